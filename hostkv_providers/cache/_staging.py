"""Pinned bounce buffers between a provider without device-reachable memory and a copy engine.

The cache layer owns this: it knows providers (it reads and writes them) and the device layer
(it hands the copy engine host pages); the device layer itself knows no provider.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hostkv_providers._errors import (
    CapacityError,
    ClosedError,
    CopyArgumentError,
    CopyEngineError,
    InFlightError,
    InvalidArgumentError,
    UnknownKeyError,
)
from hostkv_providers._provider import Provider
from hostkv_providers._span import ByteSpan
from hostkv_providers.device._copy import CopyEngine, CudaCopyEngine, KVPlanes, TransferHandle, page_regions
from hostkv_providers.device._hostmem import HostAllocator, OrdinaryAllocator, pinned_allocator
from hostkv_providers.device._transfer import _GroupHandle

__all__ = ["StagedTransfer", "StagingPool"]


@dataclass
class StagedTransfer:
    """Outcome of a staged provider transfer: how many pages, and the handle of their copies."""

    pages: int
    handle: TransferHandle

    def wait(self, timeout: float | None = None) -> bool:
        return self.handle.wait(timeout)


class StagingPool:
    """Pinned bounce buffers between a provider without device-reachable memory and the GPU.

    ``buffers`` host buffers of ``pages_per_buffer`` pages each are used round-robin, so while the
    copy engine moves chunk ``k`` between host and device, the provider reads (or writes) chunk
    ``k+1`` in another buffer.  A buffer is reused only after the transfer that last used it is
    done.  Calls are serialised by a lock (the buffers are shared).

    Parameters
    ----------
    engine:
        The copy engine that moves pages to and from the planes.
    page_nbytes:
        Bytes of one page (``layout.page_nbytes``).
    allocator:
        Where the buffers come from; default: page-locked memory for a CUDA engine, ordinary
        memory for a CPU engine.
    """

    def __init__(self, engine: CopyEngine, page_nbytes: int, *, pages_per_buffer: int = 16, buffers: int = 2,
                 allocator: HostAllocator | None = None) -> None:
        if type(page_nbytes) is not int or page_nbytes <= 0:
            raise InvalidArgumentError(f"page_nbytes must be a positive int, got {page_nbytes!r}")
        if type(pages_per_buffer) is not int or pages_per_buffer <= 0:
            raise InvalidArgumentError(f"pages_per_buffer must be a positive int, got {pages_per_buffer!r}")
        if type(buffers) is not int or buffers < 2:
            raise InvalidArgumentError(f"buffers must be an int >= 2 (double buffering), got {buffers!r}")
        if allocator is None:
            allocator = (pinned_allocator(engine.device) if isinstance(engine, CudaCopyEngine) else None) \
                or OrdinaryAllocator()
        self.engine = engine
        self.page_nbytes = page_nbytes
        self.pages_per_buffer = pages_per_buffer
        self._allocs = [allocator.allocate(page_nbytes * pages_per_buffer) for _ in range(buffers)]
        self._pages = [page_regions(a.view, a.address, page_nbytes, pages_per_buffer, pinned=a.pinned)
                       for a in self._allocs]
        self._pending: list[TransferHandle | None] = [None] * buffers
        self._next = 0
        self._lock = threading.Lock()
        self._closed = False

    def _take(self) -> int:
        s = self._next
        self._next = (s + 1) % len(self._allocs)
        h = self._pending[s]
        if h is not None:
            h.wait()
            self._pending[s] = None
        return s

    def _check(self, planes: KVPlanes) -> None:
        if self._closed:
            raise ClosedError("the staging pool is closed")
        if planes.layout.page_nbytes != self.page_nbytes:
            raise CopyArgumentError(
                f"the planes' pages are {planes.layout.page_nbytes} bytes, this pool's {self.page_nbytes}")

    def restore_from_provider(self, provider: Provider, keys: Sequence[bytes], planes: KVPlanes,
                              block_ids: Sequence[int], *, before: Any = None) -> StagedTransfer:
        """Read ``keys`` from ``provider`` and restore them into ``block_ids``, chunk by chunk.

        Stops at the first miss: ``pages`` is how many leading pages were restored (hold a lease
        on the keys so none can be evicted meanwhile).  Returns once every read is done and every
        copy enqueued; wait on the handle (or pass ``before``) before using the blocks.
        """
        if len(keys) != len(block_ids):
            raise CopyArgumentError(f"{len(keys)} keys for {len(block_ids)} block ids")
        with self._lock:
            self._check(planes)
            handles: list[TransferHandle] = []
            span = ByteSpan(0, self.page_nbytes)
            count = 0
            n = len(keys)
            for lo in range(0, n, self.pages_per_buffer):
                hi = min(n, lo + self.pages_per_buffer)
                s = self._take()
                regions = self._pages[s]
                got = 0
                for j in range(lo, hi):
                    if not provider.read(keys[j], regions[j - lo][0].view, span):
                        break
                    got += 1
                if got:
                    h = self.engine.restore(regions[:got], planes, block_ids[lo:lo + got], before=before)
                    self._pending[s] = h
                    handles.append(h)
                    count += got
                if got < hi - lo:
                    break
            return StagedTransfer(count, _GroupHandle(handles))

    def save_to_provider(self, provider: Provider, keys: Sequence[bytes], planes: KVPlanes,
                         block_ids: Sequence[int], *, parent: bytes | None = None, salt_tag: str = "",
                         after: Any = None, in_flight_timeout: float = 30.0) -> int:
        """Save blocks ``block_ids`` as the chain ``keys`` (``keys[0]``'s parent is ``parent``).

        The device→host copy of chunk ``k+1`` runs while chunk ``k`` is written and sealed.
        Already-stored keys are skipped (dedup); a key being written by someone else is waited for
        up to ``in_flight_timeout`` seconds.  Stops early if the chain cannot continue.  Returns the
        number of pages that are stored afterwards, counted from the start of the chain.
        """
        if len(keys) != len(block_ids):
            raise CopyArgumentError(f"{len(keys)} keys for {len(block_ids)} block ids")
        with self._lock:
            self._check(planes)
            n = len(keys)
            chunks = [(lo, min(n, lo + self.pages_per_buffer)) for lo in range(0, n, self.pages_per_buffer)]
            inflight: list[tuple[int, int, int, TransferHandle]] = []

            def issue(k: int) -> None:
                lo, hi = chunks[k]
                s = self._take()
                h = self.engine.save(planes, block_ids[lo:hi], self._pages[s][: hi - lo], after=after)
                self._pending[s] = h
                inflight.append((lo, hi, s, h))

            stored = 0
            prev = parent
            if chunks:
                issue(0)
            for k in range(len(chunks)):
                if k + 1 < len(chunks):
                    issue(k + 1)  # overlaps the provider writes below
                lo, hi, s, h = inflight.pop(0)
                h.wait()
                for j in range(lo, hi):
                    if not self._store_one(provider, keys[j], prev, self._pages[s][j - lo][0].view, salt_tag,
                                           in_flight_timeout):
                        for _lo, _hi, _s, other in inflight:
                            other.wait()
                        return stored
                    stored += 1
                    prev = keys[j]
            return stored

    def _store_one(self, provider: Provider, key: bytes, parent: bytes | None, data: memoryview, salt_tag: str,
                   timeout: float) -> bool:
        try:
            res = provider.reserve(key, parent, self.page_nbytes, salt_tag=salt_tag)
        except InFlightError:
            return provider.wait_sealed(key, timeout)
        except (CapacityError, UnknownKeyError):
            return False  # no room, or the parent went: the chain stops here, its stored count returned
        if res is None:
            return True  # dedup: already stored
        try:
            res.write(0, data)
            res.seal()
        except BaseException:
            if res.state == "open":
                res.abort()
            raise
        return True

    def close(self) -> None:
        """Wait for pending copies and free the buffers."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for h in self._pending:
                if h is not None:
                    try:
                        h.wait()
                    except CopyEngineError as exc:
                        warnings.warn(f"a staged transfer failed during close: {exc}", stacklevel=2)
            for a in self._allocs:
                a.close()

    def __enter__(self) -> StagingPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
