"""The `tiered://` provider (docs/providers/tiered.md)."""

from __future__ import annotations

from hostkv_providers.providers.tiered._provider import TieredProvider

__all__ = ["TieredProvider"]
