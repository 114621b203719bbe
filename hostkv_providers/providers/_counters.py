"""Store-wide live counters: a small file of per-process rows in a store directory.

``hostkv stats`` runs in another process than the engine, so counters kept in the engine's
memory are invisible to it.  File providers (``mmap``, ``lmdb``) therefore also add every count
to ``<store>/counters``, a 264 KiB file mapped by every process that opens the store::

    0      magic b"HKVCTR01", u32 version, u32 columns, u32 rows
    64     name table: ``columns`` x 32 bytes (name, NUL-padded; last byte b"c" counter / b"g" gauge)
    8192   ``rows`` x ``columns`` little-endian u64 values

Each open instance owns one row, claimed with an open-file-description lock (``F_OFD_SETLK``)
on a byte that lies past the end of the file, held while the instance is open.  Only the owner
writes its row, so an add is a plain read-modify-write of one aligned 8-byte word in shared
memory (under the instance's own lock; an aligned 8-byte store is never torn on the platforms
Linux runs on): no atomics, no system call, no lock shared between processes on the hot path.
A reader sums the column over all rows.  A row keeps its values when its owner closes or dies,
and the next instance that claims it adds on top, so the sums are cumulative since the file was
created and survive restarts.  Gauges (a write-back queue depth) are *set* by their owner and
summed only over rows whose lock is held (live processes): a killed process's stale gauge does
not count.

Names are registered in the header under a lock on the header's own byte, by whichever process
needs one first; a reader resolves names at every read, so layers above a store (``tiered``'s
``fast.*``/``tiered.*`` columns) and newer versions add columns without a format change.

The counters are figures for operators, not data: a damaged or foreign counters file is replaced
by a fresh one (a warning says so), never a reason to refuse the store; on a
platform without OFD locks, or with all rows taken, an instance counts in-process only.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import struct
import threading
import warnings
from collections.abc import Iterable, Mapping

from hostkv_providers._errors import HostKVError
from hostkv_providers.providers import _fsutil

__all__ = ["COUNTERS_FILE", "STORE_COUNTED", "StoreCounters", "read_counters"]

#: The file's name inside a store directory.
COUNTERS_FILE = "counters"
_MAGIC = b"HKVCTR01"
_VERSION = 1
_COLUMNS = 128
_ROWS = 256
_NAME_NBYTES = 32
_NAMES_AT = 64
_ROWS_AT = 8192
_FILE_NBYTES = _ROWS_AT + _ROWS * _COLUMNS * 8
_HEADER = struct.Struct("<8sIII")
# Lock bytes far past the end of the file (POSIX allows locking ranges that hold no data): one
# per row, one for the name table.
_LOCK_BASE = 1 << 40
_NAMES_LOCK = _LOCK_BASE - 1
# struct flock on Linux (x86-64, aarch64): l_type, l_whence, pad, l_start, l_len, l_pid, pad.
_FLOCK = struct.Struct("=hh4xqqi4x")
_OFD_SETLK: int | None = getattr(fcntl, "F_OFD_SETLK", None)
_OFD_SETLKW: int | None = getattr(fcntl, "F_OFD_SETLKW", None)
_OFD_GETLK: int | None = getattr(fcntl, "F_OFD_GETLK", None)
_GAUGE, _COUNTER = b"g", b"c"

#: The counters a file provider keeps store-wide (``store_counters()`` always has these keys).
STORE_COUNTED = ("hits", "misses", "bytes_read", "seals", "bytes_written", "aborts", "dedup", "evictions",
                 "evicted_bytes", "checksum_failures")

# One process-wide lock around name registration (the file lock orders processes; this orders
# the threads of one process, whose OFD locks on different descriptors would also exclude each
# other, but a descriptor's own lock is re-entrant).
_REGISTER = threading.Lock()


def _lock(fd: int, cmd: int, kind: int, start: int) -> bool:
    """An OFD lock command on one byte; ``False`` when a non-blocking one is refused."""
    try:
        fcntl.fcntl(fd, cmd, _FLOCK.pack(kind, os.SEEK_SET, start, 1, 0))
    except OSError as exc:
        if exc.errno in (11, 13):  # EAGAIN, EACCES: held by another open file description
            return False
        raise
    return True


def _held_by_other(fd: int, start: int) -> bool:
    """Whether another open file description holds a lock on byte ``start``."""
    assert _OFD_GETLK is not None
    got = fcntl.fcntl(fd, _OFD_GETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, start, 1, 0))
    return bool(_FLOCK.unpack(got[: _FLOCK.size])[0] != fcntl.F_UNLCK)


def _parse_names(buf: bytes | mmap.mmap) -> list[tuple[str, bool]]:
    """``[(name, is_gauge), ...]`` of the registered columns, in column order."""
    out: list[tuple[str, bool]] = []
    for i in range(_COLUMNS):
        raw = bytes(buf[_NAMES_AT + i * _NAME_NBYTES : _NAMES_AT + (i + 1) * _NAME_NBYTES])
        name = raw[:-1].rstrip(b"\0")
        if not name:
            break
        try:
            out.append((name.decode("ascii"), raw[-1:] == _GAUGE))
        except UnicodeDecodeError:
            break  # damaged: the columns before it still read
    return out


def _header_ok(buf: bytes | mmap.mmap) -> bool:
    magic, version, columns, rows = _HEADER.unpack_from(buf, 0)
    return bool(magic == _MAGIC and version == _VERSION and columns == _COLUMNS and rows == _ROWS)


def _create(path: str, *, replace: bool = False) -> None:
    """Write a fresh, empty counters file at ``path`` atomically: a racing creator's file wins,
    unless ``replace`` (the file there is damaged)."""
    head = bytearray(_ROWS_AT)
    _HEADER.pack_into(head, 0, _MAGIC, _VERSION, _COLUMNS, _ROWS)
    tmp = _fsutil.write_temp(path, [bytes(head), bytes(_FILE_NBYTES - _ROWS_AT)], durable=False)
    try:
        if replace:
            os.replace(tmp, path)
        else:
            os.link(tmp, path)  # never replaces a file another process created meanwhile
    except FileExistsError:
        pass
    except OSError as exc:
        raise _fsutil.io_error(exc, f"creating {path}") from exc
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def _sums(mm: mmap.mmap, fd: int | None, names: list[tuple[str, bool]], own_row: int | None) -> dict[str, int]:
    """Every registered column summed over the rows (gauges: over the rows of live owners)."""
    rows = memoryview(mm)[_ROWS_AT:_FILE_NBYTES].cast("Q")
    try:
        live: dict[int, bool] = {}

        def alive(r: int) -> bool:
            if r not in live:
                live[r] = r == own_row or (fd is not None and _OFD_GETLK is not None
                                           and _held_by_other(fd, _LOCK_BASE + r))
            return live[r]

        out: dict[str, int] = {}
        for col, (name, gauge) in enumerate(names):
            values = rows[col::_COLUMNS]
            if gauge:
                out[name] = sum(v for r, v in enumerate(values) if v and alive(r))
            else:
                out[name] = sum(values)
        return out
    finally:
        rows.release()


def read_counters(directory: str) -> dict[str, int] | None:
    """The store-wide sums of the counters file in ``directory`` (read-only: nothing is created
    or claimed); ``None`` when there is none or it is not a counters file."""
    path = os.path.join(directory, COUNTERS_FILE)
    try:
        fd = _fsutil.open_private(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        if os.fstat(fd).st_size != _FILE_NBYTES:
            return None
        with mmap.mmap(fd, _FILE_NBYTES, prot=mmap.PROT_READ) as mm:
            if not _header_ok(mm):
                return None
            return _sums(mm, fd, _parse_names(mm), None)
    finally:
        os.close(fd)


class StoreCounters:
    """One instance's row of a store's counters file (see the module docstring).

    ``add``/``add_many`` are called with the owning provider's counter lock held (the row is
    this instance's alone, so that lock is all the exclusion it needs).
    """

    __slots__ = ("_cols", "_fd", "_gauges", "_hit", "_mm", "_read", "_row", "path", "row")

    def __init__(self, path: str, fd: int, mm: mmap.mmap, row: int) -> None:
        self.path = path
        self._fd = fd
        self._mm = mm
        self.row = row
        self._row = memoryview(mm)[_ROWS_AT + row * _COLUMNS * 8 : _ROWS_AT + (row + 1) * _COLUMNS * 8].cast("Q")
        self._cols: dict[str, int] = {}
        self._gauges: set[str] = set()
        self._hit = self._read = -1  # the columns of hits and bytes_read (add_hit, once per page)

    @classmethod
    def open(cls, directory: str) -> StoreCounters | None:
        """Map ``directory``'s counters file (created when missing) and claim a free row.

        ``None`` (counting stays in-process, with a warning) without OFD locks, with every row
        taken, or when the file cannot be created or mapped (ENOSPC, EIO, an unsafe file): the
        counters are figures for operators and never make a store fail to open."""
        if _OFD_SETLK is None:
            return None
        try:
            return cls._open(os.path.join(directory, COUNTERS_FILE))
        except (HostKVError, OSError) as exc:
            warnings.warn(f"store-wide counters unavailable ({exc}); this instance counts in-process only",
                          stacklevel=3)
            return None

    @classmethod
    def _open(cls, path: str) -> StoreCounters | None:
        assert _OFD_SETLK is not None
        for attempt in range(2):
            try:
                fd = _fsutil.open_private(path, os.O_RDWR)
            except FileNotFoundError:
                _create(path)
                continue
            try:
                if os.fstat(fd).st_size != _FILE_NBYTES:
                    raise ValueError("wrong size")
                mm = mmap.mmap(fd, _FILE_NBYTES)
                if not _header_ok(mm):
                    mm.close()
                    raise ValueError("bad header")
            except OSError:
                os.close(fd)
                raise
            except ValueError as exc:  # not a counters file (an I/O error is raised, never "repaired")
                os.close(fd)
                if attempt:
                    raise OSError(f"{path}: {exc} after replacing it") from None
                warnings.warn(f"{path} is not a counters file ({exc}); replaced by a fresh one (counting anew)",
                              stacklevel=3)
                _create(path, replace=True)
                continue
            try:
                for row in range(_ROWS):
                    if _lock(fd, _OFD_SETLK, fcntl.F_WRLCK, _LOCK_BASE + row):
                        claimed = cls(path, fd, mm, row)
                        # a dead owner's gauges are stale (its counters are history: they stay)
                        for col, (_name, gauge) in enumerate(_parse_names(mm)):
                            if gauge:
                                claimed._row[col] = 0
                        return claimed
            except BaseException:
                mm.close()
                os.close(fd)
                raise
            mm.close()
            os.close(fd)
            warnings.warn(f"{path}: all {_ROWS} rows are in use; this instance counts in-process only",
                          stacklevel=3)
            return None
        return None

    def columns(self, names: Iterable[str], *, gauge: bool = False) -> None:
        """Make sure every name has a column (registering new ones in the file)."""
        missing = [n for n in names if n not in self._cols]
        if not missing:
            return
        kind = _GAUGE if gauge else _COUNTER
        with _REGISTER:
            assert _OFD_SETLKW is not None and _OFD_SETLK is not None  # open() returned an instance
            _lock(self._fd, _OFD_SETLKW, fcntl.F_WRLCK, _NAMES_LOCK)
            try:
                known = _parse_names(self._mm)
                index = {n: i for i, (n, _) in enumerate(known)}
                for name in missing:
                    raw = name.encode("ascii")
                    if not 0 < len(raw) < _NAME_NBYTES:
                        raise ValueError(f"counter name {name!r} must be 1..{_NAME_NBYTES - 1} ASCII bytes")
                    if name not in index:
                        if len(index) >= _COLUMNS:
                            continue  # full: the name counts in-process only
                        at = _NAMES_AT + len(index) * _NAME_NBYTES
                        self._mm[at : at + _NAME_NBYTES] = raw.ljust(_NAME_NBYTES - 1, b"\0") + kind
                        index[name] = len(index)
                    self._cols[name] = index[name]
                    if gauge:
                        self._gauges.add(name)
            finally:
                _lock(self._fd, _OFD_SETLK, fcntl.F_UNLCK, _NAMES_LOCK)
        self._hit = self._cols.get("hits", -1)
        self._read = self._cols.get("bytes_read", -1)

    def add(self, name: str, n: int) -> None:
        """Add ``n`` to this row's ``name`` (a registered counter; others are ignored)."""
        col = self._cols.get(name)
        if col is not None and n:
            self._row[col] += n

    def add_hit(self, nbytes: int) -> None:
        """One read hit of ``nbytes`` (``hits`` += 1, ``bytes_read`` += nbytes)."""
        if self._hit >= 0:
            self._row[self._hit] += 1
        if self._read >= 0:
            self._row[self._read] += nbytes

    def add_many(self, counts: Mapping[str, int]) -> None:
        """Add each count (one call per batch of pages, not one per page)."""
        vals, cols = self._row, self._cols
        for name, n in counts.items():
            col = cols.get(name)
            if col is not None and n:
                vals[col] += n

    def set_gauge(self, name: str, value: int) -> None:
        """Set this row's gauge ``name`` (registered with ``gauge=True``)."""
        col = self._cols.get(name)
        if col is not None and name in self._gauges:
            self._row[col] = max(0, int(value))

    def totals(self) -> dict[str, int]:
        """Every column summed over the store's rows (gauges over live owners' rows)."""
        return _sums(self._mm, self._fd, _parse_names(self._mm), self.row)

    def close(self) -> None:
        """Zero this row's gauges, unmap, and release the row (its counters stay in the file)."""
        if self._fd < 0:
            return
        for name in self._gauges:
            self._row[self._cols[name]] = 0
        self._cols = {}  # a racing add after close is a no-op, never a write to a freed map
        self._hit = self._read = -1
        self._row.release()
        with contextlib.suppress(BufferError, OSError):
            self._mm.close()
        with contextlib.suppress(OSError):
            os.close(self._fd)  # closing the description drops its row lock
        self._fd = -1
