"""The attributes every part of the tiered provider shares, and the helpers they all call:
applying the index's removals to both tiers, tail leases, fast-tier views."""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Sequence
from typing import Any

from hostkv_providers._errors import HostKVError
from hostkv_providers._keys import Key
from hostkv_providers._provider import Provider
from hostkv_providers._region import HostRegion
from hostkv_providers._reservation import Lease
from hostkv_providers.providers._tree import TreeIndex

from ._entries import _Pending

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
    _fast_batch_views: bool
    _fast_batch: bool
    _counters: dict[str, int]
    _published: dict[str, int]
    _publish_lock: threading.Lock
    _publish_at: float
    _wb_since: float

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
        for k, g in zip(keys, gens, strict=True):
            self._unsynced.pop(g, None)
            pend = self._pend.get(g)
            if pend is not None:
                pend.cancelled = True  # the writer skips it (or undoes it if it is mid-write)
                if pend.fast_lease is not None and not pend.writing:
                    pend.fast_lease.release()
                    pend.fast_lease = None
            else:
                slow_keys.append(k)
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

    def _finish_pending(self, node: _Pending) -> None:
        """The write-back is over (done, cancelled or failed): the entry is in the slow tier (or
        gone) and its fast-tier copy need not stay pinned (lock held)."""
        if node.fast_lease is not None:
            node.fast_lease.release()
            node.fast_lease = None
        self._pend.pop(node.gen, None)
