"""The tree index's budget and removals: the exact satisfiability guard (``make_room``), LRU-leaf
eviction, holds, retained entries, explicit eviction of subtrees and drops."""

from __future__ import annotations

import heapq
import time
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from hostkv_providers._errors import CapacityError, RetainedError
from hostkv_providers.providers._tree._columns import _Columns
from hostkv_providers.providers._tree._rows import _ROW_BITS, _ROW_MASK


class _Removal(_Columns):
    """:class:`~hostkv_providers.providers.TreeIndex`'s budget, holds, retained entries and removals."""

    # -- budget ----------------------------------------------------------------------------------
    def make_room(self, cost: int, protect: int = -1) -> list[int]:
        """Evict LRU leaves until ``cost`` more fits, or raise ``CapacityError`` evicting nothing.
        ``protect`` (the parent of the entry being reserved) is never evicted."""
        if self.used_cost + cost <= self.budget:
            return []
        if cost > self.budget or self.used_cost - self.sealed_cost + cost > self.budget:
            raise CapacityError(
                f"{cost} bytes do not fit: budget {self.budget}, used {self.used_cost} of which "
                f"{self.used_cost - self.sealed_cost} by reservations in flight"
            )
        if protect >= 0:
            self._hold(protect)
        try:
            removed = self._evict_lru(self.used_cost + cost - self.budget)
            if self.used_cost + cost > self.budget:
                for row in reversed(removed):  # parents were removed after their children
                    self._reinsert(row)
                raise CapacityError(
                    f"{cost} bytes do not fit: budget {self.budget}, used {self.used_cost}, and only "
                    f"{int(self.cost[removed].sum()) if removed else 0} of it is evictable (the rest is leased, "
                    f"in flight or retained: {self.retained_cost} retained)"
                )
        finally:
            if protect >= 0:
                self._unhold(protect)
        self.evictions += len(removed)
        self.evicted_cost += int(self.cost[removed].sum()) if removed else 0
        return removed

    def _reinsert(self, row: int) -> None:
        """Undo ``_remove`` of a tentative eviction (never of a retained row)."""
        self._dict[self.key[row].tobytes()] = row
        self.alive[row] = True
        self.count += 1
        c = int(self.cost[row])
        self.used_cost += c
        self.sealed_cost += c
        p = int(self.parent[row])
        if p >= 0 and self.alive[p]:
            self.children[p] += 1
        heapq.heappush(self._heap, int(self.tick[row]) << _ROW_BITS | row)

    def _refill_heap(self) -> None:
        """Rebuild the LRU candidate heap from the columns: the K oldest evictable leaves."""
        n = self.n
        cand = np.flatnonzero(self.alive[:n] & (self.children[:n] == 0) & (self.hold[:n] == 0)
                              & ~self.retained[:n])
        if not len(cand):
            self._heap = []
            self._heap_bound = -1
            return
        k = min(len(cand), 4096)
        ticks = self.tick[cand]
        if k < len(cand):
            part = np.argpartition(ticks, k - 1)[:k]
            cand, ticks = cand[part], ticks[part]
            self._heap_bound = int(ticks.max())
        else:
            self._heap_bound = 1 << 62
        self._heap = ((ticks << _ROW_BITS) | cand).tolist()
        heapq.heapify(self._heap)

    def pop_lru_leaf(self) -> int:
        """The least-recently-used evictable leaf (not removed), or -1."""
        for _ in range(2):
            while self._heap:
                item = self._heap[0]
                tick, row = item >> _ROW_BITS, item & _ROW_MASK
                if not self.m_alive[row] or self.m_tick[row] != tick or not self._evictable(row):
                    heapq.heappop(self._heap)
                    continue
                if tick > self._heap_bound:
                    break  # an evictable leaf older than this may be missing from the heap
                return row
            self._refill_heap()
        return -1

    def _evict_lru(self, need: int) -> list[int]:
        """Remove LRU evictable leaves until ``need`` cost is freed; the rows, in removal order.

        A leaf's parent that it alone keeps from being a leaf, and that is no younger, is the next
        least-recently-used leaf once the leaf is gone (every other evictable leaf is younger than
        the leaf just taken): such runs up a chain — the tail of a saved prompt, root-first ticks —
        are taken in one walk and removed together (:meth:`_remove_chain`), without the heap round
        trip and bookkeeping of each page (a full store evicts on every save: issue 14, the save
        thread's GIL share)."""
        out: list[int] = []
        freed = 0
        parent, children, hold, retained, tick, cost, alive = (
            self.m_parent, self.m_children, self.m_hold, self.m_retained, self.m_tick, self.m_cost, self.m_alive)
        while freed < need:
            row = self.pop_lru_leaf()
            if row < 0:
                break
            freed += cost[row]
            chain = [row]
            t = tick[row]
            p = parent[row]
            while (freed < need and p >= 0 and alive[p] and children[p] == 1 and not hold[p] and not retained[p]
                   and tick[p] <= t):
                chain.append(p)
                freed += cost[p]
                t = tick[p]
                p = parent[p]
            if len(chain) == 1:
                self._remove(row)
            else:
                self._remove_chain(chain)
            out.extend(chain)
        return out

    def _remove_chain(self, rows: list[int]) -> None:
        """:meth:`_remove` of ``rows``, a leaf then its ancestors (each the only child of the next,
        none held or retained), with the columns left exactly as removing them one by one would
        (so a tentative eviction's ``_reinsert`` undoes it)."""
        outer = np.zeros(len(rows), dtype=np.bool_)
        outer[-1] = True  # only the last row's parent stays
        self._remove_subtree(np.asarray(rows, dtype=np.int64), outer)

    def evict_cost(self, need: int) -> list[int]:
        """Evict LRU evictable leaves until ``need`` cost is freed (or none is left)."""
        out = self._evict_lru(need)
        self.evictions += len(out)
        self.evicted_cost += int(self.cost[out].sum()) if out else 0
        return out

    def add_cost(self, row: int, delta: int, retain_limit: int | None = None) -> list[int]:
        """Grow (or shrink) a sealed row's cost, e.g. for anchors; evicts to make room.

        ``retain_limit``: the retained bytes allowed (``retain_share`` of the budget); a retained
        row (or an ancestor of one) growing past it is refused with ``CapacityError`` before
        anything is evicted — else anchors added to retained prefixes grew the retained bytes
        past the share, and every later reservation failed for want of room."""
        evicted: list[int] = []
        if delta > 0 and retain_limit is not None and self.rcover[row] and self.retained_cost + delta > retain_limit:
            raise CapacityError(
                f"this entry is retained: {delta} more bytes make {self.retained_cost + delta} retained bytes, "
                f"more than the {retain_limit} allowed",
                hint="unretain other prefixes, or raise the retain_share option (a budget fraction)")
        if delta > 0:
            evicted = self.make_room(delta, protect=row)
        self.cost[row] += delta
        self.used_cost += delta
        self.sealed_cost += delta
        if self.rcover[row]:
            self.retained_cost += delta
        return evicted

    # -- holds -----------------------------------------------------------------------------------
    def hold_rows(self, rows: Sequence[int]) -> None:
        """Hold (lease) and touch the rows ``>= 0``; by slices past a few rows (a restore leases
        a chunk of a chain at a time: per-row Python there was the restore thread's GIL share)."""
        if len(rows) <= 8:
            for row in rows:
                if row >= 0:
                    self._hold(row)
                    self.touch(row)
            return
        arr = np.asarray(rows, dtype=np.int64)
        arr = arr[arr >= 0]
        if not len(arr):
            return
        u, c = np.unique(arr, return_counts=True)  # (not ufunc.at: slow per element on older numpy)
        self.hold[u] += c.astype(self.hold.dtype)
        # (touched in order, as one by one would; a held row is not evictable: nothing to push)
        self.tick[arr] = np.arange(self.clock + 1, self.clock + 1 + len(arr))
        self.clock += len(arr)
        self.used[arr] = time.time()

    def release_rows(self, rows: Sequence[int], gens: Sequence[int]) -> None:
        """Undo :meth:`hold_rows` for the ``(row, gen)`` pairs still live: rows removed (or
        recycled, or of an index replaced since) never match, gens are unique."""
        if len(rows) <= 8:
            for row, gen in zip(rows, gens, strict=True):
                if self.is_live(row, gen):
                    self._unhold(row)
            return
        arr = np.asarray(rows, dtype=np.int64)
        gs = np.asarray(gens, dtype=np.int64)  # (a missing row's gen may be -1; gens are counters)
        if len(arr) != len(gs):
            raise ValueError("rows and gens differ in length")
        ok = (arr >= 0) & (arr < self.n)
        arr, gs = arr[ok], gs[ok]
        arr = arr[self.alive[arr] & (self.gen[arr].astype(np.int64) == gs)]
        if not len(arr):
            return
        u, c = np.unique(arr, return_counts=True)
        self.hold[u] -= c.astype(self.hold.dtype)
        freed = u[(self.hold[u] == 0) & (self.children[u] == 0) & ~self.retained[u]]
        for row in freed.tolist():  # leaves only (a chain's last page): a few pushes
            heapq.heappush(self._heap, self.m_tick[row] << _ROW_BITS | row)

    def _hold(self, row: int) -> None:
        self.m_hold[row] += 1

    def _unhold(self, row: int) -> None:
        self.m_hold[row] -= 1
        if self.m_alive[row] and self._evictable(row):
            heapq.heappush(self._heap, self.m_tick[row] << _ROW_BITS | row)

    # -- retained entries ------------------------------------------------------------------------
    def retain_cost(self, rows: Sequence[int]) -> int:
        """The cost that marking ``rows`` would add to ``retained_cost``."""
        seen: set[int] = set()
        add = 0
        for row in rows:
            while row >= 0 and not self.rcover[row] and row not in seen:
                seen.add(row)
                add += int(self.cost[row])
                row = int(self.parent[row])
        return add

    def retain_rows(self, rows: Sequence[int], limit: int) -> int:
        """Mark live ``rows`` retained, all or nothing: ``CapacityError`` (nothing marked) when the
        retained cost would exceed ``limit``.  Returns how many rows were newly marked."""
        new = list(dict.fromkeys(r for r in rows if not self.retained[r]))
        add = self.retain_cost(new)
        if self.retained_cost + add > limit:
            raise CapacityError(
                f"retaining these entries needs {self.retained_cost + add} retained bytes, more than the "
                f"{limit} allowed ({self.retained_cost} retained now)",
                hint="unretain other prefixes, retain fewer, or raise the retain_share option (a budget fraction)",
            )
        for row in new:
            self.retained[row] = True
            self.retained_count += 1
            self._cover(row)
        return len(new)

    def unretain_rows(self, rows: Sequence[int]) -> int:
        """Clear the marks of ``rows`` (rows < 0 or not marked are ignored); how many were cleared."""
        cleared = 0
        for row in dict.fromkeys(rows):
            if row < 0 or not self.alive[row] or not self.retained[row]:
                continue
            self.retained[row] = False
            self.retained_count -= 1
            cleared += 1
            self._uncover(row)
            if self._evictable(row):
                heapq.heappush(self._heap, int(self.tick[row]) << _ROW_BITS | row)
        return cleared

    # -- removal ---------------------------------------------------------------------------------
    def _remove(self, row: int) -> None:
        if self.m_retained[row]:  # only a drop (corruption) removes a retained row; children went first
            self.m_retained[row] = False
            self.retained_count -= 1
            self._uncover(row)
        self._unmap(row)
        self.m_alive[row] = False
        self.count -= 1
        c = self.m_cost[row]
        self.used_cost -= c
        self.sealed_cost -= c
        p = self.m_parent[row]
        if p >= 0 and self.m_alive[p]:
            self.m_children[p] -= 1
            if self._evictable(p):
                heapq.heappush(self._heap, self.m_tick[p] << _ROW_BITS | p)

    def recycle(self, rows: Sequence[int]) -> None:
        """Make removed rows reusable (after the caller freed their bytes)."""
        if len(rows):
            idx = list(rows)
            self.children[idx] = 0
            self.hold[idx] = 0
            self.retained[idx] = False
            self.rcover[idx] = 0
            self._free_rows.extend(idx)

    def subtree(self, roots: Sequence[int]) -> list[int]:
        """Rows of the subtrees under ``roots``, deepest first (pointer jumping, vectorised)."""
        roots = [r for r in roots if r >= 0 and self.alive[r]]
        if not roots:
            return []
        if all(self.children[r] == 0 for r in roots):
            return list(dict.fromkeys(roots))
        n = self.n
        alive = self.alive[:n]
        mark = np.zeros(n, np.bool_)
        mark[roots] = True
        anc = np.where(alive, self.parent[:n], -1)
        depth = (anc >= 0).astype(np.int64)
        while True:
            idx = np.flatnonzero(anc >= 0)
            if not len(idx):
                break
            up = anc[idx]
            mark[idx] |= mark[up]
            depth[idx] += depth[up]
            anc[idx] = anc[up]
        rows = np.flatnonzero(mark & alive)
        order = np.argsort(-depth[rows], kind="stable")
        out: list[int] = rows[order].tolist()
        return out

    def evict_for(self, keys: Sequence[bytes] | None, need: int) -> tuple[list[int], int, int]:
        """A provider's ``evict``: the rows of ``keys`` with their subtrees (:meth:`evict_rows`),
        or with ``keys=None`` leaves worth ``need`` bytes (:meth:`evict_cost`); returns the rows
        removed, their bytes and how many were skipped (held).  The caller frees the rows."""
        if keys is not None:
            removed, skipped = self.evict_rows(self.rows_of(keys))
        else:
            removed, skipped = self.evict_cost(need), 0
        return removed, int(self.nbytes[removed].sum()) if removed else 0, skipped

    def evict_rows(self, rows: Sequence[int]) -> tuple[list[int], int]:
        """Remove ``rows`` with their subtrees, skipping held rows (and so their ancestors);
        ``RetainedError`` (nothing removed) when a subtree holds a retained row."""
        covered = [r for r in rows if r >= 0 and self.alive[r] and self.rcover[r]]
        if covered:
            raise RetainedError(
                f"{len(covered)} of the entries to evict are retained or ancestors of retained entries "
                f"(e.g. {self.key_of(covered[0]).hex()[:16]}); nothing was evicted")
        order = self.subtree(rows)
        if len(order) < 64:
            return self._evict_each(order)
        # Column work for a long subtree (a whole saved chain: 6,400 rows took 15 ms of Python
        # row by row, the GIL held throughout, stalling an engine's decode thread; issue 14).  A
        # row goes iff nothing under it (itself included) is held or in flight: the row-by-row
        # rule, since a skipped row keeps its parent's child count above zero.
        arr = np.asarray(order, dtype=np.int64)
        blocked = self.hold[arr] != 0
        if self.flights:
            flights = self.flights
            raw = self.key[arr].tobytes()
            blocked |= np.fromiter((raw[i * 32:(i + 1) * 32] in flights for i in range(len(arr))),
                                   dtype=np.bool_, count=len(arr))
        if blocked.any():
            pos = {r: i for i, r in enumerate(order)}
            parent = self.m_parent
            for i in np.flatnonzero(blocked).tolist():
                p = parent[order[i]]
                while p >= 0 and (j := pos.get(p)) is not None and not blocked[j]:
                    blocked[j] = True
                    p = parent[p]
        go = arr[~blocked]
        # every child of a row that goes goes too: its child count must be exactly those
        inner = np.isin(self.parent[go], go)
        kids = np.bincount(np.searchsorted(np.sort(go), self.parent[go][inner]), minlength=len(go))
        if self.retained[go].any() or not np.array_equal(self.children[np.sort(go)], kids):
            return self._evict_each(order)  # not a consistent subtree: the exact row-by-row rule
        self._remove_subtree(go, outer=~inner)
        c = int(self.cost[go].sum())
        self.evictions += len(go)
        self.evicted_cost += c
        return go.tolist(), int(blocked.sum())

    def _evict_each(self, order: Sequence[int]) -> tuple[list[int], int]:
        """:meth:`evict_rows`' rule, row by row (``order``: a subtree, deepest first)."""
        removed: list[int] = []
        skipped = 0
        for row in order:
            if self.hold[row] or self.children[row] or self.key_of(row) in self.flights:
                skipped += 1
                continue
            self._remove(row)
            self.evictions += 1
            self.evicted_cost += int(self.cost[row])
            removed.append(row)
        return removed, skipped

    def _remove_subtree(self, rows: npt.NDArray[np.int64], outer: npt.NDArray[np.bool_]) -> None:
        """:meth:`_remove` of ``rows`` (none retained, each with all of its children among them),
        leaving the columns as removing them one by one, children first, would; ``outer``: the
        rows whose parent is not among them."""
        self._unmap_rows(rows)
        self.alive[rows] = False
        self.children[rows] = 0
        self.count -= len(rows)
        c = int(self.cost[rows].sum())
        self.used_cost -= c
        self.sealed_cost -= c
        for p in self.parent[rows[outer]].tolist():
            if p >= 0 and self.m_alive[p]:
                self.m_children[p] -= 1
                if self._evictable(p):
                    heapq.heappush(self._heap, self.m_tick[p] << _ROW_BITS | p)

    def drop(self, row: int) -> list[int]:
        """Force-remove ``row`` and its subtree (corruption), held or retained or not."""
        removed: list[int] = []
        for r in self.subtree([row]):
            self.hold[r] = 0  # leases and flights on a dropped row see it dead (or a new gen)
            self.children[r] = 0  # children already removed (deepest first)
            self._remove(r)
            removed.append(r)
        return removed
