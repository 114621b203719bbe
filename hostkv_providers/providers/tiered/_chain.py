"""The tiered provider's chain reservation (``reserve_many``/``seal_many``: a save DMAs straight
into the fast tier) and the back-pressure that paces seals behind the write-back."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

from hostkv_providers._errors import (
    CapacityError,
    HostKVError,
    InFlightError,
    InvalidArgumentError,
    UnknownKeyError,
)
from hostkv_providers._keys import Key
from hostkv_providers._provider import (
    _DEFERRED,
    Reservation,
    ReservedChain,
    _check_checksums,
    _DeferredReservation,
)

from ._entries import _TieredReservation
from ._writeback import _WriteBack


class _Chains(_WriteBack):
    """Chain reservation and back-pressure (a part of :class:`TieredProvider`)."""

    def _wait_for_room(self) -> None:
        """Back-pressure: wait (without any lock held) while the write-back queue is full."""
        with self._room:
            while self._queued_pages >= self._queue_pages and self._writer.is_alive():
                self._room.wait(0.5)

    def _wait_write_back_below(self, pages: int) -> None:
        """Wait (no lock held) until at most ``pages`` write-backs are queued or in progress."""
        with self._room:
            while self._queued_pages > max(0, pages) and self._writer.is_alive():
                self._room.wait(0.5)

    def reserve_many(self, keys: Sequence[bytes], parents: Sequence[bytes | None], nbytes: int, *,
                     salt_tag: str = "") -> ReservedChain:
        """Reserve a chain run straight in the fast tier (see ``Provider.reserve_many``), so a
        copy engine DMAs into its (pinned) memory before the first seal.

        The tiered index takes the run in one lock round (a parent may be in flight: an earlier
        key of this call or of an earlier ``reserve_many``), then the fast tier reserves the run
        with its own ``reserve_many``, the run's first page as a root there (the fast tier is a
        byte cache under the tiered index; runs rooted apart stay evictable run by run).  Pages
        the fast tier cannot take even after a ``flush`` (pending write-backs pin its memory)
        are not refused: they get ordinary
        buffers and are stored when sealed, by the per-page path (fast tier or written
        through), like the base class's default; so are the pages after a parent of that kind.
        """
        ks = self._keys(keys)
        if isinstance(parents, (bytes, bytearray, memoryview, str)) or len(parents) != len(ks):
            raise InvalidArgumentError(f"{len(parents)} parents for {len(ks)} keys; give one per key")
        checked = [self._reserve_args(k, p, nbytes, salt_tag) for k, p in zip(ks, parents, strict=True)]
        self._check_usable()
        out: list[Reservation | None] = []
        error: HostKVError | None = None
        flown: list[tuple[int, Key, Key | None]] = []  # (position in out, key, parent) in the index
        deferred_from = len(checked)  # from here on: deferred pages (their parent is one)
        with self._lock:
            self._check_usable()
            for i, (k, p, n) in enumerate(checked):
                if p is not None and (id(self), p) in _DEFERRED:
                    deferred_from = i
                    break
                if n > self._budget:
                    error = CapacityError(f"{n} bytes exceed the whole budget of {self._budget}")
                    break
                try:
                    ok, evicted, _ = self._index.begin_chained(k, p, n)
                except (CapacityError, InFlightError, UnknownKeyError) as exc:
                    error = exc
                    break
                self._drop_from_tiers(evicted)
                if ok:
                    flown.append((len(out), k, p))
                out.append(None)
        if error is not None:
            deferred_from = len(out)
        inners: list[Reservation] = []
        try:
            inners = self._reserve_fast_run([(k, p) for _, k, p in flown], nbytes, salt_tag)
        except BaseException:
            with self._lock:
                for _, k, _ in flown:
                    self._index.cancel(k)
            raise
        for (j, k, p), inner in zip(flown, inners, strict=False):
            out[j] = _TieredReservation(self, k, p, nbytes, salt_tag, inner)
        if len(inners) < len(flown):
            # the fast tier is full: the rest of the run is stored page by page at seal
            with self._lock:
                for _, k, _ in flown[len(inners):]:
                    self._index.cancel(k)
            for j, k, p in flown[len(inners):]:
                out[j] = self._deferred(k, p, nbytes, salt_tag)
        if error is None:
            for k, p, n in checked[deferred_from:]:
                if self.present([k])[0]:
                    out.append(None)
                    continue
                if self.in_flight(k):
                    error = InFlightError(f"key {k.hex()[:16]} is being written by another writer", key=k)
                    break
                out.append(self._deferred(k, p, n, salt_tag))
        return ReservedChain(out, error)

    def _deferred(self, k: Key, p: Key | None, nbytes: int, salt_tag: str) -> Reservation:
        res = _DeferredReservation(self, k, p, nbytes, salt_tag)
        _DEFERRED[(id(self), k)] = res
        return res

    def _reserve_fast_run(self, run: Sequence[tuple[Key, Key | None]], nbytes: int,
                          salt_tag: str) -> list[Reservation]:
        """Fast-tier reservations for a prefix of ``run`` (all of it unless the fast tier is full
        even after a flush); no lock held (flush waits for the writer)."""
        got: list[Reservation] = []
        for attempt in range(4):
            rest = run[len(got):]
            if not rest:
                break
            ks = [k for k, _ in rest]
            # A copy left in the fast tier by an entry evicted earlier must not dedup this one.
            stale = [k for k, here in zip(ks, self.fast.present(ks), strict=True) if here]
            if stale:
                self.fast.evict(stale)
            # Each run is a tree of its own in the fast tier: its first page lands there as a root
            # (the tiered index keeps the real tree).  Chained onto the previous run instead, the
            # fast tier would hold one long chain whose only leaf is the parent of the page being
            # reserved (held): nothing evictable, so once full it could never take another page
            # (2,000 x 4 KiB over a 2 MiB fast tier: 1,485 pages fell back to per-page stores).
            mine = set(ks)
            fast_parents = [None] + [p if p in mine else None for _, p in rest[1:]]
            rc = self.fast.reserve_many(ks, fast_parents, nbytes, salt_tag=salt_tag)
            raced = None in rc.reservations  # stored in the fast tier since the eviction above
            for r in rc.reservations:
                if r is None:
                    break
                got.append(r)
            if raced:
                # not ours to seal: give back what follows it; the rest is stored at seal
                for r in rc.reservations[len(got) - (len(run) - len(rest)) + 1:]:
                    if r is not None:
                        with contextlib.suppress(HostKVError):
                            self.fast.abort(r)
                break
            if len(got) == len(run):
                break
            # Pages waiting for write-back pin fast memory: wait until as many as this run still
            # needs have gone (the writer stores them batch by batch, so the save and the
            # write-back keep running side by side), the last time for all of them.
            if attempt < 2:
                self._wait_write_back_below(self._queued_pages - (len(run) - len(got)))
            elif attempt == 2:
                self.flush()
        return got

    def seal_many(self, reservations: Sequence[Reservation], *, checksums: Sequence[int] | None = None,
                  algorithm: str | None = None) -> None:
        """Seal root first (see ``Provider.seal_many``): each run of fast-tier reservations with
        one ``seal_many`` of the fast tier (for ``pinned``: checksums on a few threads, commits
        in one lock round; given ``checksums`` in the fast tier's algorithm are passed on to it),
        then their tiered rows and write-backs; deferred pages are stored and written-through
        reservations sealed one by one.  On failure the sealed ones are a prefix and every other
        one is aborted."""
        _check_checksums(checksums, algorithm, len(reservations))
        for res in reservations:
            if not isinstance(res, Reservation) or res.provider is not self:
                raise InvalidArgumentError("seal_many() takes reservations of this provider")
        self._check_usable()
        i = 0
        try:
            while i < len(reservations):
                res = reservations[i]
                if isinstance(res, _TieredReservation) and res.inner.provider is self.fast:
                    j = i
                    while (j < len(reservations) and isinstance(reservations[j], _TieredReservation)
                           and reservations[j].inner.provider is self.fast):  # type: ignore[attr-defined]
                        j += 1
                    run: list[_TieredReservation] = [self._own_reservation(r, _TieredReservation)
                                                     for r in reservations[i:j]]
                    for r in run:
                        r.check_complete()
                    self._wait_for_room()
                    try:
                        if checksums is not None:
                            self.fast.seal_many([r.inner for r in run], checksums=checksums[i:j], algorithm=algorithm)
                        else:
                            self.fast.seal_many([r.inner for r in run])
                    finally:
                        for m, r in enumerate(run):  # a prefix is sealed in the fast tier
                            if r.inner.state != "sealed":
                                break
                            try:
                                self._commit_sealed(r, False)
                            except BaseException:
                                i += m
                                raise
                            self._tally("seals")
                    i = j
                elif isinstance(res, _DeferredReservation):
                    res._store()
                    i += 1
                else:
                    self.seal(res)
                    i += 1
        except BaseException:
            for rest in reservations[i:]:
                if rest.state == "open":
                    with contextlib.suppress(HostKVError):
                        rest.abort()
            raise
