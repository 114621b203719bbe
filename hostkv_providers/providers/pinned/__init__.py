"""The `pinned://` provider (docs/providers/pinned.md)."""

from __future__ import annotations

from hostkv_providers.providers.pinned._arena import _HASH_THREADS as SEAL_HASH_THREADS
from hostkv_providers.providers.pinned._arena import _checksums as seal_checksums
from hostkv_providers.providers.pinned._mapped import MappedPinnedProvider, MirrorHandle, StreamFence
from hostkv_providers.providers.pinned._provider import PinnedProvider

#: ``seal_checksums(entries)``: the seal path's checksums (XXH3-64 per entry, over its regions),
#: split over a few threads for large batches -- what ``seal_many`` spends its time on, public so
#: ``benchmarks/bench_engine.py`` can measure the host hashing rate beside the link.
__all__ = [
    "SEAL_HASH_THREADS",
    "MappedPinnedProvider",
    "MirrorHandle",
    "PinnedProvider",
    "StreamFence",
    "seal_checksums",
]
