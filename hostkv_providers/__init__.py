"""hostkv-providers: a host-side tier for LLM KV caches behind one pluggable storage interface.

Public names are re-exported here; modules starting with ``_`` are private.
"""

from __future__ import annotations

from ._checksum import CHECKSUM_ALGORITHM, checksum
from ._errors import (
    CapacityError,
    ClosedError,
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

#: ``hostkv_providers.open(url)`` builds a provider from a URL.
open = open_provider  # noqa: A001 - the documented entry point, shadowing is intended

__version__ = "0.1.0"

__all__ = [
    "CAPABILITY_NAMES",
    "CHECKSUM_ALGORITHM",
    "DISABLE_PLUGINS_ENV",
    "DTYPE_ITEMSIZE",
    "ENTRY_POINT_GROUP",
    "FORMAT_VERSION",
    "KEY_ALGORITHM",
    "KEY_NBYTES",
    "ZERO_KEY",
    "ByteSpan",
    "CapacityError",
    "ClosedError",
    "CompactReport",
    "CopyEngineError",
    "CorruptStoreError",
    "EntryInfo",
    "EvictReport",
    "HostAllocation",
    "HostAllocator",
    "HostKVError",
    "HostRegion",
    "InFlightError",
    "IncompatibleStoreError",
    "IncompleteWriteError",
    "InvalidArgumentError",
    "KVLayout",
    "Key",
    "Lease",
    "LockedError",
    "MediaItem",
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
    "Salt",
    "SpanError",
    "StorageIOError",
    "SupportsCompact",
    "SupportsIterate",
    "SupportsVerify",
    "SupportsViews",
    "TreeIndex",
    "UnknownKeyError",
    "UnknownProviderError",
    "UnsafeStoreError",
    "UsedAfterForkError",
    "VerifyReport",
    "__version__",
    "as_key",
    "available_providers",
    "chain_keys",
    "check_anchor_name",
    "checksum",
    "format_size",
    "open",
    "open_provider",
    "parse_size",
    "parse_url",
    "provider_class",
    "readable_bytes",
    "writable_buffer",
]
