"""The batch write path of an mmap store: ``put_many``, a chunk of equal pages as one batch (one
flight object per chunk, slots by array scans, one journal blob per chunk) and page by page
where a chunk is not the plain case (a part of :class:`MmapProvider`)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from hostkv_providers._errors import (
    CapacityError,
    ClosedError,
    HostKVError,
    InFlightError,
    UnknownKeyError,
)
from hostkv_providers._keys import Key
from hostkv_providers.providers import _fsutil
from hostkv_providers.providers._slotfile import (
    SlotFile,
    run_nslots,
)

from ._anchors import _Anchors
from ._base import _MmapReservation
from ._format import (
    _PUT_BATCH,
    _TAG_MAX,
    _encode_seals,
    _seal_batch_finish,
    _seal_batch_head,
)


class _BatchWrites(_Anchors):
    """``put_many`` and its batch and per-page paths (a part of :class:`MmapProvider`)."""

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
        keys, parents, views = self._put_many_columns(items, salt_tag, tag_max=_TAG_MAX)
        out: list[bool | HostKVError] = []
        with self._write_call():  # close() waits for it (it must not close a file under a pwrite)
            for lo in range(0, len(keys), _PUT_BATCH):
                if lo and self._closing:  # a close began during the last chunk's snapshot
                    raise ClosedError(f"{type(self).__name__} closed during put_many",
                                      hint=f"the first {lo} items are stored")
                hi = lo + _PUT_BATCH
                out += self._put_chunk(keys[lo:hi], parents[lo:hi], views[lo:hi], salt_tag)
                self._snapshot_due()
        return out

    def _put_chunk(self, keys: list[Key], parents: list[Key | None], views: list[memoryview],
                   salt_tag: str) -> list[bool | HostKVError]:
        """One chunk of ``put_many``: the batch path when the chunk is the plain case, else page
        by page (the exact outcome of every page)."""
        done = self._put_batch(keys, parents, views, salt_tag)
        if done is not None:
            return done
        return self._put_pages(list(zip(keys, parents, views, strict=True)), salt_tag)

    def _put_batch(self, keys: list[Key], parents: list[Key | None], views: list[memoryview],
                   salt_tag: str) -> list[bool | HostKVError] | None:
        """The chunk as one batch of equal pages (``TreeIndex.begin_batch``): reservations, slot
        allocation, slot headers, journal records and the index commit each one pass over the
        chunk's columns, no object per page; the protocol per page is unchanged (headers zeroed,
        data, checksum from the caller's buffer, slot header, journal record, index).  ``None``
        (nothing changed) when the chunk is not the plain case: pages of different sizes, a key
        in flight or repeated, a parent neither stored nor earlier in the chunk, not room for
        all of it.  Keys already stored are dedup (``False``) and may be parents of the others."""
        nb = views[0].nbytes
        for v in views:
            if v.nbytes != nb:
                return None
        nslots = run_nslots(nb, self._slot)
        cost = nslots * self._slot
        if cost > self._budget:
            return None
        idx = self._idx
        total = len(keys)
        pos: list[int] | None = None
        self._check_usable()
        with self._lock:
            self._check_usable()
            self._check_failed()
            stored = list(map(idx.contains_fn, keys))
            if any(stored):  # dedup: the others form the batch (a stored key may be a parent)
                pos = [i for i, s in enumerate(stored) if not s]
                if not pos:
                    self._tally("dedup", total)
                    return [False] * total
                keys = [keys[i] for i in pos]
                parents = [parents[i] for i in pos]
                views = [views[i] for i in pos]
            begun = idx.begin_batch(keys, parents, cost)
            if begun is None:
                return None
            batch, evicted = begun
            n = len(keys)
            try:
                self._free_rows_storage(evicted, journal=True)
                fids, slots = self._allocate_many(n, nslots)
            except CapacityError:  # fragmented, nothing evictable: page by page says which pages fit
                idx.cancel_run(batch)
                return None
            except BaseException:
                idx.cancel_run(batch)
                raise
            gen0 = self._next_gen
            self._next_gen += n
        if pos is not None:
            self._tally("dedup", total - n)
        key_blob = b"".join(keys)
        tag = salt_tag.encode()
        slot_list = slots.tolist()
        by_file = self._by_file(fids)
        digests: list[int] = []
        try:
            # the seal records but what the bytes decide (see _seal_batch_head)
            records = _seal_batch_head(key_blob, parents, tag, nslots, fids, slots, nb, gen0)
            # slot protocol step 1 for every run before any of their bytes change
            for fid, sel in by_file:
                self._files[fid].begin_write_slots(slot_list if sel is None else [slot_list[j] for j in sel],
                                                   nslots)
            _fsutil.crash_point("mmap.reserve.after_clear")
            # the caller's buffers, hashed while they are the source (no re-read of the file);
            # then the headers that vouch for them (data first)
            gens = range(gen0, gen0 + n)
            if len(by_file) == 1:
                sf = self._files[by_file[0][0]]
                sf.write_slots(slot_list, nb, views, digests)
                _fsutil.crash_point("mmap.write.partial")
                sf.write_headers(slot_list, keys, parents, gens, nb, digests)
            else:
                digests[:] = [0] * n
                parts = [(fid, sel or []) for fid, sel in by_file]
                for fid, sel in parts:
                    got: list[int] = []
                    self._files[fid].write_slots([slot_list[j] for j in sel], nb, [views[j] for j in sel], got)
                    for j, d in zip(sel, got, strict=True):
                        digests[j] = d
                _fsutil.crash_point("mmap.write.partial")
                for fid, sel in parts:
                    self._files[fid].write_headers([slot_list[j] for j in sel], [keys[j] for j in sel],
                                                   [parents[j] for j in sel], [gens[j] for j in sel], nb,
                                                   [digests[j] for j in sel])
            _fsutil.crash_point("mmap.seal.after_header")
            created = time.time()
            csums = np.array(digests, np.uint64)
            self._check_usable()
            with self._lock:
                self._check_usable()
                if not batch.open:
                    raise ClosedError(f"{type(self).__name__}: the reservations of this put_many were released")
                seq0 = idx.clock + 1
                idx.clock += n
                self._dirty_files.update(fid for fid, _ in by_file)
                self._unfinished += n
        except BaseException:
            with self._lock:
                self._abort_batch(batch, by_file, fids, slot_list, nslots)
            raise
        try:
            self._commit(_seal_batch_finish(records, csums, created, seq0))
        except BaseException:
            with self._lock:
                self._unfinished -= n
                self._abort_batch(batch, by_file, fids, slot_list, nslots)
            raise
        _fsutil.crash_point("mmap.seal.after_journal")
        mine: list[bool | HostKVError] = [True] * n
        with self._lock:
            self._unfinished -= n
            if idx.commit_batch(batch, nbytes=nb, csums=csums, tag=tag, created=created,
                                gens=np.arange(gen0, gen0 + n, dtype=np.uint64), key_blob=key_blob,
                                file=fids, slot=slots, nslots=nslots) is None:
                # a stored parent was dropped (corrupt) while the bytes went out: page by page,
                # in order, so exactly the pages under it fail (their records are journaled;
                # open drops an entry whose parent is gone)
                for j, k in enumerate(keys):
                    fid, slot = int(fids[j]), slot_list[j]
                    try:
                        idx.commit(k, nbytes=nb, file=fid, slot=slot, nslots=nslots, gen=gen0 + j,
                                   csum=digests[j], tag=tag, created=created)
                    except UnknownKeyError as exc:
                        dsf = self._files.get(fid)
                        if dsf is not None and not dsf.closed:
                            dsf.clear(slot, nslots)
                        self._release_run(fid, slot, nslots)
                        mine[j] = exc
            self._maybe_snapshot()
        nseals = mine.count(True)
        self._tally("seals", nseals)
        self._tally("bytes_written", nseals * nb)
        if pos is None:
            return mine
        results: list[bool | HostKVError] = [False] * total
        for i, r in zip(pos, mine, strict=True):
            results[i] = r
        return results

    @staticmethod
    def _by_file(fids: npt.NDArray[np.int64]) -> list[tuple[int, list[int] | None]]:
        """The data files of a batch, each with the batch positions in it (``None``: all)."""
        ids = fids.tolist()
        if ids.count(ids[0]) == len(ids):  # (Python on a chunk's list: cheaper than numpy calls)
            return [(ids[0], None)]
        return [(int(f), np.flatnonzero(fids == f).tolist()) for f in np.unique(fids)]

    def _abort_batch(self, batch: Any, by_file: list[tuple[int, list[int] | None]], fids: npt.NDArray[np.int64],
                     slots: list[int], nslots: int) -> None:
        """Release a batch that will not be sealed (caller holds the lock): its flights, its
        slot headers (zeroed: a header written for bytes no record points at) and its runs."""
        if not batch.open:
            return
        self._idx.cancel_run(batch)
        for fid, sel in by_file:
            s = slots if sel is None else [slots[j] for j in sel]
            sf = self._files.get(fid)
            if sf is not None and not sf.closed:
                sf.begin_write_slots(s, nslots)
            self._release_runs(fid, np.asarray(s, np.int64), nslots)
        self._tally("aborts", len(batch.keys))

    def _put_pages(self, items: Sequence[tuple[Key, Key | None, memoryview]],
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
                    else:
                        self._tally("dedup")
            except BaseException:
                self._tally("aborts", sum(self._abort_locked(res) for _, res, _ in todo))
                raise
        if not todo:
            return results
        try:
            by_file: dict[int, list[tuple[int, int, memoryview]]] = {}
            where: dict[int, list[int]] = {}  # per file: positions in todo
            for t, (_, res, view) in enumerate(todo):
                by_file.setdefault(res.file, []).append((res.slot, res.nbytes, view))
                where.setdefault(res.file, []).append(t)
            # slot protocol step 1 for every run before any of their bytes change
            for fid, runs in by_file.items():
                self._files[fid].begin_write_runs([(slot, run_nslots(nbytes, self._slot))
                                                   for slot, nbytes, _ in runs])
            _fsutil.crash_point("mmap.reserve.after_clear")
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
                self._tally("aborts", sum(self._abort_locked(res) for _, res, _ in todo))
            raise
        try:
            prepared = self._put_prepare([res for _, res, _ in todo], digests, salt_tag)
        except BaseException:
            with self._lock:
                self._tally("aborts", sum(self._abort_locked(res) for _, res, _ in todo))
            raise
        try:
            self._commit([pr[-1] for pr in prepared])
        except BaseException:
            for pr in prepared:
                self._seal_undo(pr)
            raise
        _fsutil.crash_point("mmap.seal.after_journal")
        # One locked pass, in item order: a parent from this batch becomes a row before its
        # children resolve it, and no other thread can evict it in between.  What _seal_finish
        # does per seal, with the lock taken, the counter settled and the snapshot check made
        # once for the chunk.
        nbytes = 0
        with self._lock:
            commit = self._idx.commit
            self._unfinished -= len(prepared)
            for (i, _, view), (res, sf, digest, created, tag, _) in zip(todo, prepared, strict=True):
                try:
                    commit(res.key, nbytes=res.nbytes, file=res.file, slot=res.slot, nslots=res.nslots,
                           gen=res.gen, csum=digest, tag=tag, created=created)
                except UnknownKeyError as exc:  # its parent was dropped (corrupt) meanwhile
                    sf.clear(res.slot, res.nslots)
                    self._release_run(res.file, res.slot, res.nslots)
                    res._finish("aborted")
                    results[i] = exc
                    continue
                res._finish("sealed")
                results[i] = True
                nbytes += view.nbytes
            self._maybe_snapshot()
        self._tally("seals", sum(r is True for r in results))
        self._tally("bytes_written", nbytes)
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
