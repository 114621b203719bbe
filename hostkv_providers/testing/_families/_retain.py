"""Conformance family: retained prefixes (``SupportsRetain``) — never evicted for room while
marked, the budget share, all-or-nothing marking, ``RetainedError`` on explicit eviction, and
marks that persist for persistent providers."""

from __future__ import annotations

import pytest

from hostkv_providers._capabilities import SupportsRetain
from hostkv_providers._errors import CapacityError, RetainedError, UnknownKeyError
from hostkv_providers._provider import Provider
from hostkv_providers.testing._pages import chain, key_of, page_bytes, put_chain, put_page

from ._base import ProviderFactory, SuiteBase, _check_budget, _check_closure


def _retaining(provider: Provider) -> SupportsRetain:
    if not isinstance(provider, SupportsRetain):
        pytest.skip(f"{provider.name} does not support retain/unretain")
    return provider


class RetainTests(SuiteBase):
    """Conformance tests: retained prefixes (skipped where ``SupportsRetain`` is absent)."""

    def test_retained_prefix_survives_pressure(self, provider_factory: ProviderFactory) -> None:
        p = provider_factory(16)
        r = _retaining(p)
        nbytes = self._pages(1)
        prompt = chain("retain-prompt", 3)
        put_chain(p, prompt, nbytes)
        assert r.retain([prompt[-1]]) == 1
        info = p.entry(prompt[-1])
        assert info is not None and info.retained
        root = p.entry(prompt[0])
        assert root is not None and not root.retained  # an ancestor is kept, not marked
        st = p.stats()
        assert st.retained == 1 and st.retained_bytes >= 3 * nbytes
        # far more than the budget passes through: the retained chain stays, whole and readable
        for i in range(40):
            put_page(p, key_of(f"retain-filler-{i}"), None, nbytes)
            _check_budget(p)
        assert p.present(prompt) == [True, True, True]
        for k in prompt:
            assert p.read_bytes(k) == page_bytes(k, nbytes)
        p.evict(nbytes=1 << 40)  # eviction for room by policy skips them too
        assert p.present(prompt) == [True, True, True]
        # unretained, they are ordinary entries again
        assert r.unretain([prompt[-1], prompt[-1], key_of("retain-not-stored")]) == 1
        assert r.unretain([prompt[-1]]) == 0
        assert p.stats().retained == 0 and p.stats().retained_bytes == 0
        p.evict(nbytes=1 << 40)
        assert p.present(prompt) == [False, False, False]

    def test_retain_is_all_or_nothing(self, provider: Provider) -> None:
        r = _retaining(provider)
        nbytes = self._pages(1)
        keys = chain("retain-aon", 2)
        put_chain(provider, keys, nbytes)
        with pytest.raises(UnknownKeyError):
            r.retain([keys[1], key_of("retain-aon-missing")])
        info = provider.entry(keys[1])
        assert info is not None and not info.retained and provider.stats().retained == 0
        res = provider.reserve(key_of("retain-aon-flight"), None, nbytes)
        assert res is not None
        with pytest.raises(UnknownKeyError):  # in flight is not sealed
            r.retain([res.key])
        res.abort()
        assert r.retain([keys[0], keys[1], keys[1]]) == 2
        assert r.retain(keys) == 0  # already marked: nothing new
        assert provider.stats().retained == 2

    def test_retain_share_bounds_the_retained_bytes(self, provider_factory: ProviderFactory) -> None:
        p = provider_factory(16)
        r = _retaining(p)
        nbytes = self._pages(1)
        big = chain("retain-share-big", 10)  # 10 of 16 pages: more than the default share (0.5)
        put_chain(p, big, nbytes)
        with pytest.raises(CapacityError) as info:
            r.retain([big[-1]])
        assert "retain_share" in info.value.hint
        assert p.stats().retained == 0 and p.stats().retained_bytes == 0
        assert r.retain([big[3]]) == 1  # 4 pages fit
        with pytest.raises(CapacityError):  # 4 retained + 6 more ancestors would not
            r.retain([big[-1]])
        assert p.stats().retained == 1

    def test_explicit_evict_of_retained_raises(self, provider: Provider) -> None:
        r = _retaining(provider)
        nbytes = self._pages(1)
        keys = chain("retain-evict", 3)
        side = key_of("retain-evict-side")
        put_chain(provider, keys, nbytes)
        put_page(provider, side, keys[0], nbytes)
        r.retain([keys[1]])
        for target in ([keys[1]], [keys[0]], [side, keys[0]]):  # the entry, its ancestor, a batch
            with pytest.raises(RetainedError):
                provider.evict(target)
            assert provider.present([*keys, side]) == [True, True, True, True]
        report = provider.evict([keys[2], side])  # not retained, not ancestors of one: they go
        assert report.entries == 2
        assert provider.present(keys) == [True, True, False]
        _check_closure(provider, {keys[0]: None, keys[1]: keys[0]})

    def test_reservations_never_evict_retained(self, provider_factory: ProviderFactory) -> None:
        p = provider_factory(8)
        r = _retaining(p)
        nbytes = self._pages(1)
        keep = chain("retain-room", 3)
        put_chain(p, keep, nbytes)
        r.retain([keep[-1]])
        with pytest.raises(CapacityError):  # 3 of 8 pages are retained: 6 can never fit
            p.reserve(key_of("retain-room-big"), None, 6 * nbytes)
        assert p.present(keep) == [True, True, True]
        assert put_page(p, key_of("retain-room-ok"), None, 5 * nbytes)
        assert p.present(keep) == [True, True, True]
        _check_budget(p)

    def test_retained_marks_persist(self, provider: Provider, request: pytest.FixtureRequest) -> None:
        r = _retaining(provider)
        nbytes = self._pages(1)
        keys = chain("retain-persist", 3)
        other = chain("retain-persist-other", 2)
        put_chain(provider, keys, nbytes)
        put_chain(provider, other, nbytes)
        r.retain([keys[2], other[1]])
        r.unretain([other[1]])
        fresh = self._reopen_tracked(provider, request)
        rf = _retaining(fresh)
        marks = {k: (i.retained if (i := fresh.entry(k)) is not None else None) for k in (*keys, *other)}
        assert marks == {keys[0]: False, keys[1]: False, keys[2]: True, other[0]: False, other[1]: False}
        st = fresh.stats()
        assert st.retained == 1 and st.retained_bytes >= 3 * nbytes
        with pytest.raises(RetainedError):
            fresh.evict([keys[0]])
        assert rf.unretain([keys[2]]) == 1
        again = self._reopen_tracked(fresh, request)
        info = again.entry(keys[2])
        assert info is not None and not info.retained and again.stats().retained == 0
