"""Conformance family: typed errors for every kind of misuse (keys, sizes, tags, buffers)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from hostkv_providers._errors import InvalidArgumentError, UnknownKeyError
from hostkv_providers._provider import Provider
from hostkv_providers._span import ByteSpan
from hostkv_providers.testing._pages import key_of, page_bytes, put_page

from ._base import SuiteBase


class MisuseTests(SuiteBase):
    """Conformance tests: typed errors for every kind of misuse (keys, sizes, tags, buffers)."""

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
