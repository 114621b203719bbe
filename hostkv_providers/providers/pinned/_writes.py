"""The pinned provider's write path (a layer of :class:`PinnedProvider`, see ``_base``):
reservations page by page and as chain runs, seals, aborts, eviction and dropping entries."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from hostkv_providers._chain import ReservedChain, chain_keys, reserve_run_first
from hostkv_providers._errors import (
    CapacityError,
    ClosedError,
    HostKVError,
    InFlightError,
    UnknownKeyError,
)
from hostkv_providers._keys import Key
from hostkv_providers._region import HostPages, HostRegion
from hostkv_providers._reports import EvictReport
from hostkv_providers._reservation import Reservation
from hostkv_providers._span import ByteSpan
from hostkv_providers.providers.pinned._arena import _blocks_cost, _scatter
from hostkv_providers.providers.pinned._leases import _Leases
from hostkv_providers.providers.pinned._run import _PinnedReservation, _PinnedRun


class _Writes(_Leases):
    """Reservations, seals and eviction (a part of :class:`PinnedProvider`)."""

    def _reserve(self, k: Key, p: Key | None, nbytes: int, salt_tag: str) -> Reservation | None:
        with self._usable():
            return self._reserve_locked(k, p, nbytes, salt_tag)

    def _wait_for_memory(self, cost: int) -> None:
        """(Lock held.)  Prefer memory still being pinned over evicting entries that could be
        hits: wait while the arena is still filling and ``cost`` more does not fit."""
        while self._pending and self._index.used_cost + cost > self._index.budget:
            self._ready.wait(0.5)
            self._check_usable()
            if self._closing:  # (close() waits for this call: do not wait for memory meanwhile)
                raise ClosedError(f"{type(self).__name__} is closing")

    def _reserve_locked(self, k: Key, p: Key | None, nbytes: int, salt_tag: str,
                        chained: bool = False) -> _PinnedReservation | None:
        """Reserve under the provider lock (``None``: already stored); ``chained``: the parent may
        be in flight (``reserve_many``)."""
        nblocks = -(-nbytes // self._block)
        cost = nblocks * self._block
        if cost > self._budget:
            raise CapacityError(f"{nbytes} bytes exceed the whole budget of {self._budget}")
        if not self._index.contains(k):
            self._wait_for_memory(cost)
        try:
            ok, evicted, _ = (self._index.begin_chained if chained else self._index.begin)(k, p, cost)
        except CapacityError as exc:
            if self._pinning_error is None:
                raise
            # part of the arena could not be allocated: say so instead of a bare budget error
            raise CapacityError(
                f"{exc.message}; only {self.ready_bytes} of {self._budget} bytes could be allocated "
                f"({self._pinning_error!r})",
                hint="lower the budget or free host memory (pinned memory is limited by ulimit -l)",
            ) from self._pinning_error
        if not ok:
            return None  # dedup (counted by the caller)
        self._free_rows(evicted)
        runs = self._arena.allocate(nblocks)
        return _PinnedReservation(self, k, p, nbytes, salt_tag, runs)

    def _write(self, res: _PinnedReservation, span: ByteSpan, view: memoryview) -> None:
        # No provider lock: the reservation's blocks are private to its writer until seal.
        _scatter(res._regions, span, view)

    def _seal(self, res: _PinnedReservation) -> None:
        digest = self._sum(r.view for r in res._regions)
        with self._usable():
            res.check_open(self)
            self._commit_locked(res, digest)

    def _commit_locked(self, res: _PinnedReservation, digest: int) -> int:
        idx = self._index
        try:
            row = idx.commit(res.key, nbytes=res.nbytes, csum=digest, tag=res.salt_tag,
                             run_start=res.runs[0][0], run_len=res.runs[0][1])
        except UnknownKeyError:
            self._arena.release(res.runs)
            res._finish("aborted")
            raise
        if len(res.runs) > 1:
            idx.scatter[row] = res.runs
        res._finish("sealed")
        return row

    def reserve_many(self, keys: Sequence[bytes], parents: Sequence[bytes | None], nbytes: int, *,
                     salt_tag: str = "") -> ReservedChain:
        """Arena reservations for a chain run in one lock round (see ``Provider.reserve_many``):
        a parent may be in flight (reserved earlier in this call or an earlier one), so a copy
        engine DMAs a whole chain straight into the arena before the first seal."""
        ks = chain_keys(self, keys, parents)
        self._check_usable()  # (before the write call: in a forked child its lock may be a copy held for good)
        # A write call: close() waits for it, so the arena's chunks are still mapped while the
        # pages' addresses are built below (a close in between unmapped them: an IndexError, or
        # addresses of freed memory handed to a copy engine).
        with self._write_call():
            chain = reserve_run_first(self, ks, parents, nbytes, salt_tag, self._reserve_run)
            if chain is not None:
                return chain
            checked = [self._reserve_args(k, p, nbytes, salt_tag) for k, p in zip(ks, parents, strict=True)]
            out: list[Reservation | None] = []
            error: HostKVError | None = None
            with self._usable():
                for k, p, n in checked:
                    try:
                        out.append(self._reserve_locked(k, p, n, salt_tag, chained=True))
                    except (CapacityError, InFlightError, UnknownKeyError) as exc:
                        error = exc
                        break
            return ReservedChain(out, error, self._chain_pages(out, nbytes))

    def _reserve_run(self, ks: list[Key], parent: Key | None, nbytes: int, salt_tag: str, *,
                     sealed_parent: bool = False) -> ReservedChain | None:
        """The chain run ``ks`` (all new) as one :class:`_PinnedRun`, or ``None`` when it is not
        the plain case (see ``TreeIndex.begin_run``) or the arena is too fragmented: the caller
        then reserves page by page.  ``ks[0]`` and ``parent`` were validated; the other keys are
        validated ``Key``s (``_keys``) and so are their parents (the keys before them)."""
        nblocks = -(-nbytes // self._block)
        cost = nblocks * self._block
        if cost * len(ks) > self._budget or len(set(ks)) != len(ks) or parent in ks:
            return None
        with self._usable():
            idx = self._index
            if sealed_parent and parent is not None and idx.row_of(parent) < 0:
                return None  # (put_many: stored under sealed parents only, never one in flight)
            self._wait_for_memory(cost * len(ks))
            begun = idx.begin_run(ks, parent, cost)
            if begun is None:
                return None
            run, evicted = begun
            self._free_rows(evicted)
            starts = self._arena.allocate_pages(len(ks), nblocks)
            if starts is None:
                idx.cancel_run(run)
                return None
        pr = _PinnedRun(self, run, ks, parent, nbytes, salt_tag, starts, nblocks)
        return ReservedChain(error=None, pages=self._pages_at(starts, nbytes), run=pr)

    def _pages_at(self, starts: npt.NDArray[np.int64], nbytes: int) -> HostPages:
        """The pages starting at arena blocks ``starts`` as one :class:`HostPages`."""
        arena = self._arena
        bases = np.array([c.address for c in arena.chunks], dtype=np.uint64)
        addrs = bases[starts // arena.bpc] + (starts % arena.bpc).astype(np.uint64) * np.uint64(arena.block)
        return HostPages(addrs, nbytes, pinned=self._allocator.pinned, readonly=False)

    def _chain_pages(self, out: Sequence[Reservation | None], nbytes: int) -> HostPages | None:
        """The reserved pages as one :class:`HostPages` (addresses in a numpy array) when each is
        one contiguous run of the arena: what a copy engine DMAs a chunk into."""
        starts = []
        arena = self._arena
        for r in out:
            if r is None:
                continue
            runs = r.runs  # type: ignore[attr-defined]
            if len(runs) != 1:
                return None
            starts.append(runs[0][0])
        if not starts:
            return None
        st = np.array(starts, dtype=np.int64)
        bases = np.array([c.address for c in arena.chunks], dtype=np.uint64)
        addrs = bases[st // arena.bpc] + (st % arena.bpc).astype(np.uint64) * np.uint64(arena.block)
        return HostPages(addrs, nbytes, pinned=self._allocator.pinned, readonly=False)

    def _abort(self, reservation: _PinnedReservation) -> bool:
        with self._usable():
            if reservation.state != "open":
                return False  # a racing seal or abort finished it
            self._index.cancel(reservation.key)
            self._arena.release(reservation.runs)
            reservation._finish("aborted")
            return True

    def _evict(self, ks: list[Key] | None, nbytes: int) -> EvictReport:
        with self._usable():
            removed, freed, skipped = self._index.evict_for(ks, nbytes)
            self._free_rows(removed)
            return EvictReport(len(removed), freed, skipped)

    def _entry_regions(self, key: bytes) -> list[HostRegion] | None:
        """The arena regions of a sealed entry, or ``None`` (the tests' backdoor into the memory)."""
        with self._lock:
            row = self._index.row_of(key)
            if row < 0:
                return None
            return self._arena.regions(self._index.runs(row), int(self._index.nbytes[row]), False)

    def _free_rows(self, rows: Sequence[int]) -> None:
        """Give removed rows' blocks back to the arena and the rows to the index."""
        idx = self._index
        if len(rows) > 8 and not idx.scatter:
            # (a chain evicted for room: its pages' blocks go back as runs, not page by page)
            arr = np.asarray(rows, dtype=np.int64)
            lens = idx.run_len[arr]
            if int(lens.min()) == int(lens.max()):
                self._arena.release_pages(idx.run_start[arr], int(lens[0]))
                self._recycle(rows)
                return
        for row in rows:
            self._arena.release(idx.runs(row))
        self._recycle(rows)

    def _recycle(self, rows: Sequence[int]) -> None:
        idx = self._index
        if idx.scatter or idx.anchors:
            for row in rows:
                idx.scatter.pop(row, None)
                idx.anchors.pop(row, None)
        idx.recycle(rows)

    def _drop(self, row: int) -> list[int]:
        """Force-remove a corrupt entry with its subtree (caller holds the lock).

        Leases are not honoured by a drop (the bytes are known bad), but a lease holder may be
        reading the entry's blocks zero-copy through :meth:`view` (a DMA in flight).  Reusing
        those blocks for another entry would hand that reader *another entry's* bytes, so the
        blocks of a leased dropped entry stay allocated and accounted — in limbo — until the last
        lease on it is released.
        """
        idx = self._index
        gens = {r: int(idx.gen[r]) for r in idx.subtree([row])}
        dropped = idx.drop(row)
        if not dropped:
            return dropped
        dead = set(gens.values())
        pins: dict[int, int] = {}
        for _rows, token_gens in self._lease_tokens.values():
            for g in token_gens.tolist() if isinstance(token_gens, np.ndarray) else token_gens:
                if g in dead:
                    pins[g] = pins.get(g, 0) + 1
        for r in dropped:
            count = pins.get(gens[r], 0)
            runs = idx.runs(r)
            if count:
                self._limbo[gens[r]] = (runs, count)
                idx.used_cost += _blocks_cost(runs, self._block)
            else:
                self._arena.release(runs)
        self._recycle(dropped)
        return dropped
