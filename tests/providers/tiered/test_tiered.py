"""The tiered provider: the conformance suite (pinned over pinned; pinned over lmdb with reopen)
and tiered behaviour: write-back parent before child, promotion, restart, bounded queue, URL,
write-through when the fast tier is full, HostKVCache over it."""

from __future__ import annotations

import contextlib
import threading
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import hostkv_providers as hk
import hostkv_providers.providers.tiered._writeback as tiered_wb
from hostkv_providers import CapacityError, InvalidArgumentError, PinnedProvider, Provider
from hostkv_providers._keys import Key
from hostkv_providers._reservation import Reservation
from hostkv_providers.cache._cache import HostKVCache
from hostkv_providers.device._copy import CpuCopyEngine
from hostkv_providers.device._hostmem import OrdinaryAllocator
from hostkv_providers.providers.pinned._run import _PinnedRun
from hostkv_providers.providers.tiered._provider import TieredProvider
from hostkv_providers.testing import ProviderTests
from hostkv_providers.testing._pages import chain, key_of, page_bytes, put_chain

PAGE = 4096


def _lmdb_available() -> bool:
    return any(p.name == "lmdb" and p.error is None for p in hk.available_providers())


needs_lmdb = pytest.mark.skipif(not _lmdb_available(), reason="the lmdb provider is not installed")


def _pinned(budget: int) -> PinnedProvider:
    return PinnedProvider(budget, block=PAGE, allocator=OrdinaryAllocator())


def _lmdb(path: Path, budget: int) -> Provider:
    return hk.open(f"lmdb://{path}?budget={budget}")


class TestTieredOverPinnedConformance(ProviderTests):
    """Both tiers in memory (the slow one a second pinned arena): no reopen."""
    backdoors_exempt = "composite: the tiers' own suites check their media through their backdoors"

    def make_provider(self, tmp_path: Path, budget_bytes: int) -> Provider:
        # the slow tier holds the whole budget plus anchors; the fast one is as large
        return TieredProvider(_pinned(budget_bytes), _pinned(2 * budget_bytes), budget_bytes=budget_bytes)


class TestTieredSmallFastConformance(ProviderTests):
    """A fast tier of 2 pages over an in-memory slow tier: most chain runs go past it, into
    ordinary buffers queued behind the write-back (heap runs), so the contract holds there."""
    backdoors_exempt = "composite: the tiers' own suites check their media through their backdoors"

    def make_provider(self, tmp_path: Path, budget_bytes: int) -> Provider:
        return TieredProvider(_pinned(2 * PAGE), _pinned(2 * budget_bytes), budget_bytes=budget_bytes)

    # (the suite's view tests want a page just stored to be viewable: here it may be larger than
    # the fast tier, or past it, and a page the fast tier does not hold is read, not viewed)
    def test_views(self, provider: Provider) -> None:
        pytest.skip("view() is None for a page the 2-page fast tier does not hold (docs/providers/tiered.md)")

    def test_batch_views(self, provider: Provider) -> None:
        pytest.skip("views() are None for pages the 2-page fast tier does not hold (docs/providers/tiered.md)")


class TestTieredMmapFastConformance(ProviderTests):
    """An mmap:// fast tier (no reserve_many of its own: its chain reservations are the base
    class's deferred ones, which the tiered store writes, seals and aborts through their own
    verbs) over an in-memory slow tier."""
    backdoors_exempt = "composite: the tiers' own suites check their media through their backdoors"

    def make_provider(self, tmp_path: Path, budget_bytes: int) -> Provider:
        fast = hk.open(f"mmap://{tmp_path}/fast?budget={2 * budget_bytes}&slot=4KiB&durability=none")
        return TieredProvider(fast, _pinned(2 * budget_bytes), budget_bytes=budget_bytes)

    # (mmap:// serves no zero-copy views: a page the tiered store holds is read, not viewed)
    def test_views(self, provider: Provider) -> None:
        pytest.skip("an mmap:// fast tier offers no views (docs/providers/tiered.md)")

    def test_batch_views(self, provider: Provider) -> None:
        pytest.skip("an mmap:// fast tier offers no views (docs/providers/tiered.md)")


def test_put_many_and_chain_reservations_over_a_fast_tier_without_reserve_many(tmp_path: Path) -> None:
    """put_many of a chain, and reserve_many + write + seal_many/seal/abort, over an mmap://
    fast tier: its deferred reservations were written through the fast tier's write(), which
    refuses them (ReservationError), so every chain of two pages or more failed."""
    fast = hk.open(f"mmap://{tmp_path}/fast?budget={64 * PAGE}&slot=4KiB&durability=none")
    slow = hk.open(f"mmap://{tmp_path}/slow?budget={512 * PAGE}&slot=4KiB&durability=none")
    t = TieredProvider(fast, slow, budget_bytes=256 * PAGE)
    try:
        keys = chain("mmap-fast", 12)
        assert t.put_many([(k, keys[i - 1] if i else None, page_bytes(k, PAGE)) for i, k in enumerate(keys[:4])]) \
            == [True] * 4
        rc = t.reserve_many(keys[4:8], keys[3:7], PAGE)
        for k, r in zip(keys[4:8], rc.reservations, strict=True):
            assert r is not None
            r.write(0, page_bytes(k, PAGE))
        rc.seal()
        rc = t.reserve_many(keys[8:], keys[7:11], PAGE)
        rs = list(rc.reservations)
        assert all(r is not None for r in rs)
        rs[0].write(0, page_bytes(keys[8], PAGE))
        rs[0].seal()  # one page alone
        for r in rs[1:]:
            r.abort()
        assert t.present(keys) == [True] * 9 + [False] * 3
        assert t.flush(60)
        assert t.slow.longest_prefix(keys) == 9
        assert all(t.read_bytes(k) == page_bytes(k, PAGE) for k in keys[:9])
        assert t.stats().in_flight == 0
    finally:
        t.close()


@needs_lmdb
class TestTieredOverLmdbConformance(ProviderTests):
    """Pinned over lmdb: the slow tier survives close/reopen, the fast one starts empty."""
    backdoors_exempt = "composite: the tiers' own suites check their media through their backdoors"

    supports_reopen = True
    stateful_examples = 10

    def make_provider(self, tmp_path: Path, budget_bytes: int) -> Provider:
        p = TieredProvider(_pinned(budget_bytes), _lmdb(tmp_path / "slow", 2 * budget_bytes),
                           budget_bytes=budget_bytes)
        p._test_where = (tmp_path, budget_bytes)  # type: ignore[attr-defined]
        return p

    def reopen(self, provider: Provider) -> Provider:
        tmp_path, budget = provider._test_where  # type: ignore[attr-defined]
        provider.close()
        return self.make_provider(tmp_path, budget)


# ------------------------------------------------------------------------------------------
# tiered behaviour
# ------------------------------------------------------------------------------------------


@pytest.fixture
def tiered(tmp_path: Path) -> Iterator[TieredProvider]:
    slow: Provider = _lmdb(tmp_path / "slow", 256 * PAGE) if _lmdb_available() else _pinned(256 * PAGE)
    t = TieredProvider(_pinned(64 * PAGE), slow, budget_bytes=128 * PAGE)
    yield t
    t.close()


def test_saves_land_fast_and_are_written_back_in_order(tiered: TieredProvider) -> None:
    keys = chain("wb", 20)
    put_chain(tiered, keys, PAGE)
    assert tiered.fast.present(keys) == [True] * 20
    assert tiered.flush(60)
    assert tiered.slow.present(keys) == [True] * 20  # parent-before-child: nothing refused
    for k in keys:
        assert tiered.slow.read_bytes(k) == page_bytes(k, PAGE)
    st = tiered.stats()
    assert st.extra["pending_write_back"] == 0 and st.extra["write_backs"] == 20
    assert st.extra["write_back_failures"] == 0


def test_anchors_follow_their_page_to_the_slow_tier(tiered: TieredProvider) -> None:
    keys = chain("anch", 3)
    put_chain(tiered, keys, PAGE)
    tiered.put_anchor(keys[2], "ssm", b"v1")
    tiered.put_anchor(keys[2], "ssm", b"v2")  # the later blob wins in both tiers
    assert tiered.get_anchor(keys[2], "ssm") == b"v2"
    tiered.flush()
    assert tiered.slow.get_anchor(keys[2], "ssm") == b"v2"
    assert tiered.get_anchor(keys[2], "ssm") == b"v2"
    assert tiered.deepest_anchor(keys, "ssm") == 3


def test_eviction_reaches_both_tiers(tiered: TieredProvider) -> None:
    keys = chain("ev", 6)
    put_chain(tiered, keys, PAGE)
    tiered.flush()
    report = tiered.evict([keys[3]])
    assert report.entries == 3
    assert tiered.present(keys) == [True] * 3 + [False] * 3
    assert tiered.fast.present(keys[3:]) == [False] * 3
    assert tiered.slow.present(keys[3:]) == [False] * 3


def test_budget_pressure_evicts_lru_from_both_tiers(tmp_path: Path) -> None:
    t = TieredProvider(_pinned(16 * PAGE), _pinned(16 * PAGE), budget_bytes=8 * PAGE)
    try:
        roots = [key_of(f"lru-{i}") for i in range(12)]
        for k in roots:
            t.put(k, None, page_bytes(k, PAGE))
        assert t.present(roots) == [False] * 4 + [True] * 8
        t.flush()
        assert t.slow.present(roots[:4]) == [False] * 4
        assert t.stats().used_bytes <= 8 * PAGE
    finally:
        t.close()


@needs_lmdb
def test_restart_keeps_the_slow_tier_and_promotes_hits(tmp_path: Path) -> None:
    keys = chain("restart", 8)
    t = TieredProvider(_pinned(64 * PAGE), _lmdb(tmp_path / "s", 64 * PAGE))
    put_chain(t, keys, PAGE)
    t.put_anchor(keys[7], "ssm", b"state")
    t.close()  # flushes the write-back queue
    t2 = TieredProvider(_pinned(64 * PAGE), _lmdb(tmp_path / "s", 64 * PAGE))
    try:
        assert t2.longest_prefix(keys) == 8 and t2.get_anchor(keys[7], "ssm") == b"state"
        assert t2.fast.present(keys) == [False] * 8
        with t2.lease(keys) as lease:
            assert t2.view(lease, keys[0]) is None  # only the slow tier has it: read it
        for k in keys:  # a restore reads root first; each read promotes
            assert t2.read_bytes(k) == page_bytes(k, PAGE)
        assert t2.fast.present(keys) == [True] * 8
        st = t2.stats()
        assert st.extra["promotions"] == 8 and st.extra["slow_hits"] == 8
        with t2.lease(keys) as lease:
            regions = t2.view(lease, keys[3])
            assert regions is not None and b"".join(bytes(r.view) for r in regions) == page_bytes(keys[3], PAGE)
        # a new page under a promoted parent lands in the fast tier
        child = key_of("restart-child")
        t2.put(child, keys[7], page_bytes(child, PAGE))
        assert t2.fast.present([child]) == [True]
    finally:
        t2.close()


@needs_lmdb
def test_read_many_after_restart_reads_the_slow_tier_once_and_promotes(tmp_path: Path) -> None:
    keys = chain("restart-many", 8)
    t = TieredProvider(_pinned(64 * PAGE), _lmdb(tmp_path / "s", 64 * PAGE))
    put_chain(t, keys, PAGE)
    t.close()
    t2 = TieredProvider(_pinned(64 * PAGE), _lmdb(tmp_path / "s", 64 * PAGE))
    try:
        t2.read_many(keys[:2], [bytearray(PAGE), bytearray(PAGE)])  # the first two, promoted
        outs = [bytearray(PAGE) for _ in range(9)]
        got = t2.read_many([*keys, key_of("restart-many-miss")], outs)
        assert got == [True] * 8 + [False]
        assert [bytes(o) for o in outs[:8]] == [page_bytes(k, PAGE) for k in keys]
        st = t2.stats()
        assert st.extra["fast_hits"] == 2 and st.extra["slow_hits"] == 8
        assert st.extra["promotions"] == 8 and t2.fast.present(keys) == [True] * 8
        # now a restore's views find every page in the fast tier
        with t2.lease(keys) as lease:
            assert all(v is not None for v in t2.views(lease, keys))
    finally:
        t2.close()


@needs_lmdb
def test_read_many_drops_a_page_corrupt_in_the_slow_tier(tmp_path: Path) -> None:
    keys = chain("restart-corrupt", 4)
    t = TieredProvider(_pinned(64 * PAGE), _lmdb(tmp_path / "s", 64 * PAGE))
    put_chain(t, keys, PAGE)
    t.close()
    slow = _lmdb(tmp_path / "s", 64 * PAGE)
    # flip a byte of keys[2]'s page in the slow store's data file (the page bytes are unique)
    slow.close()
    needle = page_bytes(keys[2], PAGE)[:64]
    hits = 0
    for f in (tmp_path / "s").rglob("*"):
        if f.is_file():
            raw = bytearray(f.read_bytes())
            at = raw.find(needle)
            if at >= 0:
                raw[at + 7] ^= 0x40
                f.write_bytes(bytes(raw))
                hits += 1
    assert hits == 1
    t2 = TieredProvider(_pinned(64 * PAGE), _lmdb(tmp_path / "s", 64 * PAGE))
    try:
        outs = [bytearray(PAGE) for _ in range(4)]
        got = t2.read_many(keys, outs)
        assert got[:2] == [True, True] and got[2] is False
        assert [bytes(o) for o in outs[:2]] == [page_bytes(k, PAGE) for k in keys[:2]]
        assert t2.present(keys) == [True, True, False, False]  # dropped with its subtree
        assert t2.stats().checksum_failures >= 1
    finally:
        t2.close()


def test_fast_tier_full_writes_through(tmp_path: Path) -> None:
    # the fast tier holds two pages; leases pin them, so the third page goes straight to slow
    t = TieredProvider(_pinned(2 * PAGE), _pinned(32 * PAGE), budget_bytes=16 * PAGE)
    try:
        a, b, c = key_of("wt-a"), key_of("wt-b"), key_of("wt-c")
        t.put(a, None, page_bytes(a, PAGE))
        t.put(b, None, page_bytes(b, PAGE))
        with t.lease([a, b]):
            t.put(c, None, page_bytes(c, PAGE))
            assert t.stats().extra["write_through"] == 1
            assert t.slow.read_bytes(c) == page_bytes(c, PAGE)
            assert t.read_bytes(c) == page_bytes(c, PAGE)
        with pytest.raises(CapacityError):
            t.reserve(key_of("wt-huge"), None, 17 * PAGE)
    finally:
        t.close()


def test_bounded_queue_of_one(tmp_path: Path) -> None:
    t = TieredProvider(_pinned(64 * PAGE), _pinned(64 * PAGE), queue_pages=1)
    try:
        keys = chain("q1", 30)
        put_chain(t, keys, PAGE)  # each seal waits for the previous write-back
        t.flush()
        assert t.slow.present(keys) == [True] * 30
    finally:
        t.close()


@needs_lmdb
def test_from_url(tmp_path: Path) -> None:
    fast = urllib.parse.quote(f"pinned://?budget={64 * PAGE}&block={PAGE}&pin=no", safe="")
    slow = urllib.parse.quote(f"lmdb://{tmp_path / 'u'}?budget={64 * PAGE}", safe="")
    p = hk.open(f"tiered://?fast={fast}&slow={slow}&queue=8")
    try:
        assert isinstance(p, TieredProvider) and p.budget_bytes == 64 * PAGE
        assert p.fast.name == "pinned" and p.slow.name == "lmdb"
        k = key_of("url")
        p.put(k, None, page_bytes(k, PAGE))
        assert p.read_bytes(k) == page_bytes(k, PAGE)
        assert p.describe()["queue"] == 8
    finally:
        p.close()
    for bad in ("tiered://", f"tiered://?fast={fast}", f"tiered:///path?fast={fast}&slow={slow}",
                f"tiered://?fast={fast}&slow={slow}&bogus=1",
                f"tiered://?fast={fast}&slow=" + urllib.parse.quote("tiered://?x=1", safe="")):
        with pytest.raises(InvalidArgumentError):
            hk.open(bad)


def test_bad_construction() -> None:
    a = _pinned(8 * PAGE)
    try:
        with pytest.raises(InvalidArgumentError):
            TieredProvider(a, a)
        with pytest.raises(InvalidArgumentError):
            TieredProvider(a, _pinned(8 * PAGE), budget_bytes=16 * PAGE)  # larger than the slow tier
        with pytest.raises(InvalidArgumentError):
            TieredProvider(a, _pinned(8 * PAGE), queue_pages=0)
    finally:
        a.close()


def test_host_kv_cache_over_tiered(tiered: TieredProvider) -> None:
    layout = hk.KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, page_tokens=4, dtype="float32")
    salt = hk.Salt("tiered/model", layout)
    rng = np.random.default_rng(0)
    shape = (40, 4, 2, 32)
    src = [rng.standard_normal(shape, dtype=np.float32) for _ in layout.planes]
    dst = [np.zeros(shape, np.float32) for _ in layout.planes]
    engine = CpuCopyEngine()
    try:
        with HostKVCache(tiered, salt, engine, chunk_pages=4, staging_allocator=OrdinaryAllocator()) as cache:
            ks = cache.keys(rng.integers(0, 1000, 4 * 20))
            assert cache.save(ks, src, list(range(20))).wait(30).stored == 20
            res = cache.restore(cache.lookup(ks), dst, list(range(20, 40))).wait(30)
            assert res.pages == 20 and res.viewed == 20  # straight from the fast tier
            for p_src, p_dst in zip(src, dst, strict=True):
                assert np.array_equal(p_src[:20], p_dst[20:40])
            tiered.flush()
            assert tiered.slow.longest_prefix(ks) == 20
    finally:
        engine.close()


def test_view_pages_come_from_the_fast_tier(tiered: TieredProvider) -> None:
    """``view_pages`` gives the fast tier's pages as one address array (a restore's chunk path:
    no object per page), and ``None`` when a page of the request is only in the slow tier."""
    import ctypes

    keys = chain("tiered-view-pages", 20)
    put_chain(tiered, keys, PAGE)
    assert tiered.flush(60)
    assert tiered.fast.evict(keys[15:16]).entries == 5  # pages 15.. now only in the slow tier
    with tiered.lease(keys) as lease:
        pages = tiered.view_pages(lease, keys[:15])
        assert pages is not None and len(pages) == 15 and pages.readonly and pages.page_nbytes == PAGE
        got = [ctypes.string_at(a, PAGE) for a in pages.addresses.tolist()]
        assert got == [page_bytes(k, PAGE) for k in keys[:15]]
        assert tiered.view_pages(lease, keys) is None  # (5 pages only in the slow tier)
        assert tiered.view_pages(lease, keys[3:9]) is not None
    with pytest.raises(InvalidArgumentError):
        tiered.view_pages(lease, keys[:15])  # a released lease
    with tiered.fast.lease(keys[:15]) as other, pytest.raises(InvalidArgumentError):
        tiered.view_pages(other, keys[:15])  # another provider's lease


def test_view_pages_keep_the_tiered_lease_alive(tiered: TieredProvider) -> None:
    """The pages ``view_pages`` gives keep the tiered lease (and so the fast tier's) alive: a
    caller that keeps only the pages still has them held in the fast tier."""
    import gc
    import warnings

    keys = chain("tiered-view-keepalive", 12)
    put_chain(tiered, keys, PAGE)
    assert tiered.flush(60)
    pages = tiered.view_pages(tiered.lease(keys), keys)  # the lease kept only through the pages
    assert pages is not None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()
    assert tiered.fast.evict(keys[-1:]).entries == 0  # still held
    del pages
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()
    assert tiered.fast.evict(keys[-1:]).entries == 1


def test_a_restore_from_tiered_views_the_fast_tier_and_reads_the_rest(tiered: TieredProvider) -> None:
    """Through the cache: the pages the fast tier holds are copied from its views (the chunk
    path), those only in the slow tier are read (and promoted); the bytes are the saved ones."""
    layout = hk.KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, page_tokens=4, dtype="float32")
    salt = hk.Salt("tiered/views", layout)
    rng = np.random.default_rng(1)
    shape = (48, 4, 2, 32)
    src = [rng.standard_normal(shape, dtype=np.float32) for _ in layout.planes]
    engine = CpuCopyEngine()
    try:
        with HostKVCache(tiered, salt, engine, chunk_pages=8, staging_allocator=OrdinaryAllocator()) as cache:
            ks = cache.keys(rng.integers(0, 1000, 4 * 24))
            assert cache.save(ks, src, list(range(24))).wait(30).stored == 24
            for evict_from in (24, 12):  # all in the fast tier; then pages 12.. only in the slow tier
                assert tiered.flush(60)
                if evict_from < 24:
                    with cache.lookup(ks) as hit:
                        page_keys = list(hit.keys)
                    # (the fast tier keeps each saved chunk as a tree of its own: evict each page)
                    assert tiered.fast.evict(page_keys[evict_from:]).entries == 24 - evict_from
                dst = [np.zeros(shape, np.float32) for _ in layout.planes]
                res = cache.restore(cache.lookup(ks), dst, list(range(24, 48))).wait(30)
                # (chunk by chunk: a chunk of 8 partly in the fast tier is read whole)
                assert res.pages == 24 and res.viewed == evict_from // 8 * 8 and res.staged == 24 - res.viewed
                for p_src, p_dst in zip(src, dst, strict=True):
                    assert np.array_equal(p_src[:24], p_dst[24:48])
    finally:
        engine.close()


def test_a_restore_after_a_restart_hints_every_chunk_before_reading_it(tmp_path: Path) -> None:
    """After a restart the fast tier is empty: every chunk of a restore falls back from views to
    reads of the slow tier.  Each chunk is hinted to the slow tier (``prefetch``) before it is
    read, the first one too (it was read cold without a hint: 2-6x slower per chunk on the CPU
    machine), and the bytes are the saved ones."""
    layout = hk.KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, page_tokens=4, dtype="float32")
    salt = hk.Salt("tiered/restart-hints", layout)
    rng = np.random.default_rng(2)
    shape = (64, 4, 2, 32)
    src = [rng.standard_normal(shape, dtype=np.float32) for _ in layout.planes]

    def open_tiered() -> TieredProvider:
        return TieredProvider(_pinned(64 * PAGE), _open_slow("mmap", tmp_path / "slow", 128 * PAGE))

    engine = CpuCopyEngine()
    try:
        t = open_tiered()
        with HostKVCache(t, salt, engine, chunk_pages=8, staging_allocator=OrdinaryAllocator()) as cache:
            ks = cache.keys(rng.integers(0, 1000, 4 * 32))
            assert cache.save(ks, src, list(range(32))).wait(30).stored == 32
        t.close()  # (flushes the write-back)
        t = open_tiered()
        try:
            calls: list[tuple[str, list[bytes]]] = []
            slow_prefetch, slow_read_many = t.slow.prefetch, t.slow.read_many  # type: ignore[attr-defined]

            def prefetch(keys: Any) -> None:
                calls.append(("prefetch", list(keys)))
                slow_prefetch(keys)

            def read_many(keys: Any, outs: Any) -> list[bool]:
                calls.append(("read", list(keys)))
                return slow_read_many(keys, outs)  # type: ignore[no-any-return]

            t.slow.prefetch = prefetch  # type: ignore[method-assign]
            t.slow.read_many = read_many  # type: ignore[attr-defined]
            with HostKVCache(t, salt, engine, chunk_pages=8, staging_allocator=OrdinaryAllocator()) as cache:
                dst = [np.zeros(shape, np.float32) for _ in layout.planes]
                res = cache.restore(cache.lookup(ks), dst, list(range(32, 64))).wait(30)
            assert res.pages == 32 and res.staged == 32 and res.viewed == 0
            for p_src, p_dst in zip(src, dst, strict=True):
                assert np.array_equal(p_src[:32], p_dst[32:64])
            reads = [c for c in calls if c[0] == "read"]
            assert [len(k) for _, k in reads] == [8] * 4  # a chunk per read, every page from disk
            hinted: set[bytes] = set()
            for what, keys in calls:
                if what == "prefetch":
                    hinted.update(keys)
                else:
                    assert hinted.issuperset(keys), "a chunk was read before it was hinted"
            assert t.stats().extra["promotions"] == 32
        finally:
            t.close()
    finally:
        engine.close()


# ------------------------------------------------------------------------------------------
# eviction racing a write-back: an evicted entry must never come back after a reopen
# ------------------------------------------------------------------------------------------

_SLOW_KINDS = ["lmdb", "mmap"]


def _open_slow(kind: str, path: Path, budget: int) -> Provider:
    if kind == "lmdb":
        if not _lmdb_available():
            pytest.skip("the lmdb provider is not installed")
        return _lmdb(path, budget)
    return hk.open(f"mmap://{path}?budget={budget}&slot={PAGE}&durability=none")


def _pause_slow_reserve(t: TieredProvider, target: Key) -> tuple[threading.Event, threading.Event]:
    """Make the write-back thread stop inside the slow tier's ``reserve`` of ``target``, right after
    the reservation exists there (so it is in flight in the slow tier), until ``go`` is set."""
    entered, go = threading.Event(), threading.Event()
    orig = t.slow.reserve

    def reserve(key: bytes, parent: bytes | None, nbytes: int, *, salt_tag: str = "") -> Reservation | None:
        res = orig(key, parent, nbytes, salt_tag=salt_tag)
        if key == target and threading.current_thread() is t._writer:
            entered.set()
            assert go.wait(60), "the test never let the write-back go on"
        return res

    t.slow.reserve = reserve  # type: ignore[method-assign]
    return entered, go


def _pause_after_slow_seal(t: TieredProvider, target: Key) -> tuple[threading.Event, threading.Event]:
    """Make the write-back thread stop right after the slow tier sealed ``target`` (the page has
    landed there; the writer has not yet looked at the tiered index again), until ``go`` is set."""
    entered, go = threading.Event(), threading.Event()
    orig = t.slow.seal

    def seal(reservation: Reservation) -> None:
        orig(reservation)
        if reservation.key == target and threading.current_thread() is t._writer:
            entered.set()
            assert go.wait(60), "the test never let the write-back go on"

    t.slow.seal = seal  # type: ignore[method-assign]
    return entered, go


@pytest.mark.parametrize("slow_kind", _SLOW_KINDS)
@pytest.mark.parametrize("how", ["keys", "nbytes"])
@pytest.mark.parametrize("paused", ["child", "root", "root-sealed"])
def test_eviction_racing_write_back_does_not_resurrect(tmp_path: Path, slow_kind: str, how: str,
                                                      paused: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """seal K7, seal K4 under K7, evict both while a write-back is mid-way, close, reopen: both
    stay evicted (the per-page write-back; the batched one: the last test of the file).
    ``child``: K7 is written back and K4's slow-tier reservation is in flight when
    the eviction comes (the slow tier then refuses to evict K7, a parent of an in-flight page);
    ``root``: K7's own write-back is in flight; ``root-sealed``: K7 has just landed in the slow
    tier, but its writer has not seen the eviction yet."""
    monkeypatch.setattr(tiered_wb, "_WRITE_BACK_BATCH", 1)  # the hooks sit in the per-page path
    budget = 16 * PAGE

    def make() -> TieredProvider:
        return TieredProvider(_pinned(budget), _open_slow(slow_kind, tmp_path / "slow", 2 * budget),
                              budget_bytes=budget)

    k7, k4 = key_of(f"race-{how}-{paused}-7"), key_of(f"race-{how}-{paused}-4")
    t = make()
    try:
        if paused == "root-sealed":
            entered, go = _pause_after_slow_seal(t, k7)
        else:
            entered, go = _pause_slow_reserve(t, k4 if paused == "child" else k7)
        t.put(k7, None, page_bytes(k7, PAGE))
        t.put(k4, k7, page_bytes(k4, PAGE))
        assert entered.wait(60)
        report = t.evict([k7]) if how == "keys" else t.evict(nbytes=2 * PAGE)
        assert report.entries == 2 and t.present([k7, k4]) == [False, False]
        go.set()
        assert t.flush(60)
        assert t.slow.present([k7, k4]) == [False, False]
        assert t.present([k7, k4]) == [False, False]
    finally:
        t.close()
    t2 = make()
    try:
        assert t2.present([k7, k4]) == [False, False]
        assert t2.slow.present([k7, k4]) == [False, False]
        # the keys are usable again: a new save of the same chain lands and survives a reopen
        put_chain(t2, [k7, k4], PAGE)
    finally:
        t2.close()
    t3 = make()
    try:
        assert t3.present([k7, k4]) == [True, True]
        assert t3.read_bytes(k4) == page_bytes(k4, PAGE)
    finally:
        t3.close()


@pytest.mark.parametrize("slow_kind", _SLOW_KINDS)
def test_close_with_queued_write_backs_uses_no_released_lease(tmp_path: Path, slow_kind: str,
                                                             caplog: pytest.LogCaptureFixture,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Evicting pages whose write-backs are queued or in flight, then closing, writes nothing
    with a released fast-tier lease (no failed write-back is logged) and keeps what was not
    evicted."""
    monkeypatch.setattr(tiered_wb, "_WRITE_BACK_BATCH", 1)  # the hook sits in the per-page path
    budget = 32 * PAGE
    keys = chain("close-race", 12)
    t = TieredProvider(_pinned(budget), _open_slow(slow_kind, tmp_path / "slow", 2 * budget), budget_bytes=budget)
    with caplog.at_level("WARNING", logger="hostkv_providers.providers.tiered"):
        try:
            entered, go = _pause_slow_reserve(t, keys[2])
            put_chain(t, keys, PAGE)
            assert entered.wait(60)
            assert t.evict([keys[6]]).entries == 6  # keys[6:] are queued behind the paused one
            go.set()
        finally:
            t.close()
    assert not [r for r in caplog.records if "write-back" in r.getMessage()]
    t2 = TieredProvider(_pinned(budget), _open_slow(slow_kind, tmp_path / "slow", 2 * budget), budget_bytes=budget)
    try:
        assert t2.present(keys) == [True] * 6 + [False] * 6
    finally:
        t2.close()


def test_prefetch_forwards_only_what_only_the_slow_tier_holds(tmp_path: Path) -> None:
    from hostkv_providers.providers.mmap._provider import MmapProvider

    keys = chain("prefetch", 6)

    def slow() -> MmapProvider:
        return MmapProvider(str(tmp_path / "s"), budget_bytes=64 * PAGE, slot_nbytes=PAGE)

    t = TieredProvider(_pinned(64 * PAGE), slow())
    put_chain(t, keys, PAGE)
    t.flush()
    asked: list[list[bytes]] = []
    t.slow.prefetch = lambda ks: asked.append(list(ks))  # type: ignore[method-assign]
    t.prefetch(keys)
    assert asked == []  # all still in the fast tier
    t.close()
    t2 = TieredProvider(_pinned(64 * PAGE), slow())  # a restart: the fast tier is empty
    try:
        t2.slow.prefetch = lambda ks: asked.append(list(ks))  # type: ignore[method-assign]
        t2.read_many(keys[:2], [bytearray(PAGE), bytearray(PAGE)])  # promoted: in the fast tier
        t2.prefetch([*keys, key_of("prefetch-miss")])
        assert asked == [keys[2:]]
    finally:
        t2.close()


# ------------------------------------------------------------------------------------------
# chain reservation straight into the fast tier (reserve_many / seal_many)
# ------------------------------------------------------------------------------------------


def _fill(res: Reservation) -> None:
    data = np.frombuffer(page_bytes(res.key, res.nbytes), np.uint8)
    for r in res.regions():
        np.frombuffer(r.view, np.uint8)[:] = data[r.offset : r.offset + r.view.nbytes]
    res.mark_written()


def test_reserve_many_lands_in_the_fast_tier_and_is_written_back(tiered: TieredProvider) -> None:
    keys = chain("rm-fast", 12)
    first = tiered.reserve_many(keys[:6], [None, *keys[:5]], PAGE)
    second = tiered.reserve_many(keys[6:], keys[5:11], PAGE)  # its first parent is still in flight
    assert first.error is None and second.error is None
    ress = [r for r in (*first.reservations, *second.reservations) if r is not None]
    assert len(ress) == 12
    # every page is a real reservation of the fast tier (its memory, for a DMA), chained there
    assert [tiered.fast.in_flight(k) for k in keys] == [True] * 12
    for r in ress:
        _fill(r)
    assert tiered.present(keys) == [False] * 12 and tiered.fast.present(keys) == [False] * 12
    tiered.seal_many(ress[:6])
    tiered.seal_many(ress[6:])
    assert tiered.longest_prefix(keys) == 12
    assert tiered.fast.present(keys) == [True] * 12
    # each run is its own tree in the fast tier (evictable run by run); the tiered index has the chain
    assert tiered.fast.entry(keys[6]).parent is None and tiered.fast.entry(keys[7]).parent == keys[6]  # type: ignore[union-attr]
    assert tiered.entry(keys[6]).parent == keys[5]  # type: ignore[union-attr]
    assert tiered.flush(60)
    assert tiered.slow.longest_prefix(keys) == 12
    assert all(tiered.slow.read_bytes(k) == page_bytes(k, PAGE) for k in keys)
    st = tiered.stats()
    assert st.extra["write_backs"] == 12 and st.extra["write_through"] == 0


def test_reserve_many_past_a_full_fast_tier_stores_the_rest_at_seal(tmp_path: Path) -> None:
    # the fast tier holds 8 pages, the chain has 40: its tail cannot be reserved there at once;
    # a slow tier without put_many (one with it gets the run in one ordinary buffer, queued
    # behind the write-back: test_tiered_heap.py)
    slow = _NoBatch(128 * PAGE, block=PAGE, allocator=OrdinaryAllocator())
    t = TieredProvider(_pinned(8 * PAGE), slow, budget_bytes=64 * PAGE)
    try:
        keys = chain("rm-small-fast", 40)
        used = t.stats().used_bytes
        rc = t.reserve_many(keys, [None, *keys[:-1]], PAGE)
        assert rc.error is None and len(rc) == 40 and all(r is not None for r in rc.reservations)
        assert sum(t.fast.in_flight(k) for k in keys) == 8  # the rest wait in ordinary buffers
        assert t.present(keys) == [False] * 40
        ress = [r for r in rc.reservations if r is not None]
        for r in ress:
            _fill(r)
        t.seal_many(ress)
        assert t.longest_prefix(keys) == 40
        assert all(t.read_bytes(k) == page_bytes(k, PAGE) for k in keys)
        assert t.flush(60) and t.slow.longest_prefix(keys) == 40
        # and an abort of an unsealed run leaves nothing behind
        more = chain("rm-small-fast-abort", 20)
        rc = t.reserve_many(more, [None, *more[:-1]], PAGE)
        for r in rc.reservations:
            assert r is not None
            r.abort()
        assert t.present(more) == [False] * 20 and not any(t.fast.in_flight(k) for k in more)
        assert t.stats().used_bytes == used + 40 * PAGE
    finally:
        t.close()


def test_seal_many_of_a_run_with_an_unsealed_parent_aborts_the_rest(tiered: TieredProvider) -> None:
    keys = chain("rm-orphaned", 6)
    rc = tiered.reserve_many(keys, [None, *keys[:-1]], PAGE)
    ress = [r for r in rc.reservations if r is not None]
    for r in ress:
        _fill(r)
    ress[0].abort()
    with pytest.raises(hk.HostKVError):
        tiered.seal_many(ress[1:])
    assert all(r.state == "aborted" for r in ress)
    assert tiered.present(keys) == [False] * 6 and not any(tiered.fast.in_flight(k) for k in keys)
    assert tiered.stats().used_bytes == 0


@pytest.mark.parametrize("slow_kind", _SLOW_KINDS)
def test_eviction_racing_a_batched_write_back_does_not_resurrect(tmp_path: Path, slow_kind: str) -> None:
    """The writer stores queued pages with one ``put_many``: evict a chain while that call is
    about to run (its pages taken off the queue, not yet in the slow tier), let it go on, close,
    reopen: the evicted pages are in neither tier, the rest stays."""
    budget = 64 * PAGE
    keys = chain("batch-race", 12)

    def make() -> TieredProvider:
        return TieredProvider(_pinned(budget), _open_slow(slow_kind, tmp_path / "slow", 2 * budget),
                              budget_bytes=budget)

    t = make()
    entered, go = threading.Event(), threading.Event()
    batches: list[int] = []
    orig = t.slow.put_many  # type: ignore[attr-defined]

    def put_many(items: list[tuple[bytes, bytes | None, object]], *, salt_tag: str = "") -> list[object]:
        batches.append(len(items))
        if threading.current_thread() is t._writer and not entered.is_set():
            entered.set()
            assert go.wait(60), "the test never let the write-back go on"
        return orig(items, salt_tag=salt_tag)  # type: ignore[no-any-return]

    try:
        # hold the writer on a page of its own so that the chain queues up behind it: a batch
        first = key_of("batch-race-first")
        pause, resume = _pause_slow_reserve(t, first)
        t.put(first, None, page_bytes(first, PAGE))
        assert pause.wait(60)
        put_chain(t, keys, PAGE)
        t.slow.put_many = put_many  # type: ignore[attr-defined]
        resume.set()
        assert entered.wait(60)
        assert t.evict([keys[6]]).entries == 6
        go.set()
        assert t.flush(60)
        assert max(batches) > 1  # the write-back really was batched
        assert t.slow.present(keys) == [True] * 6 + [False] * 6
    finally:
        t.close()
    t2 = make()
    try:
        assert t2.present(keys) == [True] * 6 + [False] * 6
        assert all(t2.read_bytes(k) == page_bytes(k, PAGE) for k in keys[:6])
    finally:
        t2.close()


# ------------------------------------------------------------------------------------------
# a chain run reserved and sealed as one (no per-page reservation objects)
# ------------------------------------------------------------------------------------------


def _write_run(rc: hk.ReservedChain, keys: list[Key]) -> None:
    import ctypes

    assert rc.pages is not None
    for k, addr in zip(keys, rc.pages.addresses.tolist(), strict=True):
        ctypes.memmove(addr, page_bytes(k, PAGE), PAGE)
    rc.mark_written()


def test_a_chain_run_is_reserved_and_sealed_as_one_run(tiered: TieredProvider) -> None:
    keys = chain("run-one", 40)
    first = tiered.reserve_many(keys[:24], [None, *keys[:23]], PAGE)
    second = tiered.reserve_many(keys[24:], keys[23:39], PAGE)  # its parent still in flight
    assert first.run is not None and second.run is not None  # nothing per page
    assert tiered.present(keys) == [False] * 40
    _write_run(first, keys[:24])
    _write_run(second, keys[24:])
    first.seal()
    second.seal()
    assert first.sealed == 24 and second.sealed == 16 and tiered.longest_prefix(keys) == 40
    assert tiered.fast.present(keys) == [True] * 40
    assert tiered.entry(keys[24]).parent == keys[23]  # type: ignore[union-attr]
    assert tiered.flush(60) and tiered.slow.longest_prefix(keys) == 40
    assert all(tiered.read_bytes(k) == page_bytes(k, PAGE) for k in keys)
    assert all(tiered.slow.read_bytes(k) == page_bytes(k, PAGE) for k in keys)
    st = tiered.stats()
    assert st.extra["write_backs"] == 40 and st.used_bytes == 40 * PAGE
    assert tiered.fast.verify().ok  # type: ignore[attr-defined]


def test_the_store_seals_in_the_fast_tiers_checksum_algorithm() -> None:
    """A cache hashes saved pages on the GPU only for a store whose ``checksum_algorithm`` is the
    GPU's (the tree): the tiered store's is its fast tier's, and checksums given to its seals in
    that algorithm are what the fast tier records (a wrong one fails the writer's check before
    the write-back, as a flipped bit does); the write-back's slow copy is hashed by the slow tier."""
    from hostkv_providers._blockhash import TREE_ALGORITHM, tree_checksum

    for algorithm in (TREE_ALGORITHM, "xxh3-64"):
        fast = PinnedProvider(64 * PAGE, block=PAGE, allocator=OrdinaryAllocator(), verify_reads=True,
                              checksum=algorithm)
        t = TieredProvider(fast, _pinned(256 * PAGE), budget_bytes=128 * PAGE)
        try:
            assert t.checksum_algorithm == algorithm
        finally:
            t.close()
    t = TieredProvider(PinnedProvider(64 * PAGE, block=PAGE, allocator=OrdinaryAllocator(), verify_reads=True),
                       _pinned(256 * PAGE), budget_bytes=128 * PAGE)
    try:
        assert t.checksum_algorithm == TREE_ALGORITHM  # (the pinned default)
        keys = chain("run-sums", 6)
        rc = t.reserve_many(keys, [None, *keys[:-1]], PAGE)
        assert rc.run is not None
        _write_run(rc, keys)
        given = [tree_checksum(page_bytes(k, PAGE)) for k in keys]
        given[4] ^= 1  # a wrong one
        fast_sums: dict[bytes, int] = {}
        real_first_bad = t.fast._first_bad  # type: ignore[attr-defined]

        def first_bad(views: Any, sums: Any) -> int:  # what the fast tier recorded, as the writer sees it
            fast_sums.update(zip(keys, [int(x) for x in sums], strict=False))
            return int(real_first_bad(views, sums))

        t.fast._first_bad = first_bad  # type: ignore[attr-defined]
        rc.seal(checksums=given, algorithm=TREE_ALGORITHM)
        assert t.flush(60)
        assert [fast_sums[k] for k in keys] == given  # recorded, not hashed again
        # The wrong one is a page damaged between the GPU's hash and the host's copy, as far as
        # anyone can tell: the writer's check fails it, and it goes with its subtree (a miss),
        # never into the slow tier under a checksum of its own.
        assert t.present(keys) == [True] * 4 + [False] * 2
        assert t.slow.present(keys) == [True] * 4 + [False] * 2
        assert all(t.read_bytes(k) == page_bytes(k, PAGE) for k in keys[:4])
    finally:
        t.close()


def test_a_fast_copy_damaged_before_its_write_back_is_not_written_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fast tier that verifies reads has a run's bytes checked against their seal checksums
    before the writer stores them in the slow tier: a page damaged in the fast tier after its
    seal fails its write-back and is dropped with its subtree (a miss, never the damaged bytes
    under a fresh slow-tier checksum); the pages before it are written back whole."""
    import ctypes

    t = TieredProvider(PinnedProvider(64 * PAGE, block=PAGE, allocator=OrdinaryAllocator(), verify_reads=True),
                       _pinned(256 * PAGE), budget_bytes=128 * PAGE)
    keys = chain("run-damaged", 6)
    real = tiered_wb._run_views

    def damaged(run: Any, positions: Any) -> Any:
        views, sums = real(run, positions)
        for p, v in zip(positions.tolist(), views, strict=True):
            if run.lease.keys[p] == keys[3] and v is not None:  # a bit flips in RAM after the seal
                addr = np.frombuffer(v, np.uint8).ctypes.data
                ctypes.c_uint8.from_address(addr + 100).value ^= 0x10
        return views, sums

    monkeypatch.setattr(tiered_wb, "_run_views", damaged)
    try:
        rc = t.reserve_many(keys, [None, *keys[:-1]], PAGE)
        assert rc.run is not None
        _write_run(rc, keys)
        rc.seal()
        assert t.flush(60)
        assert t.slow.present(keys) == [True] * 3 + [False] * 3  # the damaged page and its subtree: not written
        assert t.present(keys) == [True] * 3 + [False] * 3  # dropped: a miss from here on
        assert t.fast.present(keys[3:]) == [False] * 3
        assert all(t.read_bytes(k) == page_bytes(k, PAGE) for k in keys[:3])
        st = t.stats()
        assert st.extra["write_backs"] == 3 and st.extra["write_back_failures"] >= 1
        assert st.checksum_failures >= 1
    finally:
        t.close()


@pytest.mark.parametrize("batch", [True, False])
def test_pages_damaged_before_their_page_by_page_write_back_are_not_written_back(batch: bool) -> None:
    """The page-by-page write-back (pages sealed one by one: ``put``, ``seal``) stores a fast
    tier's verified copies where that tier verifies reads, as the chain-run path checks its
    views: a page damaged in the fast tier after its seal fails its write-back and goes with its
    subtree (a miss), never into the slow tier under a fresh checksum of its own; the pages
    before it are written back whole (one ``put_many`` or, without one, page by page)."""
    import ctypes

    slow = (PinnedProvider if batch else _NoBatch)(256 * PAGE, block=PAGE, allocator=OrdinaryAllocator())
    t = TieredProvider(PinnedProvider(64 * PAGE, block=PAGE, allocator=OrdinaryAllocator(), verify_reads=True),
                       slow, budget_bytes=128 * PAGE)
    keys = chain("pages-damaged", 6)
    real = t._write_pages
    damaged: list[bytes] = []

    batches: list[int] = []

    def damage_then_write(pages: Any) -> None:
        batches.append(len(pages))
        for node in pages:
            if node.key == keys[3]:  # a bit flips in RAM after the seal, before the write-back
                with t.fast.lease([node.key]) as lease:
                    view = t.fast.view(lease, node.key)[0].view  # type: ignore[attr-defined]
                    addr = np.frombuffer(view, np.uint8).ctypes.data
                    ctypes.c_uint8.from_address(addr + 100).value ^= 0x10
                damaged.append(node.key)
        real(pages)

    t._write_pages = damage_then_write  # type: ignore[method-assign]
    # The writer is held (behind a queued anchor) until every page is sealed: they go as one batch.
    go = threading.Event()
    t._write_anchor = lambda *_a: go.wait(30)  # type: ignore[method-assign]
    t._queue.put(("anchor", None, None, None, None))
    try:
        for i, k in enumerate(keys):
            assert t.put(k, keys[i - 1] if i else None, page_bytes(k, PAGE)) is True
        go.set()
        assert t.flush(60)
        assert damaged == [keys[3]]
        assert batches[0] == 6
        assert t.slow.present(keys) == [True] * 3 + [False] * 3  # the damaged page and its subtree: not written
        assert t.present(keys) == [True] * 3 + [False] * 3  # dropped: a miss from here on
        assert all(t.read_bytes(k) == page_bytes(k, PAGE) for k in keys[:3])
        st = t.stats()
        assert st.extra["write_backs"] == 3 and st.extra["write_back_failures"] >= 1
    finally:
        t.close()


def test_a_run_sealed_before_its_parent_run_fails_whole_and_leaves_nothing(tiered: TieredProvider) -> None:
    keys = chain("run-orphan", 20)
    first = tiered.reserve_many(keys[:10], [None, *keys[:9]], PAGE)
    second = tiered.reserve_many(keys[10:], keys[9:19], PAGE)
    assert first.run is not None and second.run is not None
    _write_run(first, keys[:10])
    _write_run(second, keys[10:])
    first.abort()
    with pytest.raises(hk.UnknownKeyError):
        second.seal()
    assert second.sealed == 0
    assert tiered.present(keys) == [False] * 20 and tiered.fast.present(keys) == [False] * 20
    assert not any(tiered.fast.in_flight(k) or tiered.in_flight(k) for k in keys)
    assert tiered.stats().used_bytes == 0 and tiered.fast.stats().used_bytes == 0
    again = tiered.reserve_many(keys, [None, *keys[:-1]], PAGE)  # the keys are free again
    _write_run(again, keys)
    again.seal()
    assert tiered.longest_prefix(keys) == 20


def test_a_run_materialized_after_reserve_seals_page_by_page(tiered: TieredProvider) -> None:
    keys = chain("run-mat", 8)
    rc = tiered.reserve_many(keys, [None, *keys[:-1]], PAGE)
    assert rc.run is not None
    _write_run(rc, keys)
    ress = rc.reservations  # per-page from here on (both tiers' runs split)
    assert rc.run is None and [r.key for r in ress if r is not None] == keys
    tiered.seal_many(ress[:3])  # type: ignore[arg-type]
    ress[3].abort()  # type: ignore[union-attr]
    with pytest.raises(hk.UnknownKeyError):
        tiered.seal_many(ress[4:])  # type: ignore[arg-type]
    assert tiered.longest_prefix(keys) == 3 and tiered.present(keys[3:]) == [False] * 5
    assert tiered.flush(60) and tiered.slow.longest_prefix(keys) == 3
    assert tiered.stats().used_bytes == 3 * PAGE


@contextlib.contextmanager
def _slow_put_many_held(t: TieredProvider) -> Iterator[tuple[threading.Event, threading.Event]]:
    """The slow tier's ``put_many`` waits (``entered`` set) until ``go`` is set: the writer held
    in the middle of storing a batch.  ``go`` is set on the way out."""
    entered, go = threading.Event(), threading.Event()
    orig = t.slow.put_many  # type: ignore[attr-defined]

    def held(items: list[object], **kw: object) -> object:
        entered.set()
        go.wait(30)
        return orig(items, **kw)

    t.slow.put_many = held  # type: ignore[attr-defined]
    try:
        yield entered, go
    finally:
        go.set()


def test_a_sealed_run_evicted_before_its_write_back_is_in_neither_tier(tiered: TieredProvider) -> None:
    with _slow_put_many_held(tiered) as (entered, _go):
        keys = _sealed_run(tiered, "run-evict", 30)
        assert entered.wait(30)  # the writer took the first batch off the queue and waits
        tiered.evict(keys[12:13])  # the subtree from page 12 on
    assert tiered.flush(60)
    assert tiered.present(keys) == [True] * 12 + [False] * 18
    assert tiered.slow.present(keys) == [True] * 12 + [False] * 18
    assert tiered.fast.present(keys[12:]) == [False] * 18
    assert all(tiered.read_bytes(k) == page_bytes(k, PAGE) for k in keys[:12])
    assert tiered.stats().used_bytes == 12 * PAGE


def test_a_sealed_run_waits_for_its_write_back_as_one_record(tiered: TieredProvider) -> None:
    """A chain run sealed at once is queued as one record with one fast-tier lease (no object
    per page at the seal); the writer takes it a batch at a time.  Meanwhile its pages read from
    the fast tier, count as pending, take anchors behind their write-back, and a subtree evicted
    before the writer reaches it leaves the fast tier at once and is never written back."""
    n = 600
    t = TieredProvider(_pinned(2 * n * PAGE), _pinned(2 * n * PAGE), budget_bytes=2 * n * PAGE)
    try:
        with _slow_put_many_held(t) as (entered, _go):
            keys = _sealed_run(t, "run-record", n)
            assert entered.wait(30)  # the writer is storing its first batch
            assert len(t._pend_runs) == 1 and t._pend == {}  # (no per-page record)
            (run,) = t._pend_runs.values()
            assert int(run.writing.sum()) == tiered_wb._WRITE_BACK_BATCH
            assert t.stats().extra["pending_write_back"] == n
            assert t.read_bytes(keys[400]) == page_bytes(keys[400], PAGE)  # from the fast tier
            t.put_anchor(keys[399], "a", b"anchor-blob")
            t.evict(keys[500:501])  # pages 500.. : not taken by the writer yet
            assert t.fast.present(keys[500:]) == [False] * 100  # let go at once
            assert t.stats().extra["pending_write_back"] == 500
        assert t.flush(60)
        assert t.present(keys) == [True] * 500 + [False] * 100
        assert t.slow.longest_prefix(keys) == 500 and t.slow.present(keys[500:]) == [False] * 100
        assert t.slow.get_anchor(keys[399], "a") == b"anchor-blob"
        assert all(t.slow.read_bytes(k) == page_bytes(k, PAGE) for k in keys[::37][:14])
        assert t._pend == {} and t._pend_runs == {} and t._run_starts == []
        assert t.stats().extra["pending_write_back"] == 0
        assert t.fast._lease_tokens == {}  # type: ignore[attr-defined]  (every page let go)
    finally:
        t.close()


def _sealed_run(t: TieredProvider, name: str, n: int) -> list[Key]:
    keys = chain(name, n)
    rc = t.reserve_many(keys, [None, *keys[:-1]], PAGE)
    assert rc.run is not None
    _write_run(rc, keys)
    rc.seal()
    return keys


def _settled(t: TieredProvider) -> None:
    """Nothing of the write-back is left over: no record, no lease, nothing in limbo."""
    assert t._pend == {} and t._pend_runs == {} and t._run_starts == []
    assert t.stats().extra["pending_write_back"] == 0
    assert t.fast._lease_tokens == {}  # type: ignore[attr-defined]
    assert t.fast.stats().extra["limbo_entries"] == 0


def test_a_run_page_whose_write_back_fails_is_dropped_with_the_rest_of_the_run(tmp_path: Path) -> None:
    """The slow tier stores the first 100 pages of a run's batch and fails the rest (an I/O
    error part way): those are dropped from both tiers (a run is a chain: the rest is their
    subtree), the stored prefix stays readable and nothing stays leased."""
    t = TieredProvider(_pinned(1024 * PAGE), _pinned(1024 * PAGE), budget_bytes=1024 * PAGE)
    orig = t.slow.put_many

    def part(items: list[Any], **kw: Any) -> list[object]:
        failed = hk.errors.StorageIOError("injected: the disk is full")
        return [*orig(items[:100], **kw), *[failed] * (len(items) - 100)]

    t.slow.put_many = part  # type: ignore[method-assign]
    try:
        keys = _sealed_run(t, "run-wb-fails", 300)
        assert t.flush(60)
        assert t.present(keys) == [True] * 100 + [False] * 200
        assert t.slow.present(keys) == [True] * 100 + [False] * 200
        assert t.fast.present(keys[100:]) == [False] * 200
        assert all(t.read_bytes(k) == page_bytes(k, PAGE) for k in keys[:100:9])
        st = t.stats()
        assert st.extra["write_back_failures"] == 156 and st.extra["write_backs"] == 100 and st.used_bytes == 100 * PAGE
        _settled(t)
    finally:
        t.close()


def test_a_run_page_the_fast_tier_drops_before_its_write_back_fails_from_there(tmp_path: Path) -> None:
    """A page of a queued run whose bytes fail the fast tier's ``verify`` (its only copy is bad)
    is not written back: it and the rest of the run are dropped, the pages before it are
    written back, and the dropped page's blocks leave limbo when its hold is let go."""
    t = TieredProvider(_pinned(1024 * PAGE), _pinned(1024 * PAGE), budget_bytes=1024 * PAGE)
    try:
        with _slow_put_many_held(t) as (entered, _go):
            keys = _sealed_run(t, "run-fast-bad", 600)
            assert entered.wait(30)  # the first batch (pages 0..255) is being stored
            regions = t.fast._entry_regions(keys[400])  # type: ignore[attr-defined]
            regions[0].view[7] ^= 1  # a memory fault in page 400's only copy
            assert t.fast.verify(repair=True).dropped == 200  # (in the fast tier: page 400 and its subtree)
        assert t.flush(60)
        assert t.present(keys) == [True] * 400 + [False] * 200
        assert t.slow.longest_prefix(keys) == 400 and t.slow.present(keys[400:]) == [False] * 200
        assert t.stats().extra["write_back_failures"] == 1
        _settled(t)
    finally:
        t.close()


class _NoBatch(PinnedProvider):
    """A pinned provider without the batch verbs (as a third-party tier may be)."""

    put_many = None  # type: ignore[assignment]  (None: not SupportsBatch, for a runtime Protocol check)


def test_a_run_over_a_slow_tier_without_put_many_is_written_back_page_by_page() -> None:
    slow = _NoBatch(1024 * PAGE, block=PAGE, allocator=OrdinaryAllocator())
    assert not isinstance(slow, hk.SupportsBatch)
    t = TieredProvider(_pinned(1024 * PAGE), slow, budget_bytes=1024 * PAGE)
    try:
        keys = _sealed_run(t, "run-no-batch", 300)
        assert t.flush(60)
        assert t.slow.longest_prefix(keys) == 300
        assert all(t.slow.read_bytes(k) == page_bytes(k, PAGE) for k in keys[::31])
        _settled(t)
    finally:
        t.close()


def test_a_failing_run_write_back_drops_the_run_and_the_writer_lives_on() -> None:
    """An unexpected error in a run's write-back (here from the fast tier's views): the run's
    pages not written are dropped from both tiers (their state is unknown), the queue's count
    comes back to zero, nothing stays leased, and the writer stores the next save."""
    t = TieredProvider(_pinned(1024 * PAGE), _pinned(1024 * PAGE), budget_bytes=1024 * PAGE)
    orig = t.fast._run_views_sums  # type: ignore[attr-defined]
    calls = [0]

    def failing(lease: object, positions: Any) -> object:
        calls[0] += 1
        if calls[0] == 2:
            raise RuntimeError("injected: a defect in the second batch")
        return orig(lease, positions)

    t.fast._run_views_sums = failing  # type: ignore[attr-defined]
    try:
        keys = _sealed_run(t, "run-wb-defect", 600)
        assert t.flush(60)
        assert t.present(keys) == [True] * 256 + [False] * 344
        assert t.slow.longest_prefix(keys) == 256 and t.slow.present(keys[256:]) == [False] * 344
        assert isinstance(t._writer_error, RuntimeError) and t._queued_pages == 0
        _settled(t)
        more = _sealed_run(t, "run-wb-after", 300)
        assert t.flush(60) and t.slow.longest_prefix(more) == 300
    finally:
        t.close()


def test_close_waits_for_a_fast_tier_seal_under_way() -> None:
    """A seal hashing the fast tier's arena (outside its lock) keeps the fast tier open: a
    close of the tiered store waits for it instead of freeing the arena under it."""
    t = TieredProvider(_pinned(64 * PAGE), _pinned(64 * PAGE), budget_bytes=64 * PAGE)
    fast = t.fast
    hashing, go = threading.Event(), threading.Event()
    orig_sum = fast._sum  # type: ignore[attr-defined]

    def slow_sum(parts: Any) -> int:
        hashing.set()
        go.wait(10)
        return orig_sum(parts)  # type: ignore[no-any-return]

    fast._sum = slow_sum  # type: ignore[attr-defined]
    k = key_of("close-vs-seal")
    res = t.reserve(k, None, PAGE)
    assert res is not None
    res.write(0, page_bytes(k, PAGE))
    sealer = threading.Thread(target=res.seal, daemon=True)
    sealer.start()
    assert hashing.wait(10)
    closer = threading.Thread(target=t.close, daemon=True)
    closer.start()
    closer.join(1.0)
    closed_mid_seal = fast._closed  # type: ignore[attr-defined]
    go.set()
    sealer.join(10)
    closer.join(70)
    assert not closer.is_alive()
    assert not closed_mid_seal, "the fast tier closed (its arena freed) while a seal was hashing it"


@pytest.mark.parametrize("batch", [False, True])
def test_a_read_racing_the_write_back_does_not_drop_a_healthy_page(batch: bool) -> None:
    """A page waiting for its write-back when a read looks it up, whose write-back lands and
    whose fast copy is evicted before the read gets there: the read finds it in the slow tier
    (before, the fast miss counted as a bad only copy and the page was dropped)."""
    t = TieredProvider(_pinned(64 * PAGE), _pinned(64 * PAGE), budget_bytes=64 * PAGE)
    go = threading.Event()
    orig_wb = t._write_back

    def held(node: Any) -> None:
        go.wait(10)
        orig_wb(node)

    t._write_back = held  # type: ignore[method-assign]
    k = key_of(f"read-race-{batch}")
    t.put(k, None, page_bytes(k, PAGE))
    name = "read_many" if batch else "read"
    orig_read = getattr(t.fast, name)

    def racing_read(*a: Any, **kw: Any) -> Any:
        go.set()
        assert t.flush(10)  # the write-back lands; the fast copy is no longer pinned
        t.fast.evict([k])  # evicted for another save's room
        return orig_read(*a, **kw)

    setattr(t.fast, name, racing_read)
    try:
        if batch:
            out = bytearray(PAGE)
            assert t.read_many([k], [out]) == [True] and bytes(out) == page_bytes(k, PAGE)
        else:
            assert t.read_bytes(k) == page_bytes(k, PAGE)
        setattr(t.fast, name, orig_read)
        assert t.present([k]) == [True] and t.stats().checksum_failures == 0
    finally:
        go.set()
        t.close()


def test_a_run_page_evicted_from_the_fast_tier_before_its_lease_fails_the_seal(tiered: TieredProvider) -> None:
    """A fast tier that leases a run's pages only after sealing them (one without ``seal_held``)
    may evict one in between (another save needing room): the run is not published with a page
    whose only copy is gone — it fails whole, nothing is left."""
    keys = chain("run-lost", 10)
    fast = tiered.fast
    rc = tiered.reserve_many(keys, [None, *keys[:-1]], PAGE)
    assert rc.run is not None
    _write_run(rc, keys)
    with _evicted_before_its_lease(fast, keys[4]), pytest.raises(hk.UnknownKeyError, match="left the fast tier"):
        rc.seal()  # (the subtree goes: pages 4..9 of the fast tier's run)
    assert rc.sealed == 0 and tiered.present(keys) == [False] * 10 and fast.present(keys) == [False] * 10
    assert not any(tiered.in_flight(k) for k in keys)
    assert tiered.stats().used_bytes == 0 and fast.stats().used_bytes == 0


@pytest.mark.parametrize("form", ["run", "pages", "one"])
def test_a_pinned_fast_tier_leases_its_pages_in_the_seal(tiered: TieredProvider, form: str) -> None:
    """With a pinned fast tier there is no window between a page's seal there and the lease
    that pins it for its write-back: the lease is taken in the seal's lock round, so an
    eviction (here forced right before any later lease) cannot take the only copy.  Beside
    concurrent saves that window lost a save (``left the fast tier``) in the thread
    conformance test."""
    keys = chain(f"held-{form}", 8)
    fast = tiered.fast
    rc = tiered.reserve_many(keys, [None, *keys[:-1]], PAGE)
    with _evicted_before_its_lease(fast, *keys, hooks=False):
        if form == "run":
            assert rc.run is not None
            _write_run(rc, keys)
            rc.seal()
        else:
            ress = rc.reservations  # (a run splits into per-page reservations)
            for r in ress:
                assert r is not None
                _fill(r)
            if form == "pages":
                tiered.seal_many([r for r in ress if r is not None])
            else:
                for r in ress:
                    assert r is not None
                    r.seal()
    assert tiered.present(keys) == [True] * 8 and fast.present(keys) == [True] * 8
    assert tiered.flush(60) and tiered.slow.longest_prefix(keys) == 8
    assert all(tiered.read_bytes(k) == page_bytes(k, PAGE) for k in keys)


def test_a_failed_page_by_page_seal_lets_go_of_the_leases_taken_in_it(tiered: TieredProvider) -> None:
    """Pages sealed and leased by the fast tier's ``seal_held`` after the one that failed to be
    published are aborted and their leases released: nothing stays pinned in the fast tier."""
    keys = [key_of(f"held-fail-{i}") for i in range(5)]
    rc = tiered.reserve_many(keys, [None] * 5, PAGE)  # five roots
    ress = [r for r in rc.reservations if r is not None]
    for r in ress:
        _fill(r)
    orig = tiered._index.commit

    def fail_third(key: Key, **kw: object) -> int:
        if key == keys[2]:
            raise hk.UnknownKeyError("injected: the parent was dropped")
        return orig(key, **kw)  # type: ignore[arg-type]

    tiered._index.commit = fail_third  # type: ignore[method-assign]
    try:
        with pytest.raises(hk.UnknownKeyError, match="injected"):
            tiered.seal_many(ress)
    finally:
        tiered._index.commit = orig  # type: ignore[method-assign]
    assert tiered.present(keys) == [True, True, False, False, False]
    assert tiered.flush(60)
    assert fast_leases(tiered.fast) == 0
    assert tiered.fast.present(keys[2:]) == [False] * 3 and tiered.fast.stats().used_bytes <= 2 * PAGE


def fast_leases(fast: Provider) -> int:
    """The leases a pinned provider holds now (all of them its own tokens)."""
    return len(fast._lease_tokens)  # type: ignore[attr-defined]


def test_a_run_the_fast_tier_takes_only_in_part_keeps_its_reservations(tmp_path: Path) -> None:
    """A fast tier that cannot take a chain run whole (here too small for it) over a slow tier
    without put_many: its reservations of a prefix are kept (not given back and asked for
    again), the rest waits in ordinary buffers and is written through at seal."""
    slow = _NoBatch(128 * PAGE, block=PAGE, allocator=OrdinaryAllocator())
    t = TieredProvider(_pinned(8 * PAGE), slow, budget_bytes=64 * PAGE)
    try:
        keys = chain("run-part", 20)
        rc = t.reserve_many(keys, [None, *keys[:-1]], PAGE)
        assert rc.run is None and rc.error is None and len(rc) == 20
        assert sum(t.fast.in_flight(k) for k in keys) == 8
        assert t.fast.stats().aborts == 0  # (nothing reserved in the fast tier and given back)
        ress = [r for r in rc.reservations if r is not None]
        for r in ress:
            _fill(r)
        t.seal_many(ress)
        assert t.longest_prefix(keys) == 20 and all(t.read_bytes(k) == page_bytes(k, PAGE) for k in keys)
        assert t.flush(60) and t.slow.longest_prefix(keys) == 20
    finally:
        t.close()


@contextlib.contextmanager
def _evicted_before_its_lease(fast: Provider, *keys: Key, hooks: bool = True) -> Iterator[None]:
    """The fast tier evicts each of ``keys`` (and its subtree there) right before a lease of it
    alone: the window between a page's seal in the fast tier and its publication in the tiered
    index when the fast tier leases after its seal.  ``hooks=False`` hides pinned's seal that
    leases in the same lock round (``_seal_held``, ``_PinnedRun.seal_held``), so the tiered
    provider takes that path, as for any other fast tier."""
    orig = fast.lease

    def evict_then_lease(ks: list[bytes]) -> object:
        if len(ks) == 1 and ks[0] in keys:
            fast.evict(ks)
        return orig(ks)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fast, "lease", evict_then_lease)
        if hooks:
            mp.setattr(fast, "_seal_held", None)
            mp.setattr(_PinnedRun, "seal_held", None)
        yield


def test_a_page_evicted_from_the_fast_tier_before_its_lease_is_not_published(tiered: TieredProvider) -> None:
    """The page-by-page seal has the same window as a run's: a page the fast tier evicts between
    its seal there and its lease fails, and the pages after it are aborted."""
    keys = chain("page-lost", 6)
    fast = tiered.fast
    rc = tiered.reserve_many(keys, [None, *keys[:-1]], PAGE)
    ress = [r for r in rc.reservations if r is not None]  # page by page
    for r in ress:
        _fill(r)
    with _evicted_before_its_lease(fast, keys[3]), pytest.raises(hk.UnknownKeyError, match="left the fast tier"):
        tiered.seal_many(ress)
    assert tiered.longest_prefix(keys) == 3 and tiered.present(keys[3:]) == [False] * 3
    assert fast.present(keys[3:]) == [False] * 3 and not any(fast.in_flight(k) for k in keys)
    assert not any(tiered.in_flight(k) for k in keys)
    assert tiered.flush(60) and tiered.slow.longest_prefix(keys) == 3
    assert tiered.stats().used_bytes == 3 * PAGE


def test_pages_sealed_in_the_fast_tier_after_a_failed_page_are_not_left_there(tiered: TieredProvider) -> None:
    """A page-by-page seal of pages in separate fast-tier trees (roots of their own) that fails
    at one: the pages after it were sealed in the fast tier already; aborted in the tiered index,
    their fast copies go too (they were nobody's, taking fast capacity)."""
    keys = [key_of(f"fast-leftover-{i}") for i in range(5)]
    fast = tiered.fast
    rc = tiered.reserve_many(keys, [None] * 5, PAGE)  # five roots
    ress = [r for r in rc.reservations if r is not None]
    for r in ress:
        _fill(r)
    with _evicted_before_its_lease(fast, keys[2]), pytest.raises(hk.UnknownKeyError):
        tiered.seal_many(ress)
    assert tiered.present(keys) == [True, True, False, False, False]
    assert fast.present(keys) == [True, True, False, False, False]
    assert fast.stats().used_bytes == 2 * PAGE and tiered.stats().used_bytes == 2 * PAGE
