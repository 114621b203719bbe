"""HostKVTier under vLLM's own TieringOffloadingManager (built by TieringOffloadingSpec)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.manager")

import _vllm_engine as eng
from _engine_helpers import corrupt_page, run_engine

from hostkv_providers.integrations.vllm import HostKVTier


def _url(tmp_path: Path, name: str = "kv") -> str:
    return f"mmap://{tmp_path / name}?budget=64MiB&slot=64KiB"


def _tier(manager: object) -> HostKVTier:
    tiers = manager.secondary_tiers  # type: ignore[attr-defined]
    assert len(tiers) == 1 and isinstance(tiers[0], HostKVTier)
    return tiers[0]


def test_store_restart_hit_bytes_equal(tmp_path: Path) -> None:
    url = _url(tmp_path)
    out = run_engine("_vllm_engine.py", "store", url, "7", "24")  # engine 1, then it exits
    assert "stored 24" in out
    manager = eng.make_manager(eng.make_config(eng.hostkv_tier(url)))  # engine 2, a new process' state
    try:
        keys = eng.prompt_keys(7, 24)
        hits, equal = eng.load(manager, "after-restart", keys)
        assert hits == 24 and all(equal) and len(equal) == 24
        tier = _tier(manager)
        # vLLM's chain became the store's tree: each chunk's parent is the chunk before it.
        ours = [tier._keyer.key(k) for k in keys]
        infos = [tier.provider.entry(k) for k in ours]
        assert infos[0] is not None and infos[0].parent is None
        assert [i.parent for i in infos[1:] if i is not None] == ours[:-1]
        assert all(i is not None and i.salt_tag == tier.salt.tag for i in infos)
        assert tier.stats.loaded_pages == 24 and tier.stats.load_misses == 0
    finally:
        manager.shutdown()


def test_tensor_parallel_and_model_configs_are_isolated(tmp_path: Path) -> None:
    url = _url(tmp_path)
    keys = eng.prompt_keys(11, 6)
    m2 = eng.make_manager(eng.make_config(eng.hostkv_tier(url), tp_size=2))
    try:
        eng.store(m2, "tp2", keys)
        assert _tier(m2).stats.stored_pages == 6
        tag2 = _tier(m2).salt.tag
    finally:
        m2.shutdown()
    # Same prompt, same block hashes: another TP size, another KV dtype or another model never hits.
    for kwargs in ({"tp_size": 1}, {"tp_size": 2, "dtype": "float16"}, {"tp_size": 2, "model": "other/model"}):
        m = eng.make_manager(eng.make_config(eng.hostkv_tier(url), **kwargs))  # type: ignore[arg-type]
        try:
            assert _tier(m).salt.tag != tag2
            hits, _ = eng.load(m, "other", keys)
            assert hits == 0, kwargs
        finally:
            m.shutdown()
    # A namespace in the tier config separates tenants of one model.
    m = eng.make_manager(eng.make_config(eng.hostkv_tier(url, namespace="tenant-b"), tp_size=2))
    try:
        assert eng.load(m, "ns", keys)[0] == 0
    finally:
        m.shutdown()
    m = eng.make_manager(eng.make_config(eng.hostkv_tier(url), tp_size=2))
    try:
        hits, equal = eng.load(m, "same", keys)
        assert hits == 6 and all(equal)
    finally:
        m.shutdown()


def test_corrupted_page_is_a_miss_never_wrong_bytes(tmp_path: Path) -> None:
    url = _url(tmp_path)
    keys = eng.prompt_keys(3, 8)
    m = eng.make_manager(eng.make_config(eng.hostkv_tier(url)))
    try:
        eng.store(m, "s", keys)
        nbytes = eng.primary_rows(m).shape[1]
    finally:
        m.shutdown()
    assert corrupt_page(tmp_path / "kv", eng.row_bytes(keys[5], nbytes)[:256].tobytes()) == 1
    m = eng.make_manager(eng.make_config(eng.hostkv_tier(url)))
    try:
        hits, equal = eng.load(m, "after-damage", keys)
        # The damaged chunk fails its checksum: vLLM gets chunks 0-4 (bytes equal), recomputes the rest.
        assert hits == 5 and all(equal)
        tier = _tier(m)
        assert tier.stats.load_misses >= 1
        # The damaged entry and its subtree are gone from the store, not served later.
        assert tier.provider.present([tier._keyer.key(k) for k in keys]) == [True] * 5 + [False] * 3
    finally:
        m.shutdown()


def test_backpressure_drops_stores_without_blocking_and_completes_every_job(tmp_path: Path) -> None:
    # One I/O thread, one pending job, and that thread kept busy: every store vLLM cascades is
    # reported failed at once (vLLM's drop-on-pressure: it releases the rows and counts a
    # failure) and the scheduler thread never waits.
    import threading

    url = _url(tmp_path)
    m = eng.make_manager(eng.make_config(eng.hostkv_tier(url, io_threads=1, max_pending_jobs=1)))
    release = threading.Event()
    try:
        tier = _tier(m)
        tier._io.submit(release.wait)  # the adapter's only I/O thread is busy
        keys = eng.prompt_keys(5, 8)
        ctx = eng.new_request(m, "burst", keys)
        rows = eng.primary_rows(m)
        for key in keys:
            out = m.prepare_store([key], ctx)
            assert out is not None
            for k, c in zip(out.keys_to_store, np.asarray(out.store_spec.chunk_ids), strict=True):
                rows[int(c)] = eng.row_bytes(k, rows.shape[1])
            m.complete_store([key], ctx, success=True)
            eng.end_step(m)
        assert tier.stats.store_failures == 8 and tier.stats.stored_pages == 0
        m.on_request_finished(ctx)
        release.set()
        eng.settle(m)
        assert not m._jobs  # every submitted job was reported back and finalized by vLLM
        assert all(m.primary_tier._policy.get(k).ref_cnt == 0 for k in keys)  # rows released
        assert tier.provider.present([tier._keyer.key(k) for k in keys]) == [False] * 8
    finally:
        release.set()
        m.shutdown()
    # Without pressure the same tier stores everything (the next test engine sees all of it).
    m = eng.make_manager(eng.make_config(eng.hostkv_tier(url, io_threads=1, max_pending_jobs=1)))
    try:
        keys = eng.prompt_keys(6, 8)
        eng.store(m, "calm", keys, per_step=8)
        assert _tier(m).stats.stored_pages == 8
        assert eng.load(m, "check", keys) == (8, [True] * 8)
    finally:
        m.shutdown()


def test_lookup_of_a_chunk_in_flight_is_retry_then_hit(tmp_path: Path) -> None:
    # vLLM's contract: lookup returns RETRY "if the chunk is being transferred (retry later)".
    # The manager cascades real TransferJobs into the tier; while they wait in the store lane a
    # lookup of their keys is RETRY, never a MISS that would make vLLM recompute them.
    import threading

    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    m = eng.make_manager(eng.make_config(eng.hostkv_tier(_url(tmp_path))))
    release = threading.Event()
    try:
        tier = _tier(m)
        tier._io.submit(release.wait)  # hold the store lane: the cascaded jobs stay queued
        keys = eng.prompt_keys(12, 6)
        ctx = eng.new_request(m, "writer", keys)
        rows = eng.primary_rows(m)
        out = m.prepare_store(keys, ctx)
        assert out is not None
        for k, c in zip(out.keys_to_store, np.asarray(out.store_spec.chunk_ids), strict=True):
            rows[int(c)] = eng.row_bytes(k, rows.shape[1])
        m.complete_store(keys, ctx, success=True)
        eng.end_step(m, ("writer",))
        assert tier.has_pending_work()
        other = ReqContext(req_id="reader")
        assert [tier.lookup(k, other) for k in keys] == [LookupResult.RETRY] * 6
        assert tier.lookup(eng.prompt_keys(13, 1)[0], other) is LookupResult.MISS
        release.set()
        m.on_request_finished(ctx)
        eng.settle(m)
        assert [tier.lookup(k, other) for k in keys] == [LookupResult.HIT] * 6
        assert not tier._inflight
    finally:
        release.set()
        m.shutdown()


def test_async_jobs_run_off_the_scheduler_thread(tmp_path: Path) -> None:
    import threading

    url = _url(tmp_path)
    m = eng.make_manager(eng.make_config(eng.hostkv_tier(url)))
    try:
        tier = _tier(m)
        threads: set[str] = set()
        orig = tier._run_store

        def spy(*a: object) -> None:
            threads.add(threading.current_thread().name)
            orig(*a)  # type: ignore[arg-type]

        tier._run_store = spy  # type: ignore[method-assign]
        eng.store(m, "s", eng.prompt_keys(9, 4))
        assert threads and all(name.startswith("hostkv-vllm-store") for name in threads)
        assert threading.current_thread().name not in threads
    finally:
        m.shutdown()


def test_bad_tier_config_is_a_typed_error() -> None:
    from hostkv_providers.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError):
        eng.make_manager(eng.make_config({"type": "HostKVTier", "module_path": "hostkv_providers.integrations.vllm"}))
    assert np is not None


def _redis_url(tmp_path: Path) -> tuple[str, object]:
    servers = pytest.importorskip("hostkv_redis.servers")
    if servers.server_binary() is None:
        pytest.skip("redis-server is not installed (CI installs it)")
    server = servers.RedisServer(tmp_path / "redis").start()
    url = server.url
    sep = "&" if "?" in url else "?"
    return f"{url}{sep}budget=64MiB&namespace=vllm-test", server


@pytest.mark.parametrize("kind", ["lmdb", "tiered", "redis"])
def test_every_provider_url_is_a_tier(tmp_path: Path, kind: str) -> None:
    """The same tier over the other URL kinds: store, a new manager (restart), all bytes back."""
    import urllib.parse

    server = None
    if kind == "lmdb":
        url = f"lmdb://{tmp_path / 'kv'}?budget=64MiB"
    elif kind == "tiered":
        fast = urllib.parse.quote("pinned://?budget=8MiB", safe="")
        slow = urllib.parse.quote(f"lmdb://{tmp_path / 'slow'}?budget=64MiB", safe="")
        url = f"tiered://?fast={fast}&slow={slow}"
    else:
        url, server = _redis_url(tmp_path)
    try:
        keys = eng.prompt_keys(21, 12)
        m = eng.make_manager(eng.make_config(eng.hostkv_tier(url)))
        try:
            eng.store(m, "s", keys)
        finally:
            m.shutdown()
        m = eng.make_manager(eng.make_config(eng.hostkv_tier(url)))
        try:
            assert eng.load(m, "l", keys) == (12, [True] * 12)
        finally:
            m.shutdown()
    finally:
        if server is not None:
            server.stop()  # type: ignore[attr-defined]
