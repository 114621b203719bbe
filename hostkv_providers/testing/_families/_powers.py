"""Conformance family: the optional powers (skipped, never failed, when a provider lacks one)."""

from __future__ import annotations

import contextlib

import pytest

from hostkv_providers._capabilities import (
    SupportsBatch,
    SupportsBatchViews,
    SupportsIterate,
    SupportsVerify,
    SupportsViews,
)
from hostkv_providers._errors import HostKVError, InvalidArgumentError, UnknownKeyError
from hostkv_providers._provider import Provider
from hostkv_providers.testing._pages import chain, key_of, page_bytes, put_chain, put_page

from ._base import SuiteBase, _check_budget


class CapabilityTests(SuiteBase):
    """Conformance tests: the optional powers (skipped, never failed, when a provider lacks one)."""

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

    def test_batch_read_into_aliased_outs_loses_nothing(self, provider: Provider) -> None:
        """``read_many`` with one output buffer for two keys (a caller's bug): a typed error or
        some result, but no stored entry is taken for corrupt (a copy into the shared buffer
        overwrote the other's bytes before their check) and none is dropped."""
        if not isinstance(provider, SupportsBatch):
            pytest.skip("provider has no batch capability (put_many/read_many)")
        nbytes = self._pages(1)
        keys = chain("batch-alias", 3)
        put_chain(provider, keys, nbytes)
        failures = provider.stats().checksum_failures
        buf = bytearray(nbytes)
        with contextlib.suppress(HostKVError):
            provider.read_many(keys[1:], [buf, buf])
        wide = memoryview(bytearray(nbytes + nbytes // 2))
        with contextlib.suppress(HostKVError):  # (overlapping, not equal)
            provider.read_many(keys[1:], [wide[:nbytes], wide[nbytes // 2:]])
        assert provider.stats().checksum_failures == failures
        assert provider.present(keys) == [True] * 3
        assert [provider.read_bytes(k) for k in keys] == [page_bytes(k, nbytes) for k in keys]

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
