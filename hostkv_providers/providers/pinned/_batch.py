"""The pinned provider's batch verbs (a layer of :class:`PinnedProvider`, see ``_base``):
``seal_many`` (checksums on a few threads, commits in one lock round), ``put_many`` (a chain
run as one run, else page by page) and ``read_many``."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

from hostkv_providers._chain import seal_args
from hostkv_providers._checks import writable_buffer
from hostkv_providers._errors import CapacityError, HostKVError, InFlightError, InvalidArgumentError, UnknownKeyError
from hostkv_providers._keys import Key
from hostkv_providers._reservation import Lease, Reservation
from hostkv_providers._span import ByteSpan
from hostkv_providers.device._hostmem import copy_bytes
from hostkv_providers.providers.pinned._arena import _checksums, _gather, _scatter, _Token
from hostkv_providers.providers.pinned._run import _PinnedReservation, _PinnedRun
from hostkv_providers.providers.pinned._writes import _Writes


class _Batches(_Writes):
    """The batch verbs (a part of :class:`PinnedProvider`)."""

    def seal_many(self, reservations: Sequence[Reservation], *, checksums: Sequence[int] | None = None,
                  algorithm: str | None = None) -> None:
        """Seal arena reservations root first (see ``Provider.seal_many``): the checksums run on
        a few threads without the lock (XXH3 releases the GIL), the commits in one lock round.
        Given ``checksums`` in this store's algorithm (a GPU's, over the pages before their copy)
        are recorded as they are: no host hashing at all."""
        self._seal_own(self._own_batch(reservations, checksums, algorithm), checksums, algorithm)

    def _own_batch(self, reservations: Sequence[Reservation], checksums: Sequence[int] | None,
                   algorithm: str | None) -> list[_PinnedReservation]:
        """``seal_many``'s reservations, checked (``seal_args``; a refusal changes nothing)."""
        return [self._own_reservation(r, _PinnedReservation) for r in seal_args(self, reservations, checksums,
                                                                                 algorithm)]

    def _seal_held(self, reservations: Sequence[Reservation], held: list[Lease], *,
                   checksums: Sequence[int] | None = None, algorithm: str | None = None) -> None:
        """``seal_many`` that also leases each page in its commit's lock round, appending the
        leases to ``held`` (a sealed prefix's, also when it raises).  The tiered provider pins
        its fast copies this way until their write-back: a lease taken after the seal left a
        window in which another save's reservation could evict the just-sealed page."""
        self._seal_own(self._own_batch(reservations, checksums, algorithm), checksums, algorithm, held)

    def _seal_own(self, own: list[_PinnedReservation], checksums: Sequence[int] | None, algorithm: str | None,
                  held: list[Lease] | None = None) -> None:
        self._check_usable()
        with self._write_call():  # (a close waits for it: the hashing below reads the arena unlocked)
            self._seal_counted(own, checksums, algorithm, held)

    def _seal_counted(self, own: list[_PinnedReservation], checksums: Sequence[int] | None, algorithm: str | None,
                      held: list[Lease] | None) -> None:
        try:
            for r in own:
                r.check_complete()
            if checksums is not None and algorithm == self.checksum_algorithm:
                digests = [int(c) for c in checksums]
            else:
                digests = _checksums([r._regions for r in own], self._sum)
            sealed = 0
            try:
                with self._usable():
                    for r, digest in zip(own, digests, strict=True):
                        r.check_open(self)
                        row = self._commit_locked(r, digest)  # UnknownKeyError: its parent was not sealed
                        sealed += 1
                        if held is not None:
                            held.append(self._lease_locked([r.key], [row]))
            finally:
                # (bytes are counted where they are written: write(), or not at all for a DMA
                # straight into the arena; seals are counted as the front's seal does, once a batch)
                if sealed:
                    self._tally("seals", sealed)
        except BaseException:
            for r in own:  # the sealed ones are a prefix; the rest go
                if r.state == "open":
                    with contextlib.suppress(HostKVError):
                        self.abort(r)
            raise

    def put_many(self, items: Sequence[tuple[bytes, bytes | None, object]], *,
                 salt_tag: str = "") -> list[bool | HostKVError]:
        """Store many pages, root first (:class:`~hostkv_providers.SupportsBatch`).

        Per item ``True`` (stored), ``False`` (already stored) or that item's error
        (``InFlightError``, ``CapacityError``, ``UnknownKeyError`` — also for every item whose
        parent failed in this call).  Each page costs two lock rounds (reserve, commit) and a
        copy and a checksum that run without the GIL; the page just stored stays held until
        the next one is reserved under it, so a chain's tail cannot be evicted mid-call and
        each reservation is O(1) in the tree index.
        """
        checked = self._put_many_args(items, salt_tag)
        self._check_usable()
        with self._write_call():  # (a close waits for it: the copies and hashes use the arena unlocked)
            stored = self._put_run(checked, salt_tag)
            return stored if stored is not None else self._put_pages(checked, salt_tag)

    def _put_pages(self, checked: list[tuple[Key, Key | None, memoryview]],
                   salt_tag: str) -> list[bool | HostKVError]:
        """``put_many`` page by page: two lock rounds a page (reserve, commit)."""
        out: list[bool | HostKVError] = []
        failed: set[Key] = set()
        held: _Token = ([], [])
        try:
            for k, p, view in checked:
                orphan = self._failed_parent(p, failed, k)
                if orphan is not None:
                    out.append(orphan)
                    continue
                try:
                    with self._usable():
                        res = self._reserve_locked(k, p, view.nbytes, salt_tag)
                        # the reservation now holds its parent: the previous hold can go
                        self._index.release_rows(*held)
                        held = self._hold_keys([k]) if res is None else ([], [])
                    if res is None:
                        self._tally("dedup")
                        out.append(False)
                        continue
                    try:
                        _scatter(res._regions, ByteSpan.whole(view.nbytes), view)
                        digest = self._sum(r.view for r in res._regions)
                    except BaseException:
                        self.abort(res)
                        raise
                    with self._usable():
                        res.check_open(self)
                        self._commit_locked(res, digest)
                        held = self._hold_keys([k])
                    self._tally("seals")
                    self._tally("bytes_written", view.nbytes)
                    out.append(True)
                except (CapacityError, InFlightError, UnknownKeyError) as exc:
                    failed.add(k)
                    out.append(exc)
        finally:
            if held[0]:
                with self._lock:
                    self._index.release_rows(*held)
        return out

    def _put_run(self, checked: list[tuple[Key, Key | None, memoryview]],
                 salt_tag: str) -> list[bool | HostKVError] | None:
        """``put_many`` of a chain run of new pages of one size under a sealed parent (or none)
        as one run (``_reserve_run``): one lock round to reserve, the copies, the checksums on a
        few threads and one commit — not two lock rounds and a hash call per page (a tiered
        store promoting a restart's restore into its fast tier spent 80% of the restore here at
        4 KiB pages).  ``None``, with nothing stored, when it is not that case or the run cannot
        be had as one: the caller then stores page by page, which gives each item its exact
        outcome (dedup, ``InFlightError``, a prefix on ``CapacityError``)."""
        n = len(checked)
        if n < 2:
            return None
        ks = [c[0] for c in checked]
        parent, nbytes = checked[0][1], checked[0][2].nbytes
        if (ks[:-1] != [c[1] for c in checked[1:]] or any(c[2].nbytes != nbytes for c in checked)
                or not nbytes):
            return None
        rc = self._reserve_run(ks, parent, nbytes, salt_tag, sealed_parent=True)
        if rc is None:
            return None
        run = rc.run
        assert isinstance(run, _PinnedRun)
        try:
            chunks, bpc, block = self._arena.chunks, self._arena.bpc, self._arena.block
            for (_k, _p, view), st in zip(checked, run.starts.tolist(), strict=True):
                lo = (st % bpc) * block
                copy_bytes(chunks[st // bpc].view[lo : lo + nbytes], view)
            run.written = True
            run.seal(None, None)
        except UnknownKeyError:
            return None  # the parent dropped meanwhile (the run cancelled itself): page by page
        except BaseException:
            with contextlib.suppress(HostKVError):
                run.abort()
            raise
        return [True] * n  # (bytes_written: counted by the run's seal)

    def read_many(self, keys: Sequence[bytes], outs: Sequence[object]) -> list[bool]:
        """Whole entries into ``outs[i]`` (:class:`~hostkv_providers.SupportsBatch`): one lock
        round to find and hold them all, the copies (and checksums, with ``verify_reads``)
        without the lock or the GIL, one lock round to release.  A miss leaves ``outs[i]``
        untouched; an ``outs[i]`` smaller than its entry raises ``InvalidArgumentError`` after
        the others were filled."""
        ks, outs = self._read_many_args(keys, outs)
        idx = self._index
        with self._usable():
            rows = idx.rows_of(ks)
            held = self._hold_rows(rows)
            # what the copies need, read under the lock (a row may be recycled once released)
            found = [(r, int(idx.gen[r]), int(idx.nbytes[r]), idx.runs(r), idx.checksum_of(r)) if r >= 0 else None
                     for r in rows]
            self._copying += 1
        # per key: None (miss or buffer too small), True (copied, checksum ok), False (bad copy)
        state: list[bool | None] = [None] * len(ks)
        short: InvalidArgumentError | None = None
        try:
            for i, f in enumerate(found):
                if f is None:
                    continue
                _, _, nbytes, runs, digest = f
                try:
                    dst = writable_buffer(outs[i], nbytes)
                except InvalidArgumentError as exc:
                    short = short or exc
                    continue
                _gather(self._arena.regions(runs, nbytes, False), ByteSpan.whole(nbytes), dst)
                state[i] = not self._verify_reads or self._sum((dst,)) == digest
        finally:
            got = [False] * len(ks)
            hits = nbytes = failures = 0
            with self._lock:
                idx.release_rows(*held)
                self._copied()
                for i, (f, st) in enumerate(zip(found, state, strict=True)):
                    if f is None or not idx.is_live(f[0], f[1]):
                        continue
                    if st is True:
                        got[i] = True
                        hits += 1
                        nbytes += f[2]
                    elif st is False:
                        # first to see the corruption: drop the entry with its subtree
                        failures += 1
                        self._drop(f[0])
            self._tally("hits", hits)
            self._tally("bytes_read", nbytes)
            self._tally("checksum_failures", failures)
            self._tally("misses", len(ks) - hits)
        if short is not None:
            raise short
        return got
