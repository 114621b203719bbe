"""HostKVCache on the CPU copy engine: lookup/restore/save, dedup, coalescing, admission,
anchors, stats, typed errors."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from hostkv_providers import (
    ClosedError,
    InvalidArgumentError,
    KVLayout,
    PinnedProvider,
    Provider,
)
from hostkv_providers._keys import Key
from hostkv_providers.cache._cache import (
    AdmitAll,
    AllOf,
    AnchorsOnly,
    CacheHit,
    HostKVCache,
    MinDepth,
    SeenAtLeast,
)
from hostkv_providers.device import HostStream
from hostkv_providers.device._copy import CpuCopyEngine, KVPlanes
from hostkv_providers.device._hostmem import OrdinaryAllocator

from ._cache_common import (
    LAYOUT,
    NBLOCKS,
    PAGE,
    SALT,
    BatchedNoViews,
    NoViews,
    _pinned,
    make_planes,
    page_of,
    tokens,
)


@pytest.fixture
def engine() -> Iterator[CpuCopyEngine]:
    e = CpuCopyEngine()
    yield e
    e.close()



@pytest.fixture(params=["views", "staged", "batched"])
def provider(request: pytest.FixtureRequest) -> Iterator[Provider]:
    p: Provider = {"views": _pinned, "staged": lambda: NoViews(_pinned()),
                   "batched": lambda: BatchedNoViews(_pinned())}[request.param]()
    yield p
    p.close()


@pytest.fixture
def cache(provider: Provider, engine: CpuCopyEngine) -> Iterator[HostKVCache]:
    # small chunks so multi-chunk pipelining and double buffering are exercised
    c = HostKVCache(provider, SALT, engine, chunk_pages=3, staging_allocator=OrdinaryAllocator())
    yield c
    c.close()


# ------------------------------------------------------------------------------------------
# round trips
# ------------------------------------------------------------------------------------------


def test_save_lookup_restore_roundtrip(cache: HostKVCache, provider: Provider) -> None:
    src = make_planes(1)
    ks = cache.keys(tokens(4 * 10 + 3))  # a trailing partial page is not keyed
    assert len(ks) == 10
    blocks = [7, 3, 9, 1, 0, 12, 30, 31, 2, 5]
    res = cache.save(ks, src, blocks).wait(30)
    assert (res.stored, res.dedup, res.admitted, res.stopped) == (10, 0, 10, None)
    assert res.nbytes == 10 * PAGE
    # the store holds exactly the packed pages, in layout order
    for k, b in zip(ks, blocks, strict=True):
        assert provider.read_bytes(k) == page_of(src, b)
    dst = make_planes(None)
    hit = cache.lookup(ks)
    assert hit.num_pages == 10 and hit.num_tokens == 40
    into = [40, 41, 42, 43, 44, 45, 46, 47, 48, 49]
    out = cache.restore(hit, dst, into).wait(30)
    assert out.pages == 10 and out.nbytes == 10 * PAGE and out.stopped is None
    assert (out.viewed if isinstance(provider, PinnedProvider) else out.staged) == 10
    assert hit.released  # release=True by default
    for b_src, b_dst in zip(blocks, into, strict=True):
        assert page_of(dst, b_dst) == page_of(src, b_src)


@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.uint32, np.uint64])
def test_block_ids_as_numpy_arrays(cache: HostKVCache, dtype: type) -> None:
    """Block tables as 1-D integer arrays (as engines keep them) save and restore exactly what
    lists of the same ids do."""
    src = make_planes(3)
    ks = cache.keys(tokens(4 * 6, seed=int(np.dtype(dtype).itemsize)))
    blocks = np.array([5, 0, 9, 2, 63, 7], dtype=dtype)
    assert cache.save(ks, src, blocks).wait(30).stored == 6
    dst = make_planes(None)
    into = np.array([40, 12, 41, 3, 60, 1], dtype=dtype)
    assert cache.restore(cache.lookup(ks), dst, into).wait(30).pages == 6
    for b_src, b_dst in zip(blocks.tolist(), into.tolist(), strict=True):
        assert page_of(dst, b_dst) == page_of(src, b_src)


def test_partial_hit_restores_prefix_into_fewer_blocks(cache: HostKVCache) -> None:
    src = make_planes(2)
    ks = cache.keys(tokens(4 * 8))
    cache.save(ks[:5], src, list(range(5))).wait(30)
    hit = cache.lookup(ks)
    assert hit.num_pages == 5 and hit.requested == 8
    dst = make_planes(None)
    res = cache.restore(hit, KVPlanes.from_arrays(LAYOUT, dst), [10, 11, 12]).wait(30)
    assert res.pages == 3
    assert [page_of(dst, 10 + i) == page_of(src, i) for i in range(3)] == [True] * 3
    assert page_of(dst, 13) == bytes(PAGE)  # nothing written past the blocks given


def test_miss_is_an_empty_falsy_hit(cache: HostKVCache) -> None:
    hit = cache.lookup(cache.keys(tokens(12, seed=5)))
    assert not hit and hit.num_pages == 0 and hit.released
    assert cache.restore(hit, make_planes(None), []).wait(1).pages == 0  # restoring a miss is a no-op
    st = cache.stats()
    assert (st.lookups, st.hits, st.misses, st.lookup_pages) == (1, 0, 1, 3)


def test_lookup_lease_protects_hit_from_eviction(engine: CpuCopyEngine) -> None:
    prov = _pinned(pages=6)
    cache = HostKVCache(prov, SALT, engine, staging_allocator=OrdinaryAllocator())
    try:
        src = make_planes(3)
        a = cache.keys(tokens(16, seed=1))
        cache.save(a, src, [0, 1, 2, 3]).wait(30)
        hit = cache.lookup(a)
        # a second chain needs the whole budget: the leased chain must survive
        b = cache.keys(tokens(16, seed=2))
        res = cache.save(b, src, [4, 5, 6, 7]).wait(30)
        assert res.stored == 2 and res.stopped is not None and "capacity" in res.stopped
        assert prov.longest_prefix(a) == 4
        hit.release()
        res = cache.save(b, src, [4, 5, 6, 7]).wait(30)
        assert res.stored == 2 and res.dedup == 2 and res.stopped is None
        assert prov.longest_prefix(b) == 4 and cache.stats().evictions >= 2
    finally:
        cache.close()
        prov.close()


# ------------------------------------------------------------------------------------------
# dedup, forks, coalescing
# ------------------------------------------------------------------------------------------


def test_fork_stores_only_new_pages(cache: HostKVCache, provider: Provider) -> None:
    src = make_planes(4)
    base = tokens(4 * 6, seed=9)
    a = cache.keys(np.concatenate([base, tokens(8, seed=10)]))
    b = cache.keys(np.concatenate([base, tokens(12, seed=11)]))
    assert a[:6] == b[:6] and a[6] != b[6]
    assert cache.save(a, src, list(range(8))).wait(30).stored == 8
    before = provider.stats().seals
    res = cache.save(b, src, list(range(20, 29))).wait(30)
    assert (res.stored, res.dedup) == (3, 6)
    assert provider.stats().seals - before == 3
    assert res.nbytes == 3 * PAGE  # only the new pages left the device


def _count_leases(provider: Provider, monkeypatch: pytest.MonkeyPatch,
                  before: Any = None) -> list[int]:
    """Record the size of every ``provider.lease`` call from now on (``before(keys)`` runs first)."""
    calls: list[int] = []
    real = provider.lease

    def counting(keys: Any) -> Any:
        calls.append(len(keys))
        if before is not None:
            before(keys)
        return real(keys)

    monkeypatch.setattr(provider, "lease", counting)
    return calls


def test_a_stored_prefix_is_leased_as_one_run(cache: HostKVCache, provider: Provider,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A chain saved again, or a fork of a stored prefix: the stored pages are taken as one run
    with one lease, not one lease (and one GIL hand-over) per page."""
    src = make_planes(4)
    base = tokens(4 * 20, seed=21)
    a = cache.keys(base)
    b = cache.keys(np.concatenate([base, tokens(8, seed=22)]))
    assert cache.save(a, src, list(range(20))).wait(30).stored == 20
    calls = _count_leases(provider, monkeypatch)
    res = cache.save(a, src, list(range(20))).wait(30)
    assert (res.stored, res.dedup, res.stopped) == (0, 20, None)
    assert calls == [20]
    calls.clear()
    res = cache.save(b, src, list(range(30, 52))).wait(30)
    assert (res.stored, res.dedup, res.stopped) == (2, 20, None)
    assert calls[0] == 20 and len(calls) <= 3 and all(c == 1 for c in calls[1:]), calls
    hit = cache.lookup(b)
    assert hit.num_pages == 22
    dst = make_planes(0)
    assert cache.restore(hit, dst, list(range(22))).wait(30).pages == 22
    for i in range(22):  # the stored prefix from the first save's blocks, the rest from this one's
        assert page_of(dst, i) == page_of(src, i if i < 20 else 30 + i)


def test_a_stored_run_evicted_under_the_save_stops_it_there(cache: HostKVCache, provider: Provider,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Pages evicted between the save's call and its thread's lease of the stored run: the run
    ends at the first page gone, the pages before it count as stored, the new pages are not
    saved below the gap."""
    src = make_planes(4)
    base = tokens(4 * 10, seed=23)
    a = cache.keys(base)
    b = cache.keys(np.concatenate([base, tokens(12, seed=24)]))
    assert cache.save(a, src, list(range(10))).wait(30).stored == 10
    evicted = []

    def evict_tail(keys: Any) -> None:
        if len(keys) > 1 and not evicted:
            evicted.append(provider.evict([a[6]]))  # pages 6..9 (a subtree)

    _count_leases(provider, monkeypatch, evict_tail)
    res = cache.save(b, src, list(range(13))).wait(30)
    assert evicted, "the save never leased its stored run"
    assert (res.stored, res.dedup) == (0, 6)
    assert res.stopped is not None and res.stopped.startswith("page 6 "), res.stopped
    assert provider.longest_prefix(b) == 6


def test_continuation_with_parent(cache: HostKVCache, provider: Provider) -> None:
    src = make_planes(5)
    toks = tokens(4 * 6, seed=12)
    ks = cache.keys(toks)
    cache.save(ks[:2], src, [0, 1]).wait(30)
    tail = cache.keys(toks[8:], parent=ks[1], start_token=8)
    assert tail == ks[2:]
    res = cache.save(tail, src, [2, 3, 4, 5], parent=ks[1], start_page=2).wait(30)
    assert res.stored == 4 and provider.longest_prefix(ks) == 6
    with pytest.raises(InvalidArgumentError):
        cache.save(tail, src, [2, 3, 4, 5], parent=ks[1])  # start_page missing


@pytest.mark.parametrize("stored", [0, 5])
def test_identical_concurrent_saves_copy_each_page_once(provider: Provider, engine: CpuCopyEngine,
                                                        stored: int) -> None:
    # stored=5: the chain's first pages are in the store already (the claims of the rest are
    # taken at C speed, as for a new chain)
    cache = HostKVCache(provider, SALT, engine, chunk_pages=2, staging_allocator=OrdinaryAllocator())
    try:
        src = make_planes(6)
        ks = cache.keys(tokens(4 * 12, seed=13))
        if stored:
            assert cache.save(ks[:stored], src, list(range(stored))).wait(30).stored == stored
        start = threading.Barrier(4)
        handles: list[Any] = []
        lock = threading.Lock()

        def go() -> None:
            start.wait()
            h = cache.save(ks, src, list(range(12)))
            with lock:
                handles.append(h)

        threads = [threading.Thread(target=go) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        results = [h.wait(30) for h in handles]
        assert sum(r.stored for r in results) == 12 - stored
        assert sum(r.nbytes for r in results) == (12 - stored) * PAGE  # no page copied twice
        for r in results:
            assert r.stored + r.dedup + r.coalesced == 12
            assert r.dedup >= stored
        assert provider.stats().seals == 12
        st = cache.stats()
        assert st.saved_pages == 12 and st.coalesced_pages + st.dedup_pages == 36 + stored
        assert not cache._claims  # every save gave its claims back
        dst = make_planes(None)
        got = cache.restore(cache.lookup(ks), dst, list(range(12))).wait(30)
        assert got.pages == 12 and all(page_of(dst, i) == page_of(src, i) for i in range(12))
    finally:
        cache.close()


def test_lookup_waits_for_in_flight_save(cache: HostKVCache) -> None:
    src = make_planes(7)
    ks = cache.keys(tokens(4 * 30, seed=14))
    h = cache.save(ks, src, list(range(30)))
    hit = cache.lookup(ks)  # waits for the save rather than reporting a shorter prefix
    assert hit.num_pages == 30
    hit.release()
    h.wait(30)
    assert cache.lookup(ks, wait=False).num_pages == 30


def test_identical_restores_are_coalesced(provider: Provider, engine: CpuCopyEngine) -> None:
    cache = HostKVCache(provider, SALT, engine, staging_allocator=OrdinaryAllocator())
    try:
        src = make_planes(8)
        ks = cache.keys(tokens(4 * 20, seed=15))
        cache.save(ks, src, list(range(20))).wait(30)
        dst = KVPlanes.from_arrays(LAYOUT, make_planes(None))
        # Hold the restore thread pool busy so the first restore is still queued when the
        # second, identical one arrives.
        gate = threading.Event()
        cache._restore_pool.submit(gate.wait)
        cache._restore_pool.submit(gate.wait)
        hit1, hit2 = cache.lookup(ks), cache.lookup(ks)
        h1 = cache.restore(hit1, dst, list(range(20, 40)))
        h2 = cache.restore(hit2, dst, list(range(20, 40)))
        assert h1 is h2
        gate.set()
        assert h1.wait(30).pages == 20
        assert hit1.released and hit2.released
        assert cache.stats().coalesced_restores == 1
    finally:
        cache.close()


@pytest.mark.parametrize("wrapper", [NoViews, BatchedNoViews])
def test_staged_restore_stops_at_a_failed_page(engine: CpuCopyEngine, wrapper: type[NoViews]) -> None:
    prov = wrapper(_pinned())
    cache = HostKVCache(prov, SALT, engine, chunk_pages=4, staging_allocator=OrdinaryAllocator())
    try:
        src = make_planes(9)
        ks = cache.keys(tokens(4 * 10, seed=16))
        cache.save(ks, src, list(range(10))).wait(30)
        prov.fail_reads.add(ks[6])
        dst = make_planes(None)
        res = cache.restore(cache.lookup(ks), dst, list(range(10))).wait(30)
        assert res.pages == 6 and res.stopped is not None
        assert all(page_of(dst, i) == page_of(src, i) for i in range(6))
        assert page_of(dst, 6) == bytes(PAGE)
    finally:
        cache.close()
        prov.close()


def test_staged_restore_prefetches_the_next_chunk(engine: CpuCopyEngine) -> None:
    """Before reading a chunk through the bounce buffers the cache tells the provider of the
    next one, so a disk-backed provider reads it in meanwhile; the first chunk is announced
    before the bounce buffers are set up."""
    prov = BatchedNoViews(_pinned())
    asked: list[list[bytes]] = []
    prov.prefetch = lambda ks: asked.append([bytes(k) for k in ks])  # type: ignore[method-assign]
    cache = HostKVCache(prov, SALT, engine, chunk_pages=4, staging_allocator=OrdinaryAllocator())
    try:
        src = make_planes(21)
        ks = cache.keys(tokens(4 * 10, seed=22))
        cache.save(ks, src, list(range(10))).wait(30)
        dst = make_planes(None)
        assert cache.restore(cache.lookup(ks), dst, list(range(10))).wait(30).pages == 10
        assert asked == [[bytes(k) for k in ks[0:4]], [bytes(k) for k in ks[4:8]], [bytes(k) for k in ks[8:10]]]
        assert all(page_of(dst, i) == page_of(src, i) for i in range(10))
    finally:
        cache.close()
        prov.close()


# ------------------------------------------------------------------------------------------
# admission
# ------------------------------------------------------------------------------------------


def test_admission_min_depth(provider: Provider, engine: CpuCopyEngine) -> None:
    with HostKVCache(provider, SALT, engine, admission=MinDepth(5), staging_allocator=OrdinaryAllocator()) as c:
        src = make_planes(10)
        short = c.keys(tokens(16, seed=17))
        r = c.save(short, src, [0, 1, 2, 3]).wait(30)
        assert (r.admitted, r.stored) == (0, 0) and c.stats().rejected_pages == 4
        long = c.keys(tokens(24, seed=18))
        assert c.save(long, src, list(range(6))).wait(30).stored == 6


def test_admission_seen_at_least(provider: Provider, engine: CpuCopyEngine) -> None:
    with HostKVCache(provider, SALT, engine, admission=SeenAtLeast(2), staging_allocator=OrdinaryAllocator()) as c:
        src = make_planes(11)
        shared = tokens(4 * 3, seed=19)
        a = c.keys(np.concatenate([shared, tokens(8, seed=20)]))
        b = c.keys(np.concatenate([shared, tokens(8, seed=21)]))
        c.lookup(a)
        assert c.save(a, src, list(range(5))).wait(30).stored == 0  # seen once: not admitted
        c.lookup(b)  # the shared root pages have now been seen twice
        r = c.save(b, src, list(range(5))).wait(30)
        assert (r.admitted, r.stored) == (3, 3)
        assert c.seen(a[0]) == 2 and c.seen(b[4]) == 1


def test_admission_anchors_only_and_all_of(provider: Provider, engine: CpuCopyEngine) -> None:
    with HostKVCache(provider, SALT, engine, admission=AllOf(AnchorsOnly(), MinDepth(2)),
                     staging_allocator=OrdinaryAllocator()) as c:
        src = make_planes(12)
        ks = c.keys(tokens(4 * 8, seed=22))
        assert c.save(ks, src, list(range(8))).wait(30).admitted == 0  # no anchors at all
        r = c.save(ks, src, list(range(8)), anchors={4: {"ssm": b"state@4"}}).wait(30)
        assert (r.admitted, r.stored, r.anchors) == (5, 5, 1)
    assert AdmitAll().admit(type("R", (), {"keys": [b"x"] * 3})()) == 3


# ------------------------------------------------------------------------------------------
# anchors (hybrid models)
# ------------------------------------------------------------------------------------------


def test_anchor_positions(provider: Provider, engine: CpuCopyEngine) -> None:
    with HostKVCache(provider, SALT, engine, anchor_interval=4, staging_allocator=OrdinaryAllocator()) as c:
        assert c.anchor_positions(10) == [3, 7, 9]
        assert c.anchor_positions(10, checkpoints=[5]) == [3, 5, 7, 9]
        assert c.anchor_positions(6, start_page=2) == [1, 5]  # depths 4 and 8 are multiples
        assert c.anchor_positions(0) == []
        with pytest.raises(InvalidArgumentError):
            c.anchor_positions(4, checkpoints=[4])


def test_need_anchor_cuts_hit_to_deepest_anchored_page(provider: Provider, engine: CpuCopyEngine) -> None:
    with HostKVCache(provider, SALT, engine, anchor_interval=3, staging_allocator=OrdinaryAllocator()) as c:
        src = make_planes(13)
        ks = c.keys(tokens(4 * 8, seed=23))
        calls: list[int] = []

        def state(i: int) -> dict[str, bytes] | None:
            calls.append(i)
            return {"ssm": f"state@{i}".encode()} if i != 7 else None  # no state at the terminal page

        r = c.save(ks[:8], src, list(range(8)), anchors=state).wait(30)
        assert calls == [2, 5, 7] and r.anchors == 2
        hit = c.lookup(ks, need_anchor="ssm")
        assert hit.num_pages == 6 and hit.stored == 8 and hit.anchor == b"state@5"
        hit.release()
        assert c.stats().anchor_cut_pages == 2
        assert not c.lookup(ks, need_anchor="other")
        # anchors may be attached to pages that are already stored (a later checkpoint)
        r = c.save(ks, src, list(range(8)), anchors={7: {"ssm": b"state@7"}}).wait(30)
        assert (r.stored, r.dedup, r.anchors) == (0, 8, 1)
        with c.lookup(ks, need_anchor="ssm") as hit:
            assert hit.num_pages == 8 and hit.anchor == b"state@7"


def test_need_anchor_lookup_reads_no_anchor_bytes_until_asked(provider: Provider, engine: CpuCopyEngine,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    # issue 17 trap 7: the lookup (admission path) copied the anchor; now it only finds it
    with HostKVCache(provider, SALT, engine, staging_allocator=OrdinaryAllocator()) as c:
        ks = c.keys(tokens(4 * 4, seed=31))
        state = bytes(range(256)) * 64
        c.save(ks, make_planes(31), list(range(4)), anchors={3: {"ssm": state}}).wait(30)
        reads: list[bytes] = []
        real_get, real_read = provider.get_anchor, provider.read_anchor

        def counted_get(key: bytes, name: str) -> bytes | None:
            reads.append(key)
            return real_get(key, name)

        def counted_read(key: bytes, name: str, into: object) -> int | None:
            reads.append(key)
            return real_read(key, name, into)

        monkeypatch.setattr(provider, "get_anchor", counted_get)
        monkeypatch.setattr(provider, "read_anchor", counted_read)
        with c.lookup(ks, need_anchor="ssm") as hit:
            assert hit.num_pages == 4 and reads == []  # found, not read
            buf = bytearray(len(state))
            assert hit.read_anchor(buf) == len(state) and bytes(buf) == state
            assert reads and set(reads) == {ks[3]}  # (a default read_anchor reads through get_anchor)
            n = len(reads)
            assert hit.anchor == state and hit.anchor == state  # read once, then kept
            assert len(reads) == n + 1
            with pytest.raises(InvalidArgumentError):
                hit.read_anchor(bytearray(10))  # too small for the anchor
        with c.lookup(ks) as plain:
            with pytest.raises(InvalidArgumentError):
                plain.read_anchor(buf)  # no need_anchor: no anchor to read
            assert plain.anchor is None


# ------------------------------------------------------------------------------------------
# stats, prometheus, lifecycle, bad input
# ------------------------------------------------------------------------------------------


def test_stats_and_prometheus(cache: HostKVCache) -> None:
    prometheus_client = pytest.importorskip("prometheus_client")
    CollectorRegistry, generate_latest = prometheus_client.CollectorRegistry, prometheus_client.generate_latest

    src = make_planes(14)
    ks = cache.keys(tokens(4 * 5, seed=24))
    cache.save(ks, src, list(range(5))).wait(30)
    cache.restore(cache.lookup(ks), make_planes(None), list(range(5))).wait(30)
    st = cache.stats()
    assert (st.saves, st.saved_pages, st.bytes_out) == (1, 5, 5 * PAGE)
    assert (st.hits, st.hit_pages, st.hit_tokens) == (1, 5, 20)
    assert (st.restores, st.restored_pages, st.bytes_in) == (1, 5, 5 * PAGE)
    assert st.save_seconds_count == 1 and st.restore_seconds_count == 1 and st.save_seconds_sum > 0
    assert st.as_dict()["in_flight_save_pages"] == 0
    reg = CollectorRegistry()
    cache.register_prometheus(reg, labels={"model": "m"})
    text = generate_latest(reg).decode()
    assert 'hostkv_cache_hit_tokens_total{model="m"} 20.0' in text
    assert 'hostkv_cache_bytes_in_total{model="m"} 20480.0' in text
    assert "hostkv_cache_restore_seconds_count" in text


def test_bad_inputs_raise_typed_errors(cache: HostKVCache, provider: Provider, engine: CpuCopyEngine) -> None:
    src = make_planes(15)
    ks = cache.keys(tokens(8))
    with pytest.raises(InvalidArgumentError):
        cache.save(ks[0], src, [0])  # type: ignore[arg-type]  # one key, not a chain
    with pytest.raises(InvalidArgumentError):
        cache.save(ks, src, [0])  # one block id per page
    with pytest.raises(InvalidArgumentError):
        cache.save(ks, src, [0, NBLOCKS])  # outside the planes
    with pytest.raises(InvalidArgumentError):
        cache.save(ks, src[:-1], [0, 1])  # a plane missing
    with pytest.raises(InvalidArgumentError):
        cache.save([b"short"], src, [0])
    with pytest.raises(InvalidArgumentError):
        cache.save(ks, src, [0, 1], anchors={5: {"a": b"x"}})
    with pytest.raises(InvalidArgumentError):
        cache.save(ks, src, [0, 1], anchors={0: {"": b"x"}})
    with pytest.raises(InvalidArgumentError):
        cache.lookup(ks, need_anchor="")
    with pytest.raises(InvalidArgumentError):
        cache.restore(object(), src, [0])  # type: ignore[arg-type]
    cache.save(ks, src, [0, 1]).wait(30)
    hit = cache.lookup(ks)
    with pytest.raises(InvalidArgumentError):
        cache.restore(hit, src, [0, 1, 2])  # more blocks than pages
    hit.release()
    with pytest.raises(InvalidArgumentError):
        cache.restore(hit, src, [0, 1])  # released
    with pytest.raises(InvalidArgumentError):
        HostKVCache(provider, LAYOUT, engine)  # a bare layout needs model_id
    with pytest.raises(InvalidArgumentError):
        HostKVCache(provider, SALT, engine, chunk_pages=0)
    for bad in (-1, 1.5, "2"):
        with pytest.raises(InvalidArgumentError, match="save_window_bytes"):
            HostKVCache(provider, SALT, engine, save_window_bytes=bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        MinDepth(-1)
    with pytest.raises(InvalidArgumentError):
        SeenAtLeast(0)
    other = KVLayout(num_layers=1, num_kv_heads=2, head_dim=32, page_tokens=4, dtype="float32")
    with pytest.raises(InvalidArgumentError):
        cache.save(ks, KVPlanes.from_arrays(other, make_planes(1)[:2]), [0, 1])


def test_bare_layout_with_model_id_and_close(provider: Provider, engine: CpuCopyEngine) -> None:
    c = HostKVCache(provider, LAYOUT, engine, model_id="test/model")
    assert c.salt == SALT
    c.close()
    c.close()
    with pytest.raises(ClosedError):
        c.lookup([Key(bytes(32))])
    assert isinstance(CacheHit, type)


# ------------------------------------------------------------------------------------------
# batched saves (put_many): a run of pages meets another writer or the budget
# ------------------------------------------------------------------------------------------


def test_batched_save_waits_for_a_page_another_writer_has_in_flight(engine: CpuCopyEngine) -> None:
    prov = BatchedNoViews(_pinned())
    cache = HostKVCache(prov, SALT, engine, chunk_pages=8, staging_allocator=OrdinaryAllocator())
    try:
        src = make_planes(21)
        ks = cache.keys(tokens(4 * 8, seed=21))
        cache.save(ks[:3], src, list(range(3))).wait(30)
        res = prov.reserve(ks[3], ks[2], cache.page_nbytes)  # another writer holds page 3
        assert res is not None

        def other_writer() -> None:
            time.sleep(0.2)
            prov.write(res, 0, page_of(src, 3))
            prov.seal(res)

        t = threading.Thread(target=other_writer)
        t.start()
        out = cache.save(ks, src, list(range(8))).wait(30)
        t.join(30)
        assert out.stopped is None and out.dedup == 3 and out.coalesced == 1 and out.stored == 4
        assert prov.put_many_calls >= 2
        dst = make_planes(None)
        got = cache.restore(cache.lookup(ks), dst, list(range(8))).wait(30)
        assert got.pages == 8 and all(page_of(dst, i) == page_of(src, i) for i in range(8))
    finally:
        cache.close()
        prov.close()


def test_batched_save_stops_at_the_budget(engine: CpuCopyEngine) -> None:
    prov = BatchedNoViews(_pinned(pages=5))
    cache = HostKVCache(prov, SALT, engine, chunk_pages=8, staging_allocator=OrdinaryAllocator())
    try:
        src = make_planes(22)
        ks = cache.keys(tokens(4 * 8, seed=22))
        out = cache.save(ks, src, list(range(8))).wait(30)
        assert out.stored == 5 and out.stopped is not None and "capacity" in out.stopped
        assert prov.longest_prefix(ks) == 5
        dst = make_planes(None)
        got = cache.restore(cache.lookup(ks), dst, list(range(5))).wait(30)
        assert got.pages == 5 and all(page_of(dst, i) == page_of(src, i) for i in range(5))
    finally:
        cache.close()
        prov.close()


class _CountingEngine(CpuCopyEngine):
    """The CPU engine behind a slow link: each save transfer waits for 20 ms of work queued on a
    host stream before it copies.  At each save call it records how many of its earlier save
    transfers were still running."""

    def __init__(self) -> None:
        super().__init__()
        self.link = HostStream("test-link")
        self.handles: list[Any] = []
        self.running_at_issue: list[int] = []

    def save(self, planes: Any, block_ids: Any, dst: Any, *, after: Any = None) -> Any:
        self.running_at_issue.append(sum(not h.done() for h in self.handles))
        assert after is None  # (these tests save without an engine stream)
        self.link.enqueue(lambda: time.sleep(0.02))
        h = super().save(planes, block_ids, dst, after=self.link)
        self.handles.append(h)
        return h

    def close(self) -> None:
        super().close()
        self.link.close()


@pytest.mark.parametrize("window", [0, 1, 2, 3])
def test_save_window_bounds_the_chunks_in_flight(window: int) -> None:
    """``save_window_bytes`` of W chunks: a zero-copy save never has more than W chunk copies
    running (the W+1-th is issued only once the oldest is done and sealed; two at least), and
    it stores the same bytes; 0 issues every chunk at once."""
    prov = _pinned()
    eng = _CountingEngine()
    try:
        cache = HostKVCache(prov, SALT, eng, chunk_pages=2, save_window_bytes=window * 2 * PAGE)
        src = make_planes(11)
        ks = cache.keys(tokens(4 * 16, seed=11))
        blocks = list(range(16))
        res = cache.save(ks, src, blocks).wait(30)
        assert (res.stored, res.stopped) == (16, None)
        for k, b in zip(ks, blocks, strict=True):
            assert prov.read_bytes(k) == page_of(src, b)
        assert len(eng.running_at_issue) == 8  # 16 pages in chunks of 2
        if window:
            # the bound; and copies did overlap the host's sealing (the link is never left idle)
            assert 1 <= max(eng.running_at_issue) <= max(2, window) - 1
        else:
            assert max(eng.running_at_issue) >= 4  # all issued up front, 20 ms each
        out = make_planes(None)
        assert cache.restore(cache.lookup(ks), out, list(range(20, 36))).wait(30).pages == 16
        for b in range(16):
            assert page_of(out, 20 + b) == page_of(src, b)
        cache.close()
    finally:
        eng.close()
        prov.close()
