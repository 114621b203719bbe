"""Hostile-input tests, mixed into :class:`~hostkv_providers.testing.ProviderTests`.

Every public method of the provider contract is called with wrong types, wrong sizes, after
``close``, in a forked child and from racing threads.  Each call must raise the error type the
contract documents (always rooted at ``HostKVError``) and leave the store exactly as it was: the
same keys present with the same bytes and anchors, the same accounting, nothing in flight.

A third-party provider gets all of it by subclassing ``ProviderTests``.  Set the environment
variable ``HOSTKV_HOSTILE_TALLY`` to a file path to have every call's outcome appended to it as
one JSON line (``{"provider", "method", "outcome"}``); ``outcome`` is ``"typed"`` (the documented
error), ``"ok"`` (a documented success: dedup, a miss, a harmless hint), or the failure found.
"""

# Every lambda below is called in the loop iteration that made it: B023 (late binding) cannot bite.
# ruff: noqa: B023

from __future__ import annotations

import json
import math
import os
import threading
import warnings
from collections.abc import Callable, Iterator

import pytest

from hostkv_providers._capabilities import (
    SupportsBatch,
    SupportsBatchViews,
    SupportsCompact,
    SupportsIterate,
    SupportsVerify,
    SupportsViews,
)
from hostkv_providers._errors import (
    CapacityError,
    ClosedError,
    HostKVError,
    InFlightError,
    InvalidArgumentError,
    ReservationError,
    SpanError,
    UnknownKeyError,
    UsedAfterForkError,
)
from hostkv_providers._keys import Key
from hostkv_providers._provider import Provider
from hostkv_providers._reservation import Lease, Reservation
from hostkv_providers._span import ByteSpan
from hostkv_providers.testing._families._base import SuiteBase
from hostkv_providers.testing._pages import anchor_bytes, chain, key_of, page_bytes, put_chain

__all__ = ["HostileInputTests"]

_ANCHOR = "hostile"

#: Values that are not a key (32 bytes).
BAD_KEYS: tuple[object, ...] = (None, 7, 1.5, "k" * 32, b"", b"short", b"x" * 33, bytearray(31), [b"x" * 32],
                                 object())
#: Values that are not a sequence of keys.
BAD_KEY_SEQUENCES: tuple[object, ...] = (None, 5, 2.5, b"x" * 32, "k" * 32, object(), [None], [b"short"], [7],
                                          (b"x" * 31,))
BAD_NBYTES: tuple[object, ...] = (0, -1, -4096, 1.5, math.nan, True, "4096", None, b"4096")
BAD_SALT_TAGS: tuple[object, ...] = (5, None, b"tag", 1.0, "\ud800")
BAD_OFFSETS: tuple[object, ...] = (-1, 1.5, None, "0", True, math.nan)
BAD_TIMEOUTS: tuple[object, ...] = (None, "1", math.nan, -1, -0.5, True, b"1", 1j)
BAD_ANCHOR_NAMES: tuple[object, ...] = (None, "", "x" * 65, "a\nb", "\u00e9t\u00e9", 5, b"name")
BAD_BUFFERS: tuple[object, ...] = (None, 5, "text", object(), 1.5)
BAD_SPANS: tuple[object, ...] = ((0, 10), [0, 10], 5, "0:10", slice(0, 10))
BAD_PROGRESS: tuple[object, ...] = (5, "x", object(), b"")


def _tally(provider: Provider, method: str, outcome: str) -> None:
    path = os.environ.get("HOSTKV_HOSTILE_TALLY")
    if not path:
        return
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps({"provider": type(provider).__name__, "method": method, "outcome": outcome}) + "\n")


def _close_amid(provider: Provider, work: Callable[[int], None], n: int, ready: Callable[[], bool],
                stop: threading.Event) -> list[threading.Thread]:
    """Run ``work(t)`` on ``n`` threads, close ``provider`` once ``ready()`` (or as soon as one
    thread has stopped), then set ``stop`` and join them (the close-race tests' scaffold)."""
    threads = [threading.Thread(target=work, args=(t,)) for t in range(n)]
    for t in threads:
        t.start()
    while not ready() and all(t.is_alive() for t in threads):
        threading.Event().wait(0.001)
    provider.close()
    stop.set()
    for t in threads:
        t.join(60)
    return threads


def expect_refused(provider: Provider, label: str, call: Callable[[], object],
                   errors: type[BaseException] | tuple[type[BaseException], ...] = InvalidArgumentError,
                   *, unchanged: Callable[[], None], may_succeed: bool = False, what: str | None = None) -> None:
    """``call()`` raises one of ``errors``, rooted at ``HostKVError`` (or, with ``may_succeed``,
    returns), and then ``unchanged()`` (an assertion that the store is as it was) holds.  The
    outcome is tallied under ``label`` (``HOSTKV_HOSTILE_TALLY``); ``what`` (default ``label``)
    names the call in the failure messages.  Shared by the suite and the cache's hostile tests."""
    method = label if what is None else what
    outcome = "typed"
    try:
        try:
            call()
        except errors as exc:
            if not isinstance(exc, HostKVError):
                outcome = f"untyped {type(exc).__name__}"
                raise AssertionError(f"{method}: {type(exc).__name__} is not a HostKVError: {exc}") from exc
        except Exception as exc:
            outcome = f"wrong error {type(exc).__name__}"
            raise AssertionError(f"{method}: expected {errors}, got {type(exc).__name__}: {exc}") from exc
        else:
            if not may_succeed:
                outcome = "no error"
                raise AssertionError(f"{method}: no error raised (expected {errors})")
            outcome = "ok"
        try:
            unchanged()
        except AssertionError:
            outcome = "store changed"
            raise
    finally:
        _tally(provider, label, outcome)


class _Store:
    """The store a hostile test starts from, and how to tell that nothing of it changed."""

    def __init__(self, provider: Provider, keys: list[Key], nbytes: int) -> None:
        self.provider = provider
        self.keys = keys
        self.nbytes = nbytes
        self.probe = key_of("hostile/never-stored")
        self.before = self.snapshot()

    def snapshot(self) -> tuple[object, ...]:
        p = self.provider
        st = p.stats()
        return (
            p.present([*self.keys, self.probe]),
            [p.read_bytes(k) for k in self.keys],
            [p.list_anchors(k) for k in self.keys],
            p.get_anchor(self.keys[0], _ANCHOR),
            p.in_flight(self.probe),
            st.entries,
            st.used_bytes,
            st.in_flight,
            st.leased,
        )

    def assert_unchanged(self, what: str) -> None:
        after = self.snapshot()
        assert after == self.before, f"{what} changed the store"
        for k, data in zip(self.keys, after[1], strict=True):  # type: ignore[call-overload]
            assert data == page_bytes(k, self.nbytes), f"{what}: wrong bytes for {k.hex()[:16]}"


class HostileInputTests(SuiteBase):
    """Hostile inputs for every public method (mixed into ``ProviderTests``; not collected alone).

    The tests use the ``provider`` and ``provider_factory`` fixtures of ``SuiteBase``."""

    # -- helpers -----------------------------------------------------------------------------
    def _hostile_store(self, provider: Provider) -> _Store:
        keys = chain("hostile", 3)
        nbytes = self.page_nbytes
        put_chain(provider, keys, nbytes)
        provider.put_anchor(keys[0], _ANCHOR, anchor_bytes(keys[0], _ANCHOR, 100))
        return _Store(provider, keys, nbytes)

    @staticmethod
    def _expect(store: _Store, method: str, call: Callable[[], object],
                errors: type[BaseException] | tuple[type[BaseException], ...] = InvalidArgumentError,
                *, may_succeed: bool = False) -> None:
        """``call()`` raises one of ``errors`` (or, with ``may_succeed``, returns) and the store
        is unchanged."""
        expect_refused(store.provider, method.split("(")[0], call, errors,
                       unchanged=lambda: store.assert_unchanged(method), may_succeed=may_succeed, what=method)

    # ==========================================================================================
    # Wrong types and sizes
    # ==========================================================================================
    def test_hostile_keys(self, provider: Provider) -> None:
        s = self._hostile_store(provider)
        good = s.keys[0]
        for bad in BAD_KEYS:
            calls: list[tuple[str, Callable[[], object]]] = [
                ("entry", lambda: provider.entry(bad)),  # type: ignore[arg-type]
                ("reserve", lambda: provider.reserve(bad, None, s.nbytes)),  # type: ignore[arg-type]
                ("read", lambda: provider.read(bad, bytearray(s.nbytes))),  # type: ignore[arg-type]
                ("read_bytes", lambda: provider.read_bytes(bad)),  # type: ignore[arg-type]
                ("put", lambda: provider.put(bad, None, bytes(s.nbytes))),  # type: ignore[arg-type]
                ("in_flight", lambda: provider.in_flight(bad)),  # type: ignore[arg-type]
                ("wait_sealed", lambda: provider.wait_sealed(bad, 0.0)),  # type: ignore[arg-type]
                ("put_anchor", lambda: provider.put_anchor(bad, "a", b"x")),  # type: ignore[arg-type]
                ("get_anchor", lambda: provider.get_anchor(bad, "a")),  # type: ignore[arg-type]
                ("list_anchors", lambda: provider.list_anchors(bad)),  # type: ignore[arg-type]
                ("present", lambda: provider.present([good, bad])),  # type: ignore[list-item]
                ("longest_prefix", lambda: provider.longest_prefix([bad, good])),  # type: ignore[list-item]
                ("lease", lambda: provider.lease([good, bad])),  # type: ignore[list-item]
                ("evict", lambda: provider.evict([bad])),  # type: ignore[list-item]
                ("deepest_anchor", lambda: provider.deepest_anchor([bad], "a")),  # type: ignore[list-item]
            ]
            if bad is not None:  # None is a valid parent (a root)
                calls.append(("reserve(parent)",
                              lambda: provider.reserve(key_of("hostile/child"), bad, s.nbytes)))  # type: ignore[arg-type]
                calls.append(("put(parent)", lambda: provider.put(key_of("hostile/child"), bad, bytes(4))))  # type: ignore[arg-type]
            if isinstance(provider, SupportsBatch):
                calls.append(("read_many", lambda: provider.read_many([bad], [bytearray(s.nbytes)])))  # type: ignore[list-item]
                calls.append(("put_many", lambda: provider.put_many([(bad, None, b"x")])))  # type: ignore[list-item]
            for method, call in calls:
                self._expect(s, method, call)

    def test_hostile_key_sequences(self, provider: Provider) -> None:
        s = self._hostile_store(provider)
        for bad in BAD_KEY_SEQUENCES:
            calls: list[tuple[str, Callable[[], object]]] = [
                ("present", lambda: provider.present(bad)),  # type: ignore[arg-type]
                ("longest_prefix", lambda: provider.longest_prefix(bad)),  # type: ignore[arg-type]
                ("lease", lambda: provider.lease(bad)),  # type: ignore[arg-type]
                ("evict", lambda: provider.evict(bad)),  # type: ignore[arg-type]
                ("deepest_anchor", lambda: provider.deepest_anchor(bad, "a")),  # type: ignore[arg-type]
                ("prefetch", lambda: provider.prefetch(bad)),  # type: ignore[arg-type]
            ]
            if isinstance(provider, SupportsBatch):
                calls.append(("read_many", lambda: provider.read_many(bad, [bytearray(s.nbytes)])))  # type: ignore[arg-type]
            for method, call in calls:
                self._expect(s, method, call)

    def test_hostile_iterables_of_keys(self, provider: Provider) -> None:
        """A generator or another one-pass iterable of keys works like the list of its keys
        (a miss among them included), once, for every method taking keys."""
        s = self._hostile_store(provider)
        want = [*s.keys, s.probe]

        def gen() -> Iterator[Key]:
            return iter(list(want))

        self._expect(s, "present", lambda: _eq(provider.present(gen()), [True, True, True, False]),  # type: ignore[arg-type]
                     may_succeed=True)
        self._expect(s, "longest_prefix", lambda: _eq(provider.longest_prefix(gen()), 3),  # type: ignore[arg-type]
                     may_succeed=True)
        self._expect(s, "deepest_anchor", lambda: _eq(provider.deepest_anchor(gen(), _ANCHOR), 1),  # type: ignore[arg-type]
                     may_succeed=True)

        def lease_gen() -> None:
            with provider.lease(gen()) as lease:  # type: ignore[arg-type]
                _eq(lease.present, (True, True, True, False))

        self._expect(s, "lease", lease_gen, may_succeed=True)
        self._expect(s, "prefetch", lambda: provider.prefetch(gen()), may_succeed=True)  # type: ignore[arg-type]
        if isinstance(provider, SupportsBatch):
            outs = [bytearray(s.nbytes) for _ in want]
            self._expect(s, "read_many",
                         lambda: _eq(provider.read_many(gen(), outs), [True, True, True, False]),  # type: ignore[arg-type]
                         may_succeed=True)

    def test_hostile_reserve_arguments(self, provider: Provider) -> None:
        s = self._hostile_store(provider)
        new = key_of("hostile/new")
        for nbytes in BAD_NBYTES:
            self._expect(s, "reserve(nbytes)", lambda: provider.reserve(new, None, nbytes))  # type: ignore[arg-type]
        for tag in BAD_SALT_TAGS:
            self._expect(s, "reserve(salt_tag)", lambda: provider.reserve(new, None, s.nbytes, salt_tag=tag))  # type: ignore[arg-type]
            self._expect(s, "put(salt_tag)", lambda: provider.put(new, None, bytes(8), salt_tag=tag))  # type: ignore[arg-type]
            if isinstance(provider, SupportsBatch):
                self._expect(s, "put_many(salt_tag)",
                             lambda: provider.put_many([(new, None, bytes(8))], salt_tag=tag))  # type: ignore[arg-type]
        self._expect(s, "reserve(parent)", lambda: provider.reserve(new, key_of("hostile/no-parent"), s.nbytes),
                     UnknownKeyError)
        self._expect(s, "reserve(self parent)", lambda: provider.reserve(new, new, s.nbytes),
                     (InvalidArgumentError, UnknownKeyError))
        for data in BAD_BUFFERS:
            self._expect(s, "put(data)", lambda: provider.put(new, None, data))
        self._expect(s, "put(empty)", lambda: provider.put(new, None, b""))
        self._expect(s, "reserve(dedup)", lambda: _eq(provider.reserve(s.keys[0], None, s.nbytes), None),
                     may_succeed=True)

    def test_hostile_reservation_misuse(self, provider_factory: Callable[..., Provider]) -> None:
        provider = provider_factory()
        other = provider_factory()
        s = self._hostile_store(provider)
        key = key_of("hostile/res")
        res = provider.reserve(key, None, s.nbytes)
        assert res is not None
        s.before = s.snapshot()  # with the reservation in flight
        for off in BAD_OFFSETS:
            self._expect(s, "write(offset)", lambda: provider.write(res, off, b"x"))  # type: ignore[arg-type]
        for data in BAD_BUFFERS:
            self._expect(s, "write(data)", lambda: provider.write(res, 0, data))
        self._expect(s, "write(past end)", lambda: provider.write(res, s.nbytes, b"x"), SpanError)
        self._expect(s, "write(too long)", lambda: provider.write(res, 1, bytes(s.nbytes)), SpanError)
        for bad in (None, "res", 5, object()):
            for method in ("write", "seal", "abort"):
                fn = getattr(provider, method)
                args: tuple[object, ...] = (bad, 0, b"x") if method == "write" else (bad,)
                self._expect(s, f"{method}(reservation)", lambda: fn(*args), (ReservationError, InvalidArgumentError))
        foreign = other.reserve(key, None, s.nbytes)
        assert foreign is not None
        for method in ("write", "seal", "abort"):
            fn = getattr(provider, method)
            args = (foreign, 0, b"x") if method == "write" else (foreign,)
            self._expect(s, f"{method}(foreign reservation)", lambda: fn(*args), ReservationError)
        foreign.abort()
        # the reservation is still usable after all of that
        res.write(0, page_bytes(key, s.nbytes))
        res.seal()
        s.before = s.snapshot()
        for method in ("write", "seal", "abort"):
            fn = getattr(provider, method)
            args = (res, 0, b"x") if method == "write" else (res,)
            # abort after seal must not unpublish the entry: a no-op or a ReservationError
            self._expect(s, f"{method}(sealed reservation)", lambda: fn(*args), ReservationError,
                         may_succeed=method == "abort")
        assert provider.read_bytes(key) == page_bytes(key, s.nbytes)

    def test_hostile_reads(self, provider: Provider) -> None:
        s = self._hostile_store(provider)
        key = s.keys[1]
        for out in (*BAD_BUFFERS, bytes(s.nbytes), bytearray(s.nbytes - 1),
                    memoryview(bytearray(2 * s.nbytes))[::2]):
            self._expect(s, "read(out)", lambda: provider.read(key, out))
        for span in BAD_SPANS:
            self._expect(s, "read(span)", lambda: provider.read(key, bytearray(s.nbytes), span))  # type: ignore[arg-type]
            self._expect(s, "read_bytes(span)", lambda: provider.read_bytes(key, span))  # type: ignore[arg-type]
        for span in (ByteSpan(0, s.nbytes + 1), ByteSpan(s.nbytes, 1), ByteSpan(2**62, 1)):
            self._expect(s, "read(span)", lambda: provider.read(key, bytearray(s.nbytes + 1), span), SpanError)
            self._expect(s, "read_bytes(span)", lambda: provider.read_bytes(key, span), SpanError)
        self._expect(s, "read(miss)", lambda: _eq(provider.read(s.probe, bytearray(s.nbytes)), False),
                     may_succeed=True)
        self._expect(s, "read_bytes(miss span)", lambda: _eq(provider.read_bytes(s.probe, ByteSpan(0, 1)), None),
                     may_succeed=True)

    def test_hostile_wait_sealed(self, provider: Provider) -> None:
        """Timeouts are seconds ``>= 0``; ``nan`` on a key being written would wait forever."""
        s = self._hostile_store(provider)
        key = key_of("hostile/wait")
        res = provider.reserve(key, None, s.nbytes)
        assert res is not None
        s.before = s.snapshot()
        try:
            for timeout in BAD_TIMEOUTS:
                for k in (key, s.keys[0], s.probe):
                    self._expect(s, "wait_sealed(timeout)", lambda: provider.wait_sealed(k, timeout))  # type: ignore[arg-type]
            self._expect(s, "wait_sealed(0)", lambda: _eq(provider.wait_sealed(key, 0), False), may_succeed=True)
            self._expect(s, "wait_sealed(sealed, inf)", lambda: _eq(provider.wait_sealed(s.keys[0], math.inf), True),
                         may_succeed=True)
        finally:
            res.abort()

    def test_hostile_evict_arguments(self, provider: Provider) -> None:
        s = self._hostile_store(provider)
        for kwargs in ({}, {"keys": [s.keys[0]], "nbytes": 4096}, {"nbytes": -1}, {"nbytes": 1.5},
                       {"nbytes": "1"}, {"nbytes": True}, {"nbytes": math.nan}, {"nbytes": None}, {"keys": None}):
            self._expect(s, "evict", lambda: provider.evict(**kwargs))
        self._expect(s, "evict(miss)", lambda: provider.evict([s.probe]), may_succeed=True)

    def test_hostile_anchors(self, provider: Provider) -> None:
        s = self._hostile_store(provider)
        key = s.keys[0]
        for name in BAD_ANCHOR_NAMES:
            self._expect(s, "put_anchor(name)", lambda: provider.put_anchor(key, name, b"x"))  # type: ignore[arg-type]
            self._expect(s, "get_anchor(name)", lambda: provider.get_anchor(key, name))  # type: ignore[arg-type]
            self._expect(s, "deepest_anchor(name)", lambda: provider.deepest_anchor(s.keys, name))  # type: ignore[arg-type]
        for data in BAD_BUFFERS:
            self._expect(s, "put_anchor(data)", lambda: provider.put_anchor(key, "a", data))
        self._expect(s, "put_anchor(miss)", lambda: provider.put_anchor(s.probe, "a", b"x"), UnknownKeyError)
        self._expect(s, "get_anchor(miss)", lambda: _eq(provider.get_anchor(s.probe, "a"), None), may_succeed=True)
        self._expect(s, "list_anchors(miss)", lambda: _eq(provider.list_anchors(s.probe), {}), may_succeed=True)

    def test_hostile_leases_and_views(self, provider_factory: Callable[..., Provider]) -> None:
        provider = provider_factory()
        other = provider_factory()
        s = self._hostile_store(provider)
        released = provider.lease(s.keys)
        released.release()
        self._expect(s, "Lease.release(twice)", released.release, may_succeed=True)
        put_chain(other, s.keys[:1], s.nbytes)
        foreign = other.lease(s.keys[:1])
        try:
            if isinstance(provider, SupportsViews):
                for lease in (None, "lease", 5, released, foreign):
                    self._expect(s, "view(lease)", lambda: provider.view(lease, s.keys[0]),  # type: ignore[arg-type]
                                 (InvalidArgumentError, ReservationError))
                with provider.lease(s.keys[:1]) as held:
                    s.before = s.snapshot()
                    for bad in BAD_KEYS:
                        self._expect(s, "view(key)", lambda: provider.view(held, bad))  # type: ignore[arg-type]
                    # a key the lease does not pin
                    self._expect(s, "view(unleased key)", lambda: provider.view(held, s.keys[1]),
                                 (InvalidArgumentError, ReservationError, UnknownKeyError), may_succeed=True)
                s.before = s.snapshot()
            if isinstance(provider, SupportsBatchViews):
                for lease in (None, "lease", released, foreign):
                    self._expect(s, "views(lease)", lambda: provider.views(lease, s.keys[:1]),  # type: ignore[arg-type]
                                 (InvalidArgumentError, ReservationError))
                with provider.lease(s.keys[:1]) as held:
                    s.before = s.snapshot()
                    for bad in BAD_KEY_SEQUENCES:
                        self._expect(s, "views(keys)", lambda: provider.views(held, bad))  # type: ignore[arg-type]
        finally:
            foreign.release()

    def test_hostile_batch_arguments(self, provider: Provider) -> None:
        if not isinstance(provider, SupportsBatch):
            pytest.skip("provider has no put_many/read_many")
        s = self._hostile_store(provider)
        new = key_of("hostile/batch")
        for items in (None, 5, b"items", "items", object(), [None], [(new,)], [(new, None)],
                      [(new, None, None)], [(new, None, 5)], [(new, None, "text")], [[new, None, b"x"]],
                      [(new, None, b"")], [(new, key_of("hostile/no-parent"), b"x"), (None, None, b"x")]):
            self._expect(s, "put_many(items)", lambda: provider.put_many(items))  # type: ignore[arg-type]
        good_outs = [bytearray(s.nbytes) for _ in s.keys]
        for outs in (None, 5, b"outs", [None, None, None], good_outs[:2], [*good_outs, bytearray(s.nbytes)],
                     [bytes(s.nbytes)] * 3):
            self._expect(s, "read_many(outs)", lambda: provider.read_many(s.keys, outs))  # type: ignore[arg-type]

    def test_hostile_long_operations(self, provider: Provider) -> None:
        s = self._hostile_store(provider)
        if isinstance(provider, SupportsVerify):
            for progress in BAD_PROGRESS:
                self._expect(s, "verify(progress)", lambda: provider.verify(progress=progress))  # type: ignore[arg-type]
            for repair in ("yes", 1, None):
                self._expect(s, "verify(repair)", lambda: provider.verify(repair=repair))  # type: ignore[arg-type]
        if isinstance(provider, SupportsCompact):
            for progress in BAD_PROGRESS:
                self._expect(s, "compact(progress)", lambda: provider.compact(progress=progress))  # type: ignore[arg-type]
        if not isinstance(provider, (SupportsVerify, SupportsCompact)):
            pytest.skip("provider has neither verify nor compact")

    # ==========================================================================================
    # Closed and forked state
    # ==========================================================================================
    def _every_call(self, provider: Provider, s: _Store, res: Reservation, lease: Lease
                    ) -> list[tuple[str, Callable[[], object]]]:
        key = s.keys[0]
        calls: list[tuple[str, Callable[[], object]]] = [
            ("present", lambda: provider.present([key])),
            ("longest_prefix", lambda: provider.longest_prefix([key])),
            ("entry", lambda: provider.entry(key)),
            ("reserve", lambda: provider.reserve(key_of("hostile/late"), None, s.nbytes)),
            ("write", lambda: provider.write(res, 0, b"\x00")),
            ("seal", lambda: provider.seal(res)),
            ("read", lambda: provider.read(key, bytearray(s.nbytes))),
            ("read_bytes", lambda: provider.read_bytes(key)),
            ("put", lambda: provider.put(key_of("hostile/late2"), None, bytes(s.nbytes))),
            ("in_flight", lambda: provider.in_flight(key)),
            ("wait_sealed", lambda: provider.wait_sealed(key, 0.0)),
            ("prefetch", lambda: provider.prefetch([key])),
            ("evict", lambda: provider.evict([key])),
            ("evict(nbytes)", lambda: provider.evict(nbytes=1)),
            ("put_anchor", lambda: provider.put_anchor(key, "a", b"x")),
            ("get_anchor", lambda: provider.get_anchor(key, _ANCHOR)),
            ("list_anchors", lambda: provider.list_anchors(key)),
            ("deepest_anchor", lambda: provider.deepest_anchor([key], _ANCHOR)),
            ("lease", lambda: provider.lease([key])),
            ("stats", provider.stats),
            ("abort", lambda: provider.abort(res)),
        ]
        if isinstance(provider, SupportsIterate):
            calls.append(("iter_entries", lambda: list(provider.iter_entries())))
        if isinstance(provider, SupportsVerify):
            calls.append(("verify", provider.verify))
        if isinstance(provider, SupportsCompact):
            calls.append(("compact", provider.compact))
        if isinstance(provider, SupportsViews):
            calls.append(("view", lambda: provider.view(lease, key)))
        if isinstance(provider, SupportsBatchViews):
            calls.append(("views", lambda: provider.views(lease, [key])))
        if isinstance(provider, SupportsBatch):
            calls.append(("put_many", lambda: provider.put_many([(key_of("hostile/late3"), None, b"x")])))
            calls.append(("read_many", lambda: provider.read_many([key], [bytearray(s.nbytes)])))
        return calls

    def test_hostile_after_close(self, provider: Provider, request: pytest.FixtureRequest) -> None:
        """After ``close`` every method raises ``ClosedError``; ``close`` again is a no-op and
        nothing sealed before is lost (persistent providers: reopen and compare)."""
        s = self._hostile_store(provider)
        res = provider.reserve(key_of("hostile/open"), None, s.nbytes)
        assert res is not None
        lease = provider.lease(s.keys[:1])
        calls = self._every_call(provider, s, res, lease)
        provider.close()
        for method, call in calls:
            outcome = "typed"
            try:
                with pytest.raises(ClosedError):
                    call()
            except BaseException:
                outcome = "not ClosedError"
                raise
            finally:
                _tally(provider, method, outcome)
        provider.close()
        lease.release()  # releasing after close must not raise
        _tally(provider, "close(twice)", "ok")
        if self.supports_reopen:
            fresh = self.reopen(provider)
            request.addfinalizer(fresh.close)
            s.provider = fresh
            assert fresh.stats().in_flight == 0
            s.before = (*s.before[:7], 0, 0)  # the reservation and the lease died with the instance
            s.assert_unchanged("close")

    def test_hostile_in_forked_child(self, provider: Provider) -> None:
        """In a forked child every method, ``close`` included, raises ``UsedAfterForkError``;
        the parent's store is unchanged."""
        if not hasattr(os, "fork"):
            pytest.skip("no os.fork on this platform")
        s = self._hostile_store(provider)
        res = provider.reserve(key_of("hostile/fork-open"), None, s.nbytes)
        assert res is not None
        lease = provider.lease(s.keys[:1])
        s.before = s.snapshot()
        calls = [*self._every_call(provider, s, res, lease), ("close", provider.close)]
        rfd, wfd = os.pipe()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:  # pragma: no cover - runs in the child
            os.close(rfd)
            lines = []
            for method, call in calls:
                try:
                    call()
                    lines.append(f"{method}\tno error")
                except UsedAfterForkError:
                    lines.append(f"{method}\ttyped")
                except BaseException as exc:
                    lines.append(f"{method}\twrong error {type(exc).__name__}")
            os.write(wfd, "\n".join(lines).encode())
            os._exit(0)
        os.close(wfd)
        chunks = []
        while True:
            chunk = os.read(rfd, 65536)
            if not chunk:
                break
            chunks.append(chunk)
        os.close(rfd)
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"child status {status}"
        results = [line.split("\t") for line in b"".join(chunks).decode().splitlines()]
        for method, outcome in results:
            _tally(provider, f"fork:{method}", outcome)
        bad = [f"{m}: {o}" for m, o in results if o != "typed"]
        assert len(results) == len(calls)
        assert not bad, bad
        s.assert_unchanged("calls in a forked child")
        lease.release()
        res.abort()

    # ==========================================================================================
    # Concurrent misuse
    # ==========================================================================================
    def test_hostile_racing_seal_and_abort(self, provider: Provider) -> None:
        """Eight threads seal or abort one reservation at once: at most one seal returns (an
        abort after the seal may be a no-op), the other calls raise ``ReservationError``; the
        entry is stored with its bytes exactly when a seal returned."""
        s = self._hostile_store(provider)
        for round_ in range(6):
            key = key_of(f"hostile/race/{round_}")
            res = provider.reserve(key, None, s.nbytes)
            assert res is not None
            res.write(0, page_bytes(key, s.nbytes))
            barrier = threading.Barrier(8)
            wins: list[str] = []
            errors: list[BaseException] = []

            def go(i: int) -> None:
                verb = "seal" if (i + round_) % 2 else "abort"
                barrier.wait()
                try:
                    getattr(provider, verb)(res)
                    wins.append(verb)
                except ReservationError:
                    pass
                except BaseException as exc:
                    errors.append(exc)

            threads = [threading.Thread(target=go, args=(i,)) for i in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            sealed = wins.count("seal")
            # (a second abort may be a no-op too, as may an abort after the seal)
            good = not errors and sealed <= 1 and bool(wins)
            _tally(provider, "race:seal|abort", "typed" if good else "race broken")
            assert not errors, errors
            assert good, wins
            assert provider.present([key]) == [sealed == 1]
            assert res.state == ("sealed" if sealed else "aborted")
            if sealed:
                assert provider.read_bytes(key) == page_bytes(key, s.nbytes)
            assert provider.stats().in_flight == 0
            provider.evict([key])
        s.assert_unchanged("racing seal/abort")

    def test_hostile_racing_reserve(self, provider: Provider) -> None:
        """Eight threads reserve one key at once: one reservation, seven ``InFlightError`` (or
        ``None`` once it is sealed)."""
        s = self._hostile_store(provider)
        key = key_of("hostile/race-reserve")
        barrier = threading.Barrier(8)
        got: list[Reservation] = []
        outcomes: list[str] = []
        lock = threading.Lock()

        def go() -> None:
            barrier.wait()
            try:
                r = provider.reserve(key, None, s.nbytes)
                with lock:
                    if r is None:
                        outcomes.append("dedup")
                    else:
                        got.append(r)
                        outcomes.append("reserved")
            except InFlightError:
                with lock:
                    outcomes.append("in flight")
            except BaseException as exc:
                with lock:
                    outcomes.append(f"wrong error {type(exc).__name__}: {exc}")

        threads = [threading.Thread(target=go) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        for o in outcomes:
            _tally(provider, "race:reserve", "typed" if o in ("in flight", "dedup", "reserved") else o)
        assert len(got) == 1, outcomes
        assert all(o in ("in flight", "reserved") for o in outcomes), outcomes
        got[0].abort()
        s.assert_unchanged("racing reserve")

    def test_hostile_close_while_writing(self, provider: Provider, request: pytest.FixtureRequest) -> None:
        """``close`` while other threads are inside ``put``/``read``: each call completes or
        raises ``ClosedError``; nothing stays reserved — after a reopen nothing is in flight, the
        accounting equals the stored entries and every key can be written again."""
        s = self._hostile_store(provider)
        stop = threading.Event()
        errors: list[str] = []
        stored: list[Key] = []
        lock = threading.Lock()

        tried = [0, 0, 0]

        def writer(t: int) -> None:
            while not stop.is_set():
                key = key_of(f"hostile/close/{t}/{tried[t]}")
                tried[t] += 1
                try:
                    if provider.put(key, None, page_bytes(key, s.nbytes)):
                        with lock:
                            stored.append(key)
                    provider.read(s.keys[0], bytearray(s.nbytes))
                except ClosedError:
                    return
                except HostKVError as exc:
                    if "closed" in str(exc).lower():
                        return
                    with lock:
                        errors.append(f"{type(exc).__name__}: {exc}")
                    return
                except BaseException as exc:
                    with lock:
                        errors.append(f"{type(exc).__name__}: {exc}")
                    return

        _close_amid(provider, writer, 3, lambda: len(stored) >= 6, stop)
        _tally(provider, "race:close|put", "typed" if not errors else "wrong error")
        assert not errors, errors
        if not self.supports_reopen:
            return
        fresh = self.reopen(provider)
        request.addfinalizer(fresh.close)
        st = fresh.stats()
        assert st.in_flight == 0
        listed = [k for k in [*s.keys, *stored] if fresh.present([k])[0]]
        for k in stored:
            data = fresh.read_bytes(k)
            assert data is None or data == page_bytes(k, s.nbytes)
        # every key the writers tried can be reserved again (none is left in flight)
        for worker, count in enumerate(tried):
            for i in range(count):
                k = key_of(f"hostile/close/{worker}/{i}")
                if not fresh.present([k])[0]:
                    assert fresh.in_flight(k) is False, f"{k.hex()[:16]} still in flight after reopen"
                    assert fresh.wait_sealed(k, 0.0) is False
                    r = fresh.reserve(k, None, s.nbytes)
                    assert r is not None
                    r.abort()
        if isinstance(fresh, SupportsIterate):
            total = sum(e.nbytes + sum(e.anchors.values()) for e in fresh.iter_entries())
            assert st.used_bytes >= total
        assert len(listed) >= 3

    def test_hostile_close_while_busy(self, provider: Provider) -> None:
        """``close`` while four threads run a mix of verbs (put, read, and where the provider has
        them read_many, put_many, lease + view, evict, present, stats, iter_entries): every call
        completes or raises ``ClosedError`` (or a typed error of its own: capacity, in flight,
        unknown key); nothing else, and no signal death (a read racing close once indexed the
        freed arena of ``pinned://``; another took a closed data file for corruption)."""
        s = self._hostile_store(provider)
        n = s.nbytes
        allowed = (CapacityError, InFlightError, UnknownKeyError)
        errors: list[str] = []
        lock = threading.Lock()
        stop = threading.Event()
        done = [0, 0, 0, 0]

        def busy(t: int) -> None:
            i = 0
            while not stop.is_set():
                i += 1
                verb = (t + i) % 8
                try:
                    if verb == 0:
                        k = key_of(f"hostile/busy/{t}/{i}")
                        provider.put(k, None, page_bytes(k, n))
                    elif verb == 1:
                        provider.read(s.keys[i % len(s.keys)], bytearray(n))
                    elif verb == 2 and isinstance(provider, SupportsBatch):
                        provider.read_many(s.keys, [bytearray(n) for _ in s.keys])
                    elif verb == 3 and isinstance(provider, SupportsBatch):
                        ks = [key_of(f"hostile/busy/{t}/{i}/{j}") for j in range(3)]
                        provider.put_many([(k, None, page_bytes(k, n)) for k in ks])
                    elif verb == 4:
                        with provider.lease(s.keys) as lease:
                            if isinstance(provider, SupportsViews):
                                provider.view(lease, s.keys[0])
                    elif verb == 5:
                        provider.evict([key_of(f"hostile/busy/{t}/{i - 5}")])
                    elif verb == 6:
                        provider.present(s.keys)
                        provider.stats()
                    elif verb == 7 and isinstance(provider, SupportsIterate):
                        list(provider.iter_entries())
                except ClosedError:
                    return
                except allowed:
                    pass
                except HostKVError as exc:
                    if "closed" not in str(exc).lower():
                        with lock:
                            errors.append(f"verb {verb}: {type(exc).__name__}: {exc}")
                    return
                except BaseException as exc:
                    with lock:
                        errors.append(f"verb {verb}: {type(exc).__name__}: {exc}")
                    return
                done[t] = i

        # close once every thread has gone round its verbs a few times (or one has stopped)
        threads = _close_amid(provider, busy, 4, lambda: min(done) >= 24, stop)
        _tally(provider, "race:close|busy", "typed" if not errors else "wrong error")
        assert not errors, errors
        assert not any(t.is_alive() for t in threads)

    def test_hostile_close_between_reserve_and_seal(self, provider: Provider) -> None:
        """``close`` between a caller's calls (its reserve done, its seal not begun) aborts the
        open reservation; that caller's next ``write``/``seal`` — also one that passed its
        usability check before the close, which ``check_open`` then sees — raises
        ``ClosedError``, never ``ReservationError`` (a put racing close once got
        "already aborted" on lmdb, under CI's load)."""
        s = self._hostile_store(provider)
        key = key_of("hostile/close-between")
        data = page_bytes(key, s.nbytes)
        r = provider.reserve(key, None, s.nbytes)
        assert r is not None
        r.write(0, data[: s.nbytes // 2])
        provider.close()
        if r.state == "aborted":  # a provider whose close aborts the open reservations (lmdb)
            with pytest.raises(ClosedError):
                r.check_open(r.provider)  # the window: a call already past its usability check
        with pytest.raises(ClosedError):
            r.write(s.nbytes // 2, data[s.nbytes // 2 :])
        with pytest.raises(ClosedError):
            r.seal()
        _tally(provider, "race:close|reserve", "typed")



def _eq(got: object, want: object) -> None:
    assert got == want, f"got {got!r}, want {want!r}"
