"""The device layer: host memory (ordinary and page-locked), and the copy engines.

It moves bytes between an engine's KV planes and host regions and knows nothing of providers:
the cache layer (:mod:`hostkv_providers.cache`) connects the two.  ``cuda.bindings`` is imported
only by ``_cuda`` and only when a CUDA path is used.
"""

from __future__ import annotations

from hostkv_providers._region import HostPages, HostRegion
from hostkv_providers.device._copy import (
    CopyArgumentError,
    CopyEngine,
    CpuCopyEngine,
    CudaCopyEngine,
    Gate,
    HostStream,
    KVPlanes,
    StreamMark,
    TransferHandle,
    cuda_available,
    default_copy_engine,
    page_regions,
)
from hostkv_providers.device._hash import PageDigests, PageHasher
from hostkv_providers.device._hostmem import (
    CudaHostAllocator,
    CudaPinnedAllocation,
    HostAllocation,
    HostAllocator,
    OrdinaryAllocator,
    pinned_allocator,
)
from hostkv_providers.device._sparse import (
    CpuPageMover,
    CpuSlotCache,
    DeviceMappingError,
    PageMover,
    PageTable,
    SlotCache,
    page_digest,
)

__all__ = [
    "PageDigests",
    "PageHasher",
    "CopyArgumentError",
    "CopyEngine",
    "CpuCopyEngine",
    "CpuPageMover",
    "CpuSlotCache",
    "CudaCopyEngine",
    "CudaHostAllocator",
    "CudaPinnedAllocation",
    "DeviceMappingError",
    "Gate",
    "HostAllocation",
    "HostAllocator",
    "HostPages",
    "HostRegion",
    "HostStream",
    "KVPlanes",
    "OrdinaryAllocator",
    "PageMover",
    "PageTable",
    "SlotCache",
    "StreamMark",
    "TransferHandle",
    "cuda_available",
    "default_copy_engine",
    "page_digest",
    "page_regions",
    "pinned_allocator",
]
