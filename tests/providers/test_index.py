"""Unit tests of ``TreeIndex``: LRU-leaf eviction, holds, the exact satisfiability guard, drops."""

from __future__ import annotations

import time

import pytest

from hostkv_providers import CapacityError, InFlightError, Key, UnknownKeyError
from hostkv_providers.providers._tree import Node, TreeIndex
from hostkv_providers.testing import chain, key_of


def seal(idx: TreeIndex, key: Key, parent: Key | None = None, cost: int = 10) -> list[Node]:
    ok, evicted = idx.begin(key, parent, cost)
    assert ok
    idx.commit(key, Node(key, parent, cost, 0, "tag", None, None, time.time()))
    return evicted


def keys_of(nodes: list[Node]) -> list[Key]:
    return [n.key for n in nodes]


def check_consistent(idx: TreeIndex) -> None:
    """Recompute every derived counter from the nodes alone."""
    assert idx.sealed_cost == sum(n.cost for n in idx.nodes.values())
    assert idx.used == idx.sealed_cost + sum(f.cost for f in idx.flights.values())
    for n in idx.nodes.values():
        assert n.hold >= 0
        assert n.children == sum(1 for c in idx.nodes.values() if c.parent == n.key)
        assert n.parent is None or n.parent in idx.nodes, "prefix closure"


def test_begin_commit_and_dedup() -> None:
    idx = TreeIndex(100)
    a, b = chain("idx-basic", 2)
    seal(idx, a)
    assert idx.begin(a, None, 10) == (False, [])  # sealed: dedup
    ok, evicted = idx.begin(b, a, 20)
    assert ok and evicted == []
    assert idx.used == 30 and idx.sealed_cost == 10
    assert idx.nodes[a].hold == 1  # an in-flight child pins its parent
    with pytest.raises(InFlightError) as info:
        idx.begin(b, a, 20)
    assert info.value.key == b
    idx.commit(b, Node(b, a, 20, 0, "", None, None, 0.0))
    assert idx.nodes[a].hold == 0 and idx.nodes[a].children == 1
    assert len(idx) == 2 and {n.key for n in idx} == {a, b}
    check_consistent(idx)


def test_unknown_parent_and_cancel() -> None:
    idx = TreeIndex(100)
    a, b = chain("idx-cancel", 2)
    with pytest.raises(UnknownKeyError):
        idx.begin(b, a, 10)
    seal(idx, a)
    idx.begin(b, a, 10)
    idx.cancel(b)
    idx.cancel(b)  # twice: no-op
    assert idx.used == 10 and idx.nodes[a].hold == 0 and not idx.flights
    check_consistent(idx)


def test_lru_leaf_order_and_touch() -> None:
    idx = TreeIndex(1000)
    ks = [key_of(f"idx-lru-{i}") for i in range(5)]
    for k in ks:
        seal(idx, k)
    idx.touch(idx.nodes[ks[0]])
    idx.hold_keys([ks[1]])
    idx.release_nodes([idx.nodes[ks[1]]])  # a lease touches too
    assert keys_of(idx.evict_cost(25)) == [ks[2], ks[3], ks[4]]
    assert keys_of(idx.evict_cost(1)) == [ks[0]]
    assert idx.evictions == 4 and idx.evicted_cost == 40
    check_consistent(idx)


def test_only_leaves_are_evicted() -> None:
    idx = TreeIndex(1000)
    a = chain("idx-leaf", 3)
    for i, k in enumerate(a):
        seal(idx, k, a[i - 1] if i else None)
    late = key_of("idx-leaf-late")
    seal(idx, late)
    idx.touch(idx.nodes[a[0]])  # recent, but not a leaf until its children go
    order = keys_of(idx.evict_cost(1000))
    assert order == [a[2], a[1], late, a[0]]
    check_consistent(idx)


def test_make_room_guard_evicts_nothing_when_unsatisfiable() -> None:
    idx = TreeIndex(100)
    ks = [key_of(f"idx-guard-{i}") for i in range(10)]
    for k in ks:
        seal(idx, k)
    held = idx.hold_keys(ks[:6])
    with pytest.raises(CapacityError):
        idx.make_room(41)  # 60 held: at most 40 can be made free
    assert len(idx) == 10 and idx.evictions == 0
    assert keys_of(idx.make_room(40)) == ks[6:]
    idx.release_nodes(held)
    with pytest.raises(CapacityError):
        idx.make_room(101)
    check_consistent(idx)


def test_guard_counts_the_new_entrys_ancestry() -> None:
    idx = TreeIndex(50)
    a = chain("idx-ancestry", 3)
    for i, k in enumerate(a):
        seal(idx, k, a[i - 1] if i else None)
    other = key_of("idx-ancestry-other")
    seal(idx, other)
    # 40 used; a child of a[2] needs 30: a[0..2] must stay, only `other` (10) is evictable
    with pytest.raises(CapacityError):
        idx.begin(key_of("idx-ancestry-child"), a[2], 30)
    assert len(idx) == 4
    ok, evicted = idx.begin(key_of("idx-ancestry-child"), a[2], 20)
    assert ok and keys_of(evicted) == [other]
    check_consistent(idx)


def test_holds_pin_a_node_and_so_its_ancestors() -> None:
    idx = TreeIndex(1000)
    a = chain("idx-hold", 4)
    for i, k in enumerate(a):
        seal(idx, k, a[i - 1] if i else None, cost=10 * (i + 1))
    held = idx.hold_keys([a[2], a[2], key_of("idx-hold-missing")])
    assert held[2] is None
    # pins are direct: ancestors stay safe because only leaves are evicted
    assert [idx.nodes[k].hold for k in a] == [0, 0, 2, 0]
    assert keys_of(idx.evict_cost(1000)) == [a[3]]
    with pytest.raises(CapacityError):  # 60 pinned of 1000: 941 more cannot fit
        idx.make_room(941)
    assert set(idx.nodes) == set(a[:3])  # the refused request evicted nothing
    idx.release_nodes(held)
    assert keys_of(idx.evict_cost(1000)) == [a[2], a[1], a[0]]
    check_consistent(idx)


def test_long_chain_operations_stay_cheap() -> None:
    # Pins used to propagate to the root: saving an n-page chain cost O(n^2) (22 s for 8,192).
    idx = TreeIndex(1 << 40)
    ks = chain("idx-long", 20_000)
    parent = None
    for k in ks:
        idx.begin(k, parent, 1)
        idx.commit(k, Node(k, parent, 1, 0, "", None, None, 0.0))
        parent = k
    held = idx.hold_keys(ks)
    assert all(idx.nodes[k].hold == 1 for k in ks)
    idx.release_nodes(held)
    idx.budget = 10
    assert len(idx.make_room(0)) == 20_000 - 10


def test_evict_keys_subtree_and_skips() -> None:
    idx = TreeIndex(1000)
    a = chain("idx-ek", 4)
    for i, k in enumerate(a):
        seal(idx, k, a[i - 1] if i else None)
    side = key_of("idx-ek-side")
    seal(idx, side, a[1])
    held = idx.hold_keys([a[2]])
    removed, skipped = idx.evict_keys([a[0]])
    assert set(keys_of(removed)) == {a[3], side}
    assert skipped == 3  # a[2] leased, a[1] and a[0] its ancestors
    idx.release_nodes(held)
    removed, skipped = idx.evict_keys([a[2], a[0], a[1]])  # roots that include their own descendants
    assert keys_of(removed) == [a[2], a[1], a[0]] and skipped == 0
    assert len(idx) == 0
    check_consistent(idx)


def test_evict_keys_keeps_parents_of_in_flight() -> None:
    idx = TreeIndex(1000)
    a, b = chain("idx-ekf", 2)
    seal(idx, a)
    idx.begin(b, a, 10)
    removed, skipped = idx.evict_keys([a])
    assert removed == [] and skipped == 1
    check_consistent(idx)


def test_subtree_deepest_first() -> None:
    idx = TreeIndex(1000)
    a = chain("idx-sub", 4)
    for i, k in enumerate(a):
        seal(idx, k, a[i - 1] if i else None)
    b = key_of("idx-sub-b")
    seal(idx, b, a[0])
    order = keys_of(idx.subtree([a[2], a[0]]))
    pos = {k: i for i, k in enumerate(order)}
    assert set(order) == {*a, b}
    for k in (*a[1:], b):
        parent = idx.nodes[k].parent
        assert parent is not None and pos[k] < pos[parent]
    assert idx.subtree([key_of("idx-sub-missing")]) == []


def test_drop_held_subtree_keeps_counts() -> None:
    idx = TreeIndex(1000)
    a = chain("idx-drop", 4)
    for i, k in enumerate(a):
        seal(idx, k, a[i - 1] if i else None)
    lease1 = idx.hold_keys([a[3]])
    lease2 = idx.hold_keys([a[1]])
    idx.begin(key_of("idx-drop-flight"), a[2], 10)
    dropped = idx.drop(a[1])
    assert set(keys_of(dropped)) == set(a[1:])
    assert all(n.dead for n in dropped)
    assert idx.nodes[a[0]].hold == 0
    idx.release_nodes(lease1)  # dead nodes: no-op
    idx.release_nodes(lease2)
    with pytest.raises(UnknownKeyError):  # the flight's parent is gone
        idx.commit(key_of("idx-drop-flight"), Node(key_of("idx-drop-flight"), a[2], 10, 0, "", None, None, 0.0))
    assert idx.used == 10 and not idx.flights
    assert keys_of(idx.evict_cost(1000)) == [a[0]]
    check_consistent(idx)


def test_flight_under_dropped_then_resealed_parent() -> None:
    # Regression: the reservation must release the hold on the node it pinned, not on a new node
    # sealed later under the same key (that left a negative hold, so leases stopped pinning).
    for finish in ("cancel", "commit"):
        idx = TreeIndex(1000)
        p, c = chain(f"idx-reseal-{finish}", 2)
        seal(idx, p)
        idx.begin(c, p, 10)
        idx.drop(p)
        seal(idx, p)
        if finish == "cancel":
            idx.cancel(c)
        else:
            with pytest.raises(UnknownKeyError):
                idx.commit(c, Node(c, p, 10, 0, "", None, None, 0.0))
        assert idx.nodes[p].hold == 0
        held = idx.hold_keys([p])
        assert idx.evict_cost(1000) == []  # the lease pins it
        idx.release_nodes(held)
        assert keys_of(idx.evict_cost(1000)) == [p]
        check_consistent(idx)


def test_add_cost_grows_and_evicts_others_only() -> None:
    idx = TreeIndex(50)
    ks = [key_of(f"idx-cost-{i}") for i in range(4)]
    for k in ks:
        seal(idx, k)
    idx.touch(idx.nodes[ks[0]])
    evicted = idx.add_cost(idx.nodes[ks[1]], 25)  # needs 15 more: evicts the two LRU others
    assert keys_of(evicted) == [ks[2], ks[3]]
    assert idx.nodes[ks[1]].cost == 35 and idx.used == 45
    with pytest.raises(CapacityError):
        idx.add_cost(idx.nodes[ks[1]], 20)  # only ks[0] (10) is evictable: 45 + 20 - 10 > 50
    assert len(idx) == 2 and idx.used == 45
    idx.add_cost(idx.nodes[ks[1]], -30)
    assert idx.used == 15
    held = idx.hold_keys([ks[1]])
    idx.add_cost(idx.nodes[ks[1]], 5)  # a held node may grow; it is never its own victim
    assert idx.nodes[ks[1]].cost == 10 and ks[1] in idx.nodes
    idx.release_nodes(held)
    check_consistent(idx)


def test_heap_stays_bounded_under_touches() -> None:
    idx = TreeIndex(10_000)
    ks = [key_of(f"idx-heap-{i}") for i in range(10)]
    for k in ks:
        seal(idx, k)
    for i in range(20_000):
        idx.touch(idx.nodes[ks[i % 10]])
    assert len(idx._heap) <= 4 * len(idx.nodes) + 1025
    assert keys_of(idx.evict_cost(10)) == [ks[0]]  # after 20,000 touches ks[0] is the oldest again


def test_budget_zero_until_chunks_arrive() -> None:
    idx = TreeIndex(0)
    with pytest.raises(CapacityError):
        idx.begin(key_of("idx-zero"), None, 1)
    idx.budget = 10
    assert idx.begin(key_of("idx-zero"), None, 10)[0]
