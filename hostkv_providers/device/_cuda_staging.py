"""The CUDA copy engine's base (a part of :class:`~._cuda_engine.CudaCopyEngine`, split by role as
the tiered provider is): the attributes every part shares, the fused gather/scatter kernel (NVRTC
source, launch), the device-side plane tables, the two staging slots per direction and their
chunking, and the helpers over host pages (coalescing adjacent pages into large DMA copies, the
pages a direct plan leaves to staging).

The engine is one object in layers, each a file of this folder and a base of the next:
:class:`_CudaBase` (here) -> :class:`~._cuda_issue._CudaIssue` (a save's and a whole restore's
copies, the shared restore) -> :class:`~._cuda_layers._CudaLayers` (layer-wise restores,
prestaging) -> :class:`~._cuda_engine.CudaCopyEngine` (construction, validation, the verbs,
stream order, lifecycle)."""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from hostkv_providers._region import HostPages
from hostkv_providers.device import _cuda, _direct
from hostkv_providers.device._cuda_sync import _FlagPool, _Reaper
from hostkv_providers.device._engine import CopyEngine, _Pages
from hostkv_providers.device._hostmem import _REGISTERED_STARTS, CudaPinnedAllocation, registration_starts
from hostkv_providers.device._order import _Worker
from hostkv_providers.device._planes import KVPlanes, _layer_spans

_MAX_CHUNK_PAGES = 512  # block ids travel as a by-value kernel parameter (2 KiB of the 4 KiB limit)

_KERNEL_SOURCE = r"""
typedef unsigned long long u64;
struct Ids { int v[MAX_PAGES]; };

// One work item = one tile of one plane slice of one page.  Items are page-major so that
// neighbouring CTAs touch neighbouring staging bytes.  The plane table holds, per plane,
// {base pointer, block stride, offset in the page, slice bytes}.
template <bool GATHER>
__device__ __forceinline__ void move(const u64* __restrict__ table, int nplanes, int npages,
                                     const Ids& ids, unsigned char* staging, u64 page_nbytes,
                                     u64 tile, u64 tiles) {
    const u64 total = (u64)npages * (u64)nplanes * tiles;
    for (u64 item = blockIdx.x; item < total; item += gridDim.x) {
        const u64 t = item % tiles;
        const u64 rest = item / tiles;
        const int plane = (int)(rest % (u64)nplanes);
        const int page = (int)(rest / (u64)nplanes);
        const u64* e = table + 4 * plane;
        const u64 nb = e[3];
        const u64 lo = t * tile;
        if (lo >= nb) continue;
        const u64 n = (nb - lo < tile) ? nb - lo : tile;
        unsigned char* dev = (unsigned char*)(e[0] + (u64)ids.v[page] * e[1]) + lo;
        unsigned char* stg = staging + (u64)page * page_nbytes + e[2] + lo;
        const unsigned char* src = GATHER ? dev : stg;
        unsigned char* dst = GATHER ? stg : dev;
        if ((((u64)src | (u64)dst | n) & 15) == 0) {
            const uint4* s4 = (const uint4*)src;
            uint4* d4 = (uint4*)dst;
            const u64 n4 = n >> 4;
#if STREAMING
            // Every byte is touched once: evict-first loads/stores keep the engine's working set in L2.
            #pragma unroll 4
            for (u64 i = threadIdx.x; i < n4; i += blockDim.x) __stcs(d4 + i, __ldcs(s4 + i));
#else
            #pragma unroll 4
            for (u64 i = threadIdx.x; i < n4; i += blockDim.x) d4[i] = s4[i];
#endif
        } else {
            for (u64 i = threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
        }
    }
}

extern "C" __global__ void hostkv_gather(const u64* table, int nplanes, int npages, Ids ids,
                                         unsigned char* staging, u64 page_nbytes, u64 tile, u64 tiles) {
    move<true>(table, nplanes, npages, ids, staging, page_nbytes, tile, tiles);
}

extern "C" __global__ void hostkv_scatter(const u64* table, int nplanes, int npages, Ids ids,
                                          unsigned char* staging, u64 page_nbytes, u64 tile, u64 tiles) {
    move<false>(table, nplanes, npages, ids, staging, page_nbytes, tile, tiles);
}
"""



class _Ids(ctypes.Structure):
    _fields_ = [("v", ctypes.c_int32 * _MAX_CHUNK_PAGES)]



def _coalesce_pages(addresses: Any, page_nbytes: int) -> list[tuple[int, int, int]]:
    """:meth:`CudaCopyEngine._coalesce` for whole pages given by address (numpy, no per-page
    objects): runs of adjacent pages that do not cross into another pinned allocation."""
    import numpy as np

    k = int(addresses.size)
    if not k:
        return []
    brk = np.ones(k, dtype=bool)
    if k > 1:
        brk[1:] = addresses[1:] != addresses[:-1] + np.uint64(page_nbytes)
        brk[1:] |= registration_starts(addresses[1:])
    first = np.flatnonzero(brk)
    lengths = np.diff(np.append(first, k))
    return [(int(i) * page_nbytes, int(addresses[i]), int(n) * page_nbytes)
            for i, n in zip(first.tolist(), lengths.tolist(), strict=True)]



def _page_addresses(pages: _Pages) -> Any:
    """The pages' start addresses as a ``uint64`` array when every page is one region, else ``None``."""
    import numpy as np

    if isinstance(pages, HostPages):
        return pages.addresses
    if all(len(page[1]) == 1 for page in pages):
        return np.fromiter((page[1][0] for page in pages), dtype=np.uint64, count=len(pages))
    return None



def _subset(ids: list[int], pages: _Pages, rest: Any) -> tuple[list[int], _Pages]:
    """The pages left to the staging path by a :class:`~._direct.DirectPlan` (``rest``: their
    indices; ``None``: all of them)."""
    if rest is None:
        return ids, pages
    idx = rest.tolist()
    sub_ids = [ids[i] for i in idx]
    if isinstance(pages, HostPages):
        if not idx:
            return sub_ids, []
        return sub_ids, HostPages(pages.addresses[rest], pages.page_nbytes, pinned=pages.pinned,
                                  readonly=pages.readonly)
    return sub_ids, [pages[i] for i in idx]



@dataclass(slots=True)
class _Table:
    dev_ptr: int
    host: Any  # pinned host copy, kept until the engine closes (the upload reads it asynchronously)
    event: Any



class _CudaBase(CopyEngine):
    """What every part of the CUDA engine shares (set by :meth:`CudaCopyEngine.__init__`; see
    the parameters there) and the staging machinery they all use."""

    device: int
    mode: str
    direct: str
    stream_gates: bool
    staging_bytes: int
    ctas: int
    threads: int
    tile_bytes: int
    shared_pages: list[int]
    _dev: Any
    _share: bool
    _planned: str
    _gather_fn: Any
    _scatter_fn: Any
    _streams: dict[str, Any]
    _restore_tail: Any
    _staging: dict[str, list[int]]
    _slot_events: dict[str, list[tuple[Any, Any]]]
    _slot: dict[str, int]
    _tables: dict[tuple[Any, ...], _Table]
    _table_lock: threading.Lock
    _checked: set[tuple[Any, ...]]
    _workers: dict[str, _Worker]
    _issue_locks: dict[str, threading.Lock]
    _flags: _FlagPool
    _reaper: _Reaper
    _sides: dict[str, _direct.BatchSide]

    @property
    def shares_restores(self) -> bool:
        """Whether this engine shares large restores with the staging path (``direct="shared"``
        with batch copies and the pack kernel both there): its worker then issues such a
        restore for as long as the restore moves, so a caller waiting until a transfer is issued
        (``TransferHandle.wait_on``) waits for the copies themselves; ``HostKVCache`` gates its
        GPU check stream instead (:meth:`gate`) for these engines.  (Restores under
        :data:`~._direct.BATCH_SPLIT_MIN` copies or from pageable pages are not shared.)"""
        return self._share and "restore" in self._sides and self.mode == "kernel"

    # -- plane tables -------------------------------------------------------------------------------
    def _table(self, planes: KVPlanes, *, layers: bool = False) -> _Table:
        """The device-side plane table for ``planes`` (uploaded once, on the aux stream).  With
        ``layers`` a plane's offset counts from its layer's first byte (layer-major staging)."""
        key = (planes.ptrs, planes.block_strides, tuple((s.offset, s.nbytes) for s in planes.layout.planes), layers)
        with self._table_lock:  # both direction workers may ask at once
            table = self._tables.get(key)
            if table is None:
                table = self._tables[key] = self._upload_table(planes, layers)
            return table

    def _upload_table(self, planes: KVPlanes, layers: bool = False) -> _Table:
        n = len(planes.ptrs)
        nbytes = 32 * n
        host = CudaPinnedAllocation(nbytes, self._dev, threads=1)
        arr = _cuda.c_array(ctypes.c_uint64, 4 * n).from_address(host.address)
        base = {layer: lo for layer, (_p0, _np, lo, _nb) in enumerate(_layer_spans(planes.layout))} if layers else {}
        for spec in planes.layout.planes:
            p = spec.index
            arr[4 * p: 4 * p + 4] = [planes.ptrs[p], planes.block_strides[p], spec.offset - base.get(spec.layer, 0),
                                     spec.nbytes]
        dev_ptr = self._dev.mem_alloc_async(nbytes, self._streams["aux"])
        d = _cuda.driver()
        _cuda.check(d.cuMemcpyHtoDAsync(dev_ptr, host.address, nbytes, self._streams["aux"]), "table upload")
        ev = self._dev.event()
        _cuda.check(d.cuEventRecord(ev, self._streams["aux"]), "cuEventRecord")
        return _Table(dev_ptr, host, ev)

    # -- staging --------------------------------------------------------------------------------
    def _per_chunk(self, nbytes: int) -> int:
        """Pages in one staged chunk of ``nbytes`` each (a whole page, or one layer of it)."""
        return max(1, min(_MAX_CHUNK_PAGES, self.staging_bytes // nbytes))

    def _chunks(self, n: int, page_nbytes: int) -> Iterator[tuple[int, int]]:
        per = self._per_chunk(page_nbytes)
        for lo in range(0, n, per):
            yield lo, min(n, lo + per)

    def _take_slot(self, direction: str, d: Any, stream: Any) -> int:
        """The next staging slot of ``direction`` (the two alternate), once ``stream`` has waited
        until the slot's last reader is done with it (its ``freed`` event).  The caller holds
        that direction's issue lock."""
        s = self._slot[direction]
        self._slot[direction] = s ^ 1
        _cuda.check(d.cuStreamWaitEvent(stream, self._slot_events[direction][s][1], 0), "cuStreamWaitEvent")
        return s

    def _launch(self, fn: Any, table: _Table, planes: KVPlanes, ids: Sequence[int], staging: int,
                stream: Any, span: tuple[int, int, int, int] | None = None) -> None:
        """One pack kernel over pages ``ids``; ``span`` (a :func:`_layer_spans` entry) limits it
        to one layer's planes, read from layer-major staging (``span``'s bytes per page)."""
        layout = planes.layout
        specs = layout.planes if span is None else layout.planes[span[0]: span[0] + span[1]]
        nplanes = len(specs)
        tiles = max(1, -(-max(s.nbytes for s in specs) // self.tile_bytes))
        table_ptr = table.dev_ptr + (0 if span is None else 32 * span[0])
        stride = layout.page_nbytes if span is None else span[3]
        idv = _Ids()
        idv.v[: len(ids)] = list(ids)
        args = [ctypes.c_uint64(table_ptr), ctypes.c_int32(nplanes), ctypes.c_int32(len(ids)), idv,
                ctypes.c_uint64(staging), ctypes.c_uint64(stride), ctypes.c_uint64(self.tile_bytes),
                ctypes.c_uint64(tiles)]
        grid = max(1, min(self.ctas, len(ids) * nplanes * tiles))
        _cuda.launch(fn, grid, self.threads, stream, args, "pack kernel launch")

    @staticmethod
    def _coalesce(pages: _Pages, lo: int, hi: int, page_nbytes: int) -> list[tuple[int, int, int]]:
        """``(staging_offset, host_address, nbytes)`` copies for pages ``[lo, hi)``, merged when both
        sides are contiguous (page-major staging + adjacent host pages = one large DMA) and the
        host side does not cross into another pinned allocation."""
        if isinstance(pages, HostPages):
            return _coalesce_pages(pages.addresses[lo:hi], page_nbytes)
        out: list[tuple[int, int, int]] = []
        s = a = m = -1  # the copy being extended
        base = 0
        for i in range(lo, hi):
            offsets, addresses, sizes = pages[i]
            for off, addr, n in zip(offsets, addresses, sizes, strict=True):
                if s + m == base + off and a + m == addr and addr not in _REGISTERED_STARTS:
                    m += n
                    continue
                if m > 0:
                    out.append((s, a, m))
                s, a, m = base + off, addr, n
            base += page_nbytes
        if m > 0:
            out.append((s, a, m))
        return out
