"""``lmdb://`` — an LMDB-indexed store that many processes share.

Layout of a store directory (0700, every file 0600)::

    data.mdb, lock.mdb    the LMDB environment: the whole index, ACID (``mdb_stat DIR`` reads it)
    hostkv.lock           flock: every open holds it shared; compaction takes it exclusively
    counters              store-wide live counters (:mod:`.._counters`), one row per writable open
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

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import xxhash

from hostkv_providers._checks import (
    check_flag,
    check_progress,
    check_retain_share,
    scatter_into,
    writable_buffer,
)
from hostkv_providers._checksum import checksum
from hostkv_providers._errors import (
    CapacityError,
    ClosedError,
    CorruptStoreError,
    HostKVError,
    InFlightError,
    InvalidArgumentError,
    LockedError,
    ReservationError,
    StorageIOError,
    UnknownKeyError,
)
from hostkv_providers._keys import KEY_NBYTES, Key
from hostkv_providers._options import Option, OptionSet
from hostkv_providers._provider import Corrupt, Provider
from hostkv_providers._region import HostRegion
from hostkv_providers._reports import (
    CompactReport,
    EntryInfo,
    EvictReport,
    Progress,
    ProviderStats,
    VerifyReport,
)
from hostkv_providers._reservation import Lease, Reservation
from hostkv_providers._span import ByteSpan
from hostkv_providers.providers import _fsutil
from hostkv_providers.providers._budget import check_disk_budget
from hostkv_providers.providers._counters import STORE_COUNTED, StoreCounters, read_counters
from hostkv_providers.providers._slotfile import (
    ReadResult,
    SlotFile,
    prefetch_runs,
)

from . import _batch
from ._env import _Shared, check_tree
from ._format import (
    _DEFAULT_FILE_NBYTES,
    _DEFAULT_INLINE_MAX,
    _DEFAULT_LEASE_TTL,
    _DEFAULT_MAP_MAX,
    _DEFAULT_MAP_SIZE,
    _LOCK_NAME,
    _OWNER,
    _PAGE,
    _PRESENT_CACHE_MAX,
    _TAG_MAX,
    DURABILITY_MODES,
    STORE_FORMAT,
    STORE_VERSION,
    _BadRecord,
    _Counters,
    _crash,
    _Entry,
    _Flight,
    _pack_lease,
    _slot_nbytes,
    _unpack_lease,
)
from ._gate import _alive, _Raise, _start_time
from ._maintenance import _audit, _compact_env, _compact_slots, _free_limbo, _repair_index, _store_nbytes
from ._txn import _Tx, covered_cost, retained_keys

__all__ = ["STORE_FORMAT", "STORE_VERSION", "LmdbProvider"]

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
    _reservation_type = _LmdbReservation
    _tag_max = _TAG_MAX
    #: The URL options (``docs/providers/lmdb.md``'s table is checked against this).
    OPTIONS = OptionSet(
        "lmdb",
        Option("budget", "size", None, "stored (1GiB for a new store)"),
        Option("durability", "choice", "process", "`process`", DURABILITY_MODES),
        Option("inline_max", "size", _DEFAULT_INLINE_MAX, "2KiB"),
        Option("map_size", "size", _DEFAULT_MAP_SIZE, "32MiB"),
        Option("map_max", "size", _DEFAULT_MAP_MAX, "64GiB"),
        Option("file_size", "size", _DEFAULT_FILE_NBYTES, "256MiB", attr="_file_nbytes"),
        Option("lease_ttl", "number", _DEFAULT_LEASE_TTL, "3600"),
        Option("readonly", "bool", False, "false"),
        Option("retain_share", "number", 0.5, "0.5"),
    )
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
        retain_share: float = 0.5,
    ) -> None:
        super().__init__()
        self._closed = True  # until fully open (close() of a half-built instance is a no-op)
        self._retain_share = check_retain_share(retain_share)
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
        self._map_size = map_size
        self._map_max = map_max
        self._file_nbytes = file_nbytes
        self._lease_ttl = float(lease_ttl)
        self._readonly = bool(readonly)
        self._lock = threading.Lock()
        self._open_res: dict[int, _LmdbReservation] = {}
        self._leases: dict[bytes, Lease] = {}
        self._lease_seq = 0
        if readonly and budget_bytes is not None:
            raise InvalidArgumentError("a read-only open cannot set the budget", hint="drop budget= or readonly=")
        self._s = _Shared.acquire(self._path, durability=durability, map_size=map_size, map_max=map_max,
                                  file_nbytes=file_nbytes, budget=budget_bytes, readonly=self._readonly)
        self._owner = _OWNER.pack(os.getpid(), _start_time(os.getpid()), int.from_bytes(os.urandom(8), "little"))
        self._budget = self._read_counters().budget
        self._closed = False
        if not self._readonly:
            # store-wide live counters (<store>/counters, SupportsStoreCounters); evictions and
            # checksum failures are counted in the meta db's transactions already
            try:
                sink = StoreCounters.open(self._path)
                if sink is not None:
                    sink.columns(STORE_COUNTED)
            except BaseException:
                self._s.release()
                raise
            self._store_sink = sink
        if budget_bytes is not None and not self._readonly:
            check_disk_budget(self._path, budget_bytes, "lmdb")

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def from_url(cls, location: str, options: Mapping[str, str]) -> LmdbProvider:
        o = cls.OPTIONS.parse(options)
        if not location or location == "/":
            raise InvalidArgumentError("lmdb:// needs a directory path", hint="use lmdb:///var/cache/kv?budget=64GiB")
        return cls(location, budget_bytes=o["budget"], durability=o["durability"], inline_max=o["inline_max"],
                   map_size=o["map_size"], map_max=o["map_max"], file_nbytes=o["file_size"],
                   lease_ttl=o["lease_ttl"], readonly=o["readonly"], retain_share=o["retain_share"])

    @property
    def path(self) -> str:
        return self._path

    @property
    def durability(self) -> str:
        return self._durability

    @property
    def readonly(self) -> bool:
        return self._readonly

    # -- retained entries (SupportsRetain) ---------------------------------------------------
    def retain(self, keys: Sequence[bytes]) -> int:
        """Mark entries retained (see ``SupportsRetain``), in one write transaction: the entry
        records carry the mark (so the LRU list leaves them out) and the meta db lists them."""
        ks = list(dict.fromkeys(self._keys(keys)))
        self._check_usable()
        self._writable("retain")
        share = self._retain_share

        def op(tx: _Tx) -> int:
            entries = []
            for k in ks:
                e = tx.get_or_drop(k)
                if e is None:
                    raise UnknownKeyError(f"entry {k.hex()[:16]} is not stored; nothing was retained",
                                          hint="retain sealed entries only (save the prefix first)")
                entries.append(e)
            new = [e for e in entries if not e.retained]
            if not new:
                return 0
            now = retained_keys(tx.t, tx.db)
            limit = int(share * tx.c.budget)
            need = covered_cost(tx.t, tx.db, now + [e.key for e in new])
            if need > limit:
                raise CapacityError(
                    f"retaining these entries needs {need} retained bytes, more than the {limit} allowed "
                    f"({covered_cost(tx.t, tx.db, now)} retained now)",
                    hint="unretain other prefixes, retain fewer, or raise the retain_share option (a budget fraction)")
            for e in new:
                tx.set_retained(e, True)
            return len(new)

        return self._s.submit(op, durable=True)  # type: ignore[no-any-return]

    def unretain(self, keys: Sequence[bytes]) -> int:
        """Clear retain marks (keys not marked or not stored are ignored), in one transaction."""
        ks = list(dict.fromkeys(self._keys(keys)))
        self._check_usable()
        self._writable("unretain")

        def op(tx: _Tx) -> int:
            cleared = 0
            for k in ks:
                e = tx.get_or_drop(k)
                if e is not None and e.retained:
                    tx.set_retained(e, False)
                    cleared += 1
            return cleared

        return self._s.submit(op, durable=True)  # type: ignore[no-any-return]

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

    # -- lookups -----------------------------------------------------------------------------
    # (the public verbs are the front's, in Provider; these are the drivers it calls)
    def _present(self, keys: Sequence[bytes]) -> list[bool]:
        ks = self._keys(keys)
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

    def _longest_prefix(self, keys: Sequence[bytes]) -> int:
        ks = self._keys(keys)
        if not ks:
            return 0
        with self._s.read() as txn:
            return self._prefix_len(txn, ks)

    def _in_flight(self, k: Key) -> bool:
        with self._s.read() as txn:
            raw = txn.get(k, db=self._s.dbs["flights"])
        # A dead writer's reservation is not in flight: nobody will seal it (reclaimed lazily).
        return raw is not None and len(raw) >= 20 and _alive(bytes(raw[:20]))

    def _entry(self, k: Key) -> EntryInfo | None:
        with self._s.read(buffers=True) as txn:  # no copy of the anchors to list their sizes
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
    def _reserve(self, k: Key, p: Key | None, nbytes: int, salt_tag: str) -> Reservation | None:
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
            return None  # dedup (the front counts it)
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

    def _write(self, res: _LmdbReservation, span: ByteSpan, view: memoryview) -> None:
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

    def _seal(self, res: _LmdbReservation) -> None:
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

    def _abort(self, reservation: _LmdbReservation) -> bool:
        self._s.submit(self._abort_op(reservation.key, reservation.gen), frees=True)
        self._finish(reservation, "aborted")
        return True

    # -- batches (SupportsBatch; the protocol is in _batch.py) ------------------------------
    def put_many(self, items: Sequence[tuple[bytes, bytes | None, object]], *,
                 salt_tag: str = "") -> list[bool | HostKVError]:
        """Store many pages, root first: per chunk of 64 pages one write transaction reserves
        them all, the bytes of adjacent slots go out with one ``pwritev`` (each page hashed from
        the caller's buffer), and one transaction seals them all (``durability=sync``: one data
        sync per slot file and one index sync per chunk).

        ``items`` are ``(key, parent, data)``; a parent may be an earlier item of the same call.
        Returns per item ``True`` (stored), ``False`` (already stored) or that item's error
        (``InFlightError``, ``CapacityError``, ``UnknownKeyError`` — also for every item whose
        parent failed in this call).  Raises only for whole-call failures (bad arguments, a
        read-only store, I/O errors: then none of the current chunk is stored, earlier chunks
        are).
        """
        return _batch.put_many(self, items, salt_tag)

    def read_many(self, keys: Sequence[bytes], outs: Sequence[object]) -> list[bool]:
        """Whole entries into ``outs[i]``: one read transaction for the lookups, then the slot
        copies (one ``preadv`` per run of adjacent slots), each with ``read``'s protocol
        (header before and after, XXH3 of ``outs[i]``); ``False`` per miss, and on a miss
        ``outs[i]`` may hold garbage.  A checksum failure drops the entry as ``read`` does.  An
        ``outs[i]`` smaller than its entry raises ``InvalidArgumentError`` after the others
        were filled."""
        return _batch.read_many(self, keys, outs)

    # -- reads -------------------------------------------------------------------------------
    def _read(self, k: Key, out: object, span: ByteSpan | None) -> int | Corrupt | None:
        ok = False
        e: _Entry | None = None
        with self._s.read(buffers=True) as txn:
            raw = txn.get(k, db=self._s.dbs["entries"])
            if raw is None:
                return None
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
            # confirmed in a write transaction by _drop_damaged (a slot another process freed and
            # reused is a plain miss there, never a false corruption)
            return Corrupt(None if e is None else e.gen)
        if not self._readonly:
            self._s.touch(k)
        return span.nbytes

    def _drop_damaged(self, k: Key, token: object) -> bool:
        return self._confirm_corrupt(k, token if isinstance(token, int) else None)

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
        replaced or evicted meanwhile (a plain miss).

        ``ClosedError`` once the store is closed: a close racing the copy closes the slot files
        under it, which is no corruption, and the environment is gone for the re-check."""
        closed = ClosedError(f"{type(self).__name__} was closed during the read")
        if self._closed:
            raise closed
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

        try:
            return bool(self._s.submit(op, frees=True))
        except StorageIOError:
            if self._closed:  # closed between the check above and the transaction
                raise closed from None
            raise

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
            self._tally("checksum_failures")
        return None

    # -- eviction ----------------------------------------------------------------------------
    def _evict(self, ks: list[Key] | None, nbytes: int) -> EvictReport:
        self._writable("evict")

        def op(tx: _Tx) -> EvictReport:
            if ks is not None:
                return EvictReport(*tx.evict_keys(ks))
            removed, freed = tx.evict_lru(nbytes)
            return EvictReport(removed, freed, 0)

        return self._s.submit(op, frees=True)  # type: ignore[no-any-return]

    # -- anchors -----------------------------------------------------------------------------
    def _put_anchor(self, k: Key, name: str, blob: bytes) -> None:
        self._writable("put_anchor")
        akey = k + name.encode("ascii")
        record = checksum(blob).to_bytes(8, "little") + blob
        share = self._retain_share

        def op(tx: _Tx) -> None:
            e = tx.get_or_drop(k)
            if e is None:
                raise UnknownKeyError(f"entry {k.hex()[:16]} is not stored", hint="seal the page before its anchors")
            old = tx.t.get(akey, db=tx.db["anchors"])
            delta = len(blob) - (max(0, len(old) - 8) if old is not None else 0)
            if delta > 0:
                if e.cost + delta > tx.c.budget:
                    raise CapacityError(f"anchor of {len(blob)} bytes does not fit the budget of {tx.c.budget}")
                _check_retained_growth(tx, k, delta, int(share * tx.c.budget))
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

    def _get_anchor(self, k: Key, name: str) -> bytes | None:
        out: list[bytes] = []
        got = self._anchor_copy(k, name, lambda mv: out.append(bytes(mv)))
        return out[0] if got is not None else None

    def _read_anchor(self, k: Key, name: str, bufs: list[memoryview]) -> int | None:
        return self._anchor_copy(k, name, lambda mv: scatter_into(bufs, mv))

    def _anchor_copy(self, k: Key, name: str, take: Callable[[memoryview], None]) -> int | None:
        """Verify the anchor in LMDB's map and hand its bytes to ``take`` (which makes the one
        copy: into ``bytes`` for get_anchor, into the caller's buffers for read_anchor), inside
        the read transaction so the map cannot change under the copy."""
        akey = k + name.encode("ascii")
        damaged: bytes | None = None
        with self._s.read(buffers=True) as txn:
            raw = txn.get(akey, db=self._s.dbs["anchors"])
            if raw is None:
                return None
            mv = memoryview(raw)
            blob = mv[8:]
            if mv.nbytes >= 8 and checksum(blob) == int.from_bytes(mv[:8], "little"):
                take(blob)
                return blob.nbytes
            damaged = bytes(mv)  # small or corrupt: compared against the record when dropped

        def op(tx: _Tx) -> bool:  # confirm and drop the damaged anchor (its entry stays)
            cur = tx.t.get(akey, db=tx.db["anchors"])
            if cur is None or cur != damaged:
                return False
            tx.t.delete(akey, db=tx.db["anchors"])
            e = tx.get_or_drop(k)
            if e is not None:
                e.cost -= max(0, len(damaged) - 8)
                tx.put(e)
                tx.c.used -= max(0, len(damaged) - 8)
                tx.c.sealed -= max(0, len(damaged) - 8)
            tx.c.checksum_failures += 1
            return True

        if self._readonly or self._s.submit(op, frees=True):
            self._tally("checksum_failures")
        return None

    def _list_anchors(self, k: Key) -> dict[str, int]:
        # buffers: the sizes are read off LMDB's map; a copying read copied every anchor's value
        # to learn its length (114 ms for a 74 MiB state, on a hybrid cache's admission path)
        with self._s.read(buffers=True) as txn:
            return self._anchor_sizes(txn, k)

    def _deepest_anchor(self, ks: list[Key], name: str) -> int:
        if not ks:
            return 0
        suffix = name.encode("ascii")
        with self._s.read() as txn:
            n = self._prefix_len(txn, ks)
            seek = txn.cursor(db=self._s.dbs["anchors"]).set_key  # positions only: no value copied
            for i in range(n - 1, -1, -1):
                if seek(ks[i] + suffix):
                    return i + 1
        return 0

    # -- leases ------------------------------------------------------------------------------
    def _lease(self, ks: list[Key]) -> Lease:
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
        check_flag(repair, "repair")
        check_progress(progress)
        self._check_usable()
        if repair:
            self._writable("verify(repair=True)")
        report = VerifyReport()
        s = self._s
        # LMDB's own pages first, in a child process: a damaged B-tree page would kill this one
        # with SIGABRT halfway through (issue 16 items 2, 12); repair cannot rebuild them
        try:
            check_tree(self._path, fork=False)
        except CorruptStoreError as exc:
            report.problems.append(f"{exc.message} ({exc.hint})")
            return report
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
        check_progress(progress)
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
            retained = retained_keys(txn, s.dbs)
            retained_bytes = covered_cost(txn, s.dbs, retained)
            leased: set[bytes] = set()
            for _, v in txn.cursor(db=s.dbs["leases"]):
                with contextlib.suppress(_BadRecord):
                    leased.update(k for k, _ in _unpack_lease(v)[2])
            info = s.env.info()
        self._budget = c.budget
        counters = self._tallies()
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
            retained=len(retained),
            retained_bytes=retained_bytes,
            # store_wide: the counters kept in the meta db (every process, since creation);
            # the others count this instance's own calls (hostkv stats tells them apart)
            extra={"store_wide": ["evictions", "evicted_bytes", "store_checksum_failures"],
                   "store_checksum_failures": c.checksum_failures, "sealed_bytes": c.sealed,
                   "map_size": int(info["map_size"]), "map_max": s.map_max, "slot_files": c.next_file,
                   "durability": self._durability},
            **counters,
        )

    def store_counters(self) -> dict[str, int]:
        """Store-wide counters (:class:`~hostkv_providers.providers.SupportsStoreCounters`):
        hits, reads, seals, writes ... summed over every process that opened the store for
        writing (``<store>/counters``; a ``readonly=true`` open counts in-process only), and the
        evictions and checksum failures of the meta db (every process, since creation)."""
        self._check_usable()
        c = self._read_counters()
        sink = self._store_sink
        got = sink.totals() if sink is not None else read_counters(self._path)
        out = dict.fromkeys(STORE_COUNTED, 0)
        out.update(got or {})
        out.update(evictions=c.evictions, evicted_bytes=c.evicted_bytes, checksum_failures=c.checksum_failures)
        return out

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "path": self._path, "multiprocess": True,
                "store_format": STORE_FORMAT,
                "store_version": STORE_VERSION, "last_recovery": dict(self._s.recovery)}

    def close(self) -> None:
        self._check_not_forked()  # a forked child must not touch the parent's environment
        if self._closed:
            return
        # let the reserve/write/seal calls under way finish (new ones get ClosedError): each of
        # them either completes or leaves its reservation in _open_res, aborted below (issue 16
        # item 7: a put() racing close() left its flight in LMDB; after reopen it counted in
        # used_bytes, reserve of the key raised InFlightError, wait_sealed returned False)
        self._quiesce()
        with self._lock:
            if self._closed:
                return
            self._closed = True
            open_res = list(self._open_res.values())
            leases = list(self._leases)
            self._open_res.clear()
            self._leases.clear()
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
            sink, self._store_sink = self._store_sink, None
            if sink is not None:
                with self._stat_lock:
                    sink.close()
            self._s.release()


def _check_retained_growth(tx: _Tx, key: Key, delta: int, limit: int) -> None:
    """``CapacityError`` when ``key`` is retained (or an ancestor of a retained entry) and
    ``delta`` more bytes take the retained bytes past ``limit`` (``retain_share`` of the budget):
    anchors grown past it left no room for any reservation (as the other stores refuse it)."""
    held = retained_keys(tx.t, tx.db)
    if not held:
        return
    now = covered_cost(tx.t, tx.db, held)
    if covered_cost(tx.t, tx.db, [*held, key]) == now and now + delta > limit:  # (key adds nothing: covered)
        raise CapacityError(f"this entry is retained: {delta} more bytes make {now + delta} retained bytes, "
                            f"more than the {limit} allowed",
                            hint="unretain other prefixes, or raise the retain_share option (a budget fraction)")

