"""Conformance family: reopen of persistent providers."""

from __future__ import annotations

import pytest

from hostkv_providers._provider import Provider
from hostkv_providers.testing._pages import anchor_bytes, chain, key_of, page_bytes, put_chain, put_page

from ._base import ProviderFactory, SuiteBase, _check_budget


class PersistenceTests(SuiteBase):
    """Conformance tests: reopen of persistent providers."""

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
