"""The optional powers: runtime-checkable Protocols (``isinstance(provider, SupportsX)``) and the
capability names derived from them; only ``persistent`` and ``multiprocess`` are class flags."""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

from hostkv_providers._errors import HostKVError
from hostkv_providers._keys import Key
from hostkv_providers._region import HostRegion
from hostkv_providers._reports import CompactReport, EntryInfo, Progress, VerifyReport
from hostkv_providers._reservation import Lease

__all__ = [
    "CAPABILITY_FLAGS",
    "CAPABILITY_NAMES",
    "CAPABILITY_PROTOCOLS",
    "SupportsBatch",
    "SupportsBatchViews",
    "SupportsCompact",
    "SupportsDeviceMapped",
    "SupportsIterate",
    "SupportsPinnedViews",
    "SupportsRetain",
    "SupportsStoreCounters",
    "SupportsVerify",
    "SupportsViews",
]


@runtime_checkable
class SupportsViews(Protocol):
    """Zero-copy access: the entry's bytes as host regions, valid while ``lease`` is held."""

    def view(self, lease: Lease, key: Key) -> Sequence[HostRegion] | None: ...


@runtime_checkable
class SupportsPinnedViews(SupportsViews, Protocol):
    """:class:`SupportsViews` in page-locked host memory: a copy engine DMAs straight to and from
    the regions (each says so in ``HostRegion.pinned``; ``views_pinned`` is ``False`` for an
    instance that had to fall back to ordinary memory, e.g. without CUDA)."""

    @property
    def views_pinned(self) -> bool: ...


@runtime_checkable
class SupportsBatchViews(Protocol):
    """:class:`SupportsViews` for many keys in one call: ``views(lease, keys)[i]`` is what
    ``view(lease, keys[i])`` would return.  One lock round and one lease check for the whole
    batch instead of one per page — a 118k-token restore touches 7,000+ pages."""

    def views(self, lease: Lease, keys: Sequence[Key]) -> list[Sequence[HostRegion] | None]: ...


@runtime_checkable
class SupportsIterate(Protocol):
    """Enumerate every sealed entry (order unspecified)."""

    def iter_entries(self) -> Iterator[EntryInfo]: ...


@runtime_checkable
class SupportsVerify(Protocol):
    """Check every checksum; with ``repair`` drop corrupt entries with their subtrees."""

    def verify(self, *, repair: bool = False, progress: Progress | None = None) -> VerifyReport: ...


@runtime_checkable
class SupportsCompact(Protocol):
    """Rewrite the store densely (crash-safe, copy-then-swap)."""

    def compact(self, *, progress: Progress | None = None) -> CompactReport: ...


@runtime_checkable
class SupportsRetain(Protocol):
    """Retained prefixes: entries an operator pins against eviction for room (system prompts,
    tool schemas, shared documents every request starts with).

    ``retain(keys)`` marks present, sealed entries retained, all or nothing: a key that is not
    stored raises ``UnknownKeyError`` and marks nothing.  An entry that is retained, or an
    ancestor of one, is never removed by eviction for room (the LRU policy, ``evict(nbytes=)``,
    a reservation making room); the tree stays prefix-closed.  The retained bytes (the marked
    entries and their ancestors, counted once, in budget bytes) may not exceed
    ``retain_share * budget_bytes`` (URL option ``retain_share``, default 0.5): ``CapacityError``,
    nothing marked.  Returns how many entries were newly marked (already marked ones count 0).

    ``unretain(keys)`` clears the marks of ``keys`` (keys not marked or not stored are ignored)
    and returns how many were cleared.

    An explicit ``evict(keys)`` whose subtrees hold a retained entry raises ``RetainedError`` and
    evicts nothing.  A checksum failure still drops a retained entry (never wrong bytes).
    Persistent providers keep the marks across close, restart and crash.  ``EntryInfo.retained``
    and ``ProviderStats.retained`` / ``retained_bytes`` show them.
    """

    def retain(self, keys: Sequence[bytes]) -> int: ...

    def unretain(self, keys: Sequence[bytes]) -> int: ...


@runtime_checkable
class SupportsBatch(Protocol):
    """Many pages per call, with the per-call costs (locks, lookups, system calls, round trips,
    syncs) paid once per batch instead of once per page.

    ``put_many(items, salt_tag=)``: ``items`` are ``(key, parent, data)``; a parent may be an
    earlier item of the same call (a chain is stored root first).  Returns per item ``True``
    (stored now), ``False`` (already stored: dedup) or the ``HostKVError`` of that item
    (``InFlightError``, ``CapacityError``, ``UnknownKeyError`` when its parent failed ...).
    Raises only for whole-call failures (bad arguments, I/O errors of the commit).

    ``read_many(keys, outs)``: whole entries into ``outs[i]``; per key ``True`` or ``False`` (a
    miss).  On a miss ``outs[i]`` may hold garbage.  An ``outs[i]`` smaller than its entry raises
    ``InvalidArgumentError`` after the others were filled.
    """

    def put_many(self, items: Sequence[tuple[bytes, bytes | None, object]], *,
                 salt_tag: str = "") -> list[bool | HostKVError]: ...

    def read_many(self, keys: Sequence[bytes], outs: Sequence[object]) -> list[bool]: ...


@runtime_checkable
class SupportsDeviceMapped(Protocol):
    """Entries in page-locked host memory mapped into a GPU's address space: a kernel reads a
    leased page in place over PCIe (``pinned://?mapped=yes``, docs/sparse.md).

    ``device_pointers(lease, keys)`` gives the device address of each leased page (0: not
    mapped); ``page_table()`` the device-resident table of every slot's address; ``retire(lease,
    after=fence)`` keeps the leased pages (and their slots) from eviction or reuse until the fence
    (a CUDA stream position, or any object with ``done()``) has passed.
    """

    def device_pointers(self, lease: Lease, keys: Sequence[bytes]) -> Any: ...

    def page_table(self) -> Any: ...

    def retire(self, lease: Lease, *, after: Any) -> None: ...


@runtime_checkable
class SupportsStoreCounters(Protocol):
    """Store-wide live counters, readable from any process that opens the store.

    ``store_counters()`` returns counts summed over *every* process that has used the store
    (cumulative since the store's counters began, surviving restarts), so ``hostkv stats`` run
    beside a live engine shows that engine's traffic; ``stats()`` counts this instance's calls
    only.  Keys are at least ``hits``, ``misses``, ``bytes_read``, ``seals``, ``bytes_written``,
    ``evictions``, ``checksum_failures`` (providers may add ``aborts``, ``dedup``,
    ``evicted_bytes`` ...).  A composite provider adds one set per tier, prefixed ``fast.`` /
    ``slow.``, and its own pipeline figures (``promotions``, ``write_backs``,
    ``write_back_queue``, ``write_back_lag_ms`` ...).  A provider whose medium lives in its
    process (``pinned``) returns that process's counts and says so in its docs.
    """

    def store_counters(self) -> dict[str, int]: ...


# --------------------------------------------------------------------------------------------
# Capability names (derived from the Protocols; two class flags)
# --------------------------------------------------------------------------------------------


def _capability_name(proto: type) -> str:
    """``SupportsBatchViews`` -> ``"batch_views"``."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", proto.__name__.removeprefix("Supports")).lower()


def _protocol_members(proto: type) -> frozenset[str]:
    names: set[str] = set()
    for base in proto.__mro__:
        if base in (Protocol, object) or not getattr(base, "_is_protocol", False):
            continue
        names.update(n for n in vars(base) if not n.startswith("_"))
    return frozenset(names)


#: The optional powers, each a runtime-checkable Protocol (``isinstance(provider, SupportsX)``),
#: in display order; a provider class has one when it implements every member of its Protocol.
CAPABILITY_PROTOCOLS: tuple[type, ...] = (
    SupportsViews, SupportsPinnedViews, SupportsBatchViews, SupportsCompact, SupportsVerify, SupportsIterate,
    SupportsBatch, SupportsDeviceMapped, SupportsRetain, SupportsStoreCounters,
)
#: The two powers that are class flags (``Provider.persistent``, ``Provider.multiprocess``).
CAPABILITY_FLAGS = ("persistent", "multiprocess")
#: Every capability name a provider may report, in display order (flags, then the Protocols').
CAPABILITY_NAMES: tuple[str, ...] = CAPABILITY_FLAGS + tuple(_capability_name(p) for p in CAPABILITY_PROTOCOLS)
_MEMBERS = {_capability_name(p): _protocol_members(p) for p in CAPABILITY_PROTOCOLS}
