"""KVPlanes and host page regions: where a copy reads and writes."""

from __future__ import annotations

import mmap
from collections.abc import Sequence
from typing import Any

from hostkv_providers._errors import (
    CopyArgumentError,
)
from hostkv_providers._layout import KVLayout
from hostkv_providers._region import HostRegion
from hostkv_providers.device import _cuda

_MiB = 1 << 20
_PAGE = mmap.PAGESIZE


def cuda_available() -> bool:
    """Whether a CUDA device is usable in this process (decided once and cached)."""
    return _cuda.available()


def _layer_spans(layout: Any) -> list[tuple[int, int, int, int]]:
    """Per layer: ``(first plane index, planes, first byte in the page, bytes)``.  A layer's
    planes are adjacent in ``layout.planes`` and in the page (:class:`KVLayout` packs layer by
    layer)."""
    out: list[tuple[int, int, int, int]] = []
    for spec in layout.planes:
        if out and spec.layer == len(out) - 1:
            p0, k, lo, nb = out[-1]
            if spec.offset != lo + nb:
                raise CopyArgumentError(f"plane {spec.index}: the planes of layer {spec.layer} are not adjacent")
            out[-1] = (p0, k + 1, lo, nb + spec.nbytes)
        else:
            if spec.layer != len(out):
                raise CopyArgumentError(f"plane {spec.index}: layer {spec.layer} out of packing order")
            out.append((spec.index, 1, spec.offset, spec.nbytes))
    return out


class KVPlanes:
    """An inference engine's KV memory: one array of blocks per ``layout.planes`` entry.

    Plane ``p``'s slice for block ``b`` is the ``layout.planes[p].nbytes`` bytes at
    ``ptrs[p] + b * block_strides[p]``.  ``device`` is the CUDA ordinal holding the planes, or
    ``-1`` for host memory.  The object keeps ``keepalive`` (tensors, arrays) referenced so the
    memory outlives every transfer that uses it.

    Use :meth:`from_torch` or :meth:`from_arrays` rather than raw pointers where you can: they
    check shapes and record the bounds of each plane's memory.
    """

    def __init__(
        self,
        layout: KVLayout,
        ptrs: Sequence[int],
        block_strides: Sequence[int],
        num_blocks: int,
        device: int = -1,
        *,
        keepalive: Sequence[object] = (),
        readonly: bool = False,
        extents: Sequence[tuple[int, int]] | None = None,
    ) -> None:
        if not isinstance(layout, KVLayout):
            raise CopyArgumentError(f"layout must be a KVLayout, got {type(layout).__name__}")
        nplanes = len(layout.planes)
        if len(ptrs) != nplanes or len(block_strides) != nplanes:
            raise CopyArgumentError(
                f"the layout has {nplanes} planes but {len(ptrs)} pointers and {len(block_strides)} strides were given")
        if type(num_blocks) is not int or num_blocks <= 0:
            raise CopyArgumentError(f"num_blocks must be a positive int, got {num_blocks!r}")
        if type(device) is not int or device < -1:
            raise CopyArgumentError(f"device must be a CUDA ordinal or -1 (host), got {device!r}")
        for p, (ptr, stride) in enumerate(zip(ptrs, block_strides, strict=True)):
            if type(ptr) is not int or ptr <= 0:
                raise CopyArgumentError(f"plane {p}: pointer must be a positive int, got {ptr!r}")
            if type(stride) is not int or (stride < layout.planes[p].nbytes and num_blocks > 1):
                raise CopyArgumentError(
                    f"plane {p}: block stride {stride!r} is smaller than the plane slice "
                    f"({layout.planes[p].nbytes} bytes): blocks would overlap")
        if extents is not None:
            for p, (base, size) in enumerate(extents):
                end = ptrs[p] + (num_blocks - 1) * block_strides[p] + layout.planes[p].nbytes
                if ptrs[p] < base or end > base + size:
                    raise CopyArgumentError(f"plane {p}: blocks reach past the memory that holds them")
        self.layout = layout
        self.ptrs: tuple[int, ...] = tuple(ptrs)
        self.block_strides: tuple[int, ...] = tuple(block_strides)
        self.num_blocks = num_blocks
        self.device = device
        self.readonly = readonly
        self._keepalive = tuple(keepalive)

    def slice_address(self, plane: int, block: int) -> int:
        """Address of plane ``plane``'s slice of block ``block``."""
        return self.ptrs[plane] + block * self.block_strides[plane]

    @classmethod
    def from_arrays(cls, layout: KVLayout, arrays: Sequence[Any]) -> KVPlanes:
        """Planes in host memory from numpy arrays, one per plane, first dimension = block."""
        import numpy as np

        if len(arrays) != len(layout.planes):
            raise CopyArgumentError(f"the layout has {len(layout.planes)} planes, {len(arrays)} arrays given")
        ptrs, strides, extents, nblocks = [], [], [], None
        readonly = False
        for p, arr in enumerate(arrays):
            if not isinstance(arr, np.ndarray):
                raise CopyArgumentError(f"plane {p}: expected a numpy array, got {type(arr).__name__}")
            if arr.dtype.hasobject:  # its bytes are object pointers: a restore would overwrite them
                raise CopyArgumentError(f"plane {p}: an array of Python objects is not KV memory")
            if arr.ndim < 2:
                raise CopyArgumentError(f"plane {p}: expected one row per block, got shape {arr.shape}")
            nblocks = _plane_geometry(p, layout, arr.shape, nblocks)
            one = arr[0]
            if not one.flags.c_contiguous or one.nbytes != layout.planes[p].nbytes:
                raise CopyArgumentError(
                    f"plane {p}: one block must be {layout.planes[p].nbytes} contiguous bytes, "
                    f"got {one.nbytes} (contiguous={one.flags.c_contiguous})")
            if arr.strides[0] <= 0:
                raise CopyArgumentError(f"plane {p}: the block stride must be positive")
            readonly |= not arr.flags.writeable
            ptrs.append(int(arr.ctypes.data))
            strides.append(int(arr.strides[0]))
            lo = int(arr.ctypes.data)
            extents.append((lo, (arr.shape[0] - 1) * arr.strides[0] + one.nbytes))
        assert nblocks is not None
        return cls(layout, ptrs, strides, nblocks, -1, keepalive=tuple(arrays), readonly=readonly, extents=extents)

    @classmethod
    def from_torch(cls, layout: KVLayout, tensors: Sequence[Any]) -> KVPlanes:
        """Planes from torch tensors (CUDA or CPU), one per plane, first dimension = block.

        A vLLM-style per-layer ``[2, num_blocks, ...]`` cache gives its planes as ``t[0]``
        and ``t[1]``.  Torch is imported only by the caller; nothing here needs it.
        """
        if len(tensors) != len(layout.planes):
            raise CopyArgumentError(f"the layout has {len(layout.planes)} planes, {len(tensors)} tensors given")
        ptrs, strides, nblocks, device = [], [], None, None
        for p, t in enumerate(tensors):
            if not hasattr(t, "data_ptr") or not hasattr(t, "element_size"):
                raise CopyArgumentError(f"plane {p}: expected a torch tensor, got {type(t).__name__}")
            nblocks = _plane_geometry(p, layout, tuple(t.shape), nblocks)
            kind = t.device.type
            if kind == "cuda":
                dev = int(t.device.index if t.device.index is not None else 0)
            elif kind == "cpu":
                dev = -1
            else:
                raise CopyArgumentError(f"plane {p}: tensors on {kind!r} are not supported (cuda or cpu only)")
            if device is None:
                device = dev
            elif dev != device:
                raise CopyArgumentError(f"plane {p}: all planes must be on one device ({device} and {dev} given)")
            one = t[0]
            if not one.is_contiguous() or one.numel() * t.element_size() != layout.planes[p].nbytes:
                raise CopyArgumentError(
                    f"plane {p}: one block must be {layout.planes[p].nbytes} contiguous bytes, "
                    f"got {one.numel() * t.element_size()} (contiguous={one.is_contiguous()})")
            ptrs.append(int(t.data_ptr()))
            strides.append(int(t.stride(0)) * int(t.element_size()))
        assert nblocks is not None and device is not None
        return cls(layout, ptrs, strides, nblocks, device, keepalive=tuple(tensors))

    def __repr__(self) -> str:
        where = "host" if self.device < 0 else f"cuda:{self.device}"
        return f"<KVPlanes {len(self.ptrs)} planes x {self.num_blocks} blocks on {where}>"


def _plane_geometry(p: int, layout: KVLayout, shape: tuple[int, ...], nblocks: int | None) -> int:
    if len(shape) < 1 or shape[0] <= 0:
        raise CopyArgumentError(f"plane {p}: the first dimension (blocks) must be non-empty, shape {shape}")
    if nblocks is not None and shape[0] != nblocks:
        raise CopyArgumentError(f"plane {p}: {shape[0]} blocks, but earlier planes have {nblocks}")
    return int(shape[0])


def page_regions(view: memoryview, address: int, page_nbytes: int, count: int, *, pinned: bool = False,
                 stride: int | None = None) -> list[list[HostRegion]]:
    """Cut a contiguous host buffer into ``count`` pages of one region each (page ``i`` at ``i * stride``)."""
    stride = page_nbytes if stride is None else stride
    if stride < page_nbytes or (count and (count - 1) * stride + page_nbytes > len(view)):
        raise CopyArgumentError(f"a {len(view)}-byte buffer cannot hold {count} pages of {page_nbytes} bytes")
    return [[HostRegion(0, view[i * stride: i * stride + page_nbytes], address + i * stride, pinned)]
            for i in range(count)]
