"""The lmdb store's identity constants and the binary records it keeps in LMDB (entries, flights,
leases, counters, slot files and free lists), each packed with ``struct`` and checked on unpack."""

from __future__ import annotations

import os
import struct
from collections.abc import Mapping, Sequence

import msgpack

from hostkv_providers._checksum import CHECKSUM_ALGORITHM, checksum
from hostkv_providers._errors import (
    CorruptStoreError,
    IncompatibleStoreError,
)
from hostkv_providers._keys import FORMAT_VERSION, KEY_ALGORITHM, Key
from hostkv_providers._reports import EntryInfo
from hostkv_providers.providers import _fsutil

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
#: No entry is larger (a bound for parsing records, far above any KV page).
_MAX_ENTRY_NBYTES = 1 << 36
_DB_NAMES = ("meta", "entries", "children", "lru", "pages", "anchors", "flights", "leases", "files", "free", "limbo")
_OWN_FILES = frozenset({"data.mdb", "lock.mdb", _LOCK_NAME, _SLOT_DIR, "counters"})  # counters: _counters.py

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


#: Entry record flags: bit 0 the entry has a parent, bit 1 it is retained (``SupportsRetain``;
#: a build that predates retain ignores the bit, so stores stay readable both ways).
_HAS_PARENT = 1
_RETAINED = 2
#: meta-db records ``_RETAIN_PREFIX + key`` list the retained entries (for stats and the share).
_RETAIN_PREFIX = b"retained/"


class _Entry:
    __slots__ = ("checksum", "children", "cost", "created", "file_id", "gen", "hold", "key", "last_used",
                 "nbytes", "parent", "retained", "slot", "tag", "tick")

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
        self.retained = False

    @property
    def evictable(self) -> bool:
        return self.children == 0 and self.hold == 0 and not self.retained

    @property
    def lru_key(self) -> bytes:
        return self.tick.to_bytes(8, "big") + self.key

    def pack(self) -> bytes:
        flags = (_HAS_PARENT if self.parent is not None else 0) | (_RETAINED if self.retained else 0)
        body = _ENTRY.pack(_ENTRY_VERSION, flags, self.parent or _ZERO32,
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
        if not 0 < nbytes <= _MAX_ENTRY_NBYTES:
            # bounded before anything allocates it: a record with a valid CRC and nbytes=2**40
            # made read_bytes raise MemoryError (issue 16 item 11)
            raise _BadRecord(f"entry record claims {nbytes} bytes")
        try:
            tag = raw[_ENTRY.size : n - 4].decode()
        except UnicodeDecodeError:
            raise _BadRecord("entry salt tag is not UTF-8") from None
        e = cls(Key(bytes(key)), Key(parent) if flags & 1 else None, nbytes, cost, digest, created, tick, gen,
                file_id, slot, tag)
        e.last_used, e.children, e.hold = last_used, children, hold
        e.retained = bool(flags & _RETAINED)
        return e

    def info(self, anchors: Mapping[str, int]) -> EntryInfo:
        return EntryInfo(self.key, self.parent, self.nbytes, self.tag, self.checksum, self.created,
                         self.last_used, dict(anchors), self.retained)


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
