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

from hostkv_providers.providers._tree._reserve import _Reservations
from hostkv_providers.providers._tree._rows import IndexStats, key_u64

__all__ = ["IndexStats", "TreeIndex", "key_u64"]


class TreeIndex(_Reservations):
    """A prefix-closed tree with LRU-leaf eviction, holds, retained entries and an O(1) budget
    guard, over numpy columns (see the module docstring).

    Subclasses add columns of their own by extending ``COLS`` (``(name, dtype, fill)``) and pass
    their values to :meth:`commit` as keyword arguments.

    Its parts, by role: ``_columns`` (columns, key map, lookups), ``_removal`` (budget, LRU
    eviction, holds, retained entries, removals), ``_reserve`` (reservations, runs, batches);
    ``_rows`` the in-flight records.
    """
