"""Process identity (owners of reservations and leases, alive or dead), the in-process gate that
lets ``set_mapsize`` run with no transaction open, and the LMDB error translation."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import lmdb

from hostkv_providers._errors import (
    CorruptStoreError,
    HostKVError,
    NoSpaceError,
    StorageIOError,
)
from hostkv_providers.providers._slotfile import (
    SlotFile,
)

from ._format import _OWNER

if TYPE_CHECKING:
    from ._txn import _Tx


# --------------------------------------------------------------------------------------------
# Process identity (owners of reservations and leases)
# --------------------------------------------------------------------------------------------


def _start_time(pid: int) -> int:
    """The process start time (clock ticks since boot) from ``/proc``; 0 where unknown.

    Together with the pid it names a process uniquely, so a recycled pid never keeps a dead
    process's reservations alive.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read(4096)
    except OSError:
        return 0
    try:
        return int(data[data.rindex(b")") + 2 :].split()[19])
    except (ValueError, IndexError):
        return 0


def _alive(owner: bytes) -> bool:
    pid, start, _ = _OWNER.unpack(owner)
    if pid == os.getpid():
        return True  # this process: its providers release their own on close
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, another user's process (cannot be ours, but do not reclaim on a guess)
    if start == 0:
        return True
    now = _start_time(pid)
    return now == 0 or now == start


# --------------------------------------------------------------------------------------------
# A reader-preferring shared/exclusive gate (set_mapsize needs no transaction in this process)
# --------------------------------------------------------------------------------------------


class _Gate:
    """Transactions hold it shared; growing or adopting the LMDB map size holds it exclusively.

    Reader-preferring on purpose: a thread that already holds it shared may take it again
    without deadlocking behind a waiting exclusive request (resizes are rare, transactions short).
    """

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._shared = 0
        self._exclusive = False

    def acquire_shared(self) -> None:
        with self._cond:
            while self._exclusive:
                self._cond.wait()
            self._shared += 1

    def release_shared(self) -> None:
        with self._cond:
            self._shared -= 1
            if self._shared == 0:
                self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            while self._exclusive or self._shared:
                self._cond.wait()
            self._exclusive = True
        try:
            yield
        finally:
            with self._cond:
                self._exclusive = False
                self._cond.notify_all()


def _lmdb_error(exc: BaseException, what: str) -> HostKVError:
    """The typed error for an LMDB failure."""
    if isinstance(exc, HostKVError):
        return exc
    text = str(exc)
    if isinstance(exc, lmdb.MapFullError):
        return NoSpaceError(f"the LMDB map is full while {what}", hint="raise the map_max option")
    if "No space left" in text or "ENOSPC" in text or "Disk quota" in text:
        return NoSpaceError(f"no space left while {what}: {text}")
    if isinstance(exc, (lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.InvalidError, lmdb.VersionMismatchError,
                        lmdb.BadRslotError, lmdb.PanicError)):
        return CorruptStoreError(f"the LMDB index is damaged ({what}): {text}")
    if isinstance(exc, lmdb.ReadersFullError):
        return StorageIOError(f"LMDB reader table full while {what}", hint="fewer threads or processes at once")
    return StorageIOError(f"LMDB failed while {what}: {text}")


class _Raise:
    """An op result meaning: commit what the op did, then raise ``exc`` to its caller."""

    __slots__ = ("exc",)

    def __init__(self, exc: HostKVError) -> None:
        self.exc = exc


class _Ticket:
    __slots__ = ("done", "durable", "error", "fn", "frees", "result", "sync_files")

    def __init__(self, fn: Callable[[_Tx], Any], durable: bool, sync_files: Sequence[SlotFile], frees: bool) -> None:
        self.fn = fn
        self.frees = frees
        self.durable = durable
        self.sync_files = sync_files
        self.result: Any = None
        self.error: BaseException | None = None
        self.done = False
