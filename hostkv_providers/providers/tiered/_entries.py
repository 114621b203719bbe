"""The tiered provider's transient records: snapshots of index rows taken under the lock, the
queued write-back of a page or of a chain run, the reservation and lease types, and the tier read helper."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from hostkv_providers._capabilities import SupportsBatch
from hostkv_providers._errors import UnknownKeyError
from hostkv_providers._keys import Key
from hostkv_providers._provider import Provider
from hostkv_providers._region import HostRegion
from hostkv_providers._reports import EntryInfo
from hostkv_providers._reservation import Lease, Reservation
from hostkv_providers._span import ByteSpan
from hostkv_providers.providers._tree import TreeIndex


def _read_batch(tier: Provider, keys: Sequence[Key], outs: Sequence[memoryview]) -> list[bool]:
    """``read_many`` where the tier batches reads, else one ``read`` per key."""
    if not keys:
        return []
    if isinstance(tier, SupportsBatch):
        return tier.read_many(keys, outs)
    return [tier.read(k, o) for k, o in zip(keys, outs, strict=True)]


def _info(idx: TreeIndex, row: int) -> EntryInfo:
    return EntryInfo(idx.key_of(row), idx.parent_key(row), int(idx.nbytes[row]), idx.tag_of(row),
                     idx.checksum_of(row), float(idx.created[row]), float(idx.used[row]),
                     dict(idx.anchors.get(row, {})), bool(idx.retained[row]))


class _Ent:
    """A transient snapshot of one index row (taken under the lock, for work done without it)."""

    __slots__ = ("gen", "key", "nbytes", "parent", "row", "tag")

    def __init__(self, idx: TreeIndex, row: int) -> None:
        self.row = row
        self.gen = int(idx.gen[row])
        self.key = idx.key_of(row)
        self.parent = idx.parent_key(row)
        self.nbytes = int(idx.nbytes[row])
        self.tag = idx.tag_of(row)


def _left_fast_tier(key: Key) -> UnknownKeyError:
    """A page the fast tier evicted between its seal there and the lease that would pin it for
    its write-back (a save that needed room): it is not published without its only copy."""
    return UnknownKeyError(f"{key.hex()[:16]} left the fast tier before it was published",
                           hint="save the chain again from its first missing page")


class _Pending(_Ent):
    """A page sealed in the fast tier whose write-back is queued (only these have an object:
    at most ``queue`` pages plus those written through; every other entry is columns only)."""

    __slots__ = ("cancelled", "created", "fast_lease", "writing")

    def __init__(self, idx: TreeIndex, row: int, fast_lease: Lease | None) -> None:
        super().__init__(idx, row)
        self.created = float(idx.created[row])  # the seal's time.time(): the write-back lag gauge
        self.fast_lease = fast_lease  # pins the only copy until it is written back
        self.cancelled = False  # evicted before its write-back ran
        self.writing = False  # the writer is copying it out of the fast tier right now


class _PendingRun:
    """A chain run sealed at once whose write-back is queued: one record for the whole run, no
    object per page.  Its only copy is either in the fast tier, under one fast-tier lease
    (``_TieredRun.seal`` with a pinned fast tier), or in ordinary memory (``heap``: a run the
    full fast tier could not take, ``_HeapRun.seal``).  The writer stores it in batches
    (``_WriteBack._write_back_run``), its per-page state in arrays.  Gens are consecutive
    (``TreeIndex.commit_run``): page ``i`` is gen ``gen0 + i``."""

    __slots__ = ("cancelled", "created", "gen0", "heap", "keys", "lease", "n", "parent", "rows", "sums", "tag",
                 "waiting", "writing")

    def __init__(self, idx: TreeIndex, rows: npt.NDArray[np.int64], lease: Lease | None, *,
                 keys: Sequence[Key] | None = None, heap: npt.NDArray[np.uint8] | None = None,
                 sums: npt.NDArray[np.uint64] | None = None) -> None:
        self.rows = rows
        self.n = len(rows)
        self.gen0 = int(idx.gen[rows[0]])
        self.created = float(idx.created[rows[0]])  # the seal's time.time(): the write-back lag gauge
        self.parent = idx.parent_key(int(rows[0]))  # the first page's; page i's is keys[i - 1]
        self.tag = idx.tag_of(int(rows[0]))
        self.lease = lease  # the fast tier's lease over the run, keys in order (let go page by page)
        self.keys: Sequence[Key] = lease.keys if lease is not None else (keys or ())
        # (a heap run: page i is heap[i], its checksum in the fast tier's algorithm sums[i] when
        # the seal was given them and the fast tier verifies reads; let go when the run is over)
        self.heap = heap
        self.sums = sums
        self.waiting = np.ones(self.n, dtype=bool)  # queued or being stored: the only copy is fast
        self.writing = np.zeros(self.n, dtype=bool)  # in the batch being stored right now
        self.cancelled = np.zeros(self.n, dtype=bool)  # dropped while being stored


class _TieredReservation(Reservation):
    __slots__ = ("inner",)

    def __init__(self, provider: Provider, key: Key, parent: Key | None, nbytes: int, salt_tag: str,
                 inner: Reservation) -> None:
        super().__init__(provider, key, parent, nbytes, salt_tag)
        self.inner = inner

    def regions(self) -> Sequence[HostRegion]:
        self.check_open(self._provider)
        return self.inner.regions()

    def mark_written(self, span: ByteSpan | None = None) -> None:
        super().mark_written(span)
        self.inner.mark_written(span)


class _LeaseToken:
    __slots__ = ("fast", "gens", "keys", "rows")

    def __init__(self, rows: npt.NDArray[np.int64], gens: npt.NDArray[np.uint64], keys: frozenset[Key],
                 fast: Lease | None) -> None:
        self.rows = rows
        self.gens = gens
        self.fast = fast
        self.keys = keys  # O(1) membership for view()
