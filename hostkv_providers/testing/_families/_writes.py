"""Conformance family: two-phase writes (dedup, in-flight keys, abort, holes, regions, reuse)."""

from __future__ import annotations

import contextlib
import threading

import pytest

from hostkv_providers._errors import (
    IncompleteWriteError,
    InFlightError,
    InvalidArgumentError,
    ReservationError,
    SpanError,
)
from hostkv_providers._provider import Provider
from hostkv_providers.testing._pages import key_of, page_bytes, put_page

from ._base import ProviderFactory, SuiteBase


class WriteTests(SuiteBase):
    """Conformance tests: two-phase writes (dedup, in-flight keys, abort, holes, regions, reuse)."""

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
        page = self.page_nbytes
        gap = page + page // 4
        provider.write(res, 0, data[:page])
        provider.write(res, gap, data[gap:])
        with pytest.raises(IncompleteWriteError):
            provider.seal(res)
        assert provider.present([key]) == [False]
        assert res.state == "open"  # the reservation stays usable
        provider.write(res, page, data[page:gap])
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
