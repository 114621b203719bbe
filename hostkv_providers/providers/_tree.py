"""An in-memory tree index with LRU-leaf eviction, leases and a budget guard.

Shared by the providers that keep their index in process memory (pinned, mmap).  It only does
bookkeeping: which keys exist, who their parents are, what each costs, what is pinned, and which
leaf to evict next.  The provider owns the bytes and frees them for the nodes this index hands
back as evicted.  Not thread-safe by itself: callers hold their provider lock.

A node's ``hold`` counts its own pins: leases, and child reservations in flight under it.  Pins
need not propagate to ancestors, because only leaves are ever evicted and an ancestor of a pinned
node has a child.  The satisfiability guard is exact without any global "held bytes" counter:
``make_room`` evicts least-recently-used unpinned leaves *tentatively* and, if even evicting all
of them would not make room, puts every one back and raises ``CapacityError`` — so a failed
reservation evicts nothing.  Every operation on a chain is O(1) (amortized O(log n) for the LRU
heap), however deep the chain: an earlier version propagated pins to the root and made saving
an 8,192-page chain quadratic (22 s).
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from hostkv_providers._errors import CapacityError, InFlightError, UnknownKeyError
from hostkv_providers._keys import Key

__all__ = ["Node", "TreeIndex"]


class Node:
    """One sealed entry in the index."""

    __slots__ = (
        "anchors",
        "checksum",
        "children",
        "cost",
        "created",
        "dead",
        "hold",
        "key",
        "last_used",
        "loc",
        "nbytes",
        "parent",
        "salt_tag",
        "tick",
    )

    def __init__(
        self,
        key: Key,
        parent: Key | None,
        nbytes: int,
        cost: int,
        salt_tag: str,
        checksum: int | None,
        loc: Any,
        created: float,
    ) -> None:
        self.key = key
        self.parent = parent
        self.nbytes = nbytes
        self.cost = cost
        self.salt_tag = salt_tag
        self.checksum = checksum
        self.loc = loc  # provider-private location of the bytes
        self.created = created
        self.last_used = created
        self.children = 0
        self.hold = 0
        self.tick = 0
        self.dead = False
        self.anchors: dict[str, Any] | None = None  # name -> provider-private anchor record


class _Flight:
    # ``pnode`` is the parent *node* the reservation holds, not just its key: if that node is
    # dropped (checksum failure) and the key sealed again, the new node never received this
    # reservation's hold, so commit/cancel must not release a hold on it.
    # A *chained* flight (``begin_chained``) names a parent that was itself in flight: ``pnode``
    # stays ``None`` until the parent's commit hands it the parent's new node (with a hold).
    __slots__ = ("chained", "cost", "parent", "pnode")

    def __init__(self, parent: Key | None, pnode: Node | None, cost: int, chained: bool = False) -> None:
        self.parent = parent
        self.pnode = pnode
        self.cost = cost
        self.chained = chained


class TreeIndex:
    """Bookkeeping of a budget-bounded, prefix-closed tree of entries."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.nodes: dict[Key, Node] = {}
        self.flights: dict[Key, _Flight] = {}
        self.used = 0  # sealed cost + in-flight cost
        self.sealed_cost = 0
        self.evictions = 0
        self.evicted_cost = 0
        self._tick = 0
        self._heap: list[tuple[int, Key]] = []
        # in-flight parent key -> keys of chained flights waiting for its commit
        self._waiting: dict[Key, list[Key]] = {}

    # -- lookups -----------------------------------------------------------------------------
    def get(self, key: Key) -> Node | None:
        return self.nodes.get(key)

    def __len__(self) -> int:
        return len(self.nodes)

    def __iter__(self) -> Iterator[Node]:
        return iter(list(self.nodes.values()))

    def touch(self, node: Node) -> None:
        self._tick += 1
        node.tick = self._tick
        node.last_used = time.time()
        if node.children == 0 and node.hold == 0:
            self._push(node)

    # -- reservations ------------------------------------------------------------------------
    def begin(self, key: Key, parent: Key | None, cost: int) -> tuple[bool, list[Node]]:
        """Start a reservation.  Returns ``(False, [])`` for a sealed key (dedup), else
        ``(True, evicted_nodes)``; raises ``InFlightError``/``UnknownKeyError``/``CapacityError``."""
        if key in self.nodes:
            return False, []
        if key in self.flights:
            raise InFlightError(f"key {key.hex()[:16]} is being written by another writer", key=key)
        pnode = None
        if parent is not None:
            pnode = self.nodes.get(parent)
            if pnode is None:
                raise UnknownKeyError(f"parent {parent.hex()[:16]} is not stored")
        evicted = self.make_room(cost, protect=pnode)
        self.flights[key] = _Flight(parent, pnode, cost)
        self.used += cost
        if pnode is not None:
            pnode.hold += 1
        return True, evicted

    def begin_chained(self, key: Key, parent: Key | None, cost: int) -> tuple[bool, list[Node]]:
        """:meth:`begin`, where ``parent`` may also be a key *in flight* (a chain reserved in one
        go, root first).  Such a flight commits only after its parent did (else
        ``UnknownKeyError``); until the parent commits nothing of the chain is visible or
        evictable, and from the parent's commit on the parent node is held for it."""
        if parent is None or parent in self.nodes or parent not in self.flights:
            return self.begin(key, parent, cost)
        if key in self.nodes:
            return False, []
        if key in self.flights:
            raise InFlightError(f"key {key.hex()[:16]} is being written by another writer", key=key)
        evicted = self.make_room(cost)
        self.flights[key] = _Flight(parent, None, cost, chained=True)
        self._waiting.setdefault(parent, []).append(key)
        self.used += cost
        return True, evicted

    def _adopt_children(self, key: Key, node: Node | None) -> None:
        """Chained flights waiting for ``key``: hand them ``node`` (held once per child), or, when
        ``key`` was cancelled (``node is None``), leave them orphaned (their commit fails)."""
        for child in self._waiting.pop(key, ()):
            cf = self.flights.get(child)
            if cf is not None and cf.chained and cf.pnode is None and node is not None:
                cf.pnode = node
                node.hold += 1

    def commit(self, key: Key, node: Node) -> None:
        """Turn the in-flight reservation ``key`` into the sealed ``node``."""
        flight = self.flights.pop(key)
        pnode = flight.pnode
        if flight.chained and pnode is None:
            self.used -= flight.cost
            self._adopt_children(key, None)
            raise UnknownKeyError(
                f"parent {flight.parent.hex()[:16] if flight.parent else '?'} was not sealed before this page",
                hint="seal a chain root first (seal_many does)",
            )
        if pnode is not None and pnode.dead:
            self.used -= flight.cost
            self._adopt_children(key, None)
            raise UnknownKeyError(
                f"parent {pnode.key.hex()[:16]} was dropped (corrupt) before the seal",
                hint="save the chain again from its first missing page",
            )
        node.cost = flight.cost
        self.nodes[key] = node
        self.sealed_cost += node.cost
        if pnode is not None:
            pnode.children += 1
            self._release(pnode)
        if self._waiting:
            self._adopt_children(key, node)
        self.touch(node)

    def cancel(self, key: Key) -> None:
        flight = self.flights.pop(key, None)
        if flight is None:
            return
        self.used -= flight.cost
        if flight.pnode is not None and not flight.pnode.dead:
            self._release(flight.pnode)
        if flight.chained and flight.pnode is None and flight.parent is not None:
            waiting = self._waiting.get(flight.parent)
            if waiting is not None and key in waiting:
                waiting.remove(key)
                if not waiting:
                    del self._waiting[flight.parent]
        if self._waiting:
            self._adopt_children(key, None)

    # -- budget ------------------------------------------------------------------------------
    def make_room(self, cost: int, protect: Node | None = None) -> list[Node]:
        """Evict LRU leaves until ``cost`` more fits; raise ``CapacityError`` *without evicting
        anything* if even evicting every evictable entry would not be enough.  ``protect`` (the
        parent of the entry being reserved) is never evicted."""
        if self.used + cost <= self.budget:
            return []
        if cost > self.budget or self.used - self.sealed_cost + cost > self.budget:
            raise CapacityError(
                f"{cost} bytes do not fit: budget {self.budget}, used {self.used} "
                f"of which {self.used - self.sealed_cost} by reservations in flight"
            )
        if protect is not None:
            protect.hold += 1
        try:
            removed = self._evict_lru(self.used + cost - self.budget)
            if self.used + cost > self.budget:
                for node in reversed(removed):  # parents were removed after their children
                    self._reinsert(node)
                raise CapacityError(
                    f"{cost} bytes do not fit: budget {self.budget}, used {self.used}, "
                    f"and only {sum(n.cost for n in removed)} of it is evictable (the rest is leased "
                    "or in flight)"
                )
        finally:
            if protect is not None:
                self._release(protect)
        self.evictions += len(removed)
        self.evicted_cost += sum(n.cost for n in removed)
        return removed

    def _evict_lru(self, need: int) -> list[Node]:
        out: list[Node] = []
        freed = 0
        while freed < need and self._heap:
            tick, key = heapq.heappop(self._heap)
            node = self.nodes.get(key)
            if node is None or node.tick != tick or node.children or node.hold:
                continue  # stale heap entry; a pinned leaf is re-pushed when released
            self._remove(node)
            freed += node.cost
            out.append(node)
        return out

    def _reinsert(self, node: Node) -> None:
        """Undo ``_remove`` (a tentative eviction that turned out not to be enough)."""
        node.dead = False
        self.nodes[node.key] = node
        self.used += node.cost
        self.sealed_cost += node.cost
        if node.parent is not None:
            pnode = self.nodes.get(node.parent)
            if pnode is not None:
                pnode.children += 1
        heapq.heappush(self._heap, (node.tick, node.key))

    def evict_cost(self, need: int) -> list[Node]:
        """Evict least-recently-used unpinned leaves until ``need`` cost is freed (or none left)."""
        out = self._evict_lru(need)
        self.evictions += len(out)
        self.evicted_cost += sum(n.cost for n in out)
        return out

    def add_cost(self, node: Node, delta: int) -> list[Node]:
        """Grow (or shrink) a sealed node's cost, e.g. for anchors; evicts to make room."""
        evicted: list[Node] = []
        if delta > 0:
            evicted = self.make_room(delta, protect=node)
        node.cost += delta
        self.used += delta
        self.sealed_cost += delta
        return evicted

    # -- holds (leases) ----------------------------------------------------------------------
    def hold_keys(self, keys: Sequence[Key]) -> list[Node | None]:
        out: list[Node | None] = []
        for key in keys:
            node = self.nodes.get(key)
            if node is not None:
                node.hold += 1
                self.touch(node)
            out.append(node)
        return out

    def release_nodes(self, nodes: Iterable[Node | None]) -> None:
        for node in nodes:
            if node is not None and not node.dead:
                self._release(node)

    def _release(self, node: Node) -> None:
        node.hold -= 1
        if node.hold == 0 and node.children == 0 and not node.dead:
            self._push(node)

    # -- removal -----------------------------------------------------------------------------
    def _remove(self, node: Node) -> None:
        del self.nodes[node.key]
        node.dead = True
        self.used -= node.cost
        self.sealed_cost -= node.cost
        if node.parent is not None:
            pnode = self.nodes.get(node.parent)
            if pnode is not None:
                pnode.children -= 1
                if pnode.children == 0 and pnode.hold == 0:
                    self._push(pnode)

    def subtree(self, roots: Iterable[Key]) -> list[Node]:
        """Nodes of the subtrees under ``roots`` (present ones), deepest first."""
        wanted = [self.nodes[k] for k in roots if k in self.nodes]
        if not wanted:
            return []
        children: dict[Key, list[Node]] = {}
        if any(n.children for n in wanted):
            for n in self.nodes.values():
                if n.parent is not None:
                    children.setdefault(n.parent, []).append(n)
        order: list[Node] = []
        seen: set[Key] = set()
        stack = list(wanted)
        while stack:
            n = stack.pop()
            if n.key in seen:
                continue
            seen.add(n.key)
            order.append(n)
            stack.extend(children.get(n.key, ()))
        # Deepest first, so every node comes after all of its descendants — also when ``roots``
        # name both a node and one of its descendants (a reversed pre-order would not).
        depth: dict[Key, int] = {}
        for n in order:
            d, cur = 0, n
            while cur.parent is not None and cur.parent in seen and cur.parent not in depth:
                d += 1
                cur = self.nodes[cur.parent]
            depth[n.key] = d + (depth[cur.parent] + 1 if cur.parent is not None and cur.parent in depth else 0)
        order.sort(key=lambda n: depth[n.key], reverse=True)
        return order

    def evict_keys(self, keys: Iterable[Key]) -> tuple[list[Node], int]:
        """Remove ``keys`` with their subtrees, skipping held nodes (and so their ancestors)."""
        removed: list[Node] = []
        skipped = 0
        for node in self.subtree(keys):
            if node.hold or node.children or node.key in self.flights:
                skipped += 1
                continue
            self._remove(node)
            self.evictions += 1
            self.evicted_cost += node.cost
            removed.append(node)
        return removed, skipped

    def drop(self, key: Key) -> list[Node]:
        """Force-remove ``key`` and its subtree (a checksum failure), held or not."""
        removed: list[Node] = []
        for node in self.subtree([key]):
            # leases and flights on a dropped node see ``dead`` and leave it alone
            node.hold = 0
            if node.children:  # children already removed (deepest first); keep counts exact
                node.children = 0
            self._remove(node)
            removed.append(node)
        return removed

    def _push(self, node: Node) -> None:
        heapq.heappush(self._heap, (node.tick, node.key))
        if len(self._heap) > 4 * len(self.nodes) + 1024:
            self._heap = [(n.tick, n.key) for n in self.nodes.values() if n.children == 0 and n.hold == 0]
            heapq.heapify(self._heap)
