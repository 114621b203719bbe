"""The provider layer: the built-in providers, and the kit a provider author builds on.

An author subclasses :class:`Provider` (the contract and its front) — or, for a medium without an
index of its own, :class:`IndexedProvider` (every driver over the in-process :class:`TreeIndex`;
the medium only moves bytes) — declares URL options with :class:`OptionSet`, and proves the
result with :class:`hostkv_providers.testing.ProviderTests`.
``docs/writing-a-provider.md`` walks through it.

The built-in provider classes with heavier imports (py-lmdb, the file-store machinery) load on
first use, as the registry loads them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hostkv_providers._blockhash import TREE_ALGORITHM, tree_checksum, tree_checksum_parts
from hostkv_providers._capabilities import (
    CAPABILITY_FLAGS,
    CAPABILITY_NAMES,
    CAPABILITY_PROTOCOLS,
    SupportsBatch,
    SupportsBatchViews,
    SupportsCompact,
    SupportsDeviceMapped,
    SupportsIterate,
    SupportsPinnedViews,
    SupportsRetain,
    SupportsStoreCounters,
    SupportsVerify,
    SupportsViews,
)
from hostkv_providers._chain import ChainRun, ReservedChain
from hostkv_providers._checks import (
    check_anchor_name,
    check_flag,
    check_progress,
    check_retain_share,
    check_span,
    check_timeout,
    overlapping,
    readable_bytes,
    scatter_into,
    writable_buffer,
)
from hostkv_providers._checksum import CHECKSUM_ALGORITHM, checksum, checksum_parts
from hostkv_providers._keys import (
    FORMAT_VERSION,
    KEY_ALGORITHM,
    KEY_NBYTES,
    MAX_TP_WORLD_SIZE,
    ZERO_KEY,
    Key,
    SaltTag,
    as_key,
    parse_salt_tag,
)
from hostkv_providers._options import Option, Options, OptionSet, format_size, parse_size
from hostkv_providers._provider import COUNTED, Corrupt, Provider
from hostkv_providers._region import HostRegion
from hostkv_providers._registry import (
    DISABLE_PLUGINS_ENV,
    ENTRY_POINT_GROUP,
    ProviderInfo,
    available_providers,
    open_provider,
    parse_url,
    provider_class,
)
from hostkv_providers._reports import (
    CompactReport,
    EntryInfo,
    EvictReport,
    Progress,
    ProviderStats,
    VerifyReport,
)
from hostkv_providers._reservation import Lease, Reservation
from hostkv_providers._span import ByteSpan
from hostkv_providers.providers._indexed import IndexedProvider
from hostkv_providers.providers._tree import TreeIndex
from hostkv_providers.providers.pinned import MappedPinnedProvider, MirrorHandle, PinnedProvider, StreamFence

if TYPE_CHECKING:
    from hostkv_providers.providers.lmdb import LmdbProvider
    from hostkv_providers.providers.mmap import MmapProvider
    from hostkv_providers.providers.tiered import TieredProvider

_LAZY = {
    "LmdbProvider": "hostkv_providers.providers.lmdb",
    "MmapProvider": "hostkv_providers.providers.mmap",
    "TieredProvider": "hostkv_providers.providers.tiered",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "TREE_ALGORITHM",
    "CAPABILITY_FLAGS",
    "CAPABILITY_NAMES",
    "CAPABILITY_PROTOCOLS",
    "COUNTED",
    "CHECKSUM_ALGORITHM",
    "DISABLE_PLUGINS_ENV",
    "ENTRY_POINT_GROUP",
    "FORMAT_VERSION",
    "KEY_ALGORITHM",
    "KEY_NBYTES",
    "MAX_TP_WORLD_SIZE",
    "ZERO_KEY",
    "ByteSpan",
    "CompactReport",
    "Corrupt",
    "EntryInfo",
    "EvictReport",
    "HostRegion",
    "IndexedProvider",
    "Key",
    "Lease",
    "LmdbProvider",
    "MappedPinnedProvider",
    "MirrorHandle",
    "MmapProvider",
    "Option",
    "OptionSet",
    "Options",
    "PinnedProvider",
    "Progress",
    "Provider",
    "ProviderInfo",
    "ProviderStats",
    "Reservation",
    "SaltTag",
    "StreamFence",
    "ChainRun",
    "ReservedChain",
    "SupportsBatch",
    "SupportsBatchViews",
    "SupportsCompact",
    "SupportsDeviceMapped",
    "SupportsRetain",
    "SupportsIterate",
    "SupportsPinnedViews",
    "SupportsStoreCounters",
    "SupportsVerify",
    "SupportsViews",
    "TieredProvider",
    "TreeIndex",
    "VerifyReport",
    "as_key",
    "available_providers",
    "check_anchor_name",
    "check_flag",
    "check_progress",
    "check_span",
    "check_timeout",
    "check_retain_share",
    "checksum",
    "checksum_parts",
    "format_size",
    "open_provider",
    "overlapping",
    "parse_salt_tag",
    "tree_checksum",
    "tree_checksum_parts",
    "parse_size",
    "parse_url",
    "provider_class",
    "readable_bytes",
    "scatter_into",
    "writable_buffer",
]
