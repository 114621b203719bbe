"""State shared by the mmap store's parts: the fork hook, the reservation type, the pending-seal
record, and the base class that declares the store's attributes and paths."""

from __future__ import annotations

import logging
import os
import threading
import weakref
from abc import abstractmethod
from collections.abc import Container, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from hostkv_providers._keys import Key
from hostkv_providers._provider import Provider
from hostkv_providers._region import HostRegion
from hostkv_providers._reservation import Reservation
from hostkv_providers.providers import _fsutil
from hostkv_providers.providers._slotfile import SlotFile

from ._index import _Index

if TYPE_CHECKING:
    from ._provider import MmapProvider


_log = logging.getLogger(__name__)
_fork_generation = 0
_instances: weakref.WeakSet[MmapProvider] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    global _fork_generation
    _fork_generation += 1
    # Methods take the lock before their fork check: a lock copied while another thread of the
    # parent held it would hang the child's first call instead of raising UsedAfterForkError.
    for prov in list(_instances):
        prov._lock = threading.RLock()
        prov._commit_cv = threading.Condition(threading.Lock())


os.register_at_fork(after_in_child=_after_fork_in_child)

_fsutil.register_crash_points({
    "mmap.reserve.after_clear": "a run's slot headers were zeroed, no data yet",
    "mmap.write.partial": "part of a reservation's data is in the mapping",
    "mmap.seal.after_header": "data and slot header written, no journal record",
    "mmap.seal.after_journal": "journal record written (process/none: in the page cache)",
    "mmap.commit.after_data_sync": "group commit: data files synced, journal not yet",
    "mmap.evict.after_drop": "drop records journaled, slot headers not yet cleared",
    "mmap.anchor.after_header": "anchor blob and header written, no journal record",
    "mmap.snapshot.after_snap": "new snapshot renamed into place, journal not yet rotated",
    "mmap.snapshot.after_rotate": "journal rotated after a snapshot",
    "mmap.compact.after_copy": "compaction: new generation's data written, manifest not switched",
    "mmap.compact.after_manifest": "compaction: manifest switched, old generation not deleted",
})

# ------------------------------------------------------------------------------------------------
# Reservation
# ------------------------------------------------------------------------------------------------


class _MmapReservation(Reservation):
    __slots__ = ("digest", "file", "gen", "nslots", "slot")

    def __init__(self, provider: MmapProvider, key: Key, parent: Key | None, nbytes: int, salt_tag: str,
                 file: int, slot: int, nslots: int, gen: int) -> None:
        super().__init__(provider, key, parent, nbytes, salt_tag)
        self.file = file
        self.slot = slot
        self.nslots = nslots
        self.gen = gen
        self.digest: int | None = None  # XXH3 of a single whole-entry write (saves re-reading it)

    def regions(self) -> Sequence[HostRegion]:
        """The reservation's bytes in the file mapping (pageable memory, not pinned)."""
        self.check_open(self._provider)
        self.digest = None  # the caller may overwrite anything through these
        prov: MmapProvider = self._provider  # type: ignore[assignment]
        view = prov._files[self.file].data(self.slot, self.nbytes)
        from hostkv_providers.device._hostmem import buffer_address

        return [HostRegion(0, view, buffer_address(view), False)]


class _Pending:
    """One seal waiting for the group commit; ``done`` once a leader's commit of it is over
    (``error`` then says how it went)."""

    __slots__ = ("done", "error", "record")

    def __init__(self, record: bytes) -> None:
        self.record = record
        self.error: BaseException | None = None
        self.done = False



class _MmapBase(Provider):
    """Attributes and paths of an mmap store (the state is set by :class:`MmapProvider`).

    The store is one object split by role into layers (each a file of this folder, each a base of
    the next): :class:`._alloc._Allocation` → :class:`._journal._Journal` →
    :class:`._snapshot._Snapshots` → :class:`._recovery._Recovery` →
    :class:`._maintenance._Maintenance` → :class:`._anchors._Anchors` →
    :class:`._batch._BatchWrites` → :class:`._provider.MmapProvider` (the verbs).  The
    attributes every layer shares are declared here; ``MmapProvider.__init__`` and ``_open`` set
    them.
    """

    # configuration (MmapProvider.__init__)
    path: str
    _fork_gen: int
    _retain_share: float
    _io: str
    _durability: str
    _verify_reads: bool
    _readonly: bool
    _snapshot_every: int
    _commit_window: float
    _lock: threading.RLock
    _commit_cv: threading.Condition
    _counters: dict[str, int]
    # data files and their free maps (_alloc)
    _files: dict[int, SlotFile]
    _free: dict[int, npt.NDArray[np.bool_]]
    _cursor: dict[int, int]
    _dirty_files: set[int]
    _lockfile: _fsutil.LockFile | None
    # journal and group commit (_journal)
    _jfd: int | None
    _jend: int
    _jalloc: int
    _jrecords: int
    _nbuf: list[bytes]
    _nbuf_t: float
    _queue: list[_Pending]
    _leader: bool
    _failed: str | None
    _unfinished: int
    # snapshots (_snapshot)
    _snap_due: bool
    _snap_mutex: threading.Lock
    _snap_epoch: int
    _rotation: tuple[int, int] | None
    _snap_syncing: set[int]
    # what open found (_recovery)
    _problems: list[str]
    _next_gen: int
    _idx: _Index
    _state_sig: tuple[Any, ...]
    _load_needs_snapshot: bool
    _jvalid_end: int
    _torn_tail: bool
    _last_mode: int
    _stale_at_open: int
    _orphans_at_open: int
    _manifest: dict[str, Any]
    _gen: int
    _slot: int
    _store_id: bytes
    _budget: int
    _file_slots: int
    _recovery: dict[str, Any]

    # Verbs the lower layers call (implemented by MmapProvider).
    @abstractmethod
    def _need_writer(self, what: str) -> None:
        """Raise unless this handle is the writer."""

    @abstractmethod
    def _free_rows_storage(self, rows: Sequence[int], *, journal: bool) -> None:
        """Release the slots of removed rows (journaling drop records when ``journal``)."""

    @abstractmethod
    def _drop_row(self, row: int) -> int:
        """Drop one entry and its subtree; the bytes freed."""

    @abstractmethod
    def _reserve_locked(self, k: Key, p: Key | None, nbytes: int, salt_tag: str,
                        pending_ok: Container[Key] = ()) -> _MmapReservation | None:
        """Budget, index flight and a free run for a reservation (caller holds the lock)."""

    @abstractmethod
    def _abort_locked(self, reservation: _MmapReservation) -> bool:
        """Release an open reservation (caller holds the lock); ``False`` if it was not open."""

    @abstractmethod
    def _seal_undo(self, prepared: tuple[_MmapReservation, SlotFile, int, float, bytes, bytes]) -> None:
        """Undo a prepared seal whose journal record was not written."""

    def _check_usable(self) -> None:
        # The base class compares os.getpid() on every call; a fork counter bumped by an
        # at-fork hook is the same check without a system call per operation.  Methods call it
        # before taking self._lock too (and again under it, for a racing close()): a forked
        # child may have copied the lock while another thread of the parent held it, and would
        # wait on it forever instead of raising UsedAfterForkError.
        if self._closed or _fork_generation != self._fork_gen:
            super()._check_usable()

    # -- paths -----------------------------------------------------------------------------------
    def _p(self, name: str) -> str:
        return os.path.join(self.path, name)

    def _data_name(self, gen: int, file_id: int) -> str:
        return f"data.{gen}.{file_id:04d}.slots"

    def _snap_name(self, gen: int) -> str:
        return f"index.{gen}.snap"

    def _journal_name(self, gen: int) -> str:
        return f"index.{gen}.journal"
