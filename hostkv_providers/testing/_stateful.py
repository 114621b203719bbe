"""A hypothesis state machine that drives any provider against a plain-dict oracle.

The oracle is written independently of the code under test (no ``TreeIndex``): a dict of sealed
entries ``key -> (parent, nbytes, version)``, a dict of anchors, the open reservations with a byte
mask of what was written, and the held leases.  Eviction is a policy choice, so the oracle does
not predict *which* entries go; it checks every consequence the contract fixes:

* a present entry reads back exactly the bytes sealed under its key (the version is part of the
  PRNG seed, so a stale page from an earlier reservation of the same key is caught);
* nothing appears that was not sealed, and nothing aborted is visible;
* the tree stays prefix-closed, and ``evict(keys)`` removes exactly the unprotected subtree;
* leased entries, parents of in-flight reservations and all their ancestors are never evicted;
* ``stats().used_bytes`` never exceeds the budget, and covers the present entries' bytes;
* a ``CapacityError`` evicts nothing; a small request with nothing pinned does not fail;
* when the provider survives reopen, every sealed entry and anchor does, and no reservation does.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from hostkv_providers._errors import CapacityError, IncompleteWriteError, InFlightError, UnknownKeyError
from hostkv_providers._keys import Key
from hostkv_providers._provider import Provider
from hostkv_providers._reservation import Lease, Reservation
from hostkv_providers._span import ByteSpan
from hostkv_providers.testing._pages import key_of, page_bytes

if TYPE_CHECKING:
    from hostkv_providers.testing._families._base import SuiteBase

__all__ = ["ProviderStateMachine", "run_provider_state_machine"]

POOL_SIZE = 10
BUDGET_PAGES = 8
ANCHOR_NAMES = ("state", "mtp")

# Rules pick keys by kind so most steps do something (a uniform pick would mostly miss).
_INDEX = st.integers(0, 1 << 16)
_NEW_KEY = st.sampled_from(("fresh", "fresh", "fresh", "sealed", "any"))
_PARENT = st.sampled_from(("sealed", "sealed", "sealed", "root", "root", "any"))
_EXISTING = st.sampled_from(("sealed", "sealed", "sealed", "any"))


def content(key: Key, version: int, nbytes: int) -> bytes:
    """The bytes the machine writes for ``key``'s ``version``-th reservation."""
    return page_bytes(bytes(key) + version.to_bytes(4, "little"), nbytes)


@dataclass
class _Open:
    res: Reservation
    parent: Key | None
    nbytes: int
    version: int
    mask: bytearray = field(default_factory=bytearray)  # 1 per written byte

    @property
    def complete(self) -> bool:
        return all(self.mask)


@dataclass
class _Sealed:
    parent: Key | None
    nbytes: int
    version: int
    anchors: dict[str, bytes] = field(default_factory=dict)


class ProviderStateMachine(RuleBasedStateMachine):
    """The model; :func:`run_provider_state_machine` binds it to a suite and a directory."""

    suite: SuiteBase
    workdir: Path
    counter = 0

    def __init__(self) -> None:
        super().__init__()
        cls = type(self)
        cls.counter += 1
        where = cls.workdir / f"sm{cls.counter}"
        where.mkdir(parents=True)
        self.where = where
        self.page = self.suite.page_nbytes
        self.budget = BUDGET_PAGES * self.page
        self.p: Provider = self.suite.make_provider(where, self.budget)
        self.pool = [key_of(f"sm-{i}") for i in range(POOL_SIZE)]
        self.sealed: dict[Key, _Sealed] = {}
        self.open: dict[Key, _Open] = {}
        self.leases: list[tuple[Lease, list[Key]]] = []
        self.version = 0
        self.forgotten: set[Key] = set()  # evicted or aborted at some point (for messages)

    # -- oracle helpers ------------------------------------------------------------------------
    def _ancestors(self, key: Key | None) -> list[Key]:
        out: list[Key] = []
        while key is not None:
            out.append(key)
            entry = self.sealed.get(key)
            key = entry.parent if entry is not None else None
        return out

    def _protected(self) -> set[Key]:
        roots: list[Key] = [k for _, keys in self.leases for k in keys]
        roots += [o.parent for o in self.open.values() if o.parent is not None]
        out: set[Key] = set()
        for k in roots:
            out.update(self._ancestors(k))
        return out

    def _subtree(self, key: Key) -> set[Key]:
        out = {key}
        grew = True
        while grew:
            grew = False
            for k, e in self.sealed.items():
                if k not in out and e.parent in out:
                    out.add(k)
                    grew = True
        return out

    def _sync(self, *, allow_evictions: bool = True) -> set[Key]:
        """Compare presence with the oracle; forget legitimately evicted entries; return them."""
        hits = dict(zip(self.pool, self.p.present(self.pool), strict=True))
        protected = self._protected()
        gone: set[Key] = set()
        for k, hit in hits.items():
            if hit:
                assert k in self.sealed, (
                    f"{k.hex()[:8]} is present but was evicted or aborted before (and not sealed since)"
                    if k in self.forgotten else f"{k.hex()[:8]} is present but was never sealed"
                )
            elif k in self.sealed:
                assert allow_evictions, f"{k.hex()[:8]} vanished without any eviction allowed"
                assert k not in protected, f"{k.hex()[:8]} was evicted while leased/in flight/an ancestor"
                gone.add(k)
        for k in gone:
            del self.sealed[k]
        self.forgotten |= gone
        for k, e in self.sealed.items():
            assert e.parent is None or e.parent in self.sealed, f"chain punctured above {k.hex()[:8]}"
        for k in self.open:
            assert not hits[k], "an in-flight key is visible before its seal"
        return gone

    def _check_bytes(self, key: Key) -> None:
        e = self.sealed[key]
        got = self.p.read_bytes(key)
        assert got == content(key, e.version, e.nbytes), f"wrong bytes for {key.hex()[:8]}"

    def _pick(self, i: int, kind: str) -> Key:
        """A pool key: ``sealed`` (one the oracle holds), ``fresh`` (neither sealed nor open) or
        ``any``; falls back to any key when the wanted kind is empty."""
        if kind == "sealed":
            cands = sorted(self.sealed)
        elif kind == "fresh":
            cands = [k for k in self.pool if k not in self.sealed and k not in self.open]
        else:
            cands = []
        if not cands:
            cands = self.pool
        return cands[i % len(cands)]

    # -- rules ---------------------------------------------------------------------------------
    @initialize(steps=st.lists(st.tuples(_INDEX, _PARENT, st.integers(1, 2)), min_size=2, max_size=6))
    def seed_forest(self, steps: list[tuple[int, str, int]]) -> None:
        """Start from a small stored forest so every example exercises hits and eviction."""
        for j, parent_kind, npages in steps:
            self.put(j, "fresh", j, parent_kind, npages)

    @rule(i=_INDEX, kind=_NEW_KEY, j=_INDEX, parent_kind=_PARENT, npages=st.integers(1, 3))
    def reserve(self, i: int, kind: str, j: int, parent_kind: str, npages: int) -> None:
        """Reserve and leave the reservation open (written and sealed by later rules)."""
        self._reserve(i, kind, j, parent_kind, npages)

    @rule(i=_INDEX, kind=_NEW_KEY, j=_INDEX, parent_kind=_PARENT, npages=st.integers(1, 3))
    def put(self, i: int, kind: str, j: int, parent_kind: str, npages: int) -> None:
        """The common path in one step: reserve, write everything, seal."""
        key = self._reserve(i, kind, j, parent_kind, npages)
        if key is not None:
            o = self.open[key]
            self.p.write(o.res, 0, content(key, o.version, o.nbytes))
            o.mask[:] = b"\x01" * o.nbytes
            self._seal(key)

    def _reserve(self, i: int, kind: str, j: int, parent_kind: str, npages: int) -> Key | None:
        key = self._pick(i, kind)
        if parent_kind == "root" or (parent_kind == "sealed" and not self.sealed):
            pkey = None
        else:
            pkey = self._pick(j, parent_kind)
        if pkey == key:
            pkey = None
        nbytes = npages * self.page
        before = set(self.sealed)
        if key in self.sealed:
            assert self.p.reserve(key, pkey, nbytes) is None, "reserve of a sealed key must dedup"
            return None
        if key in self.open:
            try:
                self.p.reserve(key, pkey, nbytes)
            except InFlightError as exc:
                assert exc.key == key
            else:
                raise AssertionError("a second reservation of an in-flight key must raise InFlightError")
            return None
        if pkey is not None and pkey not in self.sealed:
            try:
                self.p.reserve(key, pkey, nbytes)
            except UnknownKeyError:
                pass
            else:
                raise AssertionError("reserve under a parent that is not sealed must raise UnknownKeyError")
            assert self.p.in_flight(key) is False
            return None
        try:
            res = self.p.reserve(key, pkey, nbytes)
        except CapacityError:
            assert self._sync(allow_evictions=False) == set()
            pinned_bytes = sum(self.sealed[a].nbytes + sum(map(len, self.sealed[a].anchors.values()))
                               for a in self._protected() | set(self._ancestors(pkey)))
            pinned_bytes += sum(o.nbytes for o in self.open.values())
            # generous slack for per-entry overhead: only clearly satisfiable requests must work
            assert pinned_bytes + nbytes + 2 * self.page > self.budget, (
                f"CapacityError for {nbytes} bytes with only {pinned_bytes} pinned of {self.budget}"
            )
            return None
        assert res is not None
        self.version += 1
        self.open[key] = _Open(res, pkey, nbytes, self.version, bytearray(nbytes))
        gone = self._sync()
        assert gone <= before
        return key

    @precondition(lambda self: bool(self.open))
    @rule(i=_INDEX, lo=st.integers(0, 3 * 4096), length=st.integers(1, 3 * 4096))
    def write_part(self, i: int, lo: int, length: int) -> None:
        o = list(self.open.values())[i % len(self.open)]
        lo = lo % o.nbytes
        hi = min(o.nbytes, lo + length)
        data = content(o.res.key, o.version, o.nbytes)
        self.p.write(o.res, lo, data[lo:hi])
        o.mask[lo:hi] = b"\x01" * (hi - lo)

    @precondition(lambda self: bool(self.open))
    @rule(i=_INDEX)
    def write_all(self, i: int) -> None:
        o = list(self.open.values())[i % len(self.open)]
        self.p.write(o.res, 0, content(o.res.key, o.version, o.nbytes))
        o.mask[:] = b"\x01" * o.nbytes

    @precondition(lambda self: bool(self.open))
    @rule(i=_INDEX)
    def seal(self, i: int) -> None:
        self._seal(list(self.open)[i % len(self.open)])

    def _seal(self, key: Key) -> None:
        o = self.open[key]
        if not o.complete:
            try:
                self.p.seal(o.res)
            except IncompleteWriteError:
                assert o.res.state == "open"
                return
            raise AssertionError("seal with unwritten bytes must raise IncompleteWriteError")
        self.p.seal(o.res)
        del self.open[key]
        self.sealed[key] = _Sealed(o.parent, o.nbytes, o.version)
        self._sync(allow_evictions=False)
        self._check_bytes(key)

    @precondition(lambda self: bool(self.open))
    @rule(i=_INDEX, fill=st.booleans())
    def abort(self, i: int, fill: bool) -> None:
        key = list(self.open)[i % len(self.open)]
        o = self.open.pop(key)
        self.forgotten.add(key)
        if fill:  # a fully written entry that is aborted must vanish just the same
            self.p.write(o.res, 0, content(key, o.version, o.nbytes))
        self.p.abort(o.res)
        assert self.p.present([key]) == [False]
        assert self.p.in_flight(key) is False
        assert self.p.read(key, bytearray(self.page)) is False
        self._sync(allow_evictions=False)

    @rule(i=_INDEX, kind=_EXISTING, offset=st.integers(0, 3 * 4096), length=st.integers(0, 3 * 4096),
          whole=st.booleans())
    def read(self, i: int, kind: str, offset: int, length: int, whole: bool) -> None:
        key = self._pick(i, kind)
        e = self.sealed.get(key)
        if e is None:
            assert self.p.read(key, bytearray(3 * self.page)) is False
            assert self.p.list_anchors(key) == {}
            return
        data = content(key, e.version, e.nbytes)
        if whole:
            out = bytearray(e.nbytes)
            assert self.p.read(key, out) is True
            assert bytes(out) == data
        else:
            offset = min(offset, e.nbytes)
            length = min(length, e.nbytes - offset)
            out = bytearray(length)
            assert self.p.read(key, out, ByteSpan(offset, length)) is True
            assert bytes(out) == data[offset : offset + length]
        assert self.p.list_anchors(key) == {n: len(b) for n, b in e.anchors.items()}
        for name, blob in e.anchors.items():
            assert self.p.get_anchor(key, name) == blob

    @rule(ks=st.lists(_INDEX, min_size=1, max_size=3), kind=_EXISTING)
    def evict_keys(self, ks: list[int], kind: str) -> None:
        keys = [self._pick(i, kind) for i in ks]
        protected = self._protected()
        doomed: set[Key] = set()
        for k in keys:
            if k in self.sealed:
                doomed |= self._subtree(k)
        self.p.evict(keys)
        hits = dict(zip(self.pool, self.p.present(self.pool), strict=True))
        for k in doomed:
            if k in protected:
                assert hits[k], f"evict(keys) removed protected {k.hex()[:8]}"
            else:
                assert not hits[k], f"evict(keys) left unprotected {k.hex()[:8]} of the subtree"
        self._sync()

    @rule(npages=st.integers(1, 4))
    def evict_bytes(self, npages: int) -> None:
        evictable = set(self.sealed) - self._protected()
        report = self.p.evict(nbytes=npages * self.page)
        gone = self._sync()
        if evictable:
            assert report.entries >= 1 and gone, "evict(nbytes) freed nothing although entries were evictable"
        assert gone <= evictable

    @rule(ks=st.lists(_INDEX, min_size=1, max_size=4), kind=_EXISTING)
    def lease(self, ks: list[int], kind: str) -> None:
        if len(self.leases) >= 3:
            return
        keys = [self._pick(i, kind) for i in ks]
        lease = self.p.lease(keys)
        assert lease.present == tuple(k in self.sealed for k in keys)
        self.leases.append((lease, [k for k in keys if k in self.sealed]))

    @precondition(lambda self: bool(self.leases))
    @rule(i=_INDEX)
    def release(self, i: int) -> None:
        lease, _ = self.leases.pop(i % len(self.leases))
        lease.release()

    @rule(i=_INDEX, kind=_EXISTING, name=st.sampled_from(ANCHOR_NAMES), size=st.integers(0, 200))
    def put_anchor(self, i: int, kind: str, name: str, size: int) -> None:
        key = self._pick(i, kind)
        blob = page_bytes(bytes(key) + name.encode() + bytes([size % 256]), size)
        e = self.sealed.get(key)
        if e is None:
            try:
                self.p.put_anchor(key, name, blob)
            except UnknownKeyError:
                return
            raise AssertionError("put_anchor on a missing entry must raise UnknownKeyError")
        try:
            self.p.put_anchor(key, name, blob)
        except CapacityError:
            assert self._sync(allow_evictions=False) == set()
            return
        e.anchors[name] = blob
        self._sync()
        assert key in self.sealed  # the entry whose anchor grew is never the one evicted for it

    @precondition(lambda self: self.suite.supports_reopen)
    @rule()
    def reopen(self) -> None:
        for lease, _ in self.leases:
            lease.release()
        self.leases.clear()
        dropped = list(self.open)
        self.forgotten.update(dropped)
        self.p = self.suite.reopen(self.p)
        self.open.clear()
        for k in dropped:
            assert self.p.in_flight(k) is False
        self._sync(allow_evictions=False)  # everything sealed survives; nothing unsealed appears
        for k in self.sealed:
            self._check_bytes(k)
            assert self.p.list_anchors(k) == {n: len(b) for n, b in self.sealed[k].anchors.items()}

    # -- invariants ----------------------------------------------------------------------------
    @invariant()
    def budget_holds(self) -> None:
        st_ = self.p.stats()
        assert st_.used_bytes <= st_.budget_bytes == self.budget
        assert st_.used_bytes >= sum(e.nbytes for e in self.sealed.values())

    def teardown(self) -> None:
        try:
            for lease, _ in self.leases:
                lease.release()
            for o in self.open.values():
                self.p.abort(o.res)
        finally:
            self.p.close()
            # Each example's store is its own; kept until the test ends, a run of them took
            # 330 MB (10 x 33 MB preallocated files) and filled a small CI disk mid-suite.
            shutil.rmtree(self.where, ignore_errors=True)


def run_provider_state_machine(suite: SuiteBase, workdir: Path, **overrides: Any) -> None:
    """Run :class:`ProviderStateMachine` against ``suite.make_provider`` (deterministic seed)."""
    machine = type("BoundProviderStateMachine", (ProviderStateMachine,), {"suite": suite, "workdir": workdir})
    opts: dict[str, Any] = {
        "max_examples": suite.stateful_examples,
        "stateful_step_count": suite.stateful_steps,
        "deadline": None,
        "derandomize": True,
        "database": None,
        "suppress_health_check": list(HealthCheck),
        "print_blob": False,
    }
    opts.update(overrides)
    run_state_machine_as_test(machine, settings=settings(**opts))  # type: ignore[no-untyped-call, unused-ignore]  # typed in newer hypothesis
