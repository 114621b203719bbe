"""HostKVStorage driven by SGLang's real HiCacheController over its real host memory pool (CPU).

The controller builds the backend through ``StorageBackendFactory`` ("dynamic"), registers its
``MHATokenToKVPoolHost``/``MLATokenToKVPoolHost`` and runs its own prefetch and backup threads;
see ``_sglang_engine`` for what stands where the scheduler and the GPU would.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

pytest.importorskip("sglang.srt.mem_cache.hicache_storage")
import _sglang_cpu

if not _sglang_cpu.prepare():
    pytest.skip("SGLang's host pool needs ./.engine-site (scripts/dev-install.sh)", allow_module_level=True)

import _sglang_engine as eng
import numpy as np
import torch
from _engine_helpers import corrupt_page, run_engine
from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
from sglang.srt.mem_cache.hicache_storage import (
    STORAGE_BATCH_SIZE,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)
from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

from hostkv_providers.errors import InvalidArgumentError
from hostkv_providers.integrations.sglang import HostKVStorage


def _url(tmp_path: Path, name: str = "kv") -> str:
    return f"mmap://{tmp_path / name}?budget=64MiB&slot=32KiB"


def _shared_url(tmp_path: Path) -> str:
    # Several engines (TP ranks) open one store at once: LMDB's many-process store.
    return f"lmdb://{tmp_path / 'shared'}?budget=64MiB"


def _ours(cc: object) -> HostKVStorage:
    inner = eng.backend_of(cc)
    assert isinstance(inner, HostKVStorage)
    return inner


def test_store_restart_hit_bytes_equal_zero_copy(tmp_path: Path) -> None:
    # A store in one process, a prefetch in another: SGLang's v1 path (batch_set_v1/batch_get_v1
    # against the registered host pool), hit query, host-pool bytes equal.
    url = _url(tmp_path)
    assert "stored 300" in run_engine("_sglang_engine.py", "store", url, "1", "300")
    cc = eng.make_engine(url)
    try:
        assert cc.page_get_func == cc._page_get_zero_copy  # the controller picked interface v1
        tokens = eng.prompt(1, 300)
        hits, loaded, equal = eng.fetch(cc, tokens)
        assert (hits, loaded) == (300 * eng.PAGE, 300 * eng.PAGE) and len(equal) == 300 and all(equal)
        inner = _ours(cc)
        assert inner.mem_pool_host is cc.mem_pool_host
        assert inner.salt.layout.page_tokens == eng.PAGE and inner.salt.layout.num_layers == eng.LAYERS
        hashes = eng.page_hashes(tokens)
        ours = inner._keyer.keys(hashes)
        infos = [inner.provider.entry(k) for k in ours]
        assert all(i is not None and i.salt_tag == inner.salt.tag for i in infos)
        # The controller's prefix_keys link its batches: the store's tree is SGLang's whole chain.
        b = STORAGE_BATCH_SIZE
        assert infos[1] is not None and infos[1].parent == ours[0]
        assert infos[b] is not None and infos[b].parent == ours[b - 1]
        assert inner.stats.orphan_roots == 0
    finally:
        eng.close(cc)


@pytest.mark.parametrize("layout", ["layer_first", "page_first_direct"])
def test_generic_interface_and_other_host_layouts(tmp_path: Path, layout: str) -> None:
    # Without interface_v1 the controller moves flat host pages through batch_set/batch_get.
    url = _url(tmp_path)
    tokens = eng.prompt(2, 40)
    cc = eng.make_engine(url, layout=layout, interface_v1=(layout != "layer_first"))
    try:
        assert eng.backup(cc, tokens) == 40 * eng.PAGE
        hits, loaded, equal = eng.fetch(cc, tokens)
        assert hits == loaded == 40 * eng.PAGE and all(equal) and len(equal) == 40
    finally:
        eng.close(cc)
    # The host layout is part of the salt: another layout's pages are another format.
    other = eng.make_engine(url, layout="page_first")
    try:
        assert eng.fetch(other, tokens)[0] == 0
    finally:
        eng.close(other)


def test_tp_ranks_are_isolated_and_mla_is_shared(tmp_path: Path) -> None:
    url = _shared_url(tmp_path)
    tokens = eng.prompt(3, 20)
    r0 = eng.make_engine(url, tp_rank=0, tp_size=2)
    r1 = eng.make_engine(url, tp_rank=1, tp_size=2)
    try:
        assert _ours(r0).salt.tag != _ours(r1).salt.tag
        assert eng.backup(r0, tokens, rank=0) == 20 * eng.PAGE
        assert eng.fetch(r1, tokens, rank=1)[0] == 0  # rank 1 never sees rank 0's heads
        assert eng.backup(r1, tokens, rank=1) == 20 * eng.PAGE
        for cc, rank in ((r0, 0), (r1, 1)):
            hits, loaded, equal = eng.fetch(cc, tokens, rank=rank)
            assert hits == loaded == 20 * eng.PAGE and all(equal)
    finally:
        eng.close(r0)
        eng.close(r1)
    # TP size, model and namespace are in the salt too.
    for kw in ({"tp_rank": 0, "tp_size": 1}, {"tp_rank": 0, "tp_size": 2, "model": "other/model"},
               {"tp_rank": 0, "tp_size": 2, "extra": {"namespace": "tenant-b"}}):
        cc = eng.make_engine(url, **kw)  # type: ignore[arg-type]
        try:
            assert eng.fetch(cc, tokens)[0] == 0, kw
        finally:
            eng.close(cc)
    # MLA KV is replicated across TP ranks: one copy, written by SGLang's writer (rank 0), read
    # by every rank.
    m0 = eng.make_engine(url, tp_rank=0, tp_size=2, mla=True)
    m1 = eng.make_engine(url, tp_rank=1, tp_size=2, mla=True)
    try:
        assert _ours(m0).salt.tag == _ours(m1).salt.tag
        # Rank 1 is no storage writer: SGLang's controller skips its backup (backup_skip), and
        # our backend would store nothing for it either (is_storage_writer).
        assert eng.backup(m1, tokens) == 0
        assert _ours(m1).batch_set_v1(eng.page_hashes(tokens)[:1], m1.mem_pool_host.alloc(eng.PAGE)) == [True]
        assert eng.fetch(m0, tokens)[0] == 0
        assert eng.backup(m0, tokens) == 20 * eng.PAGE
        hits, loaded, equal = eng.fetch(m1, tokens)
        assert hits == loaded == 20 * eng.PAGE and all(equal)
    finally:
        eng.close(m0)
        eng.close(m1)


def test_corrupted_page_is_a_miss_never_wrong_bytes(tmp_path: Path) -> None:
    url = _url(tmp_path)
    tokens = eng.prompt(4, 10)
    cc = eng.make_engine(url)
    try:
        assert eng.backup(cc, tokens) == 10 * eng.PAGE
        needle = eng.page_bytes(cc.mem_pool_host, eng.page_hashes(tokens)[6])[:256].tobytes()
    finally:
        eng.close(cc)
    assert corrupt_page(tmp_path / "kv", needle) == 1
    cc = eng.make_engine(url)
    try:
        hits, loaded, equal = eng.fetch(cc, tokens)
        # The index still lists page 6, but its read fails its checksum: the controller loads
        # the 6 pages before it, all with the stored bytes, and never page 6's.
        assert hits == 10 * eng.PAGE and loaded == 6 * eng.PAGE and len(equal) == 6 and all(equal)
        assert eng.fetch(cc, tokens)[0] == 6 * eng.PAGE  # dropped, with its subtree
        assert _ours(cc).stats.load_misses >= 1
    finally:
        eng.close(cc)


def test_backup_and_prefetch_threads_run_concurrently(tmp_path: Path) -> None:
    # The controller's backup thread stores while its prefetch threads query and load.
    cc = eng.make_engine(_url(tmp_path))
    chains = [eng.prompt(100 + i, 24) for i in range(4)]
    errors: list[BaseException] = []

    def reader() -> None:
        try:
            for _ in range(6):
                for tokens in chains:
                    hits, loaded, equal = eng.fetch(cc, tokens)
                    assert loaded <= hits and all(equal)
        except BaseException as exc:
            errors.append(exc)

    try:
        host = cc.mem_pool_host
        staged = []
        for tokens in chains:  # queue every backup at once; the backup thread drains them
            idx = host.alloc(len(tokens))
            for i, h in enumerate(eng.page_hashes(tokens)):
                host.set_from_flat_data_page(int(idx[i * eng.PAGE]),
                                             torch.from_numpy(eng.page_bytes(host, h)).view(host.dtype))
            staged.append(idx)
        t = threading.Thread(target=reader)
        t.start()
        ids = [cc.write_storage(idx, tokens, hash_value=eng.page_hashes(tokens), prefix_keys=[])
               for idx, tokens in zip(staged, chains, strict=True)]
        done = {cc.ack_backup_queue.get(timeout=eng.TIMEOUT).id for _ in ids}
        t.join(eng.TIMEOUT)
        assert not t.is_alive() and not errors, errors
        assert done == set(ids)
        for idx in staged:
            host.free(idx)
        for tokens in chains:
            hits, loaded, equal = eng.fetch(cc, tokens)
            assert hits == loaded == 24 * eng.PAGE and all(equal)
    finally:
        eng.close(cc)


def test_v2_pools_store_and_load_beside_the_kv(tmp_path: Path) -> None:
    # A second real host pool registered as a v2 pool (SGLang's draft-model KV is an MHA host
    # pool of its own): batch_set_v2 / batch_exists_v2 / batch_get_v2 keyed per pool.
    url = _url(tmp_path)
    cc = eng.make_engine(url)
    _, draft = eng.make_pools()
    try:
        inner = _ours(cc)
        inner.register_mem_host_pool_v2(draft, PoolName.DRAFT)
        tokens = eng.prompt(5, 8)
        hashes = eng.page_hashes(tokens)
        idx = draft.alloc(len(tokens))
        for i, h in enumerate(hashes):
            draft.set_from_flat_data_page(int(idx[i * eng.PAGE]),
                                          torch.from_numpy(eng.page_bytes(draft, h, 7)).view(draft.dtype))
        assert eng.backup(cc, tokens) == 8 * eng.PAGE
        res = inner.batch_set_v2([PoolTransfer(name=PoolName.DRAFT, host_indices=idx, keys=hashes)])
        assert res == {PoolName.DRAFT: [True] * 8}
        found = inner.batch_exists_v2(hashes, [PoolTransfer(name=PoolName.DRAFT, keys=hashes)])
        assert found.kv_hit_pages == 8 and found.extra_pool_hit_pages[PoolName.DRAFT] == 8
        # The draft pages are their own entries: the KV keys of the same hashes are not them.
        assert inner.batch_exists(hashes) == 8
        dst = draft.alloc(len(tokens))
        got = inner.batch_get_v2([PoolTransfer(name=PoolName.DRAFT, host_indices=dst, keys=hashes)])
        assert got == {PoolName.DRAFT: [True] * 8}
        for i, h in enumerate(hashes):
            page = draft.get_data_page(int(dst[i * eng.PAGE]), flat=True).view(torch.uint8).numpy()
            assert np.array_equal(page, eng.page_bytes(draft, h, 7))
        # A pool this backend was never given is reported absent, never guessed.
        res = inner.batch_exists_v2(hashes, [PoolTransfer(name=PoolName.MAMBA, keys=hashes[-1:])])
        assert res.kv_hit_pages == 0
    finally:
        eng.close(cc)


def test_clear_removes_only_this_configuration(tmp_path: Path) -> None:
    url = _shared_url(tmp_path)
    tokens = eng.prompt(6, 8)
    a = eng.make_engine(url)
    other = eng.make_engine(url, extra={"namespace": "other"})
    try:
        eng.backup(a, tokens)
        eng.backup(other, tokens)
        _ours(a).clear()
        assert eng.fetch(a, tokens)[0] == 0 and eng.fetch(other, tokens)[0] == 8 * eng.PAGE
    finally:
        eng.close(a)
        eng.close(other)


def test_missing_url_is_a_typed_error(tmp_path: Path) -> None:
    # The controller wraps a failed attach in its own ValueError; ours is the cause.
    with pytest.raises(ValueError) as info:
        eng.make_engine("")
    assert isinstance(info.value.__cause__, InvalidArgumentError)


def test_get_without_a_target_is_none_or_a_typed_error(tmp_path: Path) -> None:
    # HiCacheStorage.get's target is optional ("Returns None if the key does not exist"): a
    # missing page is None; a stored one has nowhere to go without a target, a typed error.
    cc = eng.make_engine(_url(tmp_path))
    try:
        inner = _ours(cc)
        tokens = eng.prompt(51, 2)
        key = eng.page_hashes(tokens)[0]
        assert inner.get(key) is None
        assert inner.batch_get([key, "absent"], [None, None]) == [None, None]
        assert eng.backup(cc, tokens) == 2 * eng.PAGE
        with pytest.raises(InvalidArgumentError):
            inner.get(key)
        with pytest.raises(InvalidArgumentError):
            inner.get(key, [0] * 4)  # not a tensor
        host = cc.mem_pool_host
        page = host.get_dummy_flat_data_page()
        assert inner.get(key, page) is page
        assert np.array_equal(page.view(torch.uint8).numpy(), eng.page_bytes(host, key))
    finally:
        eng.close(cc)


# -- v2 pools with SGLang's real MambaPoolHost -------------------------------------------------

def _mamba_host() -> MambaPoolHost:
    info = MambaStateBufferInfo(temporal=torch.zeros(2, 17, 4, 8, dtype=torch.float32),
                                conv=(torch.zeros(2, 17, 3, 8, dtype=torch.bfloat16),))
    return MambaPoolHost(info, 2.0, 0, device_capacity=16, pin_memory=False, layout="page_first")


def test_mla_mamba_state_is_per_tp_rank(tmp_path: Path) -> None:
    # An MLA model with Mamba/KDA state (Kimi-K3): the MLA KV is replicated over TP ranks, the
    # Mamba state is TP-sharded.  SGLang's HybridCacheController.should_backup sends MAMBA
    # transfers to batch_set_v2 on every rank, writer or not; each rank must read back its own.
    url = _shared_url(tmp_path)
    hashes = eng.page_hashes(eng.prompt(31, 4))
    ranks = [eng.make_engine(url, tp_rank=r, tp_size=2, mla=True) for r in (0, 1)]
    try:
        backends = [_ours(cc) for cc in ranks]
        assert backends[0].salt.tag == backends[1].salt.tag  # the KV: one shared copy
        pools, idx = [], []
        for r, inner in enumerate(backends):
            pool = _mamba_host()
            inner.register_mem_host_pool_v2(pool, PoolName.MAMBA)
            i = pool.alloc(1)
            n = pool.get_dummy_flat_data_page().numel()
            pool.set_from_flat_data_page(int(i[0]), torch.full((n,), 10 + r, dtype=torch.uint8))  # its shard
            pools.append(pool)
            idx.append(i)
        for r, inner in enumerate(backends):
            res = inner.batch_set_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=idx[r], keys=hashes[-1:])])
            assert res == {PoolName.MAMBA: [True]}
        for r, inner in enumerate(backends):
            dst = pools[r].alloc(1)
            got = inner.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=dst, keys=hashes[-1:])])
            assert got == {PoolName.MAMBA: [True]}
            page = pools[r].get_data_page(int(dst[0]), flat=True)
            assert torch.unique(page).tolist() == [10 + r], f"TP rank {r} loaded another rank's Mamba state"
    finally:
        for cc in ranks:
            eng.close(cc)


def test_mla_mha_draft_pool_is_never_read_across_tp_ranks(tmp_path: Path) -> None:
    # An MHA draft model beside an MLA target splits its heads over the TP ranks (SGLang's
    # should_backup / Mooncake key it per rank): rank 1 must never load rank 0's heads.
    url = _shared_url(tmp_path)
    hashes = eng.page_hashes(eng.prompt(32, 2))
    ranks = [eng.make_engine(url, tp_rank=r, tp_size=2, mla=True) for r in (0, 1)]
    try:
        drafts = []
        for r, cc in enumerate(ranks):
            _, draft = eng.make_pools()
            _ours(cc).register_mem_host_pool_v2(draft, PoolName.DRAFT)
            idx = draft.alloc(len(hashes) * eng.PAGE)
            for i, h in enumerate(hashes):
                draft.set_from_flat_data_page(int(idx[i * eng.PAGE]),
                                              torch.from_numpy(eng.page_bytes(draft, h, r)).view(draft.dtype))
            drafts.append((draft, idx))
        w0 = _ours(ranks[0]).batch_set_v2([PoolTransfer(name=PoolName.DRAFT, host_indices=drafts[0][1], keys=hashes)])
        assert w0 == {PoolName.DRAFT: [True, True]}
        r1, (draft1, _) = _ours(ranks[1]), drafts[1]
        dst = draft1.alloc(len(hashes) * eng.PAGE)
        assert r1.batch_get_v2([PoolTransfer(name=PoolName.DRAFT, host_indices=dst, keys=hashes)]) \
            == {PoolName.DRAFT: [False, False]}
        assert r1.batch_set_v2([PoolTransfer(name=PoolName.DRAFT, host_indices=drafts[1][1], keys=hashes)]) \
            == {PoolName.DRAFT: [True, True]}
        assert r1.batch_get_v2([PoolTransfer(name=PoolName.DRAFT, host_indices=dst, keys=hashes)]) \
            == {PoolName.DRAFT: [True, True]}
        for i, h in enumerate(hashes):
            page = draft1.get_data_page(int(dst[i * eng.PAGE]), flat=True).view(torch.uint8).numpy()
            assert np.array_equal(page, eng.page_bytes(draft1, h, 1))
    finally:
        for cc in ranks:
            eng.close(cc)


def _trailing_query(tmp_path: Path, states: dict[PoolName, list[int]], n: int) -> PoolTransferResult:
    """``n`` KV pages backed up; each pool's state checkpoint at the end of the listed pages;
    the controller's hit query (one TRAILING_PAGES transfer per pool)."""
    cc = eng.make_engine(_url(tmp_path))
    try:
        tokens = eng.prompt(41, n)
        hashes = eng.page_hashes(tokens)
        assert eng.backup(cc, tokens) == n * eng.PAGE
        inner = _ours(cc)
        for name, at in states.items():
            pool = _mamba_host()
            inner.register_mem_host_pool_v2(pool, name)
            for page in at:
                res = inner.batch_set_v2([PoolTransfer(name=name, host_indices=pool.alloc(1), keys=[hashes[page]])])
                assert res == {name: [True]}
        query = [PoolTransfer(name=name, keys=hashes[-1:], hit_policy=PoolHitPolicy.TRAILING_PAGES)
                 for name in states]
        return inner.batch_exists_v2(hashes, query)
    finally:
        eng.close(cc)


def _controller_reads(res: PoolTransferResult) -> list[int]:
    # HybridCacheController._sync_prefetch_hit_query: without restorable_prefix_pages, every
    # length 1..kv_hit_pages is taken as restorable.
    pages = res.restorable_prefix_pages
    return list(pages) if pages is not None else list(range(1, res.kv_hit_pages + 1))


def test_trailing_state_hits_are_the_restorable_lengths(tmp_path: Path) -> None:
    # Mamba checkpoints after pages 2 and 5 (indices 1 and 4): only prefixes of 2 and 5 pages
    # can be restored, as SGLang's HiCacheFile reports them.
    res = _trailing_query(tmp_path, {PoolName.MAMBA: [1, 4]}, 5)
    assert _controller_reads(res) == [2, 5]
    assert res.kv_hit_pages == 5 and res.extra_pool_hit_pages[PoolName.MAMBA] == 5


def test_two_trailing_pools_restore_only_lengths_both_have(tmp_path: Path) -> None:
    # Mamba at 5 pages, SWA at 4: no length has both states, so nothing is restorable.
    res = _trailing_query(tmp_path, {PoolName.MAMBA: [4], PoolName.SWA: [3]}, 5)
    assert _controller_reads(res) == [] and res.kv_hit_pages == 0
