"""The tree index's reservations: one key (``begin``/``commit``/``cancel``), a chain run reserved
in one go (``begin_run``), and a batch of a ``put_many`` chunk (``begin_batch``), each sealed
root first."""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Container
from typing import Any

import numpy as np
import numpy.typing as npt

from hostkv_providers._errors import CapacityError, InFlightError, UnknownKeyError
from hostkv_providers._keys import Key
from hostkv_providers.providers._tree._removal import _Removal
from hostkv_providers.providers._tree._rows import _ROW_BITS, _Batch, _Flight, _Run


class _Reservations(_Removal):
    """:class:`~hostkv_providers.providers.TreeIndex`'s reservations, runs and batches."""

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
