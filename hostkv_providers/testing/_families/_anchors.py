"""Conformance family: anchors (put/get/list/replace, deepest, budget, errors)."""

from __future__ import annotations

import pytest

from hostkv_providers._errors import InvalidArgumentError, UnknownKeyError
from hostkv_providers._provider import Provider
from hostkv_providers.testing._pages import anchor_bytes, chain, key_of, page_bytes, put_chain, put_page

from ._base import SuiteBase


class AnchorTests(SuiteBase):
    """Conformance tests: anchors (put/get/list/replace, deepest, budget, errors)."""

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

    def test_read_anchor_into_buffers(self, provider: Provider) -> None:
        key = key_of("read-anchor")
        put_page(provider, key, None, self._pages(1))
        blob = anchor_bytes(key, "state", 5000)
        provider.put_anchor(key, "state", blob)
        one = bytearray(6000)  # one buffer, larger than the anchor
        assert provider.read_anchor(key, "state", one) == 5000
        assert bytes(one[:5000]) == blob
        head, body = bytearray(48), memoryview(bytearray(4952))  # a scatter read: header, then body
        assert provider.read_anchor(key, "state", [head, body]) == 5000
        assert bytes(head) + bytes(body) == blob
        assert provider.read_anchor(key, "missing", one) is None
        assert provider.read_anchor(key_of("read-anchor-absent"), "state", one) is None
        with pytest.raises(InvalidArgumentError):  # too small together
            provider.read_anchor(key, "state", [bytearray(48), bytearray(100)])
        with pytest.raises(InvalidArgumentError):  # read-only
            provider.read_anchor(key, "state", bytes(6000))
        with pytest.raises(InvalidArgumentError):
            provider.read_anchor(key, "state", [])
        assert provider.get_anchor(key, "state") == blob  # nothing changed
