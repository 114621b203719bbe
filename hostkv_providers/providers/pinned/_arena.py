"""The pinned provider's memory: the block arena (a coalescing free-run list over chunks of host
memory), the tree index with each entry's blocks, and the copy and hash helpers over its regions."""

from __future__ import annotations

import concurrent.futures
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from hostkv_providers._blockhash import tree_checksum_parts
from hostkv_providers._region import HostRegion
from hostkv_providers._span import ByteSpan
from hostkv_providers.device._hostmem import (
    HostAllocation,
    copy_bytes,
)
from hostkv_providers.providers._tree import TreeIndex

__all__: list[str] = []


class _Arena:
    """Blocks in chunks of host memory, with a coalescing free-run list."""

    def __init__(self, block: int, blocks_per_chunk: int) -> None:
        self.block = block
        self.bpc = blocks_per_chunk
        self.chunks: list[HostAllocation] = []
        self.total = 0  # blocks in ready chunks
        self.free = 0
        self._runs: dict[int, int] = {}  # start block -> length
        self._ends: dict[int, int] = {}  # end block (exclusive) -> start

    def add_chunk(self, alloc: HostAllocation, nblocks: int) -> None:
        start = len(self.chunks) * self.bpc
        self.chunks.append(alloc)
        self.total += nblocks
        self._release_run(start, nblocks)

    def _release_run(self, start: int, length: int) -> None:
        end = start + length
        cut = (start // self.bpc + 1) * self.bpc
        if end > cut:
            # A run may never span two chunks (separate allocations): a region cut from it would
            # stop at the chunk's end (bytes never written, a checksum over a short view) and a
            # page address past it would point outside the arena.
            self._release_run(start, cut - start)
            self._release_run(cut, end - cut)
            return
        self.free += length
        # coalesce with neighbours, but never across a chunk boundary (not contiguous memory)
        if start % self.bpc and start in self._ends:
            prev = self._ends.pop(start)
            length += self._runs.pop(prev)
            start = prev
        if end % self.bpc and end in self._runs:
            nxt_len = self._runs.pop(end)
            del self._ends[end + nxt_len]
            length += nxt_len
        self._runs[start] = length
        self._ends[start + length] = start

    def _take(self, start: int, length: int, want: int) -> tuple[int, int]:
        del self._runs[start]
        del self._ends[start + length]
        take = min(length, want)
        if take < length:
            self._runs[start + take] = length - take
            self._ends[start + length] = start + take
        self.free -= take
        return start, take

    def allocate(self, nblocks: int) -> list[tuple[int, int]]:
        """``nblocks`` blocks as ``[(start, length)]`` runs; caller checked ``free >= nblocks``."""
        best = None
        for start, length in self._runs.items():
            if length >= nblocks and (best is None or length < best[1]):
                best = (start, length)
                if length == nblocks:
                    break
        if best is not None:
            return [self._take(best[0], best[1], nblocks)]
        out: list[tuple[int, int]] = []
        need = nblocks
        for start, length in sorted(self._runs.items(), key=lambda r: -r[1]):
            out.append(self._take(start, length, need))
            need -= out[-1][1]
            if need == 0:
                break
        return out

    def allocate_pages(self, npages: int, nblocks: int) -> npt.NDArray[np.int64] | None:
        """``npages`` pieces of ``nblocks`` contiguous blocks each, as their start blocks (a numpy
        array), taken from the largest free runs first; ``None`` (nothing taken) when the free
        runs cannot be cut into that many pieces (fragmentation).  A chain run's pages this way
        cost a few dict operations per free run used, not per page."""
        taken: list[tuple[int, int]] = []
        need = npages
        for start, length in sorted(self._runs.items(), key=lambda r: -r[1]):
            k = min(need, length // nblocks)
            if k <= 0:
                break
            taken.append(self._take(start, length, k * nblocks))
            need -= k
            if need == 0:
                break
        if need:
            self.release(taken)
            return None
        return np.concatenate([np.arange(st, st + ln, nblocks, dtype=np.int64) for st, ln in taken])

    def release_pages(self, starts: npt.NDArray[np.int64], nblocks: int) -> None:
        """Give back pieces from :meth:`allocate_pages` (adjacent pieces go back as one run)."""
        if not len(starts):
            return
        st = np.sort(starts)
        # adjacent pieces go back as one run, but never across a chunk boundary
        breaks = np.flatnonzero((np.diff(st) != nblocks) | (st[1:] % self.bpc == 0)) + 1
        for piece in np.split(st, breaks):
            self._release_run(int(piece[0]), len(piece) * nblocks)

    def release(self, runs: Sequence[tuple[int, int]]) -> None:
        for start, length in runs:
            self._release_run(start, length)

    def regions(self, runs: Sequence[tuple[int, int]], nbytes: int, pinned: bool, *,
                readonly: bool = False) -> list[HostRegion]:
        out: list[HostRegion] = []
        offset = 0
        for start, length in runs:
            chunk = self.chunks[start // self.bpc]
            lo = (start % self.bpc) * self.block
            size = min(length * self.block, nbytes - offset)
            if size <= 0:
                break
            view = chunk.view[lo : lo + size]
            out.append(HostRegion(offset, view.toreadonly() if readonly else view, chunk.address + lo, pinned))
            offset += size
        return out

    def close(self) -> None:
        for chunk in self.chunks:
            chunk.close()
        self.chunks.clear()


class _PinnedIndex(TreeIndex):
    """The tree index with an entry's blocks: one contiguous run in the columns; the rare
    scattered entry (a fragmented arena) keeps its run list in ``scatter``."""

    COLS = (*TreeIndex.COLS, ("run_start", np.int64, 0), ("run_len", np.int64, 0))
    run_start: npt.NDArray[np.int64]
    run_len: npt.NDArray[np.int64]
    m_run_start: Any
    m_run_len: Any

    def __init__(self, budget: int) -> None:
        super().__init__(budget)
        self.scatter: dict[int, list[tuple[int, int]]] = {}

    def runs(self, row: int) -> list[tuple[int, int]]:
        runs = self.scatter.get(row)
        return runs if runs is not None else [(self.m_run_start[row], self.m_run_len[row])]


#: A lease's token and a ``Corrupt`` token name entries by ``(row, gen)`` pairs: rows are recycled.
_Token = tuple[Any, Any]  # (rows, gens): lists for a few rows, numpy arrays for a chain's


def _blocks_cost(runs: Sequence[tuple[int, int]], block: int) -> int:
    return block * sum(int(length) for _, length in runs)


def _scatter(regions: Sequence[HostRegion], span: ByteSpan, src: memoryview) -> None:
    """Copy ``src`` into bytes ``span`` of an entry laid out over ``regions``."""
    for r in regions:
        lo = max(span.offset, r.offset)
        hi = min(span.end, r.offset + len(r.view))
        if lo < hi:
            copy_bytes(r.view[lo - r.offset : hi - r.offset], src[lo - span.offset : hi - span.offset])


def _gather(regions: Sequence[HostRegion], span: ByteSpan, dst: memoryview) -> None:
    """Copy bytes ``span`` of an entry laid out over ``regions`` into ``dst``."""
    for r in regions:
        lo = max(span.offset, r.offset)
        hi = min(span.end, r.offset + len(r.view))
        if lo < hi:
            copy_bytes(dst[lo - span.offset : hi - span.offset], r.view[lo - r.offset : hi - r.offset])


# Seal-time hashing of large batches (zero-copy saves): XXH3 releases the GIL, so a few threads
# scale it.  H200 host, 13.4 GB chain: 8 threads hash at 45 GB/s and the save seals in 474 ms
# (DMA done at 313 ms); 12 threads hash at 56 GB/s alone but slow the DMA they overlap (528 /
# 386 ms), so the count stays at 8.
_HASH_THREADS = max(2, min(8, (os.cpu_count() or 2) // 2))
_hash_pool: concurrent.futures.ThreadPoolExecutor | None = None
_hash_pool_lock = threading.Lock()


def _split_hash(items: Sequence[Any], one: Callable[[Any], int], total: int) -> list[int]:
    """``[one(x) for x in items]``, split over a few threads when ``total`` bytes are worth it
    (one task per thread, not per page: no per-page futures)."""
    global _hash_pool
    if len(items) < 2 or total < (8 << 20):
        return [one(x) for x in items]
    with _hash_pool_lock:
        if _hash_pool is None:
            _hash_pool = concurrent.futures.ThreadPoolExecutor(_HASH_THREADS, thread_name_prefix="hostkv-hash")
        pool = _hash_pool
    step = -(-len(items) // _HASH_THREADS)
    futures = [pool.submit(lambda part: [one(x) for x in part], items[i : i + step])
               for i in range(0, len(items), step)]
    return [d for f in futures for d in f.result()]


def _checksums(entries: Sequence[Sequence[HostRegion]],
               fn: Callable[[Iterable[object]], int] = tree_checksum_parts) -> list[int]:
    """Seal checksums of many entries (each its regions); large batches over a few threads."""
    total = sum(sum(r.view.nbytes for r in regs) for regs in entries)
    return _split_hash(entries, lambda regs: fn(r.view for r in regs), total)


def _checksums_at(arena: _Arena, starts: npt.NDArray[np.int64], nbytes: int,
                  fn: Callable[[Iterable[object]], int] = tree_checksum_parts) -> npt.NDArray[np.uint64]:
    """Seal checksums of the pages of ``nbytes`` at arena blocks ``starts`` (a chain run sealed
    without checksums: the CPU copy engine's saves).  Each page's view lives only while it is
    hashed: a list of per-page regions built first (6,400 lists, regions and views per run) set
    off ~23 collections of the garbage collector per save in the engine's process."""
    chunks, bpc, block = arena.chunks, arena.bpc, arena.block

    def one(st: int) -> int:
        lo = (st % bpc) * block
        return fn((chunks[st // bpc].view[lo : lo + nbytes],))

    return np.array(_split_hash(starts.tolist(), one, len(starts) * nbytes), dtype=np.uint64)
