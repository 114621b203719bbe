"""The `mmap://` provider (docs/providers/mmap.md)."""

from __future__ import annotations

from hostkv_providers.providers.mmap._provider import MmapProvider

__all__ = ["MmapProvider"]
