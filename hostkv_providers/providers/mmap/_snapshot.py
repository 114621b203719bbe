"""Snapshots of the mmap store's index and the journal rotation that follows them."""

from __future__ import annotations

import contextlib
import logging
import os
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import xxhash

from hostkv_providers._errors import (
    HostKVError,
    StorageIOError,
)
from hostkv_providers.providers import _fsutil

from ._format import _SNAP_HEADER, _SNAP_MAGIC, OP_ANCHOR, OP_RETAIN, REC_NBYTES, _build_records, _read_exact
from ._journal import _Journal

if TYPE_CHECKING:
    pass


_log = logging.getLogger(__name__)


class _Snapshots(_Journal):
    """Index snapshots (a part of :class:`MmapProvider`)."""

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
        for row in np.flatnonzero(idx.retained[: idx.n] & idx.alive[: idx.n]).tolist():
            extra.append(self._encode(OP_RETAIN, idx.key[row].tobytes(), seq=int(idx.tick[row])))
        cols["anchors"] = extra  # every record after the seals: anchors, then retain marks
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
        # The snapshot is not part of the write call that found it due (a seal, a put_many
        # chunk): close() need not wait for it (a close meanwhile writes its own snapshot and
        # this one is discarded), so step out of the front's call count while it is written and
        # back in after (as cleanup: a close that began meanwhile is seen by the caller through
        # ``_closing``, see put_many).
        self._call_end()
        try:
            self._write_due_snapshot()
        except HostKVError as exc:
            with self._lock:
                self._counters["snapshot_failures"] += 1
                self._snap_due = True
            _log.warning("mmap %s: periodic snapshot failed: %s", self.path, exc)
        finally:
            self._snap_mutex.release()
            self._call_begin(cleanup=True)

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
