"""Conformance family: round trips, buffers, presence and chains, misses, stats, spans."""

from __future__ import annotations

import itertools

import pytest

from hostkv_providers._errors import InvalidArgumentError, SpanError
from hostkv_providers._provider import Provider
from hostkv_providers._span import ByteSpan
from hostkv_providers.testing._pages import chain, key_of, page_bytes, put_chain, put_page

from ._base import SuiteBase, _check_budget


class BasicTests(SuiteBase):
    """Conformance tests: round trips, buffers, presence and chains, misses, stats, spans."""

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
        page = self.page_nbytes  # (cut points scale with it: any page_nbytes >= 64 works)
        cuts = [0, page // 4 - 3, page, page + page // 4, 2 * page + page // 5, nbytes]
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
        q = nbytes // 4 // 8 * 8  # (8-aligned: the rest is read as uint32s, the whole as float64s)
        provider.write(res, 0, memoryview(data)[:q])
        provider.write(res, q, bytearray(data[q:2 * q]))
        provider.write(res, 2 * q, np.frombuffer(data[2 * q:], dtype=np.uint32))  # not a "B" format
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
    # Spans
    # ==========================================================================================
    def test_read_spans(self, provider: Provider) -> None:
        key = key_of("spans")
        nbytes = self._pages(3)
        data = page_bytes(key, nbytes)
        put_page(provider, key, None, nbytes)
        page = self.page_nbytes
        for offset, n in [(0, nbytes), (0, 1), (1, page - 1), (page, page), (page - 1, 2), (nbytes - 1, 1),
                          (page // 33, 2 * page - page // 5), (nbytes, 0), (0, 0)]:
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
