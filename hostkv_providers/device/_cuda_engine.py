"""The CUDA copy engine: whole pages by ``cuMemcpyBatchAsync`` straight between host pages and
blocks (``direct="batch"``, the default; :mod:`._direct`), else a fused gather/scatter kernel
(NVRTC) into double-buffered device staging and large DMA copies, on dedicated streams; events and
stream memory operations for ordering."""

from __future__ import annotations

import ctypes
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from hostkv_providers._errors import (
    CopyArgumentError,
    CopyEngineError,
)
from hostkv_providers._region import HostPages
from hostkv_providers.device import _cuda, _direct
from hostkv_providers.device._cpu_engine import _segments
from hostkv_providers.device._cuda_sync import _CudaHandle, _CudaMark, _FlagPool, _Reaper
from hostkv_providers.device._engine import (
    CopyEngine,
    _check_distinct,
    _check_ids,
    _check_layers,
    _check_pages,
    _Pages,
    _stream_handle,
)
from hostkv_providers.device._hostmem import _REGISTERED_STARTS, CudaPinnedAllocation, registration_starts
from hostkv_providers.device._order import Gate, StreamMark, _NoGate, _Worker
from hostkv_providers.device._planes import _PAGE, KVPlanes, _layer_spans, _MiB
from hostkv_providers.device._transfer import TransferHandle

# --------------------------------------------------------------------------------------------
# CUDA
# --------------------------------------------------------------------------------------------

_MAX_CHUNK_PAGES = 512  # block ids travel as a by-value kernel parameter (2 KiB of the 4 KiB limit)
# A layer-wise restore's first staged chunks issued on the caller's thread (0.6-1.2 ms for two, H200):
# two keep the DMA busy (~0.6 ms a chunk of 32 MiB) through the hand-off to the worker, which
# issues the rest; the whole first layer there held an engine's thread ~2.6 ms (H200).
_INLINE_CHUNKS = 2

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


@dataclass
class _LayerJob:
    """A layer-major restore in the making (:meth:`CudaCopyEngine._layers_begin`): its events, the
    pages left to the staging path, and ``last``, the stream every layer's event is recorded on."""

    handle: _CudaHandle
    spans: list[tuple[int, int, int, int]]
    layer_evs: list[Any]
    done: Any
    ids_s: list[int]
    pages_s: _Pages
    addresses: Any
    table: _Table | None
    last: Any
    resume_layer: int = -1  # a layer issued in part (its first chunks, on the caller's thread)
    resume_at: int = 0  # the staged page it goes on from
    # Per staged chunk ``(c0, c1)``: its runs of adjacent host pages, each with the 2D copy that
    # moves one layer of it (``(first row in the chunk, host address, its CUDA_MEMCPY2D)``).  The
    # same for every layer but the source offset and the row width: built once, not per layer
    # (32x the coalescing and struct building, ~0.15 ms a chunk of Python holding the GIL).
    runs: dict[tuple[int, int], list[tuple[int, int, Any]]] = field(default_factory=dict)
    # ``(layer, c0, c1)`` -> the staging slot :meth:`CudaCopyEngine.prestage` already loaded
    prestaged: dict[tuple[int, int, int], int] = field(default_factory=dict)


class _Prestaged:
    """The first staged chunks of layer 0 of a layer-wise restore, moved host -> staging by
    :meth:`CudaCopyEngine.prestage` before the restore's block ids are known.  Those copies write
    the engine's own staging buffers only, so they may run while the caller checks what the
    restore writes (6,400 block ids and the hit's views: ~1 ms of Python on the H200 host, which
    layer 0 otherwise waits for).  Holds the restore issue lock (the staging slots are in use)
    until :meth:`CudaCopyEngine.restore` takes it (``prestaged=``) or :meth:`release` drops it."""

    def __init__(self, engine: CudaCopyEngine, layout: Any, start: Any, addresses: Any,
                 chunks: list[tuple[int, int, int]], runs: dict[tuple[int, int], list[tuple[int, int, Any]]]) -> None:
        self.engine = engine
        self.layout = layout
        self.start: Any = start  # the transfer's start event, recorded before the first copy
        self.addresses = addresses  # the staged pages' host addresses
        self.chunks = chunks  # (c0, c1, staging slot) in issue order
        self.runs = runs  # their 2D copies (a _LayerJob's runs)
        self._held = True
        self._once = threading.Lock()
        self.owner = threading.get_ident()  # the thread that holds the issue lock through it

    def take_start(self) -> Any:
        """The start event, owned by the caller from now on."""
        ev, self.start = self.start, None
        return ev

    def release(self) -> None:
        """Give the issue lock back (once); the staged bytes are simply never read.  Later
        copies into the same slots are ordered behind these on the DMA stream.  Unused (no
        restore took it: a refused restore), it first waits for its copies, which read the
        caller's pages: once the caller's restore has raised, nothing reads them any more (the
        caller may drop its lease and the store reuse the memory).  Refusals only: its chunks
        (~1.3 ms) behind whatever the DMA stream still had queued."""
        with self._once:
            if not self._held:
                return
            self._held = False
            self.engine._prestages.discard(self)
        try:
            if self.start is not None:
                engine = self.engine
                if self.chunks:
                    loaded = engine._slot_events["restore"][self.chunks[-1][2]][0]
                    with engine._dev.scope():  # (the lock still held: nobody re-records it)
                        _cuda.driver().cuEventSynchronize(loaded)
                engine._reaper.bury([self.start])
                self.start = None
        finally:
            self.engine._issue_locks["restore"].release()


class CudaCopyEngine(CopyEngine):
    """The CUDA copy engine for planes in device memory.

    Parameters
    ----------
    device:
        CUDA device ordinal; the planes must live there.
    staging_bytes:
        Size of each of the two device staging buffers per direction (4 in all).  A chunk is
        ``staging_bytes // page_nbytes`` pages (at most 512).  64 MiB keeps every DMA large.
    mode:
        ``"kernel"``: the fused NVRTC gather/scatter kernel plus bulk DMA (the fast path);
        ``"memcpy"``: one ``cuMemcpyAsync`` per plane slice, no staging (fallback, baseline);
        ``"auto"``: ``"kernel"`` when NVRTC works, else ``"memcpy"`` with a warning.
    ctas, threads:
        Launch shape of the pack kernel (grid-stride).  Few CTAs leave the SMs to the engine's
        kernels; default ``ctas`` is a quarter of the multiprocessors.
    tile_bytes:
        Bytes of a plane slice moved by one CTA iteration.
    cache_hints:
        Use evict-first (streaming) loads and stores in the pack kernel, so the copy does not push
        the engine's data out of L2.
    direct:
        Which pages go by DMA straight between host memory and the blocks (no staging buffer, no
        kernel, no SM of the engine's taken) instead of the staging path:

        * ``"batch"`` (the default): every page of a save or a whole restore, in any block
          order, by ``cuMemcpyBatchAsync`` (one copy per page and run of adjacent planes; CUDA
          12.8+ drivers, copies of at least 32 KiB, each page in one region, pinned pages;
          otherwise, and for layer-wise restores, the staging path).  Measured on the H200
          (docs/benchmarks.md, sessions 13-16), a graph-captured decode step beside back-to-back
          restores or saves runs at 1.01-1.03x of its time alone, p99 1.05-1.25x over 1,000
          steps (1.45x beside saves in one run on a slow host; the staging path's kernels: p50
          1.04-1.07x, p99 1.11-1.53x across session 16's runs).
          The driver's ~0.5 us per copy is host time, so calls of 4,096 copies or more are issued
          half by a second thread on a second stream.  Through the cache: with K and V of a block
          adjacent (FlashInfer's layout) restores at 0.97x of a bulk copy and saves at 0.95x;
          with vLLM's ``[2, blocks, ...]`` (32 KiB copies) restores at 0.94-0.96x and saves at
          0.91-0.94x, within ~1% of the staging path side by side, but moving more between runs
          (0.82-0.84x in one run each of sessions 13 and 16).  The driver's time per copy itself
          varies: 0.56-1.1 us from one restore to the next in session 17, and for seconds at a
          time so much that restores ran at 0.39-0.46x of a bulk copy (2 of 8 processes, saves
          unaffected); ``"shared"`` is designed to bound that.  Copies of 32 KiB move less
          steadily than 64 KiB ones: 20 restores of 13.4 GB in one process (session 18) took
          256-318 ms (median 0.89x) with 32 KiB copies, 247-251 ms (0.98x) with 64 KiB copies
          (K and V adjacent), 244-250 ms staged.
        * ``"shared"``: as ``"batch"``, but a restore of 4,096 copies or more is shared with the
          staging path (:class:`~._direct.Claims`): the side thread takes pages from the back by
          batch copies, this engine's worker stages chunks from the front whenever the GPU has
          caught up with the side's copies, so a slow driver costs SM time, not throughput.
          Saves go as ``"batch"`` moves them (their batch copies were never seen to slow down;
          shared, they ran at 0.86-0.91x and cost decode steps).  Measured on the H200
          (docs/benchmarks.md, sessions 17-18).
        * ``"auto"``: runs of consecutive block ids over adjacent host pages, at least 16 MiB of
          planes with slices of at least 8 KiB, one 2D copy per plane and run; ``"always"``: every
          such run; other pages staged.  2D rows of one plane slice move at 0.89-0.94x of a bulk
          copy (0.82x for saves).
        * ``"never"``: every page staged (the fused gather/scatter kernel plus bulk DMA):
          0.92-0.98x, and the only path for short slices; the choice where the last few percent
          of restore or save throughput matter more than the decode step beside them.

    stream_gates:
        How a stream is ordered behind copies not issued yet (``restore(before=)``, a cache
        handle's ``wait_on``/``wait_layer_on`` before the restore thread got that far).
        ``False`` (the default): the caller's thread waits until the copies are *issued* (not
        done), then the stream waits on their event (``cuStreamWaitEvent``): an order CUDA sees.
        ``True``: the stream waits on a device-visible flag at once (``cuStreamWaitValue32``,
        no host wait) that the worker sets behind the copies.  That order is invisible to CUDA:
        streams share the GPU's hardware queues (``CUDA_DEVICE_MAX_CONNECTIONS``, 8 by
        default; 1 in some training and serving setups), and where the gated stream shares one
        with a stream whose later work opens the flag (the copies, the opening write), that
        work queues behind the wait and the stream is held for good.  Measured on the H200:
        ``tests/device/gpu/test_layers_gpu.py`` hung at random in a gated layer-wise restore
        from ``mmap://`` (every host thread idle; docs/benchmarks.md, session 22).  Only for
        processes that control every stream's hardware queue.

    Streams: two non-blocking, lowest-priority streams per direction (pack and DMA), so the pack
    of chunk ``k+1`` overlaps the DMA of chunk ``k``; staging reuse is ordered by events.
    """

    def __init__(self, device: int = 0, *, staging_bytes: int = 64 * _MiB, mode: str = "auto",
                 ctas: int | None = None, threads: int = 256, tile_bytes: int = 16384,
                 cache_hints: bool = True, direct: str = "batch", stream_gates: bool = False) -> None:
        super().__init__()
        if not _cuda.available():
            raise CopyEngineError(f"CUDA is not usable: {_cuda.unavailable_reason()}", hint="use CpuCopyEngine")
        if mode not in ("auto", "kernel", "memcpy"):
            raise CopyArgumentError(f"mode must be 'auto', 'kernel' or 'memcpy', got {mode!r}")
        if type(staging_bytes) is not int or staging_bytes < _PAGE:
            raise CopyArgumentError(f"staging_bytes must be an int >= {_PAGE}, got {staging_bytes!r}")
        if type(tile_bytes) is not int or tile_bytes <= 0 or tile_bytes % 16:
            raise CopyArgumentError(f"tile_bytes must be a positive multiple of 16, got {tile_bytes!r}")
        if type(threads) is not int or not 32 <= threads <= 1024:
            raise CopyArgumentError(f"threads must be an int in [32, 1024], got {threads!r}")
        self.direct = _direct.check_direct(direct)
        if not isinstance(stream_gates, bool):
            raise CopyArgumentError(f"stream_gates must be a bool, got {stream_gates!r}")
        self.stream_gates = stream_gates
        # prestages holding the restore issue lock (a restore(before=) of this thread waits for a
        # worker that needs it: refused instead of hanging)
        self._prestages: set[_Prestaged] = set()
        # "shared" plans every transfer as "batch" does; large restores are then shared with the
        # staging path (_issue_shared)
        self._share = self.direct == "shared"
        self._planned = "batch" if self._share else self.direct
        self._dev = _cuda.device(device)
        self.device = device
        self._gather_fn: Any = None
        self._scatter_fn: Any = None
        if mode in ("auto", "kernel"):
            try:
                image = _cuda.compile_module(_KERNEL_SOURCE, "hostkv_pack.cu", self._dev.capability,
                                             (f"-DMAX_PAGES={_MAX_CHUNK_PAGES}",
                                              f"-DSTREAMING={int(bool(cache_hints))}"))
                self._gather_fn = _cuda.load_function(self._dev, image, "hostkv_gather")
                self._scatter_fn = _cuda.load_function(self._dev, image, "hostkv_scatter")
                mode = "kernel"
            except CopyEngineError as exc:
                if mode == "kernel":
                    raise
                warnings.warn(f"the pack kernel is unavailable ({exc}); using one memcpy per slice", stacklevel=2)
                mode = "memcpy"
        self.mode = mode
        self.staging_bytes = staging_bytes
        self.ctas = ctas if ctas is not None else max(8, self._dev.sm_count // 4)
        self.threads = threads
        self.tile_bytes = tile_bytes
        dev = self._dev
        self._streams = {name: dev.stream() for name in ("save_pack", "save_dma", "restore_dma", "restore_scatter",
                                                          "aux")}
        self._restore_tail = dev.event()  # (re-recorded under the restore issue lock only)
        self._staging: dict[str, list[int]] = {"save": [], "restore": []}
        self._slot_events: dict[str, list[tuple[Any, Any]]] = {}
        self._slot = {"save": 0, "restore": 0}
        if mode == "kernel":
            aux = self._streams["aux"]
            for direction in ("save", "restore"):
                self._staging[direction] = [dev.mem_alloc_async(staging_bytes, aux) for _ in range(2)]
                # (blocking-sync: a shared restore's worker waits on its slots' events per chunk,
                # and a prestaged layer-wise restore on one; the save side's are only waited on
                # by streams, where the flag does nothing)
                self._slot_events[direction] = [(dev.event(blocking=True), dev.event(blocking=True))
                                                for _ in range(2)]
            with dev.scope():  # our own stream only: the staging exists before any transfer uses it
                _cuda.check(_cuda.driver().cuStreamSynchronize(aux), "cuStreamSynchronize")
        self._tables: dict[tuple[Any, ...], _Table] = {}
        self._table_lock = threading.Lock()
        self._checked: set[tuple[Any, ...]] = set()
        self._workers = {"save": _Worker("hostkv-cuda-save"), "restore": _Worker("hostkv-cuda-restore")}
        # One issuer at a time per direction (staging slots and their events): the worker, or the
        # caller's thread for a layer-wise restore's first layer (_inline_first_layer).
        self._issue_locks = {"save": threading.Lock(), "restore": threading.Lock()}
        self._flags = _FlagPool(dev)
        self._reaper = _Reaper(dev)
        # direct="batch": a second thread and stream per direction issue half of each large batch
        self._sides: dict[str, _direct.BatchSide] = {}
        #: Pages of ``direct="shared"`` restores (:meth:`_issue_shared`): ``[staged, by batch
        #: copies]``, summed over the engine's life (what a benchmark reports).
        self.shared_pages = [0, 0]
        if self._planned == "batch" and _cuda.batch_memcpy() is not None:
            self._sides = {name: _direct.BatchSide(dev, f"hostkv-cuda-{name}-side") for name in ("save", "restore")}

    # -- validation ----------------------------------------------------------------------------
    def _check_planes(self, planes: KVPlanes) -> None:
        if not isinstance(planes, KVPlanes):
            raise CopyArgumentError(f"planes must be KVPlanes, got {type(planes).__name__}")
        if planes.device != self.device:
            where = "host memory" if planes.device < 0 else f"cuda:{planes.device}"
            raise CopyArgumentError(f"this engine copies for cuda:{self.device}, the planes are in {where}",
                                    hint="use CpuCopyEngine for host planes, or an engine per device")
        key = (planes.ptrs, planes.block_strides, planes.num_blocks)
        if key in self._checked:
            return
        for spec in planes.layout.planes:
            ptr = planes.ptrs[spec.index]
            end = ptr + (planes.num_blocks - 1) * planes.block_strides[spec.index] + spec.nbytes
            try:
                start, size, ordinal = self._dev.pointer_range(ptr)
            except CopyEngineError as exc:
                raise CopyArgumentError(f"plane {spec.index}: {ptr:#x} is not device memory ({exc})") from None
            if ordinal != self.device:
                raise CopyArgumentError(f"plane {spec.index}: memory is on cuda:{ordinal}, not cuda:{self.device}")
            if end > start + size:
                raise CopyArgumentError(
                    f"plane {spec.index}: {planes.num_blocks} blocks reach {end - start - size} bytes past "
                    f"the allocation that holds them")
        self._checked.add(key)

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

    # -- stream order ----------------------------------------------------------------------------
    @property
    def shares_restores(self) -> bool:
        """Whether this engine shares large restores with the staging path (``direct="shared"``
        with batch copies and the pack kernel both there): its worker then issues such a
        restore for as long as the restore moves, so a caller waiting until a transfer is issued
        (``TransferHandle.wait_on``) waits for the copies themselves; ``HostKVCache`` gates its
        GPU check stream instead (:meth:`gate`) for these engines.  (Restores under
        :data:`~._direct.BATCH_SPLIT_MIN` copies or from pageable pages are not shared.)"""
        return self._share and "restore" in self._sides and self.mode == "kernel"

    def mark(self, stream: Any) -> StreamMark | None:
        if stream is None or isinstance(stream, StreamMark):
            return stream
        s = _stream_handle(stream, "after")
        assert s is not None
        ev = self._dev.event()
        with self._dev.scope():
            _cuda.check(_cuda.driver().cuEventRecord(ev, s), "cuEventRecord(mark)")
        return _CudaMark(self._reaper, ev)

    def gate(self, stream: Any) -> Gate:
        if stream is None:
            return _NoGate()
        s = _stream_handle(stream, "before")
        assert s is not None
        self._check_open()
        return self._flags.gate(s)

    # -- the verbs -----------------------------------------------------------------------------
    def save(self, planes: KVPlanes, block_ids: Sequence[int], dst: Sequence[Any] | HostPages, *,
             after: Any = None) -> TransferHandle:
        self._check_open()
        self._check_planes(planes)
        ids = _check_ids(planes, block_ids)
        pages = _check_pages(planes.layout, dst, len(ids), writable=True)
        # Recorded now, on the caller's thread: the save sees exactly the work queued so far.  A
        # mark made earlier (HostKVCache.save marks at its own call) is used as it is.
        mark = self.mark(after)
        handle = _CudaHandle(len(ids) * planes.layout.page_nbytes, self)
        handle.keep = (planes, dst, mark)
        after_ev = mark.event if isinstance(mark, _CudaMark) else None
        dplan = self._plan(planes, ids, pages, dst)
        self._submit("save", handle, lambda: self._issue_save(handle, planes, ids, pages, after_ev, dplan))
        return handle

    def restore(self, src: Sequence[Any] | HostPages, planes: KVPlanes, block_ids: Sequence[int], *,
                before: Any = None, layerwise: bool = False, layers: range | None = None,
                prestaged: _Prestaged | None = None) -> TransferHandle:
        """:meth:`CopyEngine.restore`; ``prestaged``: from :meth:`prestage` for these pages
        (a layer-wise restore of every layer): its chunks are not copied again."""
        try:
            self._check_open()
            self._check_planes(planes)
            ids = _check_ids(planes, block_ids)
            _check_distinct(ids)
            pages = _check_pages(planes.layout, src, len(ids), writable=False)
            moved = _check_layers(planes.layout, layerwise, layers)
            if before is not None and not self.stream_gates:
                self.check_stream(before)  # (waited on below, after the submit: refused here)
                me = threading.get_ident()
                if any(p.owner == me and p is not prestaged for p in list(self._prestages)):
                    raise CopyArgumentError("this thread holds a prestage (the restore issue lock) that this "
                                            "restore does not take: pass it as prestaged= or release() it first")
            dplan = self._plan(planes, ids, pages, src, layerwise=moved is not None)
            if prestaged is not None and not self._prestage_fits(prestaged, planes, pages, moved, dplan):
                prestaged.release()
                prestaged = None
        except BaseException:
            if prestaged is not None:
                prestaged.release()
            raise
        # stream_gates: the stream is held back from now on (a wait on a device-visible flag)
        # and the worker opens it behind the copies.  Otherwise (the default) this thread waits
        # below until the worker has issued them, then the stream waits on their event.
        gate = self.gate(before) if self.stream_gates else None
        handle = _CudaHandle(len(ids) * planes.layout.page_nbytes, self, planes.layout.num_layers)
        handle.keep = (planes, src)
        if moved is None:
            self._submit("restore", handle, lambda: self._issue_restore(handle, planes, ids, pages, dplan), gate)
        else:
            handle.layers = moved if layers is not None else None
            handle.nbytes = len(ids) * sum(span[3] for span in _layer_spans(planes.layout)[moved.start: moved.stop])
            handle._recorded = [threading.Event() for _ in range(planes.layout.num_layers)]
            pre = self._inline_first_layer(handle, planes, ids, pages, moved, dplan, prestaged)
            self._submit("restore", handle,
                         lambda: self._issue_restore_layers(handle, planes, ids, pages, moved, dplan, pre), gate)
        if before is not None and gate is None:
            try:
                handle.wait_on(before)
            except CopyEngineError:
                if handle._error is None:
                    raise  # (a driver error ordering the stream; a failed transfer's handle reports it)
        return handle

    def check_stream(self, stream: Any) -> None:
        """Raise :class:`CopyArgumentError` unless ``stream`` is one this engine can order (a
        ``torch.cuda.Stream``, a ``CUstream`` or its int handle)."""
        _stream_handle(stream, "before")

    def prestage(self, pages: HostPages, layout: Any, count: int) -> _Prestaged | None:
        """Begin a layer-wise restore of ``count`` pages before its block ids are checked: the
        host -> staging copies of layer 0 of its first chunks (``pages``: the first pages' views,
        at least that many), which touch no engine memory.  ``None`` where it does not apply
        (another restore is being issued, memcpy mode, ``direct="auto"`` or ``"always"``, pages
        not in one region each) or fails; otherwise pass the result to
        :meth:`restore` (``prestaged=``) or call its ``release()``.  The issue lock is held until
        then: keep that span short."""
        if self.mode != "kernel" or not isinstance(pages, HostPages) or count < 1:
            return None
        if not _direct.stages_all(self._planned):
            return None  # (its pages go by direct DMA: nothing is staged)
        if pages.page_nbytes != layout.page_nbytes or layout.num_layers < 2:
            return None
        lock = self._issue_locks["restore"]
        if not lock.acquire(blocking=False):
            return None
        pre: _Prestaged | None = None
        try:
            self._check_open()
            spans = _layer_spans(layout)
            nb = spans[0][3]
            per = self._per_chunk(nb)
            k = min(count, len(pages), per * _INLINE_CHUNKS)
            if k < min(count, per * _INLINE_CHUNKS):
                lock.release()  # (held, every later restore's issue would wait for it for good)
                return None  # too few views for the first chunks
            d = _cuda.driver()
            with self._dev.scope():
                start = self._dev.event(timing=True)
                pre = _Prestaged(self, layout, start, pages.addresses[:k].copy(), [], {})
                self._prestages.add(pre)
                _cuda.check(d.cuEventRecord(start, self._streams["restore_dma"]), "cuEventRecord")
                for c0 in range(0, k, per):
                    c1 = min(k, c0 + per)
                    s = self._stage_layer_chunk(d, pre.runs, pre.addresses, c0, c1, spans[0], layout.page_nbytes)
                    pre.chunks.append((c0, c1, s))
            return pre
        except Exception:
            if pre is not None:
                pre.release()  # copies already enqueued land in staging nobody reads
            else:
                lock.release()
            return None

    def prestage_pages(self, layout: Any) -> int:
        """How many leading pages :meth:`prestage` stages (the views it needs)."""
        nb = _layer_spans(layout)[0][3]
        return self._per_chunk(nb) * _INLINE_CHUNKS

    def _prestage_fits(self, pre: _Prestaged, planes: KVPlanes, pages: _Pages, moved: range | None,
                       dplan: _direct.DirectPlan) -> bool:
        """Whether the restore's own pages begin with the prestaged ones (same layout, layer 0
        first, every page staged): else they are copied again."""
        k = len(pre.addresses)
        return (pre.engine is self and pre.layout == planes.layout and moved is not None and moved.start == 0
                and not dplan.runs and isinstance(pages, HostPages) and len(pages) >= k
                and bool((pages.addresses[:k] == pre.addresses).all()))

    def _stage_layer_chunk(self, d: Any, runs_cache: dict[tuple[int, int], list[tuple[int, int, Any]]],
                           addresses: Any, c0: int, c1: int, span: tuple[int, int, int, int], P: int) -> int:
        """Copy one layer (``span``) of the pages ``[c0, c1)`` (their ``addresses``, each one
        region) into the next restore staging slot, layer-major; returns the slot, its
        ``loaded`` event recorded.  The caller holds the restore issue lock."""
        dma = self._streams["restore_dma"]
        _p0, _np, lo, nb = span
        s = self._take_slot("restore", d, dma)  # (its scatter out of the slot done)
        staging = self._staging["restore"][s]
        loaded = self._slot_events["restore"][s][0]
        runs = runs_cache.get((c0, c1))
        if runs is None:
            host_mem = d.CUmemorytype.CU_MEMORYTYPE_HOST
            dev_mem = d.CUmemorytype.CU_MEMORYTYPE_DEVICE
            runs = runs_cache[(c0, c1)] = []
            for off, addr, m in _coalesce_pages(addresses[c0:c1], P):
                cp = d.CUDA_MEMCPY2D()
                cp.srcMemoryType = host_mem
                cp.srcPitch = P
                cp.dstMemoryType = dev_mem
                cp.Height = m // P
                runs.append((off // P, addr, cp))
        for row, addr, cp in runs:  # (the driver reads the struct during the call)
            cp.srcHost = addr + lo
            cp.dstDevice = staging + row * nb
            cp.dstPitch = nb
            cp.WidthInBytes = nb
            _cuda.check(d.cuMemcpy2DAsync(cp, dma), "cuMemcpy2DAsync")
        _cuda.check(d.cuEventRecord(loaded, dma), "cuEventRecord")
        return s

    def _plan(self, planes: KVPlanes, ids: list[int], pages: _Pages, given: Any, *,
              layerwise: bool = False) -> _direct.DirectPlan:
        """The direct plan of a transfer (``given``: the caller's pages as passed, whose regions
        say whether they are pinned: batch copies are only for pinned pages).  A layer-wise
        restore is staged where :func:`_direct.stages_all` says so (``direct="batch"``)."""
        if self._planned == "never" or (layerwise and _direct.stages_all(self._planned)):
            return _direct.NO_PLAN
        pinned = self._planned != "batch" or _direct.pages_pinned(given)
        return _direct.plan(self._planned, planes.layout, ids, _page_addresses(pages), pinned=pinned, planes=planes)

    def _inline_first_layer(self, handle: _CudaHandle, planes: KVPlanes, ids: list[int], pages: _Pages,
                            moved: range, dplan: _direct.DirectPlan,
                            prestaged: _Prestaged | None = None) -> _LayerJob | None:
        """Start a layer-wise restore on the caller's thread, when no restore is being issued by
        the worker: the first layer's direct runs and its first staged chunks (``_INLINE_CHUNKS``;
        a layer that fits in them is recorded before the call returns; all of it after a
        :meth:`prestage`, which also holds the issue lock already), so layer 0's copies start
        at the call, not after the hand-off to the worker (~0.4 ms) — the engine's layer-0 prefill
        waits for exactly these; the worker goes on from there.  The restore issue lock keeps the
        staging buffers and their events to one issuer at a time; when the worker holds it, or in
        ``memcpy`` mode (a copy per slice: too long for the caller's thread), ``None``: the worker
        issues every layer."""
        if prestaged is None:
            if self.mode != "kernel" and not dplan.all_direct:
                return None
            lock = self._issue_locks["restore"]
            if not lock.acquire(blocking=False):
                return None
            if self._closed:  # close() gave up waiting for this lock (a caller's bug): the worker refuses
                lock.release()
                return None
            release = lock.release
        else:  # the lock is held since prestage()
            release = prestaged.release
        # Prestaged (a cache's restore): the whole first layer here.  Handed to the worker after a
        # few chunks, the rest of layer 0 waited for the GIL behind the caller's and the cache's
        # threads (default 5 ms switch interval): layer 0 took 8.3-9.9 ms on the device against
        # 8.2 issued here, H200; restore() returns ~1 ms later for it.
        chunks = None if prestaged is not None else _INLINE_CHUNKS
        try:
            with self._dev.scope():
                job = self._layers_begin(handle, planes, ids, pages, moved, dplan, prestaged)
                self._layers_issue(job, planes, ids, dplan, [moved.start], chunks=chunks)
        except Exception:  # the worker issues every layer and reports what fails there
            return None  # (copies already enqueued repeat the same bytes; the stream gate stays the worker's)
        finally:
            release()
        return job

    def _submit(self, direction: str, handle: _CudaHandle, issue: Callable[[], None],
                gate: Gate | None = None) -> None:
        def job() -> None:
            try:
                self._dev.activate()
                self._reaper.reap()
                with self._issue_locks[direction]:
                    issue()
                handle._issued.set()
            except BaseException as exc:
                handle._fail(exc)
            if gate is not None:
                if handle._error is None:
                    gate.open_after([handle])
                else:
                    gate.open_now()

        with self._lock:
            self._check_open()
            self._workers[direction].submit(job)

    # -- issuing (worker threads) --------------------------------------------------------------
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

    def _issue_save(self, handle: _CudaHandle, planes: KVPlanes, ids: list[int], pages: _Pages,
                    after_ev: Any, dplan: _direct.DirectPlan = _direct.NO_PLAN) -> None:
        d = _cuda.driver()
        dev = self._dev
        pack, dma = self._streams["save_pack"], self._streams["save_dma"]
        start, done = dev.event(timing=True), dev.event(timing=True)
        handle._set_events(start, done)
        first = dma if self.mode == "memcpy" or dplan.runs else pack
        if after_ev is not None:  # the mark owns the event (destroyed with it)
            _cuda.check(d.cuStreamWaitEvent(first, after_ev, 0), "cuStreamWaitEvent(after)")
            if first is not pack and self.mode != "memcpy":
                _cuda.check(d.cuStreamWaitEvent(pack, after_ev, 0), "cuStreamWaitEvent(after)")
        _cuda.check(d.cuEventRecord(start, first), "cuEventRecord")
        layout = planes.layout
        if dplan.runs:  # straight from the blocks into the host pages, then the rest staged
            _direct.issue(d, planes, ids, dplan, layout.planes, dma, to_device=False,
                          side=self._sides.get("save"))
            ids, pages = _subset(ids, pages, dplan.rest)
        if self.mode == "memcpy":
            for b, page in zip(ids, pages, strict=True):
                for spec in layout.planes:
                    src = planes.ptrs[spec.index] + b * planes.block_strides[spec.index]
                    for off, addr, n in _segments(page, spec.offset, spec.nbytes):
                        _cuda.check(d.cuMemcpyDtoHAsync(addr, src + off - spec.offset, n, dma), "cuMemcpyDtoHAsync")
        elif ids:
            table = self._table(planes)
            _cuda.check(d.cuStreamWaitEvent(pack, table.event, 0), "cuStreamWaitEvent(table)")
            for lo, hi in self._chunks(len(ids), layout.page_nbytes):
                s = self._take_slot("save", d, pack)  # (its DMA out of the slot done)
                staging = self._staging["save"][s]
                packed, freed = self._slot_events["save"][s]
                self._launch(self._gather_fn, table, planes, ids[lo:hi], staging, pack)
                _cuda.check(d.cuEventRecord(packed, pack), "cuEventRecord")
                _cuda.check(d.cuStreamWaitEvent(dma, packed, 0), "cuStreamWaitEvent")
                for off, addr, n in self._coalesce(pages, lo, hi, layout.page_nbytes):
                    _cuda.check(d.cuMemcpyDtoHAsync(addr, staging + off, n, dma), "cuMemcpyDtoHAsync")
                _cuda.check(d.cuEventRecord(freed, dma), "cuEventRecord")
        _cuda.check(d.cuEventRecord(done, dma), "cuEventRecord")

    def _issue_restore(self, handle: _CudaHandle, planes: KVPlanes, ids: list[int], pages: _Pages,
                       dplan: _direct.DirectPlan = _direct.NO_PLAN) -> None:
        d = _cuda.driver()
        dev = self._dev
        dma, scatter = self._streams["restore_dma"], self._streams["restore_scatter"]
        start, done = dev.event(timing=True), dev.event(timing=True)
        handle._set_events(start, done)
        _cuda.check(d.cuEventRecord(start, dma), "cuEventRecord")
        layout = planes.layout
        arrays = self._shared_copies(planes, dplan)
        if arrays is not None:
            self._issue_shared(planes, ids, pages, arrays, dma, scatter, done)
            return
        if dplan.runs:  # straight into the blocks first (the staged chunks' events then imply them)
            _direct.issue(d, planes, ids, dplan, layout.planes, dma, to_device=True,
                          side=self._sides.get("restore"))
            ids, pages = _subset(ids, pages, dplan.rest)
        if not ids or self.mode == "memcpy":
            for b, page in zip(ids, pages, strict=True):
                for spec in layout.planes:
                    dst = planes.ptrs[spec.index] + b * planes.block_strides[spec.index]
                    for off, addr, n in _segments(page, spec.offset, spec.nbytes):
                        _cuda.check(d.cuMemcpyHtoDAsync(dst + off - spec.offset, addr, n, dma), "cuMemcpyHtoDAsync")
            # ``done`` on the scatter stream, as every staged or shared restore records it (behind
            # this one's copies by a tail event): a restore whose pages all went direct must not
            # complete before an earlier one's scatter (one direction's transfers complete in
            # submission order, which the cache's handle events rely on), and the copies of the
            # next restore on the DMA stream are not held back by it
            tail = self._restore_tail
            _cuda.check(d.cuEventRecord(tail, dma), "cuEventRecord(tail)")
            _cuda.check(d.cuStreamWaitEvent(scatter, tail, 0), "cuStreamWaitEvent(tail)")
            _cuda.check(d.cuEventRecord(done, scatter), "cuEventRecord")
            return
        table = self._table(planes)
        _cuda.check(d.cuStreamWaitEvent(scatter, table.event, 0), "cuStreamWaitEvent(table)")
        for lo, hi in self._chunks(len(ids), layout.page_nbytes):
            s = self._take_slot("restore", d, dma)  # (its scatter out of the slot done)
            staging = self._staging["restore"][s]
            loaded, freed = self._slot_events["restore"][s]
            for off, addr, n in self._coalesce(pages, lo, hi, layout.page_nbytes):
                _cuda.check(d.cuMemcpyHtoDAsync(staging + off, addr, n, dma), "cuMemcpyHtoDAsync")
            _cuda.check(d.cuEventRecord(loaded, dma), "cuEventRecord")
            _cuda.check(d.cuStreamWaitEvent(scatter, loaded, 0), "cuStreamWaitEvent")
            self._launch(self._scatter_fn, table, planes, ids[lo:hi], staging, scatter)
            _cuda.check(d.cuEventRecord(freed, scatter), "cuEventRecord")
        _cuda.check(d.cuEventRecord(done, scatter), "cuEventRecord")

    def _shared_copies(self, planes: KVPlanes, dplan: _direct.DirectPlan) -> tuple[Any, ...] | None:
        """The batch copies of a ``direct="shared"`` restore that the staging path shares
        (:class:`~._direct.Claims`): one of at least :data:`~._direct.BATCH_SPLIT_MIN` copies, with
        the scatter kernel and the restore side thread there; ``None`` for any other (those go as
        ``direct="batch"`` moves them, as every save does)."""
        if not self.shares_restores or dplan.ids is None or dplan.addresses is None:
            return None
        groups = len(_direct.copy_groups(planes.ptrs, planes.block_strides, planes.layout.planes,
                                         blocks=planes.num_blocks)[3])
        if groups * len(dplan.ids) < _direct.BATCH_SPLIT_MIN:  # (an upper bound: no arrays built twice)
            return None
        arrays = _direct.batch_copies(planes.ptrs, planes.block_strides, planes.layout.planes, dplan.ids,
                                      dplan.addresses, to_device=True, blocks=planes.num_blocks)
        return arrays if arrays[2].size >= _direct.BATCH_SPLIT_MIN else None

    def _issue_shared(self, planes: KVPlanes, ids: list[int], pages: _Pages, arrays: tuple[Any, ...],
                      dma: Any, scatter: Any, done: Any) -> None:
        """A ``direct="shared"`` restore shared with the staging path (:class:`~._direct.Claims`):
        the side thread issues batch copies of pages from the back on its stream (forked off
        ``dma`` here: behind the transfer's start); this thread stages chunks from the front (H2D
        into a staging slot on ``dma``, the scatter kernel on ``scatter``), each once the GPU has
        caught up with the side's copies, with at most two staged chunks queued ahead of the
        link.  ``done`` is recorded on ``scatter`` behind both."""
        d = _cuda.driver()
        side = self._sides["restore"]
        P = planes.layout.page_nbytes
        n = len(ids)
        claims = _direct.Claims(n)
        fn = _cuda.batch_memcpy()
        assert fn is not None
        _cuda.check(d.cuEventRecord(side.fork, dma), "cuEventRecord(fork)")
        wait = side.start(_direct.shared_side(d, fn, arrays, int(arrays[2].size) // n, claims, side),
                          on_exit=claims.side_finished)
        errors: list[BaseException] = []
        try:
            table = self._table(planes)
            _cuda.check(d.cuStreamWaitEvent(scatter, table.event, 0), "cuStreamWaitEvent(table)")
            per = self._per_chunk(P)
            events = self._slot_events["restore"]
            while True:
                _direct.side_lagging(d, claims, side)
                lo, hi = claims.front(per)
                if hi <= lo:
                    break
                # the slot's last chunk off the link first: at most two staged chunks queued, so
                # the claims follow the GPU's progress
                _cuda.check(d.cuEventSynchronize(events[self._slot["restore"]][0]), "cuEventSynchronize(slot)")
                s = self._take_slot("restore", d, dma)
                staging = self._staging["restore"][s]
                loaded, freed = events[s]
                for off, addr, nb in self._coalesce(pages, lo, hi, P):
                    _cuda.check(d.cuMemcpyHtoDAsync(staging + off, addr, nb, dma), "cuMemcpyHtoDAsync")
                _cuda.check(d.cuEventRecord(loaded, dma), "cuEventRecord")
                _cuda.check(d.cuStreamWaitEvent(scatter, loaded, 0), "cuStreamWaitEvent")
                self._launch(self._scatter_fn, table, planes, ids[lo:hi], staging, scatter)
                _cuda.check(d.cuEventRecord(freed, scatter), "cuEventRecord")
        except BaseException as exc:
            claims.close()
            errors.append(exc)
        side.join_into(wait, scatter, errors)
        try:
            _cuda.check(d.cuEventRecord(done, scatter), "cuEventRecord")
        except CopyEngineError as exc:
            errors.append(exc)
        self.shared_pages[0] += claims.taken[0]
        self.shared_pages[1] += claims.taken[1]
        if errors:
            raise errors[0]

    def _issue_restore_layers(self, handle: _CudaHandle, planes: KVPlanes, ids: list[int], pages: _Pages,
                              moved: range, dplan: _direct.DirectPlan = _direct.NO_PLAN,
                              pre: _LayerJob | None = None) -> None:
        """A layer-major restore: layer ``l`` of every page, then layer ``l + 1``; an event per layer.

        Direct runs (``dplan``) move layer ``l``'s planes by one 2D copy each.  Within a host page a
        layer's planes are adjacent, so layer ``l`` of a run of adjacent host pages is a pitched
        region (rows of the layer's bytes, ``page_nbytes`` apart): for the staged pages one
        ``cuMemcpy2DAsync`` moves it into layer-major staging, then the scatter kernel writes that
        layer's planes of those pages into their blocks.  Layer ``l``'s event is recorded behind its
        last copy (on the scatter stream when any page is staged, else on the DMA stream: the same
        stream for every layer), so stream order makes it imply every earlier layer.  ``pre``:
        :meth:`_inline_first_layer` began the transfer and issued layer ``moved.start``.
        """
        job = pre if pre is not None else self._layers_begin(handle, planes, ids, pages, moved, dplan)
        # (the first layer again when the caller issued only its first chunks: it goes on from there)
        done_first = pre is not None and job.resume_layer != moved.start
        rest = [lay for lay in moved if not (done_first and lay == moved.start)]
        self._layers_issue(job, planes, ids, dplan, rest)
        _cuda.check(_cuda.driver().cuEventRecord(job.done, job.last), "cuEventRecord")

    def _layers_begin(self, handle: _CudaHandle, planes: KVPlanes, ids: list[int], pages: _Pages, moved: range,
                      dplan: _direct.DirectPlan, prestaged: _Prestaged | None = None) -> _LayerJob:
        d = _cuda.driver()
        dev = self._dev
        spans = _layer_spans(planes.layout)
        dma, scatter = self._streams["restore_dma"], self._streams["restore_scatter"]
        start = prestaged.take_start() if prestaged is not None else None
        recorded = start is not None  # (prestage() recorded it before its copies)
        start, done = (start if recorded else dev.event(timing=True)), dev.event(timing=True)
        # One event per layer moved, indexed by layer: the first now, the others as their layers
        # are issued (creating 32 events up front delayed layer 0's first copy by ~0.25 ms).
        layer_evs: list[Any] = [None] * len(spans)
        layer_evs[moved.start] = dev.event(timing=True)
        handle._set_events(start, done, layer_evs)
        if handle._recorded is None:
            handle._recorded = [threading.Event() for _ in spans]
        if not recorded:
            _cuda.check(d.cuEventRecord(start, dma), "cuEventRecord")
        ids_s, pages_s = _subset(ids, pages, dplan.rest) if dplan.runs else (ids, pages)
        staged = bool(ids_s) and self.mode == "kernel"
        table = None
        if staged:
            table = self._table(planes, layers=True)
            _cuda.check(d.cuStreamWaitEvent(scatter, table.event, 0), "cuStreamWaitEvent(table)")
        job = _LayerJob(handle, spans, layer_evs, done, ids_s, pages_s,
                        _page_addresses(pages_s) if staged else None, table, scatter if staged else dma)
        if prestaged is not None and staged:
            job.runs = prestaged.runs
            job.prestaged = {(moved.start, c0, c1): slot for c0, c1, slot in prestaged.chunks}
        return job

    def _layers_issue(self, job: _LayerJob, planes: KVPlanes, ids: list[int], dplan: _direct.DirectPlan,
                      layers: list[int], chunks: int | None = None) -> None:
        """Issue ``layers`` (in order) of a layer-major restore begun by :meth:`_layers_begin`.

        ``chunks``: issue only that many staged chunks of the first of ``layers`` (its direct runs
        too) and stop there, its event not recorded yet; a later call for that layer goes on from
        there (``job.resume_layer`` / ``job.resume_at``)."""
        d = _cuda.driver()
        layout = planes.layout
        P = layout.page_nbytes
        dma, scatter = self._streams["restore_dma"], self._streams["restore_scatter"]
        ids_s, pages_s, addresses = job.ids_s, job.pages_s, job.addresses
        n = len(ids_s)
        for layer in layers:
            ev = job.layer_evs[layer]
            if ev is None:
                ev = job.layer_evs[layer] = self._dev.event(timing=True)
            span = job.spans[layer]
            p0, np_, lo, nb = span
            resumed = layer == job.resume_layer
            start_at = job.resume_at if resumed else 0
            if dplan.runs and not resumed:  # before the staged chunks on the DMA stream: their events imply these
                # (2D runs of direct="auto"/"always": a layer-wise restore never has a batch plan)
                _direct.issue(d, planes, ids, dplan, layout.planes[p0: p0 + np_], dma, to_device=True)
            if job.table is None:  # memcpy mode (or every page direct): one copy per slice, on the DMA stream
                for spec in layout.planes[p0: p0 + np_]:
                    for b, page in zip(ids_s, pages_s, strict=True):
                        dst = planes.ptrs[spec.index] + b * planes.block_strides[spec.index]
                        for off, addr, m in _segments(page, spec.offset, spec.nbytes):
                            _cuda.check(d.cuMemcpyHtoDAsync(dst + off - spec.offset, addr, m, dma),
                                        "cuMemcpyHtoDAsync")
            else:
                per = self._per_chunk(nb)
                for c0 in range(start_at, n, per):
                    if chunks is not None:
                        if not chunks:  # the caller's share of this layer is issued: the worker goes on
                            job.resume_layer, job.resume_at = layer, c0
                            return
                        chunks -= 1
                    c1 = min(n, c0 + per)
                    s_pre = job.prestaged.pop((layer, c0, c1), None) if job.prestaged else None
                    if s_pre is not None:  # loaded by prestage() before the ids were checked
                        s = s_pre
                    elif addresses is not None:
                        s = self._stage_layer_chunk(d, job.runs, addresses, c0, c1, span, P)
                    else:  # pages in several regions: the layer's bytes piece by piece
                        assert not isinstance(pages_s, HostPages)
                        s = self._take_slot("restore", d, dma)
                        staging = self._staging["restore"][s]
                        for j in range(c0, c1):
                            for off, addr, m in _segments(pages_s[j], lo, nb):
                                _cuda.check(d.cuMemcpyHtoDAsync(staging + (j - c0) * nb + off - lo, addr, m, dma),
                                            "cuMemcpyHtoDAsync")
                        _cuda.check(d.cuEventRecord(self._slot_events["restore"][s][0], dma), "cuEventRecord")
                    staging = self._staging["restore"][s]
                    loaded, freed = self._slot_events["restore"][s]
                    _cuda.check(d.cuStreamWaitEvent(scatter, loaded, 0), "cuStreamWaitEvent")
                    self._launch(self._scatter_fn, job.table, planes, ids_s[c0:c1], staging, scatter, span)
                    _cuda.check(d.cuEventRecord(freed, scatter), "cuEventRecord")
            _cuda.check(d.cuEventRecord(ev, job.last), "cuEventRecord")
            job.handle._set_recorded(layer)  # layer l's event is recorded: its waiters may use it now

    # -- lifecycle -----------------------------------------------------------------------------
    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for w in self._workers.values():
            w.stop()
        # Issues on callers' threads (a layer's first chunks, a prestage held across a cache's
        # checks) finish before the buffers and events they use go; a prestage never released
        # (a caller's bug) does not hang close() for ever.
        held = [lock for lock in self._issue_locks.values() if lock.acquire(timeout=10.0)]
        try:
            with self._dev.scope():
                self._release()
        finally:
            for lock in held:
                lock.release()
        self._reaper.close()  # (what is collected from now on is destroyed where it is collected)

    def _release(self) -> None:
        d = _cuda.driver()
        problems: list[str] = []

        def attempt(result: Any, what: str) -> None:
            try:
                _cuda.check(result, what)
            except CopyEngineError as exc:
                problems.append(str(exc))

        # Only our own streams are synchronised, never the device or the engine's streams; memory
        # goes back stream-ordered (cuMemFree could synchronise the whole device).
        for s in self._streams.values():
            attempt(d.cuStreamSynchronize(s), "cuStreamSynchronize")
        aux = self._streams["aux"]
        for bufs in self._staging.values():
            for ptr in bufs:
                attempt(d.cuMemFreeAsync(ptr, aux), "cuMemFreeAsync")
        for t in self._tables.values():
            attempt(d.cuMemFreeAsync(t.dev_ptr, aux), "cuMemFreeAsync")
        attempt(d.cuStreamSynchronize(aux), "cuStreamSynchronize")
        for t in self._tables.values():
            t.host.close()
            d.cuEventDestroy(t.event)
        for pair in self._slot_events.values():
            for a, b in pair:
                d.cuEventDestroy(a)
                d.cuEventDestroy(b)
        d.cuEventDestroy(self._restore_tail)
        for s in self._streams.values():
            attempt(d.cuStreamDestroy(s), "cuStreamDestroy")
        for side in self._sides.values():
            side.close(attempt)
        self._sides = {}  # (a batch issued after close() takes no side: it fails on the closed streams)
        self._flags.close(problems)
        self._tables.clear()
        if problems:
            warnings.warn("closing the CUDA copy engine: " + "; ".join(problems), stacklevel=2)
