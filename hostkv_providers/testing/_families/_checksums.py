"""Conformance family: checksums through the backdoors (never wrong bytes)."""

from __future__ import annotations

from hostkv_providers._provider import Provider
from hostkv_providers._span import ByteSpan
from hostkv_providers.testing._pages import chain, key_of, page_bytes, put_chain, put_page

from ._base import SuiteBase, _check_budget


class ChecksumTests(SuiteBase):
    """Conformance tests: checksums through the backdoors (never wrong bytes)."""

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
