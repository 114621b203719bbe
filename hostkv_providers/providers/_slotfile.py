"""Slot files: preallocated, mmapped data files of fixed-size slots (shared by mmap and lmdb).

A slot file holds ``slot_count`` slots of ``slot_nbytes`` bytes each.  An *entry* (a page or an
anchor blob) occupies a *run* of ``ceil(nbytes / slot_nbytes)`` consecutive slots; the run's
first slot carries the entry's header in the header table.  The index (a journal, an LMDB
database) records ``(file_id, slot, generation, key, nbytes, checksum)`` per entry; a read is
accepted only when the slot header echoes the same key, generation, size and checksum, so a slot
reused for another entry can never satisfy a stale index record (R1).

On-disk layout (all integers little-endian)::

    [0, 4096)                 file header (128 bytes used, see FILE_HEADER_DTYPE), xxh3-checked
    [4096, data_offset)       header table: slot_count x 128-byte slot headers (SLOT_HEADER_DTYPE)
    [data_offset, end)        slot i at data_offset + i * slot_nbytes   (data_offset 4 KiB aligned)

Slot header (128 bytes): ``magic u64 | key 32B | parent 32B | generation u64 | nbytes u64 |
checksum u64 (XXH3-64 of the entry's bytes) | flags u32 | aux u32 | user u64 | reserved u64 |
header_checksum u64 (XXH3-64 of bytes 0..120)``.  A zero or damaged header is "no entry".

Protocol (the order is what crash safety depends on):

1. :meth:`SlotFile.begin_write` zeroes the headers of every slot in the run, *before* any data
   byte changes, so neither a stale index record nor a concurrent reader can accept the run while
   it holds a mix of old and new bytes.
2. :meth:`SlotFile.write` copies data (or a caller fills :meth:`SlotFile.data`, e.g. by DMA).
3. :meth:`SlotFile.write_header` publishes the header (data first, then header).
4. :meth:`SlotFile.sync` makes data and header durable (``durability=sync``) — then, and only
   then, the caller's index may point at the run.

Reads (:meth:`SlotFile.read_into`) are a seqlock: check header, copy, verify, check header again;
a reader in another process racing a writer that reuses the slot sees ``STALE`` (a miss), never a
mix.  With ``verify=True`` the XXH3-64 of the bytes handed out is compared with the header's.

Hygiene (R6): files are created complete with ``posix_fallocate`` (ENOSPC → ``NoSpaceError``
before anything is mapped) and are never truncated or grown while mapped; a file shorter than
its header declares is refused instead of mapped (touching a mapping past EOF is SIGBUS).  Files
are 0600, opened with ``O_NOFOLLOW``, and created through a temp name + rename so a crash never
leaves a half-initialised slot file under its final name.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import enum
import mmap
import os
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import xxhash

from hostkv_providers._errors import (
    CorruptStoreError,
    IncompatibleStoreError,
    InvalidArgumentError,
    SpanError,
    StorageIOError,
)
from hostkv_providers._keys import KEY_NBYTES
from hostkv_providers.providers import _fsutil

__all__ = [
    "FILE_HEADER_DTYPE",
    "FILE_HEADER_NBYTES",
    "FLAG_ANCHOR",
    "FLAG_HAS_PARENT",
    "SLOT_HEADER_DTYPE",
    "SLOT_HEADER_NBYTES",
    "SLOT_MAGIC",
    "ReadResult",
    "SlotFile",
    "SlotHeader",
    "header_checksums_ok",
    "run_nslots",
]

FILE_MAGIC = b"HKVSLOTS"
FILE_LAYOUT_VERSION = 1
FILE_HEADER_NBYTES = 4096
SLOT_HEADER_NBYTES = 128
#: ``magic`` field of a live slot header (``b"HKVSLOT1"`` little-endian).
SLOT_MAGIC = int.from_bytes(b"HKVSLOT1", "little")
#: ``flags`` bits of a slot header.
FLAG_HAS_PARENT = 1
FLAG_ANCHOR = 2

_ALIGN = 4096
_MAX_SLOT_NBYTES = 1 << 34  # 16 GiB: a sanity bound for parsing hostile headers
_MAX_SLOTS = 1 << 40

FILE_HEADER_DTYPE = np.dtype(
    [
        ("magic", "S8"),
        ("layout_version", "<u4"),
        ("slot_header_nbytes", "<u4"),
        ("slot_nbytes", "<u8"),
        ("slot_count", "<u8"),
        ("file_id", "<u8"),
        ("data_offset", "<u8"),
        ("store_id", "V16"),
        ("created", "<u8"),
        ("reserved", "V48"),
        ("header_checksum", "<u8"),
    ]
)
assert FILE_HEADER_DTYPE.itemsize == 128

SLOT_HEADER_DTYPE = np.dtype(
    [
        ("magic", "<u8"),
        ("key", "V32"),
        ("parent", "V32"),
        ("generation", "<u8"),
        ("nbytes", "<u8"),
        ("checksum", "<u8"),
        ("flags", "<u4"),
        ("aux", "<u4"),
        ("user", "<u8"),
        ("reserved", "<u8"),
        ("header_checksum", "<u8"),
    ]
)
assert SLOT_HEADER_DTYPE.itemsize == SLOT_HEADER_NBYTES

_HSUM_AT = SLOT_HEADER_NBYTES - 8
#: Batched reads/writes: at most this many buffers (Linux IOV_MAX) and bytes per system call.
_IOV_MAX = 1024
_GROUP_NBYTES = 1 << 20  # larger groups save few calls, and the verify pass then reads from farther caches
#: Writes on the I/O pool: one hash task per this many bytes (at most ``_IO_THREADS``).
_HASH_SLICE_NBYTES = 4 << 20
_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)
#: The smallest per-call read-ahead clamp to expect (the kernel's default ``read_ahead_kb``).
_WILLNEED_PIECE = 128 * 1024


def _usable_cores() -> int:
    """The CPUs this process may run on (its affinity mask: a container's or ``taskset``'s
    limit, not the host's count), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no affinity API (macOS): the host's count
        return max(1, os.cpu_count() or 1)


#: Cores from which a batch of ``_PARALLEL_MIN_NBYTES_MANY`` is worth splitting.
_MANY_CORES = 8
_PARALLEL_MIN_NBYTES_FEW = 8 << 20
_PARALLEL_MIN_NBYTES_MANY = 2 << 20


def _parallel_min_nbytes(cores: int) -> int:
    """The batch size from which reads (and the hashes of writes) go to the I/O threads, for a
    process that may use ``cores`` CPUs.

    Measured (docs/benchmarks.md, 256 KiB pages, 4 MiB calls): on a 16-core host a 4 MiB batch
    read by 4 threads ran at 1.05-1.14x of a one-thread raw ``preadv`` + XXH3 loop against
    0.76-0.83x on one thread; on 2 cores (shared with other work) splitting a 4 MiB call cost
    more than it gained.  Between those two machines nothing was measured: 8 cores and more
    count as many."""
    return _PARALLEL_MIN_NBYTES_MANY if cores >= _MANY_CORES else _PARALLEL_MIN_NBYTES_FEW


# Batch reads and writes of at least this many bytes use a few I/O threads (preadv, pwritev and
# XXH3 all release the GIL): reads are split into sequential sub-ranges (several requests in
# flight keep a cold disk busy, the copies and hashes of a warm batch run on several cores
# instead of one); writes keep their pwritev calls on the caller's thread (the page cache's
# write path serialises on the file) while the pool hashes the same buffers meanwhile.
_CORES = _usable_cores()
_PARALLEL_MIN_NBYTES = _parallel_min_nbytes(_CORES)
_IO_THREADS = max(2, min(4, _CORES))
_io_pool: concurrent.futures.ThreadPoolExecutor | None = None
_io_pool_pid = 0
_io_pool_lock = threading.Lock()


def _pool() -> concurrent.futures.ThreadPoolExecutor:
    """The shared I/O pool of this process (a child of ``fork`` builds its own: the parent's
    threads do not exist there)."""
    global _io_pool, _io_pool_pid
    pid = os.getpid()
    with _io_pool_lock:
        if _io_pool is None or _io_pool_pid != pid:
            _io_pool = concurrent.futures.ThreadPoolExecutor(_IO_THREADS, thread_name_prefix="hostkv-io")
            _io_pool_pid = pid
        return _io_pool


_hint_exec: concurrent.futures.ThreadPoolExecutor | None = None
_hint_pid = 0


def _hint_pool() -> concurrent.futures.ThreadPoolExecutor:
    """One background thread for read-ahead hints (per process, as :func:`_pool`)."""
    global _hint_exec, _hint_pid
    pid = os.getpid()
    with _io_pool_lock:
        if _hint_exec is None or _hint_pid != pid:
            _hint_exec = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hostkv-hint")
            _hint_pid = pid
        return _hint_exec


def _use_pool(nbytes: int, parts: int) -> bool:
    """Whether a batch of ``nbytes`` in ``parts`` pieces goes to the I/O pool: large enough for
    this machine (``_PARALLEL_MIN_NBYTES``), more than one piece, and not already on a pool
    thread (which waiting on its own pool could deadlock)."""
    return (parts >= 2 and nbytes >= _PARALLEL_MIN_NBYTES
            and not threading.current_thread().name.startswith("hostkv-io"))


def _join(futures: Sequence[concurrent.futures.Future[None]], error: BaseException | None) -> None:
    """Wait for every future (none is left running on buffers the caller may reuse), then raise
    ``error`` or the first of theirs."""
    for f in futures:
        try:
            f.result()
        except BaseException as exc:
            error = error or exc
    if error is not None:
        raise error


def _zero_headers(v: memoryview, slots: Sequence[int], nslots: int | Sequence[int]) -> None:
    """Zero the slot headers of the runs starting at ``slots`` (in slot order; ``nslots`` slots
    each, or ``nslots[i]`` for the run at ``slots[i]``): runs that lie back to back (or overlap)
    in one copy."""
    lo = hi = -1
    for i, slot in enumerate(slots):
        a = FILE_HEADER_NBYTES + slot * SLOT_HEADER_NBYTES
        if a > hi:
            if hi > lo:
                v[lo:hi] = bytes(hi - lo)
            lo = a
        hi = max(hi, a + (nslots if isinstance(nslots, int) else nslots[i]) * SLOT_HEADER_NBYTES)
    if hi > lo:
        v[lo:hi] = bytes(hi - lo)


def _hash_while(n: int, total_nbytes: int, hash_slice: Callable[[int, int], None], work: Callable[[], None]) -> None:
    """Run ``work()`` (the writes) on this thread while the pool hashes items ``[0, n)``: one task
    per ``_HASH_SLICE_NBYTES``, in write order (the pwritev calls are the long pole: XXH3 runs
    several times faster than the kernel's copy into the page cache).  Every hash is waited for,
    then the first error raised."""
    parts = max(1, min(_IO_THREADS, total_nbytes // _HASH_SLICE_NBYTES, n))
    step = -(-n // parts)
    futures: list[concurrent.futures.Future[None]] = []
    error: BaseException | None = None
    try:
        for lo in range(0, n, step):
            try:
                futures.append(_pool().submit(hash_slice, lo, min(n, lo + step)))
            except RuntimeError:  # the interpreter is exiting (no new pool tasks): hash here
                hash_slice(lo, n)
                break
        work()
    except BaseException as exc:
        error = exc
    _join(futures, error)


def _spread(groups: Sequence[Any], nbytes: int, work: Any) -> None:
    """Run ``work(slice_of_groups)`` for contiguous slices of ``groups``: on the I/O pool when
    the batch is large (each thread then reads or writes one sequential sub-range, which keeps
    the kernel's read-ahead sequential), else inline.  The first error is raised after every
    slice finished (none is left running on buffers the caller may reuse)."""
    n = min(_IO_THREADS, len(groups))
    if not _use_pool(nbytes, n):
        work(groups)
        return
    step = -(-len(groups) // n)
    futures = [_pool().submit(work, groups[i : i + step]) for i in range(step, len(groups), step)]
    error: BaseException | None = None
    try:
        work(groups[:step])
    except BaseException as exc:
        error = exc
    _join(futures, error)
_ZERO_HEADER = bytes(SLOT_HEADER_NBYTES)
_ZERO_KEY = bytes(KEY_NBYTES)


def prefetch_runs(entries: Sequence[tuple[SlotFile, int, int]]) -> None:
    """:meth:`SlotFile.will_need` for entries ``(file, slot, nbytes)``, one call per run of
    them that lies back to back in a file (the ``prefetch`` of the providers on slot files).

    Large prefetches are issued by a background thread: ``POSIX_FADV_WILLNEED`` goes out in
    128 KiB pieces (see :meth:`SlotFile.will_need`), ~0.1 ms of calls per MiB, which a restore
    that prefetches its next chunk would otherwise pay on its own thread before every read."""
    runs: list[tuple[SlotFile, int, int]] = []  # file, first byte, end
    for sf, slot, nbytes in sorted(entries, key=lambda e: (e[0].file_id, e[1])):
        lo = sf.data_offset + slot * sf.slot_nbytes
        if runs and runs[-1][0] is sf and lo <= runs[-1][2]:
            runs[-1] = (sf, runs[-1][1], max(runs[-1][2], lo + nbytes))
            continue
        runs.append((sf, lo, lo + nbytes))

    def hint() -> None:
        for sf, lo, hi in runs:
            sf.will_need(lo, hi - lo)

    if sum(hi - lo for _, lo, hi in runs) < _PARALLEL_MIN_NBYTES:
        hint()
    else:
        _hint_pool().submit(hint)  # a hint: errors are ignored by will_need, a closed file too


class ReadResult(enum.IntEnum):
    """Outcome of :meth:`SlotFile.read_into` / :meth:`SlotFile.check`."""

    OK = 0
    #: The header does not describe this record (slot reused, never written, torn): a miss.
    STALE = 1
    #: The header matches but the bytes do not hash to its checksum: corruption.
    CORRUPT = 2


#: ``ReadResult`` by code (a tuple index: no enum lookup per entry).
_RESULT_OF = (ReadResult.OK, ReadResult.STALE, ReadResult.CORRUPT)


@dataclass(frozen=True, slots=True)
class SlotHeader:
    """A decoded, checksum-verified slot header."""

    key: bytes
    parent: bytes | None
    generation: int
    nbytes: int
    checksum: int
    flags: int
    aux: int
    user: int


def run_nslots(nbytes: int, slot_nbytes: int) -> int:
    """Slots needed by an entry of ``nbytes`` bytes (at least 1)."""
    return max(1, -(-nbytes // slot_nbytes))


def _round_up(n: int, align: int) -> int:
    return -(-n // align) * align


_HEADER_STRUCT = struct.Struct("<Q32s32sQQQIIQQ")  # SLOT_HEADER_DTYPE without header_checksum
_MAGIC_BYTES = SLOT_MAGIC.to_bytes(8, "little")
_IDENT_TAIL = struct.Struct("<QQQ")  # generation, nbytes, checksum at bytes [72, 96)
def _encode_header(key: bytes, parent: bytes | None, generation: int, nbytes: int, checksum: int,
                   flags: int, aux: int, user: int) -> bytes:
    if parent is not None:
        flags |= FLAG_HAS_PARENT
    else:
        flags &= ~FLAG_HAS_PARENT
    body = _HEADER_STRUCT.pack(SLOT_MAGIC, key, parent or bytes(32), generation, nbytes, checksum, flags, aux,
                               user, 0)
    return body + xxhash.xxh3_64_intdigest(body).to_bytes(8, "little")


def _decode_header(raw: bytes | memoryview) -> SlotHeader | None:
    b = bytes(raw)
    if len(b) != SLOT_HEADER_NBYTES or int.from_bytes(b[:8], "little") != SLOT_MAGIC:
        return None
    if xxhash.xxh3_64_intdigest(b[:_HSUM_AT]) != int.from_bytes(b[_HSUM_AT:], "little"):
        return None
    flags = int.from_bytes(b[104:108], "little")
    return SlotHeader(
        key=b[8:40],
        parent=b[40:72] if flags & FLAG_HAS_PARENT else None,
        generation=int.from_bytes(b[72:80], "little"),
        nbytes=int.from_bytes(b[80:88], "little"),
        checksum=int.from_bytes(b[88:96], "little"),
        flags=flags,
        aux=int.from_bytes(b[108:112], "little"),
        user=int.from_bytes(b[112:120], "little"),
    )


def header_checksums_ok(headers: npt.NDArray[Any]) -> npt.NDArray[np.bool_]:
    """Vectorised validity of a header-table slice: magic right and header checksum matching.

    Used by bulk scans (open-time validation, verify); one XXH3 call per *live* header only.
    """
    ok: npt.NDArray[np.bool_] = np.asarray(headers["magic"] == SLOT_MAGIC, dtype=np.bool_)
    raw = headers.view(np.uint8).reshape(len(headers), SLOT_HEADER_NBYTES)
    for i in np.flatnonzero(ok):
        row = raw[i]
        if xxhash.xxh3_64_intdigest(row[:_HSUM_AT].tobytes()) != int(headers["header_checksum"][i]):
            ok[i] = False
    return ok


class SlotFile:
    """One slot file, mapped read-write (the writer) or read-only (readers).

    Build with :meth:`create` or :meth:`open`.  Thread-safe for disjoint runs: the object keeps
    no per-run state, callers own the slot allocation (which runs are free) and make sure one run
    is written by one thread at a time.  All slot numbers and byte ranges are bounds-checked and
    raise ``InvalidArgumentError``/``SpanError``.

    Attributes
    ----------
    path, file_id, slot_nbytes, slot_count, store_id, writable, data_offset
    """

    def __init__(self, path: str, fd: int, header: npt.NDArray[Any], writable: bool) -> None:
        self.path = path
        self.writable = writable
        self.file_id = int(header["file_id"][0])
        self.slot_nbytes = int(header["slot_nbytes"][0])
        self.slot_count = int(header["slot_count"][0])
        self.data_offset = int(header["data_offset"][0])
        self.store_id = bytes(header["store_id"][0].tobytes())
        self._fd: int | None = fd
        #: ``"syscall"``: :meth:`write`/:meth:`read_into` move data with ``pwrite``/``preadv``;
        #: ``"mmap"``: through the mapping.  Headers always go through the mapping.
        self.io = "syscall"
        self._lock = threading.Lock()
        size = self.data_offset + self.slot_count * self.slot_nbytes
        try:
            self._map: mmap.mmap | None = mmap.mmap(
                fd, size, flags=mmap.MAP_SHARED,
                prot=mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0),
            )
        except OSError as exc:
            os.close(fd)
            raise _fsutil.io_error(exc, f"mapping {path}") from exc
        self._view: memoryview | None = memoryview(self._map)
        htab = self._view[FILE_HEADER_NBYTES : FILE_HEADER_NBYTES + self.slot_count * SLOT_HEADER_NBYTES]
        self._headers: npt.NDArray[Any] | None = np.frombuffer(htab, SLOT_HEADER_DTYPE)

    # -- construction --------------------------------------------------------------------------
    @staticmethod
    def layout(slot_nbytes: int, slot_count: int) -> tuple[int, int]:
        """``(data_offset, file_nbytes)`` of a file with this geometry."""
        data_offset = _round_up(FILE_HEADER_NBYTES + slot_count * SLOT_HEADER_NBYTES, _ALIGN)
        return data_offset, data_offset + slot_count * slot_nbytes

    @classmethod
    def create(cls, path: str, *, slot_nbytes: int, slot_count: int, file_id: int, store_id: bytes,
               durable: bool = True) -> SlotFile:
        """Create a new slot file at ``path`` (which must not exist) and open it writable.

        The file is built under a temp name — ``posix_fallocate`` of its whole size, header,
        fsync — and renamed into place, so ``path`` either does not exist or is complete.
        ``NoSpaceError`` if the filesystem cannot hold it (nothing is left behind).
        """
        if type(slot_nbytes) is not int or slot_nbytes <= 0 or slot_nbytes % _ALIGN or slot_nbytes > _MAX_SLOT_NBYTES:
            raise InvalidArgumentError(f"slot size must be a positive multiple of 4096, got {slot_nbytes!r}")
        if type(slot_count) is not int or not 0 < slot_count <= _MAX_SLOTS:
            raise InvalidArgumentError(f"slot count must be a positive int, got {slot_count!r}")
        if len(store_id) != 16:
            raise InvalidArgumentError("store_id must be 16 bytes")
        if _fsutil.lexists(path, f"looking for {path}"):
            raise InvalidArgumentError(f"{path} already exists")
        data_offset, total = cls.layout(slot_nbytes, slot_count)
        hdr = np.zeros(1, FILE_HEADER_DTYPE)
        hdr["magic"] = FILE_MAGIC
        hdr["layout_version"] = FILE_LAYOUT_VERSION
        hdr["slot_header_nbytes"] = SLOT_HEADER_NBYTES
        hdr["slot_nbytes"] = slot_nbytes
        hdr["slot_count"] = slot_count
        hdr["file_id"] = file_id
        hdr["data_offset"] = data_offset
        hdr["store_id"] = np.frombuffer(store_id, "V16")
        hdr["created"] = int(time.time())
        raw = bytearray(hdr.tobytes())
        raw[120:128] = xxhash.xxh3_64_intdigest(bytes(raw[:120])).to_bytes(8, "little")
        tmp = _fsutil.temp_name(path)
        fd = _fsutil.open_private(tmp, os.O_RDWR, create=True, exclusive=True)
        # A failure after the rename (the directory sync, the mapping) must remove the file under
        # its final name: nothing refers to it yet, and left there it made every later create
        # of this file id fail with "already exists" until the store was reopened.
        name = tmp
        try:
            _fsutil.fallocate(fd, 0, total, f"preallocating {total} bytes for {path}")
            _fsutil.write_all(fd, bytes(raw), 0, f"writing the header of {path}")
            if durable:
                _fsutil.sync_fd(fd, f"syncing {tmp}")
            try:
                os.rename(tmp, path)
            except OSError as exc:
                raise _fsutil.io_error(exc, f"renaming {tmp}") from exc
            name = path
            if durable:
                _fsutil.fsync_dir(os.path.dirname(path) or ".")
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(name)
            raise
        try:
            return cls(path, fd, np.frombuffer(bytes(raw), FILE_HEADER_DTYPE), True)  # closes fd on failure
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise

    @classmethod
    def open(cls, path: str, *, writable: bool, store_id: bytes | None = None,
             slot_nbytes: int | None = None) -> SlotFile:
        """Open an existing slot file, validating its header with explicit bounds.

        Raises ``CorruptStoreError`` for a damaged/short file, ``IncompatibleStoreError`` for
        another layout version, store or slot size, ``UnsafeStoreError`` for a symlink or loose
        permissions.
        """
        fd = _fsutil.open_private(path, os.O_RDWR if writable else os.O_RDONLY)
        try:
            try:
                raw = os.pread(fd, 128, 0)
                size = os.fstat(fd).st_size
            except OSError as exc:
                raise _fsutil.io_error(exc, f"reading {path}") from exc
            if len(raw) < 128:
                raise CorruptStoreError(f"{path}: slot file header is truncated ({len(raw)} bytes)")
            hdr = np.frombuffer(raw, FILE_HEADER_DTYPE)
            if bytes(hdr["magic"][0]) != FILE_MAGIC:
                raise CorruptStoreError(f"{path} is not a hostkv slot file (bad magic)")
            if xxhash.xxh3_64_intdigest(raw[:120]) != int(hdr["header_checksum"][0]):
                raise CorruptStoreError(f"{path}: slot file header checksum mismatch")
            if int(hdr["layout_version"][0]) != FILE_LAYOUT_VERSION:
                raise IncompatibleStoreError(
                    f"{path}: slot file layout version {int(hdr['layout_version'][0])}, "
                    f"this build reads version {FILE_LAYOUT_VERSION}")
            sn, sc = int(hdr["slot_nbytes"][0]), int(hdr["slot_count"][0])
            if (int(hdr["slot_header_nbytes"][0]) != SLOT_HEADER_NBYTES or sn <= 0 or sn % _ALIGN
                    or sn > _MAX_SLOT_NBYTES or not 0 < sc <= _MAX_SLOTS):
                raise CorruptStoreError(f"{path}: implausible geometry (slot {sn} B x {sc})")
            data_offset, total = cls.layout(sn, sc)
            if int(hdr["data_offset"][0]) != data_offset:
                raise CorruptStoreError(f"{path}: data offset {int(hdr['data_offset'][0])} != {data_offset}")
            if size < total:
                # Mapping past EOF would turn the first touch of the missing part into SIGBUS.
                raise CorruptStoreError(f"{path} is {size} bytes but its header declares {total}")
            if store_id is not None and bytes(hdr["store_id"][0].tobytes()) != store_id:
                raise IncompatibleStoreError(f"{path} belongs to another store")
            if slot_nbytes is not None and sn != slot_nbytes:
                raise IncompatibleStoreError(f"{path} has {sn}-byte slots, expected {slot_nbytes}")
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd, hdr, writable)

    # -- accessors -----------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._map is None

    @property
    def fd(self) -> int:
        if self._fd is None:
            raise StorageIOError(f"{self.path} is closed")
        return self._fd

    def _v(self) -> memoryview:
        if self._view is None:
            raise StorageIOError(f"slot file {self.path} is closed")
        return self._view

    def headers(self, *, populate: bool = False) -> npt.NDArray[Any]:
        """The live header table as a structured array *view* of the mapping (read-only use).

        ``populate=True`` first maps the whole table in one ``MADV_POPULATE_READ`` call (Linux
        5.14+; ignored elsewhere) instead of one page fault per 4 KiB: bulk scans of a large
        table (open-time validation of a million entries) run several times faster."""
        if self._headers is None or self._map is None:
            raise StorageIOError(f"slot file {self.path} is closed")
        if populate:
            with contextlib.suppress(OSError, ValueError, AttributeError):
                self._map.madvise(_MADV_POPULATE_READ, 0, self.data_offset)
        return self._headers

    def _check_run(self, slot: int, nslots: int) -> None:
        if type(slot) is not int or type(nslots) is not int or slot < 0 or nslots <= 0 \
                or slot + nslots > self.slot_count:
            raise InvalidArgumentError(f"slot run [{slot}, {slot}+{nslots}) outside {self.path} "
                                       f"({self.slot_count} slots)")

    def _data_range(self, slot: int, nbytes: int) -> tuple[int, int]:
        nslots = run_nslots(nbytes, self.slot_nbytes)
        self._check_run(slot, nslots)
        lo = self.data_offset + slot * self.slot_nbytes
        return lo, lo + nbytes

    def data(self, slot: int, nbytes: int) -> memoryview:
        """The mapped bytes of an entry of ``nbytes`` starting at ``slot`` (writable if the file
        is).  Valid until :meth:`close`; the caller keeps the run's header protocol."""
        lo, hi = self._data_range(slot, nbytes)
        return self._v()[lo:hi]

    def data_offset_of(self, slot: int) -> int:
        """File offset of ``slot``'s first byte (for ``pread``/``pwrite`` callers and benchmarks)."""
        self._check_run(slot, 1)
        return self.data_offset + slot * self.slot_nbytes

    # -- writing -------------------------------------------------------------------------------
    def _need_writable(self) -> None:
        if not self.writable:
            raise InvalidArgumentError(f"{self.path} is open read-only")

    def begin_write(self, slot: int, nslots: int) -> None:
        """Invalidate the headers of a run before any of its data changes (protocol step 1)."""
        self._need_writable()
        self._check_run(slot, nslots)
        lo = FILE_HEADER_NBYTES + slot * SLOT_HEADER_NBYTES
        self._v()[lo : lo + nslots * SLOT_HEADER_NBYTES] = bytes(nslots * SLOT_HEADER_NBYTES)

    def begin_write_runs(self, runs: Sequence[tuple[int, int]]) -> None:
        """:meth:`begin_write` of many runs ``(slot, nslots)`` (a batch's protocol step 1): every
        run is checked first, then the headers of runs that lie back to back are zeroed with one
        copy each."""
        self._need_writable()
        count = self.slot_count
        for slot, nslots in runs:
            if type(slot) is not int or type(nslots) is not int or slot < 0 or nslots <= 0 \
                    or slot + nslots > count:
                self._check_run(slot, nslots)  # raises with the full message
        ordered = sorted(runs)
        _zero_headers(self._v(), [slot for slot, _ in ordered], [nslots for _, nslots in ordered])

    def write(self, slot: int, nbytes: int, offset: int, data: object) -> None:
        """Copy ``data`` to bytes ``[offset, offset+len)`` of the entry (``nbytes``) at ``slot``.

        With ``io == "syscall"`` (the default) the bytes go through ``pwrite`` on the file: one
        system call per write instead of one page fault per 4 KiB of the mapping (a fresh slot
        costs ~10x more through the mapping); the page cache is shared, so the mapping sees them.
        ``io == "mmap"`` copies through the mapping."""
        self._need_writable()
        src = memoryview(data).cast("B")  # type: ignore[arg-type]
        if offset < 0 or offset + src.nbytes > nbytes:
            raise SpanError(f"write [{offset}, {offset + src.nbytes}) exceeds the entry size {nbytes}")
        lo, _ = self._data_range(slot, nbytes)
        if self.io == "syscall":
            self._pwrite(src, lo + offset, slot)
        else:
            self._v()[lo + offset : lo + offset + src.nbytes] = src

    def _pwrite(self, src: memoryview, file_offset: int, slot: int) -> None:
        # One pwrite in the common case; the error text is built only when needed.
        fd = self.fd
        try:
            done = os.pwrite(fd, src, file_offset)
        except OSError as exc:
            raise _fsutil.io_error(exc, f"writing slot {slot} of {self.path}") from exc
        if done < src.nbytes:
            _fsutil.write_all(fd, src[done:], file_offset + done, f"writing slot {slot} of {self.path}")

    def write_runs(self, runs: Sequence[tuple[int, int, memoryview]], digests: list[int] | None = None) -> None:
        """Whole-entry writes ``(slot, nbytes, data)`` (``len(data) == nbytes``), each run's
        headers already zeroed (protocol step 1).  With ``io == "syscall"`` runs that lie back to
        back (an entry that fills its slots exactly, then the next run) go out in one
        ``pwritev``: one system call for many pages instead of one each.

        ``digests``: when given, receives the XXH3-64 of every ``data`` (in ``runs`` order).  A
        batch large enough for the I/O pool (see :func:`_parallel_min_nbytes`) is hashed there
        while this thread writes the same buffers (both only read them; XXH3 and ``pwritev``
        release the GIL), so the hash costs no time of its own; a smaller one is hashed group
        by group right before each group is written (the kernel's copy then reads bytes the
        hash has just brought into the CPU caches, so groups stay at ``_GROUP_NBYTES``); with
        the hashes on the pool the adjacent runs go out in as few calls as ``IOV_MAX`` allows.
        Either way every digest is in place, and no hash is still running, when this returns
        or raises."""
        self._need_writable()
        sn, count = self.slot_nbytes, self.slot_count
        for slot, nbytes, data in runs:
            if data.nbytes != nbytes:
                raise SpanError(f"a whole-entry write of {data.nbytes} bytes for an entry of {nbytes}")
            if type(slot) is not int or slot < 0 or slot + max(1, -(-nbytes // sn)) > count:
                self._data_range(slot, nbytes)  # raises with the full message
        digest = xxhash.xxh3_64_intdigest
        if digests is not None:
            digests[:] = [0] * len(runs)
        if self.io != "syscall":
            for j, (slot, nbytes, data) in enumerate(runs):
                if digests is not None:
                    digests[j] = digest(data)
                lo = self.data_offset + slot * self.slot_nbytes
                self._v()[lo : lo + nbytes] = data
            return
        fd = self.fd
        total_nbytes = sum(r[1] for r in runs)
        hash_ahead = digests is not None and _use_pool(total_nbytes, len(runs))

        def work(groups: Sequence[tuple[int, list[int]]]) -> None:
            for start, group in groups:
                bufs = [runs[j][2] for j in group]
                if digests is not None and not hash_ahead:
                    for j in group:
                        digests[j] = digest(runs[j][2])
                total = sum(b.nbytes for b in bufs)
                try:
                    done = os.pwritev(fd, bufs, start) if len(bufs) > 1 else os.pwrite(fd, bufs[0], start)
                except OSError as exc:
                    raise _fsutil.io_error(exc, f"writing slots of {self.path}") from exc
                if done < total:  # a short write: finish page by page from where it stopped
                    pos = start
                    for b in bufs:
                        if done < b.nbytes:
                            _fsutil.write_all(fd, b[max(done, 0):], pos + max(done, 0),
                                              f"writing slots of {self.path}")
                        done -= b.nbytes
                        pos += b.nbytes

        if not hash_ahead and digests is not None:  # hashed group by group: small groups
            max_nbytes = _GROUP_NBYTES
        else:  # no hash pass between the calls: as few pwritev calls as the threads allow
            parts = _IO_THREADS if not hash_ahead and _use_pool(total_nbytes, len(runs)) else 1
            max_nbytes = max(_GROUP_NBYTES, -(-total_nbytes // parts))
        groups = self._groups([(slot, nbytes) for slot, nbytes, _ in runs], max_nbytes)
        if not hash_ahead:
            _spread(groups, total_nbytes, work)
            return
        assert digests is not None
        out = digests

        def hash_slice(lo: int, hi: int) -> None:
            for j in range(lo, hi):
                out[j] = digest(runs[j][2])

        _hash_while(len(runs), total_nbytes, hash_slice, lambda: work(groups))

    def _groups(self, runs: Sequence[tuple[int, int]], max_nbytes: int = _GROUP_NBYTES
                ) -> list[tuple[int, list[int]]]:
        """Indices of ``runs`` ``(slot, nbytes)`` in groups whose bytes are contiguous in the file,
        each ``(file offset, [indices])``; at most ``_IOV_MAX`` buffers and ``max_nbytes``."""
        out: list[tuple[int, list[int]]] = []
        sn = self.slot_nbytes
        end = -1
        size = 0
        for j, (slot, nbytes) in enumerate(runs):
            lo = self.data_offset + slot * sn
            if lo == end and len(out[-1][1]) < _IOV_MAX and size + nbytes <= max_nbytes:
                out[-1][1].append(j)
                size += nbytes
            else:
                out.append((lo, [j]))
                size = nbytes
            # only an entry that fills its slots exactly is followed by the next run's first byte
            end = lo + nbytes if nbytes % sn == 0 and nbytes else -1
        return out

    def checksum(self, slot: int, nbytes: int) -> int:
        """XXH3-64 of the entry's mapped bytes."""
        return int(xxhash.xxh3_64_intdigest(self.data(slot, nbytes)))

    def write_header(self, slot: int, *, key: bytes, parent: bytes | None, generation: int, nbytes: int,
                     checksum: int, flags: int = 0, aux: int = 0, user: int = 0) -> None:
        """Publish the header of the entry at ``slot`` (protocol step 3: after its data)."""
        self._need_writable()
        if len(key) != KEY_NBYTES or (parent is not None and len(parent) != KEY_NBYTES):
            raise InvalidArgumentError("key and parent must be 32 bytes")
        self._data_range(slot, nbytes)
        lo = FILE_HEADER_NBYTES + slot * SLOT_HEADER_NBYTES
        self._v()[lo : lo + SLOT_HEADER_NBYTES] = _encode_header(key, parent, generation, nbytes, checksum,
                                                                 flags, aux, user)

    def write_header_of(self, slot: int, key: bytes, parent: bytes | None, generation: int, nbytes: int,
                        checksum: int, _pack: Any = _HEADER_STRUCT.pack, _digest: Any = xxhash.xxh3_64_intdigest
                        ) -> None:
        """:meth:`write_header` for a run this file handed out (``slot``/``nbytes`` already checked
        at reservation, ``key``/``parent`` are 32-byte keys): the per-page path of ``put_many``,
        without the argument checks and the flag juggling."""
        m = self._view
        if m is None or not self.writable:
            self._need_writable()
            raise StorageIOError(f"slot file {self.path} is closed")
        body = _pack(SLOT_MAGIC, key, parent or _ZERO_KEY, generation, nbytes, checksum,
                     FLAG_HAS_PARENT if parent is not None else 0, 0, 0, 0)
        lo = FILE_HEADER_NBYTES + slot * SLOT_HEADER_NBYTES
        m[lo : lo + SLOT_HEADER_NBYTES] = body + _digest(body).to_bytes(8, "little")

    # -- batches of equal entries (put_many's chunk path: lists of ints, no tuple per page) -----
    def _check_slots(self, slots: Sequence[int], nslots: int) -> None:
        if slots and (nslots <= 0 or min(slots) < 0 or max(slots) + nslots > self.slot_count):
            self._check_run(min(slots) if min(slots) < 0 else max(slots), max(nslots, 1))  # raises
            raise InvalidArgumentError(f"slot runs of {nslots} outside {self.path}")

    def begin_write_slots(self, slots: Sequence[int], nslots: int) -> None:
        """:meth:`begin_write_runs` of disjoint runs of ``nslots`` slots starting at ``slots``
        (every run checked first): protocol step 1, before any data byte of them changes.  Runs
        that tile one range (fresh space) are zeroed with one copy."""
        self._need_writable()
        self._check_slots(slots, nslots)
        if not slots:
            return
        v = self._v()
        lo, hi = min(slots), max(slots) + nslots
        if hi - lo == len(slots) * nslots:
            a = FILE_HEADER_NBYTES + lo * SLOT_HEADER_NBYTES
            v[a : a + (hi - lo) * SLOT_HEADER_NBYTES] = bytes((hi - lo) * SLOT_HEADER_NBYTES)
            return
        _zero_headers(v, sorted(slots), nslots)

    def write_slots(self, slots: Sequence[int], nbytes: int, views: Sequence[memoryview],
                    digests: list[int]) -> None:
        """:meth:`write_runs` of entries of equal size ``nbytes`` at ``slots`` (one per buffer of
        ``views``, headers already zeroed): runs that lie back to back go out in one ``pwritev``;
        ``digests`` receives the XXH3-64 of every buffer, computed as :meth:`write_runs` does (on
        the I/O pool beside the writes for a large batch, else right before each group's write).
        Every digest is in place, and no hash task still runs, when this returns or raises."""
        self._need_writable()
        n = len(views)
        if len(slots) != n:
            raise InvalidArgumentError(f"{len(slots)} slots for {n} buffers")
        for v in views:
            if v.nbytes != nbytes:
                raise SpanError(f"a whole-entry write of {v.nbytes} bytes for an entry of {nbytes}")
        sn = self.slot_nbytes
        nslots = max(1, -(-nbytes // sn))
        self._check_slots(slots, nslots)
        digest = xxhash.xxh3_64_intdigest
        digests[:] = [0] * n
        if not n:
            return
        if self.io != "syscall":
            m = self._v()
            base = self.data_offset
            for j, slot in enumerate(slots):
                digests[j] = digest(views[j])
                m[base + slot * sn : base + slot * sn + nbytes] = views[j]
            return
        fd = self.fd
        total = n * nbytes
        hash_ahead = _use_pool(total, n)
        # hashes on the pool: as few pwritev calls as IOV_MAX allows; else hashed group by group
        # right before each write, in groups of _GROUP_NBYTES (still in the caches for the copy)
        per_group = _IOV_MAX if hash_ahead else max(1, min(_IOV_MAX, _GROUP_NBYTES // nbytes))
        # groups [a, b) of positions whose runs follow each other back to back in the file (only
        # an entry that fills its slots exactly is followed by the next run's first byte)
        step = nslots if nbytes == nslots * sn else -1
        edges = [0]
        prev = slots[0]
        a = 0
        for j in range(1, n):
            s = slots[j]
            if s != prev + step or j - a >= per_group:
                edges.append(j)
                a = j
            prev = s
        edges.append(n)
        base = self.data_offset
        path = self.path

        def work(lo: int, hi: int) -> None:
            for g in range(lo, hi):
                a, b = edges[g], edges[g + 1]
                start = base + slots[a] * sn
                if not hash_ahead:
                    for j in range(a, b):
                        digests[j] = digest(views[j])
                try:
                    done = os.pwritev(fd, views[a:b], start) if b - a > 1 else os.pwrite(fd, views[a], start)
                except OSError as exc:
                    raise _fsutil.io_error(exc, f"writing slots of {path}") from exc
                if done < (b - a) * nbytes:  # a short write: finish page by page from where it stopped
                    pos = start
                    for buf in views[a:b]:
                        if done < buf.nbytes:
                            _fsutil.write_all(fd, buf[max(done, 0):], pos + max(done, 0),
                                              f"writing slots of {path}")
                        done -= buf.nbytes
                        pos += buf.nbytes

        ngroups = len(edges) - 1
        if not hash_ahead:
            work(0, ngroups)
            return

        def hash_slice(lo: int, hi: int) -> None:
            for j in range(lo, hi):
                digests[j] = digest(views[j])

        _hash_while(n, total, hash_slice, lambda: work(0, ngroups))

    def write_headers(self, slots: Sequence[int], keys: Sequence[bytes], parents: Sequence[bytes | None],
                      generations: Sequence[int], nbytes: int, checksums: Sequence[int],
                      _pack: Any = _HEADER_STRUCT.pack, _digest: Any = xxhash.xxh3_64_intdigest) -> None:
        """:meth:`write_header_of` of many entries of size ``nbytes`` (protocol step 3, after
        their data): byte for byte what :meth:`write_header` writes, in one loop over the
        columns (no tuple per page)."""
        self._need_writable()
        n = len(slots)
        if not (len(keys) == len(parents) == len(generations) == len(checksums) == n):
            raise InvalidArgumentError("write_headers: columns of different lengths")
        self._check_slots(slots, max(1, -(-nbytes // self.slot_nbytes)))
        m = self._v()
        for j in range(n):
            p = parents[j]
            body = _pack(SLOT_MAGIC, keys[j], p or _ZERO_KEY, generations[j], nbytes, checksums[j],
                         FLAG_HAS_PARENT if p is not None else 0, 0, 0, 0)
            lo = FILE_HEADER_NBYTES + slots[j] * SLOT_HEADER_NBYTES
            m[lo : lo + SLOT_HEADER_NBYTES] = body + _digest(body).to_bytes(8, "little")

    def clear(self, slot: int, nslots: int = 1) -> None:
        """Zero the headers of a run (free it on the medium; same as :meth:`begin_write`)."""
        self.begin_write(slot, nslots)

    # -- reading -------------------------------------------------------------------------------
    def header(self, slot: int) -> SlotHeader | None:
        """The verified header at ``slot``, or ``None`` if empty or damaged."""
        self._check_run(slot, 1)
        lo = FILE_HEADER_NBYTES + slot * SLOT_HEADER_NBYTES
        return _decode_header(self._v()[lo : lo + SLOT_HEADER_NBYTES])

    def _header_is(self, slot: int, key: bytes, generation: int, nbytes: int, checksum: int) -> bool:
        """Whether the header at ``slot`` names exactly this record: magic, key, generation, size
        and checksum compared byte for byte (the hot path of every read; :meth:`header` also
        checks the header checksum, which :meth:`check` uses)."""
        return self._ident_is(FILE_HEADER_NBYTES + slot * SLOT_HEADER_NBYTES, _MAGIC_BYTES + key,
                              _IDENT_TAIL.pack(generation, nbytes, checksum))

    def _ident_is(self, hlo: int, head: bytes, tail: bytes) -> bool:
        """The seqlock check of :meth:`read_into`: header bytes ``[0, 40)`` are ``head`` (magic,
        key) and ``[72, 96)`` are ``tail`` (generation, size, checksum).  Slicing the ``mmap``
        object returns ``bytes`` in one call (a memoryview slice + ``bytes()`` costs ~5x more,
        and this runs twice per read)."""
        m = self._map
        if m is None:
            raise StorageIOError(f"slot file {self.path} is closed")
        try:
            return m[hlo : hlo + 40] == head and m[hlo + 72 : hlo + 96] == tail
        except ValueError:  # closed by another thread between the check above and the slice
            raise StorageIOError(f"slot file {self.path} is closed") from None

    def check(self, slot: int, *, key: bytes, generation: int, nbytes: int, checksum: int,
              verify: bool = True) -> ReadResult:
        """Whether the run at ``slot`` holds exactly this record (the whole header including its
        checksum, and with ``verify`` the data checksum)."""
        self._check_run(slot, run_nslots(nbytes, self.slot_nbytes))
        h = self.header(slot)
        if h is None or h.key != key or h.generation != generation or h.nbytes != nbytes or h.checksum != checksum:
            return ReadResult.STALE
        if verify and self.checksum(slot, nbytes) != checksum:
            # a writer in another process may have reused the slot meanwhile: that is a miss
            return ReadResult.CORRUPT if self._header_is(slot, key, generation, nbytes, checksum) \
                else ReadResult.STALE
        return ReadResult.OK

    def read_into(self, slot: int, out: memoryview, *, key: bytes, generation: int, nbytes: int,
                  checksum: int, offset: int = 0, verify: bool = True) -> ReadResult:
        """Copy bytes ``[offset, offset+len(out))`` of the entry at ``slot`` into ``out``.

        The seqlock protocol of the module docstring: ``OK`` means ``out`` holds exactly the bytes
        sealed under this record (checksum-verified when ``verify``; for a whole-entry read the
        checksum is computed over ``out`` itself, so even a racing writer cannot slip bytes in).
        ``STALE``/``CORRUPT``: ``out`` content is unspecified and must not be used.
        """
        n = out.nbytes
        if offset < 0 or offset + n > nbytes:
            raise SpanError(f"read [{offset}, {offset + n}) exceeds the entry size {nbytes}")
        self._check_run(slot, run_nslots(nbytes, self.slot_nbytes))
        # The expected header bytes are built once and compared before and after the copy.
        hlo = FILE_HEADER_NBYTES + slot * SLOT_HEADER_NBYTES
        head = _MAGIC_BYTES + key
        tail = _IDENT_TAIL.pack(generation, nbytes, checksum)
        if not self._ident_is(hlo, head, tail):
            return ReadResult.STALE
        lo = self.data_offset + slot * self.slot_nbytes
        whole = offset == 0 and n == nbytes
        if self.io == "syscall":
            if n:
                self._pread_into(out, lo + offset)
        else:
            out[:] = self._v()[lo + offset : lo + offset + n]
        if verify:
            got = xxhash.xxh3_64_intdigest(out if whole else self._v()[lo : lo + nbytes])
            if got != checksum:
                return ReadResult.CORRUPT if self._ident_is(hlo, head, tail) else ReadResult.STALE
        if not self._ident_is(hlo, head, tail):
            return ReadResult.STALE
        return ReadResult.OK

    def read_runs_into(self, reads: Sequence[tuple[int, memoryview, bytes, int, int, int]], *,
                       verify: bool = True) -> list[ReadResult]:
        """Whole-entry reads ``(slot, out, key, generation, nbytes, checksum)`` with
        ``len(out) == nbytes``, each with the seqlock protocol of :meth:`read_into` (header,
        copy, XXH3 of ``out``, header again); runs that lie back to back in the file are copied
        with one ``preadv``.  One result per read: :meth:`read_batch` of the same entries."""
        sn, count = self.slot_nbytes, self.slot_count
        for slot, out, _key, _generation, nbytes, _checksum in reads:
            if out.nbytes != nbytes:
                raise SpanError(f"a whole-entry read into {out.nbytes} bytes of an entry of {nbytes}")
            if slot < 0 or slot + max(1, -(-nbytes // sn)) > count:
                self._check_run(slot, run_nslots(nbytes, sn))  # raises with the full message
        n = len(reads)
        if not n:
            return []
        codes = self.read_batch([r[0] for r in reads], [r[3] for r in reads], [r[4] for r in reads],
                                [r[5] for r in reads], [r[2] for r in reads], [r[1] for r in reads], verify=verify)
        return [_RESULT_OF[c] for c in codes]

    def read_batch(self, slots: Sequence[int] | npt.NDArray[np.int64], generations: Sequence[int] | npt.NDArray[Any],
                   nbytes: Sequence[int] | npt.NDArray[np.int64], checksums: Sequence[int] | npt.NDArray[Any],
                   keys: object, outs: Sequence[memoryview], *, verify: bool = True) -> bytes:
        """Whole-entry reads of a batch given as columns, one ``ReadResult`` code per entry
        (``bytes(n)``: all ``OK``), each with the seqlock protocol of :meth:`read_into`: see
        :func:`hostkv_providers.providers._slotread.read_batch`."""
        return _slotread.read_batch(self, slots, generations, nbytes, checksums, keys, outs, verify=verify)

    def _idents_match(self, slots: npt.NDArray[np.int64], want: npt.NDArray[np.uint64]
                      ) -> npt.NDArray[np.bool_] | None:
        return _slotread.idents_match(self, slots, want)

    def _batch_groups(self, slots: npt.NDArray[np.int64], nbytes: npt.NDArray[np.int64], max_nbytes: int
                      ) -> list[tuple[int, int, int]]:
        return _slotread.batch_groups(self, slots, nbytes, max_nbytes)

    def will_need(self, file_offset: int, nbytes: int) -> None:
        """Start reading ``[file_offset, file_offset + nbytes)`` into the page cache
        (``POSIX_FADV_WILLNEED``: the kernel queues the reads and returns).  A hint: errors
        are ignored, as is a closed file.

        In pieces of ``_WILLNEED_PIECE``: Linux reads ahead at most ``max(read_ahead_kb,
        max_sectors_kb)`` per call, so one call over a 256 MiB range read in its first few MiB
        only (measured: a read of the range after one call ran as cold as without it; after
        128 KiB pieces, at page-cache speed, for ~27 ms of calls per 256 MiB)."""
        fd = self._fd
        if fd is None or nbytes <= 0:
            return
        end = file_offset + nbytes
        with contextlib.suppress(OSError):
            for pos in range(file_offset, end, _WILLNEED_PIECE):
                os.posix_fadvise(fd, pos, min(_WILLNEED_PIECE, end - pos), os.POSIX_FADV_WILLNEED)

    def _pread_into(self, out: memoryview, file_offset: int) -> None:
        fd = self._fd
        if fd is None:
            raise StorageIOError(f"{self.path} is closed")
        n = out.nbytes
        try:
            done = os.preadv(fd, [out], file_offset)  # one call in the common case
            while done < n:
                got = os.preadv(fd, [out[done:]], file_offset + done)
                if got <= 0:
                    raise StorageIOError(f"{self.path}: short read at offset {file_offset + done}")
                done += got
        except StorageIOError:
            raise
        except OSError as exc:
            raise _fsutil.io_error(exc, f"reading {self.path}") from exc

    # -- durability ----------------------------------------------------------------------------
    def sync(self) -> None:
        """Make every byte written through the mapping durable (``fdatasync`` of the file, which
        on Linux writes back dirty shared-mapping pages too).  Raises ``StorageIOError``; never
        retry a failed sync expecting success (R7)."""
        _fsutil.sync_fd(self.fd, f"syncing {self.path}")

    def drop_cache(self) -> None:
        """Ask the kernel to drop this file's clean cached pages (benchmarks: cold reads).

        Call :meth:`sync` first (dirty pages are not dropped).  The mapping's pages are unmapped
        from this process first (``MADV_DONTNEED``: a shared file mapping loses nothing), because
        ``POSIX_FADV_DONTNEED`` leaves pages that a process still maps in the cache."""
        if self._map is not None:
            with contextlib.suppress(OSError, ValueError):
                self._map.madvise(mmap.MADV_DONTNEED)
        with contextlib.suppress(OSError):
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        """Unmap and close; idempotent.  Views handed out keep the mapping alive until released."""
        with self._lock:
            if self._map is None:
                return
            self._headers = None
            if self._view is not None:
                with contextlib.suppress(BufferError):
                    self._view.release()
                self._view = None
            with contextlib.suppress(BufferError):
                self._map.close()  # exported views still alive: freed when they go away
            self._map = None
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def __enter__(self) -> SlotFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<SlotFile {self.path} id={self.file_id} {self.slot_count}x{self.slot_nbytes}B>"


from hostkv_providers.providers import _slotread  # noqa: E402  (it imports this module)
