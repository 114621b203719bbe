"""A chain saved past a full fast tier (issue 14 item 7, "tiered without cliffs"), page by page:
the per-page reservations of a run the fast tier could not take (``ReservedChain.reservations``
of a heap run, or a slow tier without ``put_many``) wait in ordinary buffers and are written
through to the slow tier at seal, one ``put_many`` per run, after the run's parent has landed
there; nothing is lost, every stored page reads back exactly, the slow tier holds the real chain
(a reopen rebuilds it), and failures leave a sealed prefix.  The chain-level form (the run in one
buffer, queued behind the write-back) is ``test_tiered_heap.py``'s."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import hostkv_providers as hk
from hostkv_providers import CapacityError, PinnedProvider, Provider
from hostkv_providers._reservation import Reservation
from hostkv_providers.cache._cache import HostKVCache
from hostkv_providers.device._copy import CpuCopyEngine
from hostkv_providers.device._hostmem import OrdinaryAllocator
from hostkv_providers.providers.tiered._provider import TieredProvider
from hostkv_providers.testing._pages import chain, page_bytes, put_chain

PAGE = 4096


def _pinned(budget: int) -> PinnedProvider:
    return PinnedProvider(budget, block=PAGE, allocator=OrdinaryAllocator())


class _NoBatch(PinnedProvider):
    """An in-memory slow tier without the batch verbs (as a third-party tier may be): a chain run
    the fast tier takes only in part keeps that part there and the rest gets per-page buffers."""

    put_many = None  # type: ignore[assignment]  (None: not SupportsBatch, for a runtime Protocol check)


def _no_batch(budget: int) -> Provider:
    return _NoBatch(budget, block=PAGE, allocator=OrdinaryAllocator())


def _mmap(path: Path, budget: int) -> Provider:
    return hk.open(f"mmap://{path}?budget={budget}&slot={PAGE}&durability=none")


def _fill(res: Reservation) -> None:
    data = np.frombuffer(page_bytes(res.key, res.nbytes), np.uint8)
    for r in res.regions():
        np.frombuffer(r.view, np.uint8)[:] = data[r.offset : r.offset + r.view.nbytes]
    res.mark_written()


def _count_put_many(tier: Provider) -> list[int]:
    """Record the length of each ``put_many`` call of the real tier (it still does the work)."""
    calls: list[int] = []
    orig = tier.put_many  # type: ignore[attr-defined]

    def put_many(items: Any, **kw: Any) -> Any:
        calls.append(len(items))
        return orig(items, **kw)

    tier.put_many = put_many  # type: ignore[attr-defined]
    return calls


def test_overflow_of_a_chain_is_written_through_in_one_put_many(tmp_path: Path) -> None:
    budget = 64 * PAGE

    def make() -> TieredProvider:
        return TieredProvider(_pinned(8 * PAGE), _mmap(tmp_path / "slow", 2 * budget), budget_bytes=budget)

    keys = chain("overflow", 40)
    t = make()
    try:
        head = t.reserve_many(keys[:8], [None, *keys[:7]], PAGE)  # fits the fast tier: a run there
        assert head.run is not None and head.pages is not None and head.pages.pinned is t.fast.views_pinned
        for r in head.reservations:
            assert r is not None
            _fill(r)
        rc = t.reserve_many(keys[8:], keys[7:-1], PAGE)  # no wait for fast memory at reserve
        ress = [r for r in rc.reservations if r is not None]
        assert rc.error is None and len(ress) == 32
        assert sum(t.fast.in_flight(k) for k in keys) == 8
        for r in ress:
            _fill(r)
        calls = _count_put_many(t.slow)
        head.seal()
        t.seal_many(ress)  # the overflow waits for keys[7]'s write-back, then one put_many
        assert all(r.state == "sealed" for r in ress)
        assert 32 in calls
        st = t.stats()
        assert st.extra["write_through"] == 32 and st.entries == 40
        assert t.longest_prefix(keys) == 40
        assert t.fast.present(keys[8:]) == [False] * 32  # written through, not cycled through fast
        assert all(t.read_bytes(k) == page_bytes(k, PAGE) for k in keys)
        assert t.flush(60)
        assert t.stats().extra["write_backs"] == 8
        # the slow tier holds the real chain, parent before child
        assert t.slow.longest_prefix(keys) == 40
        assert t.slow.entry(keys[8]).parent == keys[7]  # type: ignore[union-attr]
    finally:
        t.close()
    t2 = make()
    try:
        assert t2.longest_prefix(keys) == 40
        assert [t2.entry(k).parent for k in keys[1:]] == keys[:-1]  # type: ignore[union-attr]
        outs = [bytearray(PAGE) for _ in keys]
        assert t2.read_many(keys, outs) == [True] * 40
        assert [bytes(o) for o in outs] == [page_bytes(k, PAGE) for k in keys]
    finally:
        t2.close()


def test_cache_save_past_a_small_fast_tier_stores_every_page_exactly(tmp_path: Path) -> None:
    """The cliff case in small: HostKVCache on the CPU engine saves 300 pages, chunks of 32,
    over a fast tier of 16 pages; every page it reports stored reads back exactly, before and
    after a reopen."""
    layout = hk.KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, page_tokens=4, dtype="float32")
    P = layout.page_nbytes
    assert P == PAGE
    n = 300
    shape = (n, layout.page_tokens, layout.num_kv_heads, layout.head_dim)
    arrays = [np.random.default_rng(i).standard_normal(shape, dtype=np.float32) for i, _ in enumerate(layout.planes)]
    budget = 512 * PAGE

    def make() -> TieredProvider:
        return TieredProvider(_pinned(16 * PAGE), _mmap(tmp_path / "slow", budget), budget_bytes=budget)

    def expected(i: int) -> bytes:
        return b"".join(np.ascontiguousarray(a[i]).tobytes() for a in arrays)

    salt = hk.Salt("test/overflow", layout)
    t = make()
    engine = CpuCopyEngine()
    try:
        with HostKVCache(t, salt, engine, chunk_pages=32) as cache:
            keys = cache.keys(list(range(n * layout.page_tokens)))
            result = cache.save(keys, arrays, list(range(n))).wait(60)
            assert result.stored == n and result.stopped is None
        st = t.stats().extra
        assert st["write_through"] > 0 and st["write_through"] + st["write_backs"] + st["pending_write_back"] == n
        assert all(t.read_bytes(k) == expected(i) for i, k in enumerate(keys))
        assert t.flush(60)
    finally:
        t.close()
        engine.close()
    t2 = make()
    try:
        assert t2.longest_prefix(keys) == n
        assert all(t2.read_bytes(k) == expected(i) for i, k in enumerate(keys))
    finally:
        t2.close()


def test_overflow_page_stored_meanwhile_by_another_writer(tmp_path: Path) -> None:
    """Between reserve_many and seal_many another writer stores the first overflow page (its
    parent is sealed; a per-page buffer is not in flight): that copy stands and the rest of the
    run is still stored exactly.  (A heap run's pages stay in flight: no other writer can.)"""
    t = TieredProvider(_pinned(4 * PAGE), _no_batch(128 * PAGE), budget_bytes=64 * PAGE)
    try:
        keys = chain("overflow-raced", 12)
        rc = t.reserve_many(keys, [None, *keys[:-1]], PAGE)
        ress = [r for r in rc.reservations if r is not None]
        assert len(ress) == 12
        for r in ress:
            _fill(r)
        t.seal_many(ress[:4])
        assert t.put(keys[4], keys[3], page_bytes(keys[4], PAGE))
        t.seal_many(ress[4:])
        assert all(r.state == "sealed" for r in ress)
        assert t.longest_prefix(keys) == 12
        assert all(t.read_bytes(k) == page_bytes(k, PAGE) for k in keys)
        assert t.flush(60) and t.slow.longest_prefix(keys) == 12
    finally:
        t.close()


def test_overflow_short_of_capacity_at_seal_keeps_a_sealed_prefix(tmp_path: Path) -> None:
    """Overflow pages hold no budget until their seal: when leased entries fill the tiered budget
    meanwhile, the seal stores what fits (a prefix), raises CapacityError, aborts the rest, and
    leaves nothing of them in either tier.  (A heap run takes its budget at reserve_many.)"""
    t = TieredProvider(_pinned(4 * PAGE), _no_batch(64 * PAGE), budget_bytes=24 * PAGE)
    try:
        keys = chain("overflow-full", 12)
        rc = t.reserve_many(keys, [None, *keys[:-1]], PAGE)
        ress = [r for r in rc.reservations if r is not None]
        assert len(ress) == 12 and sum(t.fast.in_flight(k) for k in keys) == 4
        for r in ress:
            _fill(r)
        other = chain("overflow-full-other", 16)
        put_chain(t, other, PAGE)
        with t.lease(other):  # 16 leased + 4 in flight: room for 4 more of the overflow
            with pytest.raises(CapacityError):
                t.seal_many(ress)
            assert [r.state for r in ress] == ["sealed"] * 8 + ["aborted"] * 4
            assert t.longest_prefix(keys) == 8
            assert t.present(keys[8:]) == [False] * 4
            assert all(t.read_bytes(k) == page_bytes(k, PAGE) for k in keys[:8])
        assert t.flush(60)
        assert t.slow.longest_prefix(keys) == 8 and t.slow.present(keys[8:]) == [False] * 4
        assert t.stats().used_bytes == 24 * PAGE and t.stats().in_flight == 0
        # the keys are not stuck: the rest of the chain can be saved now
        put_chain(t, keys[8:], PAGE, parent=keys[7])
        assert t.longest_prefix(keys) == 12
    finally:
        t.close()


def test_close_while_an_overflow_waits_for_its_parent_loses_nothing(tmp_path: Path) -> None:
    """close() while a seal_many waits for its overflow's parent to be written back: every
    reservation the seal reports sealed reads back exactly after a reopen; the others are
    aborted (a ClosedError), never half-stored."""
    budget = 64 * PAGE

    def make() -> TieredProvider:
        return TieredProvider(_pinned(8 * PAGE), _mmap(tmp_path / "slow", 2 * budget), budget_bytes=budget)

    keys = chain("overflow-close", 24)
    t = make()
    entered, go = threading.Event(), threading.Event()
    orig_put_many, orig_reserve = t.slow.put_many, t.slow.reserve  # type: ignore[attr-defined]

    def hold() -> None:
        if threading.current_thread() is t._writer:  # hold the first write-back (batched or not)
            entered.set()
            assert go.wait(60), "the test never let the write-back go on"

    def put_many(items: Any, **kw: Any) -> Any:
        hold()
        return orig_put_many(items, **kw)

    def reserve(*a: Any, **kw: Any) -> Any:
        hold()
        return orig_reserve(*a, **kw)

    t.slow.put_many = put_many  # type: ignore[attr-defined]
    t.slow.reserve = reserve  # type: ignore[method-assign]
    head = t.reserve_many(keys[:8], [None, *keys[:7]], PAGE)  # in the fast tier, sealed below
    rc = t.reserve_many(keys[8:], keys[7:-1], PAGE)  # the fast tier is full: buffers
    ress = [r for r in (*head.reservations, *rc.reservations) if r is not None]
    assert sum(t.fast.in_flight(k) for k in keys) == 8
    for r in ress:
        _fill(r)
    errors: list[BaseException] = []

    def seal() -> None:
        try:
            t.seal_many(ress)
        except hk.HostKVError as exc:
            errors.append(exc)

    sealer = threading.Thread(target=seal)
    sealer.start()
    assert entered.wait(60)
    closer = threading.Thread(target=t.close)
    closer.start()
    go.set()
    closer.join(60)
    sealer.join(60)
    assert not closer.is_alive() and not sealer.is_alive()
    assert all(r.state in ("sealed", "aborted") for r in ress)
    assert all(isinstance(e, hk.ClosedError) for e in errors)
    sealed = [r.key for r in ress if r.state == "sealed"]
    assert sealed == keys[: len(sealed)] and len(sealed) >= 8
    t2 = make()
    try:
        assert t2.longest_prefix(keys) >= len(sealed)
        n = t2.longest_prefix(keys)
        assert all(t2.read_bytes(k) == page_bytes(k, PAGE) for k in keys[:n])
    finally:
        t2.close()


def test_overflow_whose_parent_fails_its_write_back_stores_nothing(tmp_path: Path) -> None:
    """The slow tier fails the write-back of the run the overflow hangs from (an I/O error): the
    parent is dropped with its subtree, and the overflow, which waited for it, is refused
    (``UnknownKeyError``) and aborted; nothing of the chain is left in either tier, and the same
    chain can be saved again afterwards."""
    t = TieredProvider(_pinned(8 * PAGE), _mmap(tmp_path / "slow", 128 * PAGE), budget_bytes=64 * PAGE)
    try:
        keys = chain("overflow-io-error", 24)
        orig_put_many, orig_reserve = t.slow.put_many, t.slow.reserve  # type: ignore[attr-defined]

        def failing(*a: Any, **kw: Any) -> Any:
            if threading.current_thread() is t._writer:
                raise hk.errors.StorageIOError("injected: the disk refused the write-back")
            return None

        def put_many(items: Any, **kw: Any) -> Any:
            failing()
            return orig_put_many(items, **kw)

        def reserve(*a: Any, **kw: Any) -> Any:
            failing()
            return orig_reserve(*a, **kw)

        t.slow.put_many = put_many  # type: ignore[attr-defined]
        t.slow.reserve = reserve  # type: ignore[method-assign]
        head = t.reserve_many(keys[:8], [None, *keys[:7]], PAGE)  # in the fast tier
        rc = t.reserve_many(keys[8:], keys[7:-1], PAGE)  # the fast tier is full: buffers
        ress = [r for r in (*head.reservations, *rc.reservations) if r is not None]
        assert sum(t.fast.in_flight(k) for k in keys) == 8
        for r in ress:
            _fill(r)
        with pytest.raises(hk.errors.UnknownKeyError):
            t.seal_many(ress)
        assert [r.state for r in ress[8:]] == ["aborted"] * 16
        assert t.flush(60)
        assert t.present(keys) == [False] * 24
        assert t.slow.present(keys) == [False] * 24 and t.fast.present(keys) == [False] * 24
        st = t.stats()
        assert st.extra["write_back_failures"] >= 1 and st.extra["write_through"] == 0  # (the rest: its subtree)
        assert st.in_flight == 0 and st.used_bytes == 0
        t.slow.put_many, t.slow.reserve = orig_put_many, orig_reserve  # type: ignore[attr-defined,method-assign]
        rc = t.reserve_many(keys, [None, *keys[:-1]], PAGE)
        ress = [r for r in rc.reservations if r is not None]
        for r in ress:
            _fill(r)
        t.seal_many(ress)
        assert all(t.read_bytes(k) == page_bytes(k, PAGE) for k in keys)
        assert t.flush(60) and t.slow.longest_prefix(keys) == 24
    finally:
        t.close()


def test_put_many_past_a_full_fast_tier_stores_chain_runs(tmp_path: Path) -> None:
    """put_many stores chain runs with the chain path (overflow written through, no per-page
    flush); per-item results keep their meaning: True, False for a page already stored,
    UnknownKeyError for a page whose parent is unknown and for the pages under it, while an
    independent chain later in the same call is still stored."""
    t = TieredProvider(_pinned(8 * PAGE), _mmap(tmp_path / "slow", 1024 * PAGE), budget_bytes=512 * PAGE)
    try:
        keys = chain("put-many-overflow", 300)
        put_chain(t, keys[:3], PAGE)
        stray, under = chain("put-many-stray", 2)
        other = chain("put-many-other", 5)
        items: list[tuple[bytes, bytes | None, bytes]] = [
            (k, keys[i - 1] if i else None, page_bytes(k, PAGE)) for i, k in enumerate(keys)]
        items += [(under, stray, page_bytes(under, PAGE))]  # its parent was never stored
        items += [(k, other[i - 1] if i else None, page_bytes(k, PAGE)) for i, k in enumerate(other)]
        got = t.put_many(items)
        assert got[:3] == [False] * 3 and got[3:300] == [True] * 297
        assert isinstance(got[300], hk.errors.UnknownKeyError)
        assert got[301:] == [True] * 5
        st = t.stats()
        assert st.extra["write_through"] > 0 and st.entries == 305
        assert all(t.read_bytes(k) == page_bytes(k, PAGE) for k in (*keys, *other))
        assert t.present([under]) == [False]
        assert t.flush(60) and t.slow.longest_prefix(keys) == 300 and t.slow.longest_prefix(other) == 5
    finally:
        t.close()
