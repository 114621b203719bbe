"""The contract's value types: what a provider reports (entry metadata, eviction, verify and
compact outcomes, statistics) and the progress callback of its long operations."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from hostkv_providers._keys import Key

__all__ = ["CompactReport", "EntryInfo", "EvictReport", "Progress", "ProviderStats", "VerifyReport"]

Progress = Callable[[int, int], None]
"""``progress(done, total)`` callback used by long operations (verify, compact, copy)."""


@dataclass(frozen=True, slots=True)
class EntryInfo:
    """Metadata of one sealed entry."""

    key: Key
    parent: Key | None
    nbytes: int
    salt_tag: str
    checksum: int | None
    created: float  # seconds since the epoch, at seal
    last_used: float  # seconds since the epoch, last lease/read/seal (approximate)
    anchors: Mapping[str, int] = field(default_factory=dict)  # name -> nbytes
    retained: bool = False  # marked by ``SupportsRetain.retain`` (never evicted for room)


@dataclass(slots=True)
class EvictReport:
    """What an ``evict`` call removed, and what it had to leave (leased or in flight)."""

    entries: int = 0
    nbytes: int = 0
    skipped: int = 0


@dataclass(slots=True)
class VerifyReport:
    """Outcome of a full verification pass (``SupportsVerify.verify``)."""

    checked: int = 0
    corrupt: list[Key] = field(default_factory=list)
    dropped: int = 0  # entries removed by repair (corrupt ones plus their subtrees)
    problems: list[str] = field(default_factory=list)  # store-level findings (orphans, accounting)

    @property
    def ok(self) -> bool:
        return not self.corrupt and not self.problems


@dataclass(slots=True)
class CompactReport:
    """Outcome of a compaction."""

    entries: int = 0
    bytes_before: int = 0
    bytes_after: int = 0


@dataclass(slots=True)
class ProviderStats:
    """Counters and gauges of one provider instance (gauges are store-wide where possible)."""

    name: str
    entries: int
    used_bytes: int
    budget_bytes: int
    anchors: int = 0
    leased: int = 0
    in_flight: int = 0
    hits: int = 0
    misses: int = 0
    seals: int = 0
    aborts: int = 0
    dedup: int = 0
    evictions: int = 0
    evicted_bytes: int = 0
    checksum_failures: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    retained: int = 0  # entries marked retained (``SupportsRetain``)
    retained_bytes: int = 0  # budget bytes of the retained entries and their ancestors, counted once
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in self.__slots__ if k != "extra"}
        out.update(self.extra)
        return out
