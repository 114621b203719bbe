"""The tiered provider's write-back: sealed fast-tier pages are queued in seal order (so parent
before child) and a background thread stores them in the slow tier, a batch per ``put_many``;
evictions racing a write-back are undone afterwards (the doomed keys); ``flush()``."""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from hostkv_providers._capabilities import SupportsBatch
from hostkv_providers._checks import check_timeout
from hostkv_providers._errors import (
    CapacityError,
    HostKVError,
    InFlightError,
    UnknownKeyError,
)
from hostkv_providers._keys import Key
from hostkv_providers._reservation import Lease

from ._base import _log, _release_part, _run_views, _split_lease
from ._counters import _PUBLISH_EVERY, _Figures
from ._entries import _left_fast_tier, _Pending, _PendingRun, _TieredReservation

_WRITE_BACK_BATCH = 256  # queued pages the writer stores with one put_many of the slow tier


class _WriteBack(_Figures):
    """The write-back queue and thread (a part of :class:`TieredProvider`)."""

    def _commit_sealed(self, res: _TieredReservation, through: bool, fast_lease: Lease | None = None) -> None:
        """Publish a reservation whose inner one is sealed: the tiered row, and (fast tier) the
        lease that pins the only copy until the write-back has run (a ``_Pending``): the one
        the fast tier's seal took (``fast_lease``, see ``PinnedProvider._seal_held``), else one
        taken now — after the seal, so the page may have been evicted in between."""
        inner = res.inner
        if not through and fast_lease is None:
            fast_lease = self.fast.lease([res.key])
        with self._lock:
            if self._closed:
                if fast_lease is not None:
                    fast_lease.release()
                res._finish("aborted")
                return
            if fast_lease is not None and not fast_lease.present[0]:
                fast_lease.release()
                self._index.cancel(res.key)
                res._finish("aborted")
                raise _left_fast_tier(res.key)
            try:
                row = self._index.commit(res.key, nbytes=res.nbytes, tag=res.salt_tag)
            except UnknownKeyError:
                res._finish("aborted")
                if fast_lease is not None:
                    fast_lease.release()
                with contextlib.suppress(HostKVError):
                    inner.provider.evict([res.key])
                raise
            res._finish("sealed")
            if not through:
                pend = _Pending(self._index, row, fast_lease)
                self._pend[pend.gen] = pend
                with self._room:
                    self._queued_pages += 1
                self._queue.put(("page", pend))

    def _write_back_loop(self) -> None:
        ahead: list[tuple[Any, ...] | None] = []  # taken off the queue while collecting pages
        while True:
            if time.monotonic() >= self._publish_at:
                self._publish_logged()
            if ahead:
                item = ahead.pop()
            else:
                try:
                    item = self._queue.get(timeout=_PUBLISH_EVERY)
                except queue.Empty:
                    continue
            items: list[tuple[Any, ...] | None] = [item]
            try:
                if item is None:
                    return
                kind = item[0]
                if kind == "page":
                    self._wb_since = item[1].created
                    # The pages queued behind this one go out with it, in queue (= seal) order:
                    # one put_many of the slow tier instead of a reserve/write/seal each.
                    pages: list[_Pending] = [item[1]]
                    while len(pages) < _WRITE_BACK_BATCH:
                        try:
                            nxt = self._queue.get_nowait()
                        except queue.Empty:
                            break
                        items.append(nxt)
                        if nxt is None or nxt[0] != "page":
                            items.pop()
                            ahead.append(nxt)  # an anchor or the stop: after this batch
                            break
                        pages.append(nxt[1])
                    self._write_pages(pages)
                elif kind == "run":
                    self._write_back_run(item[1])
                elif kind == "anchor":
                    try:
                        self._write_anchor(item[1], item[2], item[3], item[4])
                    except BaseException as exc:  # keep the writer alive
                        self._writer_error = exc
                        _log.error("tiered write-back of an anchor failed: %r", exc)
            finally:
                npages = sum(1 for it in items if it is not None and it[0] == "page")
                if npages:
                    self._batch_done(npages)
                for _ in items:
                    self._queue.task_done()

    def _batch_done(self, npages: int) -> None:
        """``npages`` queued pages are written back (or dropped): doomed keys purged, room made
        for waiting saves."""
        self._wb_since = 0.0
        self._purge_doomed_logged()
        with self._room:
            self._queued_pages -= npages
            self._wb_rounds += 1
            self._room.notify_all()

    def _write_pages(self, pages: list[_Pending]) -> None:
        if len(pages) == 1 or not isinstance(self.slow, SupportsBatch):
            for node in pages:
                self._write_back_one(node)
        elif pages:
            self._write_back_many(pages)

    def _write_back_run(self, run: _PendingRun) -> None:
        """A chain run queued as one record, written back in batches of ``_WRITE_BACK_BATCH``
        pages in order (parent before child), each with one ``put_many`` of the slow tier and
        its bookkeeping in arrays (:meth:`_write_run_batch`): no per-page record, lease or lock
        round.  A batch the fast tier cannot view as the run's pages goes page by page."""
        idx = self._index
        lo = 0
        try:
            while lo < run.n:
                hi = min(lo + _WRITE_BACK_BATCH, run.n)
                self._wb_since = run.created
                nodes: list[_Pending] = []
                try:
                    if not self._write_run_batch(run, lo, hi):
                        nodes = self._take_pages(run, lo, hi)
                        self._write_pages(nodes)
                except BaseException as exc:  # keep the writer alive; the pages not written are dropped
                    hi = run.n  # (counted as done below, whatever happens next)
                    for node in nodes:
                        if node.gen in self._pend:
                            with contextlib.suppress(HostKVError):
                                self._writer_failed(node, exc)
                    self._writer_error = exc
                    _log.error("tiered write-back of a chain run failed: %r", exc)
                    with self._lock, contextlib.suppress(HostKVError):  # (their only copy is not kept)
                        # (the batch's state is unknown and the rest of the run is its subtree:
                        # dropping the first page still waiting drops the others with it)
                        run.writing[:] = False
                        for p in np.flatnonzero(run.waiting).tolist():
                            if idx.is_live(int(run.rows[p]), run.gen0 + p):
                                self._drop_from_tiers(idx.drop(int(run.rows[p])))
                finally:
                    self._batch_done(hi - lo)
                lo = hi
        finally:
            with self._lock:
                self._finish_run(run)

    def _write_run_batch(self, run: _PendingRun, lo: int, hi: int) -> bool:
        """Write back the waiting pages of ``run[lo:hi]`` with the per-page rules of
        :meth:`_write_back_many`, in arrays: a page dropped before its turn was let go already
        (``_drop_from_tiers``); one dropped while the batch is stored (``cancelled``) is evicted
        from the fast tier afterwards and made doomed if it landed; a stale copy of an earlier,
        evicted entry is replaced; a page that failed is dropped with its subtree.  ``False``
        (nothing done) when the slow tier has no ``put_many``.  A page the fast tier dropped
        meanwhile (its bytes failed ``verify``: the only copy is bad) fails with its subtree,
        the rest of the run from there (a run is a chain)."""
        idx, keys = self._index, run.keys
        if not isinstance(self.slow, SupportsBatch):
            return False
        with self._lock:
            sel = np.flatnonzero(run.waiting[lo:hi]) + lo
            if not len(sel):
                return True
            views, sums = _run_views(run, sel)
            if None in views:
                bad = views.index(None)
                row, gen = int(run.rows[sel[bad]]), run.gen0 + int(sel[bad])
                _log.warning("tiered write-back of %s failed: it left the fast tier", keys[sel[bad]].hex()[:16])
                self._counters["write_back_failures"] += 1
                if idx.is_live(row, gen):
                    self._drop_from_tiers(idx.drop(row))  # (lets go of the pages after it too)
                sel, views = sel[:bad], views[:bad]
                if not len(sel):
                    return True
            run.writing[sel] = True
            ks = [keys[p] for p in sel.tolist()]
            stale = [k for k in ks if k in self._doomed] if self._doomed else []
            self._doomed.difference_update(stale)
        parents = [keys[p - 1] if p else run.parent for p in sel.tolist()]
        got: list[bool | HostKVError]
        try:
            # A fast tier that verifies reads has its copies checked before they are stored again:
            # bytes damaged since their seal (in RAM, or by the copy from the GPU, whose checksum
            # was taken in HBM) would otherwise land in the slow tier under a checksum of their
            # own, and a read would fall back to them once the fast copy failed.  The first bad
            # page fails (dropped with its subtree below: the rest of the batch, a chain).
            # (a heap run's sums are in the fast tier's algorithm, and kept only where it verifies)
            checker = self.fast if run.lease is None else run.lease.provider
            n_ok = len(ks) if sums is None else checker._first_bad(views, sums)  # type: ignore[attr-defined]
            if stale:
                with contextlib.suppress(HostKVError):
                    self.slow.evict(stale)
            items = list(zip(ks[:n_ok], parents[:n_ok], views[:n_ok], strict=True))
            got = self.slow.put_many(items, salt_tag=run.tag) if n_ok else []
            if n_ok < len(ks):
                self._tally("checksum_failures")
                corrupt = HostKVError(f"{ks[n_ok].hex()[:16]} failed its checksum in the fast tier before its "
                                      "write-back")
                got = [*got, *[corrupt] * (len(ks) - n_ok)]
        except BaseException as exc:  # the whole call failed: every page of it failed
            _log.warning("tiered write-back of %d pages failed: %s", len(ks), exc)
            got = [exc if isinstance(exc, HostKVError) else HostKVError(str(exc))] * len(ks)
        del views
        with self._lock:
            cancelled = run.cancelled[sel]
            run.writing[sel] = False
            run.waiting[sel] = False
            _release_part(run, sel)
            ok = np.array([g is True or g is False for g in got], dtype=bool)  # False: already there
            good = ok & ~cancelled
            # (a heap run's pages bypassed the fast tier: written through, counted once landed)
            self._counters["write_through" if run.heap is not None else "write_backs"] += int(good.sum())
            if cancelled.any():  # dropped while being stored: out of both tiers again
                with contextlib.suppress(HostKVError):
                    self.fast.evict([k for k, c in zip(ks, cancelled.tolist(), strict=True) if c])
                self._doomed.update(k for k, c in zip(ks, (cancelled & ok).tolist(), strict=True) if c)
            for i in np.flatnonzero(~ok & ~cancelled).tolist():
                _log.warning("tiered write-back of %s failed: %s", ks[i].hex()[:16], got[i])
                self._counters["write_back_failures"] += 1
                row, gen = int(run.rows[sel[i]]), run.gen0 + int(sel[i])
                if idx.is_live(row, gen):  # (an earlier failure of this batch may have dropped it)
                    self._drop_from_tiers(idx.drop(row))
            if self._slow_tree and good.any():
                self._advance_tail("write", self.slow, ks[int(np.flatnonzero(good)[-1])])
            # (as _write_back_many: copies left in the fast tier by a subtree dropped above)
            contains, flights = idx.contains_fn, idx.flights
            gone = [k for k in ks if not contains(k) and k not in flights]
            if gone:
                with contextlib.suppress(HostKVError):
                    self.fast.evict(gone)
        return True

    def _take_pages(self, run: _PendingRun, lo: int, hi: int) -> list[_Pending]:
        """The waiting pages of ``run[lo:hi]`` taken out of the run as queued pages, each with a
        fast-tier lease of its own (the hold moves over, ``PinnedProvider._split_lease``)."""
        idx = self._index
        nodes: list[_Pending] = []
        with self._lock:
            sel = np.flatnonzero(run.waiting[lo:hi]) + lo
            if not len(sel):
                return nodes
            leases = _split_lease(run, sel)
            for p, lease in zip(sel.tolist(), leases, strict=True):
                row = int(run.rows[p])
                if idx.is_live(row, run.gen0 + p):
                    node = _Pending(idx, row, lease)
                    self._pend[node.gen] = node
                    nodes.append(node)
                else:
                    lease.release()
                run.waiting[p] = False  # (now in _pend, or let go)
        return nodes

    def _write_back_one(self, node: _Pending) -> None:
        try:
            self._write_back(node)
        except BaseException as exc:  # keep the writer alive; the entry is dropped
            self._writer_failed(node, exc)

    def _writer_failed(self, node: _Pending, exc: BaseException) -> None:
        self._writer_error = exc
        _log.error("tiered write-back failed: %r", exc)
        with self._lock:
            if self._index.is_live(node.row, node.gen):
                self._drop_from_tiers(self._index.drop(node.row))
            self._finish_pending(node)

    def _write_back_many(self, nodes: Sequence[_Pending]) -> None:
        """:meth:`_write_back` for a run of queued pages with one ``put_many`` of the slow tier.

        The per-page rules hold: a page evicted before its turn is skipped; one evicted while
        the batch is being stored is made doomed afterwards (evicted from the slow tier again,
        as a per-page write-back evicted between its last check and its seal is); a stale copy
        of an earlier, evicted entry is replaced.  Pages that are not one contiguous region of
        the fast tier go page by page."""
        idx = self._index
        todo: list[tuple[_Pending, Lease]] = []
        stale: list[Key] = []
        single: list[_Pending] = []
        with self._lock:
            for node in nodes:
                if node.cancelled or not idx.is_live(node.row, node.gen):
                    self._finish_pending(node)
                    continue
                lease = node.fast_lease
                if lease is None or lease.released or not self._fast_views:
                    single.append(node)
                    continue
                node.writing = True
                if node.key in self._doomed:
                    self._doomed.discard(node.key)
                    stale.append(node.key)
                todo.append((node, lease))
        items: list[tuple[bytes, bytes | None, object]] = []
        took: list[_Pending] = []
        try:
            if stale:
                with contextlib.suppress(HostKVError):
                    self.slow.evict(stale)
            for node, lease in todo:
                data: object | None
                if self._fast_verifies:
                    # its verified copy: one that fails its checksum is a miss there (and dropped
                    # by the fast tier); it and the pages after it go page by page below, where it
                    # fails its write-back and goes with its subtree
                    data = self.fast.read_bytes(node.key)
                    if data is None:
                        break
                else:
                    regions = self._view_fast(lease, node.key)
                    if regions is None:
                        raise UnknownKeyError(f"{node.key.hex()[:16]} vanished from the fast tier")
                    data = regions[0].view if len(regions) == 1 else b"".join(bytes(r.view) for r in regions)
                items.append((node.key, node.parent, data))
                took.append(node)
            slow = self.slow
            assert isinstance(slow, SupportsBatch)
            if took and len({n.tag for n in took}) == 1:
                got: list[bool | HostKVError] = slow.put_many(items, salt_tag=took[0].tag)
            else:  # several salt tags in one batch (rare): one call per page
                got = [self.slow.put(k, p, d, salt_tag=n.tag) for (k, p, d), n in zip(items, took, strict=True)]
        except BaseException as exc:
            # the whole call failed: every page of it is treated as a failed write-back
            _log.warning("tiered write-back of %d pages failed: %s", len(todo), exc)
            got = [exc if isinstance(exc, HostKVError) else HostKVError(str(exc))] * len(took)
        if len(took) < len(todo):
            took_set = {id(n) for n in took}
            with self._lock:  # pages not reached (a failure, a copy that failed its check): page by page
                for node, _ in todo:
                    if id(node) not in took_set:
                        node.writing = False
                        single.append(node)
        with self._lock:
            for node, r in zip(took, got, strict=True):
                ok = r is True or r is False  # False: already there (a cancelled write-back left it)
                if not ok:
                    _log.warning("tiered write-back of %s failed: %s", node.key.hex()[:16], r)
                self._written_back(node, ok)
            # A failed page drops its subtree at once, while the rest of the batch still held
            # their fast-tier leases: the per-page evictions of _written_back skipped the pages
            # above a leased one, leaving copies in the fast tier that no index row names.  Now
            # that every lease of the batch is released, evict those (unless saved again: then
            # the key is in the index or in flight, and its copy is the new entry's).
            contains, flights = idx.contains_fn, idx.flights
            gone = [n.key for n in took if not contains(n.key) and n.key not in flights]
            if gone:
                with contextlib.suppress(HostKVError):
                    self.fast.evict(gone)
        for node in single:
            self._write_back_one(node)

    def _written_back(self, node: _Pending, ok: bool) -> None:
        """The end of a page's write-back (lock held): publish it as in the slow tier, or undo."""
        idx = self._index
        node.writing = False
        live = idx.is_live(node.row, node.gen)
        if node.cancelled or not live:
            # Evicted while it was being written: take it out of both tiers again.  Its
            # parent may have been doomed too (the slow tier skipped it while this page was
            # in flight under it); _write_back_loop purges both now that the flight is over.
            self._finish_pending(node)
            with contextlib.suppress(HostKVError):
                self.fast.evict([node.key])
            if ok:
                self._doomed.add(node.key)
        elif ok:
            self._counters["write_backs"] += 1
            if self._slow_tree:
                self._advance_tail("write", self.slow, node.key)
        else:
            self._counters["write_back_failures"] += 1
            self._drop_from_tiers(idx.drop(node.row))
        self._finish_pending(node)

    def _write_back(self, node: _Pending) -> None:
        idx = self._index
        with self._lock:
            if node.cancelled or not idx.is_live(node.row, node.gen):
                self._finish_pending(node)
                return
            # While this is set, an eviction only marks the entry cancelled: the fast-tier lease
            # (and so the memory being copied from) stays ours until the copy is over.
            node.writing = True
            lease = node.fast_lease
            if lease is not None and lease.released:  # never view() through a released lease
                lease = None
            # The key was evicted before and saved again; a stale copy of the evicted entry (with
            # its anchors) may still be in the slow tier: replace it rather than adopt it.
            stale = node.key in self._doomed
            self._doomed.discard(node.key)
        if stale:
            with contextlib.suppress(HostKVError):
                self.slow.evict([node.key])
        ok = False
        try:
            res = self.slow.reserve(node.key, node.parent, node.nbytes, salt_tag=node.tag)
            if res is None:
                ok = True  # already there (an earlier, cancelled write-back left it): same key, same bytes
            else:
                try:
                    # (a fast tier that verifies reads: its verified copy, not an unchecked view;
                    # a page damaged since its seal is a miss there and fails here)
                    regions = (self._view_fast(lease, node.key)
                               if lease is not None and not self._fast_verifies else None)
                    if regions is None:
                        data = self.fast.read_bytes(node.key)
                        if data is None:
                            raise UnknownKeyError(f"{node.key.hex()[:16]} vanished from the fast tier")
                        res.write(0, data)
                    else:
                        for r in regions:
                            res.write(r.offset, r.view)
                    with self._lock:
                        lost = node.cancelled or not idx.is_live(node.row, node.gen)
                    if lost:  # evicted while being copied: do not make it durable at all
                        res.abort()
                    else:
                        # An eviction may still come between this check and the seal: the
                        # re-check below then evicts it from the slow tier again.
                        res.seal()
                        ok = True
                except BaseException:
                    if res.state == "open":
                        res.abort()
                    raise
        except (CapacityError, UnknownKeyError, InFlightError, HostKVError) as exc:
            _log.warning("tiered write-back of %s failed: %s", node.key.hex()[:16], exc)
        with self._lock:
            self._written_back(node, ok)

    def _purge_doomed(self) -> None:
        """Evict from the slow tier the doomed keys the index has not taken back (lock held).

        A doomed key saved again (in the index, or in flight) is left alone here: its own
        write-back replaces the stale copy (``_write_back``), a write-through evicts it first
        (``_reserve_inner``).  A key stays doomed while the slow tier still holds it (evicting it
        was skipped again: a child still in flight there), and is retried after the next write-back."""
        if not self._doomed:
            return
        contains, flights = self._index.contains_fn, self._index.flights
        gone = [k for k in self._doomed if not contains(k) and k not in flights]
        if not gone:
            return
        self.slow.evict(gone)  # subtrees, deepest first: a doomed child goes before its parent
        for k, there in zip(gone, self.slow.present(gone), strict=True):
            if not there:
                self._doomed.discard(k)

    def _purge_doomed_logged(self) -> None:
        try:
            with self._lock:
                self._purge_doomed()
        except HostKVError as exc:  # the writer must live on; close() retries
            _log.warning("tiered: evicting stale pages from the slow tier failed: %s", exc)

    def _write_anchor(self, row: int, gen: int, name: str, blob: bytes) -> None:
        idx = self._index
        try:
            with self._lock:
                if not idx.is_live(row, gen) or self._pending(gen):
                    return  # evicted (or its page's write-back failed and dropped it)
                key = idx.key_of(row)
            self.slow.put_anchor(key, name, blob)
        finally:
            with self._lock:
                table = self._unsynced.get(gen)
                if table is not None and table.get(name) is blob:
                    del table[name]
                    if not table:
                        del self._unsynced[gen]

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write-back has reached the slow tier; ``False`` on timeout.

        ``timeout`` is seconds ``>= 0`` or ``None`` (no limit).  Raises ``ClosedError`` after
        ``close`` (nothing is queued then, but a ``True`` would claim a write-back happened).
        Then publishes this instance's figures to the store-wide counters."""
        deadline = None if timeout is None else time.monotonic() + check_timeout(timeout)
        self._check_usable()
        done = self._flush(deadline)
        self._publish_logged()
        return done

    def _flush(self, deadline: float | None) -> bool:
        if self._writer is threading.current_thread():
            return False
        with self._queue.all_tasks_done:
            while self._queue.unfinished_tasks:
                if not self._writer.is_alive():
                    return False  # cannot happen short of interpreter shutdown; never hang on it
                wait = 0.1 if deadline is None else min(0.1, deadline - time.monotonic())
                if wait <= 0:
                    return False
                self._queue.all_tasks_done.wait(wait)
        return True
