"""Slot allocation for the mmap store: free maps per data file, run search, new data files."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from hostkv_providers._errors import (
    CapacityError,
)
from hostkv_providers.providers import _fsutil
from hostkv_providers.providers._slotfile import (
    SlotFile,
    run_nslots,
)

from ._base import _MmapBase

if TYPE_CHECKING:
    pass


_log = logging.getLogger(__name__)


class _Allocation(_MmapBase):
    """Slot allocation (a part of :class:`MmapProvider`)."""

    # -- slot allocation -------------------------------------------------------------------------
    def _mark_used(self, fid: int, slots: npt.NDArray[np.int64], nslots: npt.NDArray[np.int64]) -> None:
        if not len(slots):
            return
        free = self._free[fid]
        if int(nslots.max()) == 1:
            free[slots] = False
            return
        offs = np.arange(int(nslots.sum())) - np.repeat(np.cumsum(nslots) - nslots, nslots)
        free[np.repeat(slots, nslots) + offs] = False

    def _run_ok(self, fid: int, slot: int, nslots: int, nbytes: int) -> bool:
        sf = self._files.get(fid)
        return (sf is not None and nslots >= 1 and slot >= 0 and slot + nslots <= sf.slot_count
                and 0 <= nbytes <= nslots * self._slot and nslots == run_nslots(nbytes, self._slot))

    def _run_free(self, fid: int, slot: int, nslots: int) -> bool:
        return bool(self._free[fid][slot : slot + nslots].all())

    def _release_run(self, fid: int, slot: int, nslots: int) -> None:
        free = self._free.get(fid)
        if free is not None:
            free[slot : slot + nslots] = True

    def _release_runs(self, fid: int, slots: npt.NDArray[np.int64], nslots: int) -> None:
        """:meth:`_release_run` of runs of ``nslots`` starting at ``slots``."""
        free = self._free.get(fid)
        if free is not None and len(slots):
            free[slots if nslots == 1 else (slots[:, None] + np.arange(nslots)).reshape(-1)] = True

    def _find_run(self, nslots: int) -> tuple[int, int] | None:
        """First-fit from a per-file cursor, scanning windows of the free map (amortised O(1)
        per allocation instead of a scan of a million-slot map), wrapping around once."""
        for fid, free in self._free.items():  # file ids are added in increasing order
            size = len(free)
            if size < nslots:
                continue
            start = self._cursor.get(fid, 0) % size
            if nslots == 1 and free.item(start):  # the common case (slots freed in order): no scan
                free[start] = False
                self._cursor[fid] = start + 1
                return fid, start
            for lo, hi in ((start, size), (0, min(size, start + nslots))):
                pos = lo
                while pos < hi:
                    end = min(hi, pos + 65536) if nslots == 1 else hi
                    window = free[pos:end]
                    if nslots == 1:
                        i = int(window.argmax())
                        if window[i]:
                            s = pos + i
                            free[s] = False
                            self._cursor[fid] = s + 1
                            return fid, s
                    else:
                        c = np.concatenate([[0], np.cumsum(window, dtype=np.int64)])
                        starts = np.flatnonzero(c[nslots:] - c[:-nslots] == nslots)
                        if len(starts):
                            s = pos + int(starts[0])
                            free[s : s + nslots] = False
                            self._cursor[fid] = s + nslots
                            return fid, s
                    pos = end
        return None

    def _allocate_many(self, n: int, nslots: int) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """``n`` free runs of ``nslots`` (file ids, first slots), first fit from each file's cursor
        as :meth:`_allocate` of each would take them; single slots are found with array scans
        (fresh space: one check), the rest and whatever the free maps lack then come from
        :meth:`_allocate` (which grows the store or evicts).  Caller holds the lock and already
        reserved the budget; on an error every run taken here is free again."""
        fids = np.empty(n, np.int64)
        slots = np.empty(n, np.int64)
        got = 0
        try:
            if nslots == 1:
                for fid, free in self._free.items():  # file ids are added in increasing order
                    size = len(free)
                    start = self._cursor.get(fid, 0) % size if size else 0
                    for lo, hi in ((start, size), (0, start)):
                        pos = lo
                        while pos < hi and got < n:
                            need = n - got
                            end = min(hi, pos + max(need, 65536))
                            if pos + need <= end and free[pos : pos + need].all():  # the common case
                                free[pos : pos + need] = False
                                fids[got:] = fid
                                slots[got:] = np.arange(pos, pos + need, dtype=np.int64)
                                got = n
                                self._cursor[fid] = pos + need
                                break
                            take = np.flatnonzero(free[pos:end])[:need] + pos
                            if len(take):
                                free[take] = False
                                fids[got : got + len(take)] = fid
                                slots[got : got + len(take)] = take
                                got += len(take)
                                self._cursor[fid] = int(take[-1]) + 1
                            pos = end
                    if got == n:
                        break
            while got < n:
                fid, slot = self._allocate(nslots, -1)
                fids[got], slots[got] = fid, slot
                got += 1
        except BaseException:
            for j in range(got):
                self._release_run(int(fids[j]), int(slots[j]), nslots)
            raise
        return fids, slots

    def _allocate(self, nslots: int, protect: int) -> tuple[int, int]:
        """A free run of ``nslots``; grows the store by a data file or evicts LRU leaves when the
        free space is fragmented.  Caller holds the lock and already reserved the budget."""
        while True:
            found = self._find_run(nslots)
            if found is not None:
                return found
            capacity = sum(len(f) for f in self._free.values()) * self._slot
            if capacity < self._budget + max(self._file_slots, nslots) * self._slot:
                self._add_data_file(max(self._file_slots, nslots))
                continue
            idx = self._idx
            if protect >= 0:
                idx._hold(protect)
            try:
                victims = idx.evict_cost(1)
            finally:
                if protect >= 0:
                    idx._unhold(protect)
            if not victims:
                raise CapacityError(f"no run of {nslots} free slots (fragmented and nothing evictable)")
            self._free_rows_storage(victims, journal=True)

    def _discard_leftover(self, path: str) -> None:
        """Remove a data file nothing refers to — one whose creation failed after its rename and
        whose cleanup failed too — so that it can be created again (else: "already exists")."""
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise _fsutil.io_error(exc, f"removing the unused {path}") from exc

    def _add_data_file(self, nslots: int) -> None:
        fid = max(self._files, default=-1) + 1
        self._discard_leftover(self._p(self._data_name(self._gen, fid)))  # never one in use: ids are max+1
        # Durable in every mode (one sync per new data file): with durability=none a power cut
        # could leave the name on an empty or short file, and open refused the whole store.
        sf = SlotFile.create(self._p(self._data_name(self._gen, fid)), slot_nbytes=self._slot, slot_count=nslots,
                             file_id=fid, store_id=self._store_id)
        sf.io = self._io
        self._files[fid] = sf
        self._free[fid] = np.ones(nslots, np.bool_)
