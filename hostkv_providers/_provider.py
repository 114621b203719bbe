"""The provider contract: the seam every storage medium implements.

Read this module top to bottom if you write a provider: :class:`Provider` is the front (the
public verbs, which validate, count and enforce the contract's rules once) over the driver
methods a medium implements.  Its parts live beside it, one role per module:
:mod:`._reports` (value types), :mod:`._checks` (argument checks), :mod:`._reservation`
(``Reservation``, ``Lease``), :mod:`._chain` (chain reservation), :mod:`._capabilities` (the
optional powers).  The conformance suite (:mod:`hostkv_providers.testing`) checks every rule.
"""

from __future__ import annotations

import abc
import contextlib
import os
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, ClassVar, Protocol, TypeVar

from hostkv_providers import _chain
from hostkv_providers._capabilities import _MEMBERS, CAPABILITY_FLAGS
from hostkv_providers._chain import ReservedChain
from hostkv_providers._checks import (
    _scatter_buffers,
    check_anchor_name,
    check_span,
    check_timeout,
    readable_bytes,
    scatter_into,
    writable_buffer,
)
from hostkv_providers._errors import (
    ClosedError,
    InvalidArgumentError,
    ReservationError,
    UnknownKeyError,
    UsedAfterForkError,
)
from hostkv_providers._keys import KEY_NBYTES, Key, as_key
from hostkv_providers._reports import EntryInfo, EvictReport, ProviderStats
from hostkv_providers._reservation import Lease, Reservation
from hostkv_providers._span import ByteSpan

__all__ = ["COUNTED", "Corrupt", "Provider"]

_R = TypeVar("_R", bound="Reservation")


# --------------------------------------------------------------------------------------------
# The front and its drivers
# --------------------------------------------------------------------------------------------

_F = TypeVar("_F", bound=Callable[..., Any])

#: The counters the front keeps (``ProviderStats`` fields of the same names).
COUNTED = ("hits", "misses", "seals", "aborts", "dedup", "checksum_failures", "bytes_written", "bytes_read")


class _CounterSink(Protocol):
    """Where the front also adds its counts: a store's shared counters row
    (``providers._counters.StoreCounters``; the contract does not import the providers)."""

    def add(self, name: str, n: int) -> None: ...

    def add_hit(self, nbytes: int) -> None: ...

    def add_many(self, counts: Mapping[str, int]) -> None: ...

    def totals(self) -> dict[str, int]: ...

    def close(self) -> None: ...


class Corrupt:
    """What a driver's ``_read`` returns when the entry's bytes fail their checksum.

    ``token`` names the version that was read (a node, a generation), so that
    :meth:`Provider._drop_damaged` drops that version only — never an entry sealed again since.
    """

    __slots__ = ("token",)

    def __init__(self, token: object = None) -> None:
        self.token = token


def _front(fn: _F) -> _F:
    """Mark a public verb of :class:`Provider` as the front of the driver named ``_<verb>``."""
    fn.__hostkv_front__ = True  # type: ignore[attr-defined]
    return fn


def _driver(fn: _F) -> _F:
    """Mark :class:`Provider`'s placeholder of a required driver method."""
    fn.__hostkv_driver__ = True  # type: ignore[attr-defined]
    return fn


#: public verb -> the driver method it needs unless the verb itself is overridden
_DRIVERS = {
    "present": "_present", "entry": "_entry", "in_flight": "_in_flight", "reserve": "_reserve",
    "write": "_write", "seal": "_seal", "abort": "_abort", "read": "_read", "evict": "_evict",
    "put_anchor": "_put_anchor", "get_anchor": "_get_anchor", "list_anchors": "_list_anchors",
    "lease": "_lease",
}


class _ProviderMeta(abc.ABCMeta):
    """ABCMeta that treats a driver method as abstract exactly when its public verb is the
    front's and no class implements the driver: a provider implements each verb one way or the
    other, and one that does neither cannot be instantiated (``TypeError`` naming the driver)."""

    def __new__(mcls, name: str, bases: tuple[type, ...], ns: dict[str, Any], **kw: Any) -> _ProviderMeta:
        cls = super().__new__(mcls, name, bases, ns, **kw)
        missing = {driver for verb, driver in _DRIVERS.items()
                   if getattr(getattr(cls, verb, None), "__hostkv_front__", False)
                   and getattr(getattr(cls, driver, None), "__hostkv_driver__", False)}
        if missing:
            cls.__abstractmethods__ = frozenset(cls.__abstractmethods__ | missing)
        return cls


# --------------------------------------------------------------------------------------------
# The ABC
# --------------------------------------------------------------------------------------------


class Provider(abc.ABC, metaclass=_ProviderMeta):
    """A host-side store of KV pages, addressed by content key.

    Entries form a tree: every entry but a root names a ``parent`` that was stored before it.
    Every implementation keeps these invariants (the conformance suite checks each):

    1. **Prefix-closed tree.**  If an entry is present, its parent is present.  ``reserve``
       refuses a parent that is not sealed (``UnknownKeyError``).  Eviction removes leaves only,
       least-recently-used first; removing a key removes its whole subtree.
    2. **Never wrong bytes.**  ``read`` returns exactly the bytes sealed under that key, or a miss.
       A checksum recorded at seal that fails on read drops the entry with its subtree, is counted
       in ``stats().checksum_failures`` and reported as a miss.
    3. **Budget.**  ``stats().used_bytes <= budget_bytes`` at every moment.  A reservation that
       cannot be satisfied even by evicting every evictable entry raises ``CapacityError``
       *without evicting anything*.
    4. **Leases win.**  Leased entries, in-flight reservations and the ancestors of either are
       never evicted (by policy or by ``evict(keys)``).
    5. **Thread-safe.**  Every method may be called from any thread.  Persistent providers state
       their multi-process rules and enforce them with locks.
    6. **Typed errors**, rooted at ``HostKVError``.  A miss is a return value.  After ``close``
       every method raises ``ClosedError``; in a forked child, ``UsedAfterForkError``.

    Two-phase writes: ``reserve`` → ``write``\\* → ``seal`` publishes atomically (before it nothing
    of the entry is visible; after it ``present``/``read`` see exactly the written bytes);
    ``abort`` leaves no trace.

    Subclasses set ``name`` (equal to their entry-point name) and implement the abstract methods.
    They build instances from URLs through :meth:`from_url`.
    """

    #: The URL scheme and entry-point name.
    name: ClassVar[str] = ""
    #: Entries survive ``close`` and a process restart.
    persistent: ClassVar[bool] = False
    #: Several processes may open the same store at once.
    multiprocess: ClassVar[bool] = False

    def __init__(self) -> None:
        self._pid = os.getpid()
        self._closed = False
        self._stat_counts: dict[str, int] = dict.fromkeys(COUNTED, 0)
        self._stat_lock = threading.Lock()
        # Where a provider with store-wide counters (SupportsStoreCounters) also adds every
        # count the front makes, under ``_stat_lock`` (the sink's row is this instance's alone).
        self._store_sink: _CounterSink | None = None
        # The front's claims: a reservation's seal or abort is claimed under this lock, so a
        # racing seal/abort/write of another thread gets ReservationError instead of racing it
        # (a concurrent abort freed the slot of a seal whose record was being written).  It also
        # counts the write-path calls under way, which ``_quiesce`` (close) waits for.
        self._claim_lock = threading.Lock()
        self._calls_idle = threading.Condition(self._claim_lock)
        self._calls = 0
        self._closing = False

    # -- construction --------------------------------------------------------------------
    @classmethod
    @abc.abstractmethod
    def from_url(cls, location: str, options: Mapping[str, str]) -> Provider:
        """Build an instance from a parsed URL.

        ``location`` is the URL without scheme and query (``/var/cache/kv`` for
        ``mmap:///var/cache/kv?budget=8GiB``); ``options`` the query parameters.  Unknown options
        raise ``InvalidArgumentError`` naming the accepted ones.
        """

    @classmethod
    def capability_names(cls) -> frozenset[str]:
        """The optional powers this provider class has: the flags it sets and the capability
        Protocols whose every member it implements (see ``CAPABILITY_NAMES``)."""
        caps = {flag for flag in CAPABILITY_FLAGS if getattr(cls, flag)}
        caps.update(name for name, members in _MEMBERS.items()
                    if all(getattr(cls, m, None) is not None for m in members))
        return frozenset(caps)

    # -- lifecycle checks ----------------------------------------------------------------
    def _check_usable(self) -> None:
        """Raise ``ClosedError``/``UsedAfterForkError`` as the contract demands."""
        if self._closed:
            raise ClosedError(f"{type(self).__name__} is closed")
        if os.getpid() != self._pid:
            raise UsedAfterForkError(f"{type(self).__name__} was opened in process {self._pid}")

    def _check_not_forked(self) -> None:
        """For ``close``: in a forked child it raises ``UsedAfterForkError`` like every method
        (closing the parent's files, locks or memory from the child would break the parent);
        after ``close`` it is still a no-op."""
        if os.getpid() != self._pid:
            raise UsedAfterForkError(f"{type(self).__name__} was opened in process {self._pid}",
                                     hint="open a new provider in the child; the parent closes its own")

    def _call_begin(self, cleanup: bool = False) -> None:
        """Count a write-path call (reserve, write, seal, abort, a batch put) under way, so that
        :meth:`_quiesce` can wait for it; ``ClosedError`` once a close has begun, except for a
        ``cleanup`` call (an abort: it gives space back).  Pair it with :meth:`_call_end` in a
        ``finally``.  Call it after ``_check_usable`` (in a forked child the lock may be a copy
        held forever).  Not a context manager: this runs on every page's write and seal."""
        with self._claim_lock:
            if self._closing and not cleanup:
                raise ClosedError(f"{type(self).__name__} is closing")
            self._calls += 1

    def _call_end(self) -> None:
        with self._claim_lock:
            self._calls -= 1
            if not self._calls and self._closing:
                self._calls_idle.notify_all()

    @contextlib.contextmanager
    def _write_call(self) -> Iterator[None]:
        """:meth:`_call_begin` / :meth:`_call_end` around a batch call (``put_many``, ...)."""
        self._call_begin()
        try:
            yield
        finally:
            self._call_end()

    def _quiesce(self, timeout: float = 60.0) -> None:
        """For ``close``: new write-path calls get ``ClosedError`` from now on; wait (up to
        ``timeout`` seconds) for those under way, so that each of them either completes or
        leaves its reservation where ``close`` finds and aborts it (issue 16 item 7: a ``put``
        racing ``close`` left its reservation in the store, alive after a reopen).  Call it
        before taking the provider's own lock and from outside any write-path call."""
        with self._claim_lock:
            self._closing = True
            deadline = time.monotonic() + timeout
            while self._calls and (left := deadline - time.monotonic()) > 0:
                self._calls_idle.wait(left)
            if self._calls:
                warnings.warn(f"closing {type(self).__name__} while {self._calls} write calls are still running",
                              ResourceWarning, stacklevel=3)

    @contextlib.contextmanager
    def _locked(self, lock: contextlib.AbstractContextManager[Any]) -> Iterator[None]:
        """Check usability, take ``lock``, check again.

        The first check matters in a forked child: the lock may have been copied while another
        thread of the parent held it, and waiting on it would hang forever.  The second one sees a
        ``close`` that raced the first.
        """
        self._check_usable()
        with lock:
            self._check_usable()
            yield

    def _reserve_args(
        self, key: object, parent: object, nbytes: object, salt_tag: object, *, tag_max: int | None = None
    ) -> tuple[Key, Key | None, int]:
        """Validate ``reserve``'s arguments (the checks every provider makes, with typed errors);
        ``tag_max`` (default: the provider's ``_tag_max``) bounds the salt tag's UTF-8 length for
        media that store it in a fixed field."""
        if tag_max is None:
            tag_max = self._tag_max
        k = as_key(key)
        p = None if parent is None else as_key(parent, "parent")
        if type(nbytes) is not int or nbytes <= 0:
            raise InvalidArgumentError(f"nbytes must be a positive int, got {nbytes!r}")
        if type(salt_tag) is not str:
            raise InvalidArgumentError(f"salt_tag must be a str, got {type(salt_tag).__name__}")
        if tag_max is not None or not salt_tag.isascii():
            # a lone surrogate cannot be encoded: a medium that stores the tag would fail later,
            # after put() returned (issue 16 item 14), so every provider refuses it here
            try:
                tag_nbytes = len(salt_tag.encode("utf-8"))
            except UnicodeEncodeError:
                raise InvalidArgumentError("salt_tag must be valid Unicode text") from None
            if tag_max is not None and tag_nbytes > tag_max:
                raise InvalidArgumentError(f"salt_tag must be at most {tag_max} UTF-8 bytes, got {tag_nbytes}",
                                           hint="use Salt.tag (16 hex characters)")
        if p == k:
            raise InvalidArgumentError("an entry cannot be its own parent")
        return k, p, nbytes

    def _put_many_args(self, items: object, salt_tag: object, *,
                       tag_max: int | None = None) -> list[tuple[Key, Key | None, memoryview]]:
        """Validate ``put_many``'s items (``(key, parent, data)`` tuples) as :meth:`_reserve_args`
        does each page's; returns ``(key, parent, bytes view)`` per item."""
        if isinstance(items, (bytes, bytearray, memoryview, str)) or not isinstance(items, Sequence):
            raise InvalidArgumentError("put_many items are (key, parent, data) tuples")
        out: list[tuple[Key, Key | None, memoryview]] = []
        for it in items:
            if not isinstance(it, tuple) or len(it) != 3:
                raise InvalidArgumentError("put_many items are (key, parent, data) tuples")
            view = readable_bytes(it[2])
            k, p, _ = self._reserve_args(it[0], it[1], view.nbytes, salt_tag, tag_max=tag_max)
            out.append((k, p, view))
        return out

    def _put_many_columns(self, items: object, salt_tag: object, *, tag_max: int | None = None
                          ) -> tuple[list[Key], list[Key | None], list[memoryview]]:
        """:meth:`_put_many_args` as three lists (keys, parents, byte views) for a batch path
        that works on columns: the same checks and errors, the salt tag checked once (with the
        first item) instead of per item, and no tuple built per page."""
        if isinstance(items, (bytes, bytearray, memoryview, str)) or not isinstance(items, Sequence):
            raise InvalidArgumentError("put_many items are (key, parent, data) tuples")
        keys: list[Key] = []
        parents: list[Key | None] = []
        views: list[memoryview] = []
        add_key, add_parent, add_view = keys.append, parents.append, views.append
        for it in items:
            if not isinstance(it, tuple) or len(it) != 3:
                raise InvalidArgumentError("put_many items are (key, parent, data) tuples")
            k, p, data = it
            # readable_bytes, inline (this runs once per page)
            try:
                view = memoryview(data)
            except TypeError:
                raise InvalidArgumentError(
                    f"data must support the buffer protocol, got {type(data).__name__}") from None
            if not view.c_contiguous:
                raise InvalidArgumentError("data must be C-contiguous")
            if view.ndim != 1 or view.format != "B":
                view = view.cast("B")
            if not keys:  # the first item: every check, the salt tag's included
                k, p, _ = self._reserve_args(k, p, view.nbytes, salt_tag, tag_max=tag_max)
            else:
                if type(k) is not bytes or len(k) != KEY_NBYTES:
                    k = as_key(k)
                if p is not None and (type(p) is not bytes or len(p) != KEY_NBYTES):
                    p = as_key(p, "parent")
                if not view.nbytes:
                    raise InvalidArgumentError("nbytes must be a positive int, got 0")
                if p == k:
                    raise InvalidArgumentError("an entry cannot be its own parent")
            add_key(k)
            add_parent(p)
            add_view(view)
        return keys, parents, views

    def _read_many_args(self, keys: object, outs: object) -> tuple[list[Key], Sequence[object]]:
        """Validate ``read_many``'s arguments: the keys, and one output buffer per key (each
        buffer is checked against its entry's size by the read itself)."""
        ks = self._keys(keys)  # type: ignore[arg-type]
        if isinstance(outs, (bytes, bytearray, memoryview, str)) or not isinstance(outs, Sequence):
            raise InvalidArgumentError(f"outs must be a sequence of buffers, one per key, got {type(outs).__name__}")
        if len(outs) != len(ks):
            raise InvalidArgumentError(f"{len(outs)} output buffers for {len(ks)} keys")
        return ks, outs

    @staticmethod
    def _failed_parent(parent: Key | None, failed: set[Key], key: Key) -> UnknownKeyError | None:
        """For ``put_many``: the error of an item whose parent failed earlier in the same call
        (``key`` then counts as failed too), else ``None``."""
        if parent is None or parent not in failed:
            return None
        failed.add(key)
        return UnknownKeyError(f"parent {parent.hex()[:16]} failed earlier in this put_many")

    @contextlib.contextmanager
    def _claimed_seals(self, reservations: Sequence[Reservation]) -> Iterator[None]:
        """Claim ``reservations`` for a batch seal (as :meth:`seal` claims one): another thread's
        seal, abort or write of any of them meanwhile gets ``ReservationError``; released on
        exit.  ``ReservationError`` if one is not open (or claimed by another thread)."""
        me = threading.get_ident()
        claimed: list[Reservation] = []
        try:
            with self._claim_lock:
                for r in reservations:
                    r.check_open(self)
                    if r._claim is None:
                        r._claim = (me, "seal")
                        claimed.append(r)
            yield
        finally:
            for r in claimed:
                r._claim = None

    def _own_reservation(self, reservation: Reservation, kind: type[_R]) -> _R:
        """``reservation`` as one of this provider's open reservations (of class ``kind``).

        Raises ``ReservationError`` for a reservation of another provider or class, or one that
        was already sealed or aborted."""
        if not isinstance(reservation, kind):
            raise ReservationError("not a reservation of this provider")
        reservation.check_open(self)
        return reservation

    @property
    def closed(self) -> bool:
        return self._closed

    # -- the front: the contract's rules, once ----------------------------------------------
    #
    # Every public verb below validates its arguments, checks that the provider is usable
    # (open, not inherited through fork), calls the medium's driver method with validated
    # arguments, counts what the contract counts, and applies the checksum rule.  A medium
    # implements the protected ``_driver`` methods only (see docs/writing-a-provider.md).  A
    # provider that overrides a public verb itself (a third-party one written before the
    # drivers) keeps working: it then needs no driver for that verb.

    #: The reservation class this provider's ``_reserve`` returns; ``write``/``seal`` refuse others.
    _reservation_type: ClassVar[type[Reservation]] = Reservation
    #: Bound on the salt tag's UTF-8 length for media that store it in a fixed field (``None``:
    #: any).  A provider over other providers (tiered) takes the smallest bound of its tiers, so
    #: it refuses up front a tag a tier could not store (issue 16 item 14).
    _tag_max: int | None = None

    def _tallies(self) -> dict[str, Any]:
        """A consistent copy of the front's counters (``ProviderStats(**self._tallies(), ...)``)."""
        with self._stat_lock:
            return {k: self._stat_counts.get(k, 0) for k in COUNTED}

    def _tally(self, name: str, n: int = 1) -> None:
        """Add ``n`` to the front's counter ``name`` (``stats()`` reports them; a provider with a
        store sink also adds it store-wide)."""
        with self._stat_lock:
            self._stat_counts[name] = self._stat_counts.get(name, 0) + n
            if self._store_sink is not None:
                self._store_sink.add(name, n)

    # -- lookups -------------------------------------------------------------------------
    @_front
    def present(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key is sealed.  In-flight reservations are not present."""
        self._check_usable()
        return self._present(self._key_batch(keys))

    @_front
    def longest_prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading keys of a chain are stored (0 when the first is missing)."""
        self._check_usable()
        return self._longest_prefix(self._key_batch(keys))

    @_front
    def entry(self, key: bytes) -> EntryInfo | None:
        """Metadata of a sealed entry, or ``None``."""
        k = as_key(key)
        self._check_usable()
        return self._entry(k)

    @_front
    def in_flight(self, key: bytes) -> bool:
        """Whether ``key`` is reserved by some writer and not yet sealed or aborted."""
        k = as_key(key)
        self._check_usable()
        return self._in_flight(k)

    # -- writes --------------------------------------------------------------------------
    @_front
    def reserve(self, key: bytes, parent: bytes | None, nbytes: int, *, salt_tag: str = "") -> Reservation | None:
        """Reserve space for a new entry, evicting least-recently-used leaves if needed.

        Parameters
        ----------
        key:
            The entry's 32-byte key.
        parent:
            The key of the previous page of the chain (must be sealed), or ``None`` for a root.
        nbytes:
            The entry size in bytes (> 0).
        salt_tag:
            The configuration tag (``Salt.tag``) recorded with the entry.

        Returns
        -------
        Reservation or None
            ``None`` when ``key`` is already sealed (dedup: nothing to write).

        Raises
        ------
        InFlightError
            Another writer holds a reservation for ``key``; wait with :meth:`wait_sealed`.
        UnknownKeyError
            ``parent`` is not sealed.
        CapacityError
            Even evicting every evictable entry would not make room; nothing was evicted.
        """
        k, p, n = self._reserve_args(key, parent, nbytes, salt_tag)
        self._check_usable()
        self._call_begin()
        try:
            res = self._reserve(k, p, n, salt_tag)
        finally:
            self._call_end()
        if res is None:
            self._tally("dedup")
        return res

    @_front
    def write(self, reservation: Reservation, offset: int, data: object) -> None:
        """Copy ``data`` (any C-contiguous buffer) to bytes ``[offset, offset+len)`` of the entry.

        Raises ``SpanError`` past the reservation's end and ``ReservationError`` after seal/abort.
        """
        view = readable_bytes(data)
        self._check_usable()
        res = self._own_reservation(reservation, self._reservation_type)
        span = res.check_write(offset, view.nbytes)
        self._call_begin()  # close() must not close a file under this write
        try:
            self._write(res, span, view)
        finally:
            self._call_end()
        res.mark_written(span)
        with self._stat_lock:  # (inlined _tally: this runs once per page)
            self._stat_counts["bytes_written"] += span.nbytes
            if self._store_sink is not None:
                self._store_sink.add("bytes_written", span.nbytes)

    @_front
    def seal(self, reservation: Reservation) -> None:
        """Publish the entry atomically and durably (per the store's durability mode).

        Raises ``IncompleteWriteError`` (reservation left open) if bytes are missing.
        """
        self._check_usable()
        res = self._own_reservation(reservation, self._reservation_type)
        res.check_complete()
        self._call_begin()
        try:
            with self._claim_lock:  # claim it: another thread's seal/abort/write now gets ReservationError
                res.check_open(self)
                res._claim = (threading.get_ident(), "seal")
            try:
                self._seal(res)
            finally:
                res._claim = None
        finally:
            self._call_end()
        if res.state == "sealed":  # (a seal that lost a race with close finishes it "aborted")
            with self._stat_lock:
                self._stat_counts["seals"] += 1
                if self._store_sink is not None:
                    self._store_sink.add("seals", 1)

    @_front
    def abort(self, reservation: Reservation) -> None:
        """Release the reservation; nothing of it stays visible or accounted.  Aborting twice, or
        after seal, is a no-op."""
        if not isinstance(reservation, self._reservation_type) or reservation.provider is not self:
            raise ReservationError("not a reservation of this provider")
        # After close or in a forked child the medium is gone or not ours: a typed error
        # (Reservation.__exit__ turns it into a warning during exception cleanup).
        self._check_usable()
        me = threading.get_ident()
        self._call_begin(cleanup=True)
        try:
            with self._claim_lock:  # claim it (not held through _abort: drivers may call abort under their lock)
                if reservation.state != "open":
                    return
                claim = reservation._claim
                if claim is not None and claim[0] != me:
                    if claim[1] == "abort":
                        return  # another thread is aborting it: aborting twice is a no-op
                    raise ReservationError(f"the reservation for {reservation.key.hex()[:16]} is being sealed",
                                           hint="a seal under way wins; abort after it is a no-op")
                mine = claim is None
                if mine:
                    reservation._claim = (me, "abort")
            try:
                aborted = self._abort(reservation)
            finally:
                if mine:
                    reservation._claim = None
        finally:
            self._call_end()
        if aborted:
            self._tally("aborts")

    # -- reads ---------------------------------------------------------------------------
    @_front
    def read(self, key: bytes, out: object, span: ByteSpan | None = None) -> bool:
        """Copy the entry (or ``span`` of it) into ``out``; return ``False`` on a miss.

        ``out`` is a writable C-contiguous buffer of at least ``span.nbytes`` bytes.  A checksum
        failure drops the entry and its subtree and returns ``False``.  Raises ``SpanError`` for a
        span outside the entry.
        """
        k = as_key(key)
        if span is not None and not isinstance(span, ByteSpan):
            raise InvalidArgumentError("span must be a ByteSpan")
        self._check_usable()
        got = self._read(k, out, span)
        if type(got) is int:  # a hit: the driver validated ``out`` (writable_buffer) to copy into it
            with self._stat_lock:  # (inlined _tally: this runs once per page)
                c = self._stat_counts
                c["hits"] += 1
                c["bytes_read"] += got
                if self._store_sink is not None:
                    self._store_sink.add_hit(got)
            return True
        if isinstance(got, Corrupt) and self._drop_damaged(k, got.token):
            # never wrong bytes: the first reader to see the mismatch drops the entry with its
            # subtree (a racing reader or a seal of the key since then leaves nothing to drop)
            self._tally("checksum_failures")
        writable_buffer(out, 0)  # a bad buffer is misuse even when the key is a miss
        self._tally("misses")
        return False

    def _tally_hit(self, nbytes: int, hits: int = 1) -> None:
        """``hits`` read hits of ``nbytes`` bytes in all (a batch counts once, not per page)."""
        with self._stat_lock:
            c = self._stat_counts
            c["hits"] = c.get("hits", 0) + hits
            c["bytes_read"] = c.get("bytes_read", 0) + nbytes
            if self._store_sink is not None:
                if hits == 1:
                    self._store_sink.add_hit(nbytes)
                elif hits:
                    self._store_sink.add_many({"hits": hits, "bytes_read": nbytes})

    def read_bytes(self, key: bytes, span: ByteSpan | None = None) -> bytes | None:
        """Convenience: the entry's bytes (or ``span`` of them), or ``None`` on a miss."""
        if span is not None and not isinstance(span, ByteSpan):
            check_span(span, 0)  # raises: a wrong type is an error also for a key that misses
        info = self.entry(key)
        if info is None:
            self._tally("misses")  # (a miss of read() is counted there: hit ratios need both)
            return None
        span = check_span(span, info.nbytes)
        buf = bytearray(span.nbytes)
        return bytes(buf) if self.read(key, buf, span) else None

    def put(self, key: bytes, parent: bytes | None, data: object, *, salt_tag: str = "") -> bool:
        """Convenience: reserve, write and seal ``data``; ``False`` if the key was already stored."""
        view = readable_bytes(data)
        res = self.reserve(key, parent, view.nbytes, salt_tag=salt_tag)
        if res is None:
            return False
        with res:
            self.write(res, 0, view)
        return True

    def wait_sealed(self, key: bytes, timeout: float) -> bool:
        """Wait until ``key`` is sealed or no longer in flight; ``True`` if it is present.

        ``timeout`` is in seconds, ``>= 0`` (``inf``: wait as long as the key is in flight);
        anything else raises ``InvalidArgumentError`` (``nan`` would never end the wait).  The
        default polls :meth:`present`; providers with a notification path override it (and
        validate ``timeout`` the same way, with :func:`check_timeout`).
        """
        key = as_key(key)
        deadline = time.monotonic() + check_timeout(timeout)
        delay = 0.0005
        while True:
            if self.present([key])[0]:
                return True
            if not self.in_flight(key) or time.monotonic() >= deadline:
                return self.present([key])[0]
            time.sleep(delay)
            delay = min(delay * 2, 0.05)

    def prefetch(self, keys: Sequence[bytes]) -> None:
        """A hint that ``keys`` will be read soon.  A provider whose reads may wait on a slower
        medium (a disk, a network) can start bringing their bytes closer now, without blocking
        the caller, so that the caller's work on an earlier batch overlaps the medium.  Never
        required to do anything, never an error for a key that is not stored; the default does
        nothing but check its arguments and state like every method (an override does the same:
        ``self._check_usable()`` and ``self._keys(keys)``).
        :class:`~hostkv_providers.HostKVCache` calls it with the next chunk of a staged restore
        before it reads the current one."""
        self._keys(keys)
        self._check_usable()

    # -- eviction ------------------------------------------------------------------------
    @_front
    def evict(self, keys: Sequence[bytes] | None = None, *, nbytes: int = 0) -> EvictReport:
        """Remove entries: ``keys`` with their subtrees, or at least ``nbytes`` by LRU-leaf policy.

        Exactly one of ``keys`` / ``nbytes`` is given.  Leased and in-flight entries and their
        ancestors are skipped (counted in ``EvictReport.skipped``); the tree stays prefix-closed.
        """
        if type(nbytes) is not int or nbytes < 0:
            raise InvalidArgumentError(f"nbytes must be a non-negative int, got {nbytes!r}")
        if (keys is None) == (not nbytes):
            raise InvalidArgumentError("give exactly one of keys or nbytes")
        ks = self._keys(keys) if keys is not None else None
        self._check_usable()
        return self._evict(ks, nbytes)

    # -- anchors -------------------------------------------------------------------------
    @_front
    def put_anchor(self, key: bytes, name: str, data: object) -> None:
        """Attach (or replace) the named blob on a sealed entry; ``UnknownKeyError`` if absent.

        Anchor bytes count against the budget and are evicted with their entry.
        """
        k = as_key(key)
        check_anchor_name(name)
        blob = bytes(readable_bytes(data))
        self._check_usable()
        self._put_anchor(k, name, blob)

    @_front
    def get_anchor(self, key: bytes, name: str) -> bytes | None:
        """The named anchor's bytes, or ``None`` (entry or anchor missing)."""
        k = as_key(key)
        check_anchor_name(name)
        self._check_usable()
        return self._get_anchor(k, name)

    def read_anchor(self, key: bytes, name: str, into: object) -> int | None:
        """Copy the named anchor's bytes into the caller's buffer(s), once, verified.

        ``into`` is one writable buffer or a sequence of them filled in order (a scatter read:
        e.g. a small header buffer, then the engine's state buffer); together they must hold at
        least the anchor's size (``list_anchors``), the last one may be larger.  Returns the
        anchor's size, or ``None`` (entry or anchor missing, or its bytes failed their checksum:
        the buffers' contents are then unspecified).  Providers copy straight from their medium
        into ``into``; the default goes through ``get_anchor``.
        """
        k = as_key(key)
        check_anchor_name(name)
        bufs = _scatter_buffers(into)
        self._check_usable()
        return self._read_anchor(k, name, bufs)

    def _read_anchor(self, key: Key, name: str, bufs: list[memoryview]) -> int | None:
        """The default: :meth:`get_anchor`, then one copy into ``bufs`` (a provider whose
        ``get_anchor`` already copies overrides this to copy from its medium directly)."""
        blob = self.get_anchor(key, name)  # the verb: a provider may override it, not its driver
        if blob is None:
            return None
        scatter_into(bufs, memoryview(blob).cast("B"))
        return len(blob)

    @_front
    def list_anchors(self, key: bytes) -> dict[str, int]:
        """``{name: nbytes}`` of the entry's anchors (empty if the entry is missing)."""
        k = as_key(key)
        self._check_usable()
        return self._list_anchors(k)

    @_front
    def deepest_anchor(self, keys: Sequence[bytes], name: str) -> int:
        """``i + 1`` for the deepest stored page ``keys[i]`` of the chain's stored prefix that
        carries anchor ``name``; 0 if none does.  A hybrid model's hit is usable up to there."""
        ks = self._keys(keys)
        check_anchor_name(name)
        self._check_usable()
        return self._deepest_anchor(ks, name)

    # -- leases --------------------------------------------------------------------------
    @_front
    def lease(self, keys: Sequence[bytes]) -> Lease:
        """Atomically pin every stored key among ``keys``; see :class:`Lease`."""
        ks = self._keys(keys)
        self._check_usable()
        return self._lease(ks)

    @abc.abstractmethod
    def _release_lease(self, lease: Lease) -> None:
        """Undo :meth:`lease` (called once, by ``Lease.release``)."""

    # -- the drivers: what a medium implements ---------------------------------------------
    #
    # Arguments arrive validated (keys are 32-byte ``bytes``, the reservation is one of this
    # provider's open ones, spans are ``ByteSpan``), after the usability check.  A driver that
    # takes a lock checks usability again under it (``self._locked(lock)``) to see a racing
    # close.  The ones marked "required" are abstract for a provider that does not override the
    # matching public verb.

    @_driver
    def _present(self, keys: Sequence[bytes]) -> list[bool]:
        """Required: whether each key is sealed.

        The one driver that validates its own keys: a chain lookup of 8,192 keys runs on every
        request, and validating them all first costs more than the lookup (measured 420 against
        250 us); so the front checks only the batch's shape and the driver validates as it looks
        up — ``self._membership(keys, contains)`` checks only the keys that miss (a hit equals a
        stored, hence valid, key) — or calls ``self._keys(keys)`` first.
        """
        raise NotImplementedError

    def _longest_prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading keys are stored; the default counts the hits of :meth:`present`."""
        hits = self.present(keys)
        return hits.index(False) if False in hits else len(hits)

    @_driver
    def _entry(self, key: Key) -> EntryInfo | None:
        """Required: the metadata of a sealed entry, or ``None``."""
        raise NotImplementedError

    @_driver
    def _in_flight(self, key: Key) -> bool:
        """Required: whether ``key`` is reserved and not yet sealed or aborted."""
        raise NotImplementedError

    @_driver
    def _reserve(self, key: Key, parent: Key | None, nbytes: int, salt_tag: str) -> Reservation | None:
        """Required: reserve (``None``: already sealed; the front counts the dedup).  Keeps the
        satisfiability guard: a ``CapacityError`` leaves everything as it was."""
        raise NotImplementedError

    @_driver
    def _write(self, reservation: Any, span: ByteSpan, data: memoryview) -> None:
        """Required: copy ``data`` (``span.nbytes`` bytes) to ``span`` of the reservation (the
        span is validated; the front marks it written)."""
        raise NotImplementedError

    @_driver
    def _seal(self, reservation: Any) -> None:
        """Required: publish the complete reservation and finish it (``_finish("sealed")``, or
        ``"aborted"`` when the seal fails for good); the front counts the seal."""
        raise NotImplementedError

    @_driver
    def _abort(self, reservation: Any) -> bool:
        """Required: release an open reservation; ``False`` when a racing seal/abort finished it
        first (nothing done, nothing counted)."""
        raise NotImplementedError

    @_driver
    def _read(self, key: Key, out: object, span: ByteSpan | None) -> int | Corrupt | None:
        """Required: copy the entry (or ``span``: validate it against the entry's size) into
        ``out`` (``writable_buffer(out, n)``).  Returns the bytes copied (a hit), ``None`` (a
        miss) or :class:`Corrupt` when the bytes fail their checksum — then the front calls
        :meth:`_drop_damaged` and reports a miss.  Never hands out bytes that failed."""
        raise NotImplementedError

    def _drop_damaged(self, key: Key, token: object) -> bool:
        """Drop the entry ``key`` with its subtree after its bytes failed their checksum, if the
        version ``token`` (from :class:`Corrupt`) is still the stored one; ``True`` if this call
        dropped it (the front counts a checksum failure).  Required when ``_read`` can return
        :class:`Corrupt`."""
        raise NotImplementedError(f"{type(self).__name__}._read returned Corrupt but has no _drop_damaged")

    @_driver
    def _evict(self, keys: list[Key] | None, nbytes: int) -> EvictReport:
        """Required: remove ``keys`` with their subtrees, or at least ``nbytes`` by LRU-leaf policy."""
        raise NotImplementedError

    @_driver
    def _put_anchor(self, key: Key, name: str, blob: bytes) -> None:
        """Required: attach ``blob`` as anchor ``name`` (``UnknownKeyError`` if not stored)."""
        raise NotImplementedError

    @_driver
    def _get_anchor(self, key: Key, name: str) -> bytes | None:
        """Required: the anchor's bytes or ``None``."""
        raise NotImplementedError

    @_driver
    def _list_anchors(self, key: Key) -> dict[str, int]:
        """Required: ``{name: nbytes}`` of the entry's anchors."""
        raise NotImplementedError

    def _deepest_anchor(self, keys: list[Key], name: str) -> int:
        """The default walks the stored prefix from its end with :meth:`list_anchors`."""
        for i in range(self.longest_prefix(keys) - 1, -1, -1):
            if name in self.list_anchors(keys[i]):
                return i + 1
        return 0

    @_driver
    def _lease(self, keys: list[Key]) -> Lease:
        """Required: pin every stored key among ``keys`` and return the :class:`Lease`."""
        raise NotImplementedError

    # -- the rest ------------------------------------------------------------------------
    @property
    @abc.abstractmethod
    def budget_bytes(self) -> int:
        """The configured byte budget."""

    @abc.abstractmethod
    def stats(self) -> ProviderStats:
        """Counters and gauges."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release resources; idempotent.  Persistent providers flush pending seals first."""

    def describe(self) -> dict[str, Any]:
        """Configuration and identity for operators (``hostkv info``): the identity, then the
        value in effect of every URL option the class declares in ``OPTIONS`` (an
        :class:`~hostkv_providers.providers.OptionSet`; each read from the option's ``attr``),
        under the option's name.  Subclasses add facts that are not options (a path, a
        generation) — the options themselves come from the declaration, as parsing and the docs'
        options tables do."""
        out: dict[str, Any] = {"provider": self.name, "budget_bytes": self.budget_bytes,
                               "persistent": self.persistent}
        options = getattr(type(self), "OPTIONS", None)
        if options is not None and hasattr(options, "values"):
            out.update(options.values(self))
        return out

    def __enter__(self) -> Provider:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- chain reservation (added verbs; defaults work for every provider) ------------------
    def reserve_many(self, keys: Sequence[bytes], parents: Sequence[bytes | None], nbytes: int, *,
                     salt_tag: str = "") -> ReservedChain:
        """Reserve a whole chain (or a run of one) at once, so a copy engine can write every page
        straight into provider memory before any of them is sealed.

        Parameters
        ----------
        keys, parents:
            The pages, root first, and each one's parent: ``None`` (a root), a sealed key, an
            earlier key of this call, or a key still in flight in an earlier ``reserve_many`` of
            the same writer (a long chain reserved run by run).
        nbytes:
            The size of every entry (pages of one layout are all the same size).
        salt_tag:
            As for :meth:`reserve`.

        Returns
        -------
        ReservedChain
            All or a prefix: the first key that cannot be reserved ends the call, with its error
            in ``error``; nothing after it is reserved.  Nothing of any entry is visible before
            its seal; seal with :meth:`seal_many` (root first) or abort each reservation.

        The default keeps the bytes in ordinary host buffers and stores each page when it is
        sealed (capacity and in-flight conflicts then surface at seal); providers with memory
        a copy engine can reach (``pinned``, ``tiered``) override it with real reservations.
        """
        return _chain.reserve_chain(self, keys, parents, nbytes, salt_tag)

    #: The checksum algorithm of the entries this store seals: ``"xxh3-64"`` (XXH3-64 of the
    #: whole entry) or ``"xxh3-256k-tree"`` (:mod:`hostkv_providers._blockhash`, which a GPU
    #: computes too).  ``seal_many(checksums=...)`` uses given checksums only when they are in
    #: this algorithm.
    checksum_algorithm: str = "xxh3-64"

    def seal_many(self, reservations: Sequence[Reservation], *, checksums: Sequence[int] | None = None,
                  algorithm: str | None = None) -> None:
        """Seal reservations root first (a parent before its children), as one batch.

        On failure the first error is raised; the reservations sealed by then are a prefix of
        ``reservations`` (possibly none: a provider that commits a batch at once seals all or
        nothing) and every other one is aborted.  A reservation whose parent was not sealed
        (aborted, or failed here) fails with ``UnknownKeyError``; one with unwritten bytes with
        ``IncompleteWriteError``.  Arguments refused before anything is sealed (``checksums``
        not one int per reservation or without ``algorithm``, a reservation of another provider
        or given twice: ``InvalidArgumentError`` or ``ReservationError``) change nothing: the
        reservations stay open, to be sealed again with corrected arguments or aborted.

        ``checksums[i]`` (with ``algorithm``) is the checksum of the bytes written to
        ``reservations[i]``, computed where they came from (a GPU kernel over the pages before
        their device-to-host copy): a store whose :attr:`checksum_algorithm` is ``algorithm``
        records it instead of hashing the bytes again; any other store ignores it.  A wrong
        value is caught like a flipped bit: the entry fails its first verified read (a miss)."""
        _chain.seal_chain(self, reservations, checksums, algorithm)

    @staticmethod
    def _key(value: object, what: str = "key") -> Key:
        return as_key(value, what)

    @staticmethod
    def _membership(keys: Sequence[bytes], contains: Callable[[Any], bool]) -> list[bool]:
        """``[contains(k) for k in keys]`` at C speed, validating only the keys that miss.

        A key that hits equals a stored (hence valid) key; misses are checked so a malformed key
        still raises ``InvalidArgumentError`` instead of reading as a miss.
        """
        if isinstance(keys, (bytes, bytearray, memoryview, str)):
            raise InvalidArgumentError("keys must be a sequence of keys, not one key")
        try:
            hits = list(map(contains, keys))
        except TypeError:  # unhashable items (bytearray ...) or not iterable
            return list(map(contains, Provider._keys(keys)))
        if not all(hits) and not Provider._plain_keys(keys):
            # (all 32-byte bytes: valid keys, checked at C speed; a new chain misses every page,
            # and one as_key per page was 3-6 ms of GIL on a save's calling thread)
            for key, hit in zip(keys, hits, strict=True):
                if not hit:
                    as_key(key)
        return hits

    @staticmethod
    def _key_batch(keys: Sequence[bytes]) -> Sequence[bytes]:
        """The shape check of a batch of keys (a sequence, not one key); the keys themselves are
        validated by ``_membership`` or ``_keys``."""
        if isinstance(keys, (bytes, bytearray, memoryview, str)):
            raise InvalidArgumentError("keys must be a sequence of keys, not one key")
        if not isinstance(keys, Sequence):
            try:
                keys = list(keys)
            except TypeError:
                raise InvalidArgumentError(f"keys must be a sequence, got {type(keys).__name__}") from None
        return keys

    @staticmethod
    def _plain_keys(keys: Sequence[object]) -> bool:
        """Whether every item is a 32-byte ``bytes`` (a valid key), checked at C speed."""
        return set(map(type, keys)) == {bytes} and set(map(len, keys)) == {KEY_NBYTES}  # type: ignore[arg-type]

    @staticmethod
    def _keys(values: Sequence[bytes]) -> list[Key]:
        """Validate a batch of keys; the common case (all 32-byte ``bytes``) runs at C speed."""
        if isinstance(values, (bytes, bytearray, memoryview, str)):
            raise InvalidArgumentError("keys must be a sequence of keys, not one key")
        try:
            keys = list(values)
        except TypeError:
            raise InvalidArgumentError(f"keys must be a sequence, got {type(values).__name__}") from None
        if keys and Provider._plain_keys(keys):
            return keys  # type: ignore[return-value]  # validated above: every item is a Key
        return [as_key(v) for v in keys]


