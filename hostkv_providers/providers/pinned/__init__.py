"""The `pinned://` provider (docs/providers/pinned.md)."""

from __future__ import annotations

from hostkv_providers.providers.pinned._mapped import MappedPinnedProvider, MirrorHandle, StreamFence
from hostkv_providers.providers.pinned._provider import PinnedProvider

__all__ = ["MappedPinnedProvider", "MirrorHandle", "PinnedProvider", "StreamFence"]
