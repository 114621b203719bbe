"""Reservation (space for one entry before its bytes exist) and Lease (a pin on entries)."""

from __future__ import annotations

import itertools
import threading
import warnings
from collections.abc import Sequence
from types import TracebackType
from typing import TYPE_CHECKING

from hostkv_providers._errors import ClosedError, IncompleteWriteError, InvalidArgumentError, ReservationError
from hostkv_providers._keys import Key
from hostkv_providers._region import HostRegion
from hostkv_providers._span import ByteSpan

if TYPE_CHECKING:
    from hostkv_providers._provider import Provider

__all__ = ["Lease", "Reservation"]


_NONE: tuple[tuple[int, int], ...] = ()
_WHOLE: tuple[tuple[int, int], ...] = ((-1, -1),)  # a marker: compared by identity only


class Reservation:
    """Space for one entry, obtained before its bytes exist.

    Lifecycle: ``reserve`` → ``write``\\* → ``seal`` | ``abort``, each of ``seal``/``abort`` at most
    once.  Used as a context manager it seals on a clean exit and aborts on an exception.

    The base class tracks which bytes were written so that ``seal`` can refuse to publish an entry
    with unwritten holes (:class:`IncompleteWriteError`).  A copy engine that DMAs straight into
    :meth:`regions` calls :meth:`mark_written` afterwards.
    """

    __slots__ = ("__weakref__", "_claim", "_covered", "_provider", "_state", "key", "nbytes", "parent", "salt_tag")

    def __init__(self, provider: Provider, key: Key, parent: Key | None, nbytes: int, salt_tag: str) -> None:
        self._provider = provider
        self.key = key
        self.parent = parent
        self.nbytes = nbytes
        self.salt_tag = salt_tag
        self._state = "open"
        # the front's claim: (thread id, "seal" | "abort") of the seal or abort under way
        self._claim: tuple[int, str] | None = None
        # sorted, merged [start, end) intervals; ``_WHOLE`` (shared) once everything is written
        # and ``_NONE`` (shared) before anything is: no list per reservation on the hot path
        self._covered: Sequence[Sequence[int]] = _NONE

    # -- state ---------------------------------------------------------------------------
    @property
    def state(self) -> str:
        """``"open"``, ``"sealed"`` or ``"aborted"``."""
        return self._state

    @property
    def provider(self) -> Provider:
        return self._provider

    def check_open(self, provider: Provider) -> None:
        """Raise unless this reservation belongs to ``provider`` and is still open."""
        if self._provider is not provider:
            raise ReservationError("the reservation belongs to another provider")
        if self._state != "open":
            if self._state == "aborted" and (provider.closed or getattr(provider, "_closing", False)):
                # close() aborts the reservations left open between a caller's calls (a put's
                # reserve done, its write or seal not begun): to that caller it is a close
                # racing its put, which the contract answers with ClosedError
                raise ClosedError(f"{type(provider).__name__} was closed while the reservation for "
                                  f"{self.key.hex()[:16]} was open; close() aborted it")
            raise ReservationError(f"the reservation for {self.key.hex()[:16]} is already {self._state}")
        claim = self._claim
        if claim is not None and claim[0] != threading.get_ident():
            # another thread's seal/abort is under way: a write or a seal now would race it
            raise ReservationError(f"the reservation for {self.key.hex()[:16]} is being {claim[1]}ed "
                                   "by another thread")

    def check_write(self, offset: int, nbytes: int) -> ByteSpan:
        """Validate a write of ``nbytes`` at ``offset`` against the reservation's size."""
        if type(offset) is not int:
            raise InvalidArgumentError(f"offset must be an int, got {type(offset).__name__}")
        return ByteSpan(offset, nbytes).validate(self.nbytes)

    def mark_written(self, span: ByteSpan | None = None) -> None:
        """Record that ``span`` (default: everything) now holds the caller's bytes."""
        if span is None or (span.offset == 0 and span.nbytes == self.nbytes):
            # the common whole-entry write: no interval merge (a per-page cost on every put)
            if self.nbytes:
                self._covered = _WHOLE
            return
        span = span.validate(self.nbytes)
        if span.nbytes == 0:
            return
        start, end = span.offset, span.end
        merged: list[Sequence[int]] = []
        placed = False
        covered = [(0, self.nbytes)] if self._covered is _WHOLE else self._covered
        for iv in covered:
            if iv[1] < start:
                merged.append(iv)
            elif end < iv[0]:
                if not placed:
                    merged.append([start, end])
                    placed = True
                merged.append(iv)
            else:
                start, end = min(start, iv[0]), max(end, iv[1])
        if not placed:
            merged.append([start, end])
        self._covered = merged

    @property
    def complete(self) -> bool:
        """Whether every byte has been written."""
        if self.nbytes == 0:
            return True
        c = self._covered
        return c is _WHOLE or (len(c) == 1 and c[0][0] == 0 and c[0][1] == self.nbytes)

    def check_complete(self) -> None:
        if not self.complete:
            written = sum(e - s for s, e in self._covered)  # never _WHOLE here
            raise IncompleteWriteError(
                f"entry {self.key.hex()[:16]} has {written} of {self.nbytes} bytes written"
            )

    def _finish(self, state: str) -> None:
        self._state = state

    # -- convenience ---------------------------------------------------------------------
    def write(self, offset: int, data: object) -> None:
        """Same as ``provider.write(self, offset, data)``."""
        self._provider.write(self, offset, data)

    def seal(self) -> None:
        """Same as ``provider.seal(self)``."""
        self._provider.seal(self)

    def abort(self) -> None:
        """Same as ``provider.abort(self)``."""
        self._provider.abort(self)

    def regions(self) -> Sequence[HostRegion]:
        """Writable host memory of the entry, for providers with the ``pinned_views`` power.

        After filling them, call :meth:`mark_written`.  The default raises: the provider has no
        directly writable buffers, use :meth:`write`.
        """
        raise ReservationError(
            f"provider {self._provider.name!r} exposes no writable regions",
            hint="use Reservation.write(offset, data)",
        )

    def __enter__(self) -> Reservation:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._state != "open":
            return
        if exc_type is None:
            self.seal()
        else:
            try:
                self.abort()
            except ClosedError:
                pass  # the provider was closed meanwhile: its close let every open reservation go
            except Exception as cleanup:  # cleanup must not mask the original error
                warnings.warn(f"abort during exception cleanup failed: {cleanup!r}", stacklevel=2)

    def __repr__(self) -> str:
        return f"<Reservation {self.key.hex()[:16]} {self.nbytes}B {self._state}>"


class Lease:
    """A pin on entries: while held, none of ``keys`` can be evicted.

    ``present[i]`` tells whether the i-th requested key was stored (and is now pinned);
    ``prefix_len`` is how many leading requested keys are pinned, i.e. the usable prefix of a
    chain.  Release with :meth:`release` or by leaving the ``with`` block; releasing twice is a
    no-op.  A lease that is garbage-collected unreleased is released with a ``ResourceWarning``.
    """

    __slots__ = ("__weakref__", "_provider", "_released", "keys", "prefix_len", "present", "token")

    def __init__(
        self, provider: Provider, requested: Sequence[Key], present: Sequence[bool], token: object = None
    ) -> None:
        self._provider = provider
        self.present: tuple[bool, ...] = tuple(present)
        # (C speed: a restore leases a chain of thousands of pages on the engine's thread)
        self.keys: tuple[Key, ...] = tuple(itertools.compress(requested, self.present))
        self.prefix_len = self.present.index(False) if False in self.present else len(self.present)
        self.token = token  # provider-private lease handle
        self._released = False

    @property
    def released(self) -> bool:
        return self._released

    @property
    def provider(self) -> Provider:
        """The provider that granted this lease."""
        return self._provider

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        self._provider._release_lease(self)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:
        if not getattr(self, "_released", True):
            try:
                warnings.warn("Lease garbage-collected without release()", ResourceWarning, stacklevel=1)
                self.release()
            except Exception:
                pass

    def __len__(self) -> int:
        return len(self.keys)
