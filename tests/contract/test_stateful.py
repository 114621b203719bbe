"""Stateful property tests.

1. ``TreeIndex`` against an exact, independent oracle: plain dicts of nodes, flights, leases and
   retained marks and a recency counter.  At the index level costs are known, so the oracle predicts *everything*:
   which leaves each eviction removes (LRU among unpinned leaves), exactly when the O(1) guard must
   refuse, what ``evict_keys`` skips, and every derived counter.
2. A deeper run of the shipped provider model (``ProviderStateMachine``) against the pinned
   provider, in both arena variants, than the per-class conformance test does.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hostkv_providers import CapacityError, InFlightError, Key, PinnedProvider, Provider, UnknownKeyError
from hostkv_providers.device._hostmem import OrdinaryAllocator
from hostkv_providers.errors import RetainedError
from hostkv_providers.providers import TreeIndex
from hostkv_providers.testing import ProviderTests, key_of, run_provider_state_machine

POOL = [key_of(f"stateful-index-{i}") for i in range(4)]
BUDGET = 12
RETAIN_LIMIT = 6
_I = st.integers(0, 99)
_NEW = st.sampled_from(("fresh", "fresh", "fresh", "any"))
_PARENT = st.sampled_from(("stored", "stored", "none", "any"))
_OLD = st.sampled_from(("stored", "stored", "stored", "any"))


@dataclass
class _ONode:
    parent: Key | None
    cost: int
    gen: int
    tick: int


class TreeIndexMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.idx = TreeIndex(BUDGET)
        self.nodes: dict[Key, _ONode] = {}
        self.flights: dict[Key, tuple[Key | None, int, int | None]] = {}  # parent, cost, parent gen
        self.leases: list[tuple[tuple[list[int], list[int]], list[tuple[Key, int]]]] = []
        self.retained: set[Key] = set()
        self.clock = 0
        self.gen = 0
        self.evictions = 0

    # -- oracle --------------------------------------------------------------------------------
    def _tick(self, key: Key) -> None:
        self.clock += 1
        self.nodes[key].tick = self.clock

    def _alive(self, key: Key | None, gen: int | None) -> bool:
        return key is not None and key in self.nodes and self.nodes[key].gen == gen

    def _with_ancestors(self, keys: list[Key]) -> set[Key]:
        out: set[Key] = set()
        for k in keys:
            cur: Key | None = k
            while cur is not None and cur not in out:
                out.add(cur)
                cur = self.nodes[cur].parent
        return out

    def _pinned(self, extra: list[Key] = ()) -> set[Key]:  # type: ignore[assignment]
        roots = [k for _, held in self.leases for k, g in held if self._alive(k, g)]
        roots += [p for p, _, g in self.flights.values() if self._alive(p, g)]  # type: ignore[misc]
        return self._with_ancestors(roots + list(extra) + sorted(self.retained))

    def _used(self) -> int:
        return sum(n.cost for n in self.nodes.values()) + sum(c for _, c, _ in self.flights.values())

    def _lru_plan(self, need: int, pinned: set[Key]) -> list[Key]:
        """Least recently used unpinned leaves until ``need`` is freed (a simulation)."""
        left = {k: n for k, n in self.nodes.items()}
        out: list[Key] = []
        freed = 0
        while freed < need:
            leaves = [k for k in left if k not in pinned and not any(n.parent == k for n in left.values())]
            if not leaves:
                break
            k = min(leaves, key=lambda k: left[k].tick)
            freed += left.pop(k).cost
            out.append(k)
        return out

    def _room(self, cost: int, pinned: set[Key]) -> list[Key] | None:
        """What make_room must evict, or ``None`` when it must refuse (evicting nothing)."""
        used = self._used()
        if used + cost <= BUDGET:
            return []
        evictable = sum(n.cost for k, n in self.nodes.items() if k not in pinned)
        if cost > BUDGET or used + cost - evictable > BUDGET:
            return None
        return self._lru_plan(used + cost - BUDGET, pinned)

    def _forget(self, keys: list[Key]) -> None:
        for k in keys:
            del self.nodes[k]
            self.retained.discard(k)

    def _keys(self, rows: list[int]) -> list[Key]:
        return [self.idx.key_of(r) for r in rows]

    def _pick(self, i: int, kind: str) -> Key | None:
        """``fresh``: not stored nor in flight; ``stored``: a node; ``any``; ``none``: a root."""
        if kind == "none":
            return None
        if kind == "fresh":
            cands = [k for k in POOL if k not in self.nodes and k not in self.flights]
        elif kind == "stored":
            cands = sorted(self.nodes)
        elif kind == "pinned_by_flight":  # the risky case: a parent with a child in flight
            cands = sorted({p for p, _, _ in self.flights.values() if p is not None and p in self.nodes})
        else:
            cands = []
        cands = cands or POOL
        return cands[i % len(cands)]

    def _key(self, i: int, kind: str) -> Key:
        key = self._pick(i, kind)
        assert key is not None
        return key

    # -- rules ---------------------------------------------------------------------------------
    @rule(k=_I, kind=_NEW, parent=_I, pkind=_PARENT, cost=st.integers(1, 5))
    def begin(self, k: int, kind: str, parent: int, pkind: str, cost: int) -> None:
        self._begin(k, kind, parent, pkind, cost)

    @rule(k=_I, kind=_NEW, parent=_I, pkind=_PARENT, cost=st.integers(1, 5))
    def put(self, k: int, kind: str, parent: int, pkind: str, cost: int) -> None:
        key = self._begin(k, kind, parent, pkind, cost)
        if key is not None:
            self._commit(key)

    def _begin(self, k: int, kind: str, parent: int, pkind: str, cost: int) -> Key | None:
        key, pkey = self._pick(k, kind), self._pick(parent, pkind)
        assert key is not None
        if pkey == key:
            return None
        if key in self.nodes:
            assert self.idx.begin(key, pkey, cost) == (False, [], -1)
            return None
        if key in self.flights:
            with pytest.raises(InFlightError):
                self.idx.begin(key, pkey, cost)
            return None
        if pkey is not None and pkey not in self.nodes:
            with pytest.raises(UnknownKeyError):
                self.idx.begin(key, pkey, cost)
            return None
        plan = self._room(cost, self._pinned([pkey] if pkey is not None else []))
        if plan is None:
            with pytest.raises(CapacityError):
                self.idx.begin(key, pkey, cost)
            return None
        ok, evicted, _ = self.idx.begin(key, pkey, cost)
        assert ok and self._keys(evicted) == plan
        self.idx.recycle(evicted)  # rows are reused: leases and flights must tell them apart
        self.evictions += len(plan)
        self._forget(plan)
        self.flights[key] = (pkey, cost, None if pkey is None else self.nodes[pkey].gen)
        return key

    @precondition(lambda self: bool(self.flights))
    @rule(i=st.integers(0, 99))
    def commit(self, i: int) -> None:
        self._commit(sorted(self.flights)[i % len(self.flights)])

    def _commit(self, key: Key) -> None:
        parent, cost, pgen = self.flights.pop(key)
        if parent is not None and not self._alive(parent, pgen):
            with pytest.raises(UnknownKeyError):
                self.idx.commit(key, nbytes=cost)
            return
        self.idx.commit(key, nbytes=cost)
        self.gen += 1
        self.nodes[key] = _ONode(parent, cost, self.gen, 0)
        self._tick(key)

    @precondition(lambda self: bool(self.flights))
    @rule(i=st.integers(0, 99))
    def cancel(self, i: int) -> None:
        key = sorted(self.flights)[i % len(self.flights)]
        del self.flights[key]
        self.idx.cancel(key)

    @rule(ks=st.lists(_I, min_size=1, max_size=3), kind=_OLD)
    def hold(self, ks: list[int], kind: str) -> None:
        keys = [self._key(k, kind) for k in ks]
        rows = self.idx.rows_of(keys)
        assert [r >= 0 for r in rows] == [k in self.nodes for k in keys]
        live = [r for r in rows if r >= 0]
        self.idx.hold_rows(live)
        token = (live, [int(self.idx.gen[r]) for r in live])
        held = []
        for k in keys:
            if k in self.nodes:
                self._tick(k)
                held.append((k, self.nodes[k].gen))
        self.leases.append((token, held))

    @precondition(lambda self: bool(self.leases))
    @rule(i=st.integers(0, 99))
    def release(self, i: int) -> None:
        token, _ = self.leases.pop(i % len(self.leases))
        self.idx.release_rows(*token)

    @rule(k=_I, kind=_OLD)
    def touch(self, k: int, kind: str) -> None:
        key = self._key(k, kind)
        if key in self.nodes:
            self.idx.touch(self.idx.row_of(key))
            self._tick(key)

    @rule(need=st.integers(1, 15))
    def evict_cost(self, need: int) -> None:
        plan = self._lru_plan(need, self._pinned())
        rows = self.idx.evict_cost(need)
        assert self._keys(rows) == plan
        self.idx.recycle(rows)
        self.evictions += len(plan)
        self._forget(plan)

    @rule(ks=st.lists(_I, min_size=1, max_size=3), kind=_OLD)
    def evict_keys(self, ks: list[int], kind: str) -> None:
        keys = [self._key(k, kind) for k in ks]
        doomed: set[Key] = {k for k in keys if k in self.nodes}
        grew = True
        while grew:
            grew = False
            for k, n in self.nodes.items():
                if k not in doomed and n.parent in doomed:
                    doomed.add(k)
                    grew = True
        if doomed & self._with_ancestors(sorted(self.retained)):
            with pytest.raises(RetainedError):  # retained, or an ancestor of one: nothing goes
                self.idx.evict_rows(self.idx.rows_of(keys))
            return
        pinned = self._pinned()
        removed, skipped = self.idx.evict_rows(self.idx.rows_of(keys))
        assert set(self._keys(removed)) == doomed - pinned
        assert skipped == len(doomed & pinned)
        self.evictions += len(removed)
        self._forget(self._keys(removed))
        self.idx.recycle(removed)

    @rule(k=_I, kind=st.sampled_from(("stored", "pinned_by_flight")), often=st.integers(0, 3))
    def drop(self, k: int, kind: str, often: int) -> None:
        if often:  # a checksum drop is rare; run it in one draw of four so the tree can grow
            return
        key = self._key(k, kind)
        doomed: set[Key] = {key} if key in self.nodes else set()
        grew = True
        while grew:
            grew = False
            for kk, n in self.nodes.items():
                if kk not in doomed and n.parent in doomed:
                    doomed.add(kk)
                    grew = True
        rows = self.idx.drop(self.idx.row_of(key))
        assert set(self._keys(rows)) == doomed
        self.idx.recycle(rows)
        self._forget(list(doomed))

    @precondition(lambda self: any(p is not None and p in self.nodes for p, _, _ in self.flights.values()))
    @rule(i=_I, cost=st.integers(1, 5))
    def drop_parent_of_flight_and_resave(self, i: int, cost: int) -> None:
        """A checksum failure under an in-flight child, then another writer saves the page again:
        the reservation must not mistake the new node for the parent it pinned."""
        parents = sorted({p for p, _, _ in self.flights.values() if p is not None and p in self.nodes})
        parent = parents[i % len(parents)]
        self.drop(POOL.index(parent), "any", 0)
        key = self._begin(POOL.index(parent), "any", 0, "none", cost)
        if key is not None:
            self._commit(key)

    @rule(k=_I, kind=_OLD, delta=st.integers(-3, 4))
    def add_cost(self, k: int, kind: str, delta: int) -> None:
        key = self._key(k, kind)
        if key not in self.nodes or self.nodes[key].cost + delta < 0:
            return
        node = self.idx.row_of(key)
        if delta > 0:
            plan = self._room(delta, self._pinned([key]))
            if plan is None:
                with pytest.raises(CapacityError):
                    self.idx.add_cost(node, delta)
                return
        else:
            plan = []
        rows = self.idx.add_cost(node, delta)
        assert self._keys(rows) == plan
        self.idx.recycle(rows)
        self.evictions += len(plan)
        self._forget(plan)
        self.nodes[key].cost += delta

    @rule(ks=st.lists(_I, min_size=1, max_size=3))
    def retain(self, ks: list[int]) -> None:
        keys = [self._key(k, "stored") for k in ks]
        if any(k not in self.nodes for k in keys):
            return  # the providers check presence; the index takes live rows
        covered = self._with_ancestors(sorted(self.retained))
        after = self._with_ancestors(sorted(self.retained | set(keys)))
        if sum(self.nodes[k].cost for k in after) > RETAIN_LIMIT:
            with pytest.raises(CapacityError):
                self.idx.retain_rows(self.idx.rows_of(keys), RETAIN_LIMIT)
            return
        assert covered <= after
        assert self.idx.retain_rows(self.idx.rows_of(keys), RETAIN_LIMIT) == len(set(keys) - self.retained)
        self.retained |= set(keys)

    @rule(ks=st.lists(_I, min_size=1, max_size=3), kind=_OLD)
    def unretain(self, ks: list[int], kind: str) -> None:
        keys = [self._key(k, kind) for k in ks]
        assert self.idx.unretain_rows(self.idx.rows_of(keys)) == len(set(keys) & self.retained)
        self.retained -= set(keys)

    # -- invariants ----------------------------------------------------------------------------
    @invariant()
    def counters_match(self) -> None:
        idx = self.idx
        assert set(idx.keys()) == set(self.nodes)
        assert set(idx.flights) == set(self.flights)
        assert idx.used_cost == self._used() <= BUDGET
        assert idx.sealed_cost == sum(n.cost for n in self.nodes.values())
        # the index pins directly (leases, in-flight children); ancestors are safe as non-leaves
        direct = {k for _, held in self.leases for k, g in held if self._alive(k, g)}
        direct |= {p for p, _, g in self.flights.values() if self._alive(p, g)}  # type: ignore[misc]
        assert {idx.key_of(int(r)) for r in idx.live_rows() if idx.hold[r]} == direct
        assert idx.evictions == self.evictions
        for k, n in self.nodes.items():
            assert n.parent is None or n.parent in self.nodes
            assert idx.children[idx.row_of(k)] == sum(1 for c in self.nodes.values() if c.parent == k)
        assert {idx.key_of(int(r)) for r in idx.live_rows() if idx.retained[r]} == self.retained
        assert idx.retained_count == len(self.retained)
        assert idx.retained_cost == sum(self.nodes[k].cost for k in self._with_ancestors(sorted(self.retained)))


TestTreeIndexModel = TreeIndexMachine.TestCase
TestTreeIndexModel.settings = settings(max_examples=150, stateful_step_count=50, deadline=None,
                                       derandomize=True, database=None,
                                       suppress_health_check=list(HealthCheck))


# --------------------------------------------------------------------------------------------
# The provider model, deeper than the per-class conformance run
# --------------------------------------------------------------------------------------------
class _Pinned(ProviderTests):
    background = False

    def make_provider(self, tmp_path: Path, budget_bytes: int) -> Provider:
        return PinnedProvider(budget_bytes, block=4096, chunk=2 * 4096, allocator=OrdinaryAllocator(),
                              background=self.background, verify_reads=True)


class _PinnedBackground(_Pinned):
    background = True


@pytest.mark.parametrize("suite", [_Pinned(), _PinnedBackground()], ids=["foreground", "background"])
def test_pinned_provider_model_deep(suite: ProviderTests, tmp_path: Path) -> None:
    run_provider_state_machine(suite, tmp_path, max_examples=100, stateful_step_count=50)


def test_provider_model_runs_directly(tmp_path: Path) -> None:
    """The machine is usable without the suite class's test method (as the docs show)."""
    run_provider_state_machine(_Pinned(), tmp_path, max_examples=5, stateful_step_count=10)
