"""The mmap store's in-memory index: numpy columns per entry (tree links, LRU ticks, holds,
placement), the in-flight reservations, and the budget rules (leaf-LRU eviction, the guard)."""

from __future__ import annotations

import heapq
import time
from collections.abc import Container, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from hostkv_providers._errors import (
    CapacityError,
    InFlightError,
    UnknownKeyError,
)
from hostkv_providers._keys import Key

from ._format import _TAG_MAX, _key_u64


@dataclass(slots=True)
class _Anchor:
    file: int
    slot: int
    nslots: int
    nbytes: int
    gen: int
    checksum: int
    cost: int


class _Flight:
    # The parent's generation too: if the parent row is dropped (corrupt) and recycled for another
    # entry, commit/cancel must not touch that other entry's pins.
    __slots__ = ("cost", "parent", "parent_gen", "pending")

    def __init__(self, parent: int, cost: int, parent_gen: int, pending: Key | None = None) -> None:
        self.parent = parent
        self.cost = cost
        self.parent_gen = parent_gen
        #: put_many: the parent is an earlier reservation of the same batch (not a row yet); it is
        #: resolved when this flight commits, after the parent's commit in the same locked pass.
        self.pending = pending


# ------------------------------------------------------------------------------------------------
# The in-memory index: numpy columns, so a million entries load without a million Python objects
# ------------------------------------------------------------------------------------------------


class _Index:
    """A prefix-closed tree with LRU-leaf eviction, holds and an O(1) budget guard (the same
    semantics as :class:`._index.TreeIndex`) over numpy columns.

    Why not ``TreeIndex``: creating one ``Node`` object per entry costs ~1-3 s per million
    entries on a loaded machine, and reopening a million-entry store must take under a second.
    Rows are indices into the columns; the key map is a Python dict for rows added after open
    plus a sorted numpy array (binary search) for rows bulk-loaded at open.
    """

    COLS: tuple[tuple[str, Any, Any], ...] = (
        ("key", "V32", None), ("parent", np.int64, -1), ("nbytes", np.int64, 0), ("cost", np.int64, 0),
        ("file", np.int64, 0), ("slot", np.int64, 0), ("nslots", np.int64, 0), ("gen", np.uint64, 0),
        ("csum", np.uint64, 0), ("created", np.float64, 0.0), ("used", np.float64, 0.0),
        ("tick", np.int64, 0), ("children", np.int32, 0), ("hold", np.int32, 0),
        ("alive", np.bool_, False), ("tag", "V16", None), ("tag_len", np.uint8, 0),
    )

    def __init__(self, budget: int, capacity: int = 1024) -> None:
        self.budget = budget
        self.cap = 0
        self.n = 0  # rows ever used (high-water mark)
        self.key: npt.NDArray[Any] = np.zeros(0, "V32")
        self.parent: npt.NDArray[np.int64] = np.zeros(0, np.int64)
        self.nbytes: npt.NDArray[np.int64] = np.zeros(0, np.int64)
        self.cost: npt.NDArray[np.int64] = np.zeros(0, np.int64)
        self.file: npt.NDArray[np.int64] = np.zeros(0, np.int64)
        self.slot: npt.NDArray[np.int64] = np.zeros(0, np.int64)
        self.nslots: npt.NDArray[np.int64] = np.zeros(0, np.int64)
        self.gen: npt.NDArray[np.uint64] = np.zeros(0, np.uint64)
        self.csum: npt.NDArray[np.uint64] = np.zeros(0, np.uint64)
        self.created: npt.NDArray[np.float64] = np.zeros(0, np.float64)
        self.used: npt.NDArray[np.float64] = np.zeros(0, np.float64)
        self.tick: npt.NDArray[np.int64] = np.zeros(0, np.int64)
        self.children: npt.NDArray[np.int32] = np.zeros(0, np.int32)
        self.hold: npt.NDArray[np.int32] = np.zeros(0, np.int32)
        self.alive: npt.NDArray[np.bool_] = np.zeros(0, np.bool_)
        self.tag: npt.NDArray[Any] = np.zeros(0, "V16")
        self.tag_len: npt.NDArray[np.uint8] = np.zeros(0, np.uint8)
        self._grow(capacity)
        self.anchors: dict[int, dict[str, _Anchor]] = {}
        self.flights: dict[Key, _Flight] = {}
        self.count = 0
        self.used_cost = 0  # sealed cost + in-flight cost
        self.sealed_cost = 0
        self.evictions = 0
        self.evicted_cost = 0
        self.clock = 1
        self._free_rows: list[int] = []
        self._dict: dict[bytes, int] = {}
        self._base_k64: npt.NDArray[np.uint64] = np.zeros(0, np.uint64)
        self._base_row: npt.NDArray[np.int64] = np.zeros(0, np.int64)
        self._heap: list[tuple[int, int]] = []
        self._heap_bound = -1  # every unheld leaf with tick <= bound is in the heap

    def _grow(self, capacity: int) -> None:
        if capacity <= self.cap:
            return
        for name, dtype, fill in self.COLS:
            old = getattr(self, name)
            new = np.zeros(capacity, dtype=dtype)
            if fill is not None and fill != 0:
                new[:] = fill
            new[: len(old)] = old
            setattr(self, name, new)
        self.cap = capacity

    # -- key map ---------------------------------------------------------------------------------
    def row_of(self, key: bytes) -> int:
        row = self._dict.get(key)
        if row is not None:
            return row
        if len(self._base_k64):
            h = _key_u64(key)
            i = int(np.searchsorted(self._base_k64, h))
            while i < len(self._base_k64) and int(self._base_k64[i]) == h:
                r = int(self._base_row[i])
                if r >= 0 and self.key[r].tobytes() == key:
                    self._dict[key] = r  # cache: the next lookup of this key is one dict probe
                    return r
                i += 1
        return -1

    def _unmap(self, row: int) -> None:
        key = self.key[row].tobytes()
        self._dict.pop(key, None)
        if not len(self._base_k64):
            return
        h = _key_u64(key)
        i = int(np.searchsorted(self._base_k64, h))
        while i < len(self._base_k64) and int(self._base_k64[i]) == h:
            if int(self._base_row[i]) == row:
                self._base_row[i] = -1
                return
            i += 1

    def key_of(self, row: int) -> Key:
        return Key(self.key[row].tobytes())

    def tag_of(self, row: int) -> str:
        n = int(self.tag_len[row])
        raw: bytes = self.tag[row].tobytes()
        return raw[:n].decode("utf-8", "replace")

    def parent_key(self, row: int) -> Key | None:
        p = int(self.parent[row])
        return None if p < 0 else self.key_of(p)

    # -- bulk load -------------------------------------------------------------------------------
    def load_columns(self, L: npt.NDArray[np.uint64], parent_rows: npt.NDArray[np.int64],
                     costs: npt.NDArray[np.int64], base_k64: npt.NDArray[np.uint64],
                     base_row: npt.NDArray[np.int64]) -> None:
        """Replace the contents by the live records ``L`` (uint64 columns, keys unique, parents
        resolved to column positions, prefix-closed); ``base_k64``/``base_row`` is the key map
        (first 8 key bytes, sorted, and the row of each)."""
        n = L.shape[1]
        for name, dtype, _ in self.COLS:
            setattr(self, name, np.zeros(0, dtype=dtype))
        self.cap = 0
        self._grow(max(1024, n + n // 4))
        self.n = n
        if n:
            self.key[:n] = np.ascontiguousarray(L[1:5].T).view("V32").reshape(n)
            self.tag[:n] = np.ascontiguousarray(L[9:11].T).view("V16").reshape(n)
        self.parent[:n] = parent_rows
        self.nslots[:n] = (L[0] >> np.uint64(32)).astype(np.int64)
        self.tag_len[:n] = np.minimum((L[0] >> np.uint64(16)) & np.uint64(0xFF), _TAG_MAX).astype(np.uint8)
        self.file[:n] = (L[13] & np.uint64(0xFFFFFFFF)).astype(np.int64)
        self.slot[:n] = (L[13] >> np.uint64(32)).astype(np.int64)
        self.nbytes[:n] = L[14].astype(np.int64)
        self.gen[:n] = L[15]
        self.csum[:n] = L[16]
        self.created[:n] = L[17].view(np.float64)
        self.used[:n] = self.created[:n]
        ticks = L[18].astype(np.int64)
        self.tick[:n] = ticks
        self.cost[:n] = costs
        self.alive[:n] = True
        if n:
            has_parent = parent_rows >= 0
            self.children[:n] = np.bincount(parent_rows[has_parent], minlength=n)[:n].astype(np.int32)
        self._base_k64 = base_k64
        self._base_row = base_row.astype(np.int64)
        self._dict = {}
        self._free_rows = []
        self.count = n
        self.sealed_cost = int(costs.sum()) if n else 0
        self.used_cost = self.sealed_cost
        self.clock = max(self.clock, int(ticks.max()) + 1 if n else 1)
        self._heap = []
        self._heap_bound = -1

    # -- lookups ---------------------------------------------------------------------------------
    def rows_of(self, keys: Sequence[bytes]) -> list[int]:
        return [self.row_of(k) for k in keys]

    def touch(self, row: int) -> None:
        self.clock += 1
        self.tick[row] = self.clock
        self.used[row] = time.time()
        if not self.children.item(row) and not self.hold.item(row):
            if len(self._heap) > 4 * self.count + 1024:
                # mostly stale entries (a reader touches without ever evicting): rebuild lazily
                self._heap = []
                self._heap_bound = -1
            heapq.heappush(self._heap, (self.clock, row))

    def live_rows(self) -> npt.NDArray[np.intp]:
        return np.flatnonzero(self.alive[: self.n])

    # -- reservations ----------------------------------------------------------------------------
    def begin(self, key: Key, parent: Key | None, cost: int,
              pending_ok: Container[Key] = ()) -> tuple[bool, list[int], int]:
        """Start a reservation: ``(False, [], -1)`` for a sealed key (dedup), else
        ``(True, evicted_rows, parent_row)``.  A parent in ``pending_ok`` (and in flight) need not
        be sealed yet: the caller commits it first (``put_many``)."""
        if self.row_of(key) >= 0:
            return False, [], -1
        if key in self.flights:
            raise InFlightError(f"key {key.hex()[:16]} is being written by another writer", key=key)
        prow = -1
        pending = None
        if parent is not None:
            prow = self.row_of(parent)
            if prow < 0:
                if parent not in pending_ok or parent not in self.flights:
                    raise UnknownKeyError(f"parent {parent.hex()[:16]} is not stored")
                pending = parent  # an in-flight entry is never evicted: nothing to hold
        evicted = self.make_room(cost, protect=prow)
        self.flights[key] = _Flight(prow, cost, int(self.gen[prow]) if prow >= 0 else 0, pending)
        self.used_cost += cost
        if prow >= 0:
            self._hold(prow)
        return True, evicted, prow

    def commit(self, key: Key, *, nbytes: int, file: int, slot: int, nslots: int, gen: int, csum: int,
               tag: bytes, created: float) -> int:
        flight = self.flights.pop(key)
        prow = flight.parent
        if flight.pending is not None:
            prow = self.row_of(flight.pending)
            if prow < 0:
                self.used_cost -= flight.cost
                raise UnknownKeyError(
                    "the parent (an earlier item of the same batch) was not stored",
                    hint="save the chain again from its first missing page",
                )
        elif prow >= 0 and not self._parent_alive(flight):
            self.used_cost -= flight.cost
            raise UnknownKeyError(
                "the parent was dropped (corrupt) before the seal",
                hint="save the chain again from its first missing page",
            )
        row = self._free_rows.pop() if self._free_rows else self._new_row()
        self.key[row] = key
        self.parent[row] = prow
        self.nbytes[row] = nbytes
        self.cost[row] = flight.cost
        self.file[row] = file
        self.slot[row] = slot
        self.nslots[row] = nslots
        self.gen[row] = gen
        self.csum[row] = csum
        self.created[row] = created
        self.used[row] = created
        self.children[row] = 0
        self.hold[row] = 0
        self.tag[row] = tag.ljust(_TAG_MAX, b"\0")
        self.tag_len[row] = len(tag)
        self.alive[row] = True
        self._dict[key] = row
        self.count += 1
        self.sealed_cost += flight.cost
        if prow >= 0:
            self.children[prow] += 1
            if flight.pending is None:
                self._unhold(prow)
        self.touch(row)
        return row

    def _parent_alive(self, flight: _Flight) -> bool:
        """Whether the flight's parent is still the entry it pinned (alive, same generation)."""
        p = flight.parent
        return p >= 0 and bool(self.alive[p]) and int(self.gen[p]) == flight.parent_gen

    def _new_row(self) -> int:
        if self.n >= self.cap:
            self._grow(self.cap * 2)
        self.n += 1
        return self.n - 1

    def cancel(self, key: Key) -> None:
        flight = self.flights.pop(key, None)
        if flight is None:
            return
        self.used_cost -= flight.cost
        if flight.pending is None and self._parent_alive(flight):
            self._unhold(flight.parent)

    # -- budget ----------------------------------------------------------------------------------
    def make_room(self, cost: int, protect: int = -1) -> list[int]:
        """Evict LRU leaves until ``cost`` more fits, or raise ``CapacityError`` evicting nothing.

        Pins are direct (only leaves are evicted, so an ancestor of a pinned row is safe as a
        non-leaf); the guard evicts tentatively and puts every row back if even that is not
        enough.  Both keep a reservation O(1) however deep its chain, as in ``TreeIndex``.
        """
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
                    f"{sum(int(self.cost[r]) for r in removed)} of it is evictable (the rest is leased "
                    "or in flight)"
                )
        finally:
            if protect >= 0:
                self._unhold(protect)
        self.evictions += len(removed)
        self.evicted_cost += sum(int(self.cost[r]) for r in removed)
        return removed

    def _reinsert(self, row: int) -> None:
        """Undo ``_remove`` of a tentative eviction."""
        self._dict[self.key[row].tobytes()] = row
        self.alive[row] = True
        self.count += 1
        c = int(self.cost[row])
        self.used_cost += c
        self.sealed_cost += c
        p = int(self.parent[row])
        if p >= 0 and self.alive[p]:
            self.children[p] += 1
        heapq.heappush(self._heap, (int(self.tick[row]), row))

    def _refill_heap(self) -> None:
        """Rebuild the LRU candidate heap from the columns: the K oldest unheld leaves."""
        n = self.n
        cand = np.flatnonzero(self.alive[:n] & (self.children[:n] == 0) & (self.hold[:n] == 0))
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
        self._heap = list(zip(ticks.tolist(), cand.tolist(), strict=True))
        heapq.heapify(self._heap)

    def pop_lru_leaf(self) -> int:
        """The least-recently-used unheld leaf (not removed), or -1."""
        for _ in range(2):
            while self._heap:
                tick, row = self._heap[0]
                if (not self.alive[row] or int(self.tick[row]) != tick or self.children[row]
                        or self.hold[row]):
                    heapq.heappop(self._heap)
                    continue
                if tick > self._heap_bound:
                    break  # an unheld leaf older than this may be missing from the heap
                return row
            self._refill_heap()
        return -1

    def _evict_lru(self, need: int) -> list[int]:
        out: list[int] = []
        freed = 0
        while freed < need:
            row = self.pop_lru_leaf()
            if row < 0:
                break
            freed += int(self.cost[row])
            self._remove(row)
            out.append(row)
        return out

    def evict_cost(self, need: int) -> list[int]:
        """Evict LRU unpinned leaves until ``need`` cost is freed (or none is left)."""
        out = self._evict_lru(need)
        self.evictions += len(out)
        self.evicted_cost += sum(int(self.cost[r]) for r in out)
        return out

    def add_cost(self, row: int, delta: int) -> list[int]:
        evicted: list[int] = []
        if delta > 0:
            evicted = self.make_room(delta, protect=row)
        self.cost[row] += delta
        self.used_cost += delta
        self.sealed_cost += delta
        return evicted

    # -- holds -----------------------------------------------------------------------------------
    def hold_rows(self, rows: Sequence[int]) -> None:
        for row in rows:
            if row >= 0:
                self._hold(row)
                self.touch(row)

    def release_rows(self, rows: Sequence[int], gens: Sequence[int]) -> None:
        for row, g in zip(rows, gens, strict=True):
            # rows of an index replaced since (a reader's refresh) never match: gens are unique
            if 0 <= row < self.n and self.alive[row] and int(self.gen[row]) == g:
                self._unhold(row)

    def _hold(self, row: int) -> None:
        self.hold[row] += 1

    def _unhold(self, row: int) -> None:
        self.hold[row] -= 1
        if self.hold[row] == 0 and self.children[row] == 0 and self.alive[row]:
            heapq.heappush(self._heap, (int(self.tick[row]), row))

    # -- removal ---------------------------------------------------------------------------------
    def _remove(self, row: int) -> None:
        self._unmap(row)
        self.alive[row] = False
        self.count -= 1
        c = int(self.cost[row])
        self.used_cost -= c
        self.sealed_cost -= c
        p = int(self.parent[row])
        if p >= 0 and self.alive[p]:
            self.children[p] -= 1
            if self.children[p] == 0 and self.hold[p] == 0:
                heapq.heappush(self._heap, (int(self.tick[p]), p))

    def recycle(self, rows: Sequence[int]) -> None:
        """Make removed rows reusable (after the caller freed their slots)."""
        self._free_rows.extend(rows)

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
        return [int(r) for r in rows[order]]

    def evict_rows(self, rows: Sequence[int]) -> tuple[list[int], int]:
        removed: list[int] = []
        skipped = 0
        for row in self.subtree(rows):
            if self.hold[row] or self.children[row] or self.key_of(row) in self.flights:
                skipped += 1
                continue
            self._remove(row)
            self.evictions += 1
            self.evicted_cost += int(self.cost[row])
            removed.append(row)
        return removed, skipped

    def drop(self, row: int) -> list[int]:
        """Force-remove ``row`` and its subtree (corruption), held or not."""
        removed: list[int] = []
        for r in self.subtree([row]):
            self.hold[r] = 0  # leases and flights on a dropped row see it dead (or a new gen)
            self.children[r] = 0
            self._remove(r)
            removed.append(r)
        return removed
