"""``mmap://`` — a crash-safe file store on NVMe that survives restarts.

URL: ``mmap:///path/to/store?budget=64GiB&durability=process`` (options in :meth:`MmapProvider.
from_url`; the full reference with the on-disk format is ``docs/providers/mmap.md``).

Store directory (0700, every file 0600, symlinks refused)::

    manifest.json                 identity and geometry, written atomically (temp, fsync, rename)
    writer.lock                   flock held by the one writer process
    data.<gen>.<nnnn>.slots       preallocated slot files (:mod:`._slotfile`), mmapped
    index.<gen>.snap              snapshot of the index (fixed 160-byte records), atomic
    index.<gen>.journal           append-only journal of 160-byte records since the snapshot

Every index record carries its own 64-bit fold checksum; a snapshot covers every journal record
with ``seq <= snapshot.seq``; the journal holds the records after it.  Opening loads both with
numpy (no per-record Python work for pages), computes the last record per key, drops entries
whose slot header does not echo the record (key, generation, size, checksum), whose run overlaps
a newer one, or whose parent is gone, and rebuilds the accounting.  ``<gen>`` changes only with
:meth:`MmapProvider.compact`, which writes a complete new generation and switches to it by
rewriting the manifest (the commit point); leftovers of the other generation are deleted on the
next writer open.

Write protocol of one page: reserve a free run (its slot headers are zeroed first) → write data
(``pwrite`` into the data file, or a copy engine fills the mapping) → seal: checksum, slot
header, then the journal record (``process``: ``pwrite`` to the page cache, survives kill -9;
``sync``: data files and journal ``fdatasync``-ed by a group commit shared by every concurrent
seal; ``none``: records buffered, flushed in batches).  ``put_many`` runs the same steps for a
chunk of pages with one commit.

Processes: one writer (``writer.lock``, a second writer gets ``LockedError`` at once) and any
number of readers (``readonly=true``).  A reader sees the store as of its open or its last
:meth:`MmapProvider.refresh`; a page the writer evicted or rewrote since then reads as a miss
(the slot header no longer echoes the reader's record — a seqlock read), never as wrong bytes.
"""

from __future__ import annotations

import contextlib
import heapq
import json
import logging
import mmap
import os
import re
import secrets
import struct
import threading
import time
import weakref
from collections.abc import Container, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import xxhash

from hostkv_providers._checksum import CHECKSUM_ALGORITHM
from hostkv_providers._errors import (
    CapacityError,
    CorruptStoreError,
    HostKVError,
    IncompatibleStoreError,
    InFlightError,
    InvalidArgumentError,
    ReservationError,
    StorageIOError,
    UnknownKeyError,
    UnsafeStoreError,
)
from hostkv_providers._keys import FORMAT_VERSION, KEY_ALGORITHM, KEY_NBYTES, Key
from hostkv_providers._options import Options
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
from hostkv_providers.providers._slotfile import (
    _ZERO_KEY,
    FLAG_ANCHOR,
    SLOT_MAGIC,
    ReadResult,
    SlotFile,
    prefetch_runs,
    run_nslots,
)

__all__ = ["MMAP_FORMAT", "MMAP_FORMAT_VERSION", "RECORD_DTYPE", "MmapProvider"]

MMAP_FORMAT = "hostkv-mmap"
#: On-disk format of this provider (manifest ``format_version``); another version is refused.
MMAP_FORMAT_VERSION = 1
RECORD_FOLD = "fold64-v1"

_DEFAULT_BUDGET = 1 << 30
_DEFAULT_SLOT = 256 * 1024
_MAX_FILE = 1 << 30
_SNAPSHOT_MIN = 65536
_NONE_BATCH = 256
_NONE_INTERVAL = 1.0
_JOURNAL_CHUNK = 256 << 10
_MANIFEST_LIMIT = 64 * 1024
_TAG_MAX = 16
_PUT_BATCH = 256  # put_many items per commit: bounds the lock pass and the bytes one commit pins

_log = logging.getLogger(__name__)

OP_SEAL = 1
OP_DROP = 2
OP_ANCHOR = 3
_REC_DELETE = 2  # record flag: the anchor named by an OP_ANCHOR record is removed

RECORD_DTYPE = np.dtype(
    [
        ("op", "u1"),
        ("flags", "u1"),  # bit0: has parent
        ("tag_len", "u1"),
        ("name_len", "u1"),
        ("nslots", "<u4"),
        ("key", "V32"),
        ("parent", "V32"),  # OP_ANCHOR: bytes [40, 104) of the record hold the anchor name
        ("tag", "V16"),
        ("hint", "<u8"),  # OP_SEAL in a snapshot: 1 + the position of the parent's record (0: none)
        ("pad", "<u8"),
        ("file", "<u4"),
        ("slot", "<u4"),
        ("nbytes", "<u8"),
        ("gen", "<u8"),
        ("checksum", "<u8"),
        ("created", "<f8"),
        ("seq", "<u8"),  # journal order; in a snapshot, the entry's LRU tick
        ("fold", "<u8"),
    ]
)
REC_NBYTES = RECORD_DTYPE.itemsize
assert REC_NBYTES == 160
_WORDS = REC_NBYTES // 8
_FOLD_SEED = np.uint64(0x9E3779B97F4A7C15)
_FOLD_MUL = np.uint64(0x9FB21C651E98DF25)  # odd: multiplication is a bijection mod 2**64

_JOURNAL_MAGIC = b"HKVJRNL1"
_MODE_CODE = {"sync": 1, "process": 2, "none": 3}
_SNAP_MAGIC = b"HKVSNAP1"
_SNAP_HEADER = 4096
_DATA_NAME = re.compile(r"^data\.(\d{1,9})\.(\d{4,9})\.slots$")
_KNOWN_NAME = re.compile(
    r"^(manifest\.json|writer\.lock|(data\.\d{1,9}\.\d{4,9}\.slots)|index\.\d{1,9}\.(snap|journal))$")

_fork_generation = 0
_instances: weakref.WeakSet[MmapProvider] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    global _fork_generation
    _fork_generation += 1
    # Methods take the lock before their fork check: a lock copied while another thread of the
    # parent held it would hang the child's first call instead of raising UsedAfterForkError.
    for prov in list(_instances):
        prov._lock = threading.RLock()
        prov._commit_cv = threading.Condition(threading.Lock())


os.register_at_fork(after_in_child=_after_fork_in_child)

_fsutil.register_crash_points({
    "mmap.reserve.after_clear": "a run's slot headers were zeroed, no data yet",
    "mmap.write.partial": "part of a reservation's data is in the mapping",
    "mmap.seal.after_header": "data and slot header written, no journal record",
    "mmap.seal.after_journal": "journal record written (process/none: in the page cache)",
    "mmap.commit.after_data_sync": "group commit: data files synced, journal not yet",
    "mmap.evict.after_drop": "drop records journaled, slot headers not yet cleared",
    "mmap.anchor.after_header": "anchor blob and header written, no journal record",
    "mmap.snapshot.after_snap": "new snapshot renamed into place, journal not yet rotated",
    "mmap.snapshot.after_rotate": "journal rotated after a snapshot",
    "mmap.compact.after_copy": "compaction: new generation's data written, manifest not switched",
    "mmap.compact.after_manifest": "compaction: manifest switched, old generation not deleted",
})


# ------------------------------------------------------------------------------------------------
# Records
# ------------------------------------------------------------------------------------------------


def fold64(words: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """Vectorised 64-bit record checksum over the first ``_WORDS - 1`` words of each row.

    ``h = (h ^ w) * M`` per word (odd ``M``: a bijection), so any change confined to one word
    always changes the result and torn records (zero tails) are caught; it is not cryptographic,
    it only has to catch torn writes and bit rot, and it runs at numpy speed on a million rows
    (in row chunks that stay in cache: the 19 column passes would otherwise stream the whole
    array from memory 19 times).
    """
    n = words.shape[0]
    out = np.empty(n, dtype=np.uint64)
    step = 8192
    with np.errstate(over="ignore"):
        for lo in range(0, n, step):
            w = words[lo : lo + step]
            h = np.full(w.shape[0], _FOLD_SEED, dtype=np.uint64)
            for i in range(_WORDS - 1):
                h ^= w[:, i]
                h *= _FOLD_MUL
            h ^= h >> np.uint64(31)
            out[lo : lo + step] = h
    return out


_M64 = (1 << 64) - 1
_REC_STRUCT = struct.Struct("<BBBBI32s32s16sQQIIQQQdQ")  # RECORD_DTYPE without "fold"
assert _REC_STRUCT.size == REC_NBYTES - 8
_REC_WORDS = struct.Struct(f"<{_WORDS - 1}Q")


def fold64_one(raw: bytes, _unpack: Any = _REC_WORDS.unpack_from, _seed: int = int(_FOLD_SEED),
               _mul: int = int(_FOLD_MUL), _m64: int = _M64) -> int:
    """:func:`fold64` of one record (pure Python: cheaper than numpy for a single row).  The
    constants are bound as defaults: this runs once per seal, and global lookups plus two
    ``int(np.uint64)`` conversions were a quarter of its time."""
    h = _seed
    for w in _unpack(raw):
        h = ((h ^ w) * _mul) & _m64
    return h ^ (h >> 31)


def _encode_seals(reservations: Sequence[_MmapReservation], digests: Sequence[int], tag: bytes, created: float,
                  seq0: int) -> list[bytes]:
    """The seal records of a ``put_many`` chunk, byte for byte what :meth:`MmapProvider._encode`
    gives per record.  The fold of many records runs vectorised: 19 multiplications of Python
    ints cost ~2.6 µs per record, numpy passes over a chunk's columns a fraction of that per
    record from about 8 records on."""
    pack = _REC_STRUCT.pack
    tag16 = tag.ljust(16, b"\0")
    bodies = [pack(OP_SEAL, 1 if r.parent is not None else 0, len(tag), 0, r.nslots, r.key, r.parent or _ZERO_KEY,
                   tag16, 0, 0, r.file, r.slot, r.nbytes, r.gen, d, created, seq0 + j)
              for j, (r, d) in enumerate(zip(reservations, digests, strict=True))]
    if len(bodies) < 8:
        return [b + fold64_one(b).to_bytes(8, "little") for b in bodies]
    words = np.frombuffer(b"".join(bodies), dtype=np.uint64).reshape(len(bodies), _WORDS - 1)
    folds: list[int] = fold64(words).tolist()
    return [b + f.to_bytes(8, "little") for b, f in zip(bodies, folds, strict=True)]


def _build_records(cols: dict[str, Any]) -> npt.NDArray[Any]:
    """Snapshot records from :meth:`MmapProvider._snapshot_columns`, folded: the seals, then
    the anchors (stamped with the newest tick: they must sort after their entry's seal)."""
    rows = cols["rows"]
    recs = np.zeros(len(rows), RECORD_DTYPE)
    if len(rows):
        par = cols["parent_row"]
        hasp = par >= 0
        recs["op"] = OP_SEAL
        recs["key"] = cols["key"]
        recs["flags"] = hasp.astype(np.uint8)
        recs["parent"][hasp] = cols["parent_key"]
        for name in ("tag", "tag_len", "file", "slot", "nslots", "nbytes", "gen", "checksum", "created", "seq"):
            recs[name] = cols[name]
        # the parent's position in this snapshot: reopening resolves parents without a search
        pos_of_row = np.full(cols["n_rows"], -1, np.int64)
        pos_of_row[rows] = np.arange(len(rows))
        recs["hint"][hasp] = (pos_of_row[par[hasp]] + 1).astype(np.uint64)
        _seal_folds(recs)
    if cols["anchors"]:
        ext = np.frombuffer(b"".join(cols["anchors"]), RECORD_DTYPE).copy()
        ext["seq"] = cols["clock"]
        _seal_folds(ext)
        recs = np.concatenate([recs, ext])
    return recs


def _columns(recs: npt.NDArray[Any]) -> npt.NDArray[np.uint64]:
    """Records as a ``(_WORDS, n)`` array of uint64 columns (transposed in cache-sized chunks).

    Every loader step then reads contiguous columns instead of striding through 160-byte
    records once per field, which is what makes a million-entry open fast."""
    n = len(recs)
    words = recs.view(np.uint64).reshape(n, _WORDS)
    out = np.empty((_WORDS, n), dtype=np.uint64)
    step = 16384
    for lo in range(0, n, step):
        out[:, lo : lo + step] = words[lo : lo + step].T
    return out


def _fold_columns(W: npt.NDArray[np.uint64]) -> npt.NDArray[np.bool_]:
    """Which columns-records pass their fold checksum (and have an op)."""
    n = W.shape[1]
    h = np.full(n, _FOLD_SEED, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for i in range(_WORDS - 1):
            h ^= W[i]
            h *= _FOLD_MUL
        h ^= h >> np.uint64(31)
    ok: npt.NDArray[np.bool_] = (h == W[_WORDS - 1]) & ((W[0] & np.uint64(0xFF)) != 0)
    return ok


def _records_of(W: npt.NDArray[np.uint64], pos: npt.NDArray[np.intp]) -> npt.NDArray[Any]:
    """Structured records for a few column positions (anchors)."""
    rows: npt.NDArray[Any] = np.ascontiguousarray(W[:, pos].T).view(RECORD_DTYPE).reshape(len(pos))
    return rows


def _seal_folds(recs: npt.NDArray[Any]) -> None:
    if len(recs):
        recs["fold"] = fold64(recs.view(np.uint64).reshape(len(recs), _WORDS))


def _folds_ok(recs: npt.NDArray[Any]) -> npt.NDArray[np.bool_]:
    if not len(recs):
        return np.zeros(0, dtype=np.bool_)
    ok: npt.NDArray[np.bool_] = fold64(recs.view(np.uint64).reshape(len(recs), _WORDS)) == recs["fold"]
    return ok


def _u64x4(keys: npt.NDArray[Any]) -> npt.NDArray[np.uint64]:
    """32-byte keys as an ``(n, 4)`` uint64 array (for fast vectorised equality)."""
    out: npt.NDArray[np.uint64] = np.ascontiguousarray(keys).view("<u8").reshape(len(keys), 4)
    return out


def _key_u64(key: bytes) -> int:
    return int.from_bytes(key[:8], "little")


@dataclass(slots=True)
class _Anchor:
    file: int
    slot: int
    nslots: int
    nbytes: int
    gen: int
    checksum: int
    cost: int


class _Flight:
    # The parent's generation too: if the parent row is dropped (corrupt) and recycled for another
    # entry, commit/cancel must not touch that other entry's pins.
    __slots__ = ("cost", "parent", "parent_gen", "pending")

    def __init__(self, parent: int, cost: int, parent_gen: int, pending: Key | None = None) -> None:
        self.parent = parent
        self.cost = cost
        self.parent_gen = parent_gen
        #: put_many: the parent is an earlier reservation of the same batch (not a row yet); it is
        #: resolved when this flight commits, after the parent's commit in the same locked pass.
        self.pending = pending


# ------------------------------------------------------------------------------------------------
# The in-memory index: numpy columns, so a million entries load without a million Python objects
# ------------------------------------------------------------------------------------------------


class _Index:
    """A prefix-closed tree with LRU-leaf eviction, holds and an O(1) budget guard (the same
    semantics as :class:`._index.TreeIndex`) over numpy columns.

    Why not ``TreeIndex``: creating one ``Node`` object per entry costs ~1-3 s per million
    entries on a loaded machine, and reopening a million-entry store must take under a second.
    Rows are indices into the columns; the key map is a Python dict for rows added after open
    plus a sorted numpy array (binary search) for rows bulk-loaded at open.
    """

    COLS: tuple[tuple[str, Any, Any], ...] = (
        ("key", "V32", None), ("parent", np.int64, -1), ("nbytes", np.int64, 0), ("cost", np.int64, 0),
        ("file", np.int64, 0), ("slot", np.int64, 0), ("nslots", np.int64, 0), ("gen", np.uint64, 0),
        ("csum", np.uint64, 0), ("created", np.float64, 0.0), ("used", np.float64, 0.0),
        ("tick", np.int64, 0), ("children", np.int32, 0), ("hold", np.int32, 0),
        ("alive", np.bool_, False), ("tag", "V16", None), ("tag_len", np.uint8, 0),
    )

    def __init__(self, budget: int, capacity: int = 1024) -> None:
        self.budget = budget
        self.cap = 0
        self.n = 0  # rows ever used (high-water mark)
        self.key: npt.NDArray[Any] = np.zeros(0, "V32")
        self.parent: npt.NDArray[np.int64] = np.zeros(0, np.int64)
        self.nbytes: npt.NDArray[np.int64] = np.zeros(0, np.int64)
        self.cost: npt.NDArray[np.int64] = np.zeros(0, np.int64)
        self.file: npt.NDArray[np.int64] = np.zeros(0, np.int64)
        self.slot: npt.NDArray[np.int64] = np.zeros(0, np.int64)
        self.nslots: npt.NDArray[np.int64] = np.zeros(0, np.int64)
        self.gen: npt.NDArray[np.uint64] = np.zeros(0, np.uint64)
        self.csum: npt.NDArray[np.uint64] = np.zeros(0, np.uint64)
        self.created: npt.NDArray[np.float64] = np.zeros(0, np.float64)
        self.used: npt.NDArray[np.float64] = np.zeros(0, np.float64)
        self.tick: npt.NDArray[np.int64] = np.zeros(0, np.int64)
        self.children: npt.NDArray[np.int32] = np.zeros(0, np.int32)
        self.hold: npt.NDArray[np.int32] = np.zeros(0, np.int32)
        self.alive: npt.NDArray[np.bool_] = np.zeros(0, np.bool_)
        self.tag: npt.NDArray[Any] = np.zeros(0, "V16")
        self.tag_len: npt.NDArray[np.uint8] = np.zeros(0, np.uint8)
        self._grow(capacity)
        self.anchors: dict[int, dict[str, _Anchor]] = {}
        self.flights: dict[Key, _Flight] = {}
        self.count = 0
        self.used_cost = 0  # sealed cost + in-flight cost
        self.sealed_cost = 0
        self.evictions = 0
        self.evicted_cost = 0
        self.clock = 1
        self._free_rows: list[int] = []
        self._dict: dict[bytes, int] = {}
        self._base_k64: npt.NDArray[np.uint64] = np.zeros(0, np.uint64)
        self._base_row: npt.NDArray[np.int64] = np.zeros(0, np.int64)
        self._heap: list[tuple[int, int]] = []
        self._heap_bound = -1  # every unheld leaf with tick <= bound is in the heap

    def _grow(self, capacity: int) -> None:
        if capacity <= self.cap:
            return
        for name, dtype, fill in self.COLS:
            old = getattr(self, name)
            new = np.zeros(capacity, dtype=dtype)
            if fill is not None and fill != 0:
                new[:] = fill
            new[: len(old)] = old
            setattr(self, name, new)
        self.cap = capacity

    # -- key map ---------------------------------------------------------------------------------
    def row_of(self, key: bytes) -> int:
        row = self._dict.get(key)
        if row is not None:
            return row
        if len(self._base_k64):
            h = _key_u64(key)
            i = int(np.searchsorted(self._base_k64, h))
            while i < len(self._base_k64) and int(self._base_k64[i]) == h:
                r = int(self._base_row[i])
                if r >= 0 and self.key[r].tobytes() == key:
                    self._dict[key] = r  # cache: the next lookup of this key is one dict probe
                    return r
                i += 1
        return -1

    def _unmap(self, row: int) -> None:
        key = self.key[row].tobytes()
        self._dict.pop(key, None)
        if not len(self._base_k64):
            return
        h = _key_u64(key)
        i = int(np.searchsorted(self._base_k64, h))
        while i < len(self._base_k64) and int(self._base_k64[i]) == h:
            if int(self._base_row[i]) == row:
                self._base_row[i] = -1
                return
            i += 1

    def key_of(self, row: int) -> Key:
        return Key(self.key[row].tobytes())

    def tag_of(self, row: int) -> str:
        n = int(self.tag_len[row])
        raw: bytes = self.tag[row].tobytes()
        return raw[:n].decode("utf-8", "replace")

    def parent_key(self, row: int) -> Key | None:
        p = int(self.parent[row])
        return None if p < 0 else self.key_of(p)

    # -- bulk load -------------------------------------------------------------------------------
    def load_columns(self, L: npt.NDArray[np.uint64], parent_rows: npt.NDArray[np.int64],
                     costs: npt.NDArray[np.int64], base_k64: npt.NDArray[np.uint64],
                     base_row: npt.NDArray[np.int64]) -> None:
        """Replace the contents by the live records ``L`` (uint64 columns, keys unique, parents
        resolved to column positions, prefix-closed); ``base_k64``/``base_row`` is the key map
        (first 8 key bytes, sorted, and the row of each)."""
        n = L.shape[1]
        for name, dtype, _ in self.COLS:
            setattr(self, name, np.zeros(0, dtype=dtype))
        self.cap = 0
        self._grow(max(1024, n + n // 4))
        self.n = n
        if n:
            self.key[:n] = np.ascontiguousarray(L[1:5].T).view("V32").reshape(n)
            self.tag[:n] = np.ascontiguousarray(L[9:11].T).view("V16").reshape(n)
        self.parent[:n] = parent_rows
        self.nslots[:n] = (L[0] >> np.uint64(32)).astype(np.int64)
        self.tag_len[:n] = np.minimum((L[0] >> np.uint64(16)) & np.uint64(0xFF), _TAG_MAX).astype(np.uint8)
        self.file[:n] = (L[13] & np.uint64(0xFFFFFFFF)).astype(np.int64)
        self.slot[:n] = (L[13] >> np.uint64(32)).astype(np.int64)
        self.nbytes[:n] = L[14].astype(np.int64)
        self.gen[:n] = L[15]
        self.csum[:n] = L[16]
        self.created[:n] = L[17].view(np.float64)
        self.used[:n] = self.created[:n]
        ticks = L[18].astype(np.int64)
        self.tick[:n] = ticks
        self.cost[:n] = costs
        self.alive[:n] = True
        if n:
            has_parent = parent_rows >= 0
            self.children[:n] = np.bincount(parent_rows[has_parent], minlength=n)[:n].astype(np.int32)
        self._base_k64 = base_k64
        self._base_row = base_row.astype(np.int64)
        self._dict = {}
        self._free_rows = []
        self.count = n
        self.sealed_cost = int(costs.sum()) if n else 0
        self.used_cost = self.sealed_cost
        self.clock = max(self.clock, int(ticks.max()) + 1 if n else 1)
        self._heap = []
        self._heap_bound = -1

    # -- lookups ---------------------------------------------------------------------------------
    def rows_of(self, keys: Sequence[bytes]) -> list[int]:
        return [self.row_of(k) for k in keys]

    def touch(self, row: int) -> None:
        self.clock += 1
        self.tick[row] = self.clock
        self.used[row] = time.time()
        if not self.children.item(row) and not self.hold.item(row):
            if len(self._heap) > 4 * self.count + 1024:
                # mostly stale entries (a reader touches without ever evicting): rebuild lazily
                self._heap = []
                self._heap_bound = -1
            heapq.heappush(self._heap, (self.clock, row))

    def live_rows(self) -> npt.NDArray[np.intp]:
        return np.flatnonzero(self.alive[: self.n])

    # -- reservations ----------------------------------------------------------------------------
    def begin(self, key: Key, parent: Key | None, cost: int,
              pending_ok: Container[Key] = ()) -> tuple[bool, list[int], int]:
        """Start a reservation: ``(False, [], -1)`` for a sealed key (dedup), else
        ``(True, evicted_rows, parent_row)``.  A parent in ``pending_ok`` (and in flight) need not
        be sealed yet: the caller commits it first (``put_many``)."""
        if self.row_of(key) >= 0:
            return False, [], -1
        if key in self.flights:
            raise InFlightError(f"key {key.hex()[:16]} is being written by another writer", key=key)
        prow = -1
        pending = None
        if parent is not None:
            prow = self.row_of(parent)
            if prow < 0:
                if parent not in pending_ok or parent not in self.flights:
                    raise UnknownKeyError(f"parent {parent.hex()[:16]} is not stored")
                pending = parent  # an in-flight entry is never evicted: nothing to hold
        evicted = self.make_room(cost, protect=prow)
        self.flights[key] = _Flight(prow, cost, int(self.gen[prow]) if prow >= 0 else 0, pending)
        self.used_cost += cost
        if prow >= 0:
            self._hold(prow)
        return True, evicted, prow

    def commit(self, key: Key, *, nbytes: int, file: int, slot: int, nslots: int, gen: int, csum: int,
               tag: bytes, created: float) -> int:
        flight = self.flights.pop(key)
        prow = flight.parent
        if flight.pending is not None:
            prow = self.row_of(flight.pending)
            if prow < 0:
                self.used_cost -= flight.cost
                raise UnknownKeyError(
                    "the parent (an earlier item of the same batch) was not stored",
                    hint="save the chain again from its first missing page",
                )
        elif prow >= 0 and not self._parent_alive(flight):
            self.used_cost -= flight.cost
            raise UnknownKeyError(
                "the parent was dropped (corrupt) before the seal",
                hint="save the chain again from its first missing page",
            )
        row = self._free_rows.pop() if self._free_rows else self._new_row()
        self.key[row] = key
        self.parent[row] = prow
        self.nbytes[row] = nbytes
        self.cost[row] = flight.cost
        self.file[row] = file
        self.slot[row] = slot
        self.nslots[row] = nslots
        self.gen[row] = gen
        self.csum[row] = csum
        self.created[row] = created
        self.used[row] = created
        self.children[row] = 0
        self.hold[row] = 0
        self.tag[row] = tag.ljust(_TAG_MAX, b"\0")
        self.tag_len[row] = len(tag)
        self.alive[row] = True
        self._dict[key] = row
        self.count += 1
        self.sealed_cost += flight.cost
        if prow >= 0:
            self.children[prow] += 1
            if flight.pending is None:
                self._unhold(prow)
        self.touch(row)
        return row

    def _parent_alive(self, flight: _Flight) -> bool:
        """Whether the flight's parent is still the entry it pinned (alive, same generation)."""
        p = flight.parent
        return p >= 0 and bool(self.alive[p]) and int(self.gen[p]) == flight.parent_gen

    def _new_row(self) -> int:
        if self.n >= self.cap:
            self._grow(self.cap * 2)
        self.n += 1
        return self.n - 1

    def cancel(self, key: Key) -> None:
        flight = self.flights.pop(key, None)
        if flight is None:
            return
        self.used_cost -= flight.cost
        if flight.pending is None and self._parent_alive(flight):
            self._unhold(flight.parent)

    # -- budget ----------------------------------------------------------------------------------
    def make_room(self, cost: int, protect: int = -1) -> list[int]:
        """Evict LRU leaves until ``cost`` more fits, or raise ``CapacityError`` evicting nothing.

        Pins are direct (only leaves are evicted, so an ancestor of a pinned row is safe as a
        non-leaf); the guard evicts tentatively and puts every row back if even that is not
        enough.  Both keep a reservation O(1) however deep its chain, as in ``TreeIndex``.
        """
        if self.used_cost + cost <= self.budget:
            return []
        if cost > self.budget or self.used_cost - self.sealed_cost + cost > self.budget:
            raise CapacityError(
                f"{cost} bytes do not fit: budget {self.budget}, used {self.used_cost} of which "
                f"{self.used_cost - self.sealed_cost} by reservations in flight"
            )
        if protect >= 0:
            self._hold(protect)
        try:
            removed = self._evict_lru(self.used_cost + cost - self.budget)
            if self.used_cost + cost > self.budget:
                for row in reversed(removed):  # parents were removed after their children
                    self._reinsert(row)
                raise CapacityError(
                    f"{cost} bytes do not fit: budget {self.budget}, used {self.used_cost}, and only "
                    f"{sum(int(self.cost[r]) for r in removed)} of it is evictable (the rest is leased "
                    "or in flight)"
                )
        finally:
            if protect >= 0:
                self._unhold(protect)
        self.evictions += len(removed)
        self.evicted_cost += sum(int(self.cost[r]) for r in removed)
        return removed

    def _reinsert(self, row: int) -> None:
        """Undo ``_remove`` of a tentative eviction."""
        self._dict[self.key[row].tobytes()] = row
        self.alive[row] = True
        self.count += 1
        c = int(self.cost[row])
        self.used_cost += c
        self.sealed_cost += c
        p = int(self.parent[row])
        if p >= 0 and self.alive[p]:
            self.children[p] += 1
        heapq.heappush(self._heap, (int(self.tick[row]), row))

    def _refill_heap(self) -> None:
        """Rebuild the LRU candidate heap from the columns: the K oldest unheld leaves."""
        n = self.n
        cand = np.flatnonzero(self.alive[:n] & (self.children[:n] == 0) & (self.hold[:n] == 0))
        if not len(cand):
            self._heap = []
            self._heap_bound = -1
            return
        k = min(len(cand), 4096)
        ticks = self.tick[cand]
        if k < len(cand):
            part = np.argpartition(ticks, k - 1)[:k]
            cand, ticks = cand[part], ticks[part]
            self._heap_bound = int(ticks.max())
        else:
            self._heap_bound = 1 << 62
        self._heap = list(zip(ticks.tolist(), cand.tolist(), strict=True))
        heapq.heapify(self._heap)

    def pop_lru_leaf(self) -> int:
        """The least-recently-used unheld leaf (not removed), or -1."""
        for _ in range(2):
            while self._heap:
                tick, row = self._heap[0]
                if (not self.alive[row] or int(self.tick[row]) != tick or self.children[row]
                        or self.hold[row]):
                    heapq.heappop(self._heap)
                    continue
                if tick > self._heap_bound:
                    break  # an unheld leaf older than this may be missing from the heap
                return row
            self._refill_heap()
        return -1

    def _evict_lru(self, need: int) -> list[int]:
        out: list[int] = []
        freed = 0
        while freed < need:
            row = self.pop_lru_leaf()
            if row < 0:
                break
            freed += int(self.cost[row])
            self._remove(row)
            out.append(row)
        return out

    def evict_cost(self, need: int) -> list[int]:
        """Evict LRU unpinned leaves until ``need`` cost is freed (or none is left)."""
        out = self._evict_lru(need)
        self.evictions += len(out)
        self.evicted_cost += sum(int(self.cost[r]) for r in out)
        return out

    def add_cost(self, row: int, delta: int) -> list[int]:
        evicted: list[int] = []
        if delta > 0:
            evicted = self.make_room(delta, protect=row)
        self.cost[row] += delta
        self.used_cost += delta
        self.sealed_cost += delta
        return evicted

    # -- holds -----------------------------------------------------------------------------------
    def hold_rows(self, rows: Sequence[int]) -> None:
        for row in rows:
            if row >= 0:
                self._hold(row)
                self.touch(row)

    def release_rows(self, rows: Sequence[int], gens: Sequence[int]) -> None:
        for row, g in zip(rows, gens, strict=True):
            # rows of an index replaced since (a reader's refresh) never match: gens are unique
            if 0 <= row < self.n and self.alive[row] and int(self.gen[row]) == g:
                self._unhold(row)

    def _hold(self, row: int) -> None:
        self.hold[row] += 1

    def _unhold(self, row: int) -> None:
        self.hold[row] -= 1
        if self.hold[row] == 0 and self.children[row] == 0 and self.alive[row]:
            heapq.heappush(self._heap, (int(self.tick[row]), row))

    # -- removal ---------------------------------------------------------------------------------
    def _remove(self, row: int) -> None:
        self._unmap(row)
        self.alive[row] = False
        self.count -= 1
        c = int(self.cost[row])
        self.used_cost -= c
        self.sealed_cost -= c
        p = int(self.parent[row])
        if p >= 0 and self.alive[p]:
            self.children[p] -= 1
            if self.children[p] == 0 and self.hold[p] == 0:
                heapq.heappush(self._heap, (int(self.tick[p]), p))

    def recycle(self, rows: Sequence[int]) -> None:
        """Make removed rows reusable (after the caller freed their slots)."""
        self._free_rows.extend(rows)

    def subtree(self, roots: Sequence[int]) -> list[int]:
        """Rows of the subtrees under ``roots``, deepest first (pointer jumping, vectorised)."""
        roots = [r for r in roots if r >= 0 and self.alive[r]]
        if not roots:
            return []
        if all(self.children[r] == 0 for r in roots):
            return list(dict.fromkeys(roots))
        n = self.n
        alive = self.alive[:n]
        mark = np.zeros(n, np.bool_)
        mark[roots] = True
        anc = np.where(alive, self.parent[:n], -1)
        depth = (anc >= 0).astype(np.int64)
        while True:
            idx = np.flatnonzero(anc >= 0)
            if not len(idx):
                break
            up = anc[idx]
            mark[idx] |= mark[up]
            depth[idx] += depth[up]
            anc[idx] = anc[up]
        rows = np.flatnonzero(mark & alive)
        order = np.argsort(-depth[rows], kind="stable")
        return [int(r) for r in rows[order]]

    def evict_rows(self, rows: Sequence[int]) -> tuple[list[int], int]:
        removed: list[int] = []
        skipped = 0
        for row in self.subtree(rows):
            if self.hold[row] or self.children[row] or self.key_of(row) in self.flights:
                skipped += 1
                continue
            self._remove(row)
            self.evictions += 1
            self.evicted_cost += int(self.cost[row])
            removed.append(row)
        return removed, skipped

    def drop(self, row: int) -> list[int]:
        """Force-remove ``row`` and its subtree (corruption), held or not."""
        removed: list[int] = []
        for r in self.subtree([row]):
            self.hold[r] = 0  # leases and flights on a dropped row see it dead (or a new gen)
            self.children[r] = 0
            self._remove(r)
            removed.append(r)
        return removed


# ------------------------------------------------------------------------------------------------
# Reservation
# ------------------------------------------------------------------------------------------------


class _MmapReservation(Reservation):
    __slots__ = ("digest", "file", "gen", "nslots", "slot")

    def __init__(self, provider: MmapProvider, key: Key, parent: Key | None, nbytes: int, salt_tag: str,
                 file: int, slot: int, nslots: int, gen: int) -> None:
        super().__init__(provider, key, parent, nbytes, salt_tag)
        self.file = file
        self.slot = slot
        self.nslots = nslots
        self.gen = gen
        self.digest: int | None = None  # XXH3 of a single whole-entry write (saves re-reading it)

    def regions(self) -> Sequence[HostRegion]:
        """The reservation's bytes in the file mapping (pageable memory, not pinned)."""
        self.check_open(self._provider)
        self.digest = None  # the caller may overwrite anything through these
        prov: MmapProvider = self._provider  # type: ignore[assignment]
        view = prov._files[self.file].data(self.slot, self.nbytes)
        from hostkv_providers.device._hostmem import buffer_address

        return [HostRegion(0, view, buffer_address(view), False)]


class _Pending:
    """One seal waiting for the group commit; ``done`` once a leader's commit of it is over
    (``error`` then says how it went)."""

    __slots__ = ("done", "error", "record")

    def __init__(self, record: bytes) -> None:
        self.record = record
        self.error: BaseException | None = None
        self.done = False


# ------------------------------------------------------------------------------------------------
# The provider
# ------------------------------------------------------------------------------------------------


class MmapProvider(Provider):
    """File store of fixed-size slots with a checksummed journal (see the module docstring).

    Parameters
    ----------
    path:
        The store directory (created 0700 when missing; an existing empty directory is adopted
        and tightened to 0700).
    budget_bytes:
        The byte budget; ``None``: the budget recorded by the last writer (1 GiB for a new store).
    durability:
        ``"sync"`` (seal returns after data and index are on stable storage; concurrent seals
        share one sync), ``"process"`` (survives kill -9; default), ``"none"`` (a crash may lose
        the last ~second of seals, never corrupts older ones).
    slot_nbytes:
        Slot size of a new store (multiple of 4096; default 256 KiB; an entry takes
        ``ceil(nbytes / slot)`` consecutive slots).  Must match an existing store if given.
    file_nbytes:
        Size of each preallocated data file (default ``min(budget, 1 GiB)``).
    verify:
        ``"read"``: check the page checksum on every read (default); ``"never"``: trust the medium
        (slot headers are still checked, so a reused slot never satisfies a stale record).
    readonly:
        Open as a reader process: no lock, no writes; see :meth:`refresh`.
    snapshot_every:
        Journal records after which the writer writes a snapshot (at least the live entry count).
    commit_window:
        Seconds the group-commit leader waits for more seals before syncing (``sync`` only).
    create:
        Create the store when the directory holds none (``False``: ``StorageIOError``).
    io:
        ``"pread"`` (default): page bytes move with ``pwrite``/``preadv`` (one system call per
        page; measured several times faster than copying through the mapping, which faults per
        4 KiB); ``"mmap"``: through the mapping.  Slot headers always use the mapping, and
        ``Reservation.regions()`` always exposes mapped memory for a copy engine.
    """

    name = "mmap"
    persistent = True
    multiprocess = True

    def __init__(
        self,
        path: str,
        *,
        budget_bytes: int | None = None,
        durability: str = "process",
        slot_nbytes: int | None = None,
        file_nbytes: int | None = None,
        verify: str = "read",
        readonly: bool = False,
        snapshot_every: int = _SNAPSHOT_MIN,
        commit_window: float = 0.0,
        create: bool = True,
        io: str = "pread",
    ) -> None:
        super().__init__()
        self._fork_gen = _fork_generation
        t0 = time.perf_counter()
        if not isinstance(path, str) or not path:
            raise InvalidArgumentError(f"store path must be a non-empty str, got {path!r}")
        if durability not in ("sync", "process", "none"):
            raise InvalidArgumentError(f"durability must be sync, process or none, got {durability!r}")
        if io not in ("pread", "mmap"):
            raise InvalidArgumentError(f"io must be pread or mmap, got {io!r}")
        self._io = "syscall" if io == "pread" else "mmap"
        if verify not in ("read", "never"):
            raise InvalidArgumentError(f"verify must be read or never, got {verify!r}")
        if budget_bytes is not None and (type(budget_bytes) is not int or budget_bytes <= 0):
            raise InvalidArgumentError(f"budget must be a positive int, got {budget_bytes!r}")
        if type(snapshot_every) is not int or snapshot_every < 1:
            raise InvalidArgumentError(f"snapshot_every must be a positive int, got {snapshot_every!r}")
        self.path = os.path.abspath(path)
        self._durability = durability
        self._verify_reads = verify == "read"
        self._readonly = readonly
        self._snapshot_every = snapshot_every
        self._commit_window = float(commit_window)
        self._lock = threading.RLock()
        self._commit_cv = threading.Condition(threading.Lock())
        _instances.add(self)
        self._counters: dict[str, int] = dict.fromkeys(
            ("hits", "misses", "seals", "aborts", "dedup", "checksum_failures", "bytes_written", "bytes_read",
             "stale_reads", "syncs", "group_commits", "snapshot_failures"), 0)
        self._files: dict[int, SlotFile] = {}
        self._free: dict[int, npt.NDArray[np.bool_]] = {}
        self._cursor: dict[int, int] = {}  # per data file: where the next free-slot search starts
        self._lockfile: _fsutil.LockFile | None = None
        self._jfd: int | None = None
        self._jend = 0
        self._jalloc = 0
        self._jrecords = 0  # records in the journal (since the snapshot)
        self._nbuf: list[bytes] = []  # durability=none: records not yet written
        self._nbuf_t = time.monotonic()
        self._queue: list[_Pending] = []
        self._leader = False
        self._failed: str | None = None  # set after a failed sync: no more acknowledgements
        self._problems: list[str] = []
        self._dirty_files: set[int] = set()
        self._next_gen = 1
        self._idx = _Index(0)
        self._state_sig: tuple[Any, ...] = ()
        self._load_needs_snapshot = False
        self._jvalid_end = REC_NBYTES
        self._torn_tail = False
        self._last_mode = 0  # durability code of the writer that wrote the journal (0: unknown)
        self._stale_at_open = 0
        # Seals and anchors whose journal record may already be written but which are not in the
        # index yet (a seal between _seal_prepare and _seal_finish/_seal_undo, an anchor between
        # its record and its table entry).  A snapshot taken meanwhile would
        # cover neither the entry (not in the index) nor its record (the journal is rotated), so
        # an acknowledged seal would be lost by a kill -9: snapshots wait until this is 0.
        self._unfinished = 0
        # The periodic snapshot of the seal paths (_snapshot_due): due flag, one writer at a time,
        # an epoch that every other snapshot bumps (a snapshot written meanwhile is obsolete) and
        # the journal rotation still owed by an installed snapshot: (generation, offset of the
        # first journal record after it).
        self._snap_due = False
        self._snap_mutex = threading.Lock()
        self._snap_epoch = 0
        self._rotation: tuple[int, int] | None = None
        self._snap_syncing: set[int] = set()  # data files its unlocked phase is syncing
        self._orphans_at_open = 0
        try:
            self._open(budget_bytes, slot_nbytes, file_nbytes, create)
        except BaseException:
            self._release_all()
            raise
        self.open_seconds = time.perf_counter() - t0

    def _check_usable(self) -> None:
        # The base class compares os.getpid() on every call; a fork counter bumped by an
        # at-fork hook is the same check without a system call per operation.  Methods call it
        # before taking self._lock too (and again under it, for a racing close()): a forked
        # child may have copied the lock while another thread of the parent held it, and would
        # wait on it forever instead of raising UsedAfterForkError.
        if self._closed or _fork_generation != self._fork_gen:
            super()._check_usable()

    # -- construction ----------------------------------------------------------------------------
    @classmethod
    def from_url(cls, location: str, options: Mapping[str, str]) -> MmapProvider:
        """``mmap:///path?budget=..&durability=sync|process|none&slot=..&file_size=..&verify=read|never
        &readonly=false&snapshot_every=..&commit_window_us=..``"""
        opts = Options("mmap", options)
        raw_budget = opts.text("budget")
        durability = opts.choice("durability", "process", ("sync", "process", "none"))
        raw_slot = opts.text("slot")
        raw_file = opts.text("file_size")
        verify = opts.choice("verify", "read", ("read", "never"))
        readonly = opts.boolean("readonly", False)
        snapshot_every = opts.integer("snapshot_every", _SNAPSHOT_MIN)
        window_us = opts.integer("commit_window_us", 0)
        io = opts.choice("io", "pread", ("pread", "mmap"))
        opts.finish()
        if not location:
            raise InvalidArgumentError("mmap:// needs a directory path", hint="use mmap:///var/cache/kv?budget=64GiB")
        from hostkv_providers._options import parse_size

        return cls(
            os.path.expanduser(location),
            budget_bytes=None if raw_budget is None else parse_size(raw_budget),
            durability=durability,
            slot_nbytes=None if raw_slot is None else parse_size(raw_slot),
            file_nbytes=None if raw_file is None else parse_size(raw_file),
            verify=verify,
            readonly=readonly,
            snapshot_every=snapshot_every,
            commit_window=max(0, window_us) / 1e6,
            io=io,
        )

    # -- paths -----------------------------------------------------------------------------------
    def _p(self, name: str) -> str:
        return os.path.join(self.path, name)

    def _data_name(self, gen: int, file_id: int) -> str:
        return f"data.{gen}.{file_id:04d}.slots"

    def _snap_name(self, gen: int) -> str:
        return f"index.{gen}.snap"

    def _journal_name(self, gen: int) -> str:
        return f"index.{gen}.journal"

    # -- open ------------------------------------------------------------------------------------
    def _open(self, budget: int | None, slot_nbytes: int | None, file_nbytes: int | None, create: bool) -> None:
        manifest_path = self._p("manifest.json")
        if self._readonly:
            _fsutil.check_private_dir(self.path)
        else:
            self._adopt_dir(create)
        if not self._readonly:
            self._lockfile = _fsutil.LockFile(self._p("writer.lock"))
        exists = _fsutil.lexists(manifest_path, f"looking for {manifest_path}")
        if not exists:
            if self._readonly or not create:
                raise StorageIOError(f"no mmap store at {self.path} (manifest.json missing)")
            self._create_store(budget, slot_nbytes, file_nbytes)
        man = self._read_manifest()
        self._manifest = man
        self._gen = int(man["generation"])
        self._slot = int(man["slot_nbytes"])
        if slot_nbytes is not None and slot_nbytes != self._slot:
            raise IncompatibleStoreError(
                f"{self.path} has {self._slot}-byte slots, the URL asks for {slot_nbytes}",
                hint="drop the slot= option or compact into a new store")
        self._store_id = bytes.fromhex(str(man["store_id"]))
        self._budget = budget if budget is not None else int(man["budget_bytes"])
        fb = file_nbytes if file_nbytes is not None else int(man.get("file_nbytes", 0)) or min(self._budget, _MAX_FILE)
        self._file_slots = max(1, fb // self._slot)
        self._idx.budget = self._budget
        t_open = time.monotonic()
        if not self._readonly:
            self._cleanup_dir()
            self._load()
        else:
            self._load_reader()
        #: what this open found and repaired (``describe()["last_recovery"]``)
        self._recovery: dict[str, Any] = {
            "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "by_pid": os.getpid(),
            "readonly": self._readonly, "seconds": round(time.monotonic() - t_open, 4),
            "entries": int(self._idx.count), "problems": list(self._problems[:5]),
            "problems_total": len(self._problems), "stale_entries_dropped": int(self._stale_at_open),
        }
        if not self._readonly:
            if not self._files:  # preallocate the first data file now: a full disk fails at open
                self._add_data_file(self._file_slots)
            self._open_journal_for_append()
            if self._budget != int(man["budget_bytes"]) or (file_nbytes is not None
                                                             and file_nbytes != int(man.get("file_nbytes", 0))):
                man = dict(man, budget_bytes=self._budget, file_nbytes=self._file_slots * self._slot)
                self._write_manifest(man)
                self._manifest = man
            if self._idx.used_cost > self._budget:
                self._free_rows_storage(self._idx.evict_cost(self._idx.used_cost - self._budget), journal=True)
            if self._load_needs_snapshot:
                self._snapshot()

    def _adopt_dir(self, create: bool) -> None:
        if not _fsutil.lexists(self.path, f"looking for {self.path}"):
            if not create:
                raise StorageIOError(f"no mmap store at {self.path}")
            _fsutil.ensure_private_dir(self.path)
            return
        try:
            _fsutil.check_private_dir(self.path)
        except UnsafeStoreError:  # not an I/O error: that one is the answer
            # An empty directory the caller made for us (loose umask): adopt it and tighten it.
            import stat as _stat

            st = os.lstat(self.path)
            if (_stat.S_ISDIR(st.st_mode) and not _stat.S_ISLNK(st.st_mode) and st.st_uid == os.geteuid()
                    and not _fsutil.listdir(self.path)):
                os.chmod(self.path, _fsutil.DIR_MODE)
                _fsutil.check_private_dir(self.path)
            else:
                raise

    def _create_store(self, budget: int | None, slot_nbytes: int | None, file_nbytes: int | None) -> None:
        slot = _DEFAULT_SLOT if slot_nbytes is None else slot_nbytes
        if type(slot) is not int or slot <= 0 or slot % 4096:
            raise InvalidArgumentError(f"slot size must be a positive multiple of 4096, got {slot!r}")
        b = _DEFAULT_BUDGET if budget is None else budget
        if b < slot:
            raise InvalidArgumentError(f"budget {b} is smaller than one slot ({slot})")
        fb = min(b, _MAX_FILE) if file_nbytes is None else file_nbytes
        if fb < slot:
            raise InvalidArgumentError(f"file_size {fb} is smaller than one slot ({slot})")
        man = {
            "format": MMAP_FORMAT,
            "format_version": MMAP_FORMAT_VERSION,
            "store_format_version": FORMAT_VERSION,
            "key_algorithm": KEY_ALGORITHM,
            "checksum_algorithm": CHECKSUM_ALGORITHM,
            "record_fold": RECORD_FOLD,
            "record_nbytes": REC_NBYTES,
            "store_id": secrets.token_bytes(16).hex(),
            "generation": 1,
            "slot_nbytes": slot,
            "file_nbytes": fb // slot * slot,
            "budget_bytes": b,
            "created": time.time(),
        }
        self._write_manifest(man)

    def _write_manifest(self, man: Mapping[str, Any]) -> None:
        _fsutil.atomic_write(self._p("manifest.json"), json.dumps(man, indent=1, sort_keys=True).encode())

    def _disk_generation(self) -> int | None:
        """The generation the manifest on disk names, or ``None`` if it cannot be read."""
        try:
            gen = self._read_manifest().get("generation")
        except Exception:
            return None
        return gen if isinstance(gen, int) else None

    def _read_manifest(self) -> dict[str, Any]:
        path = self._p("manifest.json")
        raw = _fsutil.read_small_file(path, _MANIFEST_LIMIT)
        try:
            man = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            raise CorruptStoreError(f"{path} is not valid JSON",
                                    hint="restore the manifest or remove the store") from None
        if not isinstance(man, dict) or man.get("format") != MMAP_FORMAT:
            raise IncompatibleStoreError(f"{path} does not describe an mmap store (format {man.get('format')!r})"
                                         if isinstance(man, dict) else f"{path} is not a manifest")
        version = man.get("format_version")
        if version != MMAP_FORMAT_VERSION:
            raise IncompatibleStoreError(
                f"{self.path} is an mmap store of format version {version!r}; this build reads version "
                f"{MMAP_FORMAT_VERSION} only",
                hint="open it with the hostkv-providers version that wrote it, or remove the store")
        for field, want in (("key_algorithm", KEY_ALGORITHM), ("checksum_algorithm", CHECKSUM_ALGORITHM),
                            ("record_fold", RECORD_FOLD), ("record_nbytes", REC_NBYTES),
                            ("store_format_version", FORMAT_VERSION)):
            if man.get(field) != want:
                raise IncompatibleStoreError(f"{self.path}: {field} is {man.get(field)!r}, this build uses {want!r}")
        for field in ("generation", "slot_nbytes", "budget_bytes"):
            v = man.get(field)
            if type(v) is not int or v <= 0:
                raise CorruptStoreError(f"{path}: field {field} is {v!r}")
        if man["slot_nbytes"] % 4096 or man["slot_nbytes"] > 1 << 34:
            raise CorruptStoreError(f"{path}: slot size {man['slot_nbytes']} is not a multiple of 4096")
        sid = man.get("store_id")
        if not isinstance(sid, str) or not re.fullmatch(r"[0-9a-f]{32}", sid):
            raise CorruptStoreError(f"{path}: bad store_id")
        return man

    def _cleanup_dir(self) -> None:
        """Writer only: reclaim temp files and files of another generation (half-done
        compactions, R3); refuse symlinks and unknown files are left alone."""
        removed = _fsutil.remove_temp_files(self.path)
        if removed:
            self._problems_note(f"removed {len(removed)} leftover temp file(s)")
        for name in _fsutil.listdir(self.path):
            full = self._p(name)
            if os.path.islink(full):
                raise _unsafe(f"{full} is a symlink; symlinks inside a store are refused")
            m = re.match(r"^(?:data|index)\.(\d{1,9})\.", name)
            if m and int(m.group(1)) != self._gen and _KNOWN_NAME.match(name):
                with contextlib.suppress(OSError):
                    os.unlink(full)

    def _problems_note(self, text: str) -> None:
        self._problems.append(text)

    # -- loading the index -----------------------------------------------------------------------
    def _load_reader(self) -> None:
        """A reader's load, retried when the writer swaps files underneath (snapshot rotation,
        compaction deleting the old generation between our listing and our opens)."""
        for attempt in range(8):
            try:
                if attempt:
                    man = self._read_manifest()
                    self._manifest = man
                    self._gen = int(man["generation"])
                    self._idx = _Index(self._budget)
                    self._problems = []
                self._load()
                return
            except (CorruptStoreError, StorageIOError, FileNotFoundError):
                if attempt == 7:
                    raise
                time.sleep(0.01 * (attempt + 1))

    def _load(self) -> None:
        """Open data files and rebuild the index from snapshot + journal (module docstring)."""
        self._load_needs_snapshot = False
        sig = self._signature()  # before reading: a change made while we load triggers the next refresh
        self._open_data_files()
        snap, snap_seq = self._read_snapshot()
        jcols = self._read_journal(snap_seq)
        self._jrecords = jcols.shape[1]
        cols = np.concatenate([snap, jcols], axis=1) if jcols.shape[1] else snap
        self._apply_records(cols, n_snap=snap.shape[1])
        # new records must sort after everything the snapshot covers
        self._idx.clock = max(self._idx.clock, snap_seq + 1)
        self._state_sig = sig

    def _signature(self) -> tuple[Any, ...]:
        sig: list[Any] = []
        for name in ("manifest.json", self._snap_name(self._gen), self._journal_name(self._gen)):
            try:
                st = os.stat(self._p(name))
                sig.append((st.st_ino, st.st_size, st.st_mtime_ns))
            except OSError:
                sig.append(None)
        sig.append(tuple(sorted(n for n in _fsutil.listdir(self.path) if _DATA_NAME.match(n))))
        return tuple(sig)

    def _open_data_files(self) -> None:
        for sf in self._files.values():
            sf.close()
        self._files = {}
        for name in sorted(_fsutil.listdir(self.path)):
            m = _DATA_NAME.match(name)
            if not m or int(m.group(1)) != self._gen:
                continue
            sf = SlotFile.open(self._p(name), writable=not self._readonly, store_id=self._store_id,
                               slot_nbytes=self._slot)
            if sf.file_id != int(m.group(2)) or sf.file_id in self._files:
                sf.close()
                raise CorruptStoreError(f"{name}: file id {sf.file_id} does not match its name")
            sf.io = self._io
            self._files[sf.file_id] = sf
        self._free = {fid: np.ones(sf.slot_count, np.bool_) for fid, sf in self._files.items()}

    def _read_snapshot(self) -> tuple[npt.NDArray[np.uint64], int]:
        path = self._p(self._snap_name(self._gen))
        try:
            fd = _fsutil.open_private(path, os.O_RDONLY)
        except FileNotFoundError:
            return np.zeros((_WORDS, 0), np.uint64), 0
        mm: mmap.mmap | None = None
        try:
            size = os.fstat(fd).st_size
            head = os.pread(fd, 64, 0)
            if size > _SNAP_HEADER + (1 << 20):
                # large: map it populated (one call instead of a fault per 4 KiB) and let the
                # column transpose be the only copy
                mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                               prot=mmap.PROT_READ)
                body: bytes | memoryview = memoryview(mm)[_SNAP_HEADER:]
            else:
                body = _read_exact(fd, _SNAP_HEADER, max(0, size - _SNAP_HEADER))
        except OSError as exc:
            raise _fsutil.io_error(exc, f"reading {path}") from exc
        finally:
            os.close(fd)
        try:
            return self._parse_snapshot(head, body)
        finally:
            if mm is not None:
                if isinstance(body, memoryview):
                    body.release()
                mm.close()

    def _parse_snapshot(self, head: bytes, body: bytes | memoryview) -> tuple[npt.NDArray[np.uint64], int]:
        seq = 0
        ok_header = (len(head) == 64 and head[:8] == _SNAP_MAGIC
                     and xxhash.xxh3_64_intdigest(head[:56]) == int.from_bytes(head[56:64], "little")
                     and head[8:24] == self._store_id)
        count = len(body) // REC_NBYTES
        if ok_header:
            seq = int.from_bytes(head[24:32], "little")
            declared = int.from_bytes(head[32:40], "little")
            if declared != count:
                self._problems_note(f"snapshot declares {declared} records, holds {count}")
                self._load_needs_snapshot = True
        else:
            self._problems_note("snapshot header damaged: salvaged its records")
            self._load_needs_snapshot = True
        view = np.frombuffer(body[: count * REC_NBYTES], RECORD_DTYPE)
        W = _columns(view)
        del view
        good = _fold_columns(W)
        if not good.all():
            self._problems_note(f"snapshot: {int((~good).sum())} damaged record(s) skipped")
            self._load_needs_snapshot = True
            W = W[:, good]
            W[11] = 0  # positions moved: parent hints are void, parents are searched instead
        return W, seq

    def _read_journal(self, after_seq: int) -> npt.NDArray[np.uint64]:
        path = self._p(self._journal_name(self._gen))
        try:
            fd = _fsutil.open_private(path, os.O_RDONLY)
        except FileNotFoundError:
            self._jvalid_end = REC_NBYTES
            self._last_mode = 0
            return np.zeros((_WORDS, 0), np.uint64)
        try:
            size = os.fstat(fd).st_size
            raw = _read_exact(fd, 0, size)
        except OSError as exc:
            raise _fsutil.io_error(exc, f"reading {path}") from exc
        finally:
            os.close(fd)
        head = raw[:REC_NBYTES]
        if not (len(head) == REC_NBYTES and head[:8] == _JOURNAL_MAGIC
                and xxhash.xxh3_64_intdigest(head[:152]) == int.from_bytes(head[152:160], "little")):
            self._problems_note("journal header damaged: records salvaged")
            self._load_needs_snapshot = True
        else:
            self._last_mode = head[32]
        # the journal is preallocated ahead with zeros: parse only up to the last nonzero byte
        body = raw[REC_NBYTES:]
        used = len(body.rstrip(b"\0"))
        count = -(-used // REC_NBYTES)
        chunk = body[: count * REC_NBYTES].ljust(count * REC_NBYTES, b"\0")
        recs = np.frombuffer(chunk, RECORD_DTYPE)
        good = _folds_ok(recs) & (recs["op"] != 0)
        nz = np.flatnonzero(good)
        last = int(nz[-1]) + 1 if len(nz) else 0
        self._jvalid_end = REC_NBYTES + last * REC_NBYTES
        bad_inside = int(last - good[:last].sum())
        tail = recs[last:]
        if len(tail):
            # Records after the last valid one: a torn append (kill -9 or a power cut mid-write)
            # leaves the record's end zero; a complete record that does not verify is damage.
            complete = int((tail["fold"] != 0).sum())
            if complete:
                bad_inside += complete
            else:
                self._torn_tail = True
        if bad_inside:
            self._problems_note(f"journal: {bad_inside} damaged record(s) skipped")
            self._load_needs_snapshot = True
        recs = recs[:last][good[:last]]
        out = _columns(np.ascontiguousarray(recs[recs["seq"] > after_seq]))
        return out

    def _apply_records(self, W: npt.NDArray[np.uint64], n_snap: int = 0) -> None:
        """Final state of the records ``W`` (uint64 columns, see :func:`_columns`; snapshot
        records first, then the journal's, in order; the last record per key wins), validated
        against the slot headers and the tree, loaded into the index; free maps rebuilt.
        Vectorised end to end: one sort of the keys, one of the slots, no Python work per entry."""
        u8 = np.uint64(0xFF)
        n_all = W.shape[1]
        max_seq = int(W[18].max()) if n_all else 0
        max_gen = int(W[15].max()) if n_all else 0
        op_all = W[0] & u8
        ent_mask = (op_all == OP_SEAL) | (op_all == OP_DROP)
        anchor_pos = np.flatnonzero(op_all == OP_ANCHOR)
        if ent_mask.all():
            ent_pos = np.arange(n_all)
            E = W
        else:
            ent_pos = np.flatnonzero(ent_mask)
            E = W[:, ent_pos]
        m = E.shape[1]
        k64 = E[1]
        order = np.argsort(k64, kind="stable")
        sk = k64[order]
        if m and m == n_all and bool((sk[1:] != sk[:-1]).all()) and bool(((E[0] & u8) == OP_SEAL).all()):
            self._apply_unique(W, order, sk, n_snap, max_seq, max_gen, anchor_pos)
            return
        is_win = np.zeros(m, np.bool_)
        winner_of = np.zeros(m, np.int64)
        if m:
            ends = np.flatnonzero(np.append(sk[1:] != sk[:-1], True))
            sizes = np.diff(np.concatenate([[-1], ends]))
            last = order[ends]  # the latest record of each 64-bit key prefix
            winner_of[order] = np.repeat(last, sizes)
            exact = True
            if (sizes > 1).any():
                members = order[np.repeat(sizes > 1, sizes)]
                exact = bool((E[1:5][:, members] == E[1:5][:, winner_of[members]]).all())
            if exact:
                is_win[last] = True
            else:
                # distinct keys sharing a 64-bit prefix (astronomically rare, or a hostile file)
                latest: dict[bytes, int] = {}
                for i in range(m):
                    latest[E[1:5, i].tobytes()] = i
                for i in range(m):
                    winner_of[i] = latest[E[1:5, i].tobytes()]
                is_win[list(latest.values())] = True
        is_win &= (E[0] & u8) == OP_SEAL
        lp = np.flatnonzero(is_win)  # live records, in record order
        n = len(lp)
        L = E if n == m else E[:, lp]
        live_of_ent = np.full(m, -1, np.int64)
        live_of_ent[lp] = np.arange(n)
        order_w = order[is_win[order]]
        base_row = live_of_ent[order_w]  # live rows in key-prefix order
        base_k64 = k64[order_w]
        # parents: the snapshot's position hints (no search), a binary search for the rest
        has_parent = ((L[0] >> np.uint64(8)) & np.uint64(1)).astype(np.bool_)
        prow = np.full(n, -1, np.int64)
        if n:
            hint = L[11].astype(np.int64) - 1
            rec_pos = ent_pos[lp]
            use = has_parent & (hint >= 0) & (hint < n_snap) & (rec_pos < n_snap)
            cand = np.full(n, -1, np.int64)
            if use.any():
                ent_of_pos = np.full(n_all, -1, np.int64)
                ent_of_pos[ent_pos] = np.arange(m)
                hp = ent_of_pos[hint[use]]
                got = np.full(len(hp), -1, np.int64)
                ok_hp = hp >= 0
                got[ok_hp] = live_of_ent[winner_of[hp[ok_hp]]]
                cand[use] = got
            ok_c = cand >= 0
            ci = np.flatnonzero(ok_c)
            same = np.ones(len(ci), np.bool_)
            for w in range(4):
                same &= L[1 + w][cand[ci]] == L[5 + w][ci]
            prow[ci[same]] = cand[ci[same]]
            rest = np.flatnonzero(has_parent & (prow < 0))
            if len(rest):
                pos = np.minimum(np.searchsorted(base_k64, L[5][rest]), n - 1)
                for _ in range(8):  # walk over equal 64-bit prefixes (rare)
                    r = base_row[pos]
                    eq_prefix = base_k64[pos] == L[5][rest]
                    hit = eq_prefix.copy()
                    for w in range(4):
                        hit &= L[1 + w][r] == L[5 + w][rest]
                    prow[rest[hit]] = r[hit]
                    nxt = ~hit & eq_prefix & (pos + 1 < n)
                    if not nxt.any():
                        break
                    rest, pos = rest[nxt], pos[nxt] + 1
        self._finish_load(L, prow, has_parent, ent_pos[lp], n_snap, base_k64, base_row)
        self._finish_anchors_and_gens(W, anchor_pos, max_seq, max_gen)

    def _finish_anchors_and_gens(self, W: npt.NDArray[np.uint64], anchor_pos: npt.NDArray[np.intp],
                                 max_seq: int, max_gen: int) -> None:
        idx = self._idx
        anchors = _records_of(W, anchor_pos)
        seal_seq = idx.tick
        # anchors (rare; Python per anchor): valid only if newer than the entry's seal
        idx.anchors = {}
        if len(anchors):
            for rec in anchors:
                key = rec["key"].tobytes()
                row = idx.row_of(key)
                if row < 0 or int(rec["seq"]) < int(seal_seq[row]):  # older than the entry's seal
                    continue
                nlen = int(rec["name_len"])
                name_raw = rec.tobytes()[40 : 40 + min(nlen, 64)]
                try:
                    name = check_anchor_name(name_raw.decode("ascii"))
                except (UnicodeDecodeError, InvalidArgumentError):
                    self._problems_note("an anchor record with an invalid name was skipped")
                    continue
                table = idx.anchors.setdefault(row, {})
                old = table.pop(name, None)
                if old is not None:
                    self._release_run(old.file, old.slot, old.nslots)
                    idx.add_cost(row, -old.cost)
                a = _Anchor(int(rec["file"]), int(rec["slot"]), int(rec["nslots"]), int(rec["nbytes"]),
                            int(rec["gen"]), int(rec["checksum"]), int(rec["nslots"]) * self._slot)
                if rec["flags"] & _REC_DELETE:  # an anchor dropped by verify(repair=True)
                    if not table:
                        idx.anchors.pop(row, None)
                    continue
                if not self._run_ok(a.file, a.slot, a.nslots, a.nbytes) or not self._run_free(a.file, a.slot, a.nslots):
                    continue
                hdr_ok = self._files[a.file].check(a.slot, key=key, generation=a.gen, nbytes=a.nbytes,
                                                   checksum=a.checksum, verify=False) == ReadResult.OK
                if not hdr_ok:
                    self._problems_note(f"anchor {name!r} of {key.hex()[:16]} did not match its slot header: dropped")
                    self._load_needs_snapshot = True
                    continue
                table[name] = a
                self._mark_used(a.file, np.array([a.slot]), np.array([a.nslots]))
                idx.cost[row] += a.cost
                idx.sealed_cost += a.cost
                idx.used_cost += a.cost
        idx.clock = max(idx.clock, max_seq + 1)
        # a header written just before a crash may carry a generation no record mentions: the
        # writer starts above every generation on the medium (readers never write)
        hdr_gen = 0 if self._readonly else self._max_header_gen()
        self._next_gen = max(self._next_gen, max_gen + 1, hdr_gen + 1)

    def _max_header_gen(self) -> int:
        best = 0
        for sf in self._files.values():
            h = sf.headers(populate=sf.slot_count > 4096)
            if len(h):
                best = max(best, int(h["generation"].max()))
        return best

    def _finish_load(self, L: npt.NDArray[np.uint64], prow: npt.NDArray[np.int64],
                     has_parent: npt.NDArray[np.bool_], rec_pos: npt.NDArray[np.intp], n_snap: int,
                     base_k64: npt.NDArray[np.uint64], base_row: npt.NDArray[np.int64]) -> None:
        """Validate the live records ``L`` (parents ``prow`` resolved), prune, load the index and
        the free maps.  ``rec_pos``: each live record's position among all records."""
        idx = self._idx
        n = L.shape[1]
        # Slot headers are compared for journal records always, for snapshot records when the
        # last writer may have reused slots without journaling it first (durability=none, an
        # unknown or damaged journal).  Every read compares the header again anyway; this only
        # makes the accounting exact at open.  Snapshot records of a sync/process writer cannot
        # be stale after kill -9: a slot is reused only after its drop record is journaled.
        check_all = self._last_mode not in (1, 2) or bool(self._problems)
        subset = None if check_all else np.flatnonzero(rec_pos >= n_snap)
        ok = self._records_valid(L, subset)
        dropped_stale = int(n - ok.sum())
        ok &= ~has_parent | (prow >= 0)
        keep, parent_rows = self._prune(ok, prow)
        dropped_tree = n - len(keep) - dropped_stale
        if len(keep) != n:
            L = L[:, keep]
            remap = np.full(n, -1, np.int64)
            remap[keep] = np.arange(len(keep))
            nb = remap[base_row]
            sel = nb >= 0
            base_row, base_k64 = nb[sel], base_k64[sel]
        if dropped_stale:
            self._stale_at_open = dropped_stale
            self._problems_note(f"{dropped_stale} index record(s) did not match their slot header "
                                "(or overlapped another): entries dropped")
            self._load_needs_snapshot = True
        if dropped_tree > 0:
            self._orphans_at_open = dropped_tree
            self._problems_note(f"{dropped_tree} entries without a valid stored parent dropped")
            self._load_needs_snapshot = True
        nslots = (L[0] >> np.uint64(32)).astype(np.int64)
        idx.load_columns(L, parent_rows, nslots * self._slot, base_k64, base_row)
        files = (L[13] & np.uint64(0xFFFFFFFF)).astype(np.int64)
        slots = (L[13] >> np.uint64(32)).astype(np.int64)
        for fid in self._files:
            sel = files == fid
            self._mark_used(fid, slots[sel], nslots[sel])

    def _apply_unique(self, W: npt.NDArray[np.uint64], order: npt.NDArray[np.intp], sk: npt.NDArray[np.uint64],
                      n_snap: int, max_seq: int, max_gen: int, anchor_pos: npt.NDArray[np.intp]) -> None:
        """The common reopen: only seal records with distinct keys (a snapshot, maybe a short
        journal): no last-record-wins bookkeeping, parents straight from the hints."""
        n = W.shape[1]
        has_parent = ((W[0] >> np.uint64(8)) & np.uint64(1)).astype(np.bool_)
        hint = W[11].astype(np.int64) - 1
        prow = np.full(n, -1, np.int64)
        pos = np.arange(n)
        use = has_parent & (hint >= 0) & (hint < n_snap) & (pos < n_snap)
        cand = np.where(use, hint, 0)
        same = use.copy()
        for w in range(4):
            same &= W[1 + w][cand] == W[5 + w]
        prow[same] = cand[same]
        rest = np.flatnonzero(has_parent & ~same)
        if len(rest):
            at = np.minimum(np.searchsorted(sk, W[5][rest]), n - 1)
            r = order[at]
            hit = sk[at] == W[5][rest]
            for w in range(4):
                hit &= W[1 + w][r] == W[5 + w][rest]
            prow[rest[hit]] = r[hit]
        self._finish_load(W, prow, has_parent, pos, n_snap, sk, order.astype(np.int64))
        self._finish_anchors_and_gens(W, anchor_pos, max_seq, max_gen)

    def _records_valid(self, L: npt.NDArray[np.uint64], subset: npt.NDArray[np.intp] | None = None
                       ) -> npt.NDArray[np.bool_]:
        """Vectorised over live record columns: a plausible run inside a known file, not
        overlapping a newer record's run, whose slot header echoes the record (magic, key,
        generation, size, checksum; page, not anchor).  One sort by slot serves both checks and
        makes the header-table reads sequential."""
        n = L.shape[1]
        ok = np.zeros(n, np.bool_)
        if not n:
            return ok
        nslots = (L[0] >> np.uint64(32)).astype(np.int64)
        tag_len = (L[0] >> np.uint64(16)) & np.uint64(0xFF)
        nbytes = L[14].astype(np.int64)
        file = (L[13] & np.uint64(0xFFFFFFFF)).astype(np.int64)
        slot = (L[13] >> np.uint64(32)).astype(np.int64)
        shape_ok = (nslots >= 1) & (nbytes >= 1) & (nbytes <= nslots * self._slot) \
            & (nslots == -(-nbytes // self._slot)) & (tag_len <= _TAG_MAX)
        if subset is not None and not len(subset):
            # only trusted records (a clean sync/process snapshot, no journal): shape and bounds
            for fid, sf in self._files.items():
                ok |= shape_ok & (file == fid) & (slot + nslots <= sf.slot_count)
            return ok
        so = np.argsort((file << 40) | slot, kind="stable")
        f, sl, e = file[so], slot[so], slot[so] + nslots[so]
        clash = np.flatnonzero((f[1:] == f[:-1]) & (sl[1:] < e[:-1]))
        if len(clash):
            seq = L[18][so]
            older = np.where(seq[clash] < seq[clash + 1], so[clash], so[clash + 1])
            shape_ok[older] = False
        in_subset = None
        if subset is not None:
            in_subset = np.zeros(n, np.bool_)
            in_subset[subset] = True
        for fid, sf in self._files.items():
            rows = so[(f == fid)]
            rows = rows[shape_ok[rows] & (slot[rows] + nslots[rows] <= sf.slot_count)]
            if in_subset is not None:
                ok[rows[~in_subset[rows]]] = True  # trusted (see the caller)
                rows = rows[in_subset[rows]]
            if not len(rows):
                continue
            T = sf.headers(populate=len(rows) > 4096).view(np.uint64).reshape(sf.slot_count, 16)
            H = T[slot[rows]]
            match = ((H[:, 0] == np.uint64(SLOT_MAGIC)) & (H[:, 9] == L[15][rows]) & (H[:, 10] == L[14][rows])
                     & (H[:, 11] == L[16][rows]) & ((H[:, 12] & np.uint64(FLAG_ANCHOR)) == 0))
            for w in range(4):
                match &= H[:, 1 + w] == L[1 + w][rows]
            ok[rows[match]] = True
        return ok

    @staticmethod
    def _prune(ok: npt.NDArray[np.bool_], prow: npt.NDArray[np.int64]) -> tuple[npt.NDArray[np.intp],
                                                                                  npt.NDArray[np.int64]]:
        """Keep a node only if it and every ancestor are ``ok`` and the chain reaches a root
        (cycles never do); returns ``(kept indices, their parents renumbered)``."""
        n = len(ok)
        ok = ok.copy()
        anc = prow.copy()
        for _ in range(64):  # pointer jumping: 2**64 > any chain
            idx = np.flatnonzero(anc >= 0)
            if not len(idx):
                break
            up = anc[idx]
            ok[idx] &= ok[up]
            anc[idx] = anc[up]
        ok &= anc < 0
        keep = np.flatnonzero(ok)
        if len(keep) == n:
            return keep, prow
        remap = np.full(n, -1, np.int64)
        remap[keep] = np.arange(len(keep))
        newp = prow[keep]
        return keep, np.where(newp >= 0, remap[np.maximum(newp, 0)], -1)

    # -- slot allocation -------------------------------------------------------------------------
    def _mark_used(self, fid: int, slots: npt.NDArray[np.int64], nslots: npt.NDArray[np.int64]) -> None:
        if not len(slots):
            return
        free = self._free[fid]
        if int(nslots.max()) == 1:
            free[slots] = False
            return
        offs = np.arange(int(nslots.sum())) - np.repeat(np.cumsum(nslots) - nslots, nslots)
        free[np.repeat(slots, nslots) + offs] = False

    def _run_ok(self, fid: int, slot: int, nslots: int, nbytes: int) -> bool:
        sf = self._files.get(fid)
        return (sf is not None and nslots >= 1 and slot >= 0 and slot + nslots <= sf.slot_count
                and 0 <= nbytes <= nslots * self._slot and nslots == run_nslots(nbytes, self._slot))

    def _run_free(self, fid: int, slot: int, nslots: int) -> bool:
        return bool(self._free[fid][slot : slot + nslots].all())

    def _release_run(self, fid: int, slot: int, nslots: int) -> None:
        free = self._free.get(fid)
        if free is not None:
            free[slot : slot + nslots] = True

    def _find_run(self, nslots: int) -> tuple[int, int] | None:
        """First-fit from a per-file cursor, scanning windows of the free map (amortised O(1)
        per allocation instead of a scan of a million-slot map), wrapping around once."""
        for fid, free in self._free.items():  # file ids are added in increasing order
            size = len(free)
            if size < nslots:
                continue
            start = self._cursor.get(fid, 0) % size
            if nslots == 1 and free.item(start):  # the common case (slots freed in order): no scan
                free[start] = False
                self._cursor[fid] = start + 1
                return fid, start
            for lo, hi in ((start, size), (0, min(size, start + nslots))):
                pos = lo
                while pos < hi:
                    end = min(hi, pos + 65536) if nslots == 1 else hi
                    window = free[pos:end]
                    if nslots == 1:
                        i = int(window.argmax())
                        if window[i]:
                            s = pos + i
                            free[s] = False
                            self._cursor[fid] = s + 1
                            return fid, s
                    else:
                        c = np.concatenate([[0], np.cumsum(window, dtype=np.int64)])
                        starts = np.flatnonzero(c[nslots:] - c[:-nslots] == nslots)
                        if len(starts):
                            s = pos + int(starts[0])
                            free[s : s + nslots] = False
                            self._cursor[fid] = s + nslots
                            return fid, s
                    pos = end
        return None

    def _allocate(self, nslots: int, protect: int) -> tuple[int, int]:
        """A free run of ``nslots``; grows the store by a data file or evicts LRU leaves when the
        free space is fragmented.  Caller holds the lock and already reserved the budget."""
        while True:
            found = self._find_run(nslots)
            if found is not None:
                return found
            capacity = sum(len(f) for f in self._free.values()) * self._slot
            if capacity < self._budget + max(self._file_slots, nslots) * self._slot:
                self._add_data_file(max(self._file_slots, nslots))
                continue
            idx = self._idx
            if protect >= 0:
                idx._hold(protect)
            try:
                victims = idx.evict_cost(1)
            finally:
                if protect >= 0:
                    idx._unhold(protect)
            if not victims:
                raise CapacityError(f"no run of {nslots} free slots (fragmented and nothing evictable)")
            self._free_rows_storage(victims, journal=True)

    def _discard_leftover(self, path: str) -> None:
        """Remove a data file nothing refers to — one whose creation failed after its rename and
        whose cleanup failed too — so that it can be created again (else: "already exists")."""
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise _fsutil.io_error(exc, f"removing the unused {path}") from exc

    def _add_data_file(self, nslots: int) -> None:
        fid = max(self._files, default=-1) + 1
        self._discard_leftover(self._p(self._data_name(self._gen, fid)))  # never one in use: ids are max+1
        # Durable in every mode (one sync per new data file): with durability=none a power cut
        # could leave the name on an empty or short file, and open refused the whole store.
        sf = SlotFile.create(self._p(self._data_name(self._gen, fid)), slot_nbytes=self._slot, slot_count=nslots,
                             file_id=fid, store_id=self._store_id)
        sf.io = self._io
        self._files[fid] = sf
        self._free[fid] = np.ones(nslots, np.bool_)

    # -- journal ---------------------------------------------------------------------------------
    def _journal_header(self) -> bytes:
        raw = bytearray(REC_NBYTES)
        raw[:8] = _JOURNAL_MAGIC
        raw[8:24] = self._store_id
        raw[24:32] = self._gen.to_bytes(8, "little")
        raw[32] = _MODE_CODE[self._durability]
        raw[152:160] = xxhash.xxh3_64_intdigest(bytes(raw[:152])).to_bytes(8, "little")
        return bytes(raw)

    def _open_journal_for_append(self) -> None:
        path = self._p(self._journal_name(self._gen))
        if not _fsutil.lexists(path, f"looking for {path}"):
            _fsutil.atomic_write(path, self._journal_header(), durable=self._durability != "none")
            self._jvalid_end = REC_NBYTES
        fd = _fsutil.open_private(path, os.O_RDWR)
        self._jfd = fd
        self._jend = self._jvalid_end
        size = _fsutil.check_private_fd(fd, path).st_size
        self._jalloc = size
        if size > self._jend:
            # zero a torn tail so that nothing past the last valid record can ever parse
            _fsutil.write_all(fd, bytes(size - self._jend), self._jend, "truncating the journal's torn tail")
        if self._jalloc < self._jend + _JOURNAL_CHUNK // 2:
            # room for the next records now, so a nearly full disk fails at open, not mid-seal
            new = -(-(self._jend + _JOURNAL_CHUNK) // _JOURNAL_CHUNK) * _JOURNAL_CHUNK
            _fsutil.fallocate(fd, self._jalloc, new - self._jalloc, "preallocating the index journal")
            self._jalloc = new

    def _encode(self, op: int, key: bytes, *, parent: bytes | None = None, tag: bytes = b"", name: bytes = b"",
                file: int = 0, slot: int = 0, nslots: int = 0, nbytes: int = 0, gen: int = 0, checksum: int = 0,
                created: float = 0.0, seq: int = 0, flags: int = 0) -> bytes:
        """One journal record (RECORD_DTYPE layout, packed with struct: no numpy per seal)."""
        if parent is not None:
            flags |= 1
        raw = bytearray(_REC_STRUCT.pack(op, flags, len(tag), len(name), nslots, key, parent or bytes(32),
                                         tag.ljust(16, b"\0"), 0, 0, file, slot, nbytes, gen, checksum, created,
                                         seq))
        if name:
            raw[40 : 40 + len(name)] = name
        return bytes(raw) + fold64_one(bytes(raw)).to_bytes(8, "little")

    def _append(self, records: Sequence[bytes]) -> None:
        """Write records at the journal's end (the page cache: survives kill -9).  Space ahead is
        ``posix_fallocate``-d in 256 KiB steps so a full disk fails *before* a record is torn."""
        if not records:
            return
        fd = self._jfd
        if fd is None:
            raise StorageIOError("the journal is not open for writing")
        blob = b"".join(records)
        need = self._jend + len(blob)
        if need > self._jalloc:
            new = -(-need // _JOURNAL_CHUNK) * _JOURNAL_CHUNK
            _fsutil.fallocate(fd, self._jalloc, new - self._jalloc, "growing the index journal")
            self._jalloc = new
        _fsutil.write_all(fd, blob, self._jend, "appending to the index journal")
        self._jend = need
        self._jrecords += len(records)

    def _flush_none(self, force: bool = False) -> None:
        """``durability=none``: write buffered records in batches (caller holds the lock)."""
        if self._nbuf and (force or len(self._nbuf) >= _NONE_BATCH
                           or time.monotonic() - self._nbuf_t > _NONE_INTERVAL):
            batch, self._nbuf = self._nbuf, []
            self._nbuf_t = time.monotonic()
            self._append(batch)

    def _journal(self, records: Sequence[bytes]) -> None:
        """Records that need no acknowledgement ordering (drops, anchors in none mode...)."""
        if self._durability == "none":
            self._nbuf.extend(records)
            self._flush_none()
        else:
            self._append(records)

    def _commit(self, record: bytes | Sequence[bytes]) -> None:
        """Make seal records durable per the mode; raise if they could not be (R7)."""
        records = [record] if isinstance(record, bytes) else list(record)
        if self._durability == "none":
            with self._lock:
                self._nbuf.extend(records)
                self._flush_none()
            return
        if self._durability == "process":
            with self._lock:
                self._check_failed()
                self._append(records)
            return
        # sync: group commit.  The first waiter leads: it syncs the data files, appends every
        # queued record with one write and syncs the journal once; everyone queued behind that
        # sync shares its outcome.  A failed sync fails them all and poisons the store (R7).
        mine = [_Pending(r) for r in records]
        with self._commit_cv:
            self._queue.extend(mine)
            # Wait until a leader's commit of them is *over* (a leader takes the whole queue at
            # once, so they go together), or until no leader runs and they are still queued:
            # then lead.  "Taken by a leader" is not enough: woken by the previous leader's
            # notify while a new leader was still syncing them, a seal returned before its
            # record was written -- acknowledged, and lost to a kill -9 right then (and not
            # failed by that leader's failed sync, R7).
            while not mine[0].done and (self._leader or mine[0] not in self._queue):
                self._commit_cv.wait()
            if mine[0].done:
                for p in mine:
                    if p.error is not None:
                        raise p.error
                return
            self._leader = True
        batch: list[_Pending] = []
        try:
            if self._commit_window > 0:
                time.sleep(self._commit_window)
            with self._commit_cv:
                batch, self._queue = self._queue, []
            err: BaseException | None = None
            try:
                with self._lock:
                    self._check_failed()
                    files = [self._files[f] for f in sorted(self._dirty_files) if f in self._files]
                    self._dirty_files.clear()
                for sf in files:
                    sf.sync()
                _fsutil.crash_point("mmap.commit.after_data_sync")
                with self._lock:
                    self._check_failed()
                    self._append([p.record for p in batch])
                    fd = self._jfd
                if fd is None:
                    raise StorageIOError("the journal is closed")
                _fsutil.sync_fd(fd, "syncing the index journal")
                with self._lock:
                    self._counters["syncs"] += 1
                    self._counters["group_commits"] += 1
            except BaseException as exc:
                err = exc
                with self._lock:
                    if isinstance(exc, StorageIOError) and self._failed is None:
                        self._failed = str(exc)
            for p in batch:
                p.error = err
        finally:
            with self._commit_cv:
                for p in batch:
                    p.done = True
                if not batch:  # interrupted before taking the queue: withdraw our own records
                    self._queue = [p for p in self._queue if p not in mine]
                self._leader = False
                self._commit_cv.notify_all()
        for p in mine:
            if p.error is not None:
                raise p.error

    def _check_failed(self) -> None:
        if self._failed is not None:
            raise StorageIOError(
                f"an earlier sync of this store failed ({self._failed}); no seal is acknowledged after it",
                hint="close and reopen the store: open re-validates every entry against its slot header")

    # -- snapshot --------------------------------------------------------------------------------
    def _maybe_snapshot(self) -> None:
        """Mark the periodic snapshot due (caller holds the lock).  The seal paths write it with
        :meth:`_snapshot_due` once they have released the lock."""
        if self._rotation is not None or self._jrecords >= max(self._snapshot_every, self._idx.count):
            self._snap_due = True

    def _snapshot_records(self) -> npt.NDArray[Any]:
        """The index as snapshot records: seals (live rows in row order), then anchors."""
        return _build_records(self._snapshot_columns())

    def _snapshot_columns(self) -> dict[str, Any]:
        """What a snapshot needs of the index, copied out (caller holds the lock): the live
        rows' columns as contiguous gathers, the parent keys, and the anchor records.  This is
        the part of a snapshot that must see one state of the index; :func:`_build_records`
        turns it into records anywhere (a million entries: ~0.1 s of gathers here against ~0.3
        s of strided stores into 160-byte records there)."""
        idx = self._idx
        rows = idx.live_rows()
        par = idx.parent[rows]
        hasp = par >= 0
        cols: dict[str, Any] = {
            "key": idx.key[rows], "parent_row": par, "parent_key": idx.key[par[hasp]], "tag": idx.tag[rows],
            "tag_len": idx.tag_len[rows], "file": idx.file[rows], "slot": idx.slot[rows],
            "nslots": idx.nslots[rows], "nbytes": idx.nbytes[rows], "gen": idx.gen[rows], "checksum": idx.csum[rows],
            "created": idx.created[rows], "seq": idx.tick[rows], "rows": rows, "n_rows": idx.n,
        }
        extra = []
        for row, table in idx.anchors.items():
            if not idx.alive[row]:
                continue
            for name, a in table.items():
                extra.append(self._encode(OP_ANCHOR, idx.key[row].tobytes(), name=name.encode(), file=a.file,
                                          slot=a.slot, nslots=a.nslots, nbytes=a.nbytes, gen=a.gen,
                                          checksum=a.checksum, seq=int(idx.tick[row]) + 0))
        cols["anchors"] = extra
        cols["clock"] = idx.clock
        return cols

    def _snapshot_blob(self) -> bytes:
        """The snapshot of the index as it is now, stamped with a fresh seq: every journal record
        so far has a smaller seq, every later one a larger (caller holds the lock)."""
        head, cols = self._snapshot_capture()
        return head + _build_records(cols).tobytes()

    def _snapshot_capture(self) -> tuple[bytes, dict[str, Any]]:
        """The padded snapshot header (a fresh seq) and :meth:`_snapshot_columns` (caller holds
        the lock)."""
        self._flush_none(force=True)
        idx = self._idx
        idx.clock += 1
        seq = idx.clock
        cols = self._snapshot_columns()
        nrecs = len(cols["rows"]) + len(cols["anchors"])
        head = bytearray(64)
        head[:8] = _SNAP_MAGIC
        head[8:24] = self._store_id
        head[24:32] = seq.to_bytes(8, "little")
        head[32:40] = nrecs.to_bytes(8, "little")
        head[40:48] = self._gen.to_bytes(8, "little")
        head[56:64] = xxhash.xxh3_64_intdigest(bytes(head[:56])).to_bytes(8, "little")
        return bytes(head).ljust(_SNAP_HEADER, b"\0"), cols

    def _snapshot(self) -> None:
        """Write a snapshot (atomically), then rotate the journal to the records after it, all
        under the lock (open, close, repair).  The seal paths use :meth:`_snapshot_due`."""
        with self._lock:
            self._snap_epoch += 1  # a snapshot the seal path is writing meanwhile is obsolete
            self._rotation = None
            blob = self._snapshot_blob()
            # data referenced by the snapshot must be durable before the snapshot can replace a
            # journal that would otherwise still describe it after a power cut
            # (and the files a seal-path snapshot took out of _dirty_files and may still be syncing)
            for fid in sorted(self._dirty_files | self._snap_syncing):
                if fid in self._files:
                    self._files[fid].sync()
            self._dirty_files.clear()
            _fsutil.atomic_write(self._p(self._snap_name(self._gen)), blob, durable=True)
            _fsutil.crash_point("mmap.snapshot.after_snap")
            # every journal record so far has seq < seq: the new journal starts empty
            self._install_journal(b"")

    def _install_journal(self, tail: bytes) -> None:
        """Replace the journal by a fresh one holding ``tail`` (whole records), atomically, and
        append to it from now on (caller holds the lock, no seal between its journal record and
        its index entry)."""
        jpath = self._p(self._journal_name(self._gen))
        tmp = _fsutil.write_temp(jpath, self._journal_header() + tail, durable=True)
        _fsutil.install_temp(tmp, jpath, durable=False)  # the directory sync follows, below
        # From here the new file is the journal: if it cannot be made durable or opened, the
        # open descriptor still points at the old (unlinked) one and records appended there
        # would be lost, so the store takes no more seals until it is reopened.
        try:
            _fsutil.fsync_dir(self.path)
            if self._jfd is not None:
                os.close(self._jfd)
                self._jfd = None
            self._jvalid_end = REC_NBYTES + len(tail)
            self._open_journal_for_append()
        except BaseException as exc:
            if self._failed is None:
                self._failed = f"the index journal could not be replaced ({exc!r})"
            raise
        self._jrecords = len(tail) // REC_NBYTES
        _fsutil.crash_point("mmap.snapshot.after_rotate")

    def _snapshot_due(self) -> None:
        """Write the periodic snapshot a seal found due, holding the provider lock only to capture
        the index and to install the file, not for the data syncs and the write (a second or
        more at a million entries, which would stall every read, lookup and lease meanwhile).

        Steps: (1) under the lock, with no seal between its journal record and its index entry,
        the live rows' columns (the snapshot's seq ``S``) and the journal offset it covers; (2)
        unlocked, the records built, the data files synced, the records written to a synced
        temp file; (3) under the lock,
        the temp file renamed over the snapshot unless another snapshot or a compaction came in
        between, then the journal rotated to the records appended since (1), all ``> S``.  The
        rotation waits while a seal is between its record and its entry (a group commit may
        still sync the old journal): the old journal stays valid behind the new snapshot (the
        loader skips records ``<= S``) and a later seal rotates it.

        Errors do not fail the seal that ran this (it is in the journal and the index already):
        they are logged and counted, the snapshot stays due; a failed data sync poisons the store
        (R7), so the *next* seal fails with it.
        """
        if not self._snap_due or not self._snap_mutex.acquire(blocking=False):
            return
        try:
            self._write_due_snapshot()
        except HostKVError as exc:
            with self._lock:
                self._counters["snapshot_failures"] += 1
                self._snap_due = True
            _log.warning("mmap %s: periodic snapshot failed: %s", self.path, exc)
        finally:
            self._snap_mutex.release()

    def _write_due_snapshot(self) -> None:
        """:meth:`_snapshot_due` once its mutex is held."""
        with self._lock:
            if (not self._snap_due or self._closed or self._readonly or self._failed is not None
                    or self._jfd is None or self._unfinished):
                return
            if self._rotation is not None:
                self._snap_due = False
                self._rotate_journal()
                return
            # under the lock only the gathers of the live rows; records and the write follow
            head, cols = self._snapshot_capture()
            gen, epoch, cut = self._gen, self._snap_epoch, self._jend
            dirty = sorted(self._dirty_files)
            files = [self._files[f] for f in dirty if f in self._files]
            self._dirty_files.clear()
            self._snap_syncing = set(dirty)
            self._snap_due = False
        path = self._p(self._snap_name(gen))
        try:
            for sf in files:
                try:
                    sf.sync()
                except StorageIOError as exc:
                    if sf.closed:  # a compaction or close() replaced it: this snapshot is moot
                        continue
                    with self._lock:
                        if self._failed is None:
                            self._failed = str(exc)
                    raise
            recs = _build_records(cols)
            tmp = _fsutil.write_temp(path, [head, memoryview(recs.view(np.uint8).data)], durable=True)
        except BaseException:
            with self._lock:
                self._dirty_files.update(dirty)
                self._snap_syncing = set()
                self._snap_due = True
            raise
        with self._lock:
            self._snap_syncing = set()
            if (self._snap_epoch != epoch or self._gen != gen or self._closed or self._jfd is None
                    or self._failed is not None):
                with contextlib.suppress(OSError):
                    os.unlink(tmp)  # obsolete: another snapshot or a new generation came first
                return
            _fsutil.install_temp(tmp, path, durable=True)
            _fsutil.crash_point("mmap.snapshot.after_snap")
            self._snap_epoch += 1
            self._rotation = (gen, cut)
            self._rotate_journal()

    def _rotate_journal(self) -> None:
        """The rotation owed by an installed snapshot: a new journal with the records appended
        since the snapshot's cut (caller holds the lock); postponed while a seal is between its
        journal record and its index entry."""
        assert self._rotation is not None
        gen, cut = self._rotation
        if gen != self._gen or self._jfd is None:
            self._rotation = None
            return
        if self._unfinished:
            self._snap_due = True  # the next seal to finish tries again
            return
        n = self._jend - cut
        try:
            tail = _read_exact(self._jfd, cut, n)
        except OSError as exc:
            raise _fsutil.io_error(exc, "reading the journal's tail to rotate it") from exc
        if len(tail) != n:
            raise StorageIOError(f"the journal ends before the {n} bytes appended since the snapshot")
        self._install_journal(tail)
        self._rotation = None

    # -- lookups ---------------------------------------------------------------------------------
    def present(self, keys: Sequence[bytes]) -> list[bool]:
        ks = self._keys(keys)
        self._check_usable()
        with self._lock:
            self._check_usable()
            return [self._idx.row_of(k) >= 0 for k in ks]

    def longest_prefix(self, keys: Sequence[bytes]) -> int:
        ks = self._keys(keys)
        self._check_usable()
        with self._lock:
            self._check_usable()
            n = 0
            for k in ks:
                if self._idx.row_of(k) < 0:
                    break
                n += 1
            return n

    def in_flight(self, key: bytes) -> bool:
        k = self._key(key)
        self._check_usable()
        with self._lock:
            self._check_usable()
            return k in self._idx.flights

    def entry(self, key: bytes) -> EntryInfo | None:
        k = self._key(key)
        self._check_usable()
        with self._lock:
            self._check_usable()
            row = self._idx.row_of(k)
            return None if row < 0 else self._info(row)

    def _info(self, row: int) -> EntryInfo:
        idx = self._idx
        table = idx.anchors.get(row)
        return EntryInfo(idx.key_of(row), idx.parent_key(row), int(idx.nbytes[row]), idx.tag_of(row),
                         int(idx.csum[row]), float(idx.created[row]), float(idx.used[row]),
                         {n: a.nbytes for n, a in table.items()} if table else {})

    def iter_entries(self) -> Iterator[EntryInfo]:
        """Every sealed entry (a snapshot taken under the lock; order unspecified)."""
        self._check_usable()
        with self._lock:
            self._check_usable()
            infos = [self._info(int(r)) for r in self._idx.live_rows()]
        return iter(infos)

    # -- writes ----------------------------------------------------------------------------------
    def _need_writer(self, what: str) -> None:
        if self._readonly:
            raise InvalidArgumentError(f"{what}: this mmap store is open read-only (readonly=true)",
                                       hint="open it without readonly=true in the one writer process")

    def reserve(self, key: bytes, parent: bytes | None, nbytes: int, *, salt_tag: str = "") -> Reservation | None:
        k, p, nbytes = self._reserve_args(key, parent, nbytes, salt_tag, tag_max=_TAG_MAX)
        self._check_usable()
        with self._lock:
            self._check_usable()
            self._need_writer("reserve")
            self._check_failed()
            res = self._reserve_locked(k, p, nbytes, salt_tag)
            if res is None:
                return None
            sf = self._files[res.file]
        # Zero the run's headers before any byte changes (slot protocol step 1).
        sf.begin_write(res.slot, res.nslots)
        _fsutil.crash_point("mmap.reserve.after_clear")
        return res

    def _reserve_locked(self, k: Key, p: Key | None, nbytes: int, salt_tag: str,
                        pending_ok: Container[Key] = ()) -> _MmapReservation | None:
        """Budget, index flight and a free run for a reservation (caller holds the lock and zeroes
        the run's slot headers before writing); ``None`` for a sealed key (dedup)."""
        nslots = run_nslots(nbytes, self._slot)
        cost = nslots * self._slot
        if cost > self._budget:
            raise CapacityError(f"{nbytes} bytes exceed the whole budget of {self._budget}")
        ok, evicted, prow = self._idx.begin(k, p, cost, pending_ok)
        if not ok:
            self._counters["dedup"] += 1
            return None
        try:
            self._free_rows_storage(evicted, journal=True)
            fid, slot = self._allocate(nslots, prow)
        except BaseException:
            self._idx.cancel(k)
            raise
        gen = self._next_gen
        self._next_gen += 1
        return _MmapReservation(self, k, p, nbytes, salt_tag, fid, slot, nslots, gen)

    def _own(self, reservation: Reservation) -> _MmapReservation:
        return self._own_reservation(reservation, _MmapReservation)

    def write(self, reservation: Reservation, offset: int, data: object) -> None:
        view = readable_bytes(data)
        self._check_usable()
        res = self._own(reservation)
        span = res.check_write(offset, view.nbytes)
        # No provider lock: the run is private to its reservation until seal.
        whole = span.offset == 0 and span.nbytes == res.nbytes
        digest = xxhash.xxh3_64_intdigest(view) if whole else None
        self._files[res.file].write(res.slot, res.nbytes, span.offset, view)
        res.digest = digest
        res.mark_written(span)
        _fsutil.crash_point("mmap.write.partial")
        with self._lock:
            self._counters["bytes_written"] += span.nbytes

    def seal(self, reservation: Reservation) -> None:
        prepared = self._seal_prepare(reservation)
        try:
            self._commit(prepared[-1])
        except BaseException:
            self._seal_undo(prepared)
            raise
        _fsutil.crash_point("mmap.seal.after_journal")
        self._seal_finish(prepared)
        self._snapshot_due()

    def seal_many(self, reservations: Sequence[Reservation]) -> None:
        """Seal several reservations with one commit: with ``durability=sync`` one data sync and
        one journal sync cover all of them.  All or nothing at the commit: if it fails, every one
        of them is aborted and the error is raised."""
        if any(not isinstance(r, _MmapReservation) for r in reservations):
            # reservations of the contract's default reserve_many (bytes held until the seal)
            super().seal_many(reservations)
            return
        prepared = []
        try:
            for r in reservations:
                prepared.append(self._seal_prepare(r))
        except BaseException:
            for p in prepared:
                self._seal_undo(p)
            raise
        try:
            self._commit([p[-1] for p in prepared])
        except BaseException:
            for p in prepared:
                self._seal_undo(p)
            raise
        _fsutil.crash_point("mmap.seal.after_journal")
        errors = []
        for p in prepared:
            try:
                self._seal_finish(p)
            except UnknownKeyError as exc:  # a parent dropped (corrupt) meanwhile
                errors.append(exc)
        self._snapshot_due()
        if errors:
            raise errors[0]

    def put_many(self, items: Sequence[tuple[bytes, bytes | None, object]], *,
                 salt_tag: str = "") -> list[bool | HostKVError]:
        """Store many pages: one lock pass for the reservations, the page bytes of runs that lie
        back to back in a data file written with one ``pwritev``, and one commit (one journal
        write; with ``durability=sync`` one data sync and one journal sync) per chunk of
        ``_PUT_BATCH`` items.

        ``items`` are ``(key, parent, data)``; a parent may be an earlier item of the same call
        (a chain is stored root first).  Returns per item ``True`` (stored now), ``False``
        (already stored: dedup) or the error of that item (``InFlightError``, ``CapacityError``,
        ``UnknownKeyError`` when its parent is not stored or failed ...); items after a failed
        parent fail too.  Raises only for whole-call failures (bad arguments, a read-only
        store, I/O errors: then none of the current chunk is stored, earlier chunks are).  The
        protocol per page is the one of ``reserve``/``write``/``seal``: slot headers zeroed,
        data, checksum (XXH3 of the caller's buffer), slot header, journal record.
        """
        self._check_usable()
        self._need_writer("put_many")
        checked = self._put_many_args(items, salt_tag, tag_max=_TAG_MAX)
        out: list[bool | HostKVError] = []
        for lo in range(0, len(checked), _PUT_BATCH):
            out += self._put_chunk(checked[lo : lo + _PUT_BATCH], salt_tag)
            self._snapshot_due()
        return out

    def _put_chunk(self, items: Sequence[tuple[Key, Key | None, memoryview]],
                   salt_tag: str) -> list[bool | HostKVError]:
        results: list[bool | HostKVError] = [False] * len(items)
        todo: list[tuple[int, _MmapReservation, memoryview]] = []
        mine: set[Key] = set()
        self._check_usable()
        with self._lock:
            self._check_usable()
            self._check_failed()
            try:
                for i, (k, p, view) in enumerate(items):
                    try:
                        res = self._reserve_locked(k, p, view.nbytes, salt_tag, mine)
                    except (InFlightError, CapacityError, UnknownKeyError) as exc:
                        results[i] = exc
                        continue
                    if res is not None:
                        mine.add(k)
                        todo.append((i, res, view))
            except BaseException:
                for _, res, _ in todo:
                    self._abort_locked(res)
                raise
        if not todo:
            return results
        try:
            by_file: dict[int, list[tuple[int, int, memoryview]]] = {}
            where: dict[int, list[int]] = {}  # per file: positions in todo
            for t, (_, res, view) in enumerate(todo):
                # slot protocol step 1 for every run before any of their bytes change
                self._files[res.file].begin_write(res.slot, res.nslots)
                _fsutil.crash_point("mmap.reserve.after_clear")
                by_file.setdefault(res.file, []).append((res.slot, res.nbytes, view))
                where.setdefault(res.file, []).append(t)
            # the caller's buffers, hashed while they are the source (no re-read of the file)
            digests = [0] * len(todo)
            for fid, runs in by_file.items():
                got: list[int] = []
                self._files[fid].write_runs(runs, got)
                for t, d in zip(where[fid], got, strict=True):
                    digests[t] = d
            for _, res, _ in todo:
                res.mark_written()
            _fsutil.crash_point("mmap.write.partial")
        except BaseException:
            with self._lock:
                for _, res, _ in todo:
                    self._abort_locked(res)
            raise
        try:
            prepared = self._put_prepare([res for _, res, _ in todo], digests, salt_tag)
        except BaseException:
            with self._lock:
                for _, res, _ in todo:
                    self._abort_locked(res)
            raise
        try:
            self._commit([pr[-1] for pr in prepared])
        except BaseException:
            for pr in prepared:
                self._seal_undo(pr)
            raise
        _fsutil.crash_point("mmap.seal.after_journal")
        # One locked pass, in item order: a parent from this batch becomes a row before its
        # children resolve it, and no other thread can evict it in between.
        nbytes = 0
        with self._lock:
            for (i, _, view), pr in zip(todo, prepared, strict=True):
                try:
                    self._seal_finish(pr)
                except UnknownKeyError as exc:
                    results[i] = exc
                    continue
                results[i] = True
                nbytes += view.nbytes
            self._counters["bytes_written"] += nbytes
        return results

    def _put_prepare(self, reservations: Sequence[_MmapReservation], digests: Sequence[int],
                     salt_tag: str) -> list[tuple[_MmapReservation, SlotFile, int, float, bytes, bytes]]:
        """:meth:`_seal_prepare` of a put_many chunk (whole writes, hashed from the caller's
        buffers): slot headers after the data, then one lock pass for the journal order."""
        created = time.time()
        tag = salt_tag.encode()
        files = []
        for res, digest in zip(reservations, digests, strict=True):
            sf = self._files[res.file]
            sf.write_header_of(res.slot, res.key, res.parent, res.gen, res.nbytes, digest)
            _fsutil.crash_point("mmap.seal.after_header")
            files.append(sf)
        self._check_usable()
        with self._lock:
            self._check_usable()
            for res in reservations:
                res.check_open(self)
            seq0 = self._idx.clock + 1
            self._idx.clock += len(reservations)
            self._dirty_files.update(res.file for res in reservations)
            self._unfinished += len(reservations)
        records = _encode_seals(reservations, digests, tag, created, seq0)
        return [(res, sf, digest, created, tag, record)
                for res, sf, digest, record in zip(reservations, files, digests, records, strict=True)]

    def _seal_prepare(self, reservation: Reservation) -> tuple[_MmapReservation, SlotFile, int, float, bytes, bytes]:
        """Checksum, slot header (data first, then header) and the journal record of a seal."""
        self._check_usable()
        res = self._own(reservation)
        res.check_complete()
        sf = self._files[res.file]
        # A single whole-entry write was hashed while its bytes were hot; anything else (pieces,
        # DMA into regions()) is hashed from the file.
        digest = res.digest if res.digest is not None else sf.checksum(res.slot, res.nbytes)
        sf.write_header_of(res.slot, res.key, res.parent, res.gen, res.nbytes, digest)
        _fsutil.crash_point("mmap.seal.after_header")
        created = time.time()
        tag = res.salt_tag.encode()
        self._check_usable()
        with self._lock:
            self._check_usable()
            res.check_open(self)
            self._dirty_files.add(res.file)
            seq = self._idx.clock = self._idx.clock + 1
            self._unfinished += 1
        record = _encode_seals((res,), (digest,), tag, created, seq)[0]
        return res, sf, digest, created, tag, record

    def _seal_undo(self, prepared: tuple[_MmapReservation, SlotFile, int, float, bytes, bytes]) -> None:
        res, sf = prepared[0], prepared[1]
        with self._lock:
            self._unfinished -= 1
            if res.state == "open":
                self._idx.cancel(res.key)
                if not sf.closed:
                    sf.clear(res.slot, res.nslots)
                self._release_run(res.file, res.slot, res.nslots)
                res._finish("aborted")
                self._counters["aborts"] += 1

    def _seal_finish(self, prepared: tuple[_MmapReservation, SlotFile, int, float, bytes, bytes]) -> None:
        res, sf, digest, created, tag, _ = prepared
        with self._lock:
            self._unfinished -= 1
            try:
                self._idx.commit(res.key, nbytes=res.nbytes, file=res.file, slot=res.slot, nslots=res.nslots,
                                 gen=res.gen, csum=digest, tag=tag, created=created)
            except UnknownKeyError:
                sf.clear(res.slot, res.nslots)
                self._release_run(res.file, res.slot, res.nslots)
                res._finish("aborted")
                raise
            res._finish("sealed")
            self._counters["seals"] += 1
            self._maybe_snapshot()

    def abort(self, reservation: Reservation) -> None:
        if not isinstance(reservation, _MmapReservation) or reservation.provider is not self:
            raise ReservationError("not a reservation of this provider")
        self._check_usable()
        with self._lock:
            self._check_usable()
            self._abort_locked(reservation)

    def _abort_locked(self, reservation: _MmapReservation) -> None:
        if reservation.state != "open":
            return
        self._idx.cancel(reservation.key)
        sf = self._files.get(reservation.file)
        if sf is not None and not sf.closed:
            sf.clear(reservation.slot, reservation.nslots)
        self._release_run(reservation.file, reservation.slot, reservation.nslots)
        reservation._finish("aborted")
        self._counters["aborts"] += 1

    # -- reads -----------------------------------------------------------------------------------
    def read(self, key: bytes, out: object, span: ByteSpan | None = None) -> bool:
        # The per-page hot path: a warm 256 KiB copy takes ~20 us, so steps of 0.1-1 us show.
        # Hence no ByteSpan objects and no numpy scalars (``.item`` is 2x cheaper than
        # ``int(a[i])``).
        k = self._key(key)
        if span is not None and not isinstance(span, ByteSpan):
            raise InvalidArgumentError("span must be a ByteSpan")
        counters = self._counters
        self._check_usable()
        with self._lock:
            self._check_usable()
            idx = self._idx
            row = idx.row_of(k)
            if row < 0:
                counters["misses"] += 1
                return False
            nbytes = idx.nbytes.item(row)
            if span is None:
                offset, n = 0, nbytes
            else:
                span.validate(nbytes)
                offset, n = span.offset, span.nbytes
            dst = writable_buffer(out, n)
            fid, slot, gen, csum = idx.file.item(row), idx.slot.item(row), idx.gen.item(row), idx.csum.item(row)
            idx.touch(row)
            sf = self._files[fid]
            # counted as a hit now (one lock round trip per read); undone below on a failure
            counters["hits"] += 1
            counters["bytes_read"] += n
        # No hold: the copy runs unlocked and the slot's generation-stamped header is checked
        # before and after it (a seqlock), so an eviction + reuse racing this read is a miss.
        try:
            result = sf.read_into(slot, dst, key=k, generation=gen, nbytes=nbytes, checksum=csum,
                                  offset=offset, verify=self._verify_reads)
        except StorageIOError:
            if not sf.closed:
                raise
            result = ReadResult.STALE  # refresh/compaction swapped the files meanwhile: a miss
        if result is ReadResult.OK:
            return True
        with self._lock:
            self._read_failed(idx, row, gen, result, n)
        return False

    def _read_failed(self, idx: _Index, row: int, gen: int, result: ReadResult, n: int) -> None:
        """Undo the hit of a read whose copy did not verify, and drop the entry if its record is
        still current (caller holds the lock)."""
        self._counters["hits"] -= 1
        self._counters["bytes_read"] -= n
        self._counters["misses"] += 1
        still = bool(idx is self._idx and idx.alive[row] and int(idx.gen[row]) == gen)
        if result is ReadResult.CORRUPT or (still and not self._readonly):
            # the record is still current and its slot disagrees: corruption (in the writer
            # nobody else reuses slots; in a reader a mismatch may be the writer's reuse)
            self._counters["checksum_failures"] += 1
        else:
            self._counters["stale_reads"] += 1
        if still:
            self._drop_row(row)

    def read_many(self, keys: Sequence[bytes], outs: Sequence[object]) -> list[bool]:
        """Read whole entries into ``outs[i]``: one lock pass for the lookups, then the copies,
        runs that lie back to back in a data file with one ``preadv``; ``False`` per miss.

        Each entry keeps the protocol of :meth:`read` (slot header checked before and after the
        copy, XXH3 of ``outs[i]`` with ``verify=read``), so on a miss (including a checksum
        failure, which drops the entry as ``read`` does) ``outs[i]`` may hold garbage: use it
        only where ``True``.  An ``outs[i]`` smaller than its entry, or not a writable buffer,
        raises ``InvalidArgumentError`` after the others were filled.
        """
        ks = self._keys(keys)
        try:
            n_outs = -1 if isinstance(outs, (bytes, bytearray, memoryview)) else len(outs)
        except TypeError:
            n_outs = -1
        if n_outs != len(ks):
            raise InvalidArgumentError(f"{len(ks)} keys need a sequence of as many output buffers")
        results = [False] * len(ks)
        bad: InvalidArgumentError | None = None
        # per data file: the reads (slot, out, key, generation, nbytes, checksum) and, in the same
        # order, (position in keys, row) of each
        reads: dict[int, list[tuple[int, memoryview, bytes, int, int, int]]] = {}
        where: dict[int, list[tuple[int, int]]] = {}
        counters = self._counters
        self._check_usable()
        with self._lock:
            self._check_usable()
            idx = self._idx
            row_of, touch = idx.row_of, idx.touch
            nbytes_of, file_of, slot_of, gen_of, csum_of = (idx.nbytes.item, idx.file.item, idx.slot.item,
                                                            idx.gen.item, idx.csum.item)
            nread = hits = 0
            for i, k in enumerate(ks):
                row = row_of(k)
                if row < 0:
                    continue
                nbytes = nbytes_of(row)
                try:
                    dst = writable_buffer(outs[i], nbytes)
                except InvalidArgumentError as exc:
                    bad = bad or exc
                    continue
                touch(row)
                fid = file_of(row)
                if fid not in reads:
                    reads[fid], where[fid] = [], []
                reads[fid].append((slot_of(row), dst, k, gen_of(row), nbytes, csum_of(row)))
                where[fid].append((i, row))
                nread += nbytes
                hits += 1
            counters["hits"] += hits
            counters["misses"] += len(ks) - hits
            counters["bytes_read"] += nread
            files = self._files
        failed: list[tuple[int, int, ReadResult, int]] = []  # row, generation, result, nbytes
        for fid, batch in reads.items():
            sf = files[fid]
            try:
                got = sf.read_runs_into(batch, verify=self._verify_reads)
            except StorageIOError:
                if not sf.closed:
                    raise
                got = [ReadResult.STALE] * len(batch)  # refresh/compaction swapped the files: misses
            for (i, row), r, rd in zip(where[fid], got, batch, strict=True):
                if r is ReadResult.OK:
                    results[i] = True
                else:
                    failed.append((row, rd[3], r, rd[4]))
        if failed:
            with self._lock:
                for row, gen, r, n in failed:
                    self._read_failed(idx, row, gen, r, n)
        if bad is not None:
            raise bad
        return results

    def prefetch(self, keys: Sequence[bytes]) -> None:
        """Start reading the data of the stored ``keys`` into the page cache: one
        ``POSIX_FADV_WILLNEED`` per run of them that lies back to back in a data file (the
        kernel queues the reads and returns).  A restore that prefetches its next chunk before
        it reads, verifies and hands on the current one keeps the disk busy meanwhile; the
        reads themselves stay what they are (header, copy, checksum).  Keys not stored are
        ignored."""
        ks = self._keys(keys)
        self._check_usable()
        entries = []
        with self._lock:
            self._check_usable()
            idx, files = self._idx, self._files
            for k in ks:
                row = idx.row_of(k)
                if row >= 0 and (sf := files.get(idx.file.item(row))) is not None:
                    entries.append((sf, idx.slot.item(row), idx.nbytes.item(row)))
        prefetch_runs(entries)

    def _drop_row(self, row: int) -> int:
        """Drop a corrupt/stale entry with its subtree (caller holds the lock)."""
        removed = self._idx.drop(row)
        self._free_rows_storage(removed, journal=not self._readonly)
        return len(removed)

    # -- eviction --------------------------------------------------------------------------------
    def evict(self, keys: Sequence[bytes] | None = None, *, nbytes: int = 0) -> EvictReport:
        if (keys is None) == (not nbytes):
            raise InvalidArgumentError("give exactly one of keys or nbytes")
        if type(nbytes) is not int or nbytes < 0:
            raise InvalidArgumentError(f"nbytes must be a non-negative int, got {nbytes!r}")
        ks = self._keys(keys) if keys is not None else None
        self._check_usable()
        with self._lock:
            self._check_usable()
            self._need_writer("evict")
            idx = self._idx
            if ks is not None:
                removed, skipped = idx.evict_rows([idx.row_of(k) for k in ks])
            else:
                removed, skipped = idx.evict_cost(nbytes), 0
            total = sum(int(idx.nbytes[r]) for r in removed)
            self._free_rows_storage(removed, journal=True)
            return EvictReport(len(removed), total, skipped)

    def _free_rows_storage(self, rows: Sequence[int], *, journal: bool) -> None:
        """Journal the removal of ``rows`` (already out of the index), clear their slot headers
        and free their runs and anchors.  Caller holds the lock."""
        if not rows:
            return
        idx = self._idx
        if journal and not self._readonly:
            idx.clock += 1
            recs = [self._encode(OP_DROP, idx.key[r].tobytes(), seq=idx.clock) for r in rows]
            self._journal(recs)
            _fsutil.crash_point("mmap.evict.after_drop")
        for r in rows:
            fid, slot, nslots = int(idx.file[r]), int(idx.slot[r]), int(idx.nslots[r])
            sf = self._files.get(fid)
            if not self._readonly:
                if sf is not None and not sf.closed:
                    sf.clear(slot, nslots)
                self._release_run(fid, slot, nslots)
            for a in (idx.anchors.pop(r, None) or {}).values():
                asf = self._files.get(a.file)
                if not self._readonly:
                    if asf is not None and not asf.closed:
                        asf.clear(a.slot, a.nslots)
                    self._release_run(a.file, a.slot, a.nslots)
        idx.recycle(rows)

    # -- anchors ---------------------------------------------------------------------------------
    def put_anchor(self, key: bytes, name: str, data: object) -> None:
        k = self._key(key)
        check_anchor_name(name)
        blob = readable_bytes(data)
        nbytes = blob.nbytes
        nslots = run_nslots(nbytes, self._slot)
        cost = nslots * self._slot
        self._check_usable()
        with self._lock:
            self._check_usable()
            self._need_writer("put_anchor")
            self._check_failed()
            idx = self._idx
            row = idx.row_of(k)
            if row < 0:
                raise UnknownKeyError(f"entry {k.hex()[:16]} is not stored", hint="seal the page before its anchors")
            table = idx.anchors.get(row) or {}
            old = table.get(name)
            delta = cost - (old.cost if old is not None else 0)
            self._free_rows_storage(idx.add_cost(row, delta), journal=True)
            try:
                idx._hold(row)
                try:
                    fid, slot = self._allocate(nslots, row)
                finally:
                    idx._unhold(row)
            except BaseException:
                idx.add_cost(row, -delta)
                raise
            gen = self._next_gen
            self._next_gen += 1
            sf = self._files[fid]
            sf.begin_write(slot, nslots)
            sf.write(slot, nbytes, 0, blob)
            digest = sf.checksum(slot, nbytes)
            sf.write_header(slot, key=k, parent=None, generation=gen, nbytes=nbytes, checksum=digest,
                            flags=FLAG_ANCHOR)
            _fsutil.crash_point("mmap.anchor.after_header")
            idx.clock += 1
            rec = self._encode(OP_ANCHOR, k, name=name.encode(), file=fid, slot=slot, nslots=nslots, nbytes=nbytes,
                               gen=gen, checksum=digest, seq=idx.clock)
            self._dirty_files.add(fid)
            self._unfinished += 1  # no snapshot until the table below holds the anchor
        try:
            self._commit(rec)
        except BaseException:
            with self._lock:
                self._unfinished -= 1
                idx.add_cost(row, -delta)
                sf.clear(slot, nslots)
                self._release_run(fid, slot, nslots)
            raise
        with self._lock:
            self._unfinished -= 1
            if not idx.alive[row] or idx.key_of(row) != k:  # evicted meanwhile
                return
            table = idx.anchors.setdefault(row, {})
            prev = table.pop(name, None)
            if prev is not None:
                psf = self._files.get(prev.file)
                if psf is not None:
                    psf.clear(prev.slot, prev.nslots)
                self._release_run(prev.file, prev.slot, prev.nslots)
            table[name] = _Anchor(fid, slot, nslots, nbytes, gen, digest, cost)

    def get_anchor(self, key: bytes, name: str) -> bytes | None:
        k = self._key(key)
        check_anchor_name(name)
        self._check_usable()
        with self._lock:
            self._check_usable()
            idx = self._idx
            row = idx.row_of(k)
            if row < 0:
                return None
            a = (idx.anchors.get(row) or {}).get(name)
            if a is None:
                return None
            out = bytearray(a.nbytes)
            res = self._files[a.file].read_into(a.slot, memoryview(out), key=k, generation=a.gen, nbytes=a.nbytes,
                                                checksum=a.checksum, verify=True)
            if res is ReadResult.OK:
                return bytes(out)
            self._counters["checksum_failures"] += 1
            idx.anchors[row].pop(name, None)
            if not self._readonly:
                idx.add_cost(row, -a.cost)
                self._files[a.file].clear(a.slot, a.nslots)
                self._release_run(a.file, a.slot, a.nslots)
            return None

    def list_anchors(self, key: bytes) -> dict[str, int]:
        k = self._key(key)
        self._check_usable()
        with self._lock:
            self._check_usable()
            row = self._idx.row_of(k)
            if row < 0:
                return {}
            return {n: a.nbytes for n, a in (self._idx.anchors.get(row) or {}).items()}

    def deepest_anchor(self, keys: Sequence[bytes], name: str) -> int:
        ks = self._keys(keys)
        check_anchor_name(name)
        self._check_usable()
        with self._lock:
            self._check_usable()
            best = 0
            for i, k in enumerate(ks):
                row = self._idx.row_of(k)
                if row < 0:
                    break
                if name in (self._idx.anchors.get(row) or {}):
                    best = i + 1
            return best

    # -- leases ----------------------------------------------------------------------------------
    def lease(self, keys: Sequence[bytes]) -> Lease:
        ks = self._keys(keys)
        self._check_usable()
        with self._lock:
            self._check_usable()
            idx = self._idx
            rows = [idx.row_of(k) for k in ks]
            idx.hold_rows(rows)
            gens = [int(idx.gen[r]) if r >= 0 else -1 for r in rows]
            return Lease(self, ks, [r >= 0 for r in rows], token=(rows, gens))

    def _release_lease(self, lease: Lease) -> None:
        with self._lock:
            if self._closed:
                return
            token: tuple[list[int], list[int]] = lease.token  # type: ignore[assignment]
            self._idx.release_rows(token[0], token[1])

    # -- readers ---------------------------------------------------------------------------------
    def refresh(self) -> bool:
        """Reader processes: catch up with the writer (new manifest generation, snapshot, journal
        records, data files).  Cheap when nothing changed; returns whether anything was reloaded.
        Leases and reads in progress keep working on the previous view's rows until released."""
        self._check_usable()
        with self._lock:
            self._check_usable()
            if not self._readonly:
                return False
            if self._signature() == self._state_sig:
                return False
            man = self._read_manifest()
            self._manifest = man
            self._gen = int(man["generation"])
            self._idx = _Index(self._budget)
            self._problems = []
            self._load_reader()
            return True

    # -- verify / compact ------------------------------------------------------------------------
    def verify(self, *, repair: bool = False, progress: Progress | None = None) -> VerifyReport:
        """Check every entry's slot header and page checksum (and every anchor's); report findings
        from open (damaged index records, reclaimed leftovers) as ``problems``.  ``repair`` drops
        corrupt entries with their subtrees and rewrites the index (writer only)."""
        if repair:
            self._check_usable()
            with self._lock:
                self._check_usable()
                self._need_writer("verify(repair=True)")
        report = VerifyReport()
        self._check_usable()
        with self._lock:
            self._check_usable()
            rows = [int(r) for r in self._idx.live_rows()]
            report.problems = list(self._problems)
            recs = [(r, int(self._idx.gen[r])) for r in rows]
        total = len(recs)
        for i, (row, gen) in enumerate(recs):
            with self._lock:
                idx = self._idx
                if not idx.alive[row] or int(idx.gen[row]) != gen:
                    continue
                key = idx.key_of(row)
                sf = self._files[int(idx.file[row])]
                res = sf.check(int(idx.slot[row]), key=key, generation=gen, nbytes=int(idx.nbytes[row]),
                               checksum=int(idx.csum[row]), verify=True)
                report.checked += 1
                bad = res is not ReadResult.OK
                for name, a in list((idx.anchors.get(row) or {}).items()):
                    if self._files[a.file].check(a.slot, key=key, generation=a.gen, nbytes=a.nbytes,
                                                              checksum=a.checksum) is not ReadResult.OK:
                        report.problems.append(f"anchor {name!r} of {key.hex()[:16]} is corrupt")
                        if repair:
                            idx.anchors[row].pop(name, None)
                            idx.add_cost(row, -a.cost)
                            self._files[a.file].clear(a.slot, a.nslots)
                            self._release_run(a.file, a.slot, a.nslots)
                            idx.clock += 1
                            self._journal([self._encode(OP_ANCHOR, key, name=name.encode(), seq=idx.clock,
                                                        flags=_REC_DELETE)])
                if bad:
                    report.corrupt.append(key)
                    self._counters["checksum_failures"] += 1
                    if repair:
                        report.dropped += self._drop_row(row)
            if progress is not None:
                progress(i + 1, total)
        if progress is not None and total == 0:
            progress(0, 0)
        with self._lock:
            idx = self._idx
            live = idx.live_rows()
            acct = int(idx.cost[live].sum()) if len(live) else 0
            inflight = sum(f.cost for f in idx.flights.values())
            if acct != idx.sealed_cost or idx.used_cost != acct + inflight:
                report.problems.append(f"accounting: used {idx.used_cost} != live {acct} + in flight {inflight}")
            if repair and not self._readonly:
                # The drops are journaled already; the snapshot only compacts them.  While another
                # thread's seal has its record journaled but not yet indexed, a snapshot would
                # rotate that record away (an acknowledged seal lost on a crash): skip it then,
                # the next one compacts.
                if self._unfinished == 0:
                    self._snapshot()
                self._problems = []
                if report.problems:
                    report.problems = [p + " (repaired)" for p in report.problems]
        return report

    def compact(self, *, progress: Progress | None = None) -> CompactReport:
        """Rewrite the store densely into a new generation (copy, then switch the manifest: the
        commit point), then delete the old one.  Crash-safe at every step; refuses in a reader
        (``readonly``) and while reservations are in flight in this process.  Another process's
        writer lock makes *opening* for compaction fail with ``LockedError`` instead."""
        self._check_usable()
        with self._lock:
            self._check_usable()
            self._need_writer("compact")
            self._check_failed()
            idx = self._idx
            if idx.flights:
                raise ReservationError(f"cannot compact while {len(idx.flights)} reservation(s) are in flight",
                                       hint="seal or abort them first")
            self._flush_none(force=True)
            before = sum(sf.data_offset + sf.slot_count * sf.slot_nbytes for sf in self._files.values())
            rows = [int(r) for r in idx.live_rows()]
            need = sum(int(idx.nslots[r]) for r in rows) + sum(
                a.nslots for r in rows for a in (idx.anchors.get(r) or {}).values())
            new_gen = self._gen + 1
            nslots_file = max(1, min(max(need, 1), self._file_slots))
            new_files: dict[int, SlotFile] = {}
            cursor = [0, 0]  # file id, next slot

            def place(n: int) -> tuple[int, int]:
                fid, s = cursor
                if fid in new_files and s + n > new_files[fid].slot_count:
                    fid, s = fid + 1, 0
                if fid not in new_files:
                    size = max(nslots_file, n) if need else 1
                    self._discard_leftover(self._p(self._data_name(new_gen, fid)))  # a failed compaction's
                    new_files[fid] = SlotFile.create(
                        self._p(self._data_name(new_gen, fid)), slot_nbytes=self._slot, slot_count=size,
                        file_id=fid, store_id=self._store_id)
                    new_files[fid].io = self._io
                cursor[0], cursor[1] = fid, s + n
                return fid, s

            moves: list[tuple[int, int, int, int]] = []  # row, file, slot, gen
            amoves: list[tuple[int, str, _Anchor]] = []
            gen_counter = self._next_gen
            # An exception that arrives after the manifest's rename (a failed directory sync, a
            # KeyboardInterrupt) must not roll back: the new generation already *is* the store,
            # and deleting its files would lose every entry.  It is re-raised after the switch.
            after_commit: BaseException | None = None
            keep_files = False
            try:
                if not need:
                    place(0)
                for i, r in enumerate(rows):
                    n, nb = int(idx.nslots[r]), int(idx.nbytes[r])
                    fid, s = place(n)
                    src = self._files[int(idx.file[r])]
                    dst = new_files[fid]
                    key = idx.key_of(r)
                    if src.check(int(idx.slot[r]), key=key, generation=int(idx.gen[r]), nbytes=nb,
                                 checksum=int(idx.csum[r])) is not ReadResult.OK:
                        continue  # corrupt: not carried over (reported by verify before)
                    dst.begin_write(s, n)
                    dst.write(s, nb, 0, src.data(int(idx.slot[r]), nb))
                    dst.write_header(s, key=key, parent=idx.parent_key(r), generation=gen_counter, nbytes=nb,
                                     checksum=int(idx.csum[r]))
                    moves.append((r, fid, s, gen_counter))
                    gen_counter += 1
                    for name, a in (idx.anchors.get(r) or {}).items():
                        afid, asl = place(a.nslots)
                        adst = new_files[afid]
                        adst.begin_write(asl, a.nslots)
                        adst.write(asl, a.nbytes, 0, self._files[a.file].data(a.slot, a.nbytes))
                        adst.write_header(asl, key=key, parent=None, generation=gen_counter, nbytes=a.nbytes,
                                          checksum=a.checksum, flags=FLAG_ANCHOR)
                        amoves.append((r, name, _Anchor(afid, asl, a.nslots, a.nbytes, gen_counter, a.checksum,
                                                        a.cost)))
                        gen_counter += 1
                    if progress is not None:
                        progress(i + 1, len(rows))
                for sf in new_files.values():
                    sf.sync()
                moved = {r for r, *_ in moves}
                # the new generation's index: a snapshot of the moved entries, an empty journal
                old = (idx.file.copy(), idx.slot.copy(), idx.gen.copy(), dict(idx.anchors))
                for r, fid, s, g in moves:
                    idx.file[r], idx.slot[r], idx.gen[r] = fid, s, g
                idx.anchors = {r: {} for r in moved if r in old[3]}
                for r, name, a in amoves:
                    idx.anchors.setdefault(r, {})[name] = a
                dropped = [r for r in rows if r not in moved]
                saved_gen = self._gen
                self._gen = new_gen
                try:
                    for r in dropped:  # corrupt entries not carried: out of the index (and subtrees)
                        if idx.alive[r]:
                            for d in idx.drop(r):
                                idx.anchors.pop(d, None)
                    recs = self._snapshot_records()
                    head = bytearray(64)
                    head[:8] = _SNAP_MAGIC
                    head[8:24] = self._store_id
                    idx.clock += 1
                    head[24:32] = idx.clock.to_bytes(8, "little")
                    head[32:40] = len(recs).to_bytes(8, "little")
                    head[40:48] = new_gen.to_bytes(8, "little")
                    head[56:64] = xxhash.xxh3_64_intdigest(bytes(head[:56])).to_bytes(8, "little")
                    _fsutil.atomic_write(self._p(self._snap_name(new_gen)),
                                         bytes(head).ljust(_SNAP_HEADER, b"\0") + recs.tobytes())
                    _fsutil.atomic_write(self._p(self._journal_name(new_gen)), self._journal_header())
                    _fsutil.crash_point("mmap.compact.after_copy")
                    man = dict(self._manifest, generation=new_gen)
                    try:
                        self._write_manifest(man)  # the commit point
                    except BaseException as exc:
                        on_disk = self._disk_generation()
                        if on_disk == new_gen:
                            after_commit = exc
                        else:
                            if on_disk is None:
                                # cannot tell which generation is the store: delete nothing, and
                                # acknowledge nothing more until a reopen decides from the manifest
                                keep_files = True
                                self._failed = f"compaction could not confirm its commit ({exc!r})"
                            raise
                except BaseException:
                    self._gen = saved_gen
                    idx.file[:], idx.slot[:], idx.gen[:] = old[0], old[1], old[2]
                    idx.anchors = old[3]
                    raise
            except BaseException:
                for sf in new_files.values():
                    sf.close()
                    if not keep_files:
                        with contextlib.suppress(OSError):
                            os.unlink(sf.path)
                if keep_files:
                    raise
                with contextlib.suppress(OSError):
                    os.unlink(self._p(self._snap_name(new_gen)))
                with contextlib.suppress(OSError):
                    os.unlink(self._p(self._journal_name(new_gen)))
                raise
            _fsutil.crash_point("mmap.compact.after_manifest")
            self._manifest = man
            old_files = self._files
            self._files = new_files
            self._free = {fid: np.ones(sf.slot_count, np.bool_) for fid, sf in new_files.items()}
            live = idx.live_rows()
            for fid in new_files:
                sel = live[idx.file[live] == fid]
                self._mark_used(fid, idx.slot[sel].astype(np.int64), idx.nslots[sel].astype(np.int64))
            for table in idx.anchors.values():
                for a in table.values():
                    self._mark_used(a.file, np.array([a.slot], np.int64), np.array([a.nslots], np.int64))
            self._next_gen = gen_counter
            if self._jfd is not None:
                os.close(self._jfd)
                self._jfd = None
            self._jvalid_end = REC_NBYTES
            self._open_journal_for_append()
            self._jrecords = 0
            self._problems = []
            self._dirty_files.clear()
            for sf in old_files.values():
                sf.close()
                with contextlib.suppress(OSError):
                    os.unlink(sf.path)
            for name in (self._snap_name(new_gen - 1), self._journal_name(new_gen - 1)):
                with contextlib.suppress(OSError):
                    os.unlink(self._p(name))
            with contextlib.suppress(HostKVError):
                _fsutil.fsync_dir(self.path)
            if after_commit is not None:
                raise after_commit
            after = sum(sf.data_offset + sf.slot_count * sf.slot_nbytes for sf in self._files.values())
            return CompactReport(entries=idx.count, bytes_before=before, bytes_after=after)

    # -- the rest --------------------------------------------------------------------------------
    @property
    def budget_bytes(self) -> int:
        return self._budget

    @property
    def durability(self) -> str:
        return self._durability

    @property
    def slot_nbytes(self) -> int:
        return self._slot

    @property
    def readonly(self) -> bool:
        return self._readonly

    def stats(self) -> ProviderStats:
        self._check_usable()
        with self._lock:
            self._check_usable()
            idx = self._idx
            live = idx.live_rows()
            return ProviderStats(
                name=self.name,
                entries=idx.count,
                used_bytes=idx.used_cost,
                budget_bytes=self._budget,
                anchors=sum(len(t) for t in idx.anchors.values()),
                leased=int((idx.hold[live] > 0).sum()) if len(live) else 0,
                in_flight=len(idx.flights),
                evictions=idx.evictions,
                evicted_bytes=idx.evicted_cost,
                extra={"durability": self._durability, "slot_nbytes": self._slot, "generation": self._gen,
                       "data_files": len(self._files), "journal_records": self._jrecords,
                       "open_seconds": round(getattr(self, "open_seconds", 0.0), 4), "readonly": self._readonly,
                       "problems": len(self._problems), "stale_at_open": self._stale_at_open,
                       "orphans_at_open": self._orphans_at_open, "torn_tail": self._torn_tail,
                       "stale_reads": self._counters["stale_reads"], "syncs": self._counters["syncs"],
                       "snapshot_failures": self._counters["snapshot_failures"]},
                **{k: v for k, v in self._counters.items() if k in _STAT_FIELDS},
            )

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "path": self.path, "durability": self._durability, "slot_nbytes": self._slot,
                "verify": "read" if self._verify_reads else "never", "readonly": self._readonly,
                "generation": self._gen, "format_version": MMAP_FORMAT_VERSION,
                "store_id": self._store_id.hex(), "data_files": sorted(self._files),
                "last_recovery": dict(self._recovery)}

    def close(self) -> None:
        """Flush buffered records, write a snapshot (fast next open), sync, unlock; idempotent."""
        with self._lock:
            if self._closed:
                return
            if os.getpid() != self._pid:
                self._closed = True
                return
            try:
                if not self._readonly and self._failed is None and self._jfd is not None:
                    self._flush_none(force=True)
                    if self._jrecords and self._unfinished == 0:  # else reopen replays the journal
                        self._snapshot()
                    for sf in self._files.values():
                        if not sf.closed:
                            sf.sync()
            finally:
                self._closed = True
                self._release_all()

    def _release_all(self) -> None:
        for sf in self._files.values():
            sf.close()
        if self._jfd is not None:
            with contextlib.suppress(OSError):
                os.close(self._jfd)
            self._jfd = None
        if self._lockfile is not None:
            self._lockfile.release()
            self._lockfile = None


_STAT_FIELDS = frozenset(("hits", "misses", "seals", "aborts", "dedup", "checksum_failures", "bytes_written",
                          "bytes_read"))


def _read_exact(fd: int, offset: int, nbytes: int) -> bytes:
    chunks = []
    done = 0
    while done < nbytes:
        chunk = os.pread(fd, min(nbytes - done, 1 << 30), offset + done)
        if not chunk:
            break
        chunks.append(chunk)
        done += len(chunk)
    return b"".join(chunks)


def _unsafe(msg: str) -> HostKVError:
    from hostkv_providers._errors import UnsafeStoreError

    return UnsafeStoreError(msg)


_ = KEY_NBYTES
