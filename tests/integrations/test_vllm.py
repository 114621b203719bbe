"""HostKVTier under vLLM's own TieringOffloadingManager (built by TieringOffloadingSpec)."""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.manager")

import _vllm_engine as eng
from _engine_helpers import corrupt_page, run_engine
from vllm.v1.kv_offload.base import OffloadKey
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager

from hostkv_providers import Key
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


# -- a store job's keys in any order (vLLM completes a store with the job's keys as a set) -------

def _store_as_the_connector(m: TieringOffloadingManager, req_id: str, positions: dict[OffloadKey, int],
                            job_keys: Collection[OffloadKey]) -> None:
    """The scheduler's path of one request: the first lookup misses (get_num_new_matched_tokens),
    prepare_store of the prompt's chunks, the worker fills the rows, then complete_store with the
    job's keys as the connector passes them (``TransferJobStatus.keys = set(keys_to_store)``)."""
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    keys = list(positions)
    ctx = ReqContext(req_id=req_id)
    for key, pos in positions.items():  # RequestOffloadState.update_offload_keys
        ctx.set_offload_key_position(key, pos)
    m.on_new_request(ctx)
    assert m.lookup(keys[0], ctx) is LookupResult.MISS
    eng.end_step(m, (req_id,))
    out = m.prepare_store(keys, ctx)
    assert out is not None
    rows = eng.primary_rows(m)
    for k, c in zip(out.keys_to_store, np.asarray(out.store_spec.chunk_ids), strict=True):
        rows[int(c)] = eng.row_bytes(k, rows.shape[1])
    m.complete_store(job_keys, ctx, success=True)
    eng.end_step(m)
    m.on_request_finished(ctx)
    eng.settle(m)


def _prompt_positions(keys: list[OffloadKey]) -> dict[OffloadKey, int]:
    return {k: (i + 1) * eng.BLOCK_TOKENS for i, k in enumerate(keys)}


def _set_with_a_child_first(n: int) -> list[OffloadKey]:
    """A prompt whose keys, as a set, list chunk 1 before chunk 0 (the set's order depends on
    this process' hash seed; about one prompt in two qualifies)."""
    for seed in range(100, 300):
        keys = eng.prompt_keys(seed, n)
        order = list(set(keys))
        if order.index(keys[1]) < order.index(keys[0]):
            return keys
    raise AssertionError("no prompt of 200 lists chunk 1 before chunk 0 in a set")


@pytest.mark.parametrize("batch_pages", [256, 3])
@pytest.mark.parametrize("job_order", ["reversed", "set"])
def test_store_job_keys_in_any_order_keep_the_whole_chain(tmp_path: Path, job_order: str, batch_pages: int) -> None:
    # A child listed before its parent used to reach the provider before it: refused
    # (UnknownKeyError), with every chunk below it, and the chain was lost from chunk 1 on.
    url = _url(tmp_path)
    keys = _set_with_a_child_first(8) if job_order == "set" else eng.prompt_keys(31, 8)
    job_keys: Collection[OffloadKey] = set(keys) if job_order == "set" else list(reversed(keys))
    m = eng.make_manager(eng.make_config(eng.hostkv_tier(url, batch_pages=batch_pages)))
    try:
        _store_as_the_connector(m, "r", _prompt_positions(keys), job_keys)
        tier = _tier(m)
        ours = [tier._keyer.key(k) for k in keys]
        assert tier.provider.present(ours) == [True] * 8, tier.stats.as_dict()
        # Stored root first, each chunk under the one before it: vLLM's chain is the store's tree.
        assert _parents(tier, ours) == [None, *ours[:-1]]
        assert tier.stats.store_failures == 0 and tier.stats.orphan_roots == 0
    finally:
        m.shutdown()
    m = eng.make_manager(eng.make_config(eng.hostkv_tier(url)))  # a restart: the CPU tier is empty
    try:
        assert eng.load(m, "after-restart", keys) == (8, [True] * 8)
    finally:
        m.shutdown()


# -- KV-cache group ids (vLLM offloads only the prefix-cacheable groups) ------------------------

def _parents(tier: HostKVTier, ours: list[Key]) -> list[Key | None]:
    """Each stored entry's parent (an absent entry fails the test)."""
    infos = [tier.provider.entry(k) for k in ours]
    assert all(i is not None for i in infos), [i is not None for i in infos]
    return [i.parent for i in infos if i is not None]


def _keys_of_group(seed: int, n_blocks: int, group_id: int, every: int = 1) -> dict[OffloadKey, int]:
    """Offload keys of one KV group and their end-token positions: vLLM's chained block hashes of
    one prompt, one key per ``every`` hash blocks (a group of ``every`` x 16-token blocks)."""
    from vllm.v1.kv_offload.base import get_offload_block_hash, make_offload_key

    hashes = [get_offload_block_hash(k) for k in eng.prompt_keys(seed, n_blocks)]
    return {make_offload_key(hashes[i], group_id): (i + 1) * eng.BLOCK_TOKENS
            for i in range(every - 1, n_blocks, every)}


def _groups_config(url: str, groups: list[tuple[int, int]]) -> OffloadingConfig:
    """make_config's model with its KV groups replaced by ``(group_id, tokens_per_block)``s."""
    import dataclasses

    from vllm.v1.kv_offload.config import OffloadingGroupConfig

    cfg = eng.make_config(eng.hostkv_tier(url))
    names = cfg.groups[0].layer_names
    return dataclasses.replace(cfg, groups=tuple(
        OffloadingGroupConfig(tokens_per_block=tpb, layer_names=tuple(f"{n}.g{gid}" for n in names), group_id=gid)
        for gid, tpb in groups))


@pytest.mark.parametrize("group_id", [0, 1, 3])
def test_chain_is_the_stores_tree_whatever_the_group_id(tmp_path: Path, group_id: int) -> None:
    # The chunk stride was looked up by the group's place in config.groups instead of its id:
    # with any id past the list every chunk was stored as a root of its own.
    positions = _keys_of_group(51, 6, group_id)
    m = eng.make_manager(_groups_config(_url(tmp_path), [(group_id, eng.BLOCK_TOKENS)]))
    try:
        _store_as_the_connector(m, "s", positions, list(positions))
        tier = _tier(m)
        ours = [tier._keyer.key(k) for k in positions]
        assert _parents(tier, ours) == [None, *ours[:-1]]
        assert tier.stats.orphan_roots == 0
    finally:
        m.shutdown()


def test_groups_listed_out_of_id_order_each_get_their_own_stride(tmp_path: Path) -> None:
    # Two groups, ids 2 (16-token blocks) and 0 (32-token blocks), in that order in the config:
    # each group's chain links chunks of its own stride, one store job holding both.
    small, large = _keys_of_group(52, 8, 2), _keys_of_group(52, 8, 0, every=2)
    m = eng.make_manager(_groups_config(_url(tmp_path), [(2, 16), (0, 32)]))
    try:
        _store_as_the_connector(m, "s", {**small, **large}, set(small) | set(large))
        tier = _tier(m)
        for chain in (small, large):
            ours = [tier._keyer.key(k) for k in chain]
            assert _parents(tier, ours) == [None, *ours[:-1]]
        assert tier.stats.orphan_roots == 0 and tier.stats.store_failures == 0
    finally:
        m.shutdown()


@pytest.mark.parametrize("group_id", [0, 1])
def test_eviction_keeps_a_restorable_prefix_whatever_the_group_id(tmp_path: Path, group_id: int) -> None:
    # Room for 16 chunks: chain A (8), then chain B (12) evicts 4.  With the chain as the tree,
    # eviction takes leaves (A's last chunks) and what is left of A is a prefix vLLM can load;
    # as unrelated roots it took A's first chunks and stranded the rest.
    url = f"mmap://{tmp_path / 'kv'}?budget=1MiB&slot=64KiB"
    a, b = _keys_of_group(61, 8, group_id), _keys_of_group(62, 12, group_id)
    cfg = _groups_config(url, [(group_id, eng.BLOCK_TOKENS)])
    m = eng.make_manager(cfg)
    try:
        eng.store(m, "a", list(a))
        eng.store(m, "b", list(b))
        tier = _tier(m)
        present_a = tier.provider.present([tier._keyer.key(k) for k in a])
    finally:
        m.shutdown()
    kept = sum(present_a)
    assert 0 < kept < 8 and present_a == [True] * kept + [False] * (8 - kept)
    m = eng.make_manager(cfg)
    try:
        assert eng.load(m, "a-again", list(a)) == (kept, [True] * kept)
    finally:
        m.shutdown()


# -- a store outage never reaches vLLM's scheduler ---------------------------------------------

def test_lookup_during_a_store_outage_is_a_miss_not_an_exception(tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    import logging
    import time

    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    url, server = _redis_url(tmp_path)
    try:
        m = eng.make_manager(eng.make_config(eng.hostkv_tier(url)))
        try:
            keys = eng.prompt_keys(41, 4)
            eng.store(m, "s", keys[:2])
            tier = _tier(m)
            assert tier.lookup(keys[0], ReqContext(req_id="before")) is LookupResult.HIT
            server.stop()  # type: ignore[attr-defined]  # the Redis server goes away
            caplog.set_level(logging.WARNING, logger="hostkv_providers.integrations.vllm")
            # keys[3] was never stored: the CPU tier misses and the manager asks this tier, as
            # get_num_new_matched_tokens does; the error used to kill EngineCore from here.
            ctx = eng.new_request(m, "after-outage", keys)
            assert m.lookup(keys[3], ctx) is LookupResult.MISS
            # A stored chunk the store cannot confirm is a MISS too (vLLM recomputes it), never
            # RETRY, which would hold the request for as long as the outage lasts.
            assert tier.lookup(keys[1], ctx) is LookupResult.MISS
            warned = [r for r in caplog.records if "lookup failed" in r.getMessage()]
            assert len(warned) == 1 and "ServerUnavailableError" in warned[0].getMessage()  # rate-limited
            # For a moment after a failure the store is not asked at all (each try cost the
            # scheduler ~0.3 s of connection retries): the server back (empty, --save ""), a
            # lookup in the back-off opens no connection there, the first one after it does.
            tier._lookup_backoff_s = 0.5
            tier._lookup_quiet_until = 0.0
            assert tier.lookup(keys[1], ctx) is LookupResult.MISS  # fails, starts the back-off
            server.start()  # type: ignore[attr-defined]
            with server.client() as c:  # type: ignore[attr-defined]
                def connections() -> int:
                    return int(c.info("stats")["total_connections_received"])

                before = connections()
                assert tier.lookup(keys[1], ctx) is LookupResult.MISS
                assert connections() == before  # not asked
                time.sleep(0.6)
                assert tier.lookup(keys[1], ctx) is LookupResult.MISS  # asked: the store is empty now
                assert connections() > before
            m.on_request_finished(ctx)
        finally:
            m.shutdown()
    finally:
        server.stop()  # type: ignore[attr-defined]


def test_store_jobs_during_an_outage_count_their_failures(tmp_path: Path) -> None:
    """A whole provider call that raises (the server gone) failed the job but counted none of its
    pages in store_failures (fails before)."""
    url, server = _redis_url(tmp_path)
    try:
        m = eng.make_manager(eng.make_config(eng.hostkv_tier(url)))
        try:
            keys = eng.prompt_keys(43, 4)
            tier = _tier(m)
            server.stop()  # type: ignore[attr-defined]
            eng.store(m, "down", keys)
            assert tier.stats.store_failures == len(keys)
        finally:
            m.shutdown()
    finally:
        server.stop()  # type: ignore[attr-defined]


# -- the tier's locality (a request's kv_load_tiers filter) --------------------------------------

def test_tier_locality_from_the_config_filters_requests(tmp_path: Path) -> None:
    from vllm.v1.kv_offload.base import Locality, LookupResult, ReqContext, TierFilter, TierMatcher

    url = _url(tmp_path)
    keys = eng.prompt_keys(71, 4)
    m = eng.make_manager(eng.make_config(eng.hostkv_tier(url)))
    try:
        eng.store(m, "s", keys)
        assert _tier(m).locality is None  # no locality: every filter matches, as for vLLM's tiers
    finally:
        m.shutdown()
    for locality, served in (("REMOTE", False), ("LOCAL", True)):
        m = eng.make_manager(eng.make_config(eng.hostkv_tier(url, locality=locality)))
        try:
            assert _tier(m).locality is Locality(locality)
            # What the connector builds for kv_transfer_params {"kv_load_tiers": [{"locality": "local"}]}.
            ctx = ReqContext(req_id="local-only",
                             load_tier_filter=TierFilter(matchers=(TierMatcher(locality=Locality.LOCAL),)))
            for i, k in enumerate(keys):
                ctx.set_offload_key_position(k, (i + 1) * eng.BLOCK_TOKENS)
            m.on_new_request(ctx)
            result = m.lookup(keys[0], ctx)
            eng.end_step(m, ("local-only",))
            m.on_request_finished(ctx)
            eng.settle(m)
            # A REMOTE tier is skipped (MISS); a LOCAL one starts the promotion.
            assert result is (LookupResult.HIT_PENDING if served else LookupResult.MISS), (locality, result)
        finally:
            m.shutdown()


def test_bad_locality_is_a_typed_error(tmp_path: Path) -> None:
    from hostkv_providers.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="locality"):
        # (shut down if it was accepted, so a failing run leaves no shared region behind)
        eng.make_manager(eng.make_config(eng.hostkv_tier(_url(tmp_path), locality="nearby"))).shutdown()


# -- the salt across tensor-parallel sizes -------------------------------------------------------

def _agnostic_config(url: str, tp: int, **changes: Any) -> OffloadingConfig:
    """A TP=``tp`` engine of one model whose KV heads vLLM shards (one worker holds 1/tp of the
    heads) and whose bytes vLLM certifies as parallelism-agnostic."""
    import dataclasses

    cfg = eng.make_config(eng.hostkv_tier(url), tp_size=tp, worker_block_bytes=eng.WORKER_BLOCK_BYTES * 2 // tp)
    parallel = dataclasses.replace(cfg.parallel, is_parallelism_agnostic=True)
    return dataclasses.replace(cfg, **{"parallel": parallel, **changes})


def test_tp2_and_tp4_share_pages_when_vllm_certifies_the_bytes(tmp_path: Path) -> None:
    # The salt kept one worker's KV bytes, which halve when TP doubles: the engines never met.
    url = _url(tmp_path)
    keys = eng.prompt_keys(81, 4)
    m2 = eng.make_manager(_agnostic_config(url, 2))
    try:
        eng.store(m2, "tp2", keys)
        tag2, row2 = _tier(m2).salt.tag, eng.primary_rows(m2).shape[1]
    finally:
        m2.shutdown()
    m4 = eng.make_manager(_agnostic_config(url, 4))
    try:
        assert eng.primary_rows(m4).shape[1] == row2 and _tier(m4).salt.tag == tag2
        assert eng.load(m4, "tp4", keys) == (4, [True] * 4)
    finally:
        m4.shutdown()


def _salt_tag(cfg: OffloadingConfig, row_nbytes: int | None = None) -> str:
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    from hostkv_providers.integrations.vllm import salt_from_offloading_config

    if row_nbytes is None:  # the primary row vLLM would allocate for this config
        row_nbytes = int(TieringOffloadingSpec(cfg).kv_bytes_per_chunk)
    return salt_from_offloading_config(cfg, row_nbytes).tag


def test_salt_of_engines_vllm_does_not_certify_is_unchanged() -> None:
    # Stored keys of every engine without vLLM's certification stay valid: these tags were
    # computed before the parallelism-agnostic salt changed (the TP=2 one is in docs/engines/vllm.md).
    url = "mmap:///unused"
    assert _salt_tag(eng.make_config(eng.hostkv_tier(url), tp_size=1), 32768) == "7510d7108e01457a"
    assert _salt_tag(eng.make_config(eng.hostkv_tier(url), tp_size=2), 65536) == "9357c48c2b66e7e2"


def test_certified_salt_never_joins_rows_that_differ() -> None:
    import dataclasses

    url = "mmap:///unused"
    tp2 = _agnostic_config(url, 2)
    base = _salt_tag(tp2)
    assert _salt_tag(_agnostic_config(url, 4)) == base  # the sharing itself
    # The same engine without the certification (e.g. another model runner's layout).
    assert _salt_tag(dataclasses.replace(tp2, parallel=dataclasses.replace(
        tp2.parallel, is_parallelism_agnostic=False))) != base
    # Rows of one stride whose KV bytes end elsewhere (the rest is vLLM's alignment padding).
    short = _agnostic_config(url, 2, worker_kv_bytes_per_block=eng.WORKER_BLOCK_BYTES - 1024)
    assert _salt_tag(short) != base and _salt_tag(short, 65536) != _salt_tag(tp2, 65536)
    # Pipeline stages split the layers, not the heads: rank order is not the TP=2 order.
    pp2 = _agnostic_config(url, 2, worker_kv_bytes_per_block=eng.WORKER_BLOCK_BYTES // 2,
                           parallel=dataclasses.replace(tp2.parallel, pp_size=2, world_size=4))
    assert _salt_tag(pp2) != base
    # Two blocks per chunk: each worker's cell holds its slice of both blocks, so the row's bytes
    # interleave per TP size -- unless the canonical layout makes the page topology-free.
    two = dataclasses.replace(tp2.cache, blocks_per_chunk=2)
    direct = {tp: _salt_tag(_agnostic_config(url, tp, cache=two)) for tp in (2, 4)}
    canonical = {tp: _salt_tag(_agnostic_config(url, tp, cache=two, canonical_layout=True, kv_cache_layout="HND"))
                 for tp in (2, 4)}
    assert direct[2] != direct[4] and canonical[2] == canonical[4]
