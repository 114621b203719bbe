"""The tree index's columns and lookups: the numpy columns and their memoryviews, the key map
(a ``dict`` for rows sealed in this process, a sorted array for rows bulk loaded at open), stats,
touches and the retained cover's column walk."""

from __future__ import annotations

import heapq
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from hostkv_providers._keys import Key
from hostkv_providers.providers._tree._rows import _ROW_BITS, IndexStats, _Flight, _Run, key_u64

#: ``TreeIndex.touch_rows`` of at most this many rows runs as one loop over the column views.
_TOUCH_LOOP_MAX = 256


class _Columns:
    """:class:`~hostkv_providers.providers.TreeIndex`'s columns, key map and lookups."""


    COLS: tuple[tuple[str, Any, Any], ...] = (
        ("key", "V32", None), ("parent", np.int64, -1), ("nbytes", np.int64, 0), ("cost", np.int64, 0),
        ("gen", np.uint64, 0), ("csum", np.uint64, 0), ("has_csum", np.bool_, False),
        ("created", np.float64, 0.0), ("used", np.float64, 0.0), ("tick", np.int64, 0),
        ("children", np.int32, 0), ("hold", np.int32, 0), ("alive", np.bool_, False),
        ("retained", np.bool_, False), ("rcover", np.int32, 0), ("tag_id", np.int32, 0),
    )

    key: npt.NDArray[Any]
    parent: npt.NDArray[np.int64]
    nbytes: npt.NDArray[np.int64]
    cost: npt.NDArray[np.int64]
    gen: npt.NDArray[np.uint64]
    csum: npt.NDArray[np.uint64]
    has_csum: npt.NDArray[np.bool_]
    created: npt.NDArray[np.float64]
    used: npt.NDArray[np.float64]
    tick: npt.NDArray[np.int64]
    children: npt.NDArray[np.int32]
    hold: npt.NDArray[np.int32]
    alive: npt.NDArray[np.bool_]
    retained: npt.NDArray[np.bool_]
    rcover: npt.NDArray[np.int32]
    tag_id: npt.NDArray[np.int32]

    # memoryviews of the numeric columns (see _views); typed Any: items are Python ints/floats/bools
    m_parent: Any
    m_nbytes: Any
    m_cost: Any
    m_gen: Any
    m_csum: Any
    m_has_csum: Any
    m_created: Any
    m_used: Any
    m_tick: Any
    m_children: Any
    m_hold: Any
    m_alive: Any
    m_retained: Any
    m_rcover: Any
    m_tag_id: Any

    def __init__(self, budget: int, capacity: int = 1024) -> None:
        self.budget = budget
        self.cap = 0
        self.n = 0  # rows ever used (high-water mark)
        for name, dtype, _ in self.COLS:
            setattr(self, name, np.zeros(0, dtype=dtype))
        self._grow(capacity)
        self.anchors: dict[int, dict[str, Any]] = {}  # row -> name -> provider-private anchor record
        self.flights: dict[Key, _Flight | _Run] = {}
        self.count = 0
        self.used_cost = 0  # sealed cost + in-flight cost
        self.sealed_cost = 0
        self.evictions = 0
        self.evicted_cost = 0
        self.retained_count = 0  # rows marked retained
        self.retained_cost = 0  # cost of the rows covered by a mark (marked rows and their ancestors)
        self.clock = 1
        self._next_gen = 1
        self.tags: list[str] = [""]
        self._tag_ids: dict[str, int] = {"": 0}
        self._free_rows: list[int] = []
        self._dict: dict[bytes, int] = {}
        self._base_k64: npt.NDArray[np.uint64] = np.zeros(0, np.uint64)
        self._base_row: npt.NDArray[np.int64] = np.zeros(0, np.int64)
        self._heap: list[int] = []  # tick << 32 | row
        self._heap_bound = -1  # every evictable leaf with tick <= bound is in the heap
        self._waiting: dict[Key, list[Key]] = {}  # in-flight parent -> chained flights under it

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
        self._views()

    def _views(self) -> None:
        """``m_<name>``: a memoryview of each numeric column, for the per-entry scalar work of the
        hot paths (one item through a memoryview costs a fifth of a numpy scalar index); the
        numpy arrays stay the columns (vectorised work, subclasses), sharing the same memory."""
        for name, dtype, _ in self.COLS:
            if np.dtype(dtype).kind != "V":
                setattr(self, "m_" + name, memoryview(getattr(self, name)))

    # -- key map ---------------------------------------------------------------------------------
    def row_of(self, key: bytes) -> int:
        """The row of a sealed key, or -1."""
        row = self._dict.get(key)
        if row is not None:
            return row
        if len(self._base_k64):
            h = key_u64(key)
            # np.uint64, not the int: numpy compares a uint64 array with a Python int as float64,
            # whose 53 bits lose the low bits of the key's first 8 bytes, so the search landed on
            # another key of the same rounded value and a stored key read as absent
            i = int(np.searchsorted(self._base_k64, np.uint64(h)))
            while i < len(self._base_k64) and int(self._base_k64[i]) == h:
                r = int(self._base_row[i])
                if r >= 0 and self.key[r].tobytes() == key:
                    self._dict[key] = r  # cache: the next lookup of this key is one dict probe
                    return r
                i += 1
        return -1

    def rows_of(self, keys: Sequence[bytes]) -> list[int]:
        """:meth:`row_of` of each key.  After a bulk load the keys not yet in the dict are looked
        up in the sorted key map for the whole batch at once (one ``searchsorted``, one
        comparison of the candidates' keys), not one numpy call per key."""
        get = self._dict.get
        if not len(self._base_k64):
            return [-1 if r is None else r for r in map(get, keys)]
        found = list(map(get, keys))
        if None not in found:
            return found  # type: ignore[return-value]  # (no None in it)
        miss = [j for j, r in enumerate(found) if r is None]
        if len(miss) > 2:
            mk = [keys[j] for j in miss]
            base, brow = self._base_k64, self._base_row
            hs = np.frombuffer(b"".join([k[:8] for k in mk]), "<u8")
            pos = np.minimum(np.searchsorted(base, hs), len(base) - 1)
            hit = base[pos] == hs
            cand = np.where(hit, brow[pos], -1)
            ok = cand >= 0
            if bool(ok.all()) and self.key[cand].tobytes() == b"".join(mk):
                for j, k, r in zip(miss, mk, cand.tolist(), strict=True):
                    self._dict[k] = r  # cache, as row_of does
                    found[j] = r
                return found  # type: ignore[return-value]
            for j, k, h in zip(miss, mk, hit.tolist(), strict=True):
                # (no entry with these 8 key bytes: absent; else row_of walks the equal ones)
                found[j] = self.row_of(k) if h else -1
            return found  # type: ignore[return-value]
        for j in miss:
            found[j] = self.row_of(keys[j])
        return found  # type: ignore[return-value]

    def contains(self, key: bytes) -> bool:
        """Whether ``key`` is sealed (C speed when nothing was bulk loaded)."""
        return key in self._dict or (bool(len(self._base_k64)) and self.row_of(key) >= 0)

    @property
    def contains_fn(self) -> Any:
        """A fast membership callable (``dict.__contains__`` when nothing was bulk loaded)."""
        return self.contains if len(self._base_k64) else self._dict.__contains__

    def _unmap(self, row: int) -> None:
        key = self.key[row].tobytes()
        self._dict.pop(key, None)
        if len(self._base_k64):
            self._unmap_base(row, key_u64(key))

    def _unmap_base(self, row: int, h: int) -> None:
        """Take ``row`` (first key bytes ``h``) out of the bulk-loaded key map, if it is there."""
        i = int(np.searchsorted(self._base_k64, np.uint64(h)))  # (see row_of)
        while i < len(self._base_k64) and int(self._base_k64[i]) == h:
            if int(self._base_row[i]) == row:
                self._base_row[i] = -1
                return
            i += 1

    def _unmap_rows(self, rows: npt.NDArray[np.int64]) -> None:
        """:meth:`_unmap` of many rows: the dict pops, and one search of the bulk-loaded key map
        (a row added since the load is not in it; a few share their first 8 key bytes)."""
        raw = self.key[rows].tobytes()
        if self._dict:  # (empty after a load until rows are sealed or looked up)
            pop = self._dict.pop
            for i in range(0, len(raw), 32):
                pop(raw[i : i + 32], None)
        k64 = self._base_k64
        if not len(k64) or not len(rows):
            return
        h = np.frombuffer(raw, dtype="<u8").reshape(len(rows), 4)[:, 0]  # key_u64 of each
        lo = np.searchsorted(k64, h, side="left")
        span = np.searchsorted(k64, h, side="right") - lo
        one = span == 1
        at = lo[one]
        self._base_row[at[self._base_row[at] == rows[one]]] = -1
        for j in np.flatnonzero(span > 1).tolist():
            self._unmap_base(int(rows[j]), int(h[j]))

    def key_of(self, row: int) -> Key:
        return Key(self.key[row].tobytes())

    def parent_key(self, row: int) -> Key | None:
        p = int(self.parent[row])
        return None if p < 0 else self.key_of(p)

    def tag_of(self, row: int) -> str:
        tag: str = self.tags[self.m_tag_id[row]]
        return tag

    def _tag_index(self, tag: str | bytes) -> int:
        """The index of ``tag`` in ``tags`` (added on first use)."""
        t = tag.decode("utf-8", "replace") if isinstance(tag, bytes) else tag
        tid = self._tag_ids.get(t)
        if tid is None:
            tid = self._tag_ids[t] = len(self.tags)
            self.tags.append(t)
        return tid

    def _set_tag(self, row: int, tag: str | bytes) -> None:
        self.m_tag_id[row] = self._tag_index(tag)

    def _set_tags(self, rows: npt.NDArray[np.int64] | slice, tag: str | bytes) -> None:
        """:meth:`_set_tag` of many rows at once (a subclass that stores tags differently
        overrides both)."""
        self.tag_id[rows] = self._tag_index(tag)

    def checksum_of(self, row: int) -> int | None:
        return self.m_csum[row] if self.m_has_csum[row] else None

    def is_live(self, row: int, gen: int) -> bool:
        """Whether ``(row, gen)`` still names a sealed entry (not removed, not recycled)."""
        return 0 <= row < self.n and self.m_alive[row] and self.m_gen[row] == gen

    def __len__(self) -> int:
        return self.count

    def live_rows(self) -> npt.NDArray[np.intp]:
        return np.flatnonzero(self.alive[: self.n])

    def stats_fields(self) -> IndexStats:
        """The :class:`~hostkv_providers.ProviderStats` fields every store over this index reports
        alike (entries, bytes, anchors, leases, flights, evictions, retained entries)."""
        n = self.n
        return {"entries": self.count, "used_bytes": self.used_cost,
                "anchors": sum(len(t) for t in self.anchors.values()),
                "leased": int(((self.hold[:n] > 0) & self.alive[:n]).sum()), "in_flight": len(self.flights),
                "evictions": self.evictions, "evicted_bytes": self.evicted_cost,
                "retained": self.retained_count, "retained_bytes": self.retained_cost}

    def keys(self) -> Iterator[Key]:
        """The sealed keys (a snapshot)."""
        return iter([self.key_of(int(r)) for r in self.live_rows()])

    def set_key_map(self, base_k64: npt.NDArray[np.uint64], base_row: npt.NDArray[np.int64]) -> None:
        """Bulk-loaded rows' key map: first 8 key bytes (sorted) and the row of each."""
        self._base_k64 = base_k64
        self._base_row = base_row.astype(np.int64)
        self._dict = {}

    def reset(self, n: int) -> None:
        """Empty the index and make room for ``n`` bulk-loaded rows (a subclass fills them)."""
        for name, dtype, _ in self.COLS:
            setattr(self, name, np.zeros(0, dtype=dtype))
        self.cap = 0
        self._grow(max(1024, n + n // 4))  # (and the memoryviews)
        self.n = n
        self._dict = {}
        self._base_k64 = np.zeros(0, np.uint64)
        self._base_row = np.zeros(0, np.int64)
        self._free_rows = []
        self._heap = []
        self._heap_bound = -1
        self.anchors = {}

    def finish_load(self) -> None:
        """Derive children, counts, costs and the retained cover of rows ``[0, n)`` set by a bulk
        load (``parent``, ``cost``, ``tick``, ``alive``, ``retained`` filled in)."""
        n = self.n
        parents = self.parent[:n]
        if n:
            has_parent = parents >= 0
            self.children[:n] = np.bincount(parents[has_parent], minlength=n)[:n].astype(np.int32)
        self.count = int(self.alive[:n].sum())
        self.sealed_cost = int(self.cost[:n].sum()) if n else 0
        self.used_cost = self.sealed_cost
        self.clock = max(self.clock, int(self.tick[:n].max()) + 1 if n else 1)
        self.count_retained()

    def count_retained(self) -> None:
        """Recount the retained rows and their cover from the ``retained`` column (after a load)."""
        n = self.n
        self.retained[:n] &= self.alive[:n]
        self.rcover[:n] = 0
        self.retained_count = 0
        self.retained_cost = 0
        for row in np.flatnonzero(self.retained[:n]).tolist():
            self.retained_count += 1
            self._cover(row)

    # -- lookups ---------------------------------------------------------------------------------
    def _evictable(self, row: int) -> bool:
        return not (self.m_children[row] or self.m_hold[row] or self.m_retained[row])

    def touch(self, row: int) -> None:
        self.clock += 1
        self.m_tick[row] = self.clock
        self.m_used[row] = time.time()
        if self._evictable(row):
            if len(self._heap) > 4 * self.count + 1024:
                # mostly stale entries (a reader touches without ever evicting): rebuild lazily
                self._heap = []
                self._heap_bound = -1
            heapq.heappush(self._heap, self.clock << _ROW_BITS | row)

    def touch_rows(self, rows: Sequence[int] | npt.NDArray[np.int64]) -> None:
        """:meth:`touch` of every row of ``rows`` (live rows, in order): the same ticks (a row
        touched twice keeps its last one), the same ``used`` time for all (one ``time.time()``)
        and a heap candidate per evictable row, so the LRU order is the loop's.  A batch of up
        to ``_TOUCH_LOOP_MAX`` rows in one tight loop over the column views (a read call starts
        with cold CPU caches, where each numpy call costs several microseconds), a larger one
        over the columns."""
        n = len(rows)
        if not n:
            return
        if n <= _TOUCH_LOOP_MAX:
            clock, now = self.clock, time.time()
            tick, used, children, hold, retained = self.m_tick, self.m_used, self.m_children, self.m_hold, \
                self.m_retained
            items = []
            for row in rows.tolist() if isinstance(rows, np.ndarray) else rows:
                clock += 1
                tick[row] = clock
                used[row] = now
                if not (children[row] or hold[row] or retained[row]):
                    items.append(clock << _ROW_BITS | row)
            self.clock = clock
        else:
            arr = np.asarray(rows, dtype=np.int64)
            tick0 = self.clock + 1
            self.clock += n
            ticks = np.arange(tick0, tick0 + n, dtype=np.int64)
            if len(set(arr.tolist())) != n:
                # duplicates: keep the last occurrence of each row (its tick is the one left in place)
                uniq, rev_first = np.unique(arr[::-1], return_index=True)
                arr, ticks = uniq, (n - 1 - rev_first) + tick0
            self.tick[arr] = ticks
            self.used[arr] = time.time()
            busy = self.children.take(arr) | self.hold.take(arr)
            busy |= self.retained.take(arr)
            items = ((ticks << _ROW_BITS) | arr)[busy == 0].tolist()
        if not items:
            return
        if len(self._heap) + len(items) > 4 * self.count + 1024:
            # mostly stale entries (a reader touches without ever evicting): rebuild lazily
            self._heap = []
            self._heap_bound = -1
        push, heap = heapq.heappush, self._heap
        for item in items:
            push(heap, item)

    # -- retained cover --------------------------------------------------------------------------
    def _cover(self, row: int) -> None:
        while row >= 0:
            self.rcover[row] += 1
            if self.rcover[row] != 1:
                return
            self.retained_cost += int(self.cost[row])
            row = int(self.parent[row])

    def _uncover(self, row: int) -> None:
        while row >= 0:
            self.rcover[row] -= 1
            if self.rcover[row] != 0:
                return
            self.retained_cost -= int(self.cost[row])
            row = int(self.parent[row])
