"""Kernel-free copies for :class:`~hostkv_providers.device.CudaCopyEngine`: DMA straight between
host pages and the engine's blocks where both sides run in order.

A run of pages whose block ids are consecutive and whose host pages are adjacent is, for every
plane, one pitched region on each side: rows of the plane's slice bytes, ``page_nbytes`` apart on
the host and the plane's block stride apart on the device.  One ``cuMemcpy2DAsync`` per plane
moves the whole run — no staging buffer, no pack kernel, so no streaming multiprocessor and no
L2 traffic of the engine's is taken.  Measured on the H200 (32 KiB slices, 2 MiB pages into
consecutive blocks), a trade: a captured decode step beside back-to-back restores runs at
1.00-1.02x of its time alone (1.05-1.08x beside the staging path, whose scatter kernel shares
the SMs), but 2D rows of 32 KiB read from host memory move slower than staged bulk copies: 6,400
pages from one 13 GB buffer at 0.99x of a bulk copy, from the pinned arena's 256 MiB chunks
(runs of 128 pages) at 0.93-0.94x against 0.97-0.98x staged, saves at 0.82x against 0.93x.
Hence ``direct="never"`` by default.  Pages outside such runs keep the staging path.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from hostkv_providers._errors import CopyArgumentError
from hostkv_providers.device import _cuda
from hostkv_providers.device._hostmem import registration_starts

#: ``direct="auto"``: a run moves directly from this many bytes on (its ``num_planes`` copies are
#: issued in ~10 us each; below this the staging path's one kernel per chunk is cheaper to issue).
DIRECT_MIN_RUN_BYTES = 16 << 20
#: ``direct="auto"``: and only when every plane slice is at least this long (the 2D DMA moves
#: ``slice`` bytes per row; measured at 32 KiB rows; short rows are left to the staging path).
DIRECT_MIN_SLICE = 8 << 10

DIRECT_MODES = ("auto", "always", "never")


def check_direct(direct: object) -> str:
    if direct not in DIRECT_MODES:
        raise CopyArgumentError(f"direct must be one of {', '.join(map(repr, DIRECT_MODES))}, got {direct!r}")
    return str(direct)


class DirectPlan:
    """How the pages of one transfer split: ``runs`` of ``(first page, pages)`` moved directly,
    ``rest`` the indices of the pages left to the staging path (``None``: no page is direct)."""

    __slots__ = ("addresses", "rest", "runs")

    def __init__(self, runs: list[tuple[int, int]], rest: npt.NDArray[np.int64] | None,
                 addresses: npt.NDArray[np.uint64] | None) -> None:
        self.runs = runs
        self.rest = rest
        self.addresses = addresses

    @property
    def all_direct(self) -> bool:
        return bool(self.runs) and self.rest is not None and not self.rest.size


NO_PLAN = DirectPlan([], None, None)


def plan(mode: str, layout: Any, ids: list[int], addresses: npt.NDArray[np.uint64] | None) -> DirectPlan:
    """Split pages ``0..len(ids)`` into direct runs and the rest (numpy: no per-page objects).

    ``addresses``: the host pages' start addresses (``None`` when a page is in several pieces:
    nothing is direct).  A run breaks where a block id is not its predecessor's plus one, where a
    host page does not follow its predecessor, or where a host page starts another pinned
    allocation (a DMA must not cross from one registration into the next)."""
    n = len(ids)
    if mode == "never" or addresses is None or not n:
        return NO_PLAN
    P = layout.page_nbytes
    if mode == "auto":
        if min(spec.nbytes for spec in layout.planes) < DIRECT_MIN_SLICE:
            return NO_PLAN
        min_pages = max(1, -(-DIRECT_MIN_RUN_BYTES // P))
    else:
        min_pages = 1
    if n < min_pages:
        return NO_PLAN
    idv = np.asarray(ids, dtype=np.int64)
    brk = np.ones(n, dtype=bool)
    if n > 1:
        brk[1:] = (idv[1:] != idv[:-1] + 1) | (addresses[1:] != addresses[:-1] + np.uint64(P))
        brk[1:] |= registration_starts(addresses[1:])
    first = np.flatnonzero(brk)
    lengths = np.diff(np.append(first, n))
    long = lengths >= min_pages
    if not long.any():
        return NO_PLAN
    runs = list(zip(first[long].tolist(), lengths[long].tolist(), strict=True))
    keep = np.ones(n, dtype=bool)
    for lo, k in runs:
        keep[lo : lo + k] = False
    return DirectPlan(runs, np.flatnonzero(keep), addresses)


def issue(d: Any, planes: Any, ids: list[int], dplan: DirectPlan, specs: Any, stream: Any, *, to_device: bool) -> None:
    """Enqueue the direct runs of ``dplan`` for planes ``specs`` on ``stream``: one
    ``cuMemcpy2DAsync`` per (run, plane)."""
    assert dplan.addresses is not None
    P = planes.layout.page_nbytes
    host_mem = d.CUmemorytype.CU_MEMORYTYPE_HOST
    dev_mem = d.CUmemorytype.CU_MEMORYTYPE_DEVICE
    addrs = dplan.addresses
    for lo, k in dplan.runs:
        host0 = int(addrs[lo])
        b0 = ids[lo]
        for spec in specs:
            stride = planes.block_strides[spec.index]
            cp = d.CUDA_MEMCPY2D()
            if to_device:
                cp.srcMemoryType = host_mem
                cp.srcHost = host0 + spec.offset
                cp.srcPitch = P
                cp.dstMemoryType = dev_mem
                cp.dstDevice = planes.ptrs[spec.index] + b0 * stride
                cp.dstPitch = stride
            else:
                cp.srcMemoryType = dev_mem
                cp.srcDevice = planes.ptrs[spec.index] + b0 * stride
                cp.srcPitch = stride
                cp.dstMemoryType = host_mem
                cp.dstHost = host0 + spec.offset
                cp.dstPitch = P
            cp.WidthInBytes = spec.nbytes
            cp.Height = k
            _cuda.check(d.cuMemcpy2DAsync(cp, stream), "cuMemcpy2DAsync(direct)")
