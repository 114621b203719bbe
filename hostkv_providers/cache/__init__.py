"""The engine layer: :class:`HostKVCache` (keys, leased lookups, async restore and save, anchors)
and the mappings from an engine's memory (paged planes, Hugging Face caches) to packed pages.

It depends on the providers and on the device layer; neither depends on it.
"""

from __future__ import annotations

from hostkv_providers._keys import MediaItem, Salt, chain_keys
from hostkv_providers._layout import DTYPE_ITEMSIZE, KVLayout, PlaneSpec
from hostkv_providers.cache._cache import (
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
from hostkv_providers.cache._hfhybrid import HybridCacheMap
from hostkv_providers.cache._hybrid import (
    ANCHOR_HEADER_NBYTES,
    AnchorMismatchError,
    abandon_prefill,
    anchor_depths,
    prefill_pages_cap,
    prefill_pending,
    put_anchor,
)
from hostkv_providers.cache._kvmap import HFCacheMap, cache_layers, dequantize, paged_planes, plane_dtype_name, quantize
from hostkv_providers.cache._staging import StagedTransfer, StagingPool

__all__ = [
    "ANCHOR_HEADER_NBYTES",
    "AnchorMismatchError",
    "abandon_prefill",
    "anchor_depths",
    "prefill_pages_cap",
    "prefill_pending",
    "put_anchor",
    "DTYPE_ITEMSIZE",
    "AdmissionPolicy",
    "AdmissionRequest",
    "AdmitAll",
    "AllOf",
    "AnchorsOnly",
    "CacheHandle",
    "CacheHit",
    "CacheStats",
    "HFCacheMap",
    "HostKVCache",
    "HybridCacheMap",
    "KVLayout",
    "MediaItem",
    "MinDepth",
    "PlaneSpec",
    "RestoreResult",
    "Salt",
    "SaveResult",
    "SeenAtLeast",
    "StagedTransfer",
    "StagingPool",
    "cache_layers",
    "chain_keys",
    "dequantize",
    "paged_planes",
    "plane_dtype_name",
    "quantize",
]
