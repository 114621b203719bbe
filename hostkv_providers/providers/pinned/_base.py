"""The pinned provider's shared state and the helpers every part of it calls.

``PinnedProvider`` is one object split by role into layers (each a file of this folder, each a
base of the next): :class:`_PinnedBase` (the attributes ``PinnedProvider.__init__`` sets, the
usable-lock, row holds) → :class:`._leases._Leases` (leases and zero-copy views) →
:class:`._writes._Writes` (reservations, seals, chain runs, eviction) →
:class:`._batch._Batches` (``seal_many``, ``put_many``, ``read_many``) →
:class:`._provider.PinnedProvider` (construction, reads, anchors, verification, stats)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import cast

import numpy as np

from hostkv_providers._keys import Key
from hostkv_providers._provider import Provider
from hostkv_providers.device._hostmem import HostAllocator
from hostkv_providers.providers.pinned._arena import _Arena, _PinnedIndex, _Token

_NO_GEN = np.uint64(2**64 - 1)  # a lease token's gen for a page let go early (_release_part)


class _PinnedBase(Provider):
    """The attributes of a pinned store (set by :class:`PinnedProvider.__init__`) and the
    helpers every layer calls."""

    checksum_algorithm: str
    _sum: Callable[[Iterable[object]], int]
    _retain_share: float
    _budget: int
    _block: int
    _verify_reads: bool
    _allocator: HostAllocator
    _lock: threading.RLock
    _ready: threading.Condition
    _arena: _Arena
    _index: _PinnedIndex
    _lease_tokens: dict[int, _Token]  # live leases, by id of their token
    _copying: int  # reads copying out of the arena without the lock (close() waits for them)
    _limbo: dict[int, tuple[list[tuple[int, int]], int]]  # dropped but still leased, by gen
    _pending: int  # chunks of the arena not allocated yet
    _pinning_error: BaseException | None

    @property
    def ready_bytes(self) -> int:
        """Bytes of the arena allocated (and pinned) so far."""
        return self._arena.total * self._block

    @contextlib.contextmanager
    def _usable(self) -> Iterator[None]:
        """Hold the provider lock after checking the provider is open and not inherited by fork.

        The check runs *before* taking the lock as well: in a forked child the lock may have been
        copied while another thread of the parent held it, and waiting on it would hang forever.
        """
        self._check_usable()
        with self._lock:
            self._check_usable()
            yield

    def _hold_rows(self, rows: Sequence[int]) -> _Token:
        """Hold the present ``rows`` (lock held); the ``(rows, gens)`` token releases them."""
        idx = self._index
        if len(rows) > 8:
            # arrays (a chain's lease): view_pages slices them for a restore with no conversion
            arr = np.asarray(rows, dtype=np.int64)
            arr = arr[arr >= 0]
            idx.hold_rows(cast(Sequence[int], arr))  # (numpy rows: it takes them by slices)
            return arr, idx.gen[arr]
        live = [r for r in rows if r >= 0]
        idx.hold_rows(live)
        gen = idx.m_gen
        return live, [gen[r] for r in live]

    def _copied(self) -> None:
        """A read's copy out of the arena is over (lock held): wake a close waiting for it."""
        self._copying -= 1
        if not self._copying and self._closed:
            self._ready.notify_all()

    def _hold_keys(self, ks: Sequence[Key]) -> _Token:
        return self._hold_rows(self._index.rows_of(ks))
