"""The tiered provider's chain reservation (``reserve_many``/``seal_many``: a save DMAs straight
into the fast tier), the write-through of what a full fast tier cannot take, and the
back-pressure that paces seals behind the write-back."""

from __future__ import annotations

import contextlib
import ctypes
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from hostkv_providers._capabilities import SupportsBatch
from hostkv_providers._chain import (
    _DEFERRED,
    ReservedChain,
    _DeferredReservation,
    chain_keys,
    reserve_run_first,
    seal_args,
)
from hostkv_providers._errors import (
    CapacityError,
    ClosedError,
    HostKVError,
    InFlightError,
    InvalidArgumentError,
    UnknownKeyError,
)
from hostkv_providers._keys import Key
from hostkv_providers._region import HostPages, HostRegion
from hostkv_providers._reservation import Lease, Reservation
from hostkv_providers.providers._tree._chainrun import TreeChainRun

from ._entries import _left_fast_tier, _Pending, _PendingRun, _TieredReservation
from ._writeback import _WriteBack

#: How long a save waits for a copy an earlier entry left in the fast tier (pinned by a write-back
#: batch in progress) before it refuses with InFlightError.
_STALE_WAIT_S = 30.0


class _Chains(_WriteBack):
    """Chain reservation and back-pressure (a part of :class:`TieredProvider`)."""

    def _wait_for_room(self) -> None:
        """Back-pressure: wait (without any lock held) while the write-back queue is full."""
        with self._room:
            while self._queued_pages >= self._queue_pages and self._writer.is_alive():
                self._room.wait(0.5)

    def reserve_many(self, keys: Sequence[bytes], parents: Sequence[bytes | None], nbytes: int, *,
                     salt_tag: str = "") -> ReservedChain:
        """Reserve a chain run straight in the fast tier (see ``Provider.reserve_many``), so a
        copy engine DMAs into its (pinned) memory before the first seal.

        The tiered index takes the run in one lock round (a parent may be in flight: an earlier
        key of this call or of an earlier ``reserve_many``), then the fast tier reserves the run
        with its own ``reserve_many``, the run's first page as a root there (the fast tier is a
        byte cache under the tiered index; runs rooted apart stay evictable run by run).  A run
        the fast tier cannot take right now (pending write-backs pin its memory) is not refused
        and not waited for: over a slow tier with ``put_many`` it goes whole to one ordinary
        buffer, sealed into the write-back queue behind the fast tier's pages (``_HeapRun``;
        its seal waits only while such buffers hold the fast tier's budget).  Otherwise (a slow
        tier without ``put_many``, a chain that is not one plain run) the pages the fast tier
        cannot take get ordinary buffers (deferred reservations, like the base class's default;
        so do the pages after a parent of that kind), and ``seal_many`` writes them through to
        the slow tier, a run per ``put_many`` (:meth:`_store_through`).
        """
        ks = chain_keys(self, keys, parents)
        # (a chain run: one run in both indexes; anything else goes page by page)
        chain = reserve_run_first(self, ks, parents, nbytes, salt_tag, self._reserve_run)
        if chain is not None:
            return chain
        checked = [self._reserve_args(k, p, nbytes, salt_tag) for k, p in zip(ks, parents, strict=True)]
        self._check_usable()
        out: list[Reservation | None] = []
        error: HostKVError | None = None
        flown: list[tuple[int, Key, Key | None]] = []  # (position in out, key, parent) in the index
        deferred_from = len(checked)  # from here on: deferred pages (their parent is one)
        with self._lock:
            self._check_usable()
            for i, (k, p, n) in enumerate(checked):
                if p is not None and (id(self), p) in _DEFERRED:
                    deferred_from = i
                    break
                if n > self._budget:
                    error = CapacityError(f"{n} bytes exceed the whole budget of {self._budget}")
                    break
                try:
                    ok, evicted, _ = self._index.begin_chained(k, p, n)
                except (CapacityError, InFlightError, UnknownKeyError) as exc:
                    error = exc
                    break
                self._drop_from_tiers(evicted)
                if ok:
                    flown.append((len(out), k, p))
                out.append(None)
        if error is not None:
            deferred_from = len(out)
        inners: list[Reservation] = []
        try:
            inners = self._reserve_fast_run([(k, p) for _, k, p in flown], nbytes, salt_tag)
        except BaseException:
            with self._lock:
                for _, k, _ in flown:
                    self._index.cancel(k)
            raise
        for (j, k, p), inner in zip(flown, inners, strict=False):
            out[j] = _TieredReservation(self, k, p, nbytes, salt_tag, inner)
        if len(inners) < len(flown):
            # the fast tier is full: the rest of the run is stored page by page at seal
            with self._lock:
                for _, k, _ in flown[len(inners):]:
                    self._index.cancel(k)
            for j, k, p in flown[len(inners):]:
                out[j] = self._deferred(k, p, nbytes, salt_tag)
        if error is None and deferred_from < len(checked):
            tail = checked[deferred_from:]
            with self._lock:  # one lock round for the tail, not a present()/in_flight() per page
                self._check_usable()
                contains, flights = self._index.contains_fn, self._index.flights
                states = [(contains(k), k in flights) for k, _, _ in tail]
            for (k, p, n), (here, busy) in zip(tail, states, strict=True):
                if here:
                    out.append(None)
                    continue
                if busy:
                    error = InFlightError(f"key {k.hex()[:16]} is being written by another writer", key=k)
                    break
                out.append(self._deferred(k, p, n, salt_tag))
        return ReservedChain(out, error)

    def _reserve_run(self, ks: list[Key], parent: Key | None, nbytes: int, salt_tag: str) -> ReservedChain | None:
        """The chain run ``ks`` (all new) reserved as one run of the tiered index and one run of
        the fast tier (a :class:`_TieredRun`); per-page reservations where the fast tier cannot
        take it as one run right now; or ``None`` — nothing changed — when it is not the plain
        case (see ``TreeIndex.begin_run``; a parent waiting in a deferred buffer): the caller
        reserves page by page."""
        if (parent is not None and (id(self), parent) in _DEFERRED) or nbytes > self._budget or parent in ks:
            return None
        self._check_usable()
        with self._lock:
            self._check_usable()
            begun = self._index.begin_run(ks, parent, nbytes)
            if begun is None:
                return None
            run, evicted = begun
            try:
                self._drop_from_tiers(evicted)
            except BaseException:
                self._index.cancel_run(run)
                raise
        parents = [parent, *ks[:-1]]
        try:
            frc = self._fast_reserve(list(zip(ks, parents, strict=True)), nbytes, salt_tag)
        except BaseException:
            with self._lock:
                self._index.cancel_run(run)
            raise
        if frc.run is not None and frc.pages is not None and len(frc) == len(ks) and frc.error is None:
            return ReservedChain(error=None, pages=frc.pages,
                                 run=_TieredRun(self, run, frc, ks, parent, nbytes, salt_tag))
        inners = self._fast_prefix(frc)
        if len(inners) < len(ks) and isinstance(self.slow, SupportsBatch):
            # The fast tier is full of pages waiting for their write-back: the whole run goes to
            # one ordinary buffer and, once sealed, into the write-back queue behind them
            # (_HeapRun).  The prefix the fast tier took is given back: a run lives in one place.
            for r in inners:
                with contextlib.suppress(HostKVError):
                    self.fast.abort(r)
            try:
                heap = _HeapRun(self, run, ks, parent, nbytes, salt_tag)
            except BaseException as exc:
                with self._lock:
                    self._index.cancel_run(run)
                if isinstance(exc, MemoryError):
                    raise CapacityError(f"no host memory for a buffer of {len(ks)} pages past the full fast tier",
                                        hint="save fewer pages at once, or give the fast tier more room") from None
                raise
            return ReservedChain(error=None, pages=heap.pages, run=heap)
        # The fast tier took it page by page, or a prefix (full of pages waiting for their
        # write-back) and the slow tier stores page by page: those reservations are kept, as
        # reserve_many's page-by-page path would have made them, and the rest waits in ordinary
        # buffers for a write-through at seal.
        with self._lock:
            self._index.split_run(run)
            for k in ks[len(inners):]:
                self._index.cancel(k)
        out: list[Reservation | None] = [_TieredReservation(self, k, p, nbytes, salt_tag, inner)
                                         for k, p, inner in zip(ks, parents, inners, strict=False)]
        out += [self._deferred(k, p, nbytes, salt_tag) for k, p in zip(ks[len(inners):], parents[len(inners):],
                                                                          strict=True)]
        return ReservedChain(out, None)

    def _deferred(self, k: Key, p: Key | None, nbytes: int, salt_tag: str) -> Reservation:
        res = _DeferredReservation(self, k, p, nbytes, salt_tag)
        _DEFERRED[(id(self), k)] = res
        return res

    def _reserve_fast_run(self, run: Sequence[tuple[Key, Key | None]], nbytes: int,
                          salt_tag: str) -> list[Reservation]:
        """Fast-tier reservations for a prefix of ``run``: what the fast tier can take *now*.

        No waiting for write-backs to free fast memory: the rest of the run gets ordinary buffers
        and is written through to the slow tier at seal, one ``put_many`` per run
        (:meth:`_store_through`).  Waiting here serialised a save over a full fast tier with the
        write-back: the caller (HostKVCache) reserves chunk k+1 before it seals chunk k, so with
        two chunks in fast memory every reservation waited for the write-back of the chunk
        sealed just before it (2,000 x 4 KiB over a 2 MiB fast tier: 1.3-2x the time of a fast
        tier that holds the chain)."""
        return self._fast_prefix(self._fast_reserve(run, nbytes, salt_tag))

    def _fast_reserve(self, run: Sequence[tuple[Key, Key | None]], nbytes: int, salt_tag: str) -> ReservedChain:
        """The fast tier's ``reserve_many`` of ``run`` (a tree of its own there), copies left by
        entries evicted earlier evicted first."""
        ks = [k for k, _ in run]
        if not ks:
            return ReservedChain([])
        # A copy left in the fast tier by an entry evicted earlier must not dedup this one.
        self._evict_stale_fast(ks)
        # Each run is a tree of its own in the fast tier: its first page lands there as a root
        # (the tiered index keeps the real tree).  Chained onto the previous run instead, the
        # fast tier would hold one long chain whose only leaf is the parent of the page being
        # reserved (held): nothing evictable, so once full it could never take another page
        # (2,000 x 4 KiB over a 2 MiB fast tier: 1,485 pages fell back to per-page stores).
        mine = set(ks)
        fast_parents = [None] + [p if p in mine else None for _, p in run[1:]]
        return self.fast.reserve_many(ks, fast_parents, nbytes, salt_tag=salt_tag)

    def _fast_prefix(self, rc: ReservedChain) -> list[Reservation]:
        """The reserved prefix of a fast-tier ``reserve_many`` as per-page reservations; what
        follows the first page not reserved is given back (it is stored at seal)."""
        got: list[Reservation] = []
        for r in rc.reservations:
            if r is None:  # stored in the fast tier since the eviction above: not ours to seal
                break
            got.append(r)
        for r in rc.reservations[len(got):]:  # give back what follows it; the rest is stored at seal
            if r is not None:
                with contextlib.suppress(HostKVError):
                    self.fast.abort(r)
        return got

    def _queue_run(self, run: _PendingRun) -> None:
        """Queue the write-back of a chain run just committed, as one record (lock held, so a
        flush sees it and runs queue in commit order: gens ascending, ``_run_starts`` sorted)."""
        with self._room:
            self._queued_pages += run.n
        self._pend_runs[run.gen0] = run
        self._run_starts.append(run.gen0)
        self._queue.put(("run", run))

    def _wait_for_heap_room(self, nbytes: int, counted: list[bool]) -> None:
        """Back-pressure for a heap run's seal (no lock held): wait while the write-back queue is
        full or the heap runs already waiting hold more than the overflow's bound with this one
        (a run larger than the bound goes when none waits), then count its ``nbytes`` and set
        ``counted[0]`` (the caller gives them back if its seal fails).  First come, first served:
        no seal overtakes an earlier one (else a stream of small runs could hold a large one back
        for good, or the other way round)."""
        me = object()
        with self._room:
            self._heap_waiting.append(me)
            try:
                while self._writer.is_alive() and (
                        self._queued_pages >= self._queue_pages
                        or self._heap_waiting[0] is not me
                        or (self._heap_bytes and self._heap_bytes + nbytes > self._heap_limit)):
                    self._room.wait(0.5)
                self._heap_bytes += nbytes
                counted[0] = True
            finally:
                self._heap_waiting.remove(me)
                self._room.notify_all()

    def _evict_stale_fast(self, ks: Sequence[Key]) -> None:
        """Evict the copies that entries evicted earlier left in the fast tier under ``ks``: read
        (or deduped) for the entry saved now under the same key they would hand out the old
        bytes.  A copy the write-back is still copying out is pinned until its batch ends (the
        writer then evicts it): wait for the writer's rounds until it can go (no lock held); one
        that stays past ``_STALE_WAIT_S`` refuses the save with ``InFlightError``, never a new
        entry served from the old copy."""
        stale = [k for k, here in zip(ks, self.fast.present(ks), strict=True) if here]
        deadline = time.monotonic() + _STALE_WAIT_S
        while stale:
            with self._room:
                seen = self._wb_rounds
            with contextlib.suppress(HostKVError):
                self.fast.evict(stale)
            stale = [k for k, here in zip(stale, self.fast.present(stale), strict=True) if here]
            if not stale:
                return
            if time.monotonic() >= deadline or not self._writer.is_alive():
                raise InFlightError(f"a copy of an earlier entry under key {stale[0].hex()[:16]} is still held "
                                    "in the fast tier", key=stale[0])
            with self._room:
                while self._wb_rounds == seen and self._writer.is_alive() and time.monotonic() < deadline:
                    self._room.wait(0.5)

    def _wait_landed(self, key: Key | None) -> None:
        """Wait (no lock held) until ``key`` is no longer waiting for its write-back: in the slow
        tier, or dropped (then storing a child fails as it should, with ``UnknownKeyError``)."""
        if key is None:
            return
        idx = self._index
        while True:
            with self._room:
                seen = self._wb_rounds
            with self._lock:
                row = idx.row_of(key)
                if row < 0 or not self._pending(int(idx.gen[row])):
                    return
            with self._room:
                while self._wb_rounds == seen and self._writer.is_alive():
                    self._room.wait(0.5)
            if not self._writer.is_alive():
                return

    def _store_through(self, run: Sequence[_DeferredReservation]) -> None:
        """Store a run of deferred reservations (a chain run whose bytes wait in ordinary buffers:
        the fast tier had no room for it at ``reserve_many``) straight in the slow tier, with one
        ``put_many``, root first; their tiered rows are published once it returned.

        The run's first parent must be in the slow tier first: when it still waits for its
        write-back, this waits for that one (not for the whole queue); the rest of a chain then
        follows write-through, each run's parent already there.  On failure the stored pages are
        a prefix; the failing one is left open (``seal_many`` aborts it and the rest) and its
        error raised."""
        for r in run:
            r.check_open(self)
            r.check_complete()
        self._wait_landed(run[0].parent)
        idx = self._index
        error: HostKVError | None = None
        flown: list[_DeferredReservation] = []
        self._check_usable()
        with self._lock:
            self._check_usable()
            for r in run:
                if isinstance(r, _HeapPage):  # (its flight is in the index since reserve_many)
                    flown.append(r)
                    continue
                try:
                    ok, evicted, _ = idx.begin_chained(r.key, r.parent, r.nbytes)
                except (CapacityError, InFlightError, UnknownKeyError) as exc:
                    error = exc
                    break
                self._drop_from_tiers(evicted)
                if not ok:  # sealed meanwhile by another writer: that copy stands (and may be
                    break   # waiting for its write-back: the rest go page by page below)
                flown.append(r)
            # The key was evicted before and saved again; a stale copy of the evicted entry (with
            # its anchors) may still be in the slow tier: replace it rather than adopt it.
            ks = [r.key for r in flown]
            doomed = [k for k in ks if k in self._doomed]
            self._doomed.difference_update(doomed)
        stored = 0
        try:
            if ks:
                stale = [k for k, here in zip(ks, self.slow.present(ks), strict=True) if here]
                if stale:  # also an orphan of a cancelled write-back
                    self.slow.evict(stale)
                self._evict_stale_fast(ks)  # a copy left in the fast tier must not be read for this entry
                tag = run[0].salt_tag
                items = [(r.key, r.parent, r._view) for r in flown]
                if isinstance(self.slow, SupportsBatch) and all(r.salt_tag == tag for r in flown):
                    got: list[bool | HostKVError] = self.slow.put_many(items, salt_tag=tag)
                else:
                    got = []
                    for (k, p, d), r in zip(items, flown, strict=True):
                        try:
                            got.append(self.slow.put(k, p, d, salt_tag=r.salt_tag))
                        except HostKVError as exc:
                            got.append(exc)
                            break
            else:
                got = []
            with self._lock:
                for r, g in zip(flown, got, strict=False):
                    if not (g is True or g is False):  # False: the same key (same bytes) was there
                        error = error or (g if isinstance(g, HostKVError) else HostKVError(str(g)))
                        break
                    if self._closed:
                        break
                    try:
                        idx.commit(r.key, nbytes=r.nbytes, tag=r.salt_tag)
                    except UnknownKeyError as exc:  # its parent was dropped meanwhile
                        with contextlib.suppress(HostKVError):
                            self.slow.evict([r.key])
                        error = exc
                        break
                    r._finish("sealed")
                    stored += 1
                for r in flown[stored:]:
                    idx.cancel(r.key)
                self._counters["write_through"] += stored
        except BaseException:
            with self._lock:
                for r in flown[stored:]:
                    idx.cancel(r.key)
            raise
        finally:
            if stored:
                self._tally("seals", stored)
        if self._closed and stored < len(flown):
            self._check_usable()  # ClosedError: the rest is aborted by seal_many
        if error is not None:
            raise error
        for r in run[len(flown):]:  # after a key another writer sealed: the per-page path
            r._store()

    def _put_run(self, run: Sequence[tuple[Key, Key | None, memoryview]], salt_tag: str,
                 failed: set[Key]) -> list[bool | HostKVError]:
        """``put_many``'s results for one chain run (each page's parent the one before it, one
        size), stored with ``reserve_many`` + a copy per page + one seal (a run of new pages:
        in the fast tier or a heap run) or ``seal_many`` (per-page reservations); adds the keys
        that failed to ``failed``."""
        ks = [k for k, _, _ in run]
        rc = self.reserve_many(ks, [p for _, p, _ in run], run[0][2].nbytes, salt_tag=salt_tag)
        if rc.run is not None and rc.pages is not None:
            # One run of new pages (in the fast tier, or a heap run past it): a copy per page into
            # its memory and one seal, queued as one record; no reservation or write-back record
            # per page (the engine adapters store through put_many: per-page objects there set
            # off the collector's full passes in the engine's process).
            page_nbytes = rc.pages.page_nbytes
            # (a fast-tier run's memory is the fast tier's: a close waits for the copies and a
            # later one finds it closed, as it does for the fast tier's own writes; a heap run's
            # buffer is the run's own)
            guard = self.fast._write_call() if isinstance(rc.run, _TieredRun) else contextlib.nullcontext()
            try:
                with guard:
                    for addr, (_, _, view) in zip(rc.pages.addresses.tolist(), run, strict=True):
                        if view.nbytes != page_nbytes:  # (put_many groups one size: never, unless a caller changes)
                            raise InvalidArgumentError(f"a page of {view.nbytes} bytes in a run of {page_nbytes}")
                        ctypes.memmove(addr, np.frombuffer(view, dtype=np.uint8).ctypes.data, page_nbytes)
                rc.mark_written()
            except BaseException:
                rc.abort()  # (nothing stays reserved: the keys can be saved again)
                raise
            try:
                rc.seal()  # (all or nothing)
            except (CapacityError, InFlightError, UnknownKeyError) as exc:
                failed.update(ks)
                return [exc] * len(ks)
            return [True] * len(ks)
        ress = rc.reservations
        out: list[bool | HostKVError] = []
        mine: list[Reservation] = []
        try:
            for (_, _, view), r in zip(run, ress, strict=False):
                if r is not None:
                    r.write(0, view)
                    mine.append(r)
        except BaseException:
            for r in ress:
                if r is not None and r.state == "open":
                    with contextlib.suppress(HostKVError):
                        r.abort()
            raise
        error: HostKVError | None = None
        try:
            self.seal_many(mine)  # root first; on failure a sealed prefix, the rest aborted
        except (CapacityError, InFlightError, UnknownKeyError) as exc:
            error = exc
        for m, r in enumerate(ress):
            k = ks[m]
            orphan = self._failed_parent(run[m][1], failed, k)
            if orphan is not None:
                out.append(orphan)
            elif r is None:
                out.append(False)
                self._tally("dedup")
            elif r.state == "sealed":
                out.append(True)
            else:
                failed.add(k)
                out.append(error or UnknownKeyError(f"page {k.hex()[:16]} was not stored"))
        if len(ress) < len(run):  # reserve_many stopped there
            k = ks[len(ress)]
            orphan = self._failed_parent(run[len(ress)][1], failed, k)
            if orphan is not None:
                out.append(orphan)
            else:
                failed.add(k)
                out.append(rc.error or UnknownKeyError(f"page {k.hex()[:16]} was not reserved"))
            for (k, p, _) in run[len(ress) + 1:]:
                out.append(self._failed_parent(p, failed, k)
                           or UnknownKeyError(f"page {k.hex()[:16]} was not reserved"))
        return out

    def seal_many(self, reservations: Sequence[Reservation], *, checksums: Sequence[int] | None = None,
                  algorithm: str | None = None) -> None:
        """Seal root first (see ``Provider.seal_many``): each run of fast-tier reservations with
        one ``seal_many`` of the fast tier (for ``pinned``: checksums on a few threads, commits
        in one lock round; given ``checksums`` in the fast tier's algorithm are passed on to it),
        then their tiered rows and write-backs; each run of deferred pages is written through to
        the slow tier with one ``put_many`` (:meth:`_store_through`), and reservations written
        through by ``reserve`` are sealed one by one.  On failure the sealed ones are a prefix and every other
        one is aborted."""
        reservations = seal_args(self, reservations, checksums, algorithm)
        for res in reservations:
            if not isinstance(res, Reservation) or res.provider is not self:
                raise InvalidArgumentError("seal_many() takes reservations of this provider")
        self._check_usable()
        i = 0
        try:
            while i < len(reservations):
                res = reservations[i]
                if isinstance(res, _TieredReservation) and res.inner.provider is self.fast:
                    j = i
                    while (j < len(reservations) and isinstance(reservations[j], _TieredReservation)
                           and reservations[j].inner.provider is self.fast):  # type: ignore[attr-defined]
                        j += 1
                    run: list[_TieredReservation] = [self._own_reservation(r, _TieredReservation)
                                                     for r in reservations[i:j]]
                    for r in run:
                        r.check_complete()
                    self._wait_for_room()
                    self._seal_fast_pages(run, None if checksums is None else checksums[i:j], algorithm)
                    i = j
                elif isinstance(res, _DeferredReservation):
                    j = i
                    while (j < len(reservations) and isinstance(reservations[j], _DeferredReservation)
                           and reservations[j].state == "open"):
                        j += 1
                    if j == i:  # not open: let _store() raise the reservation's own error
                        res._store()
                        i += 1
                        continue
                    deferred = [r for r in reservations[i:j] if isinstance(r, _DeferredReservation)]
                    try:
                        self._store_through(deferred)
                    finally:
                        i += sum(1 for r in deferred if r.state == "sealed")
                    i = j
                else:
                    self.seal(res)
                    i += 1
        except BaseException:
            for rest in reservations[i:]:
                if rest.state == "open":
                    with contextlib.suppress(HostKVError):
                        rest.abort()
            raise


    def _seal_fast_pages(self, run: list[_TieredReservation], checksums: Sequence[int] | None,
                         algorithm: str | None) -> None:
        """Seal ``run`` (pages reserved in the fast tier) with one ``seal_many`` of the fast tier,
        then publish the sealed prefix; on failure the caller aborts the pages not published
        (``state`` still open).  A fast tier with ``_seal_held`` (pinned) leases each page in
        its seal's lock round; another is leased right after, and a page evicted in between
        fails the seal (``_left_fast_tier``)."""
        held: list[Lease] = []
        inners = [r.inner for r in run]
        seal_held = getattr(self.fast, "_seal_held", None)
        published = 0
        try:
            if seal_held is not None:
                seal_held(inners, held, checksums=checksums, algorithm=algorithm)
            elif checksums is not None:
                self.fast.seal_many(inners, checksums=checksums, algorithm=algorithm)
            else:
                self.fast.seal_many(inners)
        finally:
            try:
                for m, r in enumerate(run):  # a prefix is sealed in the fast tier
                    if r.inner.state != "sealed":
                        break
                    self._commit_sealed(r, False, held[m] if m < len(held) else None)
                    published += 1
                    self._tally("seals")
            finally:
                for lease in held[published + 1:]:  # (the page that failed released its own)
                    with contextlib.suppress(HostKVError):
                        lease.release()


class _TieredRun(TreeChainRun):
    """A chain run reserved in one go in the tiered index and in the fast tier (whose own run,
    ``frc``, holds the pages the copy engine fills): sealed all at once, root first — the fast
    tier's run commits, then the tiered index's, then each page's write-back is queued as a
    page sealed alone would be.  ``materialize`` splits both runs into per-page reservations."""

    __slots__ = ("_frc",)

    def __init__(self, prov: _Chains, run: object, frc: ReservedChain, keys: list[Key], parent: Key | None,
                 nbytes: int, salt_tag: str) -> None:
        super().__init__(prov, run, keys, parent, nbytes, salt_tag)
        self._frc = frc

    def materialize(self) -> list[Reservation]:
        state = self._split()
        if self.written:
            self._frc.mark_written()
        inner = self._frc.reservations  # (the fast tier's run, split the same way)
        assert None not in inner
        return self._per_page(
            state, lambda k, p, r: _TieredReservation(self._prov, k, p, self.nbytes, self.salt_tag, r), inner)

    def seal(self, checksums: Sequence[int] | None, algorithm: str | None) -> None:
        prov = self._prov
        self._check_sealable()
        prov._wait_for_room()
        self._frc.mark_written()
        fast, keys, idx = prov.fast, self.keys, prov._index
        leases: list[Lease] = []
        run_lease: Lease | None = None
        seal_held = getattr(self._frc.run, "seal_held", None)
        if seal_held is not None:
            # (pinned: sealed, and leased until the write-back in one lock round — no window in
            # which another save's reservation could evict a page sealed but unleased — with one
            # lease for the run, which the writer lets go of page by page)
            run_lease = seal_held(checksums, algorithm)
            leases = [run_lease]
        else:
            self._frc.seal(checksums=checksums, algorithm=algorithm)  # (the fast tier's run: all or nothing)
            try:  # each page's copy pinned in the fast tier until its write-back (as a page sealed alone)
                for k in keys:
                    leases.append(fast.lease([k]))
            except BaseException:
                self._undo_fast(leases)
                raise
        with prov._lock:
            failed: BaseException | None = None
            gone = None if run_lease is not None else next(
                (k for k, lease in zip(keys, leases, strict=True) if not lease.present[0]), None)
            if gone is not None:
                failed = _left_fast_tier(gone)
            elif prov._closed:
                failed = ClosedError("the tiered provider closed during the seal")
                idx.cancel_run(self._run)
            else:
                try:
                    rows = idx.commit_run(self._run, nbytes=self.nbytes, tag=self.salt_tag)
                except UnknownKeyError as exc:
                    failed = exc
            if failed is None:  # (queued under the lock, as a page sealed alone: a flush sees them)
                self.state = "sealed"
                self.sealed = self.n
                if run_lease is not None:  # one record for the run (gens consecutive, in order)
                    prov._queue_run(_PendingRun(idx, rows, run_lease))
                else:
                    with prov._room:
                        prov._queued_pages += self.n
                    pend = [_Pending(idx, row, lease) for row, lease in zip(rows.tolist(), leases, strict=True)]
                    prov._pend.update((p.gen, p) for p in pend)
                    put = prov._queue.put  # (unbounded: never blocks)
                    for p in pend:
                        put(("page", p))
        if failed is not None:
            self._undo_fast(leases)
            raise failed
        prov._tally("seals", self.n)
        prov._tally("bytes_written", self.n * self.nbytes)  # (copied in by a DMA or put_many)

    def _undo_fast(self, leases: list[Lease]) -> None:
        """The run failed after the fast tier sealed it: the ``leases`` taken for its write-back
        go, the tiered index's run goes (a no-op once ``commit_run`` cancelled it itself) and the
        copies in the fast tier are nobody's."""
        for lease in leases:
            with contextlib.suppress(HostKVError):
                lease.release()
        prov = self._prov
        with prov._lock:  # (evicted under it: a save of the same keys cannot slip in between)
            prov._index.cancel_run(self._run)
            self.state = "aborted"
            with contextlib.suppress(HostKVError):
                prov.fast.evict(self.keys)

    def abort(self) -> None:
        if self._cancel():
            self._frc.abort()


class _HeapRun(TreeChainRun):
    """A chain run reserved in one go in the tiered index whose pages wait in one ordinary host
    buffer: the fast tier could not take the run when it was reserved (full of pages waiting for
    their write-back; a slow tier that batches).  ``pages`` is the buffer as one
    :class:`HostPages`, so a copy engine fills it as it fills a fast-tier run.

    The seal publishes the run as a fast-tier run's seal does and queues it for the writer, the
    buffer as the pages' only copy until their write-back lands (reads are served from it; an
    eviction lets the writer skip the page).  The saving thread never stores into the slow tier
    itself: a save over a full fast tier overlaps its copies with the write-back, as a save into
    a fast tier with room does, instead of waiting for each of its runs to be written through
    (issue 14 item 7: 2,000 x 4 KiB pages over a 2 MiB fast tier took 1.3-1.6x the time of a
    fast tier that holds them).  Memory: the buffers of sealed heap runs are bounded by the fast
    tier's budget (and the queue's bound in pages); a seal past it waits for the writer."""

    __slots__ = ("heap", "pages")

    def __init__(self, prov: _Chains, run: object, keys: list[Key], parent: Key | None, nbytes: int,
                 salt_tag: str) -> None:
        super().__init__(prov, run, keys, parent, nbytes, salt_tag)
        self.heap = np.empty((len(keys), nbytes), dtype=np.uint8)
        addrs = np.uint64(self.heap.ctypes.data) + np.arange(len(keys), dtype=np.uint64) * np.uint64(nbytes)
        self.pages = HostPages(addrs, nbytes, pinned=False, readonly=False, keepalive=self.heap)

    def materialize(self) -> list[Reservation]:
        """Per-page reservations over the run's buffer (:class:`_HeapPage`: a copy into
        ``pages`` made after this still counts) that keep the run's flights in the index (a run
        reserved on top of this one still chains onto them), stored at seal by the
        write-through path."""
        state = self._split()
        return self._per_page(
            state, lambda k, p, row: _HeapPage(self._prov, k, p, self.nbytes, self.salt_tag, row), self.heap)

    def seal(self, checksums: Sequence[int] | None, algorithm: str | None) -> None:
        prov: _Chains = self._prov
        self._check_sealable()
        # Where the fast tier verifies reads, the buffer's pages get checksums in its algorithm,
        # as its own pages do at their seal: the ones given (the GPU's, for a cache's save),
        # else computed here.  Reads from the buffer and the write-back check them, so a byte
        # damaged in the buffer is a miss and never reaches the slow tier.
        sums = None
        if prov._fast_verifies:
            if checksums is not None and algorithm == prov.fast.checksum_algorithm:
                sums = np.array(checksums, dtype=np.uint64)
            else:
                sums = prov.fast._digests([row.data for row in self.heap])  # type: ignore[attr-defined]
        need = self.heap.nbytes
        counted = [False]
        queued = False
        failed: BaseException | None = None
        idx = prov._index
        try:
            prov._wait_for_heap_room(need, counted)
            with prov._lock:
                if prov._closed:
                    failed = ClosedError("the tiered provider closed during the seal")
                else:
                    try:
                        rows = idx.commit_run(self._run, nbytes=self.nbytes, tag=self.salt_tag)
                    except UnknownKeyError as exc:  # its parent was dropped meanwhile
                        failed = exc
                if failed is not None:
                    idx.cancel_run(self._run)  # (a no-op once commit_run cancelled it itself)
                    self.state = "aborted"
                else:  # (queued under the lock, as a fast-tier run: a flush sees it)
                    self.state = "sealed"
                    self.sealed = self.n
                    prov._queue_run(_PendingRun(idx, rows, None, keys=self.keys, heap=self.heap, sums=sums))
                    queued = True
        finally:
            if counted[0] and not queued:
                with prov._room:
                    prov._heap_bytes -= need
                    prov._room.notify_all()
        if failed is not None:
            raise failed
        prov._tally("seals", self.n)
        prov._tally("bytes_written", self.n * self.nbytes)  # (copied in by a DMA or put_many)

    def abort(self) -> None:
        self._cancel()


class _HeapPage(_DeferredReservation):
    """One page of a :class:`_HeapRun` split into reservations (``materialize``): its bytes are
    the run's buffer row (no copy), its flight stays in the tiered index (so ``_store_through``
    commits it rather than begins one, and an abort cancels it).  Not in ``_DEFERRED``: a later
    ``reserve_many`` chains onto it through the index, as onto any page in flight."""

    __slots__ = ("_row",)

    def __init__(self, provider: _Chains, key: Key, parent: Key | None, nbytes: int, salt_tag: str,
                 row: np.ndarray[Any, np.dtype[np.uint8]]) -> None:
        Reservation.__init__(self, provider, key, parent, nbytes, salt_tag)
        self._row = row
        self._view = row.data

    def regions(self) -> Sequence[HostRegion]:
        self.check_open(self._provider)
        return [HostRegion(0, self._view, int(self._row.ctypes.data), False)]

    def abort(self) -> None:
        prov: _Chains = self._provider  # type: ignore[assignment]
        with prov._lock:
            if self._state != "open":
                return
            prov._index.cancel(self.key)
            self._finish("aborted")
