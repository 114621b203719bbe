"""``pinned://?mapped=yes`` — the pinned arena mapped into a device's address space (``device_mapped``).

Every block of the arena is page-locked with ``CU_MEMHOSTREGISTER_DEVICEMAP`` (or allocated
``cuMemHostAlloc(DEVICEMAP)``), so it has a device address and kernels can read (and write) it in
place over PCIe.  Set ``block`` to the page size: then every page is one block — one contiguous
region — its *slot* is its block number, and :meth:`MappedPinnedProvider.page_table`
— slot → device address, fixed for the provider's life — is all a kernel needs, with slot ids
from :meth:`MappedPinnedProvider.slots`.

**Leases and fences.**  A slot is the entry's only while the entry is leased: once released, the
block may be evicted and reused by another page.  A kernel enqueued under a lease may still run
after the host let go, so a mapped lease is ended with :meth:`MappedPinnedProvider.retire`
``(lease, after=stream)``: it records a CUDA event on ``stream`` at that moment, and the lease's
pins (hence its blocks) are held until the event has completed — polled at every ``reserve``,
``lease``, :meth:`poll` and ``stats``, never by blocking the engine.  ``after`` may also be any
object with ``done()`` (a copy-engine handle, an engine's own epoch fence).  A stale slot id can
therefore never be read through the mapping while its block holds another page, as long as the
kernels that use a lease's slots are enqueued before its ``retire``.  ``close`` waits for every
fence before the memory goes.

**Write-through mirror.**  :meth:`MappedPinnedProvider.mirror` reserves new pages, has a
:class:`~hostkv_providers.device.PageMover` write them from the engine's pool straight into the
mapped blocks (codes and scales: every plane of the layout), and seals them once the kernel's
event has completed.

``device=-1`` builds the same bookkeeping over ordinary memory whose "device address" is the host
address, for :class:`~hostkv_providers.device.CpuPageMover` (host engines and tests).  Where
mapping is impossible (no CUDA) the default ``device=0`` raises
:class:`~hostkv_providers.device.DeviceMappingError`.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from hostkv_providers._blockhash import TREE_ALGORITHM
from hostkv_providers._errors import CopyEngineError, HostKVError, InvalidArgumentError, ReservationError
from hostkv_providers._keys import Key
from hostkv_providers._reports import ProviderStats
from hostkv_providers._reservation import Lease, Reservation
from hostkv_providers.device import _cuda
from hostkv_providers.device._engine import _stream_handle
from hostkv_providers.device._hostmem import CudaHostAllocator, HostAllocator, OrdinaryAllocator
from hostkv_providers.device._sparse import CpuPageMover, DeviceMappingError, PageMover, PageTable
from hostkv_providers.providers.pinned._provider import (
    _DEFAULT_BLOCK,
    _DEFAULT_CHUNK,
    PinnedProvider,
)
from hostkv_providers.providers.pinned._run import _PinnedReservation

__all__ = ["MappedPinnedProvider", "MirrorHandle", "StreamFence"]


class StreamFence:
    """A CUDA event recorded on ``stream`` now: ``done()`` once the GPU has passed that point."""

    def __init__(self, stream: Any, device: int = 0) -> None:
        s = _stream_handle(stream, "after")
        if s is None:
            raise InvalidArgumentError("a stream fence needs a stream")
        self._dev = _cuda.device(device)
        self._event = self._dev.event()
        with self._dev.scope():
            _cuda.check(_cuda.driver().cuEventRecord(self._event, s), "cuEventRecord(fence)")
        self._done = False

    def done(self) -> bool:
        if self._done:
            return True
        d = _cuda.driver()
        with self._dev.scope():
            (err,) = d.cuEventQuery(self._event)
        if int(err) == int(d.CUresult.CUDA_ERROR_NOT_READY):
            return False
        _cuda.check((err,), "fence")
        self._finish()
        return True

    def wait(self) -> None:
        if not self._done:
            with self._dev.scope():
                _cuda.check(_cuda.driver().cuEventSynchronize(self._event), "cuEventSynchronize(fence)")
            self._finish()

    def _finish(self) -> None:
        self._done = True
        with self._dev.scope():
            _cuda.driver().cuEventDestroy(self._event)


def _fence(after: Any, device: int) -> Any:
    """A fence object (``done()``, optionally ``wait()``) for ``after``."""
    if after is None:
        return None
    if callable(getattr(after, "done", None)):
        return after
    if device < 0:
        raise InvalidArgumentError("a host-mapped provider takes fences with done(), not streams")
    return StreamFence(after, device)


def _passed(fence: Any) -> bool:
    """Whether a lease's fence has passed.  A fence whose query fails (a faulted CUDA context)
    counts as passed, with a warning: the kernel it guarded can no longer read anything, and
    keeping its pages pinned forever would only shrink the arena."""
    try:
        return bool(fence.done())
    except HostKVError as exc:
        import warnings

        warnings.warn(f"a mapped-page fence failed ({exc}); releasing its lease", stacklevel=3)
        return True


def _fence_wait(fence: Any) -> None:
    if fence is None:
        return
    wait = getattr(fence, "wait", None)
    if callable(wait):
        wait()
        return
    while not fence.done():  # a fence without wait(): poll (close only)
        threading.Event().wait(1e-3)


class MirrorHandle:
    """Pages being mirrored by a kernel; sealed once its fence has passed (:meth:`wait`/poll).

    ``stored[i]`` is ``True`` for a page written now, ``False`` for one already stored (dedup:
    not written again), or the :class:`~hostkv_providers.errors.HostKVError` of that page.
    """

    def __init__(self, provider: MappedPinnedProvider, fence: Any, reservations: list[Reservation],
                 stored: list[bool | HostKVError]) -> None:
        self._provider = provider
        self.fence = fence
        self.reservations = reservations
        self.stored = stored
        #: index into ``stored`` of each reservation
        self.positions = [i for i, v in enumerate(stored) if v is True]
        self.sealed = not reservations

    def done(self) -> bool:
        if not self.sealed:
            self._provider.poll()
        return self.sealed

    def wait(self) -> None:
        """Block until the mirror kernel has finished, then seal its pages."""
        if not self.sealed:
            _fence_wait(self.fence)
            self._provider.poll()


class MappedPinnedProvider(PinnedProvider):
    """:class:`PinnedProvider` over device-mapped, page-locked memory (see the module docstring).

    Parameters
    ----------
    budget_bytes, block, chunk, verify_reads:
        As for :class:`PinnedProvider`; ``block`` should be the page size, so that every page is
        one contiguous block with one slot (a larger entry is stored as usual and has a slot only
        when it got one contiguous run).  The whole arena is pinned and mapped before the constructor returns, so the
        page table is fixed from the start.
    device:
        CUDA ordinal whose address space maps the arena; ``-1``: a host-side arena for
        :class:`~hostkv_providers.device.CpuPageMover` (device address = host address).
    threads, huge_pages:
        Pre-faulting threads and huge-page advice of the pinned allocator.
    """

    def __init__(self, budget_bytes: int, *, block: int = _DEFAULT_BLOCK, chunk: int = _DEFAULT_CHUNK,
                 device: int = 0, threads: int = 4, huge_pages: bool = True, verify_reads: bool = False,
                 retain_share: float = 0.5, checksum: str = TREE_ALGORITHM) -> None:
        if type(device) is not int or device < -1:
            raise InvalidArgumentError(f"device must be a CUDA ordinal or -1 (host), got {device!r}")
        allocator: HostAllocator
        if device >= 0:
            if not _cuda.available():
                raise DeviceMappingError(
                    f"pinned://?mapped=yes needs a CUDA device to map host memory into: "
                    f"{_cuda.unavailable_reason()}",
                    hint="use pinned:// without mapped=yes (or device=-1 with a host copy engine)")
            allocator = CudaHostAllocator(device, mapped=True, threads=threads, huge_pages=huge_pages)
        else:
            allocator = OrdinaryAllocator(huge_pages=huge_pages)
        self._device = device
        self._retiring: list[tuple[Any, Lease]] = []
        self._retiring_ids: set[int] = set()
        self._mirrors: list[MirrorHandle] = []
        self._table: PageTable | None = None
        try:
            super().__init__(budget_bytes, block=block, chunk=chunk, allocator=allocator, background=False,
                             verify_reads=verify_reads, retain_share=retain_share, checksum=checksum)
        except CopyEngineError as exc:
            raise DeviceMappingError(f"mapping the pinned arena failed: {exc}") from exc
        self._mapped = "yes"
        if device >= 0:
            for alloc in self._arena.chunks:
                if getattr(alloc, "device_address", None) is None:
                    raise DeviceMappingError("the pinned allocator returned memory without a device address")

    @property
    def device(self) -> int:
        """The CUDA ordinal the arena is mapped into (``-1``: host-side)."""
        return self._device

    @property
    def num_slots(self) -> int:
        """Slots (blocks) of the arena: slot ids are ``0 .. num_slots - 1``."""
        return self._arena.total

    # -- the mapping ---------------------------------------------------------------------------
    def slot_addresses(self) -> np.ndarray:
        """``uint64[num_slots]``: the device address of every slot (fixed for the provider's life)."""
        self._check_usable()
        arena = self._arena
        parts = []
        for j, alloc in enumerate(arena.chunks):
            n = min(arena.bpc, arena.total - j * arena.bpc)
            base = alloc.address if self._device < 0 else alloc.device_address  # type: ignore[attr-defined]
            parts.append(np.uint64(base) + np.arange(n, dtype=np.uint64) * np.uint64(arena.block))
        return np.concatenate(parts)

    def page_table(self) -> PageTable:
        """The device-resident slot → address table (built once, owned and closed by the provider)."""
        with self._usable():
            if self._table is None:
                self._table = PageTable(self.slot_addresses(), self._device)
            return self._table

    def slots(self, lease: Lease, keys: Sequence[bytes]) -> np.ndarray:
        """``int32[len(keys)]``: the slot of each leased entry (``-1``: not leased, not stored, or
        not one contiguous run — an entry larger than a block that had to be scattered).

        Valid until ``retire(lease, ...)``'s fence has passed; index :meth:`page_table` with them.
        """
        ks = self._keys(keys)
        self._check_lease(lease)
        out = np.full(len(ks), -1, np.int32)
        held = self._held(lease)
        with self._usable():
            idx = self._index
            gen = idx.m_gen
            for i, row in enumerate(idx.rows_of(ks)):
                # only an entry in one contiguous run has one address (always, when it fits a block)
                if row >= 0 and held.get(row, -1) == gen[row] and row not in idx.scatter:
                    out[i] = idx.run_start[row]
        return out

    def device_pointers(self, lease: Lease, keys: Sequence[bytes]) -> np.ndarray:
        """``uint64[len(keys)]``: each leased entry's device address (``0``: not leased or stored)."""
        slots = self.slots(lease, keys)
        addrs = self.page_table().host
        out: np.ndarray = np.where(slots >= 0, addrs[np.maximum(slots, 0)], np.uint64(0)).astype(np.uint64)
        return out

    def device_pointer(self, lease: Lease, key: bytes) -> int | None:
        """The device address of a leased entry's bytes (``None``: not leased or not stored)."""
        p = int(self.device_pointers(lease, [key])[0])
        return p or None

    def _check_lease(self, lease: Lease) -> None:
        if (not isinstance(lease, Lease) or lease.released or lease._provider is not self
                or id(lease) in self._retiring_ids):
            raise InvalidArgumentError("needs an unreleased, unretired lease of this provider")

    # -- fences --------------------------------------------------------------------------------
    def retire(self, lease: Lease, *, after: Any) -> None:
        """End ``lease`` once the GPU has passed ``after`` (a stream: an event recorded now; or an
        object with ``done()``; ``None``: now).  Its entries stay pinned — never evicted, their
        blocks never reused — until then.  Enqueue every kernel that reads the lease's slots
        before calling this."""
        self._check_lease(lease)
        fence = _fence(after, self._device)
        with self._usable():
            if fence is None:
                lease.release()
                return
            self._retiring.append((fence, lease))
            self._retiring_ids.add(id(lease))
            self._poll_locked()

    def poll(self) -> int:
        """Release the leases whose fences have passed and seal finished mirrors; returns how many
        leases are still waiting on their fences."""
        with self._usable():
            self._poll_locked()
            return len(self._retiring)

    def _poll_locked(self) -> None:
        if self._retiring:
            keep: list[tuple[Any, Lease]] = []
            for fence, lease in self._retiring:
                if _passed(fence):
                    self._retiring_ids.discard(id(lease))
                    PinnedProvider._release_lease(self, lease)
                    lease._released = True
                else:
                    keep.append((fence, lease))
            self._retiring = keep
        if self._mirrors:
            waiting: list[MirrorHandle] = []
            for h in self._mirrors:
                try:
                    finished = h.fence.done()
                except HostKVError as exc:  # the kernel failed: nothing of these pages is trusted
                    for res in h.reservations:
                        if res.state == "open":
                            self.abort(res)
                    for pos in h.positions:
                        h.stored[pos] = exc
                    h.sealed = True
                    continue
                if finished:
                    self._seal_mirror(h)
                else:
                    waiting.append(h)
            self._mirrors = waiting

    def _release_lease(self, lease: Lease) -> None:
        with self._lock:
            if id(lease) in self._retiring_ids:
                return  # a retired lease ends with its fence, not with an early release()
        super()._release_lease(lease)

    def lease(self, keys: Sequence[bytes]) -> Lease:
        with self._usable():
            self._poll_locked()
        return super().lease(keys)

    def _reserve_locked(self, k: Key, p: Key | None, nbytes: int, salt_tag: str,
                        chained: bool = False) -> _PinnedReservation | None:
        if self._index.contains(k):  # (a new key polls in _wait_for_memory, below)
            self._poll_locked()
        return super()._reserve_locked(k, p, nbytes, salt_tag, chained)

    def _wait_for_memory(self, cost: int) -> None:
        # Fences that passed free their blocks before anything is evicted: the step every
        # reservation that needs room takes under the lock (a page, a chain run, put_many's run).
        self._poll_locked()
        super()._wait_for_memory(cost)

    # -- the write-through mirror ----------------------------------------------------------------
    def mirror(self, mover: PageMover | CpuPageMover, items: Sequence[tuple[bytes, bytes | None]],
               from_slots: Sequence[int], *, after: Any = None, salt_tag: str = "") -> MirrorHandle:
        """Store new pages by having ``mover`` write pool slot ``from_slots[i]`` into the mapped
        block reserved for ``items[i] = (key, parent)``; each parent must be stored already (an
        earlier mirror that has finished).  One launch for all of them, on ``after`` (the stream
        that wrote the pool: the kernel runs after everything queued there).  Pages are sealed — visible to ``present``
        and ``read`` — once the kernel has finished (:meth:`MirrorHandle.wait` or any poll).

        The mover must be built over :meth:`page_table` with ``per_layer=False`` and
        ``rows * width >= len(items)``; its pool is the engine's.  Host id arrays are uploaded in
        stream order, so this path (unlike ``fetch``) is not for graph capture.
        """
        if len(from_slots) != len(items):
            raise InvalidArgumentError(f"{len(from_slots)} slots for {len(items)} pages")
        if mover.table is not self._table or mover.per_layer or mover.items < len(items):
            raise InvalidArgumentError("the mover must be a whole-page mover over this provider's page_table()"
                                       f" with room for {len(items)} items")
        if mover.layout.page_nbytes > self._block:
            raise InvalidArgumentError(f"the layout's {mover.layout.page_nbytes}-byte pages exceed block {self._block}")
        nbytes = mover.layout.page_nbytes
        # Every slot checked before anything is reserved: the mover skips a slot outside the
        # pool (nothing written), and the seal would then publish whatever the block held
        # before (a page evicted earlier) under the new key.
        srcs = np.full(mover.items, -1, np.int32)
        srcs[: len(items)] = _pool_slots(from_slots, mover.pool.num_blocks)
        stored: list[bool | HostKVError] = []
        reservations: list[Reservation] = []
        ids = np.full(mover.items, -1, np.int32)
        taken = np.zeros(mover.items, np.int32)
        failed: set[bytes] = set()
        try:
            for m, (key, parent) in enumerate(items):
                if parent is not None and parent in failed:
                    failed.add(key)
                    stored.append(ReservationError("its parent could not be stored"))
                    continue
                try:
                    res = self.reserve(key, parent, nbytes, salt_tag=salt_tag)
                except (HostKVError) as exc:
                    if isinstance(exc, InvalidArgumentError):
                        raise
                    failed.add(key)
                    stored.append(exc)
                    continue
                if res is None:
                    stored.append(False)
                    continue
                assert isinstance(res, _PinnedReservation)
                ids[len(reservations)] = res.runs[0][0]
                taken[len(reservations)] = srcs[m]
                reservations.append(res)
                stored.append(True)
            taken[len(reservations):] = -1
            fence = self._launch_mirror(mover, taken, ids, after) if reservations else None
        except BaseException:
            for res in reservations:
                self.abort(res)
            raise
        handle = MirrorHandle(self, fence, reservations, stored)
        if reservations:
            with self._usable():
                self._mirrors.append(handle)
                self._poll_locked()
        return handle

    def _launch_mirror(self, mover: PageMover | CpuPageMover, srcs: np.ndarray, ids: np.ndarray,
                       after: Any) -> Any:
        if isinstance(mover, CpuPageMover):
            if after is not None:
                raise InvalidArgumentError("a host mover has no streams: pass after=None")
            mover.mirror(srcs, ids)
            return _Passed()
        s = _stream_handle(after, "after")
        if s is None:
            raise InvalidArgumentError("a device mirror needs after= the stream that wrote the pool")
        import torch  # the id upload goes through torch's caching allocator (stream-ordered)

        dev = f"cuda:{mover.device}"
        with torch.cuda.stream(torch.cuda.ExternalStream(s, device=dev)):  # type: ignore[no-untyped-call]
            src_t = torch.from_numpy(srcs).pin_memory().to(dev, non_blocking=True)
            ids_t = torch.from_numpy(ids).pin_memory().to(dev, non_blocking=True)
            mover.mirror(src_t, ids_t, stream=s)
            fence = StreamFence(s, mover.device)
            # the tensors stay alive in the fence until the kernel has run
            fence.keep = (src_t, ids_t)  # type: ignore[attr-defined]
        return fence

    def _seal_mirror(self, handle: MirrorHandle) -> None:
        """Seal a finished mirror's pages, root first (caller holds the lock)."""
        for res, pos in zip(handle.reservations, handle.positions, strict=True):
            if res.state != "open":
                continue
            res.mark_written()
            try:
                self.seal(res)  # checksums the bytes the kernel wrote (the RLock is re-entrant)
            except HostKVError as exc:
                handle.stored[pos] = exc
        handle.sealed = True

    # -- the rest --------------------------------------------------------------------------------
    def stats(self) -> ProviderStats:
        with self._usable():
            self._poll_locked()
            retiring = len(self._retiring)
            mirrors = len(self._mirrors)
        st = super().stats()
        st.extra.update({"mapped_device": self._device, "retiring_leases": retiring, "mirrors_in_flight": mirrors})
        return st

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "mapped_device": self._device}  # (also the device option's value)

    def close(self) -> None:
        # Kernels may still read (or mirror into) the arena: wait for every fence before it goes.
        with self._lock:
            if self._closed:
                return
            pending = [f for f, _ in self._retiring] + [h.fence for h in self._mirrors]
        for fence in pending:
            try:
                _fence_wait(fence)
            except HostKVError as exc:
                import warnings

                warnings.warn(f"waiting for a mapped-page fence at close failed: {exc}", stacklevel=2)
        with self._lock:
            for h in self._mirrors:
                for res in h.reservations:
                    if res.state == "open":
                        self.abort(res)
            self._mirrors.clear()
            self._retiring.clear()
            self._retiring_ids.clear()
            if self._table is not None:
                self._table.close()
                self._table = None
        super().close()


class _Passed:
    """The fence of work already done (host movers copy synchronously)."""

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        pass


def _pool_slots(from_slots: Sequence[int], num_blocks: int) -> np.ndarray[Any, np.dtype[np.int32]]:
    """``from_slots`` as int32, each an integer in ``[0, num_blocks)`` (else InvalidArgumentError)."""
    out = np.empty(len(from_slots), np.int32)
    for i, slot in enumerate(from_slots):
        if isinstance(slot, bool) or not isinstance(slot, (int, np.integer)) or not 0 <= int(slot) < num_blocks:
            raise InvalidArgumentError(f"from_slots[{i}] = {slot!r} is not a slot of the pool's {num_blocks} blocks")
        out[i] = int(slot)
    return out
