"""Conformance family: leases (presence, pinning under pressure, evict(keys) skips them)."""

from __future__ import annotations

from hostkv_providers._provider import Provider
from hostkv_providers._reservation import Lease
from hostkv_providers.testing._pages import chain, key_of, put_chain, put_page

from ._base import ProviderFactory, SuiteBase, _check_budget


class LeaseTests(SuiteBase):
    """Conformance tests: leases (presence, pinning under pressure, evict(keys) skips them)."""

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
