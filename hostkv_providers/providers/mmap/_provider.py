"""``mmap://`` — a crash-safe file store on NVMe that survives restarts.

URL: ``mmap:///path/to/store?budget=64GiB&durability=process`` (options in :meth:`MmapProvider.
from_url`; the full reference with the on-disk format is ``docs/providers/mmap.md``).

Store directory (0700, every file 0600, symlinks refused)::

    manifest.json                 identity and geometry, written atomically (temp, fsync, rename)
    writer.lock                   flock held by the one writer process
    counters                      store-wide live counters (:mod:`.._counters`), one row per writer
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
import operator
import os
import threading
import time
from collections.abc import Container, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import xxhash

from hostkv_providers._chain import seal_args
from hostkv_providers._checks import check_retain_share, overlapping, writable_buffer
from hostkv_providers._errors import (
    CapacityError,
    ClosedError,
    InvalidArgumentError,
    StorageIOError,
    UnknownKeyError,
)
from hostkv_providers._keys import Key
from hostkv_providers._options import Option, OptionSet
from hostkv_providers._provider import Corrupt
from hostkv_providers._reports import EntryInfo, EvictReport, ProviderStats
from hostkv_providers._reservation import Lease, Reservation
from hostkv_providers._span import ByteSpan
from hostkv_providers.providers import _fsutil
from hostkv_providers.providers._budget import check_disk_budget
from hostkv_providers.providers._counters import STORE_COUNTED, StoreCounters, read_counters
from hostkv_providers.providers._slotfile import (
    ReadResult,
    SlotFile,
    prefetch_runs,
    run_nslots,
)

from . import _base
from ._base import _instances, _MmapReservation, _Pending
from ._batch import _BatchWrites
from ._format import (
    _REC_DELETE,
    _SNAPSHOT_MIN,
    _TAG_MAX,
    MMAP_FORMAT,
    MMAP_FORMAT_VERSION,
    OP_DROP,
    OP_RETAIN,
    REC_NBYTES,
    RECORD_DTYPE,
    _encode_drops,
    _encode_seals,
)

# Tests reach the record layout through this module (the format itself lives in ._format).
from ._format import OP_SEAL as OP_SEAL
from ._index import _Index

__all__ = ["MMAP_FORMAT", "MMAP_FORMAT_VERSION", "RECORD_DTYPE", "MmapProvider"]

# ------------------------------------------------------------------------------------------------
# The provider
# ------------------------------------------------------------------------------------------------


_VIEW_TRAITS = operator.attrgetter("format", "ndim", "c_contiguous", "readonly", "nbytes")


def _columns(rows: list[int]) -> Any:
    """A getter of ``rows``' items from an index column (its memoryview): ``col(m) -> list``
    (one C call per column, no per-entry Python)."""
    if len(rows) <= 1:
        return (lambda m: [m[rows[0]]]) if rows else (lambda m: [])
    get = operator.itemgetter(*rows)
    return lambda m: list(get(m))


def _out_views(outs: Sequence[object], at: list[int], sizes: list[int]
               ) -> tuple[list[memoryview], list[int] | None, InvalidArgumentError | None]:
    """The output views of ``read_many``: ``outs[at[t]]`` as a flat writable byte view of
    ``sizes[t]`` bytes (what ``writable_buffer`` makes of it).  Returns the views, the positions
    ``t`` that have one (``None``: all), and the first error of the others (in key order)."""
    n = len(at)
    views: list[memoryview]
    try:
        views = list(map(memoryview, outs if n == len(outs) else [outs[i] for i in at]))  # type: ignore[arg-type]
    except TypeError:
        views = []
    if len(views) == n and n and (
            set(map(_VIEW_TRAITS, views)) == {("B", 1, True, False, sizes[0])} if sizes.count(sizes[0]) == n
            else all(_VIEW_TRAITS(v) == ("B", 1, True, False, size) for v, size in zip(views, sizes, strict=True))):
        return views, None, None  # the common case: flat byte buffers of exactly the entry's size
    dsts: list[memoryview] = []
    keep: list[int] = []
    bad: InvalidArgumentError | None = None
    for t, (i, size) in enumerate(zip(at, sizes, strict=True)):
        try:
            dsts.append(writable_buffer(outs[i], size))
        except InvalidArgumentError as exc:
            bad = bad or exc
            continue
        keep.append(t)
    return dsts, (None if len(keep) == n else keep), bad


class MmapProvider(_BatchWrites):
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
    #: The URL options (``docs/providers/mmap.md``'s table is checked against this).
    OPTIONS = OptionSet(
        "mmap",
        Option("budget", "size", None, "the budget the last writer used (1GiB for a new store)"),
        Option("durability", "choice", "process", "`process`", ("sync", "process", "none")),
        Option("slot", "size", None, "256KiB (new store); the store's (existing)"),
        Option("file_size", "size", None, "`min(budget, 1GiB)`", attr="file_nbytes"),
        Option("verify", "choice", "read", "`read`", ("read", "never"), attr="_verify_mode"),
        Option("readonly", "bool", False, "false"),
        Option("snapshot_every", "int", _SNAPSHOT_MIN, "65536"),
        Option("commit_window_us", "int", 0, "0", attr="_commit_window_us"),
        Option("io", "choice", "pread", "`pread`", ("pread", "mmap"), attr="_io_option"),
        Option("retain_share", "number", 0.5, "0.5"),
    )
    _reservation_type = _MmapReservation
    _tag_max = _TAG_MAX
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
        retain_share: float = 0.5,
    ) -> None:
        super().__init__()
        self._retain_share = check_retain_share(retain_share)
        self._fork_gen = _base._fork_generation
        t0 = time.perf_counter()
        if not isinstance(path, str) or not path:
            raise InvalidArgumentError(f"store path must be a non-empty str, got {path!r}")
        if durability not in ("sync", "process", "none"):
            raise InvalidArgumentError(f"durability must be sync, process or none, got {durability!r}")
        if io not in ("pread", "mmap"):
            raise InvalidArgumentError(f"io must be pread or mmap, got {io!r}")
        self._io = "syscall" if io == "pread" else "mmap"
        self._io_option = io
        if verify not in ("read", "never"):
            raise InvalidArgumentError(f"verify must be read or never, got {verify!r}")
        if budget_bytes is not None and (type(budget_bytes) is not int or budget_bytes <= 0):
            raise InvalidArgumentError(f"budget must be a positive int, got {budget_bytes!r}")
        if type(snapshot_every) is not int or snapshot_every < 1:
            raise InvalidArgumentError(f"snapshot_every must be a positive int, got {snapshot_every!r}")
        self.path = os.path.abspath(path)
        self._durability = durability
        self._verify_reads = verify == "read"
        self._verify_mode = verify
        self._readonly = readonly
        self._snapshot_every = snapshot_every
        self._commit_window = float(commit_window)
        self._commit_window_us = round(self._commit_window * 1e6)
        self._lock = threading.RLock()
        self._commit_cv = threading.Condition(threading.Lock())
        _instances.add(self)
        # the store's own counters (the contract's are the front's: _tally)
        self._counters: dict[str, int] = dict.fromkeys(
            ("stale_reads", "syncs", "group_commits", "snapshot_failures"), 0)
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
        # store-wide counters (<store>/counters, SupportsStoreCounters): the writer adds every
        # count there too; the index's eviction counts are published as deltas (_sync_evictions)
        self._evictions_seen: tuple[object, int, int] = (None, 0, 0)
        try:
            self._open(budget_bytes, slot_nbytes, file_nbytes, create)
            if not readonly:  # a reader never writes to the store, counters included
                self._open_store_counters()
        except BaseException:
            self._release_all()
            raise
        if budget_bytes is not None and not readonly:
            check_disk_budget(self.path, budget_bytes, "mmap")
        self.open_seconds = time.perf_counter() - t0

    def _open_store_counters(self) -> None:
        sink = StoreCounters.open(self.path)
        if sink is not None:
            sink.columns(STORE_COUNTED)
            with self._lock, self._stat_lock:
                self._store_sink = sink
                self._sync_evictions()

    # -- construction ----------------------------------------------------------------------------
    @classmethod
    def from_url(cls, location: str, options: Mapping[str, str]) -> MmapProvider:
        """``mmap:///path?budget=..&durability=sync|process|none&slot=..&file_size=..&verify=read|never
        &readonly=false&snapshot_every=..&commit_window_us=..``"""
        o = cls.OPTIONS.parse(options)
        if not location:
            raise InvalidArgumentError("mmap:// needs a directory path", hint="use mmap:///var/cache/kv?budget=64GiB")
        return cls(
            os.path.expanduser(location),
            budget_bytes=o["budget"],
            durability=o["durability"],
            slot_nbytes=o["slot"],
            file_nbytes=o["file_size"],
            verify=o["verify"],
            readonly=o["readonly"],
            snapshot_every=o["snapshot_every"],
            commit_window=max(0, o["commit_window_us"]) / 1e6,
            io=o["io"],
            retain_share=o["retain_share"],
        )

    # -- lookups ---------------------------------------------------------------------------------
    # (the public verbs are the front's, in Provider; these are the drivers it calls)
    def _present(self, keys: Sequence[bytes]) -> list[bool]:
        ks = self._keys(keys)
        with self._lock:
            self._check_usable()
            return [self._idx.row_of(k) >= 0 for k in ks]

    def _longest_prefix(self, keys: Sequence[bytes]) -> int:
        ks = self._keys(keys)
        with self._lock:
            self._check_usable()
            n = 0
            for k in ks:
                if self._idx.row_of(k) < 0:
                    break
                n += 1
            return n

    def _in_flight(self, k: Key) -> bool:
        with self._lock:
            self._check_usable()
            return k in self._idx.flights

    def _entry(self, k: Key) -> EntryInfo | None:
        with self._lock:
            self._check_usable()
            row = self._idx.row_of(k)
            return None if row < 0 else self._info(row)

    def _info(self, row: int) -> EntryInfo:
        idx = self._idx
        table = idx.anchors.get(row)
        return EntryInfo(idx.key_of(row), idx.parent_key(row), int(idx.nbytes[row]), idx.tag_of(row),
                         int(idx.csum[row]), float(idx.created[row]), float(idx.used[row]),
                         {n: a.nbytes for n, a in table.items()} if table else {}, bool(idx.retained[row]))

    # -- retained entries (SupportsRetain) -------------------------------------------------------
    def retain(self, keys: Sequence[bytes]) -> int:
        """Mark entries retained (see ``SupportsRetain``); the marks are journaled (``OP_RETAIN``
        records, durable per the ``durability`` mode) and kept in every snapshot."""
        return self._set_retained(self._keys(keys), True)

    def unretain(self, keys: Sequence[bytes]) -> int:
        """Clear retain marks (keys not marked or not stored are ignored); journaled likewise."""
        return self._set_retained(self._keys(keys), False)

    def _set_retained(self, ks: list[Key], on: bool) -> int:
        with self._lock:
            self._check_usable()
            self._need_writer("retain" if on else "unretain")
            self._check_failed()
            idx = self._idx
            rows = idx.rows_of(ks)
            if on:
                for k, r in zip(ks, rows, strict=True):
                    if r < 0:
                        raise UnknownKeyError(f"entry {k.hex()[:16]} is not stored; nothing was retained",
                                              hint="retain sealed entries only (save the prefix first)")
                changed = [r for r in dict.fromkeys(rows) if not idx.retained[r]]
                idx.retain_rows(changed, int(self._retain_share * self._budget))
            else:
                changed = [r for r in dict.fromkeys(rows) if r >= 0 and idx.retained[r]]
                idx.unretain_rows(changed)
            if not changed:
                return 0
            idx.clock += 1
            recs = [self._encode(OP_RETAIN, idx.key[r].tobytes(), seq=idx.clock, flags=0 if on else _REC_DELETE)
                    for r in changed]
            gens = [int(idx.gen[r]) for r in changed]
        try:
            self._commit(recs)
        except BaseException:
            with self._lock:  # not durable: take the marks back (rows of the same entries only)
                live = [r for r, g in zip(changed, gens, strict=True) if idx.is_live(r, g)]
                if on:
                    idx.unretain_rows(live)
                else:
                    idx.retain_rows(live, 1 << 62)
            raise
        return len(changed)

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

    def _reserve(self, k: Key, p: Key | None, nbytes: int, salt_tag: str) -> Reservation | None:
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
            return None  # dedup (counted by the caller)
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

    def _write(self, res: _MmapReservation, span: ByteSpan, view: memoryview) -> None:
        # No provider lock: the run is private to its reservation until seal.
        whole = span.offset == 0 and span.nbytes == res.nbytes
        digest = xxhash.xxh3_64_intdigest(view) if whole else None
        self._files[res.file].write(res.slot, res.nbytes, span.offset, view)
        res.digest = digest
        _fsutil.crash_point("mmap.write.partial")

    def _seal(self, res: _MmapReservation) -> None:
        prepared = self._seal_prepare(res, checked=True)
        try:
            self._commit(prepared[-1])
        except BaseException:
            self._seal_undo(prepared)
            raise
        _fsutil.crash_point("mmap.seal.after_journal")
        self._seal_finish(prepared)
        self._snapshot_due()

    def seal_many(self, reservations: Sequence[Reservation], *, checksums: Sequence[int] | None = None,
                  algorithm: str | None = None) -> None:
        """Seal several reservations with one commit: with ``durability=sync`` one data sync and
        one journal sync cover all of them.  All or nothing at the commit: if it fails, every one
        of them is aborted and the error is raised.  Given ``checksums`` are not used: the slot
        files record XXH3-64 of the whole entry, computed here from the bytes."""
        reservations = seal_args(self, reservations, checksums, algorithm)
        if any(not isinstance(r, _MmapReservation) for r in reservations):
            # reservations of the contract's default reserve_many (bytes held until the seal)
            super().seal_many(reservations, checksums=checksums, algorithm=algorithm)
            return
        self._check_usable()
        with self._write_call(), self._claimed_seals(reservations):
            self._seal_many_claimed(reservations)

    def _seal_many_claimed(self, reservations: Sequence[Reservation]) -> None:
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
        self._tally("seals", len(prepared) - len(errors))
        self._snapshot_due()
        if errors:
            raise errors[0]

    def _seal_prepare(self, reservation: Reservation, *, checked: bool = False
                      ) -> tuple[_MmapReservation, SlotFile, int, float, bytes, bytes]:
        """Checksum, slot header (data first, then header) and the journal record of a seal
        (``checked``: the front already checked usability, ownership and completeness)."""
        if checked:
            res: _MmapReservation = reservation  # type: ignore[assignment]
        else:
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
                self._tally("aborts")

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
            self._maybe_snapshot()

    def _abort(self, reservation: _MmapReservation) -> bool:
        with self._lock:
            self._check_usable()
            return self._abort_locked(reservation)

    def _abort_locked(self, reservation: _MmapReservation) -> bool:
        """Release an open reservation (caller holds the lock); ``False`` if it was not open."""
        if reservation.state != "open":
            return False
        self._idx.cancel(reservation.key)
        sf = self._files.get(reservation.file)
        if sf is not None and not sf.closed:
            sf.clear(reservation.slot, reservation.nslots)
        self._release_run(reservation.file, reservation.slot, reservation.nslots)
        reservation._finish("aborted")
        return True

    # -- reads -----------------------------------------------------------------------------------
    def _read(self, k: Key, out: object, span: ByteSpan | None) -> int | Corrupt | None:
        # The per-page hot path: a warm 256 KiB copy takes ~20 us, so steps of 0.1-1 us show.
        # Hence no ByteSpan objects and no numpy scalars (``.item`` is 2x cheaper than
        # ``int(a[i])``).
        with self._lock:
            self._check_usable()
            idx = self._idx
            row = idx.row_of(k)
            if row < 0:
                return None
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
            return n
        return Corrupt((idx, row, gen, result))

    def _drop_damaged(self, k: Key, token: object) -> bool:
        tok: tuple[_Index, int, int, ReadResult] = token  # type: ignore[assignment]  # what _read returned
        idx, row, gen, result = tok
        with self._lock:
            return self._read_failed(idx, row, gen, result)

    def _read_failed(self, idx: _Index, row: int, gen: int, result: ReadResult) -> bool:
        """A read whose copy did not verify: drop the entry if its record is still current;
        ``True`` when that is a checksum failure, ``False`` for a stale read (counted here; the
        caller counts the miss).  Caller holds the lock.

        Raises ``ClosedError`` once the store is closed: a close racing the copy closes the data
        files under it (the copy then fails its header check), which is neither corruption nor
        a reason to drop a good entry (the hostile suite's close-while-writing race once dropped
        it and failed on the closed journal)."""
        if self._closed:
            raise ClosedError(f"{type(self).__name__} was closed during the read")
        still = bool(idx is self._idx and idx.alive[row] and int(idx.gen[row]) == gen)
        # the record is still current and its slot disagrees: corruption (in the writer nobody
        # else reuses slots; in a reader a mismatch may be the writer's reuse)
        corrupt = result is ReadResult.CORRUPT or (still and not self._readonly)
        if not corrupt:
            self._counters["stale_reads"] += 1
        if still:
            self._drop_row(row)
        return corrupt

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
        n = len(ks)
        bad: InvalidArgumentError | None = None
        self._check_usable()
        # The chunk path: the lookups for the batch (TreeIndex.rows_of), the columns through the
        # index's column views (one itemgetter call each), one touch_rows, one SlotFile.read_batch
        # per data file; per entry only its output view is an object.  (Measured: a call starts
        # with the CPU caches emptied by the previous call's copy, where each numpy call costs
        # 5-15 us; builtins over the column views cost a fraction of that.)
        with self._lock:
            self._check_usable()
            idx = self._idx
            rows = idx.rows_of(ks)
            at = list(range(n)) if -1 not in rows else [i for i, r in enumerate(rows) if r >= 0]
            hit = rows if len(at) == n else [rows[i] for i in at]
            col = _columns(hit)
            sizes = col(idx.m_nbytes)
            dsts, keep, bad = _out_views(outs, at, sizes)
            if keep is not None:
                at = [at[t] for t in keep]
                hit = [hit[t] for t in keep]
                col = _columns(hit)
                sizes = col(idx.m_nbytes)
            hits = len(at)
            if hits:
                idx.touch_rows(hit)
                fids, slots, gens, csums = col(idx.m_file), col(idx.m_slot), col(idx.m_gen), col(idx.m_csum)
            files = self._files
        nread = sum(sizes)
        results = [False] * n
        failed: list[tuple[int, int, ReadResult, int]] = []  # row, generation, result, nbytes
        if hits:
            if fids.count(fids[0]) == hits:
                by_file: list[tuple[int, list[int]]] = [(fids[0], list(range(hits)))]
            else:  # several data files: one batch each, in the order of their first entry
                pos: dict[int, list[int]] = {}
                for t, f in enumerate(fids):
                    pos.setdefault(f, []).append(t)
                by_file = list(pos.items())
            for fid, sel in by_file:
                sf = files[fid]
                if len(sel) == hits:
                    cols = (slots, gens, sizes, csums)
                    bufs, ps = dsts, at
                else:
                    cols = tuple([c[t] for t in sel] for c in (slots, gens, sizes, csums))  # type: ignore[assignment]
                    bufs, ps = [dsts[t] for t in sel], [at[t] for t in sel]
                try:
                    codes = sf.read_batch(*cols, [ks[i] for i in ps], bufs, verify=self._verify_reads)
                except StorageIOError:
                    if not sf.closed:
                        raise
                    codes = bytes([ReadResult.STALE]) * len(bufs)  # refresh/compaction swapped the files: misses
                if not any(codes):
                    for i in ps:
                        results[i] = True
                    continue
                for t, i, c in zip(sel, ps, codes, strict=True):
                    if c == ReadResult.OK:
                        results[i] = True
                    else:
                        failed.append((hit[t], gens[t], ReadResult(c), sizes[t]))
        failures = 0
        if failed:
            if len(dsts) > 1 and any(r is ReadResult.CORRUPT for _, _, r, _ in failed) and overlapping(dsts):
                # (a copy into an output buffer that aliases another overwrote that one's bytes
                # before their check: the stored entry is not corrupt, and is not dropped)
                raise InvalidArgumentError("read_many's output buffers overlap: give each key a buffer of its own",
                                           hint="nothing was dropped; which outs[i] hold their entry is undefined")
            with self._lock:
                for row, gen, r, size in failed:
                    failures += self._read_failed(idx, row, gen, r)
                    hits -= 1
                    nread -= size
        self._tally("hits", hits)
        if n - hits:  # (adding 0 changes no counter)
            self._tally("misses", n - hits)
        self._tally("bytes_read", nread)
        if failures:
            self._tally("checksum_failures", failures)
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
            # (the rows in one batch lookup: after a reopen one row_of per key was a numpy
            # searchsorted each, a quarter of a tiered store's restart restore at 4 KiB pages)
            rows = np.asarray(idx.rows_of(ks), dtype=np.int64)
            rows = rows[rows >= 0]
            for fid, slot, nb in zip(idx.file[rows].tolist(), idx.slot[rows].tolist(), idx.nbytes[rows].tolist(),
                                     strict=True):
                if (sf := files.get(fid)) is not None:
                    entries.append((sf, slot, nb))
        prefetch_runs(entries)

    def _drop_row(self, row: int) -> int:
        """Drop a corrupt/stale entry with its subtree (caller holds the lock)."""
        removed = self._idx.drop(row)
        self._free_rows_storage(removed, journal=not self._readonly)
        return len(removed)

    # -- eviction --------------------------------------------------------------------------------
    def _evict(self, ks: list[Key] | None, nbytes: int) -> EvictReport:
        with self._lock:
            self._check_usable()
            self._need_writer("evict")
            removed, total, skipped = self._idx.evict_for(ks, nbytes)
            self._free_rows_storage(removed, journal=True)
            return EvictReport(len(removed), total, skipped)

    def _sync_evictions(self) -> None:
        """Add the evictions the index counted since the last call to the store-wide counters
        (caller holds the lock).  Every eviction path ends in ``_free_rows_storage``, which calls
        this: one add per batch of evictions."""
        sink = self._store_sink
        if sink is None:
            return
        idx = self._idx
        seen, n0, b0 = self._evictions_seen
        if seen is not idx:  # a new index (recovery, a reload) counts from 0
            n0 = b0 = 0
        n, b = idx.evictions, idx.evicted_cost
        if n != n0 or b != b0:
            sink.add_many({"evictions": n - n0, "evicted_bytes": b - b0})
        self._evictions_seen = (idx, n, b)

    def store_counters(self) -> dict[str, int]:
        """Store-wide counters (:class:`~hostkv_providers.providers.SupportsStoreCounters`):
        the sums over every process that opened the store for writing, since its counters file
        was created (a reader, ``readonly=true``, reports them but counts its own reads
        in-process only).  A writer's counts are in the file as they happen."""
        self._check_usable()
        with self._lock:
            self._check_usable()
            self._sync_evictions()
            sink = self._store_sink
            got = sink.totals() if sink is not None else read_counters(self.path)
        out = dict.fromkeys(STORE_COUNTED, 0)
        out.update(got or {})
        return out

    def _free_rows_storage(self, rows: Sequence[int], *, journal: bool) -> None:
        """Journal the removal of ``rows`` (already out of the index), clear their slot headers
        and free their runs and anchors.  Caller holds the lock.  Many rows (a full store evicts
        a chunk's worth for every put_many chunk) go by arrays: their drop records encoded as
        one blob, their headers zeroed and runs freed per data file in one pass each."""
        if not rows:
            return
        idx = self._idx
        if journal and not self._readonly:
            idx.clock += 1
            if len(rows) >= 8:
                recs = [_encode_drops(idx.key[np.asarray(rows, np.int64)], idx.clock)]
            else:
                recs = [self._encode(OP_DROP, idx.key[r].tobytes(), seq=idx.clock) for r in rows]
            self._journal(recs)
            _fsutil.crash_point("mmap.evict.after_drop")
        if len(rows) >= 8 and not self._readonly:
            arr = np.asarray(rows, np.int64)
            fids, slots, nslots = idx.file[arr], idx.slot[arr], idx.nslots[arr]
            for fid in np.unique(fids).tolist():
                sel = fids == fid
                fslots, fn = slots[sel], nslots[sel]
                sf = self._files.get(fid)
                for ns in np.unique(fn).tolist():
                    runs = fslots[fn == ns]
                    if sf is not None and not sf.closed:
                        sf.begin_write_slots(runs.tolist(), ns)
                    self._release_runs(fid, runs, ns)
        else:
            for r in rows:
                fid, slot, nslots1 = int(idx.file[r]), int(idx.slot[r]), int(idx.nslots[r])
                sf = self._files.get(fid)
                if not self._readonly:
                    if sf is not None and not sf.closed:
                        sf.clear(slot, nslots1)
                    self._release_run(fid, slot, nslots1)
        if idx.anchors:
            for r in rows:
                for a in (idx.anchors.pop(r, None) or {}).values():
                    asf = self._files.get(a.file)
                    if not self._readonly:
                        if asf is not None and not asf.closed:
                            asf.clear(a.slot, a.nslots)
                        self._release_run(a.file, a.slot, a.nslots)
        idx.recycle(rows)
        self._sync_evictions()

    # -- leases ----------------------------------------------------------------------------------
    def _lease(self, ks: list[Key]) -> Lease:
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
            return ProviderStats(
                name=self.name,
                budget_bytes=self._budget,
                **self._idx.stats_fields(),
                extra={"durability": self._durability, "slot_nbytes": self._slot, "generation": self._gen,
                       "data_files": len(self._files), "journal_records": self._jrecords,
                       "open_seconds": round(getattr(self, "open_seconds", 0.0), 4), "readonly": self._readonly,
                       "problems": len(self._problems), "stale_at_open": self._stale_at_open,
                       "orphans_at_open": self._orphans_at_open, "torn_tail": self._torn_tail,
                       "stale_reads": self._counters["stale_reads"], "syncs": self._counters["syncs"],
                       "snapshot_failures": self._counters["snapshot_failures"]},
                **self._tallies(),
            )

    @property
    def file_nbytes(self) -> int:
        """The size of each data file (the ``file_size`` option in effect)."""
        return self._file_slots * self._slot

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "path": self.path,
                "generation": self._gen, "format_version": MMAP_FORMAT_VERSION,
                "store_id": self._store_id.hex(), "data_files": sorted(self._files),
                "last_recovery": dict(self._recovery)}

    def close(self) -> None:
        """Flush buffered records, write a snapshot (fast next open), sync, unlock; idempotent.
        Waits for the write calls under way (new ones get ``ClosedError``), so it never closes
        a data file or the journal under a pwrite.  In a forked child it raises
        ``UsedAfterForkError`` without touching anything (the files and the lock are the
        parent's)."""
        self._check_not_forked()  # before any lock: a copied lock may be held forever
        if self._closed:
            return
        self._quiesce()
        with self._lock:
            if self._closed:
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
        sink, self._store_sink = self._store_sink, None
        if sink is not None:
            with self._stat_lock:
                sink.close()
        for sf in self._files.values():
            sf.close()
        if self._jfd is not None:
            with contextlib.suppress(OSError):
                os.close(self._jfd)
            self._jfd = None
        if self._lockfile is not None:
            self._lockfile.release()
            self._lockfile = None


