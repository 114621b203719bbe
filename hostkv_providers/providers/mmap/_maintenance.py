"""Maintenance of an mmap store: ``verify`` (with repair) and crash-safe ``compact``."""

from __future__ import annotations

import contextlib
import logging
import os
from typing import TYPE_CHECKING

import numpy as np
import xxhash

from hostkv_providers._checks import check_flag, check_progress
from hostkv_providers._errors import (
    HostKVError,
    ReservationError,
)
from hostkv_providers._reports import CompactReport, Progress, VerifyReport
from hostkv_providers.providers import _fsutil
from hostkv_providers.providers._slotfile import (
    FLAG_ANCHOR,
    ReadResult,
    SlotFile,
)

from ._format import _REC_DELETE, _SNAP_HEADER, _SNAP_MAGIC, OP_ANCHOR, REC_NBYTES
from ._index import _Anchor
from ._recovery import _Recovery

if TYPE_CHECKING:
    pass


_log = logging.getLogger(__name__)


class _Maintenance(_Recovery):
    """Verify and compact (a part of :class:`MmapProvider`)."""

    # -- verify / compact ------------------------------------------------------------------------
    def verify(self, *, repair: bool = False, progress: Progress | None = None) -> VerifyReport:
        """Check every entry's slot header and page checksum (and every anchor's); report findings
        from open (damaged index records, reclaimed leftovers) as ``problems``.  ``repair`` drops
        corrupt entries with their subtrees and rewrites the index (writer only)."""
        check_flag(repair, "repair")
        check_progress(progress)
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
                    self._tally("checksum_failures")
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
        check_progress(progress)
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
