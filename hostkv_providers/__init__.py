"""hostkv-providers: a host-side tier for LLM KV caches behind one pluggable storage interface.

Public names are re-exported here; modules starting with ``_`` are private.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._cache import (
    AdmissionPolicy,
    AdmissionRequest,
    AdmitAll,
    AllOf,
    AnchorsOnly,
    CacheHandle,
    CacheHit,
    CacheStats,
    HostKVCache,
    MinDepth,
    RestoreResult,
    SaveResult,
    SeenAtLeast,
)
from ._checksum import CHECKSUM_ALGORITHM, checksum
from ._copy import (
    CopyEngine,
    CpuCopyEngine,
    CudaCopyEngine,
    CudaHostAllocator,
    KVPlanes,
    StagedTransfer,
    StagingPool,
    TransferHandle,
    cuda_available,
    default_copy_engine,
    page_regions,
    pinned_allocator,
)
from ._errors import (
    CapacityError,
    ClosedError,
    CopyArgumentError,
    CopyEngineError,
    CorruptStoreError,
    HostKVError,
    IncompatibleStoreError,
    IncompleteWriteError,
    InFlightError,
    InvalidArgumentError,
    LockedError,
    NoSpaceError,
    ReservationError,
    SpanError,
    StorageIOError,
    UnknownKeyError,
    UnknownProviderError,
    UnsafeStoreError,
    UsedAfterForkError,
)
from ._hostmem import HostAllocation, HostAllocator, OrdinaryAllocator
from ._index import Node, TreeIndex
from ._keys import FORMAT_VERSION, KEY_ALGORITHM, KEY_NBYTES, ZERO_KEY, Key, MediaItem, Salt, as_key, chain_keys
from ._kvmap import HFCacheMap, dequantize, paged_planes, quantize
from ._layout import DTYPE_ITEMSIZE, KVLayout, PlaneSpec
from ._options import Options, format_size, parse_size
from ._pinned import PinnedProvider
from ._provider import (
    CAPABILITY_NAMES,
    CompactReport,
    EntryInfo,
    EvictReport,
    HostRegion,
    Lease,
    Provider,
    ProviderStats,
    Reservation,
    SupportsBatch,
    SupportsCompact,
    SupportsIterate,
    SupportsVerify,
    SupportsViews,
    VerifyReport,
    check_anchor_name,
    readable_bytes,
    writable_buffer,
)
from ._registry import (
    DISABLE_PLUGINS_ENV,
    ENTRY_POINT_GROUP,
    ProviderInfo,
    available_providers,
    open_provider,
    parse_url,
    provider_class,
)
from ._span import ByteSpan

if TYPE_CHECKING:
    from ._lmdb import LmdbProvider
    from ._mmap import MmapProvider
    from ._tiered import TieredProvider

# Provider classes with heavier imports (py-lmdb, the file-store machinery) load on first use,
# as the registry loads them: ``import hostkv_providers`` stays light and works where an optional
# medium's library is missing.
_LAZY = {
    "LmdbProvider": "._lmdb",
    "MmapProvider": "._mmap",
    "TieredProvider": "._tiered",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hostkv_providers' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


#: ``hostkv_providers.open(url)`` builds a provider from a URL.
open = open_provider  # noqa: A001 - the documented entry point, shadowing is intended

__version__ = "0.1.0"

__all__ = [
    "AdmissionPolicy",
    "AdmissionRequest",
    "AdmitAll",
    "AllOf",
    "AnchorsOnly",
    "ByteSpan",
    "CAPABILITY_NAMES",
    "CHECKSUM_ALGORITHM",
    "CacheHandle",
    "CacheHit",
    "CacheStats",
    "CapacityError",
    "ClosedError",
    "CompactReport",
    "CopyArgumentError",
    "CopyEngine",
    "CopyEngineError",
    "CorruptStoreError",
    "CpuCopyEngine",
    "CudaCopyEngine",
    "CudaHostAllocator",
    "DISABLE_PLUGINS_ENV",
    "DTYPE_ITEMSIZE",
    "ENTRY_POINT_GROUP",
    "EntryInfo",
    "EvictReport",
    "FORMAT_VERSION",
    "HFCacheMap",
    "HostAllocation",
    "HostAllocator",
    "HostKVCache",
    "HostKVError",
    "HostRegion",
    "InFlightError",
    "IncompatibleStoreError",
    "IncompleteWriteError",
    "InvalidArgumentError",
    "KEY_ALGORITHM",
    "KEY_NBYTES",
    "KVLayout",
    "KVPlanes",
    "Key",
    "Lease",
    "LmdbProvider",
    "LockedError",
    "MediaItem",
    "MinDepth",
    "MmapProvider",
    "NoSpaceError",
    "Node",
    "Options",
    "OrdinaryAllocator",
    "PinnedProvider",
    "PlaneSpec",
    "Provider",
    "ProviderInfo",
    "ProviderStats",
    "Reservation",
    "ReservationError",
    "RestoreResult",
    "Salt",
    "SaveResult",
    "SeenAtLeast",
    "SpanError",
    "StagedTransfer",
    "StagingPool",
    "StorageIOError",
    "SupportsBatch",
    "SupportsCompact",
    "SupportsIterate",
    "SupportsVerify",
    "SupportsViews",
    "TieredProvider",
    "TransferHandle",
    "TreeIndex",
    "UnknownKeyError",
    "UnknownProviderError",
    "UnsafeStoreError",
    "UsedAfterForkError",
    "VerifyReport",
    "ZERO_KEY",
    "__version__",
    "as_key",
    "available_providers",
    "chain_keys",
    "check_anchor_name",
    "checksum",
    "cuda_available",
    "default_copy_engine",
    "dequantize",
    "format_size",
    "open",
    "open_provider",
    "page_regions",
    "paged_planes",
    "parse_size",
    "parse_url",
    "pinned_allocator",
    "provider_class",
    "quantize",
    "readable_bytes",
    "writable_buffer",
]
