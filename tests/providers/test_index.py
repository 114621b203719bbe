"""Unit tests of ``TreeIndex``: LRU-leaf eviction, holds, the exact satisfiability guard, drops,
retained entries, and that the index keeps no per-entry objects the garbage collector tracks."""

from __future__ import annotations

import gc
from typing import Any

import numpy as np
import pytest

from hostkv_providers import CapacityError, InFlightError, Key, UnknownKeyError
from hostkv_providers.errors import RetainedError
from hostkv_providers.providers import TreeIndex
from hostkv_providers.testing import chain, key_of

Token = tuple[list[int], list[int]]


def seal(idx: TreeIndex, key: Key, parent: Key | None = None, cost: int = 10) -> list[int]:
    ok, evicted, _ = idx.begin(key, parent, cost)
    assert ok
    idx.commit(key, nbytes=cost, tag="tag")
    return evicted


def commit(idx: TreeIndex, key: Key, nbytes: int = 10) -> int:
    return idx.commit(key, nbytes=nbytes)


def keys_of(idx: TreeIndex, rows: list[int]) -> list[Key]:
    return [idx.key_of(r) for r in rows]


def row(idx: TreeIndex, key: Key) -> int:
    r = idx.row_of(key)
    assert r >= 0
    return r


def hold(idx: TreeIndex, keys: list[Key]) -> Token:
    rows = [r for r in idx.rows_of(keys) if r >= 0]
    idx.hold_rows(rows)
    return rows, [int(idx.gen[r]) for r in rows]


def release(idx: TreeIndex, token: Token) -> None:
    idx.release_rows(*token)


def live_keys(idx: TreeIndex) -> set[Key]:
    return set(idx.keys())


def check_consistent(idx: TreeIndex) -> None:
    """Recompute every derived counter from the columns alone."""
    rows = [int(r) for r in idx.live_rows()]
    assert idx.count == len(rows)
    assert idx.sealed_cost == sum(int(idx.cost[r]) for r in rows)
    assert idx.used_cost == idx.sealed_cost + sum(f.cost for f in idx.flights.values())
    live = set(rows)
    covered: set[int] = set()
    for r in rows:
        assert idx.hold[r] >= 0
        assert idx.children[r] == sum(1 for c in rows if idx.parent[c] == r)
        p = int(idx.parent[r])
        assert p < 0 or p in live, "prefix closure"
        if idx.retained[r]:
            cur = r
            while cur >= 0:
                covered.add(cur)
                cur = int(idx.parent[cur])
    assert idx.retained_count == sum(1 for r in rows if idx.retained[r])
    assert idx.retained_cost == sum(int(idx.cost[r]) for r in covered)
    assert {r for r in rows if idx.rcover[r] > 0} == covered


def test_begin_commit_and_dedup() -> None:
    idx = TreeIndex(100)
    a, b = chain("idx-basic", 2)
    seal(idx, a)
    assert idx.begin(a, None, 10) == (False, [], -1)  # sealed: dedup
    ok, evicted, prow = idx.begin(b, a, 20)
    assert ok and evicted == [] and prow == row(idx, a)
    assert idx.used_cost == 30 and idx.sealed_cost == 10
    assert idx.hold[row(idx, a)] == 1  # an in-flight child pins its parent
    with pytest.raises(InFlightError) as info:
        idx.begin(b, a, 20)
    assert info.value.key == b
    commit(idx, b, 20)
    assert idx.hold[row(idx, a)] == 0 and idx.children[row(idx, a)] == 1
    assert len(idx) == 2 and live_keys(idx) == {a, b}
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
    assert idx.used_cost == 10 and idx.hold[row(idx, a)] == 0 and not idx.flights
    check_consistent(idx)


def test_lru_leaf_order_and_touch() -> None:
    idx = TreeIndex(1000)
    ks = [key_of(f"idx-lru-{i}") for i in range(5)]
    for k in ks:
        seal(idx, k)
    idx.touch(row(idx, ks[0]))
    release(idx, hold(idx, [ks[1]]))  # a lease touches too
    assert keys_of(idx, idx.evict_cost(25)) == [ks[2], ks[3], ks[4]]
    assert keys_of(idx, idx.evict_cost(1)) == [ks[0]]
    assert idx.evictions == 4 and idx.evicted_cost == 40
    check_consistent(idx)


def test_only_leaves_are_evicted() -> None:
    idx = TreeIndex(1000)
    a = chain("idx-leaf", 3)
    for i, k in enumerate(a):
        seal(idx, k, a[i - 1] if i else None)
    late = key_of("idx-leaf-late")
    seal(idx, late)
    idx.touch(row(idx, a[0]))  # recent, but not a leaf until its children go
    order = keys_of(idx, idx.evict_cost(1000))
    assert order == [a[2], a[1], late, a[0]]
    check_consistent(idx)


def test_make_room_guard_evicts_nothing_when_unsatisfiable() -> None:
    idx = TreeIndex(100)
    ks = [key_of(f"idx-guard-{i}") for i in range(10)]
    for k in ks:
        seal(idx, k)
    held = hold(idx, ks[:6])
    with pytest.raises(CapacityError):
        idx.make_room(41)  # 60 held: at most 40 can be made free
    assert len(idx) == 10 and idx.evictions == 0
    assert keys_of(idx, idx.make_room(40)) == ks[6:]
    release(idx, held)
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
    ok, evicted, _ = idx.begin(key_of("idx-ancestry-child"), a[2], 20)
    assert ok and keys_of(idx, evicted) == [other]
    check_consistent(idx)


def test_holds_pin_a_node_and_so_its_ancestors() -> None:
    idx = TreeIndex(1000)
    a = chain("idx-hold", 4)
    for i, k in enumerate(a):
        seal(idx, k, a[i - 1] if i else None, cost=10 * (i + 1))
    held = hold(idx, [a[2], a[2], key_of("idx-hold-missing")])
    assert len(held[0]) == 2  # the missing key holds nothing
    # pins are direct: ancestors stay safe because only leaves are evicted
    assert [int(idx.hold[row(idx, k)]) for k in a] == [0, 0, 2, 0]
    assert keys_of(idx, idx.evict_cost(1000)) == [a[3]]
    with pytest.raises(CapacityError):  # 60 pinned of 1000: 941 more cannot fit
        idx.make_room(941)
    assert live_keys(idx) == set(a[:3])  # the refused request evicted nothing
    release(idx, held)
    assert keys_of(idx, idx.evict_cost(1000)) == [a[2], a[1], a[0]]
    check_consistent(idx)


def test_long_chain_operations_stay_cheap() -> None:
    # Pins used to propagate to the root: saving an n-page chain cost O(n^2) (22 s for 8,192).
    idx = TreeIndex(1 << 40)
    ks = chain("idx-long", 20_000)
    parent = None
    for k in ks:
        idx.begin(k, parent, 1)
        commit(idx, k, 1)
        parent = k
    held = hold(idx, ks)
    assert all(idx.hold[r] == 1 for r in idx.rows_of(ks))
    release(idx, held)
    idx.budget = 10
    assert len(idx.make_room(0)) == 20_000 - 10


def test_evict_keys_subtree_and_skips() -> None:
    idx = TreeIndex(1000)
    a = chain("idx-ek", 4)
    for i, k in enumerate(a):
        seal(idx, k, a[i - 1] if i else None)
    side = key_of("idx-ek-side")
    seal(idx, side, a[1])
    held = hold(idx, [a[2]])
    removed, skipped = idx.evict_rows(idx.rows_of([a[0]]))
    assert set(keys_of(idx, removed)) == {a[3], side}
    assert skipped == 3  # a[2] leased, a[1] and a[0] its ancestors
    release(idx, held)
    removed, skipped = idx.evict_rows(idx.rows_of([a[2], a[0], a[1]]))  # roots that include their own descendants
    assert keys_of(idx, removed) == [a[2], a[1], a[0]] and skipped == 0
    assert len(idx) == 0
    check_consistent(idx)


def test_evict_keys_keeps_parents_of_in_flight() -> None:
    idx = TreeIndex(1000)
    a, b = chain("idx-ekf", 2)
    seal(idx, a)
    idx.begin(b, a, 10)
    removed, skipped = idx.evict_rows(idx.rows_of([a]))
    assert removed == [] and skipped == 1
    check_consistent(idx)


def test_subtree_deepest_first() -> None:
    idx = TreeIndex(1000)
    a = chain("idx-sub", 4)
    for i, k in enumerate(a):
        seal(idx, k, a[i - 1] if i else None)
    b = key_of("idx-sub-b")
    seal(idx, b, a[0])
    order = keys_of(idx, idx.subtree(idx.rows_of([a[2], a[0]])))
    pos = {k: i for i, k in enumerate(order)}
    assert set(order) == {*a, b}
    for k in (*a[1:], b):
        parent = idx.parent_key(row(idx, k))
        assert parent is not None and pos[k] < pos[parent]
    assert idx.subtree(idx.rows_of([key_of("idx-sub-missing")])) == []


def test_drop_held_subtree_keeps_counts() -> None:
    idx = TreeIndex(1000)
    a = chain("idx-drop", 4)
    for i, k in enumerate(a):
        seal(idx, k, a[i - 1] if i else None)
    lease1 = hold(idx, [a[3]])
    lease2 = hold(idx, [a[1]])
    idx.begin(key_of("idx-drop-flight"), a[2], 10)
    dropped = idx.drop(row(idx, a[1]))
    assert set(keys_of(idx, dropped)) == set(a[1:])
    assert not any(idx.alive[r] for r in dropped)
    assert idx.hold[row(idx, a[0])] == 0
    release(idx, lease1)  # dead rows: no-op
    release(idx, lease2)
    with pytest.raises(UnknownKeyError):  # the flight's parent is gone
        commit(idx, key_of("idx-drop-flight"))
    assert idx.used_cost == 10 and not idx.flights
    assert keys_of(idx, idx.evict_cost(1000)) == [a[0]]
    check_consistent(idx)


def test_flight_under_dropped_then_resealed_parent() -> None:
    # Regression: the reservation must release the hold on the node it pinned, not on a new node
    # sealed later under the same key (that left a negative hold, so leases stopped pinning).
    for finish in ("cancel", "commit"):
        idx = TreeIndex(1000)
        p, c = chain(f"idx-reseal-{finish}", 2)
        seal(idx, p)
        idx.begin(c, p, 10)
        idx.recycle(idx.drop(row(idx, p)))  # the row is reused by the next seal
        seal(idx, p)
        if finish == "cancel":
            idx.cancel(c)
        else:
            with pytest.raises(UnknownKeyError):
                commit(idx, c)
        assert idx.hold[row(idx, p)] == 0
        held = hold(idx, [p])
        assert idx.evict_cost(1000) == []  # the lease pins it
        release(idx, held)
        assert keys_of(idx, idx.evict_cost(1000)) == [p]
        check_consistent(idx)


def test_add_cost_grows_and_evicts_others_only() -> None:
    idx = TreeIndex(50)
    ks = [key_of(f"idx-cost-{i}") for i in range(4)]
    for k in ks:
        seal(idx, k)
    idx.touch(row(idx, ks[0]))
    evicted = idx.add_cost(row(idx, ks[1]), 25)  # needs 15 more: evicts the two LRU others
    assert keys_of(idx, evicted) == [ks[2], ks[3]]
    assert idx.cost[row(idx, ks[1])] == 35 and idx.used_cost == 45
    with pytest.raises(CapacityError):
        idx.add_cost(row(idx, ks[1]), 20)  # only ks[0] (10) is evictable: 45 + 20 - 10 > 50
    assert len(idx) == 2 and idx.used_cost == 45
    idx.add_cost(row(idx, ks[1]), -30)
    assert idx.used_cost == 15
    held = hold(idx, [ks[1]])
    idx.add_cost(row(idx, ks[1]), 5)  # a held row may grow; it is never its own victim
    assert idx.cost[row(idx, ks[1])] == 10 and idx.contains(ks[1])
    release(idx, held)
    check_consistent(idx)


def test_heap_stays_bounded_under_touches() -> None:
    idx = TreeIndex(10_000)
    ks = [key_of(f"idx-heap-{i}") for i in range(10)]
    for k in ks:
        seal(idx, k)
    for i in range(20_000):
        idx.touch(row(idx, ks[i % 10]))
    assert len(idx._heap) <= 4 * len(idx) + 1025
    assert keys_of(idx, idx.evict_cost(10)) == [ks[0]]  # after 20,000 touches ks[0] is the oldest again


def test_budget_zero_until_chunks_arrive() -> None:
    idx = TreeIndex(0)
    with pytest.raises(CapacityError):
        idx.begin(key_of("idx-zero"), None, 1)
    idx.budget = 10
    assert idx.begin(key_of("idx-zero"), None, 10)[0]


def test_chained_flight_commits_after_its_parent_only() -> None:
    idx = TreeIndex(1000)
    a, b, c = chain("idx-chained", 3)
    assert idx.begin_chained(a, None, 10)[0]
    assert idx.begin_chained(b, a, 10)[0]  # the parent is in flight
    assert idx.begin_chained(c, b, 10)[0]
    commit(idx, a)
    assert idx.hold[row(idx, a)] == 1  # handed to b's flight at a's commit
    idx.cancel(b)  # c is orphaned: its commit fails, nothing of it is visible
    with pytest.raises(UnknownKeyError):
        commit(idx, c)
    assert live_keys(idx) == {a} and not idx.flights and idx.used_cost == 10
    assert idx.hold[row(idx, a)] == 0
    check_consistent(idx)


def test_retained_rows_and_their_ancestors_are_never_evicted_for_room() -> None:
    idx = TreeIndex(100)
    a = chain("idx-retain", 3)
    for i, k in enumerate(a):
        seal(idx, k, a[i - 1] if i else None)
    side = key_of("idx-retain-side")
    seal(idx, side, a[0])
    other = key_of("idx-retain-other")
    seal(idx, other)
    assert idx.retain_rows(idx.rows_of([a[1]]), 50) == 1
    assert idx.retain_rows(idx.rows_of([a[1]]), 50) == 0  # already marked: counts 0
    assert idx.retained_count == 1 and idx.retained_cost == 20  # a[1] and its ancestor a[0]
    check_consistent(idx)
    # evicting everything evictable leaves the retained prefix a[0], a[1]
    assert set(keys_of(idx, idx.evict_cost(1000))) == {a[2], side, other}
    assert live_keys(idx) == {a[0], a[1]}
    with pytest.raises(CapacityError):  # 20 retained of 100: 81 more cannot fit
        idx.make_room(81)
    assert live_keys(idx) == {a[0], a[1]}
    # an explicit eviction of the prefix or its root refuses, evicting nothing
    for target in (a[0], a[1]):
        with pytest.raises(RetainedError):
            idx.evict_rows(idx.rows_of([target]))
    assert live_keys(idx) == {a[0], a[1]}
    assert idx.unretain_rows(idx.rows_of([a[1], a[1], key_of("idx-retain-missing")])) == 1
    assert idx.retained_cost == 0
    assert keys_of(idx, idx.evict_cost(1000)) == [a[1], a[0]]
    check_consistent(idx)


def test_retain_share_is_all_or_nothing() -> None:
    idx = TreeIndex(100)
    a = chain("idx-share", 4)
    for i, k in enumerate(a):
        seal(idx, k, a[i - 1] if i else None)
    b = key_of("idx-share-b")
    seal(idx, b)
    assert idx.retain_cost(idx.rows_of([a[3], a[1]])) == 40  # ancestors counted once
    with pytest.raises(CapacityError) as info:
        idx.retain_rows(idx.rows_of([b, a[3]]), 45)  # 10 + 40 > 45
    assert "retain_share" in info.value.hint
    assert idx.retained_count == 0 and idx.retained_cost == 0 and not idx.retained.any()
    idx.retain_rows(idx.rows_of([a[1]]), 45)
    idx.retain_rows(idx.rows_of([a[3]]), 45)  # adds a[2], a[3] only
    assert idx.retained_cost == 40
    check_consistent(idx)


def test_a_drop_removes_retained_rows_and_keeps_the_cover_exact() -> None:
    idx = TreeIndex(1000)
    a = chain("idx-retain-drop", 4)
    for i, k in enumerate(a):
        seal(idx, k, a[i - 1] if i else None)
    idx.retain_rows(idx.rows_of([a[3]]), 1000)
    idx.add_cost(row(idx, a[1]), 5)  # an anchor on a covered row counts as retained
    assert idx.retained_cost == 45
    dropped = idx.drop(row(idx, a[2]))  # corruption: retained or not, the subtree goes
    assert set(keys_of(idx, dropped)) == {a[2], a[3]}
    assert idx.retained_count == 0 and idx.retained_cost == 0
    check_consistent(idx)


def test_the_index_keeps_no_per_entry_objects_the_gc_tracks() -> None:
    # Issue #14: full collections walking millions of per-page objects stalled decode steps.
    idx = TreeIndex(1 << 40)
    ks = chain("idx-gc", 20_000)
    gc.collect()
    before = len(gc.get_objects())
    parent = None
    for k in ks:
        idx.begin(k, parent, 4096)
        commit(idx, k, 4096)
        parent = k
    held = hold(idx, ks[-100:])
    release(idx, held)
    idx.retain_rows(idx.rows_of(ks[:10]), 1 << 40)
    gc.collect()
    grown = len(gc.get_objects()) - before
    del held
    assert len(idx) == 20_000
    assert grown < 100, f"{grown} new GC-tracked objects for 20,000 entries"


# -- chain runs: one flight for a run of pages, sealed by slices ----------------------------------
def test_begin_run_declines_all_but_the_plain_case_and_changes_nothing() -> None:
    idx = TreeIndex(budget=1000)
    stored = chain("run-stored", 2)
    seal(idx, stored[0])
    used, flights = idx.used_cost, dict(idx.flights)
    keys = chain("run-decline", 3)
    assert idx.begin_run([stored[0], *keys], None, 10) is None  # a key already sealed
    assert idx.begin_run([keys[0], keys[1], keys[0]], None, 10) is None  # a repeated key
    assert idx.begin_run(keys, chain("nowhere", 1)[0], 10) is None  # a parent neither sealed nor in flight
    assert idx.begin_run(keys, None, 400) is None  # 1,200 does not fit in 1,000: the per-page path gives a prefix
    ok, _, _ = idx.begin(keys[1], None, 10)
    assert ok
    assert idx.begin_run(keys, None, 10) is None  # a key in flight at another writer
    idx.cancel(keys[1])
    assert idx.used_cost == used and idx.flights == flights


def test_commit_run_seals_a_chain_that_evicts_leaf_first() -> None:
    idx = TreeIndex(budget=100)
    root = chain("run-root", 1)[0]
    seal(idx, root)
    keys = chain("run-chain", 4)
    begun = idx.begin_run(keys, root, 10)
    assert begun is not None
    run, evicted = begun
    assert evicted == [] and all(k in idx.flights for k in keys) and idx.row_of(keys[0]) < 0
    assert idx.used_cost == 50 and idx.sealed_cost == 10
    rows = idx.commit_run(run, nbytes=8, tag="t", csums=np.arange(4, dtype=np.uint64))
    assert not idx.flights and len(idx) == 5 and idx.sealed_cost == 50
    assert [idx.parent_key(int(r)) for r in rows] == [root, *keys[:-1]]
    assert [idx.checksum_of(int(r)) for r in rows] == [0, 1, 2, 3]
    assert idx.tag_of(int(rows[0])) == "t" and int(idx.nbytes[rows[2]]) == 8
    assert len({int(idx.gen[r]) for r in rows}) == 4
    # only leaves go, the deepest first, and the root last
    assert keys_of(idx, idx.evict_cost(10)) == [keys[3]]
    assert keys_of(idx, idx.evict_cost(30)) == [keys[2], keys[1], keys[0]]
    assert keys_of(idx, idx.evict_cost(10)) == [root]


def test_chained_runs_commit_root_first_only() -> None:
    idx = TreeIndex(budget=1000)
    keys = chain("run-chained", 6)
    first = idx.begin_run(keys[:3], None, 10)
    second = idx.begin_run(keys[3:], keys[2], 10)  # its parent is still in flight
    assert first is not None and second is not None
    with pytest.raises(UnknownKeyError):
        idx.commit_run(second[0], nbytes=10)  # before its parent: cancelled, nothing sealed
    assert idx.used_cost == 30 and not any(k in idx.flights for k in keys[3:])
    again = idx.begin_run(keys[3:], keys[2], 10)
    assert again is not None
    idx.commit_run(first[0], nbytes=10)
    last_of_first = row(idx, keys[2])
    assert int(idx.hold[last_of_first]) == 1  # held for the child run in flight under it
    idx.commit_run(again[0], nbytes=10)
    assert int(idx.hold[last_of_first]) == 0 and idx.parent_key(row(idx, keys[3])) == keys[2]
    assert len(idx) == 6 and idx.used_cost == idx.sealed_cost == 60


def test_cancel_run_orphans_runs_and_flights_under_it() -> None:
    idx = TreeIndex(budget=1000)
    keys = chain("run-cancel", 4)
    first = idx.begin_run(keys[:2], None, 10)
    assert first is not None
    other = chain("run-cancel-other", 1)[0]
    ok, _, _ = idx.begin_chained(other, keys[0], 10)  # another writer's page under the run's root
    assert ok
    second = idx.begin_run(keys[2:], keys[1], 10)
    assert second is not None
    idx.cancel_run(first[0])
    idx.cancel_run(first[0])  # idempotent
    with pytest.raises(UnknownKeyError):
        idx.commit(other, nbytes=10)
    with pytest.raises(UnknownKeyError):
        idx.commit_run(second[0], nbytes=10)
    assert not idx.flights and idx.used_cost == 0 and len(idx) == 0


def test_commit_run_hands_rows_to_flights_waiting_under_its_pages() -> None:
    idx = TreeIndex(budget=1000)
    keys = chain("run-waiters", 3)
    run, _ = idx.begin_run(keys, None, 10) or (None, None)
    assert run is not None
    fork = chain("run-waiters-fork", 1)[0]
    ok, _, _ = idx.begin_chained(fork, keys[1], 10)  # a fork from the run's middle page
    assert ok
    idx.commit_run(run, nbytes=10)
    assert int(idx.hold[row(idx, keys[1])]) == 1
    idx.commit(fork, nbytes=10)
    assert idx.parent_key(row(idx, fork)) == keys[1] and int(idx.children[row(idx, keys[1])]) == 2


def test_a_run_split_into_flights_commits_page_by_page() -> None:
    idx = TreeIndex(budget=1000)
    root = chain("run-split-root", 1)[0]
    seal(idx, root)
    keys = chain("run-split", 3)
    run, _ = idx.begin_run(keys, root, 10) or (None, None)
    assert run is not None
    commit(idx, keys[0])  # one page of a run: the run becomes flights (rare path)
    assert keys[1] in idx.flights and not isinstance(idx.flights[keys[1]], type(run))
    with pytest.raises(UnknownKeyError):
        idx.commit_run(run, nbytes=10)  # the run itself is inert now
    commit(idx, keys[1])
    idx.cancel(keys[2])
    assert [idx.row_of(k) >= 0 for k in keys] == [True, True, False]
    assert idx.used_cost == idx.sealed_cost == 30 and int(idx.hold[row(idx, root)]) == 0


def test_commit_run_fails_when_its_parent_was_dropped() -> None:
    idx = TreeIndex(budget=1000)
    root = chain("run-dropped-root", 1)[0]
    seal(idx, root)
    keys = chain("run-dropped", 2)
    run, _ = idx.begin_run(keys, root, 10) or (None, None)
    assert run is not None
    idx.drop(row(idx, root))
    with pytest.raises(UnknownKeyError):
        idx.commit_run(run, nbytes=10)
    assert not idx.flights and idx.used_cost == 0


def test_a_run_keeps_no_per_page_objects_the_gc_tracks() -> None:
    idx = TreeIndex(budget=1 << 40)
    keys = chain("run-gc", 20_000)
    gc.collect()
    before = len(gc.get_objects())
    prev = None
    for lo in range(0, len(keys), 256):
        part = keys[lo : lo + 256]
        begun = idx.begin_run(part, prev, 10)
        assert begun is not None
        idx.commit_run(begun[0], nbytes=10)
        prev = part[-1]
    gc.collect()
    assert len(gc.get_objects()) - before < 200  # (one object per page would be 20,000)
    assert len(idx) == 20_000


def test_holds_by_slices_match_holds_one_by_one() -> None:
    big, small = TreeIndex(budget=10_000), TreeIndex(budget=10_000)
    keys = chain("hold-slices", 20)
    for idx in (big, small):
        prev = None
        for k in keys:
            seal(idx, k, prev)
            prev = k
    rows = big.rows_of(keys)
    gens = [int(big.gen[r]) for r in rows]
    big.hold_rows([*rows, -1, rows[-1]])  # slices (> 8 rows), a missing row, a row twice
    for r in [*rows, rows[-1]]:
        small.hold_rows([r])  # one by one
    assert big.hold[: big.n].tolist() == small.hold[: small.n].tolist()
    assert big.evict_cost(10) == [] and small.evict_cost(10) == []  # every row leased
    stale = chain("hold-slices-gone", 1)[0]
    seal(big, stale)
    big.release_rows([*rows, big.row_of(stale)], [*gens, 999_999])  # a wrong gen is ignored
    assert big.hold[rows].tolist() == [0] * 19 + [1]
    assert keys_of(big, big.evict_cost(10)) == [stale]  # the chain's leaf is still held once
    big.release_rows([rows[-1]], [gens[-1]])
    assert keys_of(big, big.evict_cost(10)) == [keys[-1]]  # released: an evictable leaf again


# -- batches: a put_many chunk (a forest) reserved as one flight, sealed by slices ---------------
def _state(idx: TreeIndex) -> dict[Key, tuple[Key | None, int, int, int, int]]:
    """Per sealed key: parent, nbytes, cost, children, hold (what a batch must leave exactly as
    page-by-page reservations and commits would)."""
    out = {}
    for r in idx.live_rows().tolist():
        out[idx.key_of(r)] = (idx.parent_key(r), int(idx.nbytes[r]), int(idx.cost[r]), int(idx.children[r]),
                              int(idx.hold[r]))
    return out


def test_begin_batch_declines_all_but_the_plain_case_and_changes_nothing() -> None:
    idx = TreeIndex(budget=1000)
    stored = chain("batch-stored", 2)
    seal(idx, stored[0])
    used, flights, holds = idx.used_cost, dict(idx.flights), idx.hold.copy()
    keys = chain("batch-decline", 3)
    none3: list[Key | None] = [None, None, None]
    assert idx.begin_batch([stored[0], *keys[:2]], none3, 10) is None  # a key already sealed
    assert idx.begin_batch([keys[0], keys[1], keys[0]], none3, 10) is None  # a repeated key
    assert idx.begin_batch(keys, [chain("nowhere", 1)[0], None, None], 10) is None  # parent unknown
    assert idx.begin_batch(keys, [None, keys[2], None], 10) is None  # a parent later in the batch
    assert idx.begin_batch(keys, [stored[0], stored[0], stored[0]], 400) is None  # 1,200 does not fit
    assert idx.begin_batch(keys, none3[:2], 10) is None  # columns of different lengths
    ok, _, _ = idx.begin(keys[1], None, 10)
    assert ok
    assert idx.begin_batch(keys, none3, 10) is None  # a key in flight at another writer
    assert idx.begin_batch([stored[1]], [keys[1]], 10) is None  # its parent is in flight elsewhere
    idx.cancel(keys[1])
    assert idx.used_cost == used and idx.flights == flights and (idx.hold == holds).all()


@pytest.mark.parametrize("shape", ["roots", "chain", "forest"])
def test_commit_batch_leaves_the_index_as_page_by_page_commits_do(shape: str) -> None:
    base = chain(f"batch-{shape}-base", 2)
    keys = chain(f"batch-{shape}", 6)
    if shape == "roots":
        parents: list[Key | None] = [None] * 6
    elif shape == "chain":
        parents = [base[1], *keys[:-1]]
    else:  # two chains under stored pages, a root, a fork inside the batch
        parents = [base[0], keys[0], base[1], None, keys[0], base[0]]
    ref, idx = TreeIndex(budget=1000), TreeIndex(budget=1000)
    for t in (ref, idx):
        seal(t, base[0])
        seal(t, base[1], base[0])
    for k, q in zip(keys, parents, strict=True):  # the reference: the per-page protocol
        ok, _, _ = ref.begin_chained(k, q, 10)
        assert ok
    for k in keys:
        ref.commit(k, nbytes=8, csum=1, tag="t")
    begun = idx.begin_batch(keys, parents, 10)
    assert begun is not None
    batch, evicted = begun
    assert evicted == [] and all(idx.flights[k] is batch for k in keys) and idx.used_cost == 80
    held = {q: parents.count(q) for q in base}
    assert [int(idx.hold[row(idx, q)]) for q in base] == [held[base[0]], held[base[1]]]
    rows = idx.commit_batch(batch, nbytes=8, csums=np.ones(6, np.uint64), tag="t")
    assert rows is not None and keys_of(idx, rows.tolist()) == keys
    assert _state(idx) == _state(ref)
    assert not idx.flights and idx.used_cost == idx.sealed_cost == ref.sealed_cost
    assert len({int(idx.gen[r]) for r in rows}) == 6 and idx.tag_of(int(rows[0])) == "t"
    # the LRU order is the per-page one too: evicting everything takes the same leaves in turn
    assert keys_of(idx, idx.evict_cost(80)) == keys_of(ref, ref.evict_cost(80))


def test_commit_batch_reuses_recycled_rows() -> None:
    idx = TreeIndex(budget=1000)
    old = chain("batch-old", 4)
    for k in old:
        seal(idx, k)
    idx.recycle(idx.evict_cost(40))
    keys = chain("batch-reuse", 6)
    batch, _ = idx.begin_batch(keys, [None, *keys[:-1]], 10) or (None, None)
    assert batch is not None
    rows = idx.commit_batch(batch, nbytes=10, csums=np.zeros(6, np.uint64))
    assert rows is not None and idx.n == 6  # four recycled rows, two new ones
    assert [idx.parent_key(int(r)) for r in rows] == [None, *keys[:-1]]
    assert [int(idx.children[r]) for r in rows] == [1] * 5 + [0]
    assert keys_of(idx, idx.evict_cost(10)) == [keys[-1]]


def test_commit_batch_with_a_dropped_parent_splits_into_flights() -> None:
    idx = TreeIndex(budget=1000)
    base = chain("batch-drop-base", 1)[0]
    seal(idx, base)
    keys = chain("batch-drop", 3)
    batch, _ = idx.begin_batch(keys, [base, keys[0], None], 10) or (None, None)
    assert batch is not None
    idx.drop(row(idx, base))  # corrupt meanwhile
    assert idx.commit_batch(batch, nbytes=10, csums=np.zeros(3, np.uint64)) is None
    assert all(not isinstance(idx.flights[k], type(batch)) for k in keys)  # one flight per page now
    with pytest.raises(UnknownKeyError):
        idx.commit(keys[0], nbytes=10)
    with pytest.raises(UnknownKeyError):
        idx.commit(keys[1], nbytes=10)  # its parent never sealed
    idx.commit(keys[2], nbytes=10)
    assert not idx.flights and len(idx) == 1 and idx.used_cost == idx.sealed_cost == 10


def test_cancel_batch_releases_its_holds_and_orphans_waiters() -> None:
    idx = TreeIndex(budget=1000)
    base = chain("batch-cancel-base", 1)[0]
    seal(idx, base)
    keys = chain("batch-cancel", 3)
    batch, _ = idx.begin_batch(keys, [base, base, keys[0]], 10) or (None, None)
    assert batch is not None
    other = chain("batch-cancel-other", 1)[0]
    ok, _, _ = idx.begin_chained(other, keys[1], 10)  # another writer's page under a batch page
    assert ok
    assert int(idx.hold[row(idx, base)]) == 2
    idx.cancel_run(batch)
    idx.cancel_run(batch)  # idempotent
    assert int(idx.hold[row(idx, base)]) == 0
    with pytest.raises(UnknownKeyError):
        idx.commit(other, nbytes=10)
    with pytest.raises(UnknownKeyError):
        idx.commit_batch(batch, nbytes=10, csums=np.zeros(3, np.uint64))
    assert not idx.flights and idx.used_cost == 10
    assert keys_of(idx, idx.evict_cost(10)) == [base]  # evictable again


def test_begin_batch_makes_room_without_evicting_its_parents() -> None:
    idx = TreeIndex(budget=50)
    base = chain("batch-room-base", 3)
    for k in base:
        seal(idx, k)  # three roots, base[0] least recently used
    keys = chain("batch-room", 3)
    begun = idx.begin_batch(keys, [base[0], None, None], 10)
    assert begun is not None
    assert keys_of(idx, begun[1]) == [base[1]]  # base[0] is held as a parent: the next LRU leaf goes
    assert idx.used_cost == 50


def _reloaded(src: TreeIndex) -> TreeIndex:
    """A fresh index holding ``src``'s live rows as a store's open loads them: columns set, then
    the sorted key map of their first 8 bytes (no dict entries)."""
    live = src.live_rows()
    n = len(live)
    pos = {int(r): i for i, r in enumerate(live.tolist())}
    t = TreeIndex(src.budget)
    t.reset(n)
    t.key[:n] = src.key[live]
    t.parent[:n] = [pos[int(q)] if q >= 0 else -1 for q in src.parent[live]]
    t.cost[:n], t.nbytes[:n], t.tick[:n] = src.cost[live], src.nbytes[live], src.tick[live]
    t.alive[:n] = True
    t.gen[:n] = np.arange(1, n + 1, dtype=np.uint64)
    t._next_gen = n + 1
    t.finish_load()
    k64 = np.frombuffer(t.key[:n].tobytes(), dtype="<u8").reshape(n, 4)[:, 0]
    order = np.argsort(k64, kind="stable")
    t.set_key_map(k64[order].copy(), order.astype(np.int64))
    return t


def _forest(seed: int) -> tuple[TreeIndex, list[Key], list[Key]]:
    """A forest of 100-300 sealed rows (a chain of 80 from the first root, then chains, forks
    and roots), reloaded for odd seeds (then a few rows sealed after the load), with leases,
    in-flight children, a sealed key in flight and retained rows for some seeds; and the roots
    to evict.  The same seed builds the same forest."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(100, 300))
    keys = chain(f"bulk-evict-{seed}", n)
    idx = TreeIndex(100_000)
    for i, k in enumerate(keys):
        r = rng.random()
        q = None if i == 0 or (i >= 80 and r < 0.03) else keys[i - 1] if i < 80 or r < 0.85 else \
            keys[int(rng.integers(0, i))]
        seal(idx, k, q)
    if seed % 2:
        idx = _reloaded(idx)
        for j in range(int(rng.integers(1, 12))):  # in the dict, not in the key map
            k = key_of(f"bulk-evict-{seed}-late-{j}")
            seal(idx, k, keys[int(rng.integers(0, n))])
            keys.append(k)
    hold(idx, [keys[int(i)] for i in rng.choice(len(keys), size=int(rng.integers(0, 4)), replace=False)])
    for j in range(int(rng.integers(0, 3))):
        ok, _, _ = idx.begin(key_of(f"bulk-evict-{seed}-flight-{j}"), keys[int(rng.integers(0, len(keys)))], 10)
        assert ok
    if seed % 3 == 0:  # a sealed key found in flights (skipped by the rule, as its ancestors)
        idx.flights[keys[int(rng.integers(1, 80))]] = idx.flights.get(keys[0]) or _any_flight(idx, seed)
    if seed % 4 == 1:  # retained rows: an evict whose subtree holds one evicts nothing
        idx.retain_rows([idx.row_of(keys[int(rng.integers(0, len(keys)))])], 10**9)
    roots = [keys[0], *(keys[int(i)] for i in rng.choice(len(keys), size=int(rng.integers(0, 3)), replace=False))]
    return idx, keys, roots


def _any_flight(idx: TreeIndex, seed: int) -> Any:
    k = key_of(f"bulk-evict-{seed}-marker")
    ok, _, _ = idx.begin(k, None, 10)
    assert ok
    return idx.flights[k]


@pytest.mark.parametrize("seed", range(24))
def test_evicting_a_long_subtree_by_columns_matches_the_row_by_row_rule(seed: int) -> None:
    """A subtree of 64 rows or more is evicted by column work (a whole chain in one pass, no GIL
    hold per row): what it removes, skips and leaves must be what the row-by-row rule gives, with
    leases, in-flight children, a sealed key in flight, retained rows and a bulk-loaded key map."""
    bulk, keys, roots = _forest(seed)
    each, _, _ = _forest(seed)
    paths: list[str] = []
    column, by_row = bulk._remove_subtree, bulk._evict_each
    bulk._remove_subtree = lambda rows, outer: (paths.append("columns"), column(rows, outer))[1]  # type: ignore[method-assign]
    bulk._evict_each = lambda order: (paths.append("rows"), by_row(order))[1]  # type: ignore[method-assign]
    assert len(bulk.subtree(bulk.rows_of(roots))) >= 64
    covered = any(each.rcover[r] for r in each.rows_of(roots) if r >= 0 and each.alive[r])
    if covered:
        with pytest.raises(RetainedError):
            bulk.evict_rows(bulk.rows_of(roots))
        assert paths == []
    else:
        got = bulk.evict_rows(bulk.rows_of(roots))
        want = each._evict_each(each.subtree(each.rows_of(roots)))
        assert paths == ["columns"]
        assert (keys_of(bulk, got[0]), got[1]) == (keys_of(each, want[0]), want[1])
    assert _state(bulk) == _state(each)
    assert [bulk.row_of(k) >= 0 for k in keys] == [each.row_of(k) >= 0 for k in keys]
    assert [r >= 0 for r in bulk.rows_of(keys)] == [r >= 0 for r in each.rows_of(keys)]
    assert (bulk.count, bulk.used_cost, bulk.sealed_cost, bulk.evictions, bulk.evicted_cost) == \
        (each.count, each.used_cost, each.sealed_cost, each.evictions, each.evicted_cost)
    # the LRU order afterwards is the same too (the parents left behind became leaves alike)
    assert keys_of(bulk, bulk.evict_cost(10**6)) == keys_of(each, each.evict_cost(10**6))


def test_evicting_a_saved_chain_removes_no_row_one_by_one() -> None:
    """The whole 6,400-page chain goes in one column pass: no Python object is made per row
    beyond the removed-row list the caller frees (this guards against a return to row-by-row
    removal by counting the calls of the per-row path)."""
    idx = TreeIndex(10**9)
    keys = chain("bulk-evict-long", 6400)
    for i, k in enumerate(keys):
        seal(idx, k, keys[i - 1] if i else None)
    calls = 0
    real = idx._remove

    def counted(row: int) -> None:
        nonlocal calls
        calls += 1
        real(row)

    idx._remove = counted  # type: ignore[method-assign]
    removed, skipped = idx.evict_rows(idx.rows_of(keys[:1]))
    assert len(removed) == 6400 and skipped == 0 and calls == 0 and len(idx) == 0
    check_consistent(idx)
