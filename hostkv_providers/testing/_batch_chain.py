"""Conformance tests of chain reservation: ``reserve_many`` / ``seal_many``.

Mixed into :class:`~hostkv_providers.testing.ProviderTests`, so every provider runs them: the
base class's default (bytes kept in host buffers, stored at seal) and the overrides of providers
that hand out their own memory (``pinned``, ``tiered``) keep the same rules:

* a parent may be an earlier key of the same call, or of an earlier call still in flight;
* nothing is visible before its seal; ``seal_many`` publishes root first;
* all or a prefix: the first key that cannot be reserved ends the call with its typed error, and
  a seal that fails takes every later page of the call whose parent it was with it;
* the budget holds throughout.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from hostkv_providers._blockhash import TREE_ALGORITHM, tree_checksum
from hostkv_providers._chain import ReservedChain
from hostkv_providers._checksum import CHECKSUM_ALGORITHM, checksum
from hostkv_providers._errors import (
    CapacityError,
    HostKVError,
    IncompleteWriteError,
    InFlightError,
    InvalidArgumentError,
    ReservationError,
    UnknownKeyError,
)
from hostkv_providers._keys import Key
from hostkv_providers._provider import Provider
from hostkv_providers._reservation import Reservation
from hostkv_providers.testing._families._base import SuiteBase
from hostkv_providers.testing._pages import chain, page_bytes, put_chain

__all__ = ["BatchChainTests"]


def _fill(res: Reservation) -> None:
    """Write the deterministic page of ``res.key``: through its regions where the provider
    exposes them (the copy engine's way), else through ``write``."""
    data = page_bytes(res.key, res.nbytes)
    try:
        regions = res.regions()
    except (ReservationError, HostKVError):
        regions = None
    if regions is None:
        res.write(0, data)
        return
    src = np.frombuffer(data, dtype=np.uint8)
    for r in regions:
        dst = np.frombuffer(r.view, dtype=np.uint8)
        dst[:] = src[r.offset : r.offset + dst.nbytes]
    res.mark_written()


def _parents(keys: Sequence[Key], first: Key | None = None) -> list[Key | None]:
    return [first, *keys[:-1]]


def _fill_chain(rc: ReservedChain, keys: Sequence[Key], nbytes: int) -> None:
    """Write every reserved page of ``rc`` the way a copy engine does: into ``rc.pages`` when the
    provider hands out its memory as one chunk (no per-page objects), else page by page."""
    pos = rc.positions()
    if rc.pages is not None:
        assert len(rc.pages.addresses) == len(pos) and rc.pages.page_nbytes == nbytes
        for i, addr in zip(pos, rc.pages.addresses.tolist(), strict=True):
            ctypes.memmove(addr, page_bytes(keys[i], nbytes), nbytes)
        rc.mark_written()
        return
    for i in pos:
        r = rc.reservations[i]
        assert r is not None
        _fill(r)


def _sums(keys: Sequence[Key], nbytes: int, algorithm: str) -> list[int] | None:
    if algorithm == TREE_ALGORITHM:
        return [tree_checksum(page_bytes(k, nbytes)) for k in keys]
    if algorithm == CHECKSUM_ALGORITHM:
        return [checksum(page_bytes(k, nbytes)) for k in keys]
    return None


class BatchChainTests(SuiteBase):
    """The chain-reservation part of the conformance suite (see the module docstring)."""

    def test_reserve_many_chain_roundtrip(self, provider: Provider) -> None:
        keys = chain("rm-roundtrip", 6)
        rc = provider.reserve_many(keys, _parents(keys), self.page_nbytes, salt_tag="tag-rm")
        assert isinstance(rc, ReservedChain)
        assert rc.error is None and len(rc) == 6
        assert all(r is not None for r in rc.reservations)
        for r in rc.reservations:
            assert r is not None
            _fill(r)
        # nothing of the chain is visible before its seal
        assert provider.present(keys) == [False] * 6
        assert provider.longest_prefix(keys) == 0
        assert provider.read_bytes(keys[0]) is None
        provider.seal_many([r for r in rc.reservations if r is not None])
        assert all(r is not None and r.state == "sealed" for r in rc.reservations)
        assert provider.present(keys) == [True] * 6
        for k in keys:
            assert provider.read_bytes(k) == page_bytes(k, self.page_nbytes)
            info = provider.entry(k)
            assert info is not None and info.salt_tag == "tag-rm"
        assert [provider.entry(k).parent for k in keys] == _parents(keys)  # type: ignore[union-attr]

    # -- the chain-level methods (a chunk-level run or per-page reservations behind them) --------
    def test_chain_level_seal_roundtrip(self, provider: Provider) -> None:
        keys = chain("rm-chain-level", 6)
        rc = provider.reserve_many(keys, _parents(keys), self.page_nbytes)
        assert rc.error is None and len(rc) == 6 and rc.positions() == list(range(6))
        assert provider.present(keys) == [False] * 6  # nothing visible before the seal
        _fill_chain(rc, keys, self.page_nbytes)
        rc.seal()
        assert rc.sealed == 6
        assert provider.present(keys) == [True] * 6 and not any(provider.in_flight(k) for k in keys)
        for k in keys:
            assert provider.read_bytes(k) == page_bytes(k, self.page_nbytes)
        assert all(r is not None and r.state == "sealed" for r in rc.reservations)

    def test_chain_level_seal_with_checksums(self, provider: Provider) -> None:
        keys = chain("rm-chain-sums", 4)
        rc = provider.reserve_many(keys, _parents(keys), self.page_nbytes)
        _fill_chain(rc, keys, self.page_nbytes)
        alg = provider.checksum_algorithm
        rc.seal(checksums=_sums(keys, self.page_nbytes, alg), algorithm=alg)
        for k in keys:  # the given checksums are the bytes' own: verified reads hit
            assert provider.read_bytes(k) == page_bytes(k, self.page_nbytes)

    def test_chain_level_abort_then_reserve_again(self, provider: Provider) -> None:
        keys = chain("rm-chain-abort", 5)
        used = provider.stats().used_bytes
        rc = provider.reserve_many(keys, _parents(keys), self.page_nbytes)
        assert len(rc) == 5
        rc.abort()
        rc.abort()  # idempotent
        assert rc.sealed == 0
        assert provider.present(keys) == [False] * 5 and not any(provider.in_flight(k) for k in keys)
        assert provider.stats().used_bytes == used
        again = provider.reserve_many(keys, _parents(keys), self.page_nbytes)
        _fill_chain(again, keys, self.page_nbytes)
        again.seal()
        assert provider.longest_prefix(keys) == 5

    def test_chain_level_refuses_unwritten_pages(self, provider: Provider) -> None:
        keys = chain("rm-chain-unwritten", 3)
        rc = provider.reserve_many(keys, _parents(keys), self.page_nbytes)
        with pytest.raises(IncompleteWriteError):
            rc.seal()
        assert provider.present(keys) == [False] * 3 and not any(provider.in_flight(k) for k in keys)

    def test_chain_level_runs_seal_root_first(self, provider: Provider) -> None:
        keys = chain("rm-chain-runs", 8)
        first = provider.reserve_many(keys[:4], _parents(keys[:4]), self.page_nbytes)
        second = provider.reserve_many(keys[4:], _parents(keys[4:], keys[3]), self.page_nbytes)
        assert len(first) == 4 and len(second) == 4
        _fill_chain(first, keys[:4], self.page_nbytes)
        _fill_chain(second, keys[4:], self.page_nbytes)
        first.seal()
        second.seal()
        assert provider.longest_prefix(keys) == 8
        for k in keys:
            assert provider.read_bytes(k) == page_bytes(k, self.page_nbytes)

    def test_chain_level_child_run_fails_without_its_parent(self, provider: Provider) -> None:
        keys = chain("rm-chain-orphan", 6)
        first = provider.reserve_many(keys[:3], _parents(keys[:3]), self.page_nbytes)
        second = provider.reserve_many(keys[3:], _parents(keys[3:], keys[2]), self.page_nbytes)
        _fill_chain(second, keys[3:], self.page_nbytes)
        first.abort()  # the parent run goes: its child run cannot be sealed
        with pytest.raises(UnknownKeyError):
            second.seal()
        assert second.sealed == 0
        assert provider.present(keys) == [False] * 6 and not any(provider.in_flight(k) for k in keys)

    def test_reserve_many_in_runs(self, provider: Provider) -> None:
        """A long chain reserved run by run: the second run's first parent is still in flight."""
        keys = chain("rm-runs", 6)
        first = provider.reserve_many(keys[:3], _parents(keys[:3]), self.page_nbytes)
        second = provider.reserve_many(keys[3:], _parents(keys[3:], keys[2]), self.page_nbytes)
        assert first.error is None and second.error is None
        for r in (*first.reservations, *second.reservations):
            assert r is not None
            _fill(r)
        assert provider.present(keys) == [False] * 6
        provider.seal_many([r for r in first.reservations if r is not None])
        assert provider.present(keys) == [True] * 3 + [False] * 3
        provider.seal_many([r for r in second.reservations if r is not None])
        assert provider.longest_prefix(keys) == 6
        for k in keys:
            assert provider.read_bytes(k) == page_bytes(k, self.page_nbytes)

    def test_reserve_many_dedups_stored_pages(self, provider: Provider) -> None:
        keys = chain("rm-dedup", 4)
        put_chain(provider, keys[:2], self.page_nbytes)
        rc = provider.reserve_many(keys, _parents(keys), self.page_nbytes)
        assert rc.error is None
        assert rc.reservations[0] is None and rc.reservations[1] is None
        rest = [r for r in rc.reservations if r is not None]
        assert [r.key for r in rest] == keys[2:]
        for r in rest:
            _fill(r)
        provider.seal_many(rest)
        assert provider.longest_prefix(keys) == 4

    def test_reserve_many_unknown_parent(self, provider: Provider) -> None:
        orphan = chain("rm-orphan", 3)
        rc = provider.reserve_many(orphan[1:], _parents(orphan[1:], orphan[0]), self.page_nbytes)
        assert len(rc) == 0
        assert isinstance(rc.error, UnknownKeyError)
        assert provider.present(orphan) == [False] * 3

    def test_reserve_many_stops_at_a_page_in_flight(self, provider: Provider) -> None:
        keys = chain("rm-inflight", 3)
        put_chain(provider, keys[:1], self.page_nbytes)
        other = provider.reserve(keys[1], keys[0], self.page_nbytes)
        assert other is not None
        try:
            rc = provider.reserve_many(keys, _parents(keys), self.page_nbytes)
            assert rc.reservations == [None]  # keys[0] is stored; keys[1] ends the call
            assert isinstance(rc.error, InFlightError)
        finally:
            provider.abort(other)

    def test_abort_leaves_no_trace(self, provider: Provider) -> None:
        keys = chain("rm-abort", 4)
        used = provider.stats().used_bytes
        rc = provider.reserve_many(keys, _parents(keys), self.page_nbytes)
        for r in rc.reservations:
            assert r is not None
            r.abort()
        assert provider.present(keys) == [False] * 4
        assert provider.stats().used_bytes == used
        assert not any(provider.in_flight(k) for k in keys)
        # and the keys can be reserved again
        again = provider.reserve_many(keys, _parents(keys), self.page_nbytes)
        for r in again.reservations:
            assert r is not None
            _fill(r)
        provider.seal_many([r for r in again.reservations if r is not None])
        assert provider.longest_prefix(keys) == 4

    def test_seal_many_after_an_aborted_parent(self, provider: Provider) -> None:
        keys = chain("rm-aborted-parent", 3)
        rc = provider.reserve_many(keys, _parents(keys), self.page_nbytes)
        res = [r for r in rc.reservations if r is not None]
        for r in res:
            _fill(r)
        res[0].abort()
        with pytest.raises(UnknownKeyError):
            provider.seal_many(res[1:])
        assert provider.present(keys) == [False] * 3
        assert all(r.state == "aborted" for r in res)
        assert provider.stats().used_bytes == 0
        assert not any(provider.in_flight(k) for k in keys)

    def test_seal_many_refuses_unwritten_pages(self, provider: Provider) -> None:
        keys = chain("rm-unwritten", 2)
        rc = provider.reserve_many(keys, _parents(keys), self.page_nbytes)
        res = [r for r in rc.reservations if r is not None]
        _fill(res[0])
        with pytest.raises(HostKVError):
            provider.seal_many(res)
        assert res[1].state == "aborted"  # never published with a hole
        assert provider.present(keys[1:]) == [False]
        assert provider.stats().used_bytes <= self.page_nbytes

    def test_seal_many_refusing_its_arguments_changes_nothing(self, provider: Provider) -> None:
        """Bad arguments (checksums not one int per page, a reservation given twice) are refused
        with a typed error before anything is sealed, and change nothing: the batch stays open,
        to be sealed again or aborted; aborted, it leaves nothing in flight or counted.  A
        generator of reservations is taken."""
        keys = chain("rm-refused", 3)
        algo = provider.checksum_algorithm
        rc = provider.reserve_many(keys, _parents(keys), self.page_nbytes)
        _fill_chain(rc, keys, self.page_nbytes)
        res = [r for r in rc.reservations if r is not None]
        for sums in (np.zeros((3, 1), dtype=np.uint64), [0.5, 1, 2], [1, 2]):
            with pytest.raises(InvalidArgumentError):
                rc.seal(checksums=sums, algorithm=algo)  # type: ignore[arg-type]
        if res:
            with pytest.raises(InvalidArgumentError):
                provider.seal_many([*res, res[0]])
            assert all(r.state == "open" for r in res)
        assert provider.present(keys) == [False] * 3
        rc.abort()
        assert not any(provider.in_flight(k) for k in keys) and provider.stats().used_bytes == 0
        rc = provider.reserve_many(keys, _parents(keys), self.page_nbytes)
        _fill_chain(rc, keys, self.page_nbytes)
        if rc.run is None:
            provider.seal_many(r for r in rc.reservations if r is not None)  # type: ignore[arg-type]
        else:
            rc.seal()
        assert provider.longest_prefix(keys) == 3

    def test_reserve_many_and_seal_refuse_malformed_arguments(self, provider: Provider) -> None:
        """Typed errors, not a TypeError/ValueError/MemoryError from inside: parents not a
        sequence of bytes-or-None, checksums not a sequence, an entry larger than the budget
        (a provider without its own reserve_many allocated its buffer first)."""
        keys = chain("rm-malformed", 3)
        for parents in ((p for p in _parents(keys)), None, np.frombuffer(b"".join(keys), np.uint8).reshape(3, -1)):
            with pytest.raises(InvalidArgumentError):
                provider.reserve_many(keys, parents, self.page_nbytes)  # type: ignore[arg-type]
        huge = provider.reserve_many(keys[:1], [None], 1 << 62)
        assert isinstance(huge.error, HostKVError) and len(huge) == 0
        for sums in ((0 for _ in keys), {0: 1, 1: 2, 2: 3}, np.uint64(7)):
            rc = provider.reserve_many(keys, _parents(keys), self.page_nbytes)
            _fill_chain(rc, keys, self.page_nbytes)
            with pytest.raises(InvalidArgumentError):
                rc.seal(checksums=sums, algorithm=provider.checksum_algorithm)  # type: ignore[arg-type]
            rc.abort()  # (a refused seal changes nothing)
            assert not any(provider.in_flight(k) for k in keys) and provider.stats().used_bytes == 0
        rc = provider.reserve_many(keys, _parents(keys), self.page_nbytes)
        _fill_chain(rc, keys, self.page_nbytes)
        rc.seal()
        assert provider.longest_prefix(keys) == 3

    def test_reserve_many_capacity_is_a_prefix(self, provider_factory: Any) -> None:
        provider: Provider = provider_factory(budget_pages=4)
        keys = chain("rm-capacity", 7)
        rc = provider.reserve_many(keys, _parents(keys), self.page_nbytes)
        res = [r for r in rc.reservations if r is not None]
        assert len(res) == len(rc)
        if rc.error is not None:
            assert isinstance(rc.error, CapacityError)
        assert provider.stats().used_bytes <= provider.budget_bytes
        for r in res:
            _fill(r)
        failure: HostKVError | None = None
        try:
            provider.seal_many(res)
        except HostKVError as exc:
            failure = exc
        assert failure is None or isinstance(failure, (CapacityError, UnknownKeyError))
        assert provider.stats().used_bytes <= provider.budget_bytes
        stored = provider.present(keys)
        # what got stored is a prefix of the chain, and every failure is typed
        n = stored.index(False) if False in stored else len(stored)
        assert stored == [True] * n + [False] * (len(keys) - n)
        assert n <= 4
        assert n == sum(r.state == "sealed" for r in res)
        for k in keys[:n]:
            assert provider.read_bytes(k) == page_bytes(k, self.page_nbytes)

    def test_reserve_many_bad_arguments(self, provider: Provider) -> None:
        keys = chain("rm-bad", 3)
        with pytest.raises(InvalidArgumentError):
            provider.reserve_many(keys, [None], self.page_nbytes)
        with pytest.raises(InvalidArgumentError):
            provider.reserve_many(keys, _parents(keys), 0)
        with pytest.raises(InvalidArgumentError):
            provider.reserve_many([b"short"], [None], self.page_nbytes)
        assert provider.present(keys) == [False] * 3
