"""The in-process tree index: a budget-bounded, prefix-closed tree of entries over numpy columns.

One implementation for every provider that keeps its index in process memory (pinned, mmap,
tiered, the example template).  It only does bookkeeping: which keys exist, who their parents
are, what each costs, what is leased or retained, and which leaf to evict next.  The provider
owns the bytes and frees them for the rows this index hands back as removed.  Not thread-safe by
itself: callers hold their provider lock.

Why columns and not one object per entry: an engine process keeps millions of pages for hours,
and CPython's full garbage-collection passes walk every tracked object; one ``Node`` per page
made decode steps stall 13x during saves (issue #14), and building a million of them made an
mmap reopen take 1-3 s.  Here an entry is a *row*: an index into numpy columns, found through a
``dict`` of ``bytes -> int`` (neither keys nor values are tracked by the GC) or, for rows bulk
loaded at open (``TreeIndex.load``), a sorted array searched by the key's first 8 bytes.  The LRU
heap holds plain ints (``tick << 32 | row``), not tuples.  Only rare, sparse things (anchors,
in-flight reservations) are Python objects.

Rows are recycled, so a row alone does not name an entry for long: ``gen[row]`` is unique per
seal and a ``(row, gen)`` pair is the durable handle (leases, ``Corrupt`` tokens).  A removed
row keeps its columns until the provider calls :meth:`TreeIndex.recycle` (it may still need them
to free the bytes).

The rules.  A row's ``hold`` counts its own pins: leases, and child reservations in flight under
it.  Pins need not propagate to ancestors, because only leaves are evicted and an ancestor of a
pinned row has a child.  Retained rows (:meth:`retain_rows`) are never evicted for room either,
and so neither are their ancestors; ``rcover`` counts a row's own mark plus its covered children,
so the retained bytes (marked rows and their ancestors, once) are kept exactly in O(new rows).
The satisfiability guard is exact without a global "held bytes" counter: ``make_room`` evicts
least-recently-used evictable leaves *tentatively* and, if even evicting all of them would not
make room, puts every one back and raises ``CapacityError`` — a failed reservation evicts
nothing.  Every operation on a chain is O(1) (amortized O(log n) for the heap), however deep the
chain: an earlier version propagated pins to the root and made saving an 8,192-page chain
quadratic (22 s).
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Container, Iterator, Sequence
from typing import Any, TypedDict

import numpy as np
import numpy.typing as npt

from hostkv_providers._errors import CapacityError, InFlightError, RetainedError, UnknownKeyError
from hostkv_providers._keys import Key

__all__ = ["TreeIndex"]

_ROW_BITS = 32
#: ``TreeIndex.touch_rows`` of at most this many rows runs as one loop over the column views.
_TOUCH_LOOP_MAX = 256
_ROW_MASK = (1 << _ROW_BITS) - 1


def key_u64(key: bytes) -> int:
    """The key's first 8 bytes as an int: the sort key of the bulk-loaded key map."""
    return int.from_bytes(key[:8], "little")


class IndexStats(TypedDict):
    """:meth:`TreeIndex.stats_fields`: keyword arguments of :class:`~hostkv_providers.ProviderStats`."""

    entries: int
    used_bytes: int
    anchors: int
    leased: int
    in_flight: int
    evictions: int
    evicted_bytes: int
    retained: int
    retained_bytes: int

class _Flight:
    # The parent's generation too: if the parent row is dropped (corrupt) and recycled for another
    # entry, commit/cancel must not touch that other entry's pins.  A *chained* flight names a
    # parent that was itself in flight (``pkey``): ``parent`` stays -1 until the parent's commit
    # hands it the parent's row (with a hold); a parent cancelled first leaves it orphaned.
    __slots__ = ("chained", "cost", "parent", "parent_gen", "pkey")

    def __init__(self, parent: int, cost: int, parent_gen: int, pkey: Key | None = None,
                 chained: bool = False) -> None:
        self.parent = parent
        self.cost = cost
        self.parent_gen = parent_gen
        self.pkey = pkey
        self.chained = chained


class _Run:
    """A chain run reserved in one go (:meth:`TreeIndex.begin_run`): ``keys[i]``'s parent is
    ``keys[i - 1]``, ``keys[0]``'s the run's parent.  Every key maps to this one object in
    ``flights``, and its attributes are a ``_Flight``'s *for the run's root*, so the rules that
    look a flight up by key (in flight?, chained children adopted at the parent's commit, the
    in-flight cost summed over ``flights.values()``: ``cost`` is per page) hold unchanged.  One
    object per run instead of one per page: no per-page Python objects on a save's hot path."""

    __slots__ = ("chained", "cost", "keys", "open", "parent", "parent_gen", "pkey")

    def __init__(self, keys: list[Key], parent: int, cost: int, parent_gen: int, pkey: Key | None,
                 chained: bool) -> None:
        self.keys = keys
        self.parent = parent
        self.cost = cost
        self.parent_gen = parent_gen
        self.pkey = pkey
        self.chained = chained
        self.open = True


class _Batch(_Run):
    """A batch of pages reserved in one go (:meth:`TreeIndex.begin_batch`): a forest, not only a
    chain.  ``ppos[i]`` is the position of ``keys[i]``'s parent in the batch (always ``< i``) or
    -1; ``prow[i]``/``pgen[i]`` name a parent that was already sealed (a row held by the batch,
    once per page under it) or -1.  Like a :class:`_Run`, every key maps to this one object in
    ``flights`` with ``cost`` per page; its root attributes (``parent``, ``chained`` ...) are
    those of a flight without a parent, so the rules that look a flight up by key hold
    unchanged.  What ``put_many`` of a file store reserves per chunk: no object per page."""

    __slots__ = ("ninner", "nparents", "pgen", "ppos", "prow")

    def __init__(self, keys: list[Key], cost: int, ppos: npt.NDArray[np.int64], prow: npt.NDArray[np.int64],
                 pgen: npt.NDArray[np.uint64], nparents: int, ninner: int) -> None:
        super().__init__(keys, -1, cost, 0, None, False)
        self.ppos = ppos
        self.prow = prow
        self.pgen = pgen
        self.nparents = nparents  # pages under a sealed parent
        self.ninner = ninner  # pages under a parent in the batch


class TreeIndex:
    """A prefix-closed tree with LRU-leaf eviction, holds, retained entries and an O(1) budget
    guard, over numpy columns (see the module docstring).

    Subclasses add columns of their own by extending ``COLS`` (``(name, dtype, fill)``) and pass
    their values to :meth:`commit` as keyword arguments.
    """

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
            i = int(np.searchsorted(self._base_k64, h))
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
        i = int(np.searchsorted(self._base_k64, h))
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

    def _set_tag(self, row: int, tag: str | bytes) -> None:
        t = tag.decode("utf-8", "replace") if isinstance(tag, bytes) else tag
        tid = self._tag_ids.get(t)
        if tid is None:
            tid = self._tag_ids[t] = len(self.tags)
            self.tags.append(t)
        self.m_tag_id[row] = tid

    def _set_tags(self, rows: npt.NDArray[np.int64] | slice, tag: str | bytes) -> None:
        """:meth:`_set_tag` of many rows at once (a subclass that stores tags differently
        overrides both)."""
        t = tag.decode("utf-8", "replace") if isinstance(tag, bytes) else tag
        tid = self._tag_ids.get(t)
        if tid is None:
            tid = self._tag_ids[t] = len(self.tags)
            self.tags.append(t)
        self.tag_id[rows] = tid

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

    # -- reservations ----------------------------------------------------------------------------
    def begin(self, key: Key, parent: Key | None, cost: int,
              pending_ok: Container[Key] = ()) -> tuple[bool, list[int], int]:
        """Start a reservation: ``(False, [], -1)`` for a sealed key (dedup), else
        ``(True, evicted_rows, parent_row)``; raises ``InFlightError``/``UnknownKeyError``/
        ``CapacityError``.  A parent in ``pending_ok`` that is in flight need not be sealed yet
        (a chained flight, see :meth:`begin_chained`)."""
        if self.row_of(key) >= 0:
            return False, [], -1
        if key in self.flights:
            raise InFlightError(f"key {key.hex()[:16]} is being written by another writer", key=key)
        prow = -1
        if parent is not None:
            prow = self.row_of(parent)
            if prow < 0:
                if parent not in pending_ok or parent not in self.flights:
                    raise UnknownKeyError(f"parent {parent.hex()[:16]} is not stored")
                return self._begin_chained(key, parent, cost)
        evicted = self.make_room(cost, protect=prow)
        self.flights[key] = _Flight(prow, cost, self.m_gen[prow] if prow >= 0 else 0)
        self.used_cost += cost
        if prow >= 0:
            self._hold(prow)
        return True, evicted, prow

    def begin_chained(self, key: Key, parent: Key | None, cost: int) -> tuple[bool, list[int], int]:
        """:meth:`begin`, where ``parent`` may also be any key *in flight* (a chain reserved in
        one go, root first).  Such a flight commits only after its parent did (else
        ``UnknownKeyError``); from the parent's commit on the parent row is held for it."""
        if parent is None or parent not in self.flights or self.row_of(parent) >= 0:
            return self.begin(key, parent, cost)
        if self.row_of(key) >= 0:
            return False, [], -1
        if key in self.flights:
            raise InFlightError(f"key {key.hex()[:16]} is being written by another writer", key=key)
        return self._begin_chained(key, parent, cost)

    def _begin_chained(self, key: Key, parent: Key, cost: int) -> tuple[bool, list[int], int]:
        evicted = self.make_room(cost)  # an in-flight parent is never evicted: nothing to protect
        self.flights[key] = _Flight(-1, cost, 0, parent, chained=True)
        self._waiting.setdefault(parent, []).append(key)
        self.used_cost += cost
        return True, evicted, -1

    def _adopt_children(self, key: Key, row: int) -> None:
        """Chained flights waiting for ``key``: hand them ``row`` (held once per child), or, when
        ``key`` was cancelled (``row < 0``), leave them orphaned (their commit fails)."""
        for child in self._waiting.pop(key, ()):
            cf = self.flights.get(child)
            if cf is not None and cf.chained and cf.parent < 0 and row >= 0:
                cf.parent = row
                cf.parent_gen = int(self.gen[row])
                self._hold(row)

    def _parent_alive(self, flight: _Flight | _Run) -> bool:
        """Whether the flight's parent is still the entry it pinned (alive, same generation)."""
        return self.is_live(flight.parent, flight.parent_gen)

    def commit(self, key: Key, *, nbytes: int, csum: int | None = None, tag: str | bytes = "",
               created: float | None = None, gen: int | None = None, **cols: int) -> int:
        """Turn the in-flight reservation ``key`` into a sealed row (returned); ``cols`` set a
        subclass's columns.  ``UnknownKeyError`` (the flight is gone) when its parent was dropped
        or, for a chained flight, never sealed."""
        if isinstance(self.flights.get(key), _Run):
            self.split_run(self.flights[key])  # type: ignore[arg-type]  # (one page of a run: rare)
        flight = self.flights.pop(key)
        prow = flight.parent
        if flight.chained and prow < 0:
            self.used_cost -= flight.cost
            self._adopt_children(key, -1)
            raise UnknownKeyError(
                f"parent {flight.pkey.hex()[:16] if flight.pkey else '?'} was not sealed before this page",
                hint="seal a chain root first (seal_many does); save the chain again from its first missing page",
            )
        if prow >= 0 and not self._parent_alive(flight):
            self.used_cost -= flight.cost
            self._adopt_children(key, -1)
            raise UnknownKeyError(
                f"parent {flight.pkey.hex()[:16] if flight.pkey else '?'} was dropped before this page's seal "
                "(it failed its checksum, or a tiered store could not write it back to its slow tier)",
                hint="save the chain again from its first missing page",
            )
        # (a recycled row had children, hold, retained and rcover reset by recycle(); a new one is zero)
        row = self._free_rows.pop() if self._free_rows else self._new_row()
        if gen is None:
            gen = self._next_gen
        self._next_gen = max(self._next_gen, gen) + 1
        self.key[row] = key
        self.m_parent[row] = prow
        self.m_nbytes[row] = nbytes
        self.m_cost[row] = flight.cost
        self.m_gen[row] = gen
        if csum is not None:
            self.m_csum[row] = csum
        self.m_has_csum[row] = csum is not None
        self.m_created[row] = time.time() if created is None else float(created)  # touch() sets used
        self._set_tag(row, tag)
        for name, value in cols.items():
            getattr(self, "m_" + name)[row] = value
        self.m_alive[row] = True
        self._dict[key] = row
        self.count += 1
        self.sealed_cost += flight.cost
        if prow >= 0:
            self.m_children[prow] += 1
            self._unhold(prow)
        if self._waiting:
            self._adopt_children(key, row)
        self.touch(row)
        return row

    def _new_row(self) -> int:
        if self.n >= self.cap:
            self._grow(self.cap * 2)
        self.n += 1
        return self.n - 1

    def cancel(self, key: Key) -> None:
        if isinstance(self.flights.get(key), _Run):
            self.split_run(self.flights[key])  # type: ignore[arg-type]
        flight = self.flights.pop(key, None)
        if flight is None:
            return
        self.used_cost -= flight.cost
        if flight.parent >= 0 and self._parent_alive(flight):
            self._unhold(flight.parent)
        if flight.chained and flight.parent < 0 and flight.pkey is not None:
            waiting = self._waiting.get(flight.pkey)
            if waiting is not None and key in waiting:
                waiting.remove(key)
                if not waiting:
                    del self._waiting[flight.pkey]
        if self._waiting:
            self._adopt_children(key, -1)

    # -- chain runs (chunk-level reservations) ---------------------------------------------------
    def begin_run(self, keys: list[Key], parent: Key | None, cost: int) -> tuple[_Run, list[int]] | None:
        """Reserve ``keys`` as one chain run (``keys[i]``'s parent ``keys[i - 1]``, the first's
        ``parent``: ``None``, a sealed key or a key in flight), ``cost`` each, in O(1) Python work
        plus C-speed passes over the keys.  Returns ``(run, evicted_rows)``, or ``None`` — nothing
        changed — when the run is not the plain case (a key sealed or in flight, a repeated key, a
        parent neither sealed nor in flight, or not room for all of it): the caller then reserves
        page by page, which gives each page its exact outcome (dedup, ``InFlightError``, a prefix
        on ``CapacityError``)."""
        n = len(keys)
        fl = self.flights
        if (not n or any(map(fl.__contains__, keys)) or any(map(self.contains_fn, keys))
                or len(set(keys)) != n):
            return None
        prow = -1
        chained = False
        if parent is not None:
            prow = self.row_of(parent)
            if prow < 0:
                if parent not in fl:
                    return None
                chained = True
        try:
            evicted = self.make_room(n * cost, protect=prow)
        except CapacityError:
            return None  # (make_room evicted nothing)
        run = _Run(keys, prow, cost, self.m_gen[prow] if prow >= 0 else 0, parent if chained else None, chained)
        fl.update(zip(keys, itertools.repeat(run)))
        self.used_cost += n * cost
        if chained:
            self._waiting.setdefault(parent, []).append(keys[0])  # type: ignore[arg-type]
        elif prow >= 0:
            self._hold(prow)
        return run, evicted

    def commit_run(self, run: _Run, *, nbytes: int, csums: npt.NDArray[np.uint64] | None = None,
                   tag: str | bytes = "", **cols: Any) -> npt.NDArray[np.int64]:
        """Seal every page of ``run`` at once (columns assigned by slices; one clock read); the
        rows, root first.  All or nothing: ``UnknownKeyError`` — the run cancelled, nothing
        sealed — when its parent was dropped or, for a chained run, not sealed before it."""
        if not run.open:
            raise UnknownKeyError("the run was already sealed or cancelled")
        keys = run.keys
        n = len(keys)
        prow = run.parent
        if (run.chained and prow < 0) or (prow >= 0 and not self.is_live(prow, run.parent_gen)):
            what = (f"parent {run.pkey.hex()[:16] if run.pkey else '?'} was not sealed before this page"
                    if prow < 0 else f"parent {run.pkey.hex()[:16] if run.pkey else '?'} was dropped before "
                    "this page's seal (it failed its checksum, or a tiered store could not write it back)")
            self.cancel_run(run)
            raise UnknownKeyError(what, hint="seal a chain root first (seal_many does); save the chain again "
                                             "from its first missing page")
        run.open = False
        fl = self.flights
        for k in keys:
            del fl[k]
        free = self._free_rows
        take = min(len(free), n)
        reused = free[len(free) - take:]
        del free[len(free) - take:]
        fresh = n - take
        if self.n + fresh > self.cap:
            self._grow(max(self.cap * 2, self.n + fresh))
        rows = np.empty(n, np.int64)
        rows[:take] = reused
        rows[take:] = np.arange(self.n, self.n + fresh)
        self.n += fresh
        gen0 = self._next_gen
        self._next_gen += n
        self.key[rows] = np.frombuffer(b"".join(keys), dtype="V32")
        self.parent[rows[0]] = prow
        self.parent[rows[1:]] = rows[:-1]
        self.nbytes[rows] = nbytes
        self.cost[rows] = run.cost
        self.gen[rows] = np.arange(gen0, gen0 + n, dtype=np.uint64)
        if csums is not None:
            self.csum[rows] = csums
        self.has_csum[rows] = csums is not None
        now = time.time()
        self.created[rows] = now
        self.used[rows] = now
        self.tick[rows] = np.arange(self.clock + 1, self.clock + n + 1)
        self.clock += n
        self._set_tags(rows, tag)
        for name, value in cols.items():
            getattr(self, name)[rows] = value
        self.children[rows[:-1]] = 1  # (recycled rows were reset by recycle(); new rows are zero)
        self.alive[rows] = True
        row_list = rows.tolist()
        self._dict.update(zip(keys, row_list, strict=True))
        self.count += n
        self.sealed_cost += n * run.cost
        if prow >= 0:
            self.m_children[prow] += 1
            self._unhold(prow)
        if self._waiting:
            for k in self._waiting.keys() & set(keys):
                self._adopt_children(k, self._dict[k])
        last = row_list[-1]
        if self._evictable(last):
            heapq.heappush(self._heap, self.m_tick[last] << _ROW_BITS | last)
        return rows

    def cancel_run(self, run: _Run) -> None:
        """Drop an open run's reservations (all of them); chained children of its keys are
        orphaned (their commit fails), as :meth:`cancel` does for one flight."""
        if not run.open:
            return
        run.open = False
        fl = self.flights
        for k in run.keys:
            if fl.get(k) is run:
                del fl[k]
        self.used_cost -= len(run.keys) * run.cost
        if isinstance(run, _Batch):
            for prow, pgen in zip(run.prow.tolist(), run.pgen.tolist(), strict=True):
                if prow >= 0 and self.is_live(prow, pgen):
                    self._unhold(prow)
        if run.parent >= 0 and self.is_live(run.parent, run.parent_gen):
            self._unhold(run.parent)
        if run.chained and run.parent < 0 and run.pkey is not None:
            waiting = self._waiting.get(run.pkey)
            if waiting is not None and run.keys[0] in waiting:
                waiting.remove(run.keys[0])
                if not waiting:
                    del self._waiting[run.pkey]
        if self._waiting:
            for k in self._waiting.keys() & set(run.keys):
                self._adopt_children(k, -1)

    def split_run(self, run: _Run) -> None:
        """Turn an open run into one flight per page (what :meth:`begin_chained` would have made),
        for a caller that seals or aborts its pages one by one; the run's hold on its parent
        passes to its first page's flight."""
        if not run.open:
            return
        run.open = False
        fl = self.flights
        keys = run.keys
        if isinstance(run, _Batch):
            # (each page under a sealed parent holds it already: the hold passes to its flight)
            for i, (j, prow, pgen) in enumerate(zip(run.ppos.tolist(), run.prow.tolist(), run.pgen.tolist(),
                                                    strict=True)):
                if j >= 0:
                    fl[keys[i]] = _Flight(-1, run.cost, 0, keys[j], chained=True)
                    self._waiting.setdefault(keys[j], []).append(keys[i])
                else:
                    fl[keys[i]] = _Flight(prow, run.cost, pgen)
            return
        fl[keys[0]] = _Flight(run.parent, run.cost, run.parent_gen, run.pkey, run.chained)
        for prev, k in itertools.pairwise(keys):
            fl[k] = _Flight(-1, run.cost, 0, prev, chained=True)
            self._waiting.setdefault(prev, []).append(k)

    # -- batches (a chunk of put_many: a forest reserved and sealed as one) -----------------------
    def begin_batch(self, keys: list[Key], parents: list[Key | None], cost: int
                    ) -> tuple[_Batch, list[int]] | None:
        """Reserve ``keys`` (``cost`` each) as one :class:`_Batch`: ``parents[i]`` is ``None``, a
        sealed key, or a key *earlier* in the batch.  C-speed passes over the keys, plus a little
        Python per page whose parent is neither ``None`` nor the page just before it (a chain).
        Returns ``(batch, evicted_rows)``, or ``None`` — nothing changed — when the batch is not
        the plain case (a key sealed, in flight or repeated, a parent neither sealed nor earlier
        in the batch, or not room for all of it): the caller then reserves page by page, which
        gives each page its exact outcome (dedup, ``InFlightError``, ``UnknownKeyError``, a
        prefix on ``CapacityError``).  Room is made for the whole batch at once, taking the
        least-recently-used leaves in the order page-by-page reservations would take them."""
        n = len(keys)
        if not n or len(parents) != n:
            return None
        fl = self.flights
        if (fl and any(map(fl.__contains__, keys))) or any(map(self.contains_fn, keys)) or len(set(keys)) != n:
            return None
        prow = np.full(n, -1, np.int64)
        ext: list[int] = []  # rows of the sealed parents, one per page under one
        ninner = 0
        if parents.count(None) == n:
            ppos = prow.copy()
        elif parents[1:] == keys[:-1]:  # a chain; its root's parent sealed (or none)
            ppos = np.arange(-1, n - 1, dtype=np.int64)
            ninner = n - 1
            if parents[0] is not None:
                r = self.row_of(parents[0])
                if r < 0:
                    return None
                prow[0] = r
                ext.append(r)
        else:
            at = dict(zip(keys, range(n), strict=True)).get
            pp = [-1 if p is None else at(p, -2) for p in parents]
            for i, j in enumerate(pp):
                if j == -2:
                    r = self.row_of(parents[i])  # type: ignore[arg-type]
                    if r < 0:
                        return None  # neither sealed nor in this batch (nor: in flight elsewhere)
                    prow[i] = r
                    ext.append(r)
                    pp[i] = -1
                elif j >= i:
                    return None  # a parent later in the batch
                elif j >= 0:
                    ninner += 1
            ppos = np.asarray(pp, dtype=np.int64)
        pgen = np.zeros(n, np.uint64)
        for r in ext:
            self.m_hold[r] += 1  # first: making room must not evict a parent
        try:
            evicted = self.make_room(n * cost)
        except CapacityError:
            for r in ext:
                self._unhold(r)  # (make_room evicted nothing)
            return None
        if ext:
            sel = prow >= 0
            pgen[sel] = self.gen[prow[sel]]
        batch = _Batch(keys, cost, ppos, prow, pgen, len(ext), ninner)
        fl.update(zip(keys, itertools.repeat(batch)))
        self.used_cost += n * cost
        return batch, evicted

    def commit_batch(self, batch: _Batch, *, nbytes: int, csums: npt.NDArray[np.uint64],
                     tag: str | bytes = "", created: float | None = None,
                     gens: npt.NDArray[np.uint64] | None = None, key_blob: bytes | None = None,
                     **cols: Any) -> npt.NDArray[np.int64] | None:
        """Seal every page of ``batch`` at once (columns assigned by slices; ``key_blob``: the
        keys joined, if the caller has them); the rows, in batch order.  ``None`` when a sealed
        parent of some page was dropped (corrupt) meanwhile: the batch is then split into one
        flight per page (:meth:`split_run`) and the caller commits page by page
        (:meth:`commit`), which fails exactly the pages under the dropped parent.
        ``UnknownKeyError`` when the batch is no longer open."""
        if not batch.open:
            raise UnknownKeyError("the batch was already sealed or cancelled")
        keys = batch.keys
        n = len(keys)
        prow, ppos = batch.prow, batch.ppos
        ext: list[int] = []
        if batch.nparents:
            ext = prow[prow >= 0].tolist()
            for r, g in zip(ext, batch.pgen[prow >= 0].tolist(), strict=True):
                if not self.is_live(r, g):
                    self.split_run(batch)
                    return None
        batch.open = False
        fl = self.flights
        for k in keys:
            del fl[k]
        free = self._free_rows
        take = min(len(free), n)
        fresh = n - take
        if self.n + fresh > self.cap:
            self._grow(max(self.cap * 2, self.n + fresh))
        at: slice | npt.NDArray[np.int64]
        if take:
            rows = np.empty(n, np.int64)
            rows[:take] = free[len(free) - take:]
            del free[len(free) - take:]
            rows[take:] = np.arange(self.n, self.n + fresh)
            at = rows
        else:  # fresh rows: contiguous, assigned by slices
            rows = np.arange(self.n, self.n + n, dtype=np.int64)
            at = slice(self.n, self.n + n)
        self.n += fresh
        nchild: npt.NDArray[np.int64] | None = None
        if not batch.nparents and not batch.ninner:
            self.parent[at] = -1
        else:
            inner = ppos >= 0
            par = prow.copy()
            par[inner] = rows[ppos[inner]]
            self.parent[at] = par
            nchild = np.bincount(ppos[inner], minlength=n)
        self.key[at] = np.frombuffer(key_blob if key_blob is not None else b"".join(keys), dtype="V32")
        self.nbytes[at] = nbytes
        self.cost[at] = batch.cost
        if gens is None:
            gens = np.arange(self._next_gen, self._next_gen + n, dtype=np.uint64)
        self.gen[at] = gens
        self._next_gen = max(self._next_gen, int(gens.max())) + 1
        self.csum[at] = csums
        self.has_csum[at] = True
        now = time.time()
        self.created[at] = now if created is None else created
        self.used[at] = now
        tick0 = self.clock + 1
        self.tick[at] = np.arange(tick0, tick0 + n)
        self.clock += n
        self._set_tags(at, tag)
        for name, value in cols.items():
            getattr(self, name)[at] = value
        if nchild is not None:  # (else 0 already: a new row is zero, a recycled one reset by recycle())
            self.children[at] = nchild
        self.alive[at] = True
        row_list = rows.tolist()
        self._dict.update(zip(keys, row_list, strict=True))
        self.count += n
        self.sealed_cost += n * batch.cost
        for r in ext:
            # one more child under a sealed parent, and its page's hold released (it has a child
            # now: not a leaf, nothing to push)
            self.m_children[r] += 1
            self.m_hold[r] -= 1
        if self._waiting:
            for k in self._waiting.keys() & set(keys):
                self._adopt_children(k, self._dict[k])
        # the new leaves into the LRU heap (a new row is not held nor retained: evictable)
        push, heap = heapq.heappush, self._heap
        if nchild is None:
            for t, row in enumerate(row_list, tick0):
                push(heap, t << _ROW_BITS | row)
        else:
            leaf = nchild == 0
            for t, row in zip((np.flatnonzero(leaf) + tick0).tolist(), rows[leaf].tolist(), strict=True):
                push(heap, t << _ROW_BITS | row)
        return rows

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

    def add_cost(self, row: int, delta: int) -> list[int]:
        """Grow (or shrink) a sealed row's cost, e.g. for anchors; evicts to make room."""
        evicted: list[int] = []
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
