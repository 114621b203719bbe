"""The `lmdb://` provider (docs/providers/lmdb.md)."""

from __future__ import annotations

from hostkv_providers.providers.lmdb._provider import LmdbProvider

__all__ = ["LmdbProvider"]
