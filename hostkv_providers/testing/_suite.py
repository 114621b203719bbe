"""``ProviderTests``: the conformance suite every provider's test class subclasses.

Usage (in a provider's test module)::

    from hostkv_providers.testing import ProviderTests

    class TestMyConformance(ProviderTests):
        supports_reopen = True

        def make_provider(self, tmp_path, budget_bytes):
            return MyProvider(tmp_path / "store", budget_bytes=budget_bytes)

        def reopen(self, provider):
            provider.close()
            return MyProvider(...same store...)

        def backdoor_read(self, provider, key):       # optional
            ...
        def backdoor_corrupt(self, provider, key):    # optional
            ...

Every test checks one rule of the :class:`~hostkv_providers.Provider` docstring or of DESIGN.md
("Invariants every provider keeps").  Tests that need an optional power (``iterate``, ``verify``,
``views``, reopen, a backdoor) skip, never fail, when the provider lacks it.  Page contents are a
PRNG of the key (:func:`page_bytes`), so a wrong byte anywhere is caught by recomputation.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar

import pytest

from hostkv_providers._errors import (
    CapacityError,
    ClosedError,
    HostKVError,
    IncompleteWriteError,
    InFlightError,
    InvalidArgumentError,
    ReservationError,
    SpanError,
    UnknownKeyError,
    UsedAfterForkError,
)
from hostkv_providers._keys import Key
from hostkv_providers._provider import (
    Lease,
    Provider,
    SupportsBatch,
    SupportsBatchViews,
    SupportsIterate,
    SupportsVerify,
    SupportsViews,
)
from hostkv_providers._span import ByteSpan
from hostkv_providers.testing._batch_chain import BatchChainTests
from hostkv_providers.testing._pages import anchor_bytes, chain, key_of, page_bytes, put_chain, put_page

__all__ = ["ProviderFactory", "ProviderTests"]

ProviderFactory = Callable[..., Provider]


class ProviderTests(BatchChainTests):
    """Base class of a provider's conformance tests (not collected itself: no ``Test`` prefix).

    Subclasses implement :meth:`make_provider` and, for persistent providers, set
    ``supports_reopen = True`` and implement :meth:`reopen`.  The optional backdoors
    :meth:`backdoor_read` / :meth:`backdoor_corrupt` reach the medium without the provider's read
    path, so the suite can check the provider against an independent path; without them the tests
    that need them are skipped.
    """

    #: Entry sizes used by the suite are multiples of this.
    page_nbytes: ClassVar[int] = 4096
    #: Budget of the ``provider`` fixture, in pages.
    default_budget_pages: ClassVar[int] = 64
    #: Persistent providers set this and implement :meth:`reopen`.
    supports_reopen: ClassVar[bool] = False
    #: Threads per role in the thread-safety test (writers and readers each).
    thread_count: ClassVar[int] = 4
    #: Operations per thread in the thread-safety test.
    thread_ops: ClassVar[int] = 150
    #: Hypothesis budget of the stateful test.
    stateful_examples: ClassVar[int] = 30
    stateful_steps: ClassVar[int] = 50
    #: Extra ``hypothesis.settings`` for the stateful test (e.g. ``{"phases": [Phase.generate]}``).
    stateful_settings: ClassVar[dict[str, Any]] = {}

    # -- the interface a provider's test class implements --------------------------------------
    def make_provider(self, tmp_path: Path, budget_bytes: int) -> Provider:
        """Build a fresh, empty provider whose store lives under ``tmp_path`` (an empty dir)."""
        raise NotImplementedError("subclasses of ProviderTests implement make_provider()")

    def reopen(self, provider: Provider) -> Provider:
        """Close ``provider`` and open the same store again; return the new instance."""
        raise NotImplementedError("set supports_reopen = True and implement reopen()")

    def backdoor_read(self, provider: Provider, key: Key) -> bytes | None:
        """The sealed bytes of ``key`` straight from the medium, or ``None`` if not stored."""
        raise NotImplementedError

    def backdoor_corrupt(self, provider: Provider, key: Key) -> None:
        """Flip at least one byte of ``key``'s page on the medium (bypassing the provider)."""
        raise NotImplementedError

    # -- fixtures ------------------------------------------------------------------------------
    @pytest.fixture
    def provider_factory(self, tmp_path: Path) -> Iterator[ProviderFactory]:
        """``make(budget_pages=64) -> Provider`` in a fresh directory; all closed at teardown."""
        made: list[Provider] = []
        counter = [0]

        def make(budget_pages: int | None = None) -> Provider:
            pages = self.default_budget_pages if budget_pages is None else budget_pages
            counter[0] += 1
            where = tmp_path / f"provider{counter[0]}"
            where.mkdir()
            p = self.make_provider(where, pages * self.page_nbytes)
            made.append(p)
            return p

        yield make
        for p in made:
            _close_quietly(p)

    @pytest.fixture
    def provider(self, provider_factory: ProviderFactory) -> Provider:
        """A fresh provider with a budget of ``default_budget_pages`` pages."""
        return provider_factory()

    # -- helpers -------------------------------------------------------------------------------
    def _reopen_tracked(self, provider: Provider, request: pytest.FixtureRequest) -> Provider:
        if not self.supports_reopen:
            pytest.skip("provider does not survive close/reopen (supports_reopen = False)")
        fresh = self.reopen(provider)
        request.addfinalizer(lambda: _close_quietly(fresh))
        return fresh

    def _backdoor_read(self, provider: Provider, key: Key) -> bytes | None:
        try:
            return self.backdoor_read(provider, key)
        except NotImplementedError:
            pytest.skip("no backdoor_read for this provider")

    def _backdoor_corrupt(self, provider: Provider, key: Key) -> None:
        try:
            self.backdoor_corrupt(provider, key)
        except NotImplementedError:
            pytest.skip("no backdoor_corrupt for this provider")

    def _pages(self, n: int) -> int:
        return n * self.page_nbytes

    # ==========================================================================================
    # Basic round trips
    # ==========================================================================================
    @pytest.mark.parametrize("npages", [1, 2, 5])
    def test_put_read_roundtrip(self, provider: Provider, npages: int) -> None:
        key = key_of(f"roundtrip-{npages}")
        nbytes = self._pages(npages)
        assert provider.put(key, None, page_bytes(key, nbytes), salt_tag="tag-a") is True
        assert provider.present([key]) == [True]
        assert provider.read_bytes(key) == page_bytes(key, nbytes)
        out = bytearray(nbytes + 7)  # a larger buffer is fine; only the first nbytes are written
        out[nbytes:] = b"\xee" * 7
        assert provider.read(key, out) is True
        assert bytes(out[:nbytes]) == page_bytes(key, nbytes)
        assert bytes(out[nbytes:]) == b"\xee" * 7
        info = provider.entry(key)
        assert info is not None
        assert (info.key, info.parent, info.nbytes, info.salt_tag) == (key, None, nbytes, "tag-a")
        _check_budget(provider)

    def test_write_in_pieces_any_order(self, provider: Provider) -> None:
        key = key_of("pieces")
        nbytes = self._pages(3)
        data = page_bytes(key, nbytes)
        res = provider.reserve(key, None, nbytes)
        assert res is not None
        cuts = [0, 1000, 4096, 5000, 9000, nbytes]
        pieces = list(itertools.pairwise(cuts))
        for lo, hi in reversed(pieces):
            provider.write(res, lo, data[lo:hi])
        assert provider.present([key]) == [False]  # nothing visible before seal
        provider.seal(res)
        assert res.state == "sealed"
        assert provider.read_bytes(key) == data

    def test_accepts_any_contiguous_buffer(self, provider: Provider) -> None:
        import numpy as np

        key = key_of("buffers")
        nbytes = self._pages(1)
        data = page_bytes(key, nbytes)
        res = provider.reserve(key, None, nbytes)
        assert res is not None
        provider.write(res, 0, memoryview(data)[:1024])
        provider.write(res, 1024, bytearray(data[1024:2048]))
        provider.write(res, 2048, np.frombuffer(data[2048:], dtype=np.uint32))  # not a "B" format
        provider.seal(res)
        out = np.zeros(nbytes // 8, dtype=np.float64)  # reading into a typed array works too
        assert provider.read(key, out) is True
        assert out.tobytes() == data

    def test_reservation_context_manager(self, provider: Provider) -> None:
        key, bad = key_of("ctx-ok"), key_of("ctx-bad")
        nbytes = self._pages(1)
        res = provider.reserve(key, None, nbytes)
        assert res is not None
        with res:
            res.write(0, page_bytes(key, nbytes))
        assert res.state == "sealed"
        assert provider.read_bytes(key) == page_bytes(key, nbytes)
        res2 = provider.reserve(bad, None, nbytes)
        assert res2 is not None
        with pytest.raises(RuntimeError, match="boom"), res2:
            res2.write(0, page_bytes(bad, nbytes))
            raise RuntimeError("boom")
        assert res2.state == "aborted"
        assert provider.present([bad]) == [False]

    def test_chain_present_and_longest_prefix(self, provider: Provider) -> None:
        keys = chain("prefix", 5)
        put_chain(provider, keys[:3], self._pages(1))
        assert provider.present(keys) == [True, True, True, False, False]
        assert provider.longest_prefix(keys) == 3
        assert provider.longest_prefix(keys[1:]) == 2
        assert provider.longest_prefix(keys[3:]) == 0
        assert provider.longest_prefix([]) == 0
        assert provider.present([]) == []
        for i in range(3):
            info = provider.entry(keys[i])
            assert info is not None
            assert info.parent == (keys[i - 1] if i else None)

    def test_miss_is_a_value(self, provider: Provider) -> None:
        key = key_of("never-stored")
        out = bytearray(self._pages(1))
        assert provider.present([key]) == [False]
        assert provider.read(key, out) is False
        assert provider.read_bytes(key) is None
        assert provider.entry(key) is None
        assert provider.get_anchor(key, "state") is None
        assert provider.list_anchors(key) == {}
        assert provider.in_flight(key) is False
        assert provider.deepest_anchor([key], "state") == 0
        with provider.lease([key]) as lease:
            assert lease.present == (False,)
            assert lease.prefix_len == 0
        report = provider.evict([key])
        assert report.entries == 0

    def test_stats_accounting(self, provider: Provider) -> None:
        st = provider.stats()
        assert st.entries == 0 and st.used_bytes == 0
        assert st.budget_bytes == provider.budget_bytes == self._pages(self.default_budget_pages)
        keys = chain("stats", 4)
        put_chain(provider, keys, self._pages(2))
        st = provider.stats()
        assert st.entries == 4
        assert self._pages(8) <= st.used_bytes <= st.budget_bytes
        provider.evict(keys[2:])
        st2 = provider.stats()
        assert st2.entries == 2
        assert self._pages(4) <= st2.used_bytes < st.used_bytes

    # ==========================================================================================
    # Prefix-closed tree
    # ==========================================================================================
    def test_reserve_needs_sealed_parent(self, provider: Provider) -> None:
        a, b, c = chain("parent", 3)
        nbytes = self._pages(1)
        with pytest.raises(UnknownKeyError):
            provider.reserve(b, a, nbytes)
        res = provider.reserve(a, None, nbytes)
        assert res is not None
        with pytest.raises(UnknownKeyError):  # a parent in flight is not sealed
            provider.reserve(b, a, nbytes)
        provider.write(res, 0, page_bytes(a, nbytes))
        provider.seal(res)
        assert put_page(provider, b, a, nbytes)
        provider.evict([b])
        with pytest.raises(UnknownKeyError):  # an evicted parent is gone
            provider.reserve(c, b, nbytes)
        assert provider.present([a, b, c]) == [True, False, False]

    def test_evict_keys_removes_subtrees(self, provider: Provider) -> None:
        nbytes = self._pages(1)
        a0, a1, a2 = chain("tree-a", 3)
        b2, b3 = key_of("tree-b2"), key_of("tree-b3")
        other = key_of("tree-other")
        put_chain(provider, [a0, a1, a2], nbytes)
        put_chain(provider, [b2, b3], nbytes, parent=a1)
        put_page(provider, other, None, nbytes)
        used = provider.stats().used_bytes
        report = provider.evict([a1])
        assert report.entries == 4
        assert report.nbytes == 4 * nbytes
        assert report.skipped == 0
        assert provider.present([a0, a1, a2, b2, b3, other]) == [True, False, False, False, False, True]
        assert provider.stats().used_bytes <= used - 4 * nbytes
        for k in (a1, a2, b2, b3):
            assert provider.read_bytes(k) is None
        assert provider.read_bytes(other) == page_bytes(other, nbytes)
        # evicting keys that are missing, repeated or nested is harmless
        report = provider.evict([a0, a0, a1, key_of("tree-missing")])
        assert report.entries == 1
        assert provider.present([a0, other]) == [False, True]

    def test_evict_keys_descendants_listed_first(self, provider: Provider) -> None:
        # Roots that include their own descendants, deepest first: a walk that starts from every
        # root and reverses its visit order puts the ancestor before its child and skips it.
        nbytes = self._pages(1)
        keys = chain("tree-nested", 4)
        put_chain(provider, keys, nbytes)
        report = provider.evict([keys[3], keys[1], keys[2], keys[0]])
        assert report.entries == 4 and report.skipped == 0
        assert provider.present(keys) == [False] * 4

    def test_policy_eviction_never_punctures_chains(self, provider_factory: ProviderFactory) -> None:
        p = provider_factory(16)
        nbytes = self._pages(1)
        parents: dict[Key, Key | None] = {}
        for c in range(12):
            keys = chain(f"puncture-{c}", 2 + c % 4)
            parent: Key | None = None
            for k in keys:
                try:
                    put_page(p, k, parent, nbytes)
                except UnknownKeyError:
                    break  # the parent was evicted by our own pressure: fine, stop the chain
                parents[k] = parent
                parent = k
                _check_closure(p, parents)
                _check_budget(p)
        # evict by bytes in small steps: every step keeps the tree prefix-closed
        while p.stats().entries:
            report = p.evict(nbytes=1)
            assert report.entries >= 1
            _check_closure(p, parents)

    # ==========================================================================================
    # LRU-leaf eviction order
    # ==========================================================================================
    def test_lru_leaf_order_with_refresh(self, provider: Provider) -> None:
        nbytes = self._pages(1)
        roots = [key_of(f"lru-{i}") for i in range(8)]
        for k in roots:
            put_page(provider, k, None, nbytes)
        assert provider.read(roots[0], bytearray(nbytes)) is True  # refresh by read
        with provider.lease([roots[1]]):  # refresh by lease
            pass
        expected = roots[2:] + roots[:2]
        evicted: list[Key] = []
        while len(evicted) < len(roots):
            report = provider.evict(nbytes=1)
            assert report.entries >= 1
            evicted = [k for k, hit in zip(roots, provider.present(roots), strict=True) if not hit]
            # batched eviction is allowed, but always of the least recently used leaves
            assert set(evicted) == set(expected[: len(evicted)]), "eviction must follow LRU order"

    def test_eviction_removes_leaves_before_their_parents(self, provider: Provider) -> None:
        nbytes = self._pages(1)
        keys = chain("leafonly", 4)
        put_chain(provider, keys, nbytes)
        late = key_of("leafonly-late")
        put_page(provider, late, None, nbytes)
        provider.read(keys[0], bytearray(nbytes))  # the root is recent, but it is not a leaf
        seen_present: list[list[bool]] = []
        while provider.stats().entries:
            provider.evict(nbytes=1)
            seen_present.append(provider.present(keys))
        for row in seen_present:
            # a chain shrinks from its tip: the present keys are always a prefix of the chain
            n = sum(row)
            assert row == [True] * n + [False] * (len(keys) - n)

    def test_pressure_evicts_lru_and_keeps_recent(self, provider_factory: ProviderFactory) -> None:
        p = provider_factory(8)
        nbytes = self._pages(1)
        old = [key_of(f"pressure-old-{i}") for i in range(6)]
        for k in old:
            put_page(p, k, None, nbytes)
        assert p.read(old[0], bytearray(nbytes))
        new = [key_of(f"pressure-new-{i}") for i in range(12)]
        for k in new[:4]:
            put_page(p, k, None, nbytes)
            _check_budget(p)
        # At least some old entries had to go; the refreshed old[0] goes after old[1..].
        hits = p.present(old)
        assert not all(hits)
        if hits[0] is False:
            assert not any(hits[1:]), "old[0] was read last, it must outlive old[1:]"
        for k in new[4:]:
            put_page(p, k, None, nbytes)
            _check_budget(p)
        assert p.present(new[-1:]) == [True]
        assert p.read_bytes(new[-1]) == page_bytes(new[-1], nbytes)

    # ==========================================================================================
    # Budget and the satisfiability guard
    # ==========================================================================================
    def test_budget_never_exceeded(self, provider_factory: ProviderFactory) -> None:
        p = provider_factory(12)
        for i in range(40):
            npages = 1 + i % 3
            k = key_of(f"budget-{i}")
            put_page(p, k, None, self._pages(npages))
            _check_budget(p)
            assert p.read_bytes(k) == page_bytes(k, self._pages(npages))

    def test_larger_than_budget_is_capacity_error(self, provider_factory: ProviderFactory) -> None:
        p = provider_factory(8)
        keys = [key_of(f"huge-{i}") for i in range(4)]
        for k in keys:
            put_page(p, k, None, self._pages(1))
        with pytest.raises(CapacityError):
            p.reserve(key_of("huge"), None, self._pages(9))
        assert p.present(keys) == [True] * 4  # nothing evicted
        assert p.in_flight(key_of("huge")) is False

    def test_unsatisfiable_reserve_evicts_nothing(self, provider_factory: ProviderFactory) -> None:
        p = provider_factory(8)
        nbytes = self._pages(1)
        leased = [key_of(f"guard-leased-{i}") for i in range(5)]
        free = [key_of(f"guard-free-{i}") for i in range(2)]
        for k in leased + free:
            put_page(p, k, None, nbytes)
        before = p.present(leased + free)
        used = p.stats().used_bytes
        with p.lease(leased) as lease:
            assert lease.prefix_len == 5
            # 5 leased pages + 4 new ones can never fit in 8: refuse without evicting the 2 free ones
            with pytest.raises(CapacityError):
                p.reserve(key_of("guard-big"), None, self._pages(4))
            assert p.present(leased + free) == before
            assert p.stats().used_bytes == used
            assert p.in_flight(key_of("guard-big")) is False
            # a request that fits by evicting the free ones succeeds
            res = p.reserve(key_of("guard-ok"), None, self._pages(3))
            assert res is not None
            assert p.present(leased) == [True] * 5
            _check_budget(p)
            res.abort()

    def test_in_flight_space_is_not_evictable(self, provider_factory: ProviderFactory) -> None:
        p = provider_factory(8)
        nbytes = self._pages(1)
        root = key_of("flight-root")
        put_page(p, root, None, nbytes)
        spare = key_of("flight-spare")
        put_page(p, spare, None, nbytes)
        held = []
        for i in range(5):
            r = p.reserve(key_of(f"flight-{i}"), root, nbytes)
            assert r is not None
            held.append(r)
        # 1 sealed parent (pinned by its in-flight children) + 5 in flight + 1 evictable spare:
        # 3 more pages can never fit, so the spare must survive the refusal
        with pytest.raises(CapacityError):
            p.reserve(key_of("flight-big"), None, self._pages(3))
        assert p.present([root, spare]) == [True, True]
        assert p.evict([root]).entries == 0  # the parent of in-flight entries stays
        assert p.present([root]) == [True]
        for i, r in enumerate(held):
            k = key_of(f"flight-{i}")
            r.write(0, page_bytes(k, nbytes))
            r.seal()
        assert p.longest_prefix([root, key_of("flight-0")]) == 2
        _check_budget(p)

    # ==========================================================================================
    # Leases
    # ==========================================================================================
    def test_lease_reports_presence(self, provider: Provider) -> None:
        keys = chain("lease-presence", 4)
        put_chain(provider, keys[:2], self._pages(1))
        stray = key_of("lease-stray")
        put_page(provider, stray, None, self._pages(1))
        lease = provider.lease([keys[0], keys[1], keys[2], stray])
        try:
            assert isinstance(lease, Lease)
            assert lease.present == (True, True, False, True)
            assert lease.prefix_len == 2
            assert set(lease.keys) == {keys[0], keys[1], stray}
        finally:
            lease.release()
        lease.release()  # releasing twice is a no-op
        assert lease.released

    def test_leased_entries_survive_pressure(self, provider_factory: ProviderFactory) -> None:
        p = provider_factory(8)
        nbytes = self._pages(1)
        keys = chain("lease-pressure", 3)
        put_chain(p, keys, nbytes)
        tip_only = key_of("lease-tip-parent")
        put_page(p, tip_only, None, nbytes)
        tip = key_of("lease-tip")
        put_page(p, tip, tip_only, nbytes)
        with p.lease([keys[0], keys[1], keys[2], tip]):
            for i in range(20):
                k = key_of(f"lease-filler-{i}")
                put_page(p, k, None, nbytes)
                _check_budget(p)
                assert p.present([*keys, tip_only, tip]) == [True] * 5  # ancestors of a leased tip too
            assert p.evict(nbytes=self._pages(8)).entries <= 3
            assert p.present([*keys, tip_only, tip]) == [True] * 5
        # released: now evictable
        p.evict(nbytes=self._pages(8))
        assert p.present([*keys, tip_only, tip]) == [False] * 5

    def test_evict_keys_skips_leased_and_ancestors(self, provider: Provider) -> None:
        nbytes = self._pages(1)
        keys = chain("evict-leased", 4)
        put_chain(provider, keys, nbytes)
        side = key_of("evict-leased-side")
        put_page(provider, side, keys[1], nbytes)
        with provider.lease([keys[2]]):
            report = provider.evict([keys[0]])
            # keys[3] and side go; keys[2] is leased, keys[1] and keys[0] are its ancestors
            assert provider.present(keys) == [True, True, True, False]
            assert provider.present([side]) == [False]
            assert report.entries == 2
            assert report.skipped >= 1
        assert provider.evict([keys[0]]).entries == 3
        assert provider.present(keys) == [False] * 4

    # ==========================================================================================
    # Dedup and concurrent reservation of one key
    # ==========================================================================================
    def test_dedup_of_sealed_key(self, provider: Provider) -> None:
        key = key_of("dedup")
        nbytes = self._pages(1)
        assert put_page(provider, key, None, nbytes)
        used = provider.stats().used_bytes
        assert provider.reserve(key, None, nbytes) is None
        assert provider.reserve(key, None, self._pages(2)) is None  # the size doesn't matter
        assert provider.put(key, None, b"\x00" * nbytes) is False
        assert provider.read_bytes(key) == page_bytes(key, nbytes)  # never overwritten
        assert provider.stats().used_bytes == used

    def test_in_flight_key(self, provider: Provider) -> None:
        key = key_of("inflight")
        nbytes = self._pages(1)
        res = provider.reserve(key, None, nbytes)
        assert res is not None
        assert provider.in_flight(key) is True
        assert provider.present([key]) == [False]
        assert provider.read(key, bytearray(nbytes)) is False
        with pytest.raises(InFlightError) as info:
            provider.reserve(key, None, nbytes)
        assert info.value.key == key
        assert provider.wait_sealed(key, 0.01) is False  # times out: still in flight
        assert provider.evict([key]).entries == 0  # evicting an in-flight key is not an abort
        assert provider.in_flight(key) is True
        done: list[bool] = []
        waiter = threading.Thread(target=lambda: done.append(provider.wait_sealed(key, 30.0)))
        waiter.start()
        res.write(0, page_bytes(key, nbytes))
        res.seal()
        waiter.join(60)
        assert done == [True]
        assert provider.in_flight(key) is False

    def test_wait_sealed_after_abort(self, provider: Provider) -> None:
        key = key_of("inflight-abort")
        nbytes = self._pages(1)
        res = provider.reserve(key, None, nbytes)
        assert res is not None
        done: list[bool] = []
        waiter = threading.Thread(target=lambda: done.append(provider.wait_sealed(key, 30.0)))
        waiter.start()
        res.abort()
        waiter.join(60)
        assert done == [False]
        res2 = provider.reserve(key, None, nbytes)  # the key is free again
        assert res2 is not None
        res2.abort()

    # ==========================================================================================
    # Two-phase writes
    # ==========================================================================================
    def test_abort_leaves_no_trace(self, provider: Provider) -> None:
        root = key_of("abort-root")
        nbytes = self._pages(2)
        put_page(provider, root, None, nbytes)
        used = provider.stats().used_bytes
        entries = provider.stats().entries
        key = key_of("abort")
        res = provider.reserve(key, root, nbytes, salt_tag="t")
        assert res is not None
        provider.write(res, 0, page_bytes(key, nbytes))  # fully written, still aborted
        provider.abort(res)
        assert res.state == "aborted"
        assert provider.present([key]) == [False]
        assert provider.in_flight(key) is False
        assert provider.read(key, bytearray(nbytes)) is False
        assert provider.entry(key) is None
        st = provider.stats()
        assert (st.used_bytes, st.entries) == (used, entries)
        # reservable again; a different content then seals exactly
        res = provider.reserve(key, root, nbytes)
        assert res is not None
        other = page_bytes(key_of("abort-other"), nbytes)
        provider.write(res, 0, other)
        provider.seal(res)
        assert provider.read_bytes(key) == other
        if self._has_backdoor_read():
            aborted = key_of("abort-backdoor")
            res = provider.reserve(aborted, None, nbytes)
            assert res is not None
            res.write(0, page_bytes(aborted, nbytes))
            res.abort()
            assert self.backdoor_read(provider, aborted) is None

    def test_seal_incomplete_write(self, provider: Provider) -> None:
        key = key_of("incomplete")
        nbytes = self._pages(2)
        data = page_bytes(key, nbytes)
        res = provider.reserve(key, None, nbytes)
        assert res is not None
        with pytest.raises(IncompleteWriteError):
            provider.seal(res)
        provider.write(res, 0, data[:4096])
        provider.write(res, 5000, data[5000:])
        with pytest.raises(IncompleteWriteError):
            provider.seal(res)
        assert provider.present([key]) == [False]
        assert res.state == "open"  # the reservation stays usable
        provider.write(res, 4096, data[4096:5000])
        provider.seal(res)
        assert provider.read_bytes(key) == data

    def test_reservation_after_seal_or_abort(self, provider: Provider) -> None:
        nbytes = self._pages(1)
        sealed_key, aborted_key = key_of("after-seal"), key_of("after-abort")
        sealed = provider.reserve(sealed_key, None, nbytes)
        assert sealed is not None
        provider.write(sealed, 0, page_bytes(sealed_key, nbytes))
        provider.seal(sealed)
        aborted = provider.reserve(aborted_key, None, nbytes)
        assert aborted is not None
        provider.abort(aborted)
        for res in (sealed, aborted):
            with pytest.raises(ReservationError):
                provider.write(res, 0, b"\x00" * 16)
            with pytest.raises(ReservationError):
                provider.seal(res)
        # abort after seal must not unpublish the entry (a no-op or a ReservationError)
        with contextlib.suppress(ReservationError):
            provider.abort(sealed)
        assert sealed.state == "sealed"
        assert provider.read_bytes(sealed_key) == page_bytes(sealed_key, nbytes)
        assert provider.present([aborted_key]) == [False]

    def test_reservation_regions(self, provider: Provider) -> None:
        key = key_of("regions")
        nbytes = self._pages(2) + 100
        res = provider.reserve(key, None, nbytes)
        assert res is not None
        try:
            regions = res.regions()
        except ReservationError:
            res.abort()
            pytest.skip("provider exposes no writable regions (writes go through write())")
        data = page_bytes(key, nbytes)
        offset = 0
        for r in regions:  # the copy engine's path: fill the memory, then mark it written
            assert r.offset == offset and not r.view.readonly
            r.view[:] = data[offset : offset + len(r.view)]
            offset += len(r.view)
        assert offset == nbytes
        with pytest.raises(IncompleteWriteError):
            provider.seal(res)
        res.mark_written()
        provider.seal(res)
        with pytest.raises(ReservationError):
            res.regions()
        assert provider.read_bytes(key) == data

    def test_reused_space_never_serves_an_evicted_key(self, provider_factory: ProviderFactory) -> None:
        p = provider_factory(4)
        nbytes = self._pages(1)
        old = [key_of(f"reuse-old-{i}") for i in range(4)]
        for k in old:
            put_page(p, k, None, nbytes)
        p.evict(old)
        new = [key_of(f"reuse-new-{i}") for i in range(4)]
        for k in new:  # very likely the same slots/blocks/files as the evicted entries
            put_page(p, k, None, nbytes)
        out = bytearray(nbytes)
        for k in old:
            assert p.read(k, out) is False
            assert p.entry(k) is None
        for k in new:
            assert p.read_bytes(k) == page_bytes(k, nbytes)

    def test_write_outside_reservation(self, provider: Provider) -> None:
        key = key_of("write-bounds")
        nbytes = self._pages(1)
        res = provider.reserve(key, None, nbytes)
        assert res is not None
        with pytest.raises(SpanError):
            provider.write(res, nbytes - 10, b"\x00" * 11)
        with pytest.raises(SpanError):
            provider.write(res, nbytes + 1, b"")
        with pytest.raises(InvalidArgumentError):
            provider.write(res, -1, b"\x00")
        with pytest.raises(InvalidArgumentError):
            provider.write(res, 1.0, b"\x00")  # type: ignore[arg-type]
        with pytest.raises(InvalidArgumentError):
            provider.write(res, 0, 12345)
        with pytest.raises(InvalidArgumentError):
            provider.write(res, 0, "text")
        assert res.state == "open"
        provider.write(res, 0, page_bytes(key, nbytes))
        provider.seal(res)
        assert provider.read_bytes(key) == page_bytes(key, nbytes)

    def test_foreign_reservation(self, provider_factory: ProviderFactory) -> None:
        p1, p2 = provider_factory(), provider_factory()
        key = key_of("foreign")
        nbytes = self._pages(1)
        res = p1.reserve(key, None, nbytes)
        assert res is not None
        with pytest.raises(ReservationError):
            p2.write(res, 0, page_bytes(key, nbytes))
        res.write(0, page_bytes(key, nbytes))
        with pytest.raises(ReservationError):
            p2.seal(res)
        with pytest.raises(ReservationError):
            p2.abort(res)
        with pytest.raises(ReservationError):
            p2.write("not a reservation", 0, b"\x00")  # type: ignore[arg-type]
        assert res.state == "open"
        res.seal()
        assert p1.present([key]) == [True]
        assert p2.present([key]) == [False]

    # ==========================================================================================
    # Spans
    # ==========================================================================================
    def test_read_spans(self, provider: Provider) -> None:
        key = key_of("spans")
        nbytes = self._pages(3)
        data = page_bytes(key, nbytes)
        put_page(provider, key, None, nbytes)
        for offset, n in [(0, nbytes), (0, 1), (1, 4095), (4096, 4096), (4095, 2), (nbytes - 1, 1),
                          (123, 7777), (nbytes, 0), (0, 0)]:
            out = bytearray(n)
            assert provider.read(key, out, ByteSpan(offset, n)) is True
            assert bytes(out) == data[offset : offset + n]
            assert provider.read_bytes(key, ByteSpan(offset, n)) == data[offset : offset + n]

    def test_bad_spans(self, provider: Provider) -> None:
        key = key_of("bad-spans")
        nbytes = self._pages(1)
        put_page(provider, key, None, nbytes)
        big = bytearray(2 * nbytes)
        for span in (ByteSpan(0, nbytes + 1), ByteSpan(nbytes, 1), ByteSpan(nbytes + 5, 0), ByteSpan(1, nbytes)):
            with pytest.raises(SpanError):
                provider.read(key, big, span)
        for args in ((-1, 1), (0, -1), ("0", 1), (0, 1.5), (True, 1)):
            with pytest.raises(SpanError):
                ByteSpan(*args)
        with pytest.raises(InvalidArgumentError):
            provider.read(key, big, (0, 10))  # type: ignore[arg-type]
        assert provider.read_bytes(key) == page_bytes(key, nbytes)  # unchanged

    # ==========================================================================================
    # Anchors
    # ==========================================================================================
    def test_anchors_put_get_list_replace(self, provider: Provider) -> None:
        key = key_of("anchors")
        put_page(provider, key, None, self._pages(1))
        provider.put_anchor(key, "ssm", anchor_bytes(key, "ssm", 300))
        provider.put_anchor(key, "hidden", bytearray(anchor_bytes(key, "hidden", 1000)))
        assert provider.get_anchor(key, "ssm") == anchor_bytes(key, "ssm", 300)
        assert provider.get_anchor(key, "hidden") == anchor_bytes(key, "hidden", 1000)
        assert provider.get_anchor(key, "missing") is None
        assert provider.list_anchors(key) == {"ssm": 300, "hidden": 1000}
        provider.put_anchor(key, "ssm", anchor_bytes(key, "ssm2", 50))  # replace
        assert provider.get_anchor(key, "ssm") == anchor_bytes(key, "ssm2", 50)
        assert provider.list_anchors(key) == {"ssm": 50, "hidden": 1000}
        info = provider.entry(key)
        assert info is not None and dict(info.anchors) == {"ssm": 50, "hidden": 1000}
        assert provider.read_bytes(key) == page_bytes(key, self._pages(1))  # the page is untouched

    def test_deepest_anchor(self, provider: Provider) -> None:
        keys = chain("deepest", 6)
        put_chain(provider, keys[:5], self._pages(1))
        assert provider.deepest_anchor(keys, "state") == 0
        provider.put_anchor(keys[1], "state", b"s1")
        provider.put_anchor(keys[3], "state", b"s3")
        provider.put_anchor(keys[4], "other", b"o4")
        assert provider.deepest_anchor(keys, "state") == 4
        assert provider.deepest_anchor(keys[:3], "state") == 2
        assert provider.deepest_anchor(keys, "other") == 5
        assert provider.deepest_anchor([keys[0], keys[5], keys[3]], "state") == 0  # after the stored prefix
        provider.evict([keys[3]])
        assert provider.deepest_anchor(keys, "state") == 2
        assert provider.deepest_anchor([], "state") == 0

    def test_anchors_count_in_budget(self, provider: Provider) -> None:
        key = key_of("anchor-budget")
        put_page(provider, key, None, self._pages(1))
        used = provider.stats().used_bytes
        provider.put_anchor(key, "big", anchor_bytes(key, "big", 10_000))
        assert provider.stats().used_bytes >= used + 10_000
        provider.put_anchor(key, "big", b"x")
        assert provider.stats().used_bytes < used + 10_000
        provider.evict([key])
        assert provider.stats().used_bytes == 0
        assert provider.get_anchor(key, "big") is None
        assert provider.list_anchors(key) == {}
        put_page(provider, key, None, self._pages(1))  # stored again: the old anchors are gone
        assert provider.list_anchors(key) == {}

    def test_anchor_errors(self, provider: Provider) -> None:
        key = key_of("anchor-errors")
        with pytest.raises(UnknownKeyError):
            provider.put_anchor(key, "state", b"x")
        res = provider.reserve(key, None, self._pages(1))
        assert res is not None
        with pytest.raises(UnknownKeyError):  # in flight is not stored
            provider.put_anchor(key, "state", b"x")
        res.write(0, page_bytes(key, self._pages(1)))
        res.seal()
        for bad in ("", "x" * 65, "tab\tname", "naïve", 7, None, b"state"):
            with pytest.raises(InvalidArgumentError):
                provider.put_anchor(key, bad, b"x")  # type: ignore[arg-type]
            with pytest.raises(InvalidArgumentError):
                provider.get_anchor(key, bad)  # type: ignore[arg-type]
            with pytest.raises(InvalidArgumentError):
                provider.deepest_anchor([key], bad)  # type: ignore[arg-type]
        with pytest.raises(InvalidArgumentError):
            provider.put_anchor(key, "state", 12)
        provider.put_anchor(key, "x" * 64, b"ok")
        assert provider.list_anchors(key) == {"x" * 64: 2}

    # ==========================================================================================
    # Typed errors for misuse
    # ==========================================================================================
    @pytest.mark.parametrize("bad", [b"short", b"x" * 33, "k" * 32, 42, None, bytearray(31)])
    def test_bad_keys(self, provider: Provider, bad: Any) -> None:
        good = key_of("bad-keys")
        put_page(provider, good, None, self._pages(1))
        calls: list[Callable[[], object]] = [
            lambda: provider.present([bad]),
            lambda: provider.longest_prefix([good, bad]),
            lambda: provider.entry(bad),
            lambda: provider.reserve(bad, None, 4096),
            lambda: provider.read(bad, bytearray(4096)),
            lambda: provider.in_flight(bad),
            lambda: provider.evict([bad]),
            lambda: provider.put_anchor(bad, "a", b"x"),
            lambda: provider.get_anchor(bad, "a"),
            lambda: provider.list_anchors(bad),
            lambda: provider.lease([bad]),
        ]
        if bad is not None:  # None is a valid parent (a root)
            calls.append(lambda: provider.deepest_anchor([bad], "a"))
            calls.append(lambda: provider.reserve(key_of("bad-keys-child"), bad, 4096))
        for call in calls:
            with pytest.raises(InvalidArgumentError):
                call()
        assert provider.stats().in_flight == 0
        assert provider.stats().entries == 1

    def test_single_key_instead_of_sequence(self, provider: Provider) -> None:
        key = key_of("not-a-sequence")
        for call in (provider.present, provider.longest_prefix, provider.lease, provider.evict):
            with pytest.raises(InvalidArgumentError):
                call(key)  # type: ignore[arg-type]

    @pytest.mark.parametrize("nbytes", [0, -4096, 4096.0, True, "4096", None])
    def test_bad_nbytes(self, provider: Provider, nbytes: Any) -> None:
        key = key_of("bad-nbytes")
        with pytest.raises(InvalidArgumentError):
            provider.reserve(key, None, nbytes)
        assert provider.in_flight(key) is False
        assert provider.stats().used_bytes == 0

    def test_bad_salt_tag(self, provider: Provider) -> None:
        with pytest.raises(InvalidArgumentError):
            provider.reserve(key_of("bad-tag"), None, 4096, salt_tag=5)  # type: ignore[arg-type]

    def test_self_parent(self, provider: Provider) -> None:
        key = key_of("self-parent")
        put_page(provider, key, None, self._pages(1))
        other = key_of("self-parent-2")
        with pytest.raises((InvalidArgumentError, UnknownKeyError)):
            provider.reserve(other, other, self._pages(1))
        assert provider.in_flight(other) is False

    def test_bad_evict_arguments(self, provider: Provider) -> None:
        key = key_of("bad-evict")
        put_page(provider, key, None, self._pages(1))
        for kwargs in ({}, {"keys": [key], "nbytes": 4096}, {"nbytes": -1}, {"nbytes": 1.5}, {"nbytes": "1"}):
            with pytest.raises(InvalidArgumentError):
                provider.evict(**kwargs)
        assert provider.present([key]) == [True]

    def test_bad_out_buffers(self, provider: Provider) -> None:
        key = key_of("bad-out")
        nbytes = self._pages(1)
        put_page(provider, key, None, nbytes)
        for out in (bytes(nbytes), bytearray(nbytes - 1), 17, "text", memoryview(bytearray(nbytes)).toreadonly(),
                    memoryview(bytearray(2 * nbytes))[::2]):
            with pytest.raises(InvalidArgumentError):
                provider.read(key, out)
        with pytest.raises(InvalidArgumentError):
            provider.read(key, bytearray(10), ByteSpan(0, 11))
        assert provider.read_bytes(key) == page_bytes(key, nbytes)

    def test_closed_provider(self, provider: Provider) -> None:
        key = key_of("closed")
        nbytes = self._pages(1)
        put_page(provider, key, None, nbytes)
        res = provider.reserve(key_of("closed-open"), None, nbytes)
        assert res is not None
        lease = provider.lease([key])
        provider.close()
        provider.close()  # idempotent
        assert provider.closed
        calls: list[Callable[[], object]] = [
            lambda: provider.present([key]),
            lambda: provider.longest_prefix([key]),
            lambda: provider.entry(key),
            lambda: provider.reserve(key_of("closed-2"), None, nbytes),
            lambda: provider.write(res, 0, b"\x00"),
            lambda: provider.seal(res),
            lambda: provider.read(key, bytearray(nbytes)),
            lambda: provider.read_bytes(key),
            lambda: provider.put(key_of("closed-3"), None, b"\x00" * nbytes),
            lambda: provider.in_flight(key),
            lambda: provider.wait_sealed(key, 0.01),
            lambda: provider.evict([key]),
            lambda: provider.evict(nbytes=1),
            lambda: provider.put_anchor(key, "a", b"x"),
            lambda: provider.get_anchor(key, "a"),
            lambda: provider.list_anchors(key),
            lambda: provider.deepest_anchor([key], "a"),
            lambda: provider.lease([key]),
            lambda: provider.stats(),
            lambda: provider.abort(res),
        ]
        for cap, method in ((SupportsIterate, "iter_entries"), (SupportsVerify, "verify")):
            if isinstance(provider, cap):
                calls.append(getattr(provider, method))
        if isinstance(provider, SupportsViews):
            calls.append(lambda: provider.view(lease, key))
        for call in calls:
            with pytest.raises(ClosedError):
                call()
        lease.release()  # releasing after close must not raise

    def test_use_after_fork(self, provider: Provider) -> None:
        if not hasattr(os, "fork"):
            pytest.skip("no os.fork on this platform")
        key = key_of("fork")
        nbytes = self._pages(1)
        put_page(provider, key, None, nbytes)
        res = provider.reserve(key_of("fork-open"), None, nbytes)
        assert res is not None
        calls: list[Callable[[], object]] = [
            lambda: provider.present([key]),
            lambda: provider.entry(key),
            lambda: provider.reserve(key_of("fork-2"), None, nbytes),
            lambda: provider.write(res, 0, b"\x00"),
            lambda: provider.seal(res),
            lambda: provider.abort(res),
            lambda: provider.read(key, bytearray(nbytes)),
            lambda: provider.in_flight(key),
            lambda: provider.evict([key]),
            lambda: provider.put_anchor(key, "a", b"x"),
            lambda: provider.get_anchor(key, "a"),
            lambda: provider.list_anchors(key),
            lambda: provider.lease([key]),
            lambda: provider.stats(),
        ]
        with warnings.catch_warnings():
            # Python 3.12+ warns about fork() in a multi-threaded process; the child only checks
            # that the provider refuses to be used, then exits without touching anything else.
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:  # pragma: no cover - runs in the child
            code = 0
            try:
                for i, call in enumerate(calls):
                    try:
                        call()
                        code = 10 + i  # no error at all
                        break
                    except UsedAfterForkError:
                        continue
                    except BaseException:
                        code = 50 + i  # a wrong error type
                        break
            finally:
                os._exit(code)
        code = _wait_child(pid, timeout=120.0)
        assert code == 0, _fork_failure(code, len(calls))
        # the parent is unaffected
        assert provider.read_bytes(key) == page_bytes(key, nbytes)
        res.write(0, page_bytes(key_of("fork-open"), nbytes))
        res.seal()

    def test_use_after_fork_while_busy(self, provider: Provider) -> None:
        """Fork while another thread is inside the provider (likely holding its lock): the child
        must get ``UsedAfterForkError`` at once, not wait forever on a lock copied in the held
        state."""
        if not hasattr(os, "fork"):
            pytest.skip("no os.fork on this platform")
        keys = chain("fork-busy", 4)
        nbytes = self._pages(1)
        put_chain(provider, keys, nbytes)
        stop = threading.Event()
        errors: list[BaseException] = []

        def busy() -> None:
            out = bytearray(nbytes)
            try:
                while not stop.is_set():
                    provider.present(keys)
                    provider.read(keys[-1], out)
                    with provider.lease(keys):
                        pass
            except BaseException as exc:
                errors.append(exc)

        worker = threading.Thread(target=busy)
        worker.start()
        codes = []
        try:
            for _ in range(5):
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", DeprecationWarning)
                    pid = os.fork()
                if pid == 0:  # pragma: no cover - runs in the child
                    code = 1
                    try:
                        provider.present(keys)
                    except UsedAfterForkError:
                        code = 0
                    except BaseException:
                        code = 2
                    finally:
                        os._exit(code)
                codes.append(_wait_child(pid, timeout=20.0))
                if codes[-1] != 0:
                    break  # one hung or wrong child is the finding; don't wait on more
        finally:
            stop.set()
            worker.join(60)
        assert errors == []
        assert codes == [0] * 5, "; ".join(
            "ok" if c == 0 else "no error in the child" if c == 1 else _fork_failure(c, 1) for c in codes
        )

    # ==========================================================================================
    # Threads
    # ==========================================================================================
    def test_threads_shared_and_distinct_chains(self, provider_factory: ProviderFactory) -> None:
        p = provider_factory(48)
        nbytes = self._pages(1)
        shared = chain("threads-shared", 12)
        errors: list[str] = []
        counts = {"reads": 0, "hits": 0}
        lock = threading.Lock()
        stop = threading.Event()

        def save(keys: Sequence[Key]) -> None:
            parent: Key | None = None
            for k in keys:
                try:
                    res = p.reserve(k, parent, nbytes)
                except InFlightError:
                    if not p.wait_sealed(k, 30.0):
                        return  # the other writer aborted or the entry was evicted: stop this chain
                    parent = k
                    continue
                except (UnknownKeyError, CapacityError):
                    return  # parent evicted under pressure, or everything leased right now
                if res is not None:
                    res.write(0, page_bytes(k, nbytes))
                    res.seal()
                parent = k

        def writer(w: int) -> None:
            try:
                for i in range(self.thread_ops // 10):
                    save(shared[: 4 + (i + w) % 8])
                    save(chain(f"threads-w{w}-{i}", 1 + i % 4))
                    _check_budget(p)
            except BaseException as exc:  # report, don't hang the test
                errors.append(f"writer {w}: {exc!r}")

        def reader(r: int) -> None:
            try:
                out = bytearray(nbytes)
                i = 0
                while not stop.is_set() or i < 20:
                    k = shared[(r + i) % len(shared)] if i % 2 else chain(f"threads-w{r}-{i % 15}", 1)[0]
                    hit = p.read(k, out)
                    if hit and bytes(out) != page_bytes(k, nbytes):
                        errors.append(f"reader {r}: wrong bytes for {k.hex()[:12]}")
                    with p.lease(shared) as lease:
                        for j in range(lease.prefix_len):
                            if not p.read(shared[j], out):
                                errors.append(f"reader {r}: leased {j} missing")
                            elif bytes(out) != page_bytes(shared[j], nbytes):
                                errors.append(f"reader {r}: wrong leased bytes at {j}")
                    with lock:
                        counts["reads"] += 1
                        counts["hits"] += hit
                    i += 1
            except BaseException as exc:
                errors.append(f"reader {r}: {exc!r}")

        writers = [threading.Thread(target=writer, args=(w,)) for w in range(self.thread_count)]
        readers = [threading.Thread(target=reader, args=(r,)) for r in range(self.thread_count)]
        for t in writers + readers:
            t.start()
        for t in writers:
            t.join(300)
        stop.set()
        for t in readers:
            t.join(300)
        assert not any(t.is_alive() for t in writers + readers), "threads deadlocked"
        assert errors == []
        assert counts["reads"] > 0
        st = p.stats()
        assert st.used_bytes <= st.budget_bytes
        assert st.in_flight == 0
        n = p.longest_prefix(shared)
        for k in shared[:n]:
            assert p.read_bytes(k) == page_bytes(k, nbytes)

    # ==========================================================================================
    # Reopen (persistent providers)
    # ==========================================================================================
    def test_reopen_keeps_sealed_entries(self, provider: Provider, request: pytest.FixtureRequest) -> None:
        if not self.supports_reopen:
            pytest.skip("provider does not survive close/reopen")
        nbytes = self._pages(1)
        a = chain("reopen-a", 4)
        b = chain("reopen-b", 2)
        put_chain(provider, a, nbytes)
        put_chain(provider, b, self._pages(3), parent=a[1])
        provider.put_anchor(a[3], "state", anchor_bytes(a[3], "state", 777))
        provider.put_anchor(b[1], "mtp", b"w")
        st = provider.stats()
        pending = key_of("reopen-pending")
        res = provider.reserve(pending, a[3], nbytes)
        assert res is not None
        res.write(0, page_bytes(pending, nbytes))  # written but never sealed
        p2 = self._reopen_tracked(provider, request)
        assert p2.present([*a, *b, pending]) == [True] * 6 + [False]
        for k in a:
            assert p2.read_bytes(k) == page_bytes(k, nbytes)
        for k in b:
            assert p2.read_bytes(k) == page_bytes(k, self._pages(3))
        assert p2.get_anchor(a[3], "state") == anchor_bytes(a[3], "state", 777)
        assert p2.list_anchors(b[1]) == {"mtp": 1}
        assert p2.deepest_anchor(a, "state") == 4
        info = p2.entry(b[0])
        assert info is not None and info.parent == a[1] and info.nbytes == self._pages(3)
        st2 = p2.stats()
        assert (st2.entries, st2.used_bytes, st2.budget_bytes) == (st.entries, st.used_bytes, st.budget_bytes)
        assert st2.in_flight == 0
        assert p2.in_flight(pending) is False
        res2 = p2.reserve(pending, a[3], nbytes)  # the unsealed reservation left nothing behind
        assert res2 is not None
        res2.write(0, page_bytes(pending, nbytes))
        res2.seal()
        assert p2.read_bytes(pending) == page_bytes(pending, nbytes)

    def test_reopen_after_evictions(self, provider_factory: ProviderFactory, request: pytest.FixtureRequest) -> None:
        if not self.supports_reopen:
            pytest.skip("provider does not survive close/reopen")
        p = provider_factory(8)
        nbytes = self._pages(1)
        keys = [key_of(f"reopen-evict-{i}") for i in range(20)]
        for k in keys:
            put_page(p, k, None, nbytes)
        p.evict([keys[-1]])
        before = p.present(keys)
        st = p.stats()
        p2 = self._reopen_tracked(p, request)
        assert p2.present(keys) == before
        for k, hit in zip(keys, before, strict=True):
            if hit:
                assert p2.read_bytes(k) == page_bytes(k, nbytes)
        st2 = p2.stats()
        assert (st2.entries, st2.used_bytes) == (st.entries, st.used_bytes)
        # still bounded and usable after reopen
        for i in range(10):
            put_page(p2, key_of(f"reopen-evict-more-{i}"), None, nbytes)
            _check_budget(p2)

    # ==========================================================================================
    # Optional powers (skipped, never failed, when absent)
    # ==========================================================================================
    def test_iterate(self, provider: Provider) -> None:
        if not isinstance(provider, SupportsIterate):
            pytest.skip("provider has no iter_entries()")
        keys = chain("iterate", 3)
        put_chain(provider, keys, self._pages(1))
        provider.put_anchor(keys[2], "s", b"abc")
        infos = {i.key: i for i in provider.iter_entries()}
        assert set(infos) == set(keys)
        assert infos[keys[1]].parent == keys[0]
        assert dict(infos[keys[2]].anchors) == {"s": 3}
        assert all(i.nbytes == self._pages(1) for i in infos.values())

    def test_verify_clean_and_corrupt(self, provider: Provider) -> None:
        if not isinstance(provider, SupportsVerify):
            pytest.skip("provider has no verify()")
        keys = chain("verify", 3)
        put_chain(provider, keys, self._pages(1))
        other = key_of("verify-other")
        put_page(provider, other, None, self._pages(1))
        report = provider.verify()
        assert report.ok and report.checked == 4 and report.corrupt == []
        progress: list[tuple[int, int]] = []
        self._backdoor_corrupt(provider, keys[1])
        report = provider.verify(progress=lambda done, total: progress.append((done, total)))
        assert report.corrupt == [keys[1]]
        assert not report.ok
        assert progress and progress[-1][0] == progress[-1][1]
        assert provider.present(keys) == [True, True, True]  # no repair: reported only
        report = provider.verify(repair=True)
        assert report.corrupt == [keys[1]]
        assert report.dropped == 2  # keys[1] and its subtree
        assert provider.present([*keys, other]) == [True, False, False, True]
        assert provider.verify().ok

    def test_prefetch_is_a_harmless_hint(self, provider: Provider) -> None:
        """``prefetch`` of stored and unknown keys returns without error and changes nothing:
        the same entries are present and read back exactly."""
        keys = chain("prefetch", 3)
        put_chain(provider, keys, self._pages(1))
        missing = key_of("prefetch-missing")
        provider.prefetch([*keys, missing])
        provider.prefetch([])
        assert provider.present([*keys, missing]) == [True, True, True, False]
        assert all(provider.read_bytes(k) == page_bytes(k, self._pages(1)) for k in keys)

    def test_batch_put_many_read_many(self, provider: Provider) -> None:
        if not isinstance(provider, SupportsBatch):
            pytest.skip("provider has no batch capability (put_many/read_many)")
        nbytes = self._pages(1)
        keys = chain("batch", 6)
        items = [(k, keys[i - 1] if i else None, page_bytes(k, nbytes)) for i, k in enumerate(keys)]
        assert provider.put_many(items) == [True] * 6  # parents are earlier items of the call
        assert provider.longest_prefix(keys) == 6
        assert provider.put_many(items[:2]) == [False, False]  # dedup
        orphan, child = key_of("batch-orphan"), key_of("batch-orphan-child")
        got = provider.put_many([(orphan, key_of("batch-no-parent"), page_bytes(orphan, nbytes)),
                                 (child, orphan, page_bytes(child, nbytes))])
        assert isinstance(got[0], UnknownKeyError)
        assert isinstance(got[1], HostKVError)  # its parent failed
        assert provider.present([orphan, child]) == [False, False]
        outs = [bytearray(nbytes) for _ in range(7)]
        assert provider.read_many([*keys, key_of("batch-miss")], outs) == [True] * 6 + [False]
        assert [bytes(o) for o in outs[:6]] == [page_bytes(k, nbytes) for k in keys]
        with pytest.raises(InvalidArgumentError):
            provider.read_many(keys[:1], [bytearray(nbytes - 1)])
        _check_budget(provider)

    def test_views(self, provider: Provider) -> None:
        if not isinstance(provider, SupportsViews):
            pytest.skip("provider has no view()")
        key = key_of("views")
        nbytes = self._pages(3)
        put_page(provider, key, None, nbytes)
        missing = key_of("views-missing")
        with provider.lease([key, missing]) as lease:
            regions = provider.view(lease, key)
            assert regions is not None
            offset = 0
            joined = bytearray()
            for r in regions:
                assert r.offset == offset
                assert r.view.readonly
                joined += r.view
                offset += len(r.view)
            assert bytes(joined) == page_bytes(key, nbytes)
            assert provider.view(lease, missing) is None
        with pytest.raises(InvalidArgumentError):
            provider.view(lease, key)  # released

    def test_batch_views(self, provider: Provider) -> None:
        if not isinstance(provider, SupportsBatchViews):
            pytest.skip("provider has no views()")
        keys = chain("batch-views", 4)
        nbytes = self._pages(2)
        put_chain(provider, keys, nbytes)
        missing = key_of("batch-views-missing")
        with provider.lease(keys[:3]) as lease:
            # order kept; a key not stored and a stored key outside the lease are both None
            got = provider.views(lease, [keys[2], missing, keys[0], keys[3], keys[1]])
            assert len(got) == 5 and got[1] is None and got[3] is None
            for k, regions in ((keys[2], got[0]), (keys[0], got[2]), (keys[1], got[4])):
                assert regions is not None
                assert all(r.view.readonly for r in regions)
                assert b"".join(bytes(r.view) for r in regions) == page_bytes(k, nbytes)
            assert provider.views(lease, []) == []
            with pytest.raises(InvalidArgumentError):
                provider.views(lease, [b"short"])  # type: ignore[list-item]  # not a key
        with pytest.raises(InvalidArgumentError):
            provider.views(lease, keys[:1])  # released

    # ==========================================================================================
    # Checksums and backdoors
    # ==========================================================================================
    def test_backdoor_read_matches(self, provider: Provider) -> None:
        keys = chain("backdoor", 3)
        put_chain(provider, keys, self._pages(2))
        for k in keys:
            assert self._backdoor_read(provider, k) == page_bytes(k, self._pages(2))
        provider.evict([keys[1]])
        assert self._backdoor_read(provider, keys[1]) is None
        assert self._backdoor_read(provider, keys[2]) is None

    def test_checksum_failure_is_a_miss(self, provider: Provider) -> None:
        keys = chain("corrupt", 4)
        nbytes = self._pages(2)
        put_chain(provider, keys, nbytes)
        side = key_of("corrupt-side")
        put_page(provider, side, keys[0], nbytes)
        failures = provider.stats().checksum_failures
        self._backdoor_corrupt(provider, keys[1])
        out = bytearray(nbytes)
        assert provider.read(keys[1], out) is False
        assert provider.stats().checksum_failures == failures + 1
        assert provider.present([*keys, side]) == [True, False, False, False, True]
        assert provider.read_bytes(keys[0]) == page_bytes(keys[0], nbytes)
        assert provider.read_bytes(side) == page_bytes(side, nbytes)
        # the chain can be saved again from its first missing page
        put_chain(provider, keys[1:], nbytes, parent=keys[0])
        for k in keys:
            assert provider.read_bytes(k) == page_bytes(k, nbytes)
        _check_budget(provider)

    def test_checksum_failure_on_span_read(self, provider: Provider) -> None:
        key = key_of("corrupt-span")
        nbytes = self._pages(2)
        put_page(provider, key, None, nbytes)
        self._backdoor_corrupt(provider, key)
        assert provider.read(key, bytearray(16), ByteSpan(100, 16)) is False
        assert provider.present([key]) == [False]

    # ==========================================================================================
    # The stateful model
    # ==========================================================================================
    def test_stateful(self, tmp_path: Path) -> None:
        pytest.importorskip("hypothesis", reason="the stateful model needs hypothesis (pip install hypothesis)")
        from hostkv_providers.testing._stateful import run_provider_state_machine

        run_provider_state_machine(self, tmp_path, **self.stateful_settings)

    # -- private -------------------------------------------------------------------------------
    def _has_backdoor_read(self) -> bool:
        return type(self).backdoor_read is not ProviderTests.backdoor_read


def _close_quietly(p: Provider) -> None:
    try:
        p.close()
    except HostKVError as exc:  # teardown must not mask the test's own failure
        warnings.warn(f"closing {type(p).__name__} failed: {exc!r}", stacklevel=2)


def _check_budget(p: Provider) -> None:
    st = p.stats()
    assert 0 <= st.used_bytes <= st.budget_bytes, f"used {st.used_bytes} > budget {st.budget_bytes}"


def _check_closure(p: Provider, parents: dict[Key, Key | None]) -> None:
    keys = list(parents)
    hits = dict(zip(keys, p.present(keys), strict=True))
    for k, parent in parents.items():
        if hits[k] and parent is not None:
            assert hits[parent], f"{k.hex()[:12]} is present but its parent {parent.hex()[:12]} is not"


def _wait_child(pid: int, timeout: float) -> int:
    """Exit code of a forked child; SIGKILL it (and report a hang) after ``timeout`` seconds.

    A provider that takes a lock before its fork check can hang forever in the child when another
    thread held that lock at fork time; the suite must fail, not hang, on that.
    """
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return -999
        time.sleep(0.005)


def _fork_failure(code: int, ncalls: int) -> str:
    if 10 <= code < 10 + ncalls:
        return f"call #{code - 10} succeeded in a forked child (expected UsedAfterForkError)"
    if 50 <= code < 50 + ncalls:
        return f"call #{code - 50} raised the wrong error in a forked child"
    if code == -999:
        return "the forked child hung (a lock taken before the fork check?) and was killed"
    return f"child exited with {code}"

