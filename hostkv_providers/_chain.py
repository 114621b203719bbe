"""Chain reservation: :meth:`Provider.reserve_many` / :meth:`Provider.seal_many`, what they
return (:class:`ReservedChain`) and the base class's default for a provider without its own
(deferred reservations: the bytes wait in host buffers and are stored at seal)."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hostkv_providers._checks import readable_bytes
from hostkv_providers._errors import HostKVError, InFlightError, InvalidArgumentError, UnknownKeyError
from hostkv_providers._keys import Key
from hostkv_providers._region import HostPages, HostRegion
from hostkv_providers._reservation import Reservation

if TYPE_CHECKING:
    from hostkv_providers._provider import Provider

__all__ = ["ReservedChain", "reserve_chain", "seal_chain"]


def _check_checksums(checksums: Sequence[int] | None, algorithm: str | None, n: int) -> None:
    """Validate ``seal_many``'s ``checksums=``/``algorithm=`` pair (one checksum per reservation)."""
    if checksums is None:
        return
    if not isinstance(algorithm, str):
        raise InvalidArgumentError("give algorithm= with checksums= (the algorithm they are in)")
    if len(checksums) != n:
        raise InvalidArgumentError(f"{len(checksums)} checksums for {n} reservations; give one per reservation")


@dataclass(slots=True)
class ReservedChain:
    """What :meth:`Provider.reserve_many` reserved: a *prefix* of the keys asked for.

    ``reservations[i]`` is the reservation of ``keys[i]``, or ``None`` where that key is already
    sealed (dedup: nothing to write, and later keys may name it as their parent).  When fewer
    than all keys were reserved, ``error`` is the typed error of the first key that was not
    (``CapacityError``, ``InFlightError``, ``UnknownKeyError``); nothing after it was reserved.
    """

    reservations: list[Reservation | None]
    error: HostKVError | None = None
    #: The reserved (not ``None``) reservations' memory as one chunk-level :class:`HostPages`,
    #: when the provider has it (each page one contiguous piece of host memory): a copy engine
    #: fills the chunk from it without a Python object per page.  ``None`` otherwise: use
    #: ``regions()`` of each reservation.
    pages: HostPages | None = None

    def __len__(self) -> int:
        return len(self.reservations)


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


def reserve_chain(provider: Provider, keys: Sequence[bytes], parents: Sequence[bytes | None], nbytes: int,
                  salt_tag: str) -> ReservedChain:
    """The default :meth:`Provider.reserve_many`: deferred reservations (see its docstring)."""
    ks = provider._keys(keys)
    if isinstance(parents, (bytes, bytearray, memoryview, str)) or len(parents) != len(ks):
        raise InvalidArgumentError(f"{len(parents)} parents for {len(ks)} keys; give one per key")
    provider._check_usable()
    out: list[Reservation | None] = []
    batch: set[Key] = set()
    present = provider.present(ks) if ks else []
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
        res = _DeferredReservation(provider, k, p, n, salt_tag)
        _DEFERRED[(id(provider), k)] = res
        out.append(res)
        batch.add(k)
    return ReservedChain(out)


def seal_chain(provider: Provider, reservations: Sequence[Reservation], checksums: Sequence[int] | None,
               algorithm: str | None) -> None:
    """The default :meth:`Provider.seal_many`: seal (or store, for a deferred reservation) root
    first; on failure abort the rest and raise (see its docstring)."""
    for res in reservations:
        if not isinstance(res, Reservation) or res.provider is not provider:
            raise InvalidArgumentError("seal_many() takes reservations of this provider")
    _check_checksums(checksums, algorithm, len(reservations))
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
