"""R9 on a real GPU: ``HostKVCache.restore(before=stream)`` and ``save(after=stream)`` through
the CUDA copy engine, for every provider kind (pinned: zero-copy views and direct saves; mmap and
lmdb: bounce buffers; tiered: fast tier views, then slow-tier staging after a restart;
tiered-small: a fast tier of 16 pages, so most of a save goes to heap runs, pageable buffers the
engine copies into through staging and reads serve until their write-back lands).

Each restore trial poisons the destination blocks, restores with ``before=cs`` and enqueues, on
``cs`` right after ``restore()`` returns and with no host synchronisation in between, a kernel
that compares the blocks with the expected pages and counts mismatching bytes into a device
counter.  The provider's side of the restore is slowed down (a sleep in its view/read calls), so
a stream that ran ahead would read poison; a negative control without ``before=`` shows that it
does.  Saves: a slow kernel writes the blocks on ``cs``, ``save(after=cs)`` is called at once,
``handle.wait_on(cs)``, then the blocks are overwritten on ``cs``: the stored pages must be the
first contents.
"""

from __future__ import annotations

import time
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import hostkv_providers as hk
from hostkv_providers.cache import HostKVCache
from hostkv_providers.device import CudaCopyEngine, cuda_available

torch = pytest.importorskip("torch")
if not cuda_available() or not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

pytestmark = pytest.mark.gpu

from ._pool import Pool, engine_for  # noqa: E402  (after the skips: it imports torch)

LAYOUT = hk.KVLayout(num_layers=8, num_kv_heads=8, head_dim=128, page_tokens=16, dtype="bfloat16")  # 512 KiB
SALT = hk.Salt("test/gpu-order", LAYOUT)
PAGE = LAYOUT.page_nbytes
NBLOCKS = 256
PAGES = 48
TRIALS = 100
KINDS = ["pinned", "mmap", "lmdb", "tiered", "tiered-small"]


def open_kind(kind: str, root: Path) -> hk.Provider:
    if kind == "pinned":
        return hk.open(f"pinned://?budget=128MiB&block={PAGE}&background=false")
    if kind == "mmap":
        return hk.open(f"mmap://{root}/mmap?budget=128MiB&durability=none")
    if kind == "lmdb":
        return hk.open(f"lmdb://{root}/lmdb?budget=128MiB&durability=none")
    budget = "8MiB" if kind == "tiered-small" else "128MiB"  # (16 pages: the rest of a save past it)
    fast = urllib.parse.quote(f"pinned://?budget={budget}&block={PAGE}&background=false", safe="")
    slow = urllib.parse.quote(f"mmap://{root}/slow?budget=256MiB&durability=none", safe="")
    return hk.open(f"tiered://?fast={fast}&slow={slow}")


def slowed(fn: Callable[..., Any], seconds: float) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        time.sleep(seconds)
        return fn(*args, **kwargs)

    return call


@pytest.fixture(scope="module", params=["auto", "always", "batch", "batch-split", "shared-split"])
def engine(request: pytest.FixtureRequest) -> Iterator[CudaCopyEngine]:
    """The engine with direct DMA for runs of consecutive blocks (auto, always) and for every page by
    batch copies (batch; batch-split: each call's second half issued by the side thread;
    shared-split: every page-major restore shared between batch copies and the staging path,
    saves as batch-split)."""
    with engine_for(request.param) as e:
        yield e


@pytest.mark.parametrize("kind", KINDS)
def test_restore_before_stream_never_reads_stale_blocks(kind: str, engine: CudaCopyEngine, tmp_path: Path) -> None:
    pool = Pool(LAYOUT, NBLOCKS)
    cs = torch.cuda.Stream()
    provider = open_kind(kind, tmp_path)
    src = list(range(PAGES))
    try:
        with HostKVCache(provider, SALT, engine, chunk_pages=16) as cache:
            keys = cache.keys(list(range(PAGES * LAYOUT.page_tokens)))
            pool.fill_random(src, seed=7)
            torch.cuda.synchronize()
            assert cache.save(keys, pool.planes, src).wait().stored == PAGES
            if kind.startswith("tiered"):
                provider.flush()  # type: ignore[attr-defined]
            expect = pool.gather(src)
            for name in ("views", "read_many"):
                if hasattr(provider, name):
                    setattr(provider, name, slowed(getattr(provider, name), 0.002))
            dst = list(range(PAGES, 2 * PAGES))
            counts = []
            for _trial in range(TRIALS):
                with torch.cuda.stream(cs):
                    pool.poison(dst)
                cs.synchronize()  # the poison is in place before the restore's copies start
                handle = cache.restore(cache.lookup(keys), pool.planes, dst, before=cs)
                with torch.cuda.stream(cs):  # the engine's next kernel, enqueued at once
                    counts.append(pool.mismatches(dst, expect))
                handle.wait()
            cs.synchronize()
            stale = sum(int(c.item()) > 0 for c in counts)
            assert stale == 0, f"{kind}: {stale} of {TRIALS} trials read the blocks before the restore"
            assert all(handle.wait().pages == PAGES for _ in [0])
            # negative control: without before= the same kernel runs ahead of the copies
            control = []
            for _trial in range(5):
                with torch.cuda.stream(cs):
                    pool.poison(dst)
                cs.synchronize()
                handle = cache.restore(cache.lookup(keys), pool.planes, dst)
                with torch.cuda.stream(cs):
                    control.append(pool.mismatches(dst, expect))
                handle.wait()
            cs.synchronize()
            assert sum(int(c.item()) > 0 for c in control) > 0, "the control never saw poison"
            # the handle's event orders another stream the same way
            other = torch.cuda.Stream()
            with torch.cuda.stream(cs):
                pool.poison(dst)
            cs.synchronize()
            handle = cache.restore(cache.lookup(keys), pool.planes, dst)
            handle.wait_on(other)
            with torch.cuda.stream(other):
                late = pool.mismatches(dst, expect)
            other.synchronize()
            assert int(late.item()) == 0
            assert handle.event is not None
    finally:
        provider.close()


@pytest.mark.parametrize("kind", KINDS)
def test_save_after_stream_reads_blocks_as_of_the_call(kind: str, engine: CudaCopyEngine, tmp_path: Path) -> None:
    pool = Pool(LAYOUT, NBLOCKS)
    cs = torch.cuda.Stream()
    provider = open_kind(kind, tmp_path)
    blocks = list(range(PAGES))
    first = list(range(PAGES, 2 * PAGES))
    try:
        with HostKVCache(provider, SALT, engine, chunk_pages=16) as cache:
            pool.fill_random(first, seed=11)  # the contents the save must see
            torch.cuda.synchronize()
            x = pool.gather(first)
            bad = 0
            for trial in range(20):
                keys = cache.keys([trial * 100_000 + t for t in range(PAGES * LAYOUT.page_tokens)])
                with torch.cuda.stream(cs):
                    pool.poison(blocks)
                    torch.cuda._sleep(2_000_000)  # a slow prefill ...
                    for b, src in zip(pool.bytes, x, strict=True):  # ... that writes the pages
                        b[:, torch.tensor(blocks, device="cuda")] = src
                handle = cache.save(keys, pool.planes, blocks, after=cs)
                handle.wait_on(cs)
                with torch.cuda.stream(cs):  # the blocks' next user overwrites them
                    pool.poison(blocks)
                res = handle.wait()
                assert res.stored == PAGES, res
                assert handle.copied()
                cs.synchronize()
                out = list(range(2 * PAGES, 3 * PAGES))
                assert cache.restore(cache.lookup(keys), pool.planes, out).wait().pages == PAGES
                torch.cuda.synchronize()
                bad += any(not torch.equal(a, b) for a, b in zip(pool.gather(out), x, strict=True))
            assert bad == 0, f"{kind}: {bad} of 20 saves stored other bytes than the blocks held at the call"
    finally:
        provider.close()


@pytest.mark.parametrize("gates", [True, False])
def test_a_gate_opening_never_waits_behind_another_gates_copies(monkeypatch: pytest.MonkeyPatch, gates: bool) -> None:
    """A ``restore(before=s)`` still being issued, then ``save(after=s)`` (its copies behind the
    restore's gate on ``s``) and the save's ``wait_on(s)`` (a gate opened once the save is
    issued, which here is first).  When every gate opened on one shared stream, the save's
    opening waited there for the save's copies, and the restore's opening behind it: ``s``
    never ran again (found in review, session 18).  Each opening now has a stream of its own.
    With stream gates (opt-in since session 22) and without (events once issued)."""
    pool = Pool(LAYOUT, NBLOCKS)
    pool.fill_random(list(range(PAGES + 4)), seed=5)
    torch.cuda.synchronize()  # (the engine's streams do not wait for torch's)
    prov = open_kind("pinned", Path("/nonexistent"))
    with engine_for("batch", stream_gates=gates) as eng:
        cache = HostKVCache(prov, SALT, eng, chunk_pages=8)
        try:
            keys = cache.keys(list(range(PAGES * LAYOUT.page_tokens)))
            assert cache.save(keys, pool.planes, list(range(PAGES))).wait(60).stored == PAGES
            expect = pool.gather(list(range(PAGES)))
            new = cache.keys(list(range(10**6, 10**6 + 4 * LAYOUT.page_tokens)))
            # the restore's issue slow (its gate opens late), the save's a little (its gate is
            # made before its copies are issued, and opens first)
            monkeypatch.setattr(CudaCopyEngine, "_issue_restore", slowed(CudaCopyEngine._issue_restore, 0.4))
            monkeypatch.setattr(CudaCopyEngine, "_issue_save", slowed(CudaCopyEngine._issue_save, 0.1))
            s = torch.cuda.Stream()
            dst = list(range(PAGES + 8, 2 * PAGES + 8))
            r = cache.restore(cache.lookup(keys), pool.planes, dst, before=s)
            sv = cache.save(new, pool.planes, list(range(PAGES, PAGES + 4)), after=s)
            sv.wait_on(s)
            done = torch.cuda.Event()
            done.record(s)
            deadline = time.monotonic() + 30
            while not done.query() and time.monotonic() < deadline:
                time.sleep(0.01)
            ran = done.query()
            if not ran:  # held for ever: open every gate by hand, or closing would wait for ever too
                for arr, slot, *_rest in eng._flags._busy:
                    arr[slot] = 1
            assert ran, "the stream stayed held: a gate's opening queued behind copies that wait for another gate"
            assert r.wait(60).pages == PAGES
            assert sv.wait(60).stored == 4
        finally:
            cache.close()
    prov.close()
    assert int(pool.mismatches(dst, expect)) == 0


_ONE_QUEUE = '''
import sys
sys.path.insert(0, sys.argv[1])
import torch
import hostkv_providers as hk
from hostkv_providers.cache import HostKVCache
from hostkv_providers.device import CudaCopyEngine
from _pool import Pool

layout = hk.KVLayout(num_layers=8, num_kv_heads=8, head_dim=128, page_tokens=16, dtype="bfloat16")
pool = Pool(layout, 128)
prov = hk.open(f"mmap://{sys.argv[2]}/store?budget=256MiB&durability=none")
eng = CudaCopyEngine(0, stream_gates=sys.argv[3] == "gated")
n, stale = 48, 0
with HostKVCache(prov, hk.Salt("test/one-queue", layout), eng, chunk_pages=8) as cache:
    keys = cache.keys(list(range(n * layout.page_tokens)))
    src, dst = list(range(n)), list(range(n, 2 * n))
    pool.fill_random(src, seed=3)
    torch.cuda.synchronize()
    assert cache.save(keys, pool.planes, src).wait().stored == n
    expect = pool.gather(src)
    idx = torch.tensor(dst, device="cuda")
    cs = torch.cuda.Stream()
    for trial in range(8):
        with torch.cuda.stream(cs):
            pool.poison(dst)
        cs.synchronize()
        h = cache.restore(cache.lookup(keys), pool.planes, dst, layerwise=True, before=cs if trial % 2 else None)
        rows = []
        for i in range(layout.num_layers):
            h.wait_layer_on(i, cs)
            with torch.cuda.stream(cs):
                rows.append(pool.layer_mismatches(idx, expect, range(i + 1)))
        assert h.wait().pages == n
        cs.synchronize()
        stale += sum(int(r.item()) > 0 for r in rows)
eng.close()
prov.close()
print("stale", stale, flush=True)
'''


def test_ordering_holds_and_never_hangs_on_one_hardware_queue(tmp_path: Path) -> None:
    """With every stream on one hardware queue (``CUDA_DEVICE_MAX_CONNECTIONS=1``, as some serving
    and training setups run) work runs in submission order across streams: a stream held on a
    device-visible flag before the copies that open it are issued would hold them too, for good
    (the GPU suite hung at random that way, session 22).  The default engine orders streams by
    events of copies already issued: layer-wise restores from ``mmap://`` (bounce buffers, the
    longest time between the call and the issue), ``wait_layer_on`` for every layer at once and
    ``before=``, 0 stale reads, and the process ends."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, CUDA_DEVICE_MAX_CONNECTIONS="1")
    here = str(Path(__file__).parent)
    r = subprocess.run([sys.executable, "-c", _ONE_QUEUE, here, str(tmp_path), "events"], env=env,
                       capture_output=True, text=True, timeout=240, cwd=str(Path(__file__).parents[3]))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "stale 0" in r.stdout, r.stdout
