"""The attributes every part of the tiered provider shares, and the helpers they all call:
applying the index's removals to both tiers, which entries wait for their write-back, tail
leases, fast-tier views."""

from __future__ import annotations

import bisect
import collections
import contextlib
import logging
import queue
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from hostkv_providers._errors import HostKVError
from hostkv_providers._keys import Key
from hostkv_providers._provider import Provider
from hostkv_providers._region import HostRegion
from hostkv_providers._reservation import Lease
from hostkv_providers.providers._tree import TreeIndex

from ._entries import _Pending, _PendingRun

# One logger for all the parts (the write-back thread logs; warnings could be turned into errors).
_log = logging.getLogger("hostkv_providers.providers.tiered")


class _TieredBase(Provider):
    """Attributes of a tiered store (set by :class:`TieredProvider.__init__`) and the helpers
    every part calls.

    The provider is one object split by role into layers (each a file of this folder, each a base
    of the next): :class:`._counters._Figures` (stats, store-wide counters) →
    :class:`._writeback._WriteBack` (the write-back thread) → :class:`._chain._Chains` (chain
    reservation, back-pressure) → :class:`._provider.TieredProvider` (construction and the verbs).
    """

    fast: Provider
    slow: Provider
    _retain_share: float
    _budget: int
    _promote: bool
    _own: bool
    _lock: threading.RLock
    _index: TreeIndex
    # write-backs queued or running, by the entry's gen (rows are recycled, gens are not)
    _pend: dict[int, _Pending]
    # chain runs whose write-back is queued, by their first gen (and those gens in order: a
    # run's gens are consecutive, so a gen's run is found by bisection)
    _pend_runs: dict[int, _PendingRun]
    _run_starts: list[int]
    _unsynced: dict[int, dict[str, bytes]]  # gen -> anchors queued for the slow tier
    _queue: queue.Queue[tuple[Any, ...] | None]
    _room: threading.Condition  # guards _queued_pages; notified when write-backs finish
    _queued_pages: int
    _wb_rounds: int  # write-back rounds finished (guarded by _room): a waiter's wake-up test
    _queue_pages: int
    _writer_error: BaseException | None
    _writer: threading.Thread
    _doomed: set[Key]  # see TieredProvider.__init__
    _tails: dict[str, tuple[Key, Lease]]
    _slow_tree: bool
    _slow_retain: bool
    _fast_views: bool
    _fast_verifies: bool
    _fast_batch_views: bool
    _fast_page_views: bool
    _fast_batch: bool
    _counters: dict[str, int]
    _published: dict[str, int]
    _publish_lock: threading.Lock
    _publish_at: float
    _wb_since: float
    # bytes of heap runs (sealed pages waiting for their write-back in ordinary memory: the fast
    # tier was full) and their bound; guarded by _room
    _heap_bytes: int
    _heap_limit: int
    _heap_waiting: collections.deque[object]

    def _recycle(self, rows: Sequence[int]) -> None:
        for r in rows:
            self._index.anchors.pop(r, None)
        self._index.recycle(rows)

    def _drop_from_tiers(self, rows: Sequence[int]) -> None:
        """Apply the index's removals to the tiers and recycle the rows (called with the lock held)."""
        if not rows:
            return
        idx = self._index
        keys = [idx.key_of(r) for r in rows]
        gens = [int(g) for g in idx.gen[list(rows)].tolist()]
        self._recycle(rows)
        gone = set(keys)
        for which, (k, lease) in list(self._tails.items()):
            if k in gone:  # a tail lease must not keep an evicted page alive in a tier
                del self._tails[which]
                with contextlib.suppress(HostKVError):
                    lease.release()
        slow_keys = []
        let_go: dict[int, list[int]] = {}  # run -> its pages dropped before the writer took them
        for k, g in zip(keys, gens, strict=True):
            self._unsynced.pop(g, None)
            pend = self._pend.get(g)
            if pend is not None:
                pend.cancelled = True  # the writer skips it (or undoes it if it is mid-write)
                if pend.fast_lease is not None and not pend.writing:
                    pend.fast_lease.release()
                    pend.fast_lease = None
                continue
            at = self._run_at(g)
            if at is None or not at[0].waiting[at[1]]:
                slow_keys.append(k)
            elif at[0].writing[at[1]]:
                at[0].cancelled[at[1]] = True  # being stored: the writer undoes it afterwards
            else:
                at[0].waiting[at[1]] = False  # the writer skips it; its fast copy is let go below
                let_go.setdefault(at[0].gen0, []).append(at[1])
        for gen0, positions in let_go.items():
            run = self._pend_runs[gen0]
            _release_part(run, np.array(positions, dtype=np.int64))
        with contextlib.suppress(HostKVError):
            self.fast.evict(keys)
        if slow_keys:
            report = self.slow.evict(slow_keys)
            if report.skipped or report.entries < len(slow_keys):
                # The slow tier kept some (a parent of a page the writer has in flight there):
                # doomed, evicted again once that write-back is over (else a reopen revives them).
                still = self.slow.present(slow_keys)
                self._doomed.update(k for k, there in zip(slow_keys, still, strict=True) if there)

    def _advance_tail(self, which: str, tier: Provider, key: Key) -> None:
        try:
            lease = tier.lease([key])
        except HostKVError:
            return
        with self._lock:
            prior = self._tails.get(which)
            old = prior[1] if prior is not None else None
            if self._closed:
                old = lease
            else:
                self._tails[which] = (key, lease)
        if old is not None:
            with contextlib.suppress(HostKVError):
                old.release()

    def _view_fast(self, lease: Lease, key: Key) -> Sequence[HostRegion] | None:
        if not self._fast_views:
            return None
        regions: Sequence[HostRegion] | None = self.fast.view(lease, key)  # type: ignore[attr-defined]
        return regions

    def _run_at(self, gen: int) -> tuple[_PendingRun, int] | None:
        """The queued chain run holding entry ``gen``, and its position there (lock held)."""
        starts = self._run_starts
        j = bisect.bisect_right(starts, gen) - 1 if starts else -1
        if j < 0:
            return None
        run = self._pend_runs[starts[j]]
        i = gen - run.gen0
        return (run, i) if i < run.n else None

    def _pending(self, gen: int) -> bool:
        """Whether entry ``gen`` waits for its write-back or is being written back (lock held):
        its only copy is in the fast tier."""
        if gen in self._pend:
            return True
        at = self._run_at(gen)
        return at is not None and bool(at[0].waiting[at[1]])

    def _finish_run(self, run: _PendingRun) -> None:
        """The writer is past every page of ``run``, or the store closes (lock held): the run's
        lease goes with whatever pages it still holds (a heap run's buffer goes, and its bytes
        leave the overflow's count: a save waiting for room there goes on)."""
        if self._pend_runs.pop(run.gen0, None) is not None:
            self._run_starts.remove(run.gen0)
        run.waiting[:] = False
        if run.lease is not None:
            with contextlib.suppress(HostKVError):
                run.lease.release()
        if run.heap is not None:
            with self._room:
                self._heap_bytes -= run.heap.nbytes
                self._room.notify_all()
            run.heap = None  # (a reader that took a view of a page before keeps it alive)

    def _heap_page(self, gen: int) -> tuple[memoryview, Any] | None:
        """A read-only view of entry ``gen``'s bytes when its only copy is a heap run's page
        (``_HeapRun``: waiting for its write-back in ordinary memory), with its seal checksum
        in the fast tier's algorithm (``None``: none was given); ``None`` otherwise (lock
        held).  The view stays valid after the write-back: it keeps the buffer alive."""
        at = self._run_at(gen)
        if at is None:
            return None
        run, i = at
        if run.heap is None or not run.waiting[i]:
            return None
        return memoryview(run.heap[i]).toreadonly(), None if run.sums is None else run.sums[i:i + 1]

    def _finish_pending(self, node: _Pending) -> None:
        """The write-back is over (done, cancelled or failed): the entry is in the slow tier (or
        gone) and its fast-tier copy need not stay pinned (lock held)."""
        if node.fast_lease is not None:
            node.fast_lease.release()
            node.fast_lease = None
        self._pend.pop(node.gen, None)


def _release_part(run: _PendingRun, positions: Any) -> None:
    """Let the fast tier free the pages at ``positions`` of ``run`` (``PinnedProvider._release_part``:
    only a pinned fast tier makes runs); a heap run's buffer goes whole, with the run."""
    if run.lease is None:
        return
    with contextlib.suppress(HostKVError):
        run.lease.provider._release_part(run.lease, positions)  # type: ignore[attr-defined]


def _split_lease(run: _PendingRun, positions: Any) -> list[Lease]:
    """The pages at ``positions`` of ``run``, each under a lease of its own, taken over from the
    run's lease with no moment unheld (``PinnedProvider._split_lease``; a run in the fast tier:
    heap runs are made only over a slow tier that batches, and never go page by page)."""
    assert run.lease is not None
    leases: list[Lease] = run.lease.provider._split_lease(run.lease, positions)  # type: ignore[attr-defined]
    return leases


def _run_views(run: _PendingRun, positions: Any) -> tuple[list[memoryview | None], Any]:
    """Read-only views of the pages at ``positions`` of ``run`` in the fast tier, ``None`` for
    one the fast tier dropped, and their seal checksums where the fast tier verifies reads
    (else ``None``; ``PinnedProvider._run_views_sums``).  A heap run's pages are views of its
    buffer, with the checksums its seal was given (if any)."""
    if run.heap is not None:
        sel = np.asarray(positions, dtype=np.int64)
        heap = run.heap
        return ([memoryview(heap[p]).toreadonly() for p in sel.tolist()],
                None if run.sums is None else run.sums[sel])
    assert run.lease is not None
    got: tuple[list[memoryview | None], Any] = run.lease.provider._run_views_sums(  # type: ignore[attr-defined]
        run.lease, positions)
    return got
