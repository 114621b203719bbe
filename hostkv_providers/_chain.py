"""Chain reservation: :meth:`Provider.reserve_many` / :meth:`Provider.seal_many`, what they
return (:class:`ReservedChain`) and the base class's default for a provider without its own
(deferred reservations: the bytes wait in host buffers and are stored at seal)."""

from __future__ import annotations

import abc
import contextlib
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from hostkv_providers._checks import readable_bytes
from hostkv_providers._errors import CapacityError, HostKVError, InFlightError, InvalidArgumentError, UnknownKeyError
from hostkv_providers._keys import Key
from hostkv_providers._region import HostPages, HostRegion
from hostkv_providers._reservation import Reservation

if TYPE_CHECKING:
    from hostkv_providers._provider import Provider

__all__ = ["ChainRun", "ReservedChain", "reserve_chain", "seal_chain"]


def _check_checksums(checksums: Sequence[int] | None, algorithm: str | None, n: int) -> None:
    """Validate ``seal_many``'s ``checksums=``/``algorithm=`` pair (one checksum per reservation)."""
    if checksums is None:
        return
    if not isinstance(algorithm, str):
        raise InvalidArgumentError("give algorithm= with checksums= (the algorithm they are in)")
    if isinstance(checksums, (str, bytes, bytearray, memoryview)) or not isinstance(checksums,
                                                                                  (Sequence, np.ndarray)):
        raise InvalidArgumentError(f"checksums must be a sequence of ints (one per reservation), got "
                                   f"{type(checksums).__name__}")
    if len(checksums) != n:
        raise InvalidArgumentError(f"{len(checksums)} checksums for {n} reservations; give one per reservation")
    # (refused before anything is sealed: a float, or an int outside 0 .. 2**64 - 1)
    if isinstance(checksums, np.ndarray):
        # (one dimension: an (n, 1) array passes len() but broadcasts wrongly in every later
        # comparison — a heap run's write-back then failed every page after the first)
        ok = checksums.ndim == 1 and (checksums.dtype.kind == "u"
                                      or (checksums.dtype.kind == "i" and not (n and checksums.min() < 0)))
    else:
        ok = all(type(c) is int or isinstance(c, np.integer) for c in checksums)
        if ok:
            try:
                np.array(checksums, dtype=np.uint64)
            except OverflowError:
                ok = False
    if not ok:
        raise InvalidArgumentError("checksums must be ints from 0 to 2**64 - 1, one per reservation (a 1-D array "
                                   "or a sequence of ints)")


def seal_args(provider: Provider, reservations: object, checksums: Sequence[int] | None,
              algorithm: str | None) -> list[Reservation]:
    """``seal_many``'s arguments, checked before anything is sealed: the reservations as a list
    (a generator is taken; a reservation given twice is refused) and the ``checksums``.  A
    refusal changes nothing: the reservations stay open, to be sealed again with corrected
    arguments or aborted (``Provider.seal_many``)."""
    if isinstance(reservations, (Reservation, str, bytes, bytearray, memoryview)):
        raise InvalidArgumentError("seal_many() takes a sequence of reservations")
    try:
        rs: list[Reservation] = list(reservations)  # type: ignore[call-overload]
    except TypeError:
        raise InvalidArgumentError("seal_many() takes a sequence of reservations") from None
    if len(set(map(id, rs))) != len(rs):
        raise InvalidArgumentError("a reservation is given twice to seal_many()")
    _check_checksums(checksums, algorithm, len(rs))
    return rs


class ChainRun(abc.ABC):
    """A provider's chunk-level chain reservation behind a :class:`ReservedChain`: a whole run of
    new pages (``keys[i]``'s parent ``keys[i - 1]``) held as one object, with no Python object
    per page, sealed all at once.  Providers whose ``reserve_many`` has such a path (``pinned``)
    return it as ``ReservedChain(run=...)``; callers use the chain's methods, which work the same
    for per-page reservations.

    ``materialize`` turns the run into one :class:`Reservation` per page (for a caller that wants
    to write, seal or abort pages one by one): from then on the run itself is inert."""

    #: the number of pages in the run
    n: int
    #: whether every page was written (``ReservedChain.mark_written``: a DMA filled the pages)
    written: bool = False
    #: pages sealed so far (0 or ``n``: a run commits all or nothing)
    sealed: int = 0

    @abc.abstractmethod
    def materialize(self) -> list[Reservation]:
        """One reservation per page, in the run's state (open, sealed or aborted)."""

    @abc.abstractmethod
    def seal(self, checksums: Sequence[int] | None, algorithm: str | None) -> None:
        """Seal every page (as ``seal_many``: checksums given in the store's algorithm are
        recorded as they are).  Nothing is sealed when it raises."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Drop the reservations of an open run (no-op otherwise)."""


class ReservedChain:
    """What :meth:`Provider.reserve_many` reserved: a *prefix* of the keys asked for.

    ``reservations[i]`` is the reservation of ``keys[i]``, or ``None`` where that key is already
    sealed (dedup: nothing to write, and later keys may name it as their parent).  When fewer
    than all keys were reserved, ``error`` is the typed error of the first key that was not
    (``CapacityError``, ``InFlightError``, ``UnknownKeyError``); nothing after it was reserved.

    A provider with a chunk-level path returns the reserved run as one :class:`ChainRun`
    (``run=``) and builds the per-page ``reservations`` only if someone asks for them.  The
    chain-level methods — :meth:`positions`, :meth:`mark_written`, :meth:`seal`,
    :meth:`abort`, :attr:`sealed` — work for both forms, so a copy engine's caller never needs a
    Python object per page (issue 14: per-page objects of a save set off the collector's full
    passes in the engine's process).
    """

    __slots__ = ("_reservations", "_run", "error", "pages")

    def __init__(self, reservations: list[Reservation | None] | None = None, error: HostKVError | None = None,
                 pages: HostPages | None = None, *, run: ChainRun | None = None) -> None:
        if reservations is None and run is None:
            reservations = []
        self._reservations = reservations
        self._run = run
        self.error = error
        #: The reserved (not ``None``) reservations' memory as one chunk-level :class:`HostPages`,
        #: when the provider has it (each page one contiguous piece of host memory): a copy engine
        #: fills the chunk from it without a Python object per page.  ``None`` otherwise: use
        #: ``regions()`` of each reservation.
        self.pages = pages

    @property
    def reservations(self) -> list[Reservation | None]:
        """Per key: its reservation, or ``None`` (already sealed).  Built on first access for a
        chunk-level run (which is then inert: use the reservations from there on)."""
        if self._reservations is None:
            assert self._run is not None
            self._reservations = list(self._run.materialize())
        return self._reservations

    @property
    def run(self) -> ChainRun | None:
        """The chunk-level run, while it has not been materialized into reservations."""
        return self._run if self._reservations is None else None

    def __len__(self) -> int:
        if self._reservations is None:
            assert self._run is not None
            return self._run.n
        return len(self._reservations)

    def positions(self) -> list[int]:
        """The indexes of the keys that were reserved (not already sealed), in order."""
        if self._reservations is None:
            assert self._run is not None
            return list(range(self._run.n))
        return [i for i, r in enumerate(self._reservations) if r is not None]

    def mark_written(self) -> None:
        """Declare every reserved page fully written (a copy engine filled ``pages``)."""
        if self._reservations is None:
            assert self._run is not None
            self._run.written = True
            return
        for r in self._reservations:
            if r is not None:
                r.mark_written()

    def seal(self, *, checksums: Sequence[int] | None = None, algorithm: str | None = None) -> None:
        """Seal the reserved pages root first, with :meth:`Provider.seal_many`'s rules (given
        ``checksums``: one per reserved page, in ``positions()`` order).  On failure the sealed
        pages are a prefix (see :attr:`sealed`) and the rest are aborted."""
        if self._reservations is None:
            assert self._run is not None
            _check_checksums(checksums, algorithm, self._run.n)  # (refused: the run stays open)
            try:
                self._run.seal(checksums, algorithm)
            except BaseException:
                with contextlib.suppress(HostKVError):
                    self._run.abort()
                raise
            return
        real = [r for r in self._reservations if r is not None]
        if real:
            real[0].provider.seal_many(real, checksums=checksums, algorithm=algorithm)

    def abort(self) -> None:
        """Abort every reserved page still open (errors of a closed provider are swallowed:
        its memory is gone with it)."""
        if self._reservations is None:
            assert self._run is not None
            with contextlib.suppress(HostKVError):
                self._run.abort()
            return
        for r in self._reservations:
            if r is not None and r.state == "open":
                with contextlib.suppress(HostKVError):
                    r.abort()

    @property
    def sealed(self) -> int:
        """How many of the reserved pages are sealed (a prefix of ``positions()``)."""
        if self._reservations is None:
            assert self._run is not None
            return self._run.sealed
        n = 0
        for r in self._reservations:
            if r is not None:
                if r.state != "sealed":
                    break
                n += 1
        return n

    def __repr__(self) -> str:
        form = f"run of {self._run.n}" if self._reservations is None and self._run is not None else \
            f"{len(self._reservations or ())} reservations"
        return f"ReservedChain({form}, error={self.error!r})"


class _DeferredReservation(Reservation):
    """The base class's chain reservation for a provider without its own: the bytes wait in an
    ordinary host buffer and are stored by ``seal_many`` (reserve, write, seal, in that call).
    Nothing is visible or accounted before that; capacity is found short only then."""

    __slots__ = ("_buf", "_view")

    def __init__(self, provider: Provider, key: Key, parent: Key | None, nbytes: int, salt_tag: str) -> None:
        super().__init__(provider, key, parent, nbytes, salt_tag)
        self._buf = bytearray(nbytes)
        self._view = memoryview(self._buf)

    def regions(self) -> Sequence[HostRegion]:
        self.check_open(self._provider)
        import ctypes  # only here: the address of the buffer for a copy engine

        address = ctypes.addressof(ctypes.c_char.from_buffer(self._buf))
        return [HostRegion(0, self._view, address, False)]

    def write(self, offset: int, data: object) -> None:
        self.check_open(self._provider)
        view = readable_bytes(data)
        span = self.check_write(offset, view.nbytes)
        self._view[span.offset : span.end] = view
        self.mark_written(span)

    def _store(self) -> None:
        self.check_open(self._provider)
        self.check_complete()
        try:
            self._provider.put(self.key, self.parent, self._view, salt_tag=self.salt_tag)
        except BaseException:
            self.abort()
            raise
        self._finish("sealed")

    def seal(self) -> None:
        self._provider.seal_many([self])

    def abort(self) -> None:
        if self._state == "open":
            self._finish("aborted")

    def _finish(self, state: str) -> None:
        super()._finish(state)
        _DEFERRED.pop((id(self._provider), self.key), None)


# Open deferred reservations by (provider id, key): a later reserve_many may chain onto them.
_DEFERRED: weakref.WeakValueDictionary[tuple[int, Key], _DeferredReservation] = weakref.WeakValueDictionary()


def chain_keys(provider: Provider, keys: Sequence[bytes], parents: Sequence[bytes | None]) -> list[Key]:
    """``reserve_many``'s shape checks: the keys validated, and one parent per key."""
    ks = provider._keys(keys)
    if isinstance(parents, (bytes, bytearray, memoryview, str)) or not isinstance(parents, (Sequence, np.ndarray)):
        raise InvalidArgumentError(f"parents must be a sequence (one parent per key: bytes or None), got "
                                   f"{type(parents).__name__}")
    if len(parents) != len(ks):
        raise InvalidArgumentError(f"{len(parents)} parents for {len(ks)} keys; give one per key")
    if not set(map(type, parents)) <= _PARENT_TYPES:  # (numpy rows broke comparisons further on)
        bad = next(p for p in parents if type(p) not in _PARENT_TYPES)
        raise InvalidArgumentError(f"a parent must be bytes or None, got {type(bad).__name__}")
    return ks


_PARENT_TYPES = frozenset((bytes, bytearray, memoryview, type(None)))


def reserve_run_first(provider: Provider, ks: list[Key], parents: Sequence[bytes | None], nbytes: int,
                      salt_tag: str,
                      reserve_run: Callable[[list[Key], Key | None, int, str], ReservedChain | None]
                      ) -> ReservedChain | None:
    """A chain run (each page's parent the page before) reserved as one run, no per-page objects,
    by the provider's ``reserve_run``; ``None`` when ``ks`` is not one or the provider declined
    (the caller then goes page by page)."""
    if len(ks) > 1 and list(parents[1:]) == ks[:-1]:
        _k0, p0, n = provider._reserve_args(ks[0], parents[0], nbytes, salt_tag)
        return reserve_run(ks, p0, n, salt_tag)
    return None


def reserve_chain(provider: Provider, keys: Sequence[bytes], parents: Sequence[bytes | None], nbytes: int,
                  salt_tag: str) -> ReservedChain:
    """The default :meth:`Provider.reserve_many`: deferred reservations (see its docstring)."""
    ks = chain_keys(provider, keys, parents)
    provider._check_usable()
    out: list[Reservation | None] = []
    batch: set[Key] = set()
    present = provider.present(ks) if ks else []
    budget = provider.budget_bytes  # (once: a remote store's may cost a round trip)
    for k, parent, here in zip(ks, parents, present, strict=True):
        k, p, n = provider._reserve_args(k, parent, nbytes, salt_tag)
        if here:
            out.append(None)
            batch.add(k)
            continue
        if provider.in_flight(k):
            return ReservedChain(out, InFlightError(f"key {k.hex()[:16]} is being written by another writer",
                                                    key=k))
        if (p is not None and p not in batch and (id(provider), p) not in _DEFERRED
                and not provider.present([p])[0] and not provider.in_flight(p)):
            return ReservedChain(out, UnknownKeyError(f"parent {p.hex()[:16]} is not stored"))
        if n > budget:  # (its buffer is allocated here: 2**62 raised a bare MemoryError)
            return ReservedChain(out, CapacityError(f"an entry of {n} bytes exceeds the budget of {budget} bytes"))
        res = _DeferredReservation(provider, k, p, n, salt_tag)
        _DEFERRED[(id(provider), k)] = res
        out.append(res)
        batch.add(k)
    return ReservedChain(out)


def seal_chain(provider: Provider, reservations: Sequence[Reservation], checksums: Sequence[int] | None,
               algorithm: str | None) -> None:
    """The default :meth:`Provider.seal_many`: seal (or store, for a deferred reservation) root
    first; on failure abort the rest and raise (see its docstring)."""
    reservations = seal_args(provider, reservations, checksums, algorithm)
    for res in reservations:
        if not isinstance(res, Reservation) or res.provider is not provider:
            raise InvalidArgumentError("seal_many() takes reservations of this provider")
    for i, res in enumerate(reservations):
        try:
            if isinstance(res, _DeferredReservation):
                res._store()
            else:
                provider.seal(res)
        except BaseException:
            for rest in reservations[i:]:
                with contextlib.suppress(HostKVError):
                    rest.abort()
            raise
