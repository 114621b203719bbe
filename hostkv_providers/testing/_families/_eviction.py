"""Conformance family: the prefix-closed tree, LRU-leaf eviction order, the budget and the
satisfiability guard."""

from __future__ import annotations

import pytest

from hostkv_providers._errors import CapacityError, UnknownKeyError
from hostkv_providers._keys import Key
from hostkv_providers._provider import Provider
from hostkv_providers.testing._pages import chain, key_of, page_bytes, put_chain, put_page

from ._base import ProviderFactory, SuiteBase, _check_budget, _check_closure


class EvictionTests(SuiteBase):
    """Conformance tests: the prefix-closed tree, LRU-leaf eviction order, the budget and the"""

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
