"""Page checksums on the GPU: the ``xxh3-256k-tree`` block digests of pages still in HBM.

A page of an engine's paged pool is the concatenation of its plane slices (``layout.planes[p]``
at ``offset`` inside the packed page), which is exactly the byte order the copy engine writes to
host memory.  :class:`PageHasher` runs one kernel over a batch of pages: 8 threads per 256 KiB
block, each owning one of XXH3's 8 accumulator lanes (the lane pairs exchange their input words
with a warp shuffle), so every block of every page is hashed in parallel at close to HBM
bandwidth.  The 8-byte block digests come back to the host (256 KiB -> 8 B), where
:func:`hostkv_providers._blockhash.roots_from_digests` folds them into each page's checksum with
numpy: the same value the host computes from the page's bytes with ``xxhash``.

Uses: a save computes its pages' checksums on the GPU before (or while) the D2H copy runs, so a
provider seals them without hashing on the host; a restore verifies on the GPU after the H2D
copy, so zero-copy paths (pinned views) are verified too.  Plane slices must be multiples of 64
bytes and 8-byte aligned (:meth:`PageHasher.supports`); other layouts hash on the host.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np

from hostkv_providers._blockhash import BLOCK, SECRET, nblocks, roots_from_digests
from hostkv_providers._errors import CopyArgumentError, CopyEngineError
from hostkv_providers.device import _cuda

__all__ = ["PageDigests", "PageHasher"]

_THREADS = 256
_PREALLOCATED = 32


def _words(offset: int) -> str:
    vals = np.frombuffer(SECRET[offset : offset + 64], dtype="<u8")
    return ", ".join(f"0x{int(v):016x}ull" for v in vals)


_SOURCE = (
    r"""
typedef unsigned long long u64;
#define BLOCK """ + f"{BLOCK}ull" + r"""
__constant__ u64 KEY[24] = {""" + ", ".join(f"0x{int(v):016x}ull" for v in np.frombuffer(SECRET, dtype="<u8"))
    + r"""};
__constant__ u64 LASTKEY[8] = {""" + _words(192 - 64 - 7) + r"""};
__constant__ u64 MERGEKEY[8] = {""" + _words(11) + r"""};
__constant__ u64 INIT[8] = {0xC2B2AE3Dull, 0x9E3779B185EBCA87ull, 0xC2B2AE3D27D4EB4Full, 0x165667B19E3779F9ull,
                            0x85EBCA77C2B2AE63ull, 0x85EBCA77ull, 0x27D4EB2F165667C5ull, 0x9E3779B1ull};

// One 8-thread group per 256 KiB block of a page; thread `lane` keeps XXH3 accumulator `lane`.
// Page `i`'s bytes: plane p's slice of block bids[i] (bases[p] + bids[i] * strides[p], lens[p] bytes)
// at offs[p] of the packed page.  A page's last block of r bytes is hashed as max(256, r rounded up
// to 64) bytes, zeros past the page (XXH3's long-input loop on a whole number of stripes).
extern "C" __global__ void hostkv_xxh3_blocks(const u64* __restrict__ bases, const u64* __restrict__ strides,
                                              const u64* __restrict__ offs, const u64* __restrict__ lens,
                                              int nplanes, const long long* __restrict__ bids, long long npages,
                                              u64 page_nbytes, int nb, u64* __restrict__ out) {
    long long g = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 3;
    int lane = threadIdx.x & 7;
    bool active = g < npages * nb;   // inactive threads still take part in the shuffles
    long long page = active ? g / nb : 0;
    int b = active ? (int)(g % nb) : 0;
    u64 start = (u64)b * BLOCK;
    u64 r = page_nbytes - start < BLOCK ? page_nbytes - start : BLOCK;
    u64 hl = (r + 63) & ~63ull;
    if (hl < 256) hl = 256;
    int nk = (int)((hl - 1) >> 10);                      // full 1 KiB blocks (scrambled)
    int ns = (int)(((hl - 1) - ((u64)nk << 10)) >> 6);   // stripes of the last one, then the last stripe
    int p = 0;
    {   // the plane holding the block's first byte (binary search over the sorted offsets)
        int lo = 0, hi = nplanes - 1;
        while (lo < hi) { int mid = (lo + hi + 1) >> 1; if (offs[mid] <= start) lo = mid; else hi = mid - 1; }
        p = lo;
    }
    u64 bid = active ? (u64)bids[page] : 0;
    u64 in = start - offs[p];
    u64 len = lens[p];
    const char* base = (const char*)(bases[p] + bid * strides[p]);
    u64 pos = start;
    u64 acc = INIT[lane];
    for (int blk = 0; blk <= nk; ++blk) {
        u64 v[16];
        int nstr = blk < nk ? 16 : ns + 1;   // the final 1 KiB block ends with the last stripe
        #pragma unroll
        for (int s = 0; s < 16; ++s) {
            while (in >= len && p + 1 < nplanes) {   // next plane (uniform within the group)
                ++p; in = 0; len = lens[p]; base = (const char*)(bases[p] + bid * strides[p]);
            }
            v[s] = (active && s < nstr && pos < page_nbytes) ? *(const u64*)(base + in + 8 * lane) : 0ull;
            in += 64; pos += 64;
        }
        #pragma unroll
        for (int s = 0; s < 16; ++s) {
            if (s < nstr) {
                u64 key = (blk == nk && s == ns) ? LASTKEY[lane] : KEY[s + lane];
                u64 dk = v[s] ^ key;
                u64 other = __shfl_xor_sync(0xffffffffu, v[s], 1);
                acc += other + (dk & 0xffffffffull) * (dk >> 32);
            }
        }
        if (blk < nk) { acc ^= acc >> 47; acc ^= KEY[16 + lane]; acc *= 0x9E3779B1ull; }
    }
    u64 x = acc ^ MERGEKEY[lane];
    u64 y = __shfl_xor_sync(0xffffffffu, x, 1);
    u64 m = (lane & 1) ? 0ull : ((x * y) ^ __umul64hi(x, y));
    m += __shfl_xor_sync(0xffffffffu, m, 2);
    m += __shfl_xor_sync(0xffffffffu, m, 4);
    if (lane == 0 && active) {
        u64 h = m + hl * 0x9E3779B185EBCA87ull;
        h ^= h >> 37; h *= 0x165667919E3779F9ull; h ^= h >> 32;
        out[g] = h;
    }
}
"""
)


class PageDigests:
    """The block digests of one batch of pages, on their way to the host (a stream position).

    :meth:`roots` waits for them and returns each page's ``xxh3-256k-tree`` checksum.
    """

    def __init__(self, hasher: PageHasher, npages: int, page_nbytes: int, host: Any, event: Any,
                 dev_mem: int, stream: Any) -> None:
        self._hasher = hasher
        self.npages = npages
        self.page_nbytes = page_nbytes
        self._host = host
        self.event = event
        self._dev_mem = dev_mem
        self._stream = stream
        self._roots: list[int] | None = None

    def done(self) -> bool:
        d = _cuda.driver()
        with self._hasher.dev.scope():
            (err,) = d.cuEventQuery(self.event)
        if int(err) == int(d.CUresult.CUDA_ERROR_NOT_READY):
            return False
        _cuda.check((err,), "page digests")
        return True

    def digests(self) -> np.ndarray[Any, np.dtype[np.uint64]]:
        """``(npages, blocks)`` block digests (waits for the kernel and its copy)."""
        self._wait()
        nb = nblocks(self.page_nbytes)
        return np.frombuffer(self._host.view, dtype=np.uint64, count=self.npages * nb).reshape(self.npages, nb)

    def roots(self) -> list[int]:
        """Each page's ``xxh3-256k-tree`` checksum (waits for the kernel and its copy)."""
        if self._roots is None:
            self._roots = roots_from_digests(self.digests().copy(), self.page_nbytes)
            self.close()
        return self._roots

    def _wait(self) -> None:
        if self._host is None:
            raise CopyEngineError("these page digests were closed")
        with self._hasher.dev.scope():
            _cuda.check(_cuda.driver().cuEventSynchronize(self.event), "page digests")

    def close(self) -> None:
        """Give the buffers back (after the kernel is done: waits for it)."""
        if self._host is None:
            return
        with self._hasher.dev.scope():
            d = _cuda.driver()
            d.cuEventSynchronize(self.event)
            d.cuEventDestroy(self.event)
        self._hasher._give(self._host)
        self._host = None


class PageHasher:
    """Block digests of pages in device memory (one per device, :meth:`get`)."""

    _instances: ClassVar[dict[int, PageHasher]] = {}
    _lock = threading.Lock()

    def __init__(self, ordinal: int) -> None:
        self.dev = _cuda.device(ordinal)
        image = _cuda.compile_module(_SOURCE, "hostkv_xxh3_blocks.cu", self.dev.capability)
        self.fn = _cuda.load_function(self.dev, image, "hostkv_xxh3_blocks")
        self._free: list[Any] = []  # pinned host buffers for digests, reused
        self._flock = threading.Lock()
        # Pinned allocation is slow and locks the driver: a pool sized for a long save up front
        # (64 KiB holds the digests of 1,024 pages of 2 MiB).
        for _ in range(_PREALLOCATED):
            self._free.append(self._new_buffer(1 << 16))
        self._tables: dict[tuple[Any, ...], int] = {}  # plane tables in device memory, per geometry

    @classmethod
    def get(cls, ordinal: int) -> PageHasher:
        with cls._lock:
            h = cls._instances.get(ordinal)
            if h is None:
                h = cls(ordinal)
                cls._instances[ordinal] = h
            return h

    @staticmethod
    def supports(planes: Any) -> bool:
        """Whether ``planes`` (a ``KVPlanes``) can be hashed here: on a CUDA device, every plane
        slice a multiple of 64 bytes and 8-byte aligned."""
        if getattr(planes, "device", -1) < 0:
            return False
        specs = planes.layout.planes
        return all(s.nbytes % 64 == 0 and s.nbytes > 0 for s in specs) and \
            all(p % 8 == 0 for p in planes.ptrs) and all(st % 8 == 0 for st in planes.block_strides)

    def _table(self, planes: Any) -> int:
        specs = planes.layout.planes
        key = (tuple(planes.ptrs), tuple(planes.block_strides), tuple((s.offset, s.nbytes) for s in specs))
        ptr = self._tables.get(key)
        if ptr is None:
            order = sorted(range(len(specs)), key=lambda i: specs[i].offset)
            arr = np.array([[planes.ptrs[i] for i in order], [planes.block_strides[i] for i in order],
                            [specs[i].offset for i in order], [specs[i].nbytes for i in order]], dtype=np.uint64)
            ptr = self.dev.mem_alloc(arr.nbytes)
            with self.dev.scope():
                _cuda.check(_cuda.driver().cuMemcpyHtoD(ptr, arr.ctypes.data, arr.nbytes), "cuMemcpyHtoD")
            if len(self._tables) > 64:  # a bounded cache: engines have one or two pools
                self._tables.clear()
            self._tables[key] = ptr
        return ptr

    def _take(self, nbytes: int) -> Any:
        with self._flock:
            for i, buf in enumerate(self._free):
                if buf.view.nbytes >= nbytes:
                    return self._free.pop(i)
        return self._new_buffer(nbytes)

    def _new_buffer(self, nbytes: int) -> Any:
        from hostkv_providers.device._hostmem import CudaPinnedAllocation

        size = 1 << max(16, (nbytes - 1).bit_length())
        return CudaPinnedAllocation(size, self.dev, threads=1)

    def _give(self, buf: Any) -> None:
        # Kept for good, never freed here: cuMemHostUnregister/cuMemFreeHost take the driver's
        # lock and stalled an engine's decode step by ~90 ms whenever a save freed one (a save
        # keeps a chunk's digests in flight per chunk, 25 for a 100k-token chain).
        with self._flock:
            self._free.append(buf)

    def enqueue(self, planes: Any, block_ids: Sequence[int], stream: Any) -> PageDigests:
        """Enqueue the digests of pages ``block_ids`` of ``planes`` on ``stream`` (a raw CUstream
        or ``None`` for the legacy stream); they hash the blocks as the stream finds them."""
        if not self.supports(planes):
            raise CopyArgumentError("these planes cannot be hashed on the GPU (see PageHasher.supports)")
        page = planes.layout.page_nbytes
        n = len(block_ids)
        nb = nblocks(page)
        bids = np.ascontiguousarray(np.asarray(block_ids, dtype=np.int64))
        host = self._take(max(8, n * nb * 8))
        d = _cuda.driver()
        table = self._table(planes)
        nplanes = len(planes.layout.planes)
        with self.dev.scope():
            mem = self.dev.mem_alloc_async(max(8, bids.nbytes) + max(8, n * nb * 8), stream)
            out = mem + max(8, bids.nbytes)
            if n:
                _cuda.check(d.cuMemcpyHtoDAsync(mem, bids.ctypes.data, bids.nbytes, stream), "cuMemcpyHtoDAsync")
            total = n * nb * 8
            if total:
                args = [ctypes.c_uint64(table), ctypes.c_uint64(table + 8 * nplanes),
                        ctypes.c_uint64(table + 16 * nplanes), ctypes.c_uint64(table + 24 * nplanes),
                        ctypes.c_int32(nplanes), ctypes.c_uint64(mem), ctypes.c_int64(n), ctypes.c_uint64(page),
                        ctypes.c_int32(nb), ctypes.c_uint64(out)]
                _cuda.launch(self.fn, -(-(n * nb * 8) // _THREADS), _THREADS, stream, args, "page hash kernel launch")
                _cuda.check(d.cuMemcpyDtoHAsync(host.address, out, total, stream), "cuMemcpyDtoHAsync")
            self.dev.mem_free_async(mem, stream)
            ev = _cuda.check(d.cuEventCreate(int(d.CUevent_flags.CU_EVENT_DISABLE_TIMING)), "cuEventCreate")
            _cuda.check(d.cuEventRecord(ev, stream), "cuEventRecord")
        return PageDigests(self, n, page, host, ev, mem, stream)


