"""``lmdb://`` — an LMDB-indexed store that many processes share.

Layout of a store directory (0700, every file 0600)::

    data.mdb, lock.mdb    the LMDB environment: the whole index, ACID (``mdb_stat DIR`` reads it)
    hostkv.lock           flock: every open holds it shared; compaction takes it exclusively
    slots/NNNNNNNN.slots  slot files (:mod:`._slotfile`, shared with the mmap provider)

The LMDB environment holds named sub-databases (values are ``struct`` records or msgpack, never
pickle):

========== ============================== ====================================================
database   key                            value
========== ============================== ====================================================
meta       ``manifest``                   msgpack: store format/version, key, checksum algos,
                                          store id (identity check on open)
meta       ``counters``                   used/sealed bytes, LRU tick, generation, budget, ...
meta       ``cur`` + slot size            the slot file currently filled for that size class
entries    key                            one sealed entry (``_Entry``: parent, size, cost,
                                          checksum, LRU tick, child count, hold count,
                                          generation, location, salt tag, record checksum)
children   parent ‖ child                 tree links (subtree walks)
lru        tick ‖ key                     evictable leaves (no children, not held), oldest first
pages      key                            inline page bytes (entries of at most ``inline_max``)
anchors    key ‖ name                     XXH3-64 ‖ anchor bytes
flights    key                            an open reservation (owner pid+start time, location,
                                          generation, parent generation)
leases     owner ‖ sequence               a lease (owner, expiry, ``(key, generation)`` pairs)
files      file id                        slot size, slot count, high-water mark of a slot file
free       slot size ‖ file id ‖ slot     the free-slot list
limbo      key ‖ generation               the slot of a *held* entry that was dropped (checksum
                                          failure): freed only when its last holder lets go,
                                          so a zero-copy view can never see the slot reused
========== ============================== ====================================================

Protocol, the order crash safety depends on:

* ``reserve``: one write transaction checks dedup/in-flight/parent, evicts LRU leaves to make
  room (inside a nested transaction, rolled back if even evicting everything evictable cannot
  make room: the satisfiability guard evicts nothing), allocates a slot and a fresh generation,
  records the reservation with its owner.  After the commit the slot's header is zeroed before
  any byte of it changes (``SlotFile.begin_write``).
* ``write`` copies into the slot (or an in-memory buffer for inline entries).
* ``seal`` checksums the bytes, writes the slot header (key echo, generation, checksum), syncs
  the slot file when ``durability=sync``, and only then commits the transaction that creates the
  entry.  Seals of concurrent threads share one transaction and one sync (group commit).
* ``read`` takes the entry from a read transaction and copies the slot with the slot file's
  seqlock protocol: the header must echo key, generation, size and checksum, and the copied bytes
  must hash to the checksum.  A mismatch is confirmed inside a write transaction (where no slot of
  a live entry can change) before the entry and its subtree are dropped, so a slot that another
  process freed and reused is a plain miss, never wrong bytes and never a false corruption.

Multi-process rules: any number of processes may open a store and read and write at once;
LMDB serializes write transactions.  Reservations and leases live in LMDB with their owner's pid
and process start time, so every process respects them; those of dead processes are reclaimed on
open and whenever they stand in the way (an in-flight key, a full budget).  All processes must
share one PID namespace and one host (LMDB's own reader table has the same rule).
"""

from __future__ import annotations

import collections
import contextlib
import os
import shutil
import stat
import struct
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, ClassVar

import lmdb
import msgpack
import numpy as np
import xxhash

from hostkv_providers._checksum import CHECKSUM_ALGORITHM, checksum
from hostkv_providers._errors import (
    CapacityError,
    CorruptStoreError,
    HostKVError,
    IncompatibleStoreError,
    InFlightError,
    InvalidArgumentError,
    LockedError,
    NoSpaceError,
    ReservationError,
    StorageIOError,
    UnknownKeyError,
    UsedAfterForkError,
)
from hostkv_providers._keys import FORMAT_VERSION, KEY_ALGORITHM, KEY_NBYTES, Key
from hostkv_providers._options import Options, parse_size
from hostkv_providers._provider import (
    CompactReport,
    EntryInfo,
    EvictReport,
    HostRegion,
    Lease,
    Progress,
    Provider,
    ProviderStats,
    Reservation,
    VerifyReport,
    check_anchor_name,
    readable_bytes,
    writable_buffer,
)
from hostkv_providers._span import ByteSpan
from hostkv_providers.providers import _fsutil
from hostkv_providers.providers._slotfile import ReadResult, SlotFile, prefetch_runs

__all__ = ["STORE_FORMAT", "STORE_VERSION", "LmdbProvider"]

STORE_FORMAT = "hostkv-lmdb"
#: Bumped when the LMDB record layouts change incompatibly.
STORE_VERSION = 1

DURABILITY_MODES = ("sync", "process", "none")

_PAGE = 4096
_DEFAULT_BUDGET = 1 << 30
_DEFAULT_INLINE_MAX = 2048  # LMDB spills larger values to overflow pages; slots are better there
_DEFAULT_MAP_SIZE = 32 << 20
_DEFAULT_MAP_MAX = 64 << 30
_DEFAULT_FILE_NBYTES = 256 << 20
_DEFAULT_LEASE_TTL = 3600.0
_LOCK_TIMEOUT = 30.0
_MANIFEST_LIMIT = 64 << 10
_TAG_MAX = 255
_TOUCH_FLUSH = 4096  # pending LRU refreshes from reads are written with the next transaction
_PRESENT_CACHE_MAX = 1 << 18  # keys in the per-process presence cache; emptied when full

_LOCK_NAME = "hostkv.lock"
_SLOT_DIR = "slots"
_DB_NAMES = ("meta", "entries", "children", "lru", "pages", "anchors", "flights", "leases", "files", "free", "limbo")
_OWN_FILES = frozenset({"data.mdb", "lock.mdb", _LOCK_NAME, _SLOT_DIR})

_crash_armed = False  # set on open from the environment: keeps crash points off the hot path


def _crash(name: str) -> None:
    if _crash_armed:
        _fsutil.crash_point(name)


_fsutil.register_crash_points({
    "lmdb.txn.before_commit": "a write transaction is complete but not committed (write lock held)",
    "lmdb.txn.after_commit": "a write transaction committed; a durable seal is not synced yet",
    "lmdb.reserve.after_commit": "a reservation is committed; its slot header is not invalidated yet",
    "lmdb.seal.after_header": "page bytes and slot header written; nothing synced or committed",
    "lmdb.slotfile.created": "a new slot file exists; the transaction registering it has not committed",
    "lmdb.compact.after_moves": "slots moved and committed; the LMDB copy has not started",
    "lmdb.compact.after_copy": "the compacted LMDB copy is complete; not swapped in yet",
    "lmdb.compact.after_swap": "the compacted data.mdb replaced the old one; not reopened yet",
})


# --------------------------------------------------------------------------------------------
# Records
# --------------------------------------------------------------------------------------------


class _BadRecord(Exception):
    """An index record failed its own checksum or bounds (internal; becomes a corrupt entry)."""


_COUNTERS = struct.Struct("<11Q")


class _Counters:
    """Store-wide counters, one LMDB record updated in every write transaction."""

    __slots__ = ("budget", "checksum_failures", "evicted_bytes", "evictions", "gen", "lease_seq",
                 "next_file", "removals", "sealed", "tick", "used")
    used: int
    sealed: int
    tick: int
    gen: int
    evictions: int
    evicted_bytes: int
    checksum_failures: int
    budget: int
    next_file: int
    lease_seq: int
    removals: int  # bumped by every transaction that removes an entry (presence-cache epoch)

    def __init__(self, raw: bytes | None) -> None:
        vals = _COUNTERS.unpack(raw) if raw is not None and len(raw) == _COUNTERS.size else (0,) * 11
        (self.used, self.sealed, self.tick, self.gen, self.evictions, self.evicted_bytes,
         self.checksum_failures, self.budget, self.next_file, self.lease_seq, self.removals) = vals

    def pack(self) -> bytes:
        return _COUNTERS.pack(self.used, self.sealed, self.tick, self.gen, self.evictions, self.evicted_bytes,
                              self.checksum_failures, self.budget, self.next_file, self.lease_seq, self.removals)


# version, flags, parent, nbytes, cost, checksum, created, last_used, tick, children, hold, gen,
# file id (0: inline), slot — then the salt tag, then a 32-bit record checksum.
_ENTRY = struct.Struct("<BB32sQQQddQIIQQQ")
_ENTRY_VERSION = 1
_CRC = struct.Struct("<I")
_ZERO32 = bytes(32)


def _crc32(data: bytes | memoryview) -> int:
    return checksum(data) & 0xFFFFFFFF


class _Entry:
    __slots__ = ("checksum", "children", "cost", "created", "file_id", "gen", "hold", "key", "last_used",
                 "nbytes", "parent", "slot", "tag", "tick")

    def __init__(self, key: Key, parent: Key | None, nbytes: int, cost: int, digest: int, created: float,
                 tick: int, gen: int, file_id: int, slot: int, tag: str) -> None:
        self.key = key
        self.parent = parent
        self.nbytes = nbytes
        self.cost = cost
        self.checksum = digest
        self.created = created
        self.last_used = created
        self.tick = tick
        self.children = 0
        self.hold = 0
        self.gen = gen
        self.file_id = file_id
        self.slot = slot
        self.tag = tag

    @property
    def evictable(self) -> bool:
        return self.children == 0 and self.hold == 0

    @property
    def lru_key(self) -> bytes:
        return self.tick.to_bytes(8, "big") + self.key

    def pack(self) -> bytes:
        body = _ENTRY.pack(_ENTRY_VERSION, 1 if self.parent is not None else 0, self.parent or _ZERO32,
                           self.nbytes, self.cost, self.checksum, self.created, self.last_used, self.tick,
                           self.children, self.hold, self.gen, self.file_id, self.slot) + self.tag.encode()
        return body + _CRC.pack(_crc32(body))

    @classmethod
    def unpack(cls, key: bytes, raw: bytes | memoryview) -> _Entry:
        raw = bytes(raw)
        n = len(raw)
        if n < _ENTRY.size + _CRC.size or n > _ENTRY.size + _TAG_MAX + _CRC.size:
            raise _BadRecord(f"entry record of {n} bytes")
        if _CRC.unpack_from(raw, n - 4)[0] != _crc32(raw[:-4]):
            raise _BadRecord("entry record checksum mismatch")
        (ver, flags, parent, nbytes, cost, digest, created, last_used, tick, children, hold, gen, file_id,
         slot) = _ENTRY.unpack_from(raw)
        if ver != _ENTRY_VERSION:
            raise _BadRecord(f"entry record version {ver}")
        try:
            tag = raw[_ENTRY.size : n - 4].decode()
        except UnicodeDecodeError:
            raise _BadRecord("entry salt tag is not UTF-8") from None
        e = cls(Key(bytes(key)), Key(parent) if flags & 1 else None, nbytes, cost, digest, created, tick, gen,
                file_id, slot, tag)
        e.last_used, e.children, e.hold = last_used, children, hold
        return e

    def info(self, anchors: Mapping[str, int]) -> EntryInfo:
        return EntryInfo(self.key, self.parent, self.nbytes, self.tag, self.checksum, self.created,
                         self.last_used, dict(anchors))


# owner (pid, process start time, instance nonce), has_parent, parent, parent gen, cost, nbytes,
# gen, file id, slot, created, expiry
_OWNER = struct.Struct("<IQQ")
_FLIGHT = struct.Struct("<20sB32sQQQQQQdd")


class _Flight:
    __slots__ = ("cost", "created", "expiry", "file_id", "gen", "nbytes", "owner", "parent", "parent_gen", "slot")

    def __init__(self, owner: bytes, parent: Key | None, parent_gen: int, cost: int, nbytes: int, gen: int,
                 file_id: int, slot: int, created: float, expiry: float) -> None:
        self.owner = owner
        self.parent = parent
        self.parent_gen = parent_gen
        self.cost = cost
        self.nbytes = nbytes
        self.gen = gen
        self.file_id = file_id
        self.slot = slot
        self.created = created
        self.expiry = expiry

    def pack(self) -> bytes:
        return _FLIGHT.pack(self.owner, 1 if self.parent is not None else 0, self.parent or _ZERO32,
                            self.parent_gen, self.cost, self.nbytes, self.gen, self.file_id, self.slot,
                            self.created, self.expiry)

    @classmethod
    def unpack(cls, raw: bytes | memoryview) -> _Flight:
        if len(raw) != _FLIGHT.size:
            raise _BadRecord(f"reservation record of {len(raw)} bytes")
        owner, flags, parent, pgen, cost, nbytes, gen, fid, slot, created, expiry = _FLIGHT.unpack(bytes(raw))
        return cls(owner, Key(parent) if flags & 1 else None, pgen, cost, nbytes, gen, fid, slot, created, expiry)


_LEASE_HEAD = struct.Struct("<20sdI")
_LEASE_ITEM = struct.Struct("<32sQ")


def _pack_lease(owner: bytes, expiry: float, held: Sequence[tuple[bytes, int]]) -> bytes:
    return _LEASE_HEAD.pack(owner, expiry, len(held)) + b"".join(_LEASE_ITEM.pack(k, g) for k, g in held)


def _unpack_lease(raw: bytes | memoryview) -> tuple[bytes, float, list[tuple[Key, int]]]:
    raw = bytes(raw)
    if len(raw) < _LEASE_HEAD.size:
        raise _BadRecord("lease record too short")
    owner, expiry, n = _LEASE_HEAD.unpack_from(raw)
    if len(raw) != _LEASE_HEAD.size + n * _LEASE_ITEM.size:  # bound checked before iterating
        raise _BadRecord("lease record length does not match its count")
    items = [_LEASE_ITEM.unpack_from(raw, _LEASE_HEAD.size + i * _LEASE_ITEM.size) for i in range(n)]
    return owner, expiry, [(Key(k), g) for k, g in items]


_FILE = struct.Struct("<QQQ")  # slot size, slot count, high-water mark
_LIMBO = struct.Struct("<QQI")  # file id, slot, holders left


def _free_key(slot_nbytes: int, file_id: int, slot: int) -> bytes:
    return slot_nbytes.to_bytes(8, "big") + file_id.to_bytes(8, "big") + slot.to_bytes(8, "big")


def _slot_nbytes(nbytes: int) -> int:
    return -(-nbytes // _PAGE) * _PAGE


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


# --------------------------------------------------------------------------------------------
# The per-process environment handle
# --------------------------------------------------------------------------------------------


class _Shared:
    """One LMDB environment (and slot files) per store per process, shared by its providers.

    LMDB forbids opening one environment twice in a process (closing either would drop the
    other's locks), so providers opened on the same directory share this handle.
    """

    _registry: ClassVar[dict[tuple[int, int, int], _Shared]] = {}
    _registry_lock: ClassVar[threading.Lock] = threading.Lock()

    @classmethod
    def acquire(cls, path: str, *, durability: str, map_size: int, map_max: int, file_nbytes: int,
                budget: int | None, readonly: bool = False) -> _Shared:
        if readonly:
            # never create anything: a read-only open of a typo'd path must not make a store
            _fsutil.check_private_dir(path)
            if not os.path.lexists(os.path.join(path, "data.mdb")):
                raise IncompatibleStoreError(f"{path} holds no lmdb store (no data.mdb)")
        else:
            _fsutil.ensure_private_dir(path)
        st = os.stat(path)
        ident = (os.getpid(), st.st_dev, st.st_ino)
        with cls._registry_lock:
            handle = cls._registry.get(ident)
            if handle is None:
                handle = cls(path, ident, durability=durability, map_size=map_size, map_max=map_max,
                             file_nbytes=file_nbytes, readonly=readonly)
                cls._registry[ident] = handle
            elif (handle.durability == "sync") != (durability == "sync"):
                raise InvalidArgumentError(
                    f"{path} is already open in this process with durability={handle.durability}",
                    hint="open every provider of one store in one process with the same durability")
            handle.refs += 1
        try:
            if not readonly:
                if not handle.maintained:  # the handle was opened read-only first
                    handle.reclaim_dead()
                    handle.maintained = True
                handle.apply_budget(budget)
        except BaseException:
            handle.release()
            raise
        return handle

    def __init__(self, path: str, ident: tuple[int, int, int], *, durability: str, map_size: int, map_max: int,
                 file_nbytes: int, readonly: bool = False) -> None:
        self.path = path
        self.readonly = readonly
        self.maintained = not readonly
        self.ident = ident
        self.durability = durability
        self.map_max = map_max
        self.file_nbytes = file_nbytes
        self.refs = 0
        self.gate = _Gate()
        self.leader = threading.Lock()
        self.leader_owner: int | None = None
        # re-entrant: a garbage-collected Lease may release itself from a finalizer that runs
        # while this thread is inside a qlock block
        self.qlock = threading.RLock()
        self.deferred: collections.deque[Callable[[_Tx], Any]] = collections.deque()
        self.maint = threading.Condition(self.qlock)
        self.maint_owner: int | None = None  # the thread running a compaction, if any
        self.queue: list[_Ticket] = []
        self.touches: dict[Key, float] = {}
        self.files: dict[int, SlotFile] = {}
        self.files_lock = threading.Lock()
        # Keys known present as of removal epoch `present_epoch` (see LmdbProvider._hits).
        self.present_cache: set[bytes] = set()
        self.present_epoch = -1
        self.cache_lock = threading.Lock()
        self.slot_dir = os.path.join(path, _SLOT_DIR)
        self._exclusive_during_open = False
        global _crash_armed
        _crash_armed = bool(os.environ.get(_fsutil.CRASH_ENV) or os.environ.get("CRASH_AT"))
        self._check_contents()
        self.lock = self._shared_lock()
        t_open = time.monotonic()
        #: what opening this store did to recover it (``describe()["last_recovery"]``)
        self.recovery: dict[str, Any] = {"at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                         "by_pid": os.getpid(), "readonly": readonly}
        try:
            alone = False if readonly else self._try_exclusive()
            self.env = self._open_env(map_size)
            try:
                self.dbs = self._open_dbs()
                self.store_id = self._check_manifest()
                if not readonly:
                    _fsutil.ensure_private_dir(self.slot_dir)
                    if alone:
                        self._recover_files()
                    self.recovery["files_checked"] = alone  # temp/orphan files reclaimed (alone only)
                    self.recovery["dead_owners_reclaimed"] = self.reclaim_dead()
                self.recovery["seconds"] = round(time.monotonic() - t_open, 4)
            except BaseException:
                self.env.close()
                raise
        except BaseException:
            self.lock.release()
            raise

    # -- opening ---------------------------------------------------------------------------------
    def _check_contents(self) -> None:
        """Refuse a directory that holds something other than an lmdb store, or unsafe files."""
        try:
            names = os.listdir(self.path)
        except OSError as exc:
            raise _fsutil.io_error(exc, f"listing {self.path}") from exc
        foreign = [n for n in names if n not in _OWN_FILES and not _fsutil.is_temp_name(n)]
        if foreign:
            raise IncompatibleStoreError(
                f"{self.path} is not an lmdb store (it holds {', '.join(sorted(foreign)[:3])})",
                hint="point lmdb:// at an empty directory or an existing lmdb store")
        for name in ("data.mdb", "lock.mdb", _LOCK_NAME):
            full = os.path.join(self.path, name)
            if os.path.lexists(full):
                os.close(_fsutil.open_private(full, os.O_RDONLY))  # symlink/owner/mode checks

    def _shared_lock(self) -> _fsutil.LockFile:
        deadline = time.monotonic() + _LOCK_TIMEOUT
        while True:
            try:
                return _fsutil.LockFile(os.path.join(self.path, _LOCK_NAME), exclusive=False)
            except LockedError:
                if time.monotonic() >= deadline:
                    raise LockedError(f"{self.path} is being compacted by another process",
                                      hint="retry when the compaction has finished") from None
                time.sleep(0.01)

    def _try_exclusive(self) -> bool:
        """Take the lock exclusively if no other process has the store open: then recovery may
        remove orphans that nobody else can be creating.  ``False``: others are attached, the
        lock is held shared.  ``True``: held exclusively until :meth:`_downgrade`."""
        self.lock.release()
        try:
            ex = _fsutil.LockFile(os.path.join(self.path, _LOCK_NAME), exclusive=True)
        except LockedError:
            self.lock = self._shared_lock()
            return False
        # Keep the exclusive lock through recovery; _downgrade() swaps it for a shared one.
        self.lock = ex
        self._exclusive_during_open = True
        return True

    def _downgrade(self) -> None:
        if self._exclusive_during_open:
            self.lock.release()
            self.lock = self._shared_lock()
            self._exclusive_during_open = False

    def _open_env(self, map_size: int) -> Any:
        data = os.path.join(self.path, "data.mdb")
        try:
            existing = os.path.getsize(data)
        except OSError:
            existing = 0
        try:
            env = lmdb.open(
                self.path,
                # an existing store keeps its (preallocated) size; the map grows from there
                map_size=existing if existing >= 1 << 20 else map_size,
                subdir=True,
                readonly=False,
                create=True,
                mode=0o600,  # py-lmdb's default 0644 would make the index world-readable
                max_dbs=len(_DB_NAMES) + 2,
                max_readers=1024,
                max_spare_txns=4,
                lock=True,
                writemap=False,  # a power cut can corrupt a writemap environment
                # sync: LMDB fsyncs the data pages at every commit and we sync the meta page
                # with env.sync() after a batch of seals (one group commit); process/none never
                # sync (kill -9 safe: committed pages are in the page cache).
                sync=self.durability == "sync",
                metasync=False,
                readahead=False,  # random point reads of a large index
            )
        except lmdb.Error as exc:
            if "already open in this process" in str(exc):
                # py-lmdb's registry of open environments survives fork(): the parent has it open
                raise UsedAfterForkError(
                    f"{self.path} is open in the parent of this forked process; py-lmdb refuses a second open",
                    hint="open the store only after fork in each process, or start workers with 'spawn'",
                ) from None
            raise _lmdb_error(exc, f"opening {self.path}") from exc
        try:
            if not self.readonly:
                self._preallocate(int(env.info()["map_size"]))
        except BaseException:
            env.close()
            raise
        try:
            env.reader_check()  # clear the reader slots of killed processes
        except lmdb.Error as exc:
            env.close()
            raise _lmdb_error(exc, "checking stale readers") from exc
        for name in ("data.mdb", "lock.mdb"):
            full = os.path.join(self.path, name)
            with contextlib.suppress(OSError, NotImplementedError):
                os.chmod(full, 0o600, follow_symlinks=False)  # LMDB applies the umask, not less
        return env

    def _preallocate(self, nbytes: int) -> None:
        """``posix_fallocate`` data.mdb to the map size: LMDB then never extends the file, so a
        full filesystem shows up here as a clean ``NoSpaceError`` instead of an LMDB commit
        failing with a bare EIO halfway through a transaction (R6)."""
        fd = _fsutil.open_private(os.path.join(self.path, "data.mdb"), os.O_RDWR)
        try:
            if os.fstat(fd).st_size < nbytes:
                _fsutil.fallocate(fd, 0, nbytes, f"preallocating {nbytes} bytes for the LMDB index")
        finally:
            os.close(fd)

    def _open_dbs(self) -> dict[str, Any]:
        dbs: dict[str, Any] = {}
        try:
            # read-only: a write transaction that changes nothing writes nothing to data.mdb
            with self.env.begin(write=True) as txn:
                for name in _DB_NAMES:
                    dbs[name] = self.env.open_db(name.encode(), txn=txn, create=not self.readonly)
        except lmdb.NotFoundError:
            raise IncompatibleStoreError(f"{self.path} is not a complete lmdb store (a database is missing)") from None
        except lmdb.Error as exc:
            raise _lmdb_error(exc, "opening the index databases") from exc
        return dbs

    def _check_manifest(self) -> bytes:
        meta = self.dbs["meta"]
        try:
            with self.env.begin(write=True) as txn:
                raw = txn.get(b"manifest", db=meta)
                if raw is None and self.readonly:
                    raise IncompatibleStoreError(f"{self.path} holds no initialized lmdb store")
                if raw is None:
                    if txn.stat(self.dbs["entries"])["entries"]:
                        raise CorruptStoreError(f"{self.path}: index has entries but no manifest")
                    store_id = os.urandom(16)
                    manifest = {
                        "store_format": STORE_FORMAT,
                        "store_version": STORE_VERSION,
                        "format_version": FORMAT_VERSION,
                        "key_algorithm": KEY_ALGORITHM,
                        "checksum_algorithm": CHECKSUM_ALGORITHM,
                        "store_id": store_id,
                        "created": time.time(),
                    }
                    txn.put(b"manifest", msgpack.packb(manifest, use_bin_type=True), db=meta)
                    c = _Counters(None)
                    c.budget = _DEFAULT_BUDGET
                    txn.put(b"counters", c.pack(), db=meta)
                    return store_id
        except lmdb.Error as exc:
            raise _lmdb_error(exc, "reading the manifest") from exc
        return _check_manifest_bytes(bytes(raw), self.path)

    def _recover_files(self) -> None:
        """With no other process attached: remove temp files, a half-done compaction and slot
        files that no committed transaction registered (R3)."""
        try:
            _fsutil.remove_temp_files(self.slot_dir)
            for name in os.listdir(self.path):
                full = os.path.join(self.path, name)
                if _fsutil.is_temp_name(name):
                    if os.path.isdir(full) and not os.path.islink(full):
                        shutil.rmtree(full, ignore_errors=True)
                    else:
                        with contextlib.suppress(OSError):
                            os.unlink(full)
            with self.env.begin() as txn:
                known = {int.from_bytes(k, "big") for k, _ in txn.cursor(db=self.dbs["files"])}
            for name in os.listdir(self.slot_dir):
                fid = _file_id_of(name)
                if fid is not None and fid not in known:
                    with contextlib.suppress(OSError):
                        os.unlink(os.path.join(self.slot_dir, name))
        except OSError as exc:
            raise _fsutil.io_error(exc, f"recovering {self.path}") from exc
        except lmdb.Error as exc:
            raise _lmdb_error(exc, "listing slot files") from exc
        finally:
            self._downgrade()

    def apply_budget(self, budget: int | None) -> None:
        if budget is None:
            return

        def op(tx: _Tx) -> None:
            if tx.c.budget != budget:
                tx.c.budget = budget
                if tx.c.used > budget:
                    tx.evict_lru(tx.c.used - budget)

        self.submit(op)

    # -- transactions ------------------------------------------------------------------------------
    def _adopt_map_size(self) -> None:
        with self.gate.exclusive():
            try:
                self.env.set_mapsize(0)  # another process grew the map: adopt its size
            except lmdb.Error as exc:
                raise _lmdb_error(exc, "adopting the map size") from exc

    def _grow(self, *, headroom: bool = False) -> None:
        limit = self.map_max + max(self.map_max // 16, 2 << 20) if headroom else self.map_max
        with self.gate.exclusive():
            cur = int(self.env.info()["map_size"])
            if cur >= limit:
                raise NoSpaceError(f"the LMDB index reached map_max ({self.map_max} bytes)",
                                   hint="raise the map_max option, or lower inline_max/the budget")
            new = min(cur * 2, limit) if cur < self.map_max else limit
            self._preallocate(new)  # first: on ENOSPC the map stays as it was
            try:
                self.env.set_mapsize(new)
            except lmdb.Error as exc:
                raise _lmdb_error(exc, "growing the map") from exc

    @contextlib.contextmanager
    def read(self, buffers: bool = False) -> Iterator[Any]:
        """A short read transaction."""
        while True:
            self.gate.acquire_shared()
            try:
                txn = self.env.begin(buffers=buffers)
            except lmdb.MapResizedError:
                self.gate.release_shared()
                self._adopt_map_size()
                continue
            except lmdb.Error as exc:
                self.gate.release_shared()
                raise _lmdb_error(exc, "starting a read transaction") from exc
            break
        try:
            yield txn
        except lmdb.Error as exc:
            raise _lmdb_error(exc, "reading the index") from exc
        finally:
            txn.abort()
            self.gate.release_shared()

    def submit(self, fn: Callable[[_Tx], Any], *, durable: bool = False, sync_files: Sequence[SlotFile] = (),
               frees: bool = False) -> Any:
        """Run ``fn`` in a write transaction, batched with other threads' (group commit).

        ``fn`` runs in a nested transaction: if it raises, only its own changes are rolled back.
        ``sync_files`` are synced before the transaction commits; with ``durable`` the commit is
        synced before this returns (``durability=sync``).  ``frees``: the op only removes things
        (evict, abort, release); such ops may use the map's headroom past ``map_max``, so a full
        index can always be evicted from.
        """
        ticket = _Ticket(fn, durable and self.durability == "sync", sync_files if self.durability == "sync" else (),
                         frees)
        me = threading.get_ident()
        with self.qlock:
            while self.maint_owner is not None and self.maint_owner != me:
                self.maint.wait()  # a compaction in this process has the store to itself
            self.queue.append(ticket)
        with self.leader:
            self.leader_owner = me
            try:
                if not ticket.done:
                    with self.qlock:
                        batch, self.queue = self.queue, []
                    while self.deferred:
                        batch.append(_Ticket(self.deferred.popleft(), False, (), True))
                    self._run_batch(batch)
            finally:
                self.leader_owner = None
        if ticket.error is not None:
            raise ticket.error
        return ticket.result

    def _run_batch(self, batch: list[_Ticket]) -> None:
        try:
            self._run_batch_inner(batch)
        except BaseException as exc:  # never leave a waiter without an answer
            for t in batch:
                if not t.done and t.error is None:
                    t.error = exc if isinstance(exc, HostKVError) else _lmdb_error(exc, "committing")
            if not isinstance(exc, (HostKVError, lmdb.Error)):
                raise
        finally:
            for t in batch:
                t.done = True

    def _run_batch_inner(self, batch: list[_Ticket]) -> None:
        # 1. Page bytes reach stable storage before the transaction that points at them.
        synced: dict[int, BaseException | None] = {}
        for t in batch:
            for sf in t.sync_files:
                if id(sf) not in synced:
                    try:
                        sf.sync()
                        synced[id(sf)] = None
                    except HostKVError as exc:  # R7: every seal waiting on a failed sync fails
                        synced[id(sf)] = exc
                err = synced[id(sf)]
                if err is not None and t.error is None:
                    t.error = err
        live = [t for t in batch if t.error is None]
        with self.qlock:
            touches, self.touches = self.touches, {}
        # 2. One transaction for the whole batch.
        while True:
            for t in live:
                t.result, t.error = None, None
            try:
                self._commit_batch(live, touches)
                break
            except lmdb.MapFullError:
                # nothing was committed; retry the whole batch in a larger map
                try:
                    self._grow(headroom=all(t.frees for t in live))
                except NoSpaceError as exc:
                    if all(t.frees for t in live):
                        raise
                    # at map_max: fail what adds to the index, retry what frees (it may use the
                    # headroom), so a full index can always be evicted from
                    for t in live:
                        if not t.frees:
                            t.error = exc
                    live = [t for t in live if t.frees]
                    touches = {}
            except lmdb.MapResizedError:
                self._adopt_map_size()
            except lmdb.Error as exc:
                err = _lmdb_error(exc, "committing a transaction")
                if not isinstance(err, NoSpaceError) and _filesystem_full(self.path):
                    # LMDB reports a short write as EIO; on a full filesystem that is ENOSPC
                    err = NoSpaceError(f"no space left while committing to {self.path}: {exc}")
                for t in live:
                    t.error = err
                return
        # 3. durability=sync: the commit itself reaches stable storage before any seal returns.
        if any(t.durable and t.error is None for t in live):
            try:
                self.env.sync(True)
            except lmdb.Error as exc:
                err = StorageIOError(f"syncing the LMDB index failed: {exc}")
                for t in live:
                    if t.durable and t.error is None:
                        t.error = err

    def _commit_batch(self, live: list[_Ticket], touches: dict[Key, float]) -> None:
        self.gate.acquire_shared()
        try:
            txn = self.env.begin(write=True)
            try:
                if touches:
                    tx = _Tx(self, txn)
                    tx.apply_touches(touches)
                    tx.save()
                for t in live:
                    child = self.env.begin(write=True, parent=txn)
                    try:
                        tx = _Tx(self, child)
                        result = t.fn(tx)
                        tx.save()
                    except (lmdb.MapFullError, lmdb.MapResizedError):
                        child.abort()
                        raise  # the whole batch is retried in a larger map
                    except lmdb.Error as exc:
                        child.abort()
                        t.error = _lmdb_error(exc, "updating the index")
                        continue
                    except _BadRecord as exc:
                        child.abort()
                        t.error = CorruptStoreError(f"damaged index record: {exc}")
                        continue
                    except Exception as exc:
                        child.abort()
                        t.error = exc
                        continue
                    child.commit()
                    if isinstance(result, _Raise):
                        t.error = result.exc
                    else:
                        t.result = result
                _crash("lmdb.txn.before_commit")
                txn.commit()
                _crash("lmdb.txn.after_commit")
            except BaseException:
                txn.abort()
                raise
        finally:
            self.gate.release_shared()

    def submit_later(self, fn: Callable[[_Tx], Any]) -> None:
        """Queue a freeing op without waiting (safe from finalizers and from the leader itself):
        it runs with the next batch of this process, or at close."""
        self.deferred.append(fn)

    def touch(self, key: Key) -> None:
        """Record an LRU refresh from a read; written with the next transaction of this process."""
        with self.qlock:
            self.touches[key] = time.time()
            flush = len(self.touches) >= _TOUCH_FLUSH
        if flush:
            self.submit(lambda tx: None)

    # -- slot files --------------------------------------------------------------------------------
    def slot_file(self, file_id: int) -> SlotFile:
        sf = self.files.get(file_id)
        if sf is not None:
            return sf
        with self.files_lock:
            sf = self.files.get(file_id)
            if sf is None:
                sf = SlotFile.open(_slot_path(self.slot_dir, file_id), writable=True, store_id=self.store_id)
                if sf.file_id != file_id:
                    sf.close()
                    raise CorruptStoreError(f"slot file {file_id} names itself {sf.file_id}")
                self.files[file_id] = sf
            return sf

    def create_slot_file(self, file_id: int, slot_nbytes: int, slot_count: int) -> SlotFile:
        """Create slot file ``file_id`` (inside the write transaction that registers it)."""
        path = _slot_path(self.slot_dir, file_id)
        with self.files_lock:
            old = self.files.pop(file_id, None)
            if old is not None:
                old.close()
            if os.path.lexists(path):
                # Ids are allocated inside write transactions, so an existing file with an id the
                # index does not know is an orphan of a transaction that never committed.
                try:
                    os.unlink(path)
                except OSError as exc:
                    raise _fsutil.io_error(exc, f"removing orphan {path}") from exc
            # Durable in every mode (one sync per new slot file, rare): without it a power cut in
            # process/none mode could leave the registered name on an empty or short file, which
            # open refuses — losing recent seals is allowed there, losing the store is not (the
            # mmap provider's power-cut images found exactly this).
            sf = SlotFile.create(path, slot_nbytes=slot_nbytes, slot_count=slot_count, file_id=file_id,
                                 store_id=self.store_id)
            self.files[file_id] = sf
            return sf

    def close_files(self) -> None:
        with self.files_lock:
            for sf in self.files.values():
                sf.close()
            self.files.clear()

    # -- maintenance -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def maintenance(self) -> Iterator[None]:
        """Run the block as the only writer thread of this process (compaction): other threads'
        writes wait; those queued before are committed first."""
        me = threading.get_ident()
        with self.qlock:
            while self.maint_owner is not None:
                self.maint.wait()
            self.maint_owner = me
        try:
            self.submit(lambda tx: None)  # commits whatever other threads queued before us
            yield
        finally:
            with self.qlock:
                self.maint_owner = None
                self.maint.notify_all()

    def reclaim_dead(self) -> int:
        """Release the reservations and leases of dead processes (and expired leases)."""
        with self.read() as txn:
            dead_f = [bytes(k) for k, v in txn.cursor(db=self.dbs["flights"])
                      if len(v) != _FLIGHT.size or not _alive(bytes(v[:20]))]
            now = time.time()
            dead_l = []
            for k, v in txn.cursor(db=self.dbs["leases"]):
                try:
                    owner, expiry, _ = _unpack_lease(v)
                except _BadRecord:
                    owner, expiry = b"", 0.0
                if expiry < now or not owner or not _alive(owner):
                    dead_l.append(bytes(k))
        if not dead_f and not dead_l:
            return 0

        def op(tx: _Tx) -> int:
            n = 0
            for k in dead_f:
                try:
                    fl = tx.flight(Key(k))
                except _BadRecord:
                    tx.t.delete(k, db=tx.db["flights"])
                    n += 1
                    continue
                if fl is not None and not _alive(fl.owner):
                    tx.drop_flight(Key(k), fl)
                    n += 1
            for lid in dead_l:
                n += tx.release_lease(lid)
            return n

        return int(self.submit(op, frees=True))

    def release(self) -> None:
        with self._registry_lock:
            self.refs -= 1
            if self.refs > 0:
                return
            self._registry.pop(self.ident, None)
        self.close_files()
        with self.gate.exclusive():
            self.env.close()
        self.lock.release()


def _filesystem_full(path: str) -> bool:
    try:
        st = os.statvfs(path)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < 1 << 20


def _check_manifest_bytes(raw: bytes, path: str) -> bytes:
    if len(raw) > _MANIFEST_LIMIT:
        raise CorruptStoreError(f"{path}: manifest of {len(raw)} bytes")
    try:
        manifest = msgpack.unpackb(raw, raw=False, strict_map_key=True, max_bin_len=1024, max_str_len=1024,
                                   max_array_len=64, max_map_len=64, max_ext_len=0)
    except Exception as exc:  # msgpack raises several types for malformed input
        raise CorruptStoreError(f"{path}: the manifest cannot be parsed ({exc})") from None
    if not isinstance(manifest, dict):
        raise CorruptStoreError(f"{path}: the manifest is not a map")
    expected: dict[str, object] = {
        "store_format": STORE_FORMAT,
        "store_version": STORE_VERSION,
        "format_version": FORMAT_VERSION,
        "key_algorithm": KEY_ALGORITHM,
        "checksum_algorithm": CHECKSUM_ALGORITHM,
    }
    for field, want in expected.items():
        got = manifest.get(field)
        if got != want:
            raise IncompatibleStoreError(
                f"{path}: store has {field}={got!r}, this build needs {want!r}",
                hint="open it with a matching hostkv-providers version, or start a new store")
    store_id = manifest.get("store_id")
    if not isinstance(store_id, bytes) or len(store_id) != 16:
        raise CorruptStoreError(f"{path}: the manifest has no valid store id")
    return store_id


def _slot_path(slot_dir: str, file_id: int) -> str:
    return os.path.join(slot_dir, f"{file_id:08d}.slots")


def _file_id_of(name: str) -> int | None:
    stem, dot, ext = name.partition(".")
    return int(stem) if dot and ext == "slots" and stem.isdigit() else None


# --------------------------------------------------------------------------------------------
# Index operations inside one write transaction
# --------------------------------------------------------------------------------------------


class _Tx:
    """Typed helpers over one (nested) write transaction; ``save()`` writes the counters back."""

    def __init__(self, shared: _Shared, txn: Any) -> None:
        self.s = shared
        self.t = txn
        self.db = shared.dbs
        self.c = _Counters(txn.get(b"counters", db=shared.dbs["meta"]))
        self.needs_repair = False

    def save(self) -> None:
        if self.needs_repair:
            # A damaged record was removed without knowing its cost, slot or LRU tick: rebuild
            # the derived state (rare: only after corruption of the index itself).
            self.needs_repair = False
            _repair_index(self)
        self.t.put(b"counters", self.c.pack(), db=self.db["meta"])

    # -- entries ---------------------------------------------------------------------------------
    def get(self, key: Key) -> _Entry | None:
        raw = self.t.get(key, db=self.db["entries"])
        return None if raw is None else _Entry.unpack(key, raw)

    def get_or_drop(self, key: Key) -> _Entry | None:
        """The entry, or ``None``; an entry whose record is damaged is dropped with its subtree."""
        try:
            return self.get(key)
        except _BadRecord:
            self.drop(key)
            self.c.checksum_failures += 1
            return None

    def put(self, e: _Entry) -> None:
        self.t.put(e.key, e.pack(), db=self.db["entries"])

    def next_tick(self) -> int:
        self.c.tick += 1
        return self.c.tick

    def hold(self, e: _Entry) -> None:
        if e.evictable:
            self.t.delete(e.lru_key, db=self.db["lru"])
        e.hold += 1
        self.put(e)

    def unhold(self, e: _Entry) -> None:
        e.hold = max(0, e.hold - 1)
        if e.evictable:
            self.t.put(e.lru_key, b"", db=self.db["lru"])
        self.put(e)

    def touch(self, e: _Entry, when: float) -> None:
        was = e.evictable
        if was:
            self.t.delete(e.lru_key, db=self.db["lru"])
        e.tick = self.next_tick()
        e.last_used = when
        if was:
            self.t.put(e.lru_key, b"", db=self.db["lru"])
        self.put(e)

    def apply_touches(self, touches: Mapping[Key, float]) -> None:
        for key, when in sorted(touches.items(), key=lambda kv: kv[1]):
            try:
                e = self.get(key)
            except _BadRecord:
                continue
            if e is not None:
                self.touch(e, when)

    def insert(self, e: _Entry) -> None:
        """Add a new sealed leaf (the caller updated the parent)."""
        self.put(e)
        self.t.put(e.lru_key, b"", db=self.db["lru"])
        if e.parent is not None:
            self.t.put(e.parent + e.key, b"", db=self.db["children"])

    def remove(self, e: _Entry, *, evicted: bool) -> None:
        """Delete ``e`` (a leaf: its children are gone) with its bytes, anchors and links."""
        t, db = self.t, self.db
        t.delete(e.key, db=db["entries"])
        t.delete(e.lru_key, db=db["lru"])
        if e.parent is not None:
            t.delete(e.parent + e.key, db=db["children"])
            try:
                pe = self.get(e.parent)
            except _BadRecord:
                pe = None
            if pe is not None:
                was = pe.evictable
                pe.children = max(0, pe.children - 1)
                if pe.evictable and not was:
                    t.put(pe.lru_key, b"", db=db["lru"])
                self.put(pe)
        cur = t.cursor(db=db["anchors"])
        if cur.set_range(e.key):
            while cur.key()[:KEY_NBYTES] == e.key:
                if not cur.delete():
                    break
        if e.file_id == 0:
            t.delete(e.key, db=db["pages"])
        elif e.hold:
            # Dropped while leased (or under an in-flight child): a reader may hold a zero-copy
            # view of the slot, so it is only freed when the last holder lets go.
            t.put(e.key + e.gen.to_bytes(8, "big"), _LIMBO.pack(e.file_id, e.slot, e.hold), db=db["limbo"])
        else:
            self.free_slot(e.file_id, e.slot)
        self.c.used -= e.cost
        self.c.sealed -= e.cost
        self.c.removals += 1
        if evicted:
            self.c.evictions += 1
            self.c.evicted_bytes += e.cost

    def children_of(self, key: Key) -> list[Key]:
        out: list[Key] = []
        cur = self.t.cursor(db=self.db["children"])
        if cur.set_range(key):
            for k in cur.iternext(values=False):
                if k[:KEY_NBYTES] != key:
                    break
                out.append(Key(bytes(k[KEY_NBYTES:])))
        return out

    def subtree(self, roots: Sequence[Key]) -> list[Key]:
        """Keys of the subtrees under ``roots`` (present ones), every node after its descendants."""
        order: list[Key] = []
        seen: set[Key] = set()
        for root in roots:
            if root in seen or self.t.get(root, db=self.db["entries"]) is None:
                continue
            # iterative post-order: a node is emitted after all of its descendants, also when
            # one root lies inside another root's subtree
            stack: list[tuple[Key, bool]] = [(root, False)]
            while stack:
                k, expanded = stack.pop()
                if expanded:
                    order.append(k)
                    continue
                if k in seen:
                    continue
                seen.add(k)
                stack.append((k, True))
                stack.extend((c, False) for c in self.children_of(k) if c not in seen)
        return order

    def evict_keys(self, keys: Sequence[Key]) -> tuple[int, int, int]:
        removed = freed = skipped = 0
        for k in self.subtree(keys):
            e = self.get_or_drop(k)
            if e is None:
                continue
            if e.hold or e.children or self.t.get(k, db=self.db["flights"]) is not None:
                skipped += 1
                continue
            self.remove(e, evicted=True)
            removed += 1
            freed += e.cost
        return removed, freed, skipped

    def evict_lru(self, need: int) -> tuple[int, int]:
        """Evict least-recently-used unheld leaves until ``need`` bytes are freed (or none left)."""
        removed = freed = 0
        cur = self.t.cursor(db=self.db["lru"])
        while freed < need and cur.first():
            k = Key(bytes(cur.key()[8:]))
            e = self.get_or_drop(k)
            if e is None or not e.evictable or e.lru_key != bytes(cur.key()):
                cur.delete()  # a stale LRU record (repaired here rather than trusted)
                continue
            self.remove(e, evicted=True)
            removed += 1
            freed += e.cost
        return removed, freed

    def make_room(self, cost: int) -> None:
        """Evict LRU leaves so that ``cost`` more bytes fit, or raise ``CapacityError`` having
        evicted nothing (the evictions run in a nested transaction that is rolled back)."""
        over = self.c.used + cost - self.c.budget
        if over <= 0:
            return
        if cost > self.c.budget:
            raise CapacityError(f"{cost} bytes exceed the whole budget of {self.c.budget}")
        self.save()  # the trial transaction starts from this one's current counters
        trial = self.s.env.begin(write=True, parent=self.t)
        inner = _Tx(self.s, trial)
        try:
            _, freed = inner.evict_lru(over)
            if freed < over:
                raise CapacityError(
                    f"{cost} bytes do not fit: budget {self.c.budget}, used {self.c.used}, "
                    f"evictable {freed}")
            inner.save()
        except BaseException:
            trial.abort()
            raise
        trial.commit()
        self.c = _Counters(self.t.get(b"counters", db=self.db["meta"]))

    def drop(self, key: Key) -> int:
        """Force-remove ``key`` and its subtree (a checksum failure), held or not."""
        n = 0
        for k in self.subtree([key]) or [key]:
            try:
                e = self.get(k)
            except _BadRecord:
                self._remove_damaged(k)
                n += 1
                continue
            if e is None:
                continue
            e.children = 0
            self.remove(e, evicted=False)
            n += 1
        return n

    def _remove_damaged(self, key: Key) -> None:
        """Remove an entry whose record cannot be decoded: its parent and location are unknown,
        so find the parent link by a scan (rare) and leave the slot to ``verify(repair=True)``."""
        t, db = self.t, self.db
        self.needs_repair = True
        self.c.removals += 1
        t.delete(key, db=db["entries"])
        t.delete(key, db=db["pages"])
        t.delete(key, db=db["flights"])
        cur = t.cursor(db=db["anchors"])
        if cur.set_range(key):
            while cur.key()[:KEY_NBYTES] == key:
                if not cur.delete():
                    break
        for link in [bytes(k) for k in t.cursor(db=db["children"]).iternext(values=False)]:
            if link[KEY_NBYTES:] == key:
                t.delete(link, db=db["children"])
                try:
                    pe = self.get(Key(link[:KEY_NBYTES]))
                except _BadRecord:
                    pe = None
                if pe is not None:
                    pe.children = max(0, pe.children - 1)
                    if pe.evictable:
                        t.put(pe.lru_key, b"", db=db["lru"])
                    self.put(pe)

    # -- slots -----------------------------------------------------------------------------------
    def file_record(self, file_id: int) -> tuple[int, int, int]:
        raw = self.t.get(file_id.to_bytes(8, "big"), db=self.db["files"])
        if raw is None or len(raw) != _FILE.size:
            raise CorruptStoreError(f"slot file {file_id} is not registered")
        sn, count, hw = _FILE.unpack(raw)
        return int(sn), int(count), int(hw)

    def alloc_slot(self, slot_nbytes: int) -> tuple[int, int]:
        prefix = slot_nbytes.to_bytes(8, "big")
        cur = self.t.cursor(db=self.db["free"])
        if cur.set_range(prefix):
            k = bytes(cur.key())
            if k[:8] == prefix:
                cur.delete()
                return int.from_bytes(k[8:16], "big"), int.from_bytes(k[16:24], "big")
        meta = self.db["meta"]
        raw = self.t.get(b"cur" + prefix, db=meta)
        if raw is not None:
            fid = int.from_bytes(raw, "big")
            sn, count, hw = self.file_record(fid)
            if hw < count:
                self.t.put(fid.to_bytes(8, "big"), _FILE.pack(sn, count, hw + 1), db=self.db["files"])
                return fid, hw
        # A new slot file, created and registered inside this transaction: if it never commits,
        # the file is an orphan that the next creator of this id (or recovery) removes.
        self.c.next_file += 1
        fid = self.c.next_file
        count = max(1, min(self.s.file_nbytes, max(self.c.budget, slot_nbytes)) // slot_nbytes)
        self.s.create_slot_file(fid, slot_nbytes, count)
        _crash("lmdb.slotfile.created")
        self.t.put(fid.to_bytes(8, "big"), _FILE.pack(slot_nbytes, count, 1), db=self.db["files"])
        self.t.put(b"cur" + prefix, fid.to_bytes(8, "big"), db=meta)
        return fid, 0

    def free_slot(self, file_id: int, slot: int) -> None:
        try:
            sn = self.file_record(file_id)[0]
        except CorruptStoreError:
            return  # the file is gone (repair): nothing to free
        self.t.put(_free_key(sn, file_id, slot), b"", db=self.db["free"])

    # -- reservations ----------------------------------------------------------------------------
    def flight(self, key: Key) -> _Flight | None:
        raw = self.t.get(key, db=self.db["flights"])
        return None if raw is None else _Flight.unpack(raw)

    def drop_flight(self, key: Key, fl: _Flight) -> None:
        """Forget a reservation: its space, its slot and the hold on its parent."""
        self.t.delete(key, db=self.db["flights"])
        self.c.used -= fl.cost
        if fl.file_id:
            self.free_slot(fl.file_id, fl.slot)
        if fl.parent is not None:
            try:
                pe = self.get(fl.parent)
            except _BadRecord:
                pe = None
            if pe is not None and pe.gen == fl.parent_gen:
                self.unhold(pe)
            else:
                self.unhold_gone(fl.parent, fl.parent_gen)

    def unhold_gone(self, key: Key, gen: int) -> None:
        """A holder of an entry that was dropped lets go: free its slot after the last one."""
        lk = key + gen.to_bytes(8, "big")
        raw = self.t.get(lk, db=self.db["limbo"])
        if raw is None or len(raw) != _LIMBO.size:
            return
        fid, slot, left = _LIMBO.unpack(raw)
        if left <= 1:
            self.t.delete(lk, db=self.db["limbo"])
            self.free_slot(fid, slot)
        else:
            self.t.put(lk, _LIMBO.pack(fid, slot, left - 1), db=self.db["limbo"])

    def release_lease(self, lease_id: bytes) -> int:
        raw = self.t.get(lease_id, db=self.db["leases"])
        if raw is None:
            return 0
        self.t.delete(lease_id, db=self.db["leases"])
        try:
            _, _, held = _unpack_lease(raw)
        except _BadRecord:
            return 1
        for k, gen in held:
            try:
                e = self.get(k)
            except _BadRecord:
                continue
            if e is not None and e.gen == gen and e.hold > 0:
                self.unhold(e)
            else:
                self.unhold_gone(k, gen)
        return 1


# --------------------------------------------------------------------------------------------
# The provider
# --------------------------------------------------------------------------------------------


class _LmdbReservation(Reservation):
    __slots__ = ("buf", "file", "file_id", "gen", "hashed", "hasher", "slot")

    def __init__(self, provider: LmdbProvider, key: Key, parent: Key | None, nbytes: int, salt_tag: str,
                 gen: int, file_id: int, slot: int, file: SlotFile | None) -> None:
        super().__init__(provider, key, parent, nbytes, salt_tag)
        self.gen = gen
        self.file_id = file_id
        self.slot = slot
        self.file = file
        self.buf = bytearray(nbytes) if file is None else None
        # Writes in order (the common case: one write of the whole page) are hashed as they go,
        # so the seal need not read the slot back; any other pattern falls back to a read-back.
        self.hasher: Any = xxhash.xxh3_64() if file is not None else None
        self.hashed = 0

    def regions(self) -> Sequence[HostRegion]:
        """The writable slot (mapped file pages) or inline buffer, for a copy engine."""
        self.check_open(self._provider)
        if self.file is not None:
            self.hasher = None  # bytes may now arrive by DMA: the seal hashes the slot itself
            view = self.file.data(self.slot, self.nbytes)
        else:
            assert self.buf is not None
            view = memoryview(self.buf)
        return [HostRegion(0, view, _address(view), False)]


def _slot_checksum(sf: SlotFile, slot: int, nbytes: int) -> int:
    """XXH3-64 of a slot's bytes read with ``pread`` in 1 MiB chunks (hashing through the
    mapping would page-fault every 4 KiB of a slot written with ``pwrite``)."""
    h = xxhash.xxh3_64()
    buf = bytearray(min(nbytes, 1 << 20))
    view = memoryview(buf)
    base = sf.data_offset_of(slot)
    done = 0
    try:
        while done < nbytes:
            n = os.preadv(sf.fd, [view[: min(len(buf), nbytes - done)]], base + done)
            if n <= 0:
                raise StorageIOError(f"{sf.path}: short read of slot {slot}")
            h.update(view[:n])
            done += n
    except OSError as exc:
        raise _fsutil.io_error(exc, f"reading slot {slot} of {sf.path}") from exc
    return int(h.intdigest())


def _address(view: memoryview) -> int:
    if view.nbytes == 0:
        return 0
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


class LmdbProvider(Provider):
    """Pages in slot files (or inline in LMDB), the index in LMDB; many processes at once.

    Parameters
    ----------
    path:
        The store directory (created 0700 if missing).
    budget_bytes:
        The store's byte budget; ``None`` keeps the stored one (1 GiB for a new store).  It is a
        property of the store: every process enforces the latest one set.
    durability:
        ``"sync"`` (a returned ``seal`` survives power loss; seals of concurrent threads share
        one sync), ``"process"`` (survives kill -9; the default) or ``"none"``.
    inline_max:
        Entries of at most this many bytes live inside LMDB instead of a slot file.
    map_size, map_max:
        The initial LMDB map size and the limit it grows to on ``MapFullError`` (past it:
        ``NoSpaceError``).
    file_nbytes:
        Target size of one slot file (each preallocated with ``posix_fallocate``).
    lease_ttl:
        Seconds after which a lease of a *live* process stops protecting its entries (leases of
        dead processes are reclaimed at once).  Reservations never expire while their owner lives.
    readonly:
        Never modify the store (``hostkv info/ls/verify``): no reservations, evictions, leases,
        anchors, LRU refreshes or repairs; a corrupt page reads as a miss and is counted, not
        dropped.  Writes raise ``InvalidArgumentError``.
    """

    name = "lmdb"
    persistent = True
    multiprocess = True

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        budget_bytes: int | None = None,
        durability: str = "process",
        inline_max: int = _DEFAULT_INLINE_MAX,
        map_size: int = _DEFAULT_MAP_SIZE,
        map_max: int = _DEFAULT_MAP_MAX,
        file_nbytes: int = _DEFAULT_FILE_NBYTES,
        lease_ttl: float = _DEFAULT_LEASE_TTL,
        readonly: bool = False,
    ) -> None:
        super().__init__()
        self._closed = True  # until fully open (close() of a half-built instance is a no-op)
        if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
            raise InvalidArgumentError(f"path must be a non-empty path, got {path!r}")
        if budget_bytes is not None and (type(budget_bytes) is not int or budget_bytes <= 0):
            raise InvalidArgumentError(f"budget must be a positive int, got {budget_bytes!r}")
        if durability not in DURABILITY_MODES:
            raise InvalidArgumentError(f"durability must be one of {', '.join(DURABILITY_MODES)}, got {durability!r}")
        for name, value in (("inline_max", inline_max), ("map_size", map_size), ("map_max", map_max),
                            ("file_nbytes", file_nbytes)):
            if type(value) is not int or value < 0:
                raise InvalidArgumentError(f"{name} must be a non-negative int, got {value!r}")
        if map_size < 1 << 20 or map_max < map_size:
            raise InvalidArgumentError(f"need 1 MiB <= map_size <= map_max, got {map_size} and {map_max}")
        if file_nbytes < _PAGE:
            raise InvalidArgumentError(f"file_nbytes must be at least {_PAGE}")
        if not isinstance(lease_ttl, (int, float)) or lease_ttl <= 0:
            raise InvalidArgumentError(f"lease_ttl must be a positive number of seconds, got {lease_ttl!r}")
        self._path = os.path.abspath(os.fspath(path))
        self._durability = durability
        self._inline_max = inline_max
        self._lease_ttl = float(lease_ttl)
        self._readonly = bool(readonly)
        self._lock = threading.Lock()
        self._open_res: dict[int, _LmdbReservation] = {}
        self._leases: dict[bytes, Lease] = {}
        self._lease_seq = 0
        self._counters: dict[str, int] = dict.fromkeys(
            ("hits", "misses", "seals", "aborts", "dedup", "checksum_failures", "bytes_written", "bytes_read"), 0)
        if readonly and budget_bytes is not None:
            raise InvalidArgumentError("a read-only open cannot set the budget", hint="drop budget= or readonly=")
        self._s = _Shared.acquire(self._path, durability=durability, map_size=map_size, map_max=map_max,
                                  file_nbytes=file_nbytes, budget=budget_bytes, readonly=self._readonly)
        self._owner = _OWNER.pack(os.getpid(), _start_time(os.getpid()), int.from_bytes(os.urandom(8), "little"))
        self._budget = self._read_counters().budget
        self._closed = False

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def from_url(cls, location: str, options: Mapping[str, str]) -> LmdbProvider:
        opts = Options("lmdb", options)
        budget = opts.text("budget")
        durability = opts.choice("durability", "process", DURABILITY_MODES)
        inline_max = opts.size("inline_max", _DEFAULT_INLINE_MAX)
        map_size = opts.size("map_size", _DEFAULT_MAP_SIZE)
        map_max = opts.size("map_max", _DEFAULT_MAP_MAX)
        file_nbytes = opts.size("file_size", _DEFAULT_FILE_NBYTES)
        lease_ttl = opts.number("lease_ttl", _DEFAULT_LEASE_TTL)
        readonly = opts.boolean("readonly", False)
        opts.finish()
        if not location or location == "/":
            raise InvalidArgumentError("lmdb:// needs a directory path", hint="use lmdb:///var/cache/kv?budget=64GiB")
        return cls(location, budget_bytes=None if budget is None else parse_size(budget), durability=durability,
                   inline_max=inline_max, map_size=map_size, map_max=map_max, file_nbytes=file_nbytes,
                   lease_ttl=lease_ttl, readonly=readonly)

    @property
    def path(self) -> str:
        return self._path

    @property
    def durability(self) -> str:
        return self._durability

    @property
    def readonly(self) -> bool:
        return self._readonly

    def _writable(self, what: str) -> None:
        if self._readonly:
            raise InvalidArgumentError(f"{what}: this lmdb store is open read-only (readonly=true)",
                                       hint="open it without readonly=true to modify it")

    @property
    def budget_bytes(self) -> int:
        return self._budget

    def _read_counters(self) -> _Counters:
        with self._s.read() as txn:
            return _Counters(txn.get(b"counters", db=self._s.dbs["meta"]))

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counters[name] += n

    # -- lookups -----------------------------------------------------------------------------
    def present(self, keys: Sequence[bytes]) -> list[bool]:
        ks = self._keys(keys)
        self._check_usable()
        if not ks:
            return []
        with self._s.read() as txn:
            return self._hits(txn, ks)

    def _hits(self, txn: Any, ks: Sequence[Key]) -> list[bool]:
        """Presence of ``ks`` in ``txn``'s snapshot, through a per-process presence cache.

        Entries disappear only in transactions that bump the ``removals`` counter.  So a key
        seen present at removal epoch *e* is still present in any snapshot whose epoch is *e*,
        in every process: the cache is emptied whenever the epoch moved.  Misses go to LMDB
        (``Cursor.set_key``: no value copy, one C call per key).
        """
        cache, epoch = self._cache(txn)
        hits = list(map(cache.__contains__, ks))
        if all(hits):
            return hits
        missing = [i for i, h in enumerate(hits) if not h]
        found = list(map(txn.cursor(db=self._s.dbs["entries"]).set_key, [ks[i] for i in missing]))
        new = []
        for i, f in zip(missing, found, strict=True):
            if f:
                hits[i] = True
                new.append(ks[i])
        self._cache_add(new, epoch)
        return hits

    def _cache(self, txn: Any) -> tuple[set[bytes], int]:
        s = self._s
        epoch = _Counters(txn.get(b"counters", db=s.dbs["meta"])).removals
        with s.cache_lock:
            if s.present_epoch != epoch:
                s.present_cache = set()
                s.present_epoch = epoch
            return s.present_cache, epoch

    def _cache_add(self, new: Sequence[bytes], epoch: int) -> None:
        if not new:
            return
        s = self._s
        with s.cache_lock:
            if s.present_epoch == epoch:  # not invalidated by a newer snapshot meanwhile
                if len(s.present_cache) + len(new) > _PRESENT_CACHE_MAX:
                    s.present_cache = set()
                s.present_cache.update(new)

    def _prefix_len(self, txn: Any, ks: Sequence[Key]) -> int:
        """Leading keys of ``ks`` present: the cached prefix at C speed, then LMDB up to the
        first miss (a chain's unstored tail costs one lookup, not one per key)."""
        cache, epoch = self._cache(txn)
        hits = list(map(cache.__contains__, ks))
        try:
            n = hits.index(False)
        except ValueError:
            return len(ks)
        seek = txn.cursor(db=self._s.dbs["entries"]).set_key
        new = []
        while n < len(ks) and (hits[n] or seek(ks[n])):
            if not hits[n]:
                new.append(ks[n])
            n += 1
        self._cache_add(new, epoch)
        return n

    def longest_prefix(self, keys: Sequence[bytes]) -> int:
        ks = self._keys(keys)
        self._check_usable()
        if not ks:
            return 0
        with self._s.read() as txn:
            return self._prefix_len(txn, ks)

    def in_flight(self, key: bytes) -> bool:
        k = self._key(key)
        self._check_usable()
        with self._s.read() as txn:
            raw = txn.get(k, db=self._s.dbs["flights"])
        # A dead writer's reservation is not in flight: nobody will seal it (reclaimed lazily).
        return raw is not None and len(raw) >= 20 and _alive(bytes(raw[:20]))

    def entry(self, key: bytes) -> EntryInfo | None:
        k = self._key(key)
        self._check_usable()
        with self._s.read() as txn:
            raw = txn.get(k, db=self._s.dbs["entries"])
            if raw is None:
                return None
            try:
                e = _Entry.unpack(k, raw)
            except _BadRecord:
                return None
            anchors = self._anchor_sizes(txn, k)
        return e.info(anchors)

    def _anchor_sizes(self, txn: Any, key: Key) -> dict[str, int]:
        out: dict[str, int] = {}
        cur = txn.cursor(db=self._s.dbs["anchors"])
        if cur.set_range(key):
            for k, v in cur:
                if k[:KEY_NBYTES] != key:
                    break
                out[bytes(k[KEY_NBYTES:]).decode("ascii", "replace")] = max(0, len(v) - 8)
        return out

    def iter_entries(self) -> Iterator[EntryInfo]:
        """Every sealed entry, read in batches of short transactions (order: by key)."""
        self._check_usable()
        return self._iter_entries()

    def _iter_entries(self) -> Iterator[EntryInfo]:
        after: bytes | None = None
        while True:
            self._check_usable()
            batch: list[EntryInfo] = []
            with self._s.read() as txn:
                cur = txn.cursor(db=self._s.dbs["entries"])
                ok = cur.set_range(after) if after is not None else cur.first()
                while ok and len(batch) < 1024:
                    k = bytes(cur.key())
                    if k != after:
                        with contextlib.suppress(_BadRecord):
                            batch.append(_Entry.unpack(k, cur.value()).info(self._anchor_sizes(txn, Key(k))))
                        after = k
                    ok = cur.next()
                more = ok
            yield from batch
            if not more:
                return

    # -- writes ------------------------------------------------------------------------------
    def reserve(self, key: bytes, parent: bytes | None, nbytes: int, *, salt_tag: str = "") -> Reservation | None:
        k, p, nbytes = self._reserve_args(key, parent, nbytes, salt_tag, tag_max=_TAG_MAX)
        self._check_usable()
        self._writable("reserve")
        inline = nbytes <= self._inline_max
        slot_nbytes = _slot_nbytes(nbytes)
        owner = self._owner
        ttl = self._lease_ttl

        def op(tx: _Tx) -> tuple[int, int, int] | None:
            if tx.t.get(k, db=tx.db["entries"]) is not None:
                return None
            fl = tx.flight(k)
            if fl is not None:
                if _alive(fl.owner):
                    raise InFlightError(f"key {k.hex()[:16]} is being written by another writer", key=k)
                tx.drop_flight(k, fl)  # its writer died: the key is free again
            pe = None
            if p is not None:
                pe = tx.get_or_drop(p)
                if pe is None:
                    raise UnknownKeyError(f"parent {p.hex()[:16]} is not stored")
            if nbytes > tx.c.budget:
                raise CapacityError(f"{nbytes} bytes exceed the whole budget of {tx.c.budget}")
            if pe is not None:
                tx.hold(pe)  # first, so that making room cannot evict the parent
            tx.make_room(nbytes)
            fid, slot = (0, 0) if inline else tx.alloc_slot(slot_nbytes)
            tx.c.gen += 1
            now = time.time()
            tx.t.put(k, _Flight(owner, p, pe.gen if pe is not None else 0, nbytes, nbytes, tx.c.gen, fid, slot,
                                now, now + ttl).pack(), db=tx.db["flights"])
            tx.c.used += nbytes
            return tx.c.gen, fid, slot

        try:
            got = self._s.submit(op)
        except CapacityError:
            if not self._s.reclaim_dead():
                raise
            got = self._s.submit(op)  # a dead process's leases or reservations were in the way
        if got is None:
            self._count("dedup")
            return None
        gen, fid, slot = got
        _crash("lmdb.reserve.after_commit")
        sf = None
        if fid:
            try:
                sf = self._s.slot_file(fid)
                # Invalidate the slot's header before any byte of it changes, so neither a stale
                # record nor a reader in another process can accept a half-overwritten slot.
                sf.begin_write(slot, 1)
            except BaseException:
                self._s.submit(self._abort_op(k, gen), frees=True)
                raise
        res = _LmdbReservation(self, k, p, nbytes, salt_tag, gen, fid, slot, sf)
        with self._lock:
            self._open_res[id(res)] = res
        return res

    def _own(self, reservation: Reservation) -> _LmdbReservation:
        return self._own_reservation(reservation, _LmdbReservation)

    def write(self, reservation: Reservation, offset: int, data: object) -> None:
        view = readable_bytes(data)
        self._check_usable()
        res = self._own(reservation)
        span = res.check_write(offset, view.nbytes)
        # No lock: the slot (or buffer) is private to its reservation until the seal.
        if res.file is not None:
            res.file.write(res.slot, res.nbytes, span.offset, view)
            if res.hasher is not None and span.offset == res.hashed:
                res.hasher.update(view)
                res.hashed += span.nbytes
            elif span.nbytes:
                res.hasher = None  # out of order (or rewritten): hash the slot at seal
        else:
            assert res.buf is not None
            res.buf[span.offset : span.end] = view
        res.mark_written(span)
        self._count("bytes_written", span.nbytes)

    def seal(self, reservation: Reservation) -> None:
        self._check_usable()
        res = self._own(reservation)
        res.check_complete()
        k, p, gen, nbytes, tag = res.key, res.parent, res.gen, res.nbytes, res.salt_tag
        sync_files: tuple[SlotFile, ...] = ()
        if res.file is not None:
            if res.hasher is not None and res.hashed == nbytes:
                digest = int(res.hasher.intdigest())
            else:
                digest = _slot_checksum(res.file, res.slot, nbytes)
            # Data first, then the header that vouches for it, then (sync) the fsync, then the
            # transaction that points at the slot.
            res.file.write_header(res.slot, key=k, parent=p, generation=gen, nbytes=nbytes, checksum=digest)
            sync_files = (res.file,)
            blob = None
            _crash("lmdb.seal.after_header")
        else:
            assert res.buf is not None
            blob = bytes(res.buf)
            digest = checksum(blob)
        fid, slot = res.file_id, res.slot

        def op(tx: _Tx) -> _Raise | None:
            fl = tx.flight(k)
            if fl is None or fl.gen != gen:
                raise ReservationError(f"the reservation for {k.hex()[:16]} no longer exists",
                                       hint="it was reclaimed; reserve the page again")
            tx.t.delete(k, db=tx.db["flights"])
            pe = None
            if fl.parent is not None:
                pe = tx.get_or_drop(fl.parent)
                if pe is None or pe.gen != fl.parent_gen:
                    tx.c.used -= fl.cost
                    tx.unhold_gone(fl.parent, fl.parent_gen)
                    if fid:
                        tx.free_slot(fid, slot)
                    return _Raise(UnknownKeyError(
                        f"parent {fl.parent.hex()[:16]} was dropped before the seal",
                        hint="save the chain again from its first missing page"))
                pe.children += 1
                pe.hold = max(0, pe.hold - 1)
                tx.put(pe)  # not a leaf any more: it stays out of the LRU list
            e = _Entry(k, fl.parent, nbytes, fl.cost, digest, time.time(), tx.next_tick(), gen, fid, slot, tag)
            tx.insert(e)
            if blob is not None:
                tx.t.put(k, blob, db=tx.db["pages"])
            tx.c.sealed += fl.cost
            return None

        try:
            self._s.submit(op, durable=True, sync_files=sync_files)
        except (ReservationError, UnknownKeyError):
            self._finish(res, "aborted")
            raise
        except StorageIOError:
            # R7: a failed sync fails the seal for good; give the space back (best effort).
            with contextlib.suppress(HostKVError):
                self._s.submit(self._abort_op(k, gen), frees=True)
            self._finish(res, "aborted")
            raise
        self._finish(res, "sealed")
        self._count("seals")

    def _finish(self, res: _LmdbReservation, state: str) -> None:
        res._finish(state)
        res.file = None
        with self._lock:
            self._open_res.pop(id(res), None)

    @staticmethod
    def _abort_op(key: Key, gen: int) -> Callable[[_Tx], None]:
        def op(tx: _Tx) -> None:
            fl = tx.flight(key)
            if fl is not None and fl.gen == gen:
                tx.drop_flight(key, fl)

        return op

    def abort(self, reservation: Reservation) -> None:
        if not isinstance(reservation, _LmdbReservation) or reservation.provider is not self:
            raise ReservationError("not a reservation of this provider")
        self._check_usable()
        if reservation.state != "open":
            return  # aborting twice (or after seal) is a no-op
        self._s.submit(self._abort_op(reservation.key, reservation.gen), frees=True)
        self._finish(reservation, "aborted")
        self._count("aborts")

    # -- reads -------------------------------------------------------------------------------
    def read(self, key: bytes, out: object, span: ByteSpan | None = None) -> bool:
        k = self._key(key)
        if span is not None and not isinstance(span, ByteSpan):
            raise InvalidArgumentError("span must be a ByteSpan")
        self._check_usable()
        ok = False
        e: _Entry | None = None
        with self._s.read(buffers=True) as txn:
            raw = txn.get(k, db=self._s.dbs["entries"])
            if raw is None:
                self._count("misses")
                return False
            with contextlib.suppress(_BadRecord):
                e = _Entry.unpack(k, raw)
            if e is not None:
                span = ByteSpan.whole(e.nbytes) if span is None else span.validate(e.nbytes)
                dst = writable_buffer(out, span.nbytes)
                if e.file_id == 0:
                    blob = txn.get(k, db=self._s.dbs["pages"])
                    if blob is not None and len(blob) == e.nbytes and checksum(blob) == e.checksum:
                        dst[:] = blob[span.offset : span.end]
                        ok = True
        if e is not None and e.file_id and span is not None:
            try:
                result = self._s.slot_file(e.file_id).read_into(
                    e.slot, dst, key=k, generation=e.gen, nbytes=e.nbytes, checksum=e.checksum, offset=span.offset)
                ok = result == ReadResult.OK
            except (StorageIOError, CorruptStoreError):
                ok = False  # a file compacted away meanwhile, or damaged: confirmed below
        if not ok or span is None:
            if self._confirm_corrupt(k, None if e is None else e.gen):
                self._count("checksum_failures")
            self._count("misses")
            return False
        if not self._readonly:
            self._s.touch(k)
        with self._lock:
            self._counters["hits"] += 1
            self._counters["bytes_read"] += span.nbytes
        return True

    def prefetch(self, keys: Sequence[bytes]) -> None:
        """Start reading the slot-file data of the stored ``keys`` into the page cache (as the
        mmap provider does: ``POSIX_FADV_WILLNEED`` per run of adjacent slots); entries stored
        inline in LMDB and keys not stored are skipped."""
        ks = self._keys(keys)
        self._check_usable()
        found: list[tuple[int, int, int]] = []
        with self._s.read(buffers=True) as txn:
            db = self._s.dbs["entries"]
            for k in ks:
                raw = txn.get(k, db=db)
                if raw is None:
                    continue
                with contextlib.suppress(_BadRecord):
                    e = _Entry.unpack(k, raw)
                    if e.file_id:
                        found.append((e.file_id, e.slot, e.nbytes))
        entries = []
        for fid, slot, nbytes in found:
            with contextlib.suppress(HostKVError):
                entries.append((self._s.slot_file(fid), slot, nbytes))
        prefetch_runs(entries)

    def _check_entry_bytes(self, tx: _Tx, e: _Entry) -> bool:
        if e.file_id == 0:
            blob = tx.t.get(e.key, db=tx.db["pages"])
            return blob is not None and len(blob) == e.nbytes and checksum(blob) == e.checksum
        try:
            sf = self._s.slot_file(e.file_id)
        except HostKVError:
            return False
        return bool(sf.check(e.slot, key=e.key, generation=e.gen, nbytes=e.nbytes, checksum=e.checksum)
                    == ReadResult.OK)

    def _confirm_corrupt(self, key: Key, gen: int | None) -> bool:
        """Re-check a failed read inside a write transaction, where no slot of a live entry can
        change; drop the entry with its subtree only if it still fails.  ``False``: the entry was
        replaced or evicted meanwhile (a plain miss)."""

        if self._readonly:
            return self._still_bad(key, gen)

        def op(tx: _Tx) -> bool:
            try:
                e = tx.get(key)
            except _BadRecord:
                tx.drop(key)
                tx.c.checksum_failures += 1
                return True
            if e is None or (gen is not None and e.gen != gen):
                return False
            if self._check_entry_bytes(tx, e):
                return False
            tx.drop(key)
            tx.c.checksum_failures += 1
            return True

        return bool(self._s.submit(op, frees=True))

    def view(self, lease: Lease, key: bytes) -> Sequence[HostRegion] | None:
        """Read-only host regions of a leased entry, valid while the lease is held.

        Slot entries are views of the mapped slot file (zero copy): the lease keeps every process
        from evicting the entry, so its slot cannot be reused, and compaction refuses to run while
        leases exist.  The bytes are checksum-verified once, here.  Inline entries are returned as
        a private copy.
        """
        k = self._key(key)
        if not isinstance(lease, Lease) or lease.released or lease.token is None or lease._provider is not self:
            raise InvalidArgumentError("view() needs an unreleased lease of this provider")
        self._check_usable()
        if k not in lease.keys:
            return None
        with self._s.read(buffers=True) as txn:
            raw = txn.get(k, db=self._s.dbs["entries"])
            if raw is None:
                return None
            try:
                e = _Entry.unpack(k, raw)
            except _BadRecord:
                e = None
            blob = None
            if e is not None and e.file_id == 0:
                got = txn.get(k, db=self._s.dbs["pages"])
                blob = None if got is None else bytes(got)
        if e is not None and e.file_id == 0:
            if blob is not None and len(blob) == e.nbytes and checksum(blob) == e.checksum:
                view = memoryview(bytearray(blob))
                return [HostRegion(0, view.toreadonly(), _address(view), False)]
        elif e is not None:
            sf = self._s.slot_file(e.file_id)
            if sf.check(e.slot, key=k, generation=e.gen, nbytes=e.nbytes, checksum=e.checksum) == ReadResult.OK:
                view = sf.data(e.slot, e.nbytes).toreadonly()
                return [HostRegion(0, view, _address(view), False)]
        if self._confirm_corrupt(k, None if e is None else e.gen):
            self._count("checksum_failures")
        return None

    # -- eviction ----------------------------------------------------------------------------
    def evict(self, keys: Sequence[bytes] | None = None, *, nbytes: int = 0) -> EvictReport:
        if (keys is None) == (not nbytes):
            raise InvalidArgumentError("give exactly one of keys or nbytes")
        if type(nbytes) is not int or nbytes < 0:
            raise InvalidArgumentError(f"nbytes must be a non-negative int, got {nbytes!r}")
        ks = self._keys(keys) if keys is not None else None
        self._check_usable()
        self._writable("evict")

        def op(tx: _Tx) -> EvictReport:
            if ks is not None:
                return EvictReport(*tx.evict_keys(ks))
            removed, freed = tx.evict_lru(nbytes)
            return EvictReport(removed, freed, 0)

        return self._s.submit(op, frees=True)  # type: ignore[no-any-return]

    # -- anchors -----------------------------------------------------------------------------
    def put_anchor(self, key: bytes, name: str, data: object) -> None:
        k = self._key(key)
        check_anchor_name(name)
        blob = bytes(readable_bytes(data))
        self._check_usable()
        self._writable("put_anchor")
        akey = k + name.encode("ascii")
        record = checksum(blob).to_bytes(8, "little") + blob

        def op(tx: _Tx) -> None:
            e = tx.get_or_drop(k)
            if e is None:
                raise UnknownKeyError(f"entry {k.hex()[:16]} is not stored", hint="seal the page before its anchors")
            old = tx.t.get(akey, db=tx.db["anchors"])
            delta = len(blob) - (max(0, len(old) - 8) if old is not None else 0)
            if delta > 0:
                if e.cost + delta > tx.c.budget:
                    raise CapacityError(f"anchor of {len(blob)} bytes does not fit the budget of {tx.c.budget}")
                tx.hold(e)
                tx.make_room(delta)
                e = tx.get(k)
                assert e is not None  # held: make_room cannot evict it
                tx.unhold(e)
            e.cost += delta
            tx.put(e)
            tx.c.used += delta
            tx.c.sealed += delta
            tx.t.put(akey, record, db=tx.db["anchors"])

        self._s.submit(op)

    def get_anchor(self, key: bytes, name: str) -> bytes | None:
        k = self._key(key)
        check_anchor_name(name)
        self._check_usable()
        akey = k + name.encode("ascii")
        with self._s.read() as txn:
            raw = txn.get(akey, db=self._s.dbs["anchors"])
        if raw is None:
            return None
        blob = raw[8:]
        if len(raw) >= 8 and checksum(blob) == int.from_bytes(raw[:8], "little"):
            return bytes(blob)

        def op(tx: _Tx) -> bool:  # confirm and drop the damaged anchor (its entry stays)
            cur = tx.t.get(akey, db=tx.db["anchors"])
            if cur is None or cur != raw:
                return False
            tx.t.delete(akey, db=tx.db["anchors"])
            e = tx.get_or_drop(k)
            if e is not None:
                e.cost -= max(0, len(raw) - 8)
                tx.put(e)
                tx.c.used -= max(0, len(raw) - 8)
                tx.c.sealed -= max(0, len(raw) - 8)
            tx.c.checksum_failures += 1
            return True

        if self._readonly or self._s.submit(op, frees=True):
            self._count("checksum_failures")
        return None

    def list_anchors(self, key: bytes) -> dict[str, int]:
        k = self._key(key)
        self._check_usable()
        with self._s.read() as txn:
            return self._anchor_sizes(txn, k)

    def deepest_anchor(self, keys: Sequence[bytes], name: str) -> int:
        ks = self._keys(keys)
        check_anchor_name(name)
        self._check_usable()
        if not ks:
            return 0
        suffix = name.encode("ascii")
        with self._s.read() as txn:
            n = self._prefix_len(txn, ks)
            adb = self._s.dbs["anchors"]
            for i in range(n - 1, -1, -1):
                if txn.get(ks[i] + suffix, db=adb) is not None:
                    return i + 1
        return 0

    # -- leases ------------------------------------------------------------------------------
    def lease(self, keys: Sequence[bytes]) -> Lease:
        ks = self._keys(keys)
        self._check_usable()
        self._writable("lease")
        with self._lock:
            self._lease_seq += 1
            lease_id = self._owner + self._lease_seq.to_bytes(8, "big")
        owner, ttl = self._owner, self._lease_ttl

        def op(tx: _Tx) -> list[bool]:
            present: list[bool] = []
            held: list[tuple[bytes, int]] = []
            now = time.time()
            for k in ks:
                e = tx.get_or_drop(k)
                if e is not None:
                    tx.hold(e)
                    tx.touch(e, now)
                    held.append((k, e.gen))
                present.append(e is not None)
            if held:
                tx.t.put(lease_id, _pack_lease(owner, now + ttl, held), db=tx.db["leases"])
            return present

        present = self._s.submit(op)
        lease = Lease(self, ks, present, token=lease_id)
        with self._lock:
            self._leases[lease_id] = lease
        return lease

    def _release_lease(self, lease: Lease) -> None:
        if self._closed or os.getpid() != self._pid:
            return
        lease_id = lease.token
        with self._lock:
            if isinstance(lease_id, bytes):
                self._leases.pop(lease_id, None)
        if isinstance(lease_id, bytes) and any(lease.present):
            if self._s.leader_owner == threading.get_ident():
                # released from a finalizer while this thread runs a batch: cannot wait for it
                self._s.submit_later(lambda tx: tx.release_lease(lease_id))
            else:
                self._s.submit(lambda tx: tx.release_lease(lease_id), frees=True)

    # -- verification and compaction -----------------------------------------------------------
    def verify(self, *, repair: bool = False, progress: Progress | None = None) -> VerifyReport:
        """Check every entry's bytes against its checksum, and the index's own consistency.

        Reports first; with ``repair`` it then drops corrupt entries with their subtrees, frees
        unreferenced slots and rebuilds the counters.  Never changes anything without ``repair``.
        """
        self._check_usable()
        if repair:
            self._writable("verify(repair=True)")
        report = VerifyReport()
        s = self._s
        with s.read() as txn:
            keys = [Key(bytes(k)) for k in txn.cursor(db=s.dbs["entries"]).iternext(values=False)]
        total = len(keys)
        for i, k in enumerate(keys):
            with s.read(buffers=True) as txn:
                raw = txn.get(k, db=s.dbs["entries"])
                if raw is None:
                    e = None
                    bad = False
                else:
                    try:
                        e = _Entry.unpack(k, raw)
                        bad = False
                    except _BadRecord:
                        e, bad = None, True
                    if e is not None and e.file_id == 0:
                        blob = txn.get(k, db=s.dbs["pages"])
                        bad = blob is None or len(blob) != e.nbytes or checksum(blob) != e.checksum
            if e is not None and e.file_id:
                try:
                    res = s.slot_file(e.file_id).check(e.slot, key=k, generation=e.gen, nbytes=e.nbytes,
                                                       checksum=e.checksum)
                    bad = res != ReadResult.OK
                except HostKVError:
                    bad = True
            if raw is not None:
                report.checked += 1
            if bad and self._still_bad(k, None if e is None else e.gen):
                report.corrupt.append(k)
            if progress is not None:
                progress(i + 1, total)
        report.problems.extend(self._index_problems())
        if repair:
            for k in report.corrupt:

                def op(tx: _Tx, k: Key = k) -> int:
                    n = tx.drop(k)
                    tx.c.checksum_failures += 1
                    return n

                report.dropped += int(s.submit(op, frees=True))
            if report.problems:
                s.submit(_repair_index, frees=True)
        return report

    def _still_bad(self, key: Key, gen: int | None) -> bool:
        """Whether ``key``'s bytes are really damaged, without writing: check the bytes, *then*
        check in a fresh read transaction that the entry still exists with the same generation.
        A slot is reused only after the eviction of its entry commits, so if the entry is still
        there afterwards, the slot held it during the check: the failure was corruption."""
        with self._s.read(buffers=True) as txn:
            raw = txn.get(key, db=self._s.dbs["entries"])
            if raw is None:
                return False
            try:
                e = _Entry.unpack(key, raw)
            except _BadRecord:
                return True
            if gen is not None and e.gen != gen:
                return False
            if e.file_id == 0:
                blob = txn.get(key, db=self._s.dbs["pages"])
                return blob is None or len(blob) != e.nbytes or checksum(blob) != e.checksum
        try:
            ok = self._s.slot_file(e.file_id).check(e.slot, key=key, generation=e.gen, nbytes=e.nbytes,
                                                    checksum=e.checksum) == ReadResult.OK
        except HostKVError:
            ok = False
        if ok:
            return False
        with self._s.read() as txn:
            raw = txn.get(key, db=self._s.dbs["entries"])
        try:
            return raw is not None and _Entry.unpack(key, raw).gen == e.gen
        except _BadRecord:
            return True

    def _index_problems(self) -> list[str]:
        """Store-level findings: accounting, tree links, LRU list, slot ownership."""
        s = self._s
        with s.read() as txn:
            return _audit(txn, s.dbs)

    def compact(self, *, progress: Progress | None = None) -> CompactReport:
        """Rewrite the store densely: move slots into the lowest files, delete emptied files,
        then copy the LMDB environment compacted and swap it in (copy-then-swap).

        Needs the store to itself: refuses with ``LockedError`` while another process has it
        open, or while this process holds leases or open reservations on it.  Each step is
        crash-safe: a slot move commits only after the copy is synced; the index swap is an
        atomic rename; leftovers of an interrupted compaction are removed on the next open.
        """
        self._check_usable()
        self._writable("compact")
        s = self._s
        with self._lock:
            if self._open_res or self._leases:
                raise LockedError("compaction needs no open reservations or leases in this provider")
        with _Shared._registry_lock:
            if s.refs > 1:
                raise LockedError(f"{self._path} is open by another provider in this process")
        with s.maintenance():
            s.lock.release()
            try:
                ex = _fsutil.LockFile(os.path.join(self._path, _LOCK_NAME), exclusive=True)
            except LockedError:
                s.lock = s._shared_lock()
                raise LockedError(f"{self._path} is open by another process; compaction needs it alone",
                                  hint="close the other processes (engines, readers) first") from None
            s.lock = ex
            try:
                s.reclaim_dead()
                with s.read() as txn:
                    if txn.stat(s.dbs["flights"])["entries"] or txn.stat(s.dbs["leases"])["entries"]:
                        raise LockedError("compaction needs a store without reservations or leases")
                # with no lease or reservation left, no slot in limbo has a holder any more
                s.submit(_free_limbo, frees=True)
                before = _store_nbytes(s)
                entries = _compact_slots(s, progress)
                _crash("lmdb.compact.after_moves")
                _compact_env(s)
                after = _store_nbytes(s)
            finally:
                s.lock.release()
                s.lock = s._shared_lock()
        return CompactReport(entries, before, after)

    # -- the rest ----------------------------------------------------------------------------
    def stats(self) -> ProviderStats:
        self._check_usable()
        s = self._s
        with s.read() as txn:
            c = _Counters(txn.get(b"counters", db=s.dbs["meta"]))
            entries = txn.stat(s.dbs["entries"])["entries"]
            anchors = txn.stat(s.dbs["anchors"])["entries"]
            flights = txn.stat(s.dbs["flights"])["entries"]
            leased: set[bytes] = set()
            for _, v in txn.cursor(db=s.dbs["leases"]):
                with contextlib.suppress(_BadRecord):
                    leased.update(k for k, _ in _unpack_lease(v)[2])
            info = s.env.info()
        self._budget = c.budget
        with self._lock:
            counters = dict(self._counters)
        return ProviderStats(
            name=self.name,
            entries=entries,
            used_bytes=c.used,
            budget_bytes=c.budget,
            anchors=anchors,
            leased=len(leased),
            in_flight=flights,
            evictions=c.evictions,
            evicted_bytes=c.evicted_bytes,
            # store_wide: the counters kept in the meta db (every process, since creation);
            # the others count this instance's own calls (hostkv stats tells them apart)
            extra={"store_wide": ["evictions", "evicted_bytes", "store_checksum_failures"],
                   "store_checksum_failures": c.checksum_failures, "sealed_bytes": c.sealed,
                   "map_size": int(info["map_size"]), "map_max": s.map_max, "slot_files": c.next_file,
                   "durability": self._durability},
            **counters,
        )

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "path": self._path, "durability": self._durability,
                "inline_max": self._inline_max, "multiprocess": True, "readonly": self._readonly,
                "store_format": STORE_FORMAT,
                "store_version": STORE_VERSION, "last_recovery": dict(self._s.recovery)}

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            open_res = list(self._open_res.values())
            leases = list(self._leases)
            self._open_res.clear()
            self._leases.clear()
        if os.getpid() != self._pid:
            return  # a forked child must not touch the parent's environment
        try:
            if open_res or leases or self._s.touches or self._s.deferred:

                def op(tx: _Tx) -> None:
                    for r in open_res:
                        fl = tx.flight(r.key)
                        if fl is not None and fl.gen == r.gen:
                            tx.drop_flight(r.key, fl)
                    for lid in leases:
                        tx.release_lease(lid)

                self._s.submit(op, frees=True)
            for r in open_res:
                r._finish("aborted")
                r.file = None
        finally:
            self._s.release()


# --------------------------------------------------------------------------------------------
# Audit and repair of the index (verify)
# --------------------------------------------------------------------------------------------



def _pending_slots(txn: Any, dbs: Mapping[str, Any], slots: set[tuple[int, int]]) -> int:
    """Add the slots held by reservations in flight and by limbo entries to ``slots``; return
    the cost the reservations account for."""
    flight_cost = 0
    for _, v in txn.cursor(db=dbs["flights"]):
        with contextlib.suppress(_BadRecord):
            fl = _Flight.unpack(v)
            flight_cost += fl.cost
            if fl.file_id:
                slots.add((fl.file_id, fl.slot))
    for _, v in txn.cursor(db=dbs["limbo"]):
        if len(v) == _LIMBO.size:
            fid, slot, _ = _LIMBO.unpack(v)
            slots.add((fid, slot))
    return flight_cost

def _audit(txn: Any, dbs: Mapping[str, Any]) -> list[str]:
    problems: list[str] = []
    c = _Counters(txn.get(b"counters", db=dbs["meta"]))
    sealed = 0
    children: dict[bytes, int] = {}
    slots: set[tuple[int, int]] = set()
    n_lru_expected = 0
    for k, v in txn.cursor(db=dbs["entries"]):
        try:
            e = _Entry.unpack(k, v)
        except _BadRecord:
            continue  # reported as corrupt by the entry pass
        sealed += e.cost
        if e.parent is not None:
            children[e.parent] = children.get(e.parent, 0) + 1
            if txn.get(e.parent, db=dbs["entries"]) is None:
                problems.append(f"entry {e.key.hex()[:16]} has no parent {e.parent.hex()[:16]}")
        if e.file_id:
            slots.add((e.file_id, e.slot))
        n_lru_expected += e.evictable
    flight_cost = _pending_slots(txn, dbs, slots)
    if sealed != c.sealed or sealed + flight_cost != c.used:
        problems.append(f"accounting: counters say sealed {c.sealed}/used {c.used}, "
                        f"entries sum to {sealed}/{sealed + flight_cost}")
    for k, v in txn.cursor(db=dbs["entries"]):
        with contextlib.suppress(_BadRecord):
            e = _Entry.unpack(k, v)
            if e.children != children.get(bytes(k), 0):
                problems.append(f"entry {e.key.hex()[:16]} counts {e.children} children, has "
                                f"{children.get(bytes(k), 0)}")
    if txn.stat(dbs["lru"])["entries"] != n_lru_expected:
        problems.append(f"LRU list has {txn.stat(dbs['lru'])['entries']} records, {n_lru_expected} evictable leaves")
    free: set[tuple[int, int]] = set()
    for k in txn.cursor(db=dbs["free"]).iternext(values=False):
        free.add((int.from_bytes(k[8:16], "big"), int.from_bytes(k[16:24], "big")))
    both = free & slots
    if both:
        problems.append(f"{len(both)} slots are both free and in use")
    for k, v in txn.cursor(db=dbs["files"]):
        fid = int.from_bytes(k, "big")
        _, _, hw = _FILE.unpack(v)
        lost = sum(1 for s in range(hw) if (fid, s) not in slots and (fid, s) not in free)
        if lost:
            problems.append(f"slot file {fid}: {lost} slots neither used nor free")
    return problems


def _free_limbo(tx: _Tx) -> None:
    for k, v in list(tx.t.cursor(db=tx.db["limbo"])):
        tx.t.delete(k, db=tx.db["limbo"])
        if len(v) == _LIMBO.size:
            fid, slot, _ = _LIMBO.unpack(v)
            tx.free_slot(fid, slot)


def _repair_index(tx: _Tx) -> None:
    """Rebuild counters, child counts, the LRU list and the free list from the entries."""
    t, db = tx.t, tx.db
    entries: list[_Entry] = []
    for k, v in t.cursor(db=db["entries"]):
        with contextlib.suppress(_BadRecord):
            entries.append(_Entry.unpack(k, v))
    present = {e.key for e in entries}
    # entries whose parent is gone cannot stay (prefix closure): drop them with their subtrees
    for e in entries:
        if e.parent is not None and e.parent not in present:
            tx.drop(e.key)
    entries = []
    for k, v in t.cursor(db=db["entries"]):
        with contextlib.suppress(_BadRecord):
            entries.append(_Entry.unpack(k, v))
    counts: dict[bytes, int] = {}
    for e in entries:
        if e.parent is not None:
            counts[e.parent] = counts.get(e.parent, 0) + 1
    t.drop(db["lru"], delete=False)
    t.drop(db["children"], delete=False)
    used_slots: set[tuple[int, int]] = set()
    flight_cost = _pending_slots(t, db, used_slots)
    sealed = 0
    for e in entries:
        e.children = counts.get(e.key, 0)
        tx.put(e)
        if e.evictable:
            t.put(e.lru_key, b"", db=db["lru"])
        if e.parent is not None:
            t.put(e.parent + e.key, b"", db=db["children"])
        if e.file_id:
            used_slots.add((e.file_id, e.slot))
        sealed += e.cost
    t.drop(db["free"], delete=False)
    for k, v in t.cursor(db=db["files"]):
        fid = int.from_bytes(k, "big")
        sn, _, hw = _FILE.unpack(v)
        for s in range(hw):
            if (fid, s) not in used_slots:
                t.put(_free_key(sn, fid, s), b"", db=db["free"])
    tx.c.sealed = sealed
    tx.c.used = sealed + flight_cost


# --------------------------------------------------------------------------------------------
# Compaction
# --------------------------------------------------------------------------------------------


def _store_nbytes(s: _Shared) -> int:
    """Bytes the store occupies: LMDB pages in use (data.mdb is preallocated to the map size)
    plus the slot files."""
    info = s.env.info()
    total = (int(info["last_pgno"]) + 1) * int(s.env.stat()["psize"])
    with contextlib.suppress(OSError):
        for name in os.listdir(s.slot_dir):
            with contextlib.suppress(OSError):
                st = os.lstat(os.path.join(s.slot_dir, name))
                if stat.S_ISREG(st.st_mode):
                    total += st.st_size
    return total


def _compact_slots(s: _Shared, progress: Progress | None) -> int:
    """Move every slot entry into the lowest-numbered files of its size class and delete the
    files left empty.  One move = copy, sync the destination, commit the new location."""
    with s.read() as txn:
        files = {int.from_bytes(k, "big"): _FILE.unpack(v) for k, v in txn.cursor(db=s.dbs["files"])}
        located: list[tuple[int, int, Key]] = []
        n_entries = txn.stat(s.dbs["entries"])["entries"]
        for k, v in txn.cursor(db=s.dbs["entries"]):
            with contextlib.suppress(_BadRecord):
                e = _Entry.unpack(k, v)
                if e.file_id:
                    located.append((e.file_id, e.slot, e.key))
    by_class: dict[int, list[int]] = {}
    for fid, (sn, _, _) in sorted(files.items()):
        by_class.setdefault(sn, []).append(fid)
    live: dict[int, list[tuple[int, int, Key]]] = {}
    for fid, slot, key in located:
        live.setdefault(files[fid][0], []).append((fid, slot, key))
    done = 0
    total = len(located)
    keep_files: set[int] = set()
    for sn, fids in by_class.items():
        items = live.get(sn, [])
        # the smallest prefix of files (by id) that can hold every live entry of this class
        need, cap, keep = len(items), 0, []
        for fid in fids:
            if cap >= need:
                break
            keep.append(fid)
            cap += files[fid][1]
        keep_files.update(keep)
        targets = [(fid, slot) for fid in keep for slot in range(files[fid][1])]
        occupied = {(fid, slot) for fid, slot, _ in items}
        free_targets = [t for t in targets if t not in occupied]
        movers = [it for it in items if it[0] not in keep]
        pairs = list(zip(movers, free_targets, strict=False))  # targets >= movers by construction
        for lo in range(0, len(pairs), 256):
            chunk = pairs[lo : lo + 256]
            _move_slots(s, chunk)
            done += len(chunk)
            if progress is not None:
                progress(done, total)
        # the kept files: high-water marks at capacity, every unoccupied slot free
        def finish(tx: _Tx, sn: int = sn, keep: list[int] = keep, fids: list[int] = fids) -> None:
            t, db = tx.t, tx.db
            prefix = sn.to_bytes(8, "big")
            cur = t.cursor(db=db["free"])
            while cur.set_range(prefix) and bytes(cur.key())[:8] == prefix:
                cur.delete()
            used: set[tuple[int, int]] = set()
            for k, v in t.cursor(db=db["entries"]):
                with contextlib.suppress(_BadRecord):
                    e = _Entry.unpack(k, v)
                    if e.file_id in keep:
                        used.add((e.file_id, e.slot))
            for fid in keep:
                _, count, _ = files[fid]
                t.put(fid.to_bytes(8, "big"), _FILE.pack(sn, count, count), db=db["files"])
                for slot in range(count):
                    if (fid, slot) not in used:
                        t.put(_free_key(sn, fid, slot), b"", db=db["free"])
            for fid in fids:
                if fid not in keep:
                    t.delete(fid.to_bytes(8, "big"), db=db["files"])
            if keep:
                t.put(b"cur" + prefix, keep[-1].to_bytes(8, "big"), db=db["meta"])
            else:
                t.delete(b"cur" + prefix, db=db["meta"])

        s.submit(finish, durable=True)
        if s.durability != "sync":
            s.env.sync(True)  # the files are about to be deleted: their unregistration must last
        for fid in fids:
            if fid not in keep:
                with s.files_lock:
                    old = s.files.pop(fid, None)
                    if old is not None:
                        old.close()
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(_slot_path(s.slot_dir, fid))
    if progress is not None:
        progress(total, total)  # entries already in place count as done
    return int(n_entries)


def _move_slots(s: _Shared, moves: Sequence[tuple[tuple[int, int, Key], tuple[int, int]]]) -> None:
    """Copy entries to their new slots, sync the destinations, then commit the new locations in
    one transaction (a crash before the commit leaves the old copies authoritative)."""
    with s.read() as txn:
        current: dict[Key, _Entry] = {}
        for (_, _, key), _dst in moves:
            raw = txn.get(key, db=s.dbs["entries"])
            if raw is not None:
                with contextlib.suppress(_BadRecord):
                    current[key] = _Entry.unpack(key, raw)
    touched: dict[int, SlotFile] = {}
    done: list[tuple[Key, int, int, int, int]] = []
    for (fid, slot, key), (dfid, dslot) in moves:
        e = current.get(key)
        if e is None or (e.file_id, e.slot) != (fid, slot):
            continue
        src, dst = s.slot_file(fid), s.slot_file(dfid)
        if src.check(slot, key=key, generation=e.gen, nbytes=e.nbytes, checksum=e.checksum) != ReadResult.OK:
            continue  # damaged: left where it is, for verify to report
        dst.begin_write(dslot, 1)
        dst.write(dslot, e.nbytes, 0, src.data(slot, e.nbytes))
        dst.write_header(dslot, key=key, parent=e.parent, generation=e.gen, nbytes=e.nbytes, checksum=e.checksum)
        touched[dfid] = dst
        done.append((key, fid, slot, dfid, dslot))
    for dst in touched.values():
        dst.sync()  # the copies are durable before the index points at them

    def op(tx: _Tx) -> None:
        for key, fid, slot, dfid, dslot in done:
            cur = tx.get(key)
            if cur is None or (cur.file_id, cur.slot) != (fid, slot):
                continue
            cur.file_id, cur.slot = dfid, dslot
            tx.put(cur)

    s.submit(op, durable=True)


def _compact_env(s: _Shared) -> None:
    """``env.copy(compact=True)`` into a temp directory, then rename its ``data.mdb`` over ours."""
    tmp = os.path.join(s.path, f"{_fsutil.TEMP_MARK}compact-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.mkdir(tmp, 0o700)
    try:
        with s.gate.exclusive():
            try:
                s.env.sync(True)
                s.env.copy(tmp, compact=True)
            except lmdb.Error as exc:
                raise _lmdb_error(exc, "copying the index") from exc
            copied = os.path.join(tmp, "data.mdb")
            os.chmod(copied, 0o600)
            fd = _fsutil.open_private(copied, os.O_RDONLY)
            try:
                _fsutil.sync_fd(fd, "syncing the compacted index", data_only=False)
            finally:
                os.close(fd)
            _crash("lmdb.compact.after_copy")
            map_size = int(s.env.info()["map_size"])
            s.env.close()
            try:
                os.rename(copied, os.path.join(s.path, "data.mdb"))
                _fsutil.fsync_dir(s.path)
                _crash("lmdb.compact.after_swap")
            finally:
                s.env = s._open_env(map_size)
                s.dbs = s._open_dbs()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

