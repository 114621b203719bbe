"""The engine-free part of the adapters: keys under a salt, chain writes, the I/O pool."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest

import hostkv_providers as hk
from hostkv_providers.errors import InvalidArgumentError
from hostkv_providers.integrations import EngineKeyer, IOPool, engine_salt, open_store, read_pages, store_pages

LAYOUT = hk.KVLayout(num_layers=2, num_kv_heads=4, head_dim=8, page_tokens=16)


def test_importing_the_core_imports_no_engine() -> None:
    code = ("import sys, hostkv_providers, hostkv_providers.integrations; "
            "print(sorted(m for m in ('vllm', 'sglang', 'lmcache', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_engine_keys_are_deterministic_and_salted() -> None:
    a = engine_salt(engine="vllm", model_id="m", layout=LAYOUT)
    keyer = EngineKeyer(a, "vllm")
    assert keyer.key(b"h1") == EngineKeyer(engine_salt(engine="vllm", model_id="m", layout=LAYOUT), "vllm").key(b"h1")
    assert keyer.key("h1") == keyer.key(b"h1") and len(keyer.key(b"h1")) == 32
    assert keyer.keys([b"h1", "h2"]) == [keyer.key(b"h1"), keyer.key(b"h2")]
    others = [
        engine_salt(engine="vllm", model_id="m2", layout=LAYOUT),
        engine_salt(engine="vllm", model_id="m", layout=LAYOUT, namespace="n"),
        engine_salt(engine="vllm", model_id="m", layout=LAYOUT, tp_rank=1, tp_world_size=2),
        engine_salt(engine="vllm", model_id="m", layout=LAYOUT, extra={"x": 1}),
        engine_salt(engine="sglang", model_id="m", layout=LAYOUT),
    ]
    assert len({EngineKeyer(s, "vllm").key(b"h1") for s in others} | {keyer.key(b"h1")}) == 6
    # never equal to a token-chain key of the same salt (another personalization)
    assert keyer.key(b"h1") not in hk.chain_keys(a, list(range(16)))
    with pytest.raises(InvalidArgumentError):
        EngineKeyer(a, "")


def test_store_pages_links_chains_and_roots_orphans(tmp_path: Path) -> None:
    p = open_store(f"mmap://{tmp_path / 's'}?budget=8MiB&slot=4KiB")
    try:
        keyer = EngineKeyer(engine_salt(engine="t", model_id="m", layout=LAYOUT), "t")
        k = keyer.keys([b"0", b"1", b"2", b"3"])
        data = [bytes([i]) * 4096 for i in range(4)]
        assert store_pages(p, [(k[0], None, data[0]), (k[1], k[0], data[1])], salt_tag="t") == [True, True]
        # k[3]'s parent k[2] was never stored: k[3] is kept, as a root
        assert store_pages(p, [(k[3], k[2], data[3])], salt_tag="t") == [True]
        assert p.entry(k[1]).parent == k[0] and p.entry(k[3]).parent is None  # type: ignore[union-attr]
        assert store_pages(p, [(k[1], k[0], data[1])], salt_tag="t") == [True]  # dedup is success
        outs = [bytearray(4096) for _ in range(4)]
        assert read_pages(p, k, outs) == [True, True, False, True]
        assert outs[1] == data[1] and outs[3] == data[3]
    finally:
        p.close()
    with pytest.raises(InvalidArgumentError):
        open_store("not a url")


def test_io_pool_bounds_pending_jobs() -> None:
    pool = IOPool("t", threads=1, max_pending=1)
    gate = threading.Event()
    try:
        fut = pool.try_submit(gate.wait)
        assert fut is not None and pool.try_submit(lambda: None) is None and pool.pending == 1
        forced = pool.submit(lambda: 7)  # jobs the engine must see complete always queue
        gate.set()
        assert forced.result(10) == 7 and pool.drain(10) and pool.pending == 0
    finally:
        gate.set()
        pool.close()
