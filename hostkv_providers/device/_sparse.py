"""Selected-page movement for sparse attention: page tables, fetch, mirror, in-place reads, slot cache.

Sparse-attention models read only the pages an indexer selects each step.  Two designs serve that
from a host tier (``docs/sparse.md`` compares them with measurements):

* **in place**: the host pages are page-locked *and mapped* into the device's address space; a
  :class:`PageTable` holds one device address per page, and kernels read the selected pages over
  PCIe directly (:meth:`PageMover.digest_pages` is the attention-shaped read used to measure it);
* **mirror + device slot cache**: every page is mirrored in host memory (:meth:`PageMover.mirror`
  writes a pool slot through the mapping), the GPU pool is a cache of slots over the page space
  (:class:`SlotCache`, CLOCK replacement resolved on the device), and the misses of a step are
  fetched by one fixed-shape launch (:meth:`PageMover.fetch`).

Every launch here takes *device* arrays of a fixed length (``rows x width`` int32, ``-1`` =
padding): no data-dependent shapes and no device→host synchronisation, so a step's
resolve → fetch → attend sequence can be captured in a CUDA graph and replayed.  One launch moves
all planes of an item — every layer's K/V codes *and* their scale planes (whole-page items), or
one layer's planes (per-layer items, ``per_layer=True``, row ``r`` = layer ``r``).  An id or slot
outside its table is never followed: the item is skipped and counted in a device error counter
(:meth:`PageMover.errors`), so a bad index can never read or write foreign memory.

The kernels are compiled at run time by NVRTC through :mod:`hostkv_providers.device._cuda`, like
the copy engine's pack kernel.  :class:`CpuPageMover` and :class:`CpuSlotCache` implement the same
contract over host memory (numpy arrays for ids) so the bookkeeping is tested without a GPU.
"""

from __future__ import annotations

import ctypes
import sys
import threading
import warnings
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np

from hostkv_providers._errors import CopyArgumentError, CopyEngineError
from hostkv_providers._layout import KVLayout
from hostkv_providers.device import _cuda
from hostkv_providers.device._copy import KVPlanes
from hostkv_providers.device._engine import _stream_handle

__all__ = [
    "CpuPageMover",
    "CpuSlotCache",
    "DeviceMappingError",
    "PageMover",
    "PageTable",
    "SlotCache",
    "page_digest",
]


class DeviceMappingError(CopyEngineError):
    """Host memory cannot be mapped into a device's address space here (no CUDA, or refused)."""

    default_hint = "device mapping needs a CUDA device; use device=-1 for host-side engines"


_FETCH, _MIRROR, _DIGEST_PAGES, _DIGEST_SLOTS = 0, 1, 2, 3

_SOURCE = r"""
typedef unsigned long long u64;
typedef unsigned int u32;

// Digest of page bytes: sum over the page's 8-byte little-endian words w_j of w_j * (2j + 1), mod 2^64.
// It is linear in the bytes, so a tile may be summed in any pieces, from any alignment, with the
// same result: the in-place read (through the page table) and the read of the pool slot agree
// exactly when the bytes do.
__device__ __forceinline__ u64 byte_term(u64 b, u64 pos) {
    return (b << (8 * (pos & 7))) * (2 * (pos >> 3) + 1);
}

__device__ __forceinline__ u64 warp_sum(u64 v) {
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    return v;
}

// One work unit = one tile of one plane slice of one item.  MODE 0: fetch (page -> pool slot),
// 1: mirror (pool slot -> page), 2: digest of the page in place, 3: digest of the pool slot.
// planes[4p..4p+3] = {pool base, pool block stride, offset of the plane in the packed page, bytes}.
template <int MODE>
__device__ __forceinline__ void run(const u64* __restrict__ planes, const u64* __restrict__ pages,
                                    const int* __restrict__ ids, const int* __restrict__ slots,
                                    u64* __restrict__ out, int* errors, u64 table_len, int num_blocks,
                                    int items, int width, int per_layer, int span, u64 tile, u64 tiles) {
    const u64 total = (u64)items * (u64)span * tiles;
    for (u64 unit = blockIdx.x; unit < total; unit += gridDim.x) {
        const u64 t = unit % tiles;
        const u64 rest = unit / tiles;
        const int k = (int)(rest % (u64)span);
        const int item = (int)(rest / (u64)span);
        const int id = ids[item];
        if (id < 0) continue;  // padding
        int slot = 0;
        bool bad;
        if (MODE == 2) {
            bad = (u64)id >= table_len;
        } else if (MODE == 3) {
            slot = id;
            bad = slot >= num_blocks;
        } else {
            slot = slots[item];
            bad = (u64)id >= table_len || slot < 0 || slot >= num_blocks;
        }
        if (bad) {  // never followed; counted once per item
            if (k == 0 && t == 0 && threadIdx.x == 0) atomicAdd(errors, 1);
            continue;
        }
        const int plane = per_layer ? (item / width) * span + k : k;
        const u64* e = planes + 4 * plane;
        const u64 nb = e[3];
        const u64 lo = t * tile;
        if (lo >= nb) continue;
        const u64 n = (nb - lo < tile) ? nb - lo : tile;
        unsigned char* pool = (unsigned char*)(e[0] + (u64)slot * e[1]) + lo;
        unsigned char* page = (MODE == 3) ? pool : (unsigned char*)(pages[id] + e[2]) + lo;
        if (MODE == 0 || MODE == 1) {
            const unsigned char* src = (MODE == 0) ? page : pool;
            unsigned char* dst = (MODE == 0) ? pool : page;
            if ((((u64)src | (u64)dst | n) & 15) == 0) {
                const uint4* s4 = (const uint4*)src;
                uint4* d4 = (uint4*)dst;
                const u64 n4 = n >> 4;
                const u64 step = (u64)blockDim.x * UNROLL;
                // UNROLL loads in flight per thread before any store: a read over PCIe has
                // microseconds of latency, and only many outstanding reads reach line rate.
                for (u64 base = threadIdx.x; base < n4; base += step) {
                    uint4 v[UNROLL];
                    #pragma unroll
                    for (int j = 0; j < UNROLL; ++j) {
                        const u64 i = base + (u64)j * blockDim.x;
                        if (i < n4) v[j] = __ldcs(s4 + i);
                    }
                    #pragma unroll
                    for (int j = 0; j < UNROLL; ++j) {
                        const u64 i = base + (u64)j * blockDim.x;
                        if (i < n4) __stcs(d4 + i, v[j]);
                    }
                }
            } else {
                for (u64 i = threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
            }
        } else {
            const u64 pos0 = e[2] + lo;  // position of the tile in the packed page
            u64 acc = 0;
            if ((((u64)page | pos0 | n) & 15) == 0) {
                const uint4* s4 = (const uint4*)page;
                const u64 n4 = n >> 4;
                const u64 step = (u64)blockDim.x * UNROLL;
                for (u64 base = threadIdx.x; base < n4; base += step) {
                    uint4 v[UNROLL];
                    #pragma unroll
                    for (int j = 0; j < UNROLL; ++j) {
                        const u64 i = base + (u64)j * blockDim.x;
                        if (i < n4) v[j] = __ldcs(s4 + i);
                    }
                    #pragma unroll
                    for (int j = 0; j < UNROLL; ++j) {
                        const u64 i = base + (u64)j * blockDim.x;
                        if (i < n4) {
                            const u64 w = (pos0 >> 3) + 2 * i;  // word index of v[j].x/.y
                            const u64 a = (u64)v[j].x | ((u64)v[j].y << 32);
                            const u64 b = (u64)v[j].z | ((u64)v[j].w << 32);
                            acc += a * (2 * w + 1) + b * (2 * w + 3);
                        }
                    }
                }
            } else {
                for (u64 i = threadIdx.x; i < n; i += blockDim.x) acc += byte_term(page[i], pos0 + i);
            }
            acc = warp_sum(acc);
            if ((threadIdx.x & 31) == 0 && acc) atomicAdd(out + item, acc);
        }
    }
}

#define ENTRY(name, MODE)                                                                             \
extern "C" __global__ void name(const u64* planes, const u64* pages, const int* ids, const int* slots,  \
                                u64* out, int* errors, u64 table_len, int num_blocks, int items,       \
                                int width, int per_layer, int span, u64 tile, u64 tiles) {             \
    run<MODE>(planes, pages, ids, slots, out, errors, table_len, num_blocks, items, width, per_layer,  \
              span, tile, tiles);                                                                      \
}
ENTRY(hostkv_sparse_fetch, 0)
ENTRY(hostkv_sparse_mirror, 1)
ENTRY(hostkv_sparse_digest_pages, 2)
ENTRY(hostkv_sparse_digest_slots, 3)

// CLOCK (second-chance) slot cache, one CTA per row (layer).  Per row: slot_of[num_pages]
// (-1: not resident), page_of[num_slots] (-1: free), stamp[num_slots] (the step that last used
// the slot), ref[num_slots] (second-chance bit), cursor, step.  For each selected page id it
// writes the slot that will hold it (out) and, for a miss, the (page, slot) pair to fetch; a slot
// used by this step is never chosen as a victim, so a step's hits are not rebound under it.
extern "C" __global__ void hostkv_slot_resolve(const int* sel, int* out, int* fetch_ids, int* fetch_slots,
                                               int* slot_of, int* page_of, int* stamp, int* ref,
                                               u32* cursor, int* steps, int* misses, int* errors,
                                               int num_pages, int num_slots, int width) {
    const int r = blockIdx.x;
    sel += (u64)r * width; out += (u64)r * width;
    fetch_ids += (u64)r * width; fetch_slots += (u64)r * width;
    slot_of += (u64)r * num_pages;
    page_of += (u64)r * num_slots; stamp += (u64)r * num_slots; ref += (u64)r * num_slots;
    __shared__ int step;
    __shared__ int row_misses;
    if (threadIdx.x == 0) { step = steps[r] + 1; steps[r] = step; row_misses = 0; }
    __syncthreads();
    // 1. hits: mark their slots used by this step
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        const int p = sel[i];
        fetch_ids[i] = -1;
        fetch_slots[i] = -1;
        if (p < 0 || p >= num_pages) {
            out[i] = -1;
            if (p >= num_pages) atomicAdd(errors, 1);
            continue;
        }
        const int s = slot_of[p];
        if (s >= 0) { stamp[s] = step; ref[s] = 1; out[i] = s; }
        else out[i] = -2;
    }
    __syncthreads();
    // 2. misses: one owner per distinct page claims it, then takes a victim in clock order
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        if (out[i] != -2) continue;
        const int p = sel[i];
        if (atomicCAS(slot_of + p, -1, -3) != -1) continue;  // a duplicate: resolved in 3.
        int victim = -1;
        for (int tries = 0; tries < 3 * num_slots; ++tries) {
            const int c = (int)(atomicAdd(cursor + r, 1u) % (u32)num_slots);
            const int o = stamp[c];
            if (o == step) continue;                    // used by this step
            if (ref[c]) { ref[c] = 0; continue; }       // second chance
            if (atomicCAS(stamp + c, o, step) != o) continue;
            victim = c;
            break;
        }
        if (victim < 0) { slot_of[p] = -1; out[i] = -1; atomicAdd(errors, 1); continue; }
        const int old = page_of[victim];
        if (old >= 0) slot_of[old] = -1;  // a pure rebind: the host mirror of `old` is clean
        page_of[victim] = p;
        ref[victim] = 1;
        slot_of[p] = victim;
        out[i] = victim;
        fetch_ids[i] = p;
        fetch_slots[i] = victim;
        atomicAdd(&row_misses, 1);
    }
    __syncthreads();
    // 3. duplicates of a miss take the owner's slot
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        if (out[i] == -2) out[i] = slot_of[sel[i]];
    }
    if (threadIdx.x == 0) misses[r] += row_misses;
}
"""

_UNROLL = 4


# ============================================================================================
# Helpers
# ============================================================================================


def _device_array(value: Any, what: str, count: int, device: int, dtype: str = "int32") -> int:
    """The device address of ``value``: a CUDA torch tensor of ``count`` ``dtype`` elements
    (checked: device, dtype, size, contiguity) or a raw device pointer (trusted)."""
    if hasattr(value, "data_ptr") and hasattr(value, "device"):
        dev = value.device
        if dev.type != "cuda" or int(dev.index if dev.index is not None else 0) != device:
            raise CopyArgumentError(f"{what} must be on cuda:{device}, it is on {dev}")
        if str(value.dtype).rsplit(".", 1)[-1] != dtype:
            raise CopyArgumentError(f"{what} must be {dtype}, got {value.dtype}")
        if value.numel() != count or not value.is_contiguous():
            raise CopyArgumentError(f"{what} must be {count} contiguous elements (fixed shape), "
                                    f"got {tuple(value.shape)}")
        return int(value.data_ptr())
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise CopyArgumentError(f"{what} must be a CUDA tensor or a device pointer, got {type(value).__name__}")
    return value


def _launch_stream(stream: Any, device: int) -> int:
    """The raw stream to launch on; ``None`` is torch's current stream when torch is in use (so a
    ``torch.cuda.graph`` capture records the launch), else the legacy default stream."""
    s = _stream_handle(stream, "stream")
    if s is not None:
        return s
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return int(torch.cuda.current_stream(device).cuda_stream)
    return 0


def page_digest(data: Any) -> int:
    """The digest :meth:`PageMover.digest_pages` computes, on the host, for a page's bytes:
    ``sum_j w_j * (2j + 1) mod 2**64`` over its 8-byte little-endian words (zero-padded)."""
    raw = np.frombuffer(memoryview(data).cast("B"), np.uint8)
    pad = (-raw.size) % 8
    if pad:
        raw = np.concatenate([raw, np.zeros(pad, np.uint8)])
    words = raw.view("<u8")
    weights = np.arange(words.size, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    with np.errstate(over="ignore"):
        return int(np.sum(words * weights, dtype=np.uint64))


class _Kernels:
    """The compiled sparse module for one device (compiled once per process and device)."""

    _cache: ClassVar[dict[int, _Kernels]] = {}
    _lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, dev: _cuda.Device) -> None:
        image = _cuda.compile_module(_SOURCE, "hostkv_sparse.cu", dev.capability, (f"-DUNROLL={_UNROLL}",))
        self.move = {mode: _cuda.load_function(dev, image, name) for mode, name in (
            (_FETCH, "hostkv_sparse_fetch"), (_MIRROR, "hostkv_sparse_mirror"),
            (_DIGEST_PAGES, "hostkv_sparse_digest_pages"), (_DIGEST_SLOTS, "hostkv_sparse_digest_slots"))}
        self.resolve = _cuda.load_function(dev, image, "hostkv_slot_resolve")

    @classmethod
    def get(cls, dev: _cuda.Device) -> _Kernels:
        with cls._lock:
            k = cls._cache.get(dev.ordinal)
            if k is None:
                k = cls._cache[dev.ordinal] = _Kernels(dev)
            return k


def _launch(fn: Any, grid: int, threads: int, stream: int, args: Sequence[Any]) -> None:
    _cuda.launch(fn, grid, threads, stream, list(args), "sparse kernel launch")


class _DeviceBuffer:
    """Device memory owned by this module (freed stream-ordered-free on close)."""

    def __init__(self, dev: _cuda.Device, nbytes: int) -> None:
        self.dev = dev
        self.nbytes = nbytes
        self.ptr = dev.mem_alloc(max(nbytes, 16))

    def upload(self, data: np.ndarray) -> None:
        raw = np.ascontiguousarray(data)
        if raw.nbytes > self.nbytes:
            raise CopyArgumentError(f"{raw.nbytes} bytes do not fit a {self.nbytes}-byte device buffer")
        with self.dev.scope():
            _cuda.check(_cuda.driver().cuMemcpyHtoD(self.ptr, raw.ctypes.data, raw.nbytes), "cuMemcpyHtoD")

    def download(self, nbytes: int) -> np.ndarray:
        out = np.empty(nbytes, np.uint8)
        with self.dev.scope():
            _cuda.check(_cuda.driver().cuMemcpyDtoH(out.ctypes.data, self.ptr, nbytes), "cuMemcpyDtoH")
        return out

    def close(self) -> None:
        if self.ptr:
            try:
                self.dev.mem_free(self.ptr)
            except CopyEngineError as exc:  # cleanup warns
                warnings.warn(f"freeing sparse device memory failed: {exc}", stacklevel=2)
            self.ptr = 0


# ============================================================================================
# Page tables
# ============================================================================================


class PageTable:
    """A device-resident table of page base addresses: entry ``i`` is where page ``i``'s packed
    bytes start (mapped host memory for in-place reads and fetches, or device memory).

    The kernels check every id against the table's length, but the addresses themselves are
    trusted: each must point at a whole packed page that stays valid while kernels may read it.
    Build the table from a provider
    (:meth:`~hostkv_providers.providers.MappedPinnedProvider.page_table`, whose slots are all
    mapped for its whole life) or from memory you own.

    Parameters
    ----------
    addresses:
        One address per page (an integer array-like).
    device:
        CUDA ordinal the table lives on, or ``-1`` for a host table (:class:`CpuPageMover`).
    """

    def __init__(self, addresses: Any, device: int = 0) -> None:
        try:
            arr = np.ascontiguousarray(np.asarray(addresses, dtype=np.uint64))
        except (OverflowError, ValueError, TypeError) as exc:  # negative, not a number
            raise CopyArgumentError(f"page addresses must be integers >= 0: {exc}") from exc
        if arr.ndim != 1 or arr.size == 0:
            raise CopyArgumentError("a page table needs a non-empty 1-D array of addresses")
        if type(device) is not int or device < -1:
            raise CopyArgumentError(f"device must be a CUDA ordinal or -1 (host), got {device!r}")
        self.device = device
        self.length = int(arr.size)
        self.host = arr  # the addresses as uploaded (host copy, read-only use)
        self._buf: _DeviceBuffer | None = None
        if device >= 0:
            if not _cuda.available():
                raise DeviceMappingError(f"CUDA is not usable: {_cuda.unavailable_reason()}")
            self._buf = _DeviceBuffer(_cuda.device(device), arr.nbytes)
            self._buf.upload(arr)  # once, at construction: a synchronous copy is fine here

    @property
    def ptr(self) -> int:
        """Device address of the table (``uint64[length]``); 0 for a host table."""
        return 0 if self._buf is None else self._buf.ptr

    def tensor(self) -> Any:
        """The table as a torch ``int64`` tensor (a copy on the table's device; needs torch)."""
        import torch

        t = torch.from_numpy(self.host.view(np.int64).copy())
        return t if self.device < 0 else t.to(f"cuda:{self.device}")

    def close(self) -> None:
        if self._buf is not None:
            self._buf.close()
            self._buf = None

    def __enter__(self) -> PageTable:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        where = "host" if self.device < 0 else f"cuda:{self.device}"
        return f"<PageTable {self.length} pages on {where}>"


def _check_shape(layout: KVLayout, pool: KVPlanes, rows: int, width: int, per_layer: bool) -> int:
    if not isinstance(layout, KVLayout):
        raise CopyArgumentError(f"layout must be a KVLayout, got {type(layout).__name__}")
    if not isinstance(pool, KVPlanes) or pool.layout != layout:
        raise CopyArgumentError("pool must be KVPlanes of the same layout")
    for name, v in (("rows", rows), ("width", width)):
        if type(v) is not int or v <= 0:
            raise CopyArgumentError(f"{name} must be a positive int, got {v!r}")
    if per_layer and rows != layout.num_layers:
        raise CopyArgumentError(f"per-layer items need one row per layer ({layout.num_layers}), got {rows}")
    if rows * width >= 1 << 31:
        raise CopyArgumentError("rows * width must stay below 2**31")
    nplanes = len(layout.planes)
    return nplanes // layout.num_layers if per_layer else nplanes


# ============================================================================================
# The CUDA mover
# ============================================================================================


class PageMover:
    """Fixed-shape, graph-capturable page movement between a :class:`PageTable` and a device pool.

    Parameters
    ----------
    layout:
        The page layout (packed page = ``layout.planes`` in order, codes and scales).
    pool:
        The device pool (:class:`KVPlanes` on ``table.device``): slot ``s`` of every plane.
    table:
        Where page id ``i``'s packed bytes are (:class:`PageTable` on the same device).
    width, rows:
        Every id array is ``rows x width`` int32 (row-major), fixed for the mover's life.
    per_layer:
        ``True``: row ``r`` holds layer ``r``'s selection and an item moves that layer's planes
        (its K/V codes and scales); ``False``: an item is a whole page (every plane).
    ctas, threads, tile_bytes:
        Launch shape (grid-stride over (item, plane, tile) units); ``ctas`` defaults to 4 per
        multiprocessor — reads over PCIe need many requests in flight.

    Every method enqueues one kernel on ``stream`` (default: torch's current stream) and returns
    at once: nothing synchronises, nothing depends on the ids' values on the host.
    """

    def __init__(self, layout: KVLayout, pool: KVPlanes, table: PageTable, *, width: int, rows: int = 1,
                 per_layer: bool = False, ctas: int | None = None, threads: int = 256,
                 tile_bytes: int = 16384) -> None:
        self.span = _check_shape(layout, pool, rows, width, per_layer)
        if not isinstance(table, PageTable) or table.device < 0:
            raise CopyArgumentError("PageMover needs a device PageTable (use CpuPageMover for host tables)")
        if pool.device != table.device:
            raise CopyArgumentError(f"the pool is on {pool.device}, the table on cuda:{table.device}")
        if type(tile_bytes) is not int or tile_bytes <= 0 or tile_bytes % 16:
            raise CopyArgumentError(f"tile_bytes must be a positive multiple of 16, got {tile_bytes!r}")
        if type(threads) is not int or threads % 32 or not 32 <= threads <= 1024:
            raise CopyArgumentError(f"threads must be a multiple of 32 in [32, 1024], got {threads!r}")
        self.layout, self.pool, self.table = layout, pool, table
        self.rows, self.width, self.per_layer = rows, width, per_layer
        self.items = rows * width
        self.device = table.device
        self._dev = _cuda.device(self.device)
        self._k = _Kernels.get(self._dev)
        # Balanced tiles: an 18 KiB plane slice is two 9 KiB tiles, not a 16 KiB and a 2 KiB one.
        widest = max(s.nbytes for s in layout.planes)
        self.tiles = max(1, -(-widest // tile_bytes))
        per_tile = -(-widest // self.tiles)
        self.threads, self.tile_bytes = threads, -(-per_tile // 16) * 16
        self.ctas = ctas if ctas is not None else 4 * self._dev.sm_count
        rowsz = np.array([[pool.ptrs[s.index], pool.block_strides[s.index], s.offset, s.nbytes]
                          for s in layout.planes], dtype=np.uint64)
        self._planes = _DeviceBuffer(self._dev, rowsz.nbytes)
        self._planes.upload(rowsz)
        self._errors = _DeviceBuffer(self._dev, 4)
        self._errors.upload(np.zeros(1, np.int32))
        self._closed = False

    #: bytes one full item moves
    @property
    def item_nbytes(self) -> int:
        specs = self.layout.planes[: self.span]
        return sum(s.nbytes for s in specs)

    def _run(self, mode: int, ids: Any, slots: Any, out: int, stream: Any) -> None:
        if self._closed:
            raise CopyEngineError("the page mover is closed")
        s = _launch_stream(stream, self.device)
        grid = max(1, min(self.ctas, self.items * self.span * self.tiles))
        args = [ctypes.c_uint64(self._planes.ptr), ctypes.c_uint64(self.table.ptr), ctypes.c_uint64(ids),
                ctypes.c_uint64(slots), ctypes.c_uint64(out), ctypes.c_uint64(self._errors.ptr),
                ctypes.c_uint64(self.table.length), ctypes.c_int32(self.pool.num_blocks),
                ctypes.c_int32(self.items), ctypes.c_int32(self.width), ctypes.c_int32(int(self.per_layer)),
                ctypes.c_int32(self.span), ctypes.c_uint64(self.tile_bytes), ctypes.c_uint64(self.tiles)]
        with self._dev.scope():
            if out:  # digests accumulate: zero them first, in stream order (a memset node in a graph)
                _cuda.check(_cuda.driver().cuMemsetD8Async(out, 0, 8 * self.items, s), "cuMemsetD8Async")
            _launch(self._k.move[mode], grid, self.threads, s, args)

    def fetch(self, page_ids: Any, into_slots: Any, *, stream: Any = None) -> None:
        """Copy page ``page_ids[i]`` (through the table) into pool slot ``into_slots[i]``.

        ``page_ids``/``into_slots``: ``rows x width`` int32 device arrays; ``-1`` ids are padding.
        Destination slots of one call must be distinct (two items would race for one slot).
        """
        n = self.items
        self._run(_FETCH, _device_array(page_ids, "page_ids", n, self.device),
                  _device_array(into_slots, "into_slots", n, self.device), 0, stream)

    def mirror(self, from_slots: Any, page_ids: Any, *, stream: Any = None) -> None:
        """Write pool slot ``from_slots[i]`` into page ``page_ids[i]`` (the write-through mirror:
        through a mapped table the kernel stores straight into host memory)."""
        n = self.items
        self._run(_MIRROR, _device_array(page_ids, "page_ids", n, self.device),
                  _device_array(from_slots, "from_slots", n, self.device), 0, stream)

    def digest_pages(self, page_ids: Any, out: Any, *, stream: Any = None) -> None:
        """Read the selected pages *in place* (through the table) into ``out[i]`` =
        :func:`page_digest` of item ``i``'s bytes (``rows x width`` uint64 / int64; 0 for padding).

        This is the attention-shaped read of the in-place design: every selected byte crosses
        the link once, nothing is written but one word per item.
        """
        n = self.items
        self._run(_DIGEST_PAGES, _device_array(page_ids, "page_ids", n, self.device), 0,
                  _device_array(out, "out", n, self.device, _u64_name(out)), stream)

    def digest_slots(self, slots: Any, out: Any, *, stream: Any = None) -> None:
        """:meth:`digest_pages` of pool slots (``-1`` = padding): the same read from device memory."""
        n = self.items
        self._run(_DIGEST_SLOTS, _device_array(slots, "slots", n, self.device), 0,
                  _device_array(out, "out", n, self.device, _u64_name(out)), stream)

    def errors(self) -> int:
        """Items refused so far (ids or slots out of range).  Reads device memory: synchronises."""
        with self._dev.scope():
            _cuda.check(_cuda.driver().cuCtxSynchronize(), "cuCtxSynchronize")
        return int(self._errors.download(4).view(np.int32)[0])

    def close(self) -> None:
        """Free the mover's device memory (the caller makes sure its launches have finished)."""
        if self._closed:
            return
        self._closed = True
        self._planes.close()
        self._errors.close()

    def __enter__(self) -> PageMover:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _u64_name(t: Any) -> str:
    """Digest outputs may be int64 (torch has no uint64 arithmetic everywhere) or uint64."""
    name = str(getattr(t, "dtype", "int64")).rsplit(".", 1)[-1]
    return name if name in ("int64", "uint64") else "int64"


# ============================================================================================
# The device slot cache
# ============================================================================================


class SlotCache:
    """A cache of device pool slots over a page space, resolved on the device (CLOCK replacement).

    ``resolve(page_ids, out_slots, fetch_ids, fetch_slots)`` — all ``rows x width`` int32 device
    arrays — writes for every selected page the pool slot that holds it after the step, and for
    each *miss* one ``(page, slot)`` pair to fetch (``-1`` elsewhere), ready to hand to
    :meth:`PageMover.fetch`.  A slot used by the current step is never a victim, duplicates of a
    page share one slot, and eviction is a pure rebind (the host mirror is always clean).  Rows are
    independent caches (one per layer for per-layer selections).  Needs ``num_slots >= width``.
    """

    def __init__(self, num_pages: int, num_slots: int, *, width: int, rows: int = 1, device: int = 0,
                 threads: int = 1024) -> None:
        for name, v in (("num_pages", num_pages), ("num_slots", num_slots), ("width", width), ("rows", rows)):
            if type(v) is not int or v <= 0:
                raise CopyArgumentError(f"{name} must be a positive int, got {v!r}")
        if num_slots < width:
            raise CopyArgumentError(f"{num_slots} slots cannot hold a {width}-page selection")
        if not _cuda.available():
            raise DeviceMappingError(f"CUDA is not usable: {_cuda.unavailable_reason()}")
        self.num_pages, self.num_slots, self.width, self.rows, self.device = num_pages, num_slots, width, rows, device
        self.items = rows * width
        self._dev = _cuda.device(device)
        self._k = _Kernels.get(self._dev)
        self.threads = threads
        self._bufs: dict[str, _DeviceBuffer] = {}
        for name, count, fill in (("slot_of", rows * num_pages, -1), ("page_of", rows * num_slots, -1),
                                  ("stamp", rows * num_slots, 0), ("ref", rows * num_slots, 0),
                                  ("cursor", rows, 0), ("steps", rows, 0), ("misses", rows, 0), ("errors", 1, 0)):
            buf = self._bufs[name] = _DeviceBuffer(self._dev, 4 * count)
            with self._dev.scope():
                _cuda.check(_cuda.driver().cuMemsetD32(buf.ptr, fill & 0xFFFFFFFF, count), "cuMemsetD32")

    def resolve(self, page_ids: Any, out_slots: Any, fetch_ids: Any, fetch_slots: Any, *, stream: Any = None) -> None:
        n, d = self.items, self.device
        b = self._bufs
        args = [ctypes.c_uint64(_device_array(page_ids, "page_ids", n, d)),
                ctypes.c_uint64(_device_array(out_slots, "out_slots", n, d)),
                ctypes.c_uint64(_device_array(fetch_ids, "fetch_ids", n, d)),
                ctypes.c_uint64(_device_array(fetch_slots, "fetch_slots", n, d)),
                *(ctypes.c_uint64(b[k].ptr) for k in ("slot_of", "page_of", "stamp", "ref", "cursor", "steps",
                                                      "misses", "errors")),
                ctypes.c_int32(self.num_pages), ctypes.c_int32(self.num_slots), ctypes.c_int32(self.width)]
        s = _launch_stream(stream, d)
        with self._dev.scope():
            _launch(self._k.resolve, self.rows, self.threads, s, args)

    def _read(self, name: str) -> np.ndarray:
        with self._dev.scope():
            _cuda.check(_cuda.driver().cuCtxSynchronize(), "cuCtxSynchronize")
        buf = self._bufs[name]
        return buf.download(buf.nbytes).view(np.int32)

    def misses(self) -> np.ndarray:
        """Fetches issued so far per row (synchronises: diagnostics and benchmarks)."""
        out: np.ndarray = self._read("misses").copy()
        return out

    def errors(self) -> int:
        """Selected ids out of range, and misses that found no victim (synchronises)."""
        return int(self._read("errors")[0])

    def resident(self) -> np.ndarray:
        """``rows x num_pages`` slot of every page (``-1``: not resident); synchronises."""
        out: np.ndarray = self._read("slot_of").reshape(self.rows, self.num_pages).copy()
        return out

    def close(self) -> None:
        for buf in self._bufs.values():
            buf.close()
        self._bufs.clear()


# ============================================================================================
# Host implementations (the CPU copy engine's counterparts)
# ============================================================================================


def _host_ids(value: Any, what: str, count: int) -> np.ndarray:
    arr = np.asarray(value)
    if arr.size != count or arr.dtype.kind not in "iu":
        raise CopyArgumentError(f"{what} must be {count} integers (fixed shape), got {arr.dtype} {arr.shape}")
    return arr.reshape(-1).astype(np.int64, copy=False)


def _host_out(value: Any, what: str, count: int, kinds: str = "i", itemsize: int = 4) -> np.ndarray:
    """``value`` as a writable flat view: a numpy array of ``count`` integers (``kinds``, at least
    ``itemsize`` bytes each), as the device classes require of their outputs.  Checked before
    anything changes: a list would be written as a copy and dropped, a narrow dtype overflow
    part-way (pages already bound to slots nothing was fetched into)."""
    if not isinstance(value, np.ndarray) or not value.flags.writeable:
        raise CopyArgumentError(f"{what} must be a writable numpy array, got {type(value).__name__}")
    if value.size != count or value.dtype.kind not in kinds or value.dtype.itemsize < itemsize:
        raise CopyArgumentError(f"{what} must hold {count} integers of {itemsize * 8} bits or more "
                                f"({'signed' if kinds == 'i' else 'any sign'}), got {value.dtype} {value.shape}")
    flat = value.reshape(-1)
    if not np.shares_memory(flat, value):  # (a reshape that had to copy: not a view of the output)
        raise CopyArgumentError(f"{what} must be contiguous")
    return flat


class CpuPageMover:
    """:class:`PageMover`'s contract over host memory: a host :class:`PageTable` (``device=-1``)
    and host pool planes; ids are numpy arrays.  Copies run on the caller's thread.
    """

    def __init__(self, layout: KVLayout, pool: KVPlanes, table: PageTable, *, width: int, rows: int = 1,
                 per_layer: bool = False) -> None:
        self.span = _check_shape(layout, pool, rows, width, per_layer)
        if not isinstance(table, PageTable) or table.device != -1 or pool.device != -1:
            raise CopyArgumentError("CpuPageMover needs a host PageTable and host pool planes")
        self.layout, self.pool, self.table = layout, pool, table
        self.rows, self.width, self.per_layer = rows, width, per_layer
        self.items = rows * width
        self._errors = 0

    def _units(self, ids: np.ndarray, slots: np.ndarray | None, digest_slots: bool = False
               ) -> list[tuple[int, int, int, int]]:
        """``(item, page address, slot, plane)`` of every valid unit; bad items are counted."""
        out: list[tuple[int, int, int, int]] = []
        pages = self.table.host
        for item in range(self.items):
            pid = int(ids[item])
            if pid < 0:
                continue
            slot = pid if digest_slots else (0 if slots is None else int(slots[item]))
            bad = (slot >= self.pool.num_blocks) if digest_slots else (
                pid >= self.table.length or (slots is not None and not 0 <= slot < self.pool.num_blocks))
            if bad:
                self._errors += 1
                continue
            addr = 0 if digest_slots else int(pages[pid])
            first = (item // self.width) * self.span if self.per_layer else 0
            for p in range(first, first + self.span):
                out.append((item, addr, slot, p))
        return out

    def _slot_address(self, plane: int, slot: int) -> int:
        return self.pool.ptrs[plane] + slot * self.pool.block_strides[plane]

    def fetch(self, page_ids: Any, into_slots: Any, *, stream: Any = None) -> None:
        ids = _host_ids(page_ids, "page_ids", self.items)
        slots = _host_ids(into_slots, "into_slots", self.items)
        for _item, addr, slot, p in self._units(ids, slots):
            spec = self.layout.planes[p]
            ctypes.memmove(self._slot_address(p, slot), addr + spec.offset, spec.nbytes)

    def mirror(self, from_slots: Any, page_ids: Any, *, stream: Any = None) -> None:
        ids = _host_ids(page_ids, "page_ids", self.items)
        slots = _host_ids(from_slots, "from_slots", self.items)
        for _item, addr, slot, p in self._units(ids, slots):
            spec = self.layout.planes[p]
            ctypes.memmove(addr + spec.offset, self._slot_address(p, slot), spec.nbytes)

    def _digest(self, units: list[tuple[int, int, int, int]], from_slots: bool) -> np.ndarray:
        # The digest is linear in the bytes and zero bytes add nothing: an item's digest is the
        # page digest of a zero page holding only the item's planes at their offsets.
        pages: dict[int, bytearray] = {}
        for item, addr, slot, p in units:
            spec = self.layout.planes[p]
            src = self._slot_address(p, slot) if from_slots else addr + spec.offset
            page = pages.setdefault(item, bytearray(self.layout.page_nbytes))
            raw = _cuda.c_array(ctypes.c_char, spec.nbytes).from_address(src).raw
            page[spec.offset: spec.offset + spec.nbytes] = raw
        out = np.zeros(self.items, np.uint64)
        for item, page in pages.items():
            out[item] = np.uint64(page_digest(page))
        return out

    def digest_pages(self, page_ids: Any, out: Any = None, *, stream: Any = None) -> np.ndarray:
        """Digests of the selected pages (numpy ``uint64``; also written into ``out`` if given)."""
        ids = _host_ids(page_ids, "page_ids", self.items)
        dst = None if out is None else _host_out(out, "out", self.items, "iu", 8)
        res = self._digest(self._units(ids, None), False)
        if dst is not None:
            dst[:] = res.view(dst.dtype)
        return res

    def digest_slots(self, slots: Any, out: Any = None, *, stream: Any = None) -> np.ndarray:
        ids = _host_ids(slots, "slots", self.items)
        dst = None if out is None else _host_out(out, "out", self.items, "iu", 8)
        res = self._digest(self._units(ids, None, digest_slots=True), True)
        if dst is not None:
            dst[:] = res.view(dst.dtype)
        return res

    def errors(self) -> int:
        return self._errors

    def close(self) -> None:
        pass


class CpuSlotCache:
    """:class:`SlotCache`'s contract on the host (numpy id arrays), the same CLOCK policy run
    sequentially: the reference the device cache's invariants are tested against."""

    def __init__(self, num_pages: int, num_slots: int, *, width: int, rows: int = 1) -> None:
        for name, v in (("num_pages", num_pages), ("num_slots", num_slots), ("width", width), ("rows", rows)):
            if type(v) is not int or v <= 0:
                raise CopyArgumentError(f"{name} must be a positive int, got {v!r}")
        if num_slots < width:
            raise CopyArgumentError(f"{num_slots} slots cannot hold a {width}-page selection")
        self.num_pages, self.num_slots, self.width, self.rows = num_pages, num_slots, width, rows
        self.items = rows * width
        self.slot_of = np.full((rows, num_pages), -1, np.int64)
        self.page_of = np.full((rows, num_slots), -1, np.int64)
        self.stamp = np.zeros((rows, num_slots), np.int64)
        self.ref = np.zeros((rows, num_slots), np.int8)
        self.cursor = [0] * rows
        self.steps = [0] * rows
        self._misses = np.zeros(rows, np.int64)
        self._errors = 0

    def resolve(self, page_ids: Any, out_slots: Any, fetch_ids: Any, fetch_slots: Any, *, stream: Any = None) -> None:
        sel = _host_ids(page_ids, "page_ids", self.items).reshape(self.rows, self.width)
        out, fids, fslots = (_host_out(a, what, self.items).reshape(self.rows, self.width)
                             for a, what in ((out_slots, "out_slots"), (fetch_ids, "fetch_ids"),
                                             (fetch_slots, "fetch_slots")))
        fids[:] = -1
        fslots[:] = -1
        for r in range(self.rows):
            self.steps[r] += 1
            step = self.steps[r]
            slot_of, page_of, stamp, ref = self.slot_of[r], self.page_of[r], self.stamp[r], self.ref[r]
            for i, p in enumerate(sel[r].tolist()):  # hits first, as on the device
                if p < 0 or p >= self.num_pages:
                    out[r, i] = -1
                    self._errors += p >= self.num_pages
                    continue
                s = int(slot_of[p])
                out[r, i] = s if s >= 0 else -2
                if s >= 0:
                    stamp[s], ref[s] = step, 1
            for i, p in enumerate(sel[r].tolist()):
                if out[r, i] != -2:
                    continue
                if slot_of[p] >= 0:  # a duplicate of a miss resolved earlier in this step
                    out[r, i] = slot_of[p]
                    continue
                victim = -1
                for _ in range(3 * self.num_slots):
                    c = self.cursor[r] % self.num_slots
                    self.cursor[r] += 1
                    if stamp[c] == step:
                        continue
                    if ref[c]:
                        ref[c] = 0
                        continue
                    victim = c
                    break
                if victim < 0:
                    out[r, i] = -1
                    self._errors += 1
                    continue
                old = int(page_of[victim])
                if old >= 0:
                    slot_of[old] = -1
                page_of[victim], slot_of[p], stamp[victim], ref[victim] = p, victim, step, 1
                out[r, i] = fslots[r, i] = victim
                fids[r, i] = p
                self._misses[r] += 1

    def misses(self) -> np.ndarray:
        out: np.ndarray = self._misses.copy()
        return out

    def errors(self) -> int:
        return self._errors

    def resident(self) -> np.ndarray:
        out: np.ndarray = self.slot_of.copy()
        return out

    def close(self) -> None:
        pass
