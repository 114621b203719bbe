"""The pinned provider's reservations: one page (``_PinnedReservation``) and a chain run of pages
reserved and sealed as one (``_PinnedRun``, ``reserve_many``'s chunk-level path)."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from hostkv_providers._errors import (
    HostKVError,
    ReservationError,
    UnknownKeyError,
)
from hostkv_providers._keys import Key
from hostkv_providers._region import HostRegion
from hostkv_providers._reservation import Lease, Reservation
from hostkv_providers.providers._tree._chainrun import TreeChainRun
from hostkv_providers.providers.pinned._arena import _checksums_at

if TYPE_CHECKING:
    from hostkv_providers.providers.pinned._writes import _Writes

__all__: list[str] = []


class _PinnedReservation(Reservation):
    # The regions (a list, a HostRegion and a memoryview per arena run) are built on first use:
    # a chain reservation that a copy engine fills through ``ReservedChain.pages`` and that is
    # sealed with checksums from the GPU never builds them (no per-page objects on that path).
    __slots__ = ("_regs", "runs")

    def __init__(self, provider: _Writes, key: Key, parent: Key | None, nbytes: int, salt_tag: str,
                 runs: list[tuple[int, int]]) -> None:
        super().__init__(provider, key, parent, nbytes, salt_tag)
        self.runs = runs
        self._regs: list[HostRegion] | None = None

    @property
    def _regions(self) -> list[HostRegion]:
        regs = self._regs
        if regs is None:
            prov: _Writes = self._provider  # type: ignore[assignment]
            regs = self._regs = prov._arena.regions(self.runs, self.nbytes, prov._allocator.pinned)
        return regs

    def regions(self) -> Sequence[HostRegion]:
        self.check_open(self._provider)
        return self._regions


class _PinnedRun(TreeChainRun):
    """A chain run of new pages in the arena (``PinnedProvider.reserve_many``'s fast path): the
    index holds it as one flight (``TreeIndex.begin_run``), its pages are ``starts`` (one piece of
    ``nblocks`` arena blocks each) and it seals with one ``TreeIndex.commit_run``."""

    __slots__ = ("nblocks", "starts")

    def __init__(self, prov: _Writes, run: Any, keys: list[Key], parent: Key | None, nbytes: int,
                 salt_tag: str, starts: npt.NDArray[np.int64], nblocks: int) -> None:
        super().__init__(prov, run, keys, parent, nbytes, salt_tag)
        self.starts = starts
        self.nblocks = nblocks

    def materialize(self) -> list[Reservation]:
        state = self._split()
        return self._per_page(
            state, lambda k, p, st: _PinnedReservation(self._prov, k, p, self.nbytes, self.salt_tag,
                                                       [(st, self.nblocks)]),
            self.starts.tolist())

    def seal(self, checksums: Sequence[int] | None, algorithm: str | None) -> None:
        self._seal(checksums, algorithm, False)

    def seal_held(self, checksums: Sequence[int] | None, algorithm: str | None) -> Lease:
        """Seal, and lease the pages in the commit's lock round: one lease over the run (its
        token is ``(rows, gens)`` arrays in key order), whose pages may be let go one by one
        (``PinnedProvider._release_part``).  The tiered provider pins its fast copies this way
        until their write-back, with no window in which another save could evict a page sealed
        but not yet leased, and no per-page object.  Aborts the run when it raises (as
        ``ReservedChain.seal`` does)."""
        try:
            lease = self._seal(checksums, algorithm, True)
            assert lease is not None
            return lease
        except BaseException:
            with contextlib.suppress(HostKVError):
                self.abort()
            raise

    def _seal(self, checksums: Sequence[int] | None, algorithm: str | None, hold: bool) -> Lease | None:
        prov = self._prov
        self._check_sealable()  # (its _check_usable comes before the write call, as it must)
        with prov._write_call():  # (a close waits for it: the hashing below reads the arena unlocked)
            return self._commit(checksums, algorithm, hold)

    def _commit(self, checksums: Sequence[int] | None, algorithm: str | None, hold: bool) -> Lease | None:
        prov = self._prov
        if checksums is not None and algorithm == prov.checksum_algorithm:
            digests = np.asarray(checksums, dtype=np.uint64)
        else:
            digests = _checksums_at(prov._arena, self.starts, self.nbytes, prov._sum)
        with prov._usable():
            if self.state != "open":
                raise ReservationError(f"this chain run is {self.state}")
            try:
                rows = prov._index.commit_run(self._run, nbytes=self.nbytes, csums=digests, tag=self.salt_tag,
                                       run_start=self.starts, run_len=self.nblocks)
            except UnknownKeyError:
                prov._arena.release_pages(self.starts, self.nblocks)
                self.state = "aborted"
                raise
            self.state = "sealed"
            self.sealed = self.n
            lease = prov._lease_run(self.keys, rows) if hold else None
        prov._tally("seals", self.n)
        prov._tally("bytes_written", self.n * self.nbytes)  # (copied in by a DMA or put_many)
        return lease

    def abort(self) -> None:
        prov = self._prov
        with prov._usable():
            if self.state != "open":
                return
            prov._index.cancel_run(self._run)
            prov._arena.release_pages(self.starts, self.nblocks)
            self.state = "aborted"
