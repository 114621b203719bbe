"""What the cache needs of the copy engine and of host memory: the copy-engine Protocol, plane
normalisation, bounce buffers, and the small shared aliases."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from hostkv_providers._errors import (
    InvalidArgumentError,
)
from hostkv_providers._layout import KVLayout
from hostkv_providers._region import HostPages, HostRegion
from hostkv_providers.device._hostmem import HostAllocation, HostAllocator, OrdinaryAllocator

AnchorBlobs = Mapping[str, object]
AnchorSource = Mapping[int, AnchorBlobs] | Callable[[int], AnchorBlobs | None]
_VIEW_LEASE_PAGES = 32


# --------------------------------------------------------------------------------------------
# The copy engine as seen from here (hostkv_providers.device._copy implements it)
# --------------------------------------------------------------------------------------------


class _Transfer(Protocol):
    def done(self) -> bool: ...

    def wait(self) -> object: ...


class CopyEngineLike(Protocol):
    """What the cache needs of a copy engine (``CpuCopyEngine``, the CUDA engine)."""

    def save(self, planes: Any, block_ids: Sequence[int], dst: Sequence[Sequence[HostRegion]], *,
             after: Any = None) -> Any: ...

    def restore(self, src: Sequence[Sequence[HostRegion]] | HostPages, planes: Any, block_ids: Sequence[int], *,
                before: Any = None) -> Any: ...


def _check_max_pages(max_pages: object) -> int:
    """Validate ``lookup(max_pages=)`` (hybrid hook, cache/_hybrid.py)."""
    if type(max_pages) is not int or max_pages < 0:
        raise InvalidArgumentError(f"max_pages must be an int >= 0, got {max_pages!r}",
                                   hint="prefill_pages_cap(num_tokens, page_tokens) keeps >= 1 token to prefill")
    return max_pages


def _default_engine() -> CopyEngineLike:
    from hostkv_providers.device import _copy  # lazily: it may import CUDA

    return _copy.default_copy_engine()


def _as_planes(layout: KVLayout, planes: Any) -> Any:
    """Accept a ``KVPlanes`` or a list of per-plane tensors/arrays (ordered as ``layout.planes``)."""
    if hasattr(planes, "ptrs") and hasattr(planes, "num_blocks"):
        if getattr(planes, "layout", layout) != layout:
            raise InvalidArgumentError("the KVPlanes were built for another layout")
        return planes
    if isinstance(planes, (list, tuple)):
        from hostkv_providers.device import _copy
        if len(planes) != len(layout.planes):
            raise InvalidArgumentError(f"{len(planes)} plane tensors given, the layout has {len(layout.planes)}")
        if planes and isinstance(planes[0], np.ndarray):
            return _copy.KVPlanes.from_arrays(layout, list(planes))
        return _copy.KVPlanes.from_torch(layout, list(planes))
    raise InvalidArgumentError(
        f"expected KVPlanes or a list of plane tensors, got {type(planes).__name__}",
        hint="build planes with paged_planes(...) or HFCacheMap.pack(...)",
    )


def _staging_allocator() -> HostAllocator:
    """Page-locked bounce buffers when CUDA is usable (DMA at full rate), else ordinary memory."""
    try:
        from hostkv_providers.device._hostmem import pinned_allocator
    except ImportError:
        return OrdinaryAllocator()
    alloc = pinned_allocator()
    return alloc if alloc is not None else OrdinaryAllocator()


class _Staging:
    """``pages`` page-sized bounce slots in one host allocation."""

    def __init__(self, allocator: HostAllocator, page_nbytes: int, pages: int) -> None:
        self.page_nbytes = page_nbytes
        self.pages = pages
        self.alloc: HostAllocation = allocator.allocate(page_nbytes * pages)
        self.array = np.frombuffer(self.alloc.view, dtype=np.uint8, count=page_nbytes * pages)

    def region(self, i: int) -> list[HostRegion]:
        lo = i * self.page_nbytes
        view = self.alloc.view[lo : lo + self.page_nbytes]
        return [HostRegion(0, view, self.alloc.address + lo, self.alloc.pinned)]

    def page(self, i: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
        lo = i * self.page_nbytes
        return self.array[lo : lo + self.page_nbytes]

    def close(self) -> None:
        del self.array
        self.alloc.close()
