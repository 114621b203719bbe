"""The pinned provider's leases and zero-copy views (a layer of :class:`PinnedProvider`, see
``_base``): what a lease holds is its token's (row, gen) pairs; a chain run's lease may be let
go of page by page (the tiered provider's write-back)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import cast

import numpy as np
import numpy.typing as npt

from hostkv_providers._errors import InvalidArgumentError
from hostkv_providers._keys import Key
from hostkv_providers._region import HostPages, HostRegion
from hostkv_providers._reservation import Lease
from hostkv_providers.providers.pinned._arena import _blocks_cost, _split_hash, _Token
from hostkv_providers.providers.pinned._base import _NO_GEN, _PinnedBase


class _Leases(_PinnedBase):
    """Leases and views (a part of :class:`PinnedProvider`)."""

    def view(self, lease: Lease, key: bytes) -> Sequence[HostRegion] | None:
        """Read-only host regions of a leased entry (valid while the lease is held)."""
        return self.views(lease, [key])[0]

    def views(self, lease: Lease, keys: Sequence[bytes]) -> list[Sequence[HostRegion] | None]:
        """:meth:`view` of many keys under one lock round (``None`` for a key not leased)."""
        ks = self._keys(keys)
        if not isinstance(lease, Lease) or lease.released or lease.token is None or lease._provider is not self:
            raise InvalidArgumentError("view() needs an unreleased lease of this provider")
        held = self._held(lease)
        out: list[Sequence[HostRegion] | None] = []
        pinned = self._allocator.pinned
        with self._usable():
            idx, regions = self._index, self._arena.regions
            gen = idx.m_gen
            for row in idx.rows_of(ks):
                if row < 0 or held.get(row, -1) != gen[row]:
                    out.append(None)
                else:
                    out.append(regions(idx.runs(row), int(idx.nbytes[row]), pinned, readonly=True))
        return out

    @staticmethod
    def _held(lease: Lease) -> dict[int, int]:
        """The rows ``lease`` holds, with their gens.  What a lease holds is its token's (row,
        gen) pairs, not its keys: an entry dropped and saved again under the same key, or a page
        let go early (``_release_part``), is not held by it any more."""
        t_rows, t_gens = cast(_Token, lease.token)
        return dict(zip(t_rows.tolist() if isinstance(t_rows, np.ndarray) else t_rows,
                        t_gens.tolist() if isinstance(t_gens, np.ndarray) else t_gens, strict=True))

    def view_pages(self, lease: Lease, keys: Sequence[bytes]) -> HostPages | None:
        """:meth:`views` as one :class:`HostPages` (an address per page, no per-page objects), or
        ``None`` unless every key is leased, of one size and in one contiguous run of the arena
        (always so when ``block`` is the page size)."""
        if not isinstance(lease, Lease) or lease.released or lease.token is None or lease._provider is not self:
            raise InvalidArgumentError("view_pages() needs an unreleased lease of this provider")
        # The common case, a run of the lease's own keys (a restore of a hit, whole or part by
        # part): the lease's token already names their rows, so the keys are matched by one
        # C-speed slice comparison (equal to the lease's keys: valid keys, no further check) and
        # the rows checked by generation, not looked up one by one.
        known = self._leased_rows(lease, keys) if isinstance(keys, list | tuple) and keys else None
        ks: list[Key] = cast(list[Key], list(keys)) if known is not None else self._keys(keys)
        held = self._held(lease) if known is None else None
        with self._usable():
            idx, arena = self._index, self._arena
            if known is not None:
                rows, gens = known
                if not len(rows) or (rows < 0).any() or not (idx.alive[rows].all() and (idx.gen[rows] == gens).all()):
                    return None  # an entry of the lease was dropped (corrupt) meanwhile
            else:
                assert held is not None
                rows = np.asarray(idx.rows_of(ks), dtype=np.int64)
                gen = idx.m_gen
                # (what the lease holds, as views(): not its keys)
                if not len(rows) or (rows < 0).any() or any(held.get(r, -1) != gen[r] for r in rows.tolist()):
                    return None
            if idx.scatter and any(r in idx.scatter for r in rows.tolist()):
                return None  # a scattered entry is not one run
            sizes = idx.nbytes[rows]
            nbytes = int(sizes[0])
            if not nbytes or (sizes != nbytes).any():
                return None
            starts = idx.run_start[rows]
            bases = np.array([c.address for c in arena.chunks], dtype=np.uint64)
            addrs = bases[starts // arena.bpc] + ((starts % arena.bpc) * arena.block).astype(np.uint64)
            # for a verification of the copied bytes on the GPU (with verify=read)
            sums = idx.csum[rows].copy() if self._verify_reads else None
        # With verify=read the checksums go with the views: the cache checks the copied bytes
        # on the GPU (a view is never checked here: that would read every byte on the host).
        return HostPages(addrs, nbytes, pinned=self._allocator.pinned, readonly=True, keepalive=lease,
                         checksums=sums, algorithm=self.checksum_algorithm)

    @staticmethod
    def _leased_rows(lease: Lease, ks: Sequence[bytes]) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.uint64]] | None:
        """The ``(rows, gens)`` of ``ks`` from ``lease``'s token when ``ks`` is a run of the
        lease's keys (``lease.keys[j]`` is ``token[0][j]``), else ``None``."""
        lk = lease.keys
        n = len(ks)
        if not n or n > len(lk):
            return None
        j = 0
        if lk[0] != ks[0]:
            try:
                j = lk.index(ks[0])
            except ValueError:
                return None
        if lk[j : j + n] != tuple(ks):
            return None
        token: _Token = lease.token  # type: ignore[assignment]
        token_rows, token_gens = token
        return (np.asarray(token_rows[j : j + n], dtype=np.int64),
                np.asarray(token_gens[j : j + n], dtype=np.uint64))

    def _lease(self, ks: list[Key]) -> Lease:
        with self._usable():
            return self._lease_locked(ks, self._index.rows_of(ks))

    def _lease_locked(self, ks: list[Key], rows: Sequence[int]) -> Lease:
        """A lease of ``ks`` on their ``rows`` (``-1``: absent) (lock held)."""
        token = self._hold_rows(rows)
        self._lease_tokens[id(token)] = token
        return Lease(self, ks, [r >= 0 for r in rows], token=token)

    def _lease_run(self, ks: list[Key], rows: npt.NDArray[np.int64]) -> Lease:
        """One lease over the sealed ``rows`` of ``ks`` (lock held), its token ``(rows, gens)``
        arrays in key order, so that :meth:`_release_part` can let go of some pages."""
        idx = self._index
        idx.hold_rows(cast(Sequence[int], rows))
        token: _Token = (rows.copy(), idx.gen[rows].copy())
        self._lease_tokens[id(token)] = token
        return Lease(self, ks, [True] * len(ks), token=token)

    def _release_part(self, lease: Lease, positions: npt.NDArray[np.int64]) -> None:
        """Let go of the pages at ``positions`` of a :meth:`_lease_run` lease (each once; the
        rest stays held until they or the whole lease are released): the tiered provider frees
        a page's fast copy as soon as it is written back or dropped, not at the run's end."""
        with self._lock:
            if self._closed or lease.released or not len(positions):
                return
            rows, gens = cast(tuple[npt.NDArray[np.int64], npt.NDArray[np.uint64]], lease.token)
            pos = positions[rows[positions] >= 0]
            self._index.release_rows(cast(Sequence[int], rows[pos]), cast(Sequence[int], gens[pos]))
            self._leave_limbo(gens[pos].tolist())
            rows[pos] = -1
            gens[pos] = _NO_GEN  # (never a live gen: not counted as a pin when an entry drops)

    def _split_lease(self, lease: Lease, positions: npt.NDArray[np.int64]) -> list[Lease]:
        """The pages at ``positions`` of a :meth:`_lease_run` lease, each under a lease of its
        own (released on its own): the hold moves over in one lock round, never let go between."""
        with self._usable():
            if lease.released:
                raise InvalidArgumentError("_split_lease() needs an unreleased lease")
            rows, gens = cast(tuple[npt.NDArray[np.int64], npt.NDArray[np.uint64]], lease.token)
            keys, tokens = lease.keys, self._lease_tokens
            out = []
            for p, r, g in zip(positions.tolist(), rows[positions].tolist(), gens[positions].tolist(), strict=True):
                token: _Token = ([r], [g]) if r >= 0 else ([], [])
                tokens[id(token)] = token
                out.append(Lease(self, [keys[p]], [r >= 0], token=token))
            rows[positions] = -1
            gens[positions] = _NO_GEN
            return out

    def _run_views_sums(self, lease: Lease, positions: npt.NDArray[np.int64]
                        ) -> tuple[list[memoryview | None], npt.NDArray[np.uint64] | None]:
        """Read-only views of the pages at ``positions`` of a :meth:`_lease_run` lease (valid
        while held); ``None`` for one let go or dropped (its bytes failed ``verify``): what the
        tiered writer stores in the slow tier with one ``put_many``.  In the same lock round the
        pages' seal checksums when this store verifies reads (``None`` otherwise): the writer
        checks the bytes it copies out against them (:meth:`_first_bad`)."""
        with self._usable():
            rows, gens = cast(tuple[npt.NDArray[np.int64], npt.NDArray[np.uint64]], lease.token)
            r = rows[positions]
            idx, arena = self._index, self._arena
            live = r >= 0
            if lease.released:
                live[:] = False
            live[live] = idx.alive[r[live]] & (idx.gen[r[live]] == gens[positions][live])
            chunks, bpc, block, scatter = arena.chunks, arena.bpc, arena.block, idx.scatter
            views: list[memoryview | None] = []
            for ok, row, st, nb in zip(live.tolist(), r.tolist(), idx.run_start[r].tolist(),
                                       idx.nbytes[r].tolist(), strict=True):
                if not ok:
                    views.append(None)
                elif scatter and row in scatter:  # (a run's pages are one piece each; not so here)
                    regions = arena.regions(idx.runs(row), nb, False, readonly=True)
                    views.append(memoryview(b"".join(bytes(x.view) for x in regions)))
                else:
                    lo = (st % bpc) * block
                    views.append(chunks[st // bpc].view[lo : lo + nb].toreadonly())
            if not self._verify_reads:
                return views, None
            return views, idx.csum[np.maximum(r, 0)].astype(np.uint64)

    def _digests(self, views: Sequence[memoryview]) -> npt.NDArray[np.uint64]:
        """The checksums of ``views`` in this store's algorithm (large batches over a few
        threads, no lock): what a seal records, for bytes held outside the arena."""
        return np.array(_split_hash(list(views), lambda v: self._sum((v,)), sum(v.nbytes for v in views)),
                        dtype=np.uint64)

    def _first_bad(self, views: Sequence[memoryview], sums: npt.NDArray[np.uint64]) -> int:
        """Index of the first of ``views`` whose bytes do not hash to ``sums`` (this store's
        algorithm; large batches over a few threads, no lock); ``len(views)`` when all do."""
        digests = self._digests(views)
        bad = np.flatnonzero(digests != np.asarray(sums, dtype=np.uint64)[: len(views)])
        return int(bad[0]) if len(bad) else len(views)

    def _release_lease(self, lease: Lease) -> None:
        with self._lock:
            if self._closed:
                return
            token: _Token = lease.token  # type: ignore[assignment]
            self._lease_tokens.pop(id(token), None)
            self._index.release_rows(*token)
            # (limbo: dropped entries still leased; rare)
            self._leave_limbo((token[1].tolist() if isinstance(token[1], np.ndarray) else token[1])
                              if self._limbo else ())

    def _leave_limbo(self, gens: Iterable[int]) -> None:
        """Leases on the entries ``gens`` let go (lock held): a dropped entry's blocks are reused
        once its last lease is gone."""
        if self._limbo:
            for g in gens:
                held = self._limbo.get(g)
                if held is None:
                    continue
                runs, count = held
                if count > 1:
                    self._limbo[g] = (runs, count - 1)
                else:  # the last lease on a dropped entry let go: its blocks may be reused now
                    del self._limbo[g]
                    self._index.used_cost -= _blocks_cost(runs, self._block)
                    self._arena.release(runs)
