"""The copy engine: pinned host memory and page gathers/scatters between KV planes and host pages.

An engine's KV cache lives in *planes* (one per layer and kind, see :class:`~hostkv_providers.KVLayout`),
each an array of blocks.  A stored page is the slice of one block of every plane, packed in
``layout.planes`` order.  :class:`CopyEngine` moves pages between planes and host memory:

* ``save(planes, block_ids, dst)`` gathers page ``i`` = block ``block_ids[i]`` of every plane into
  the host regions ``dst[i]``;
* ``restore(src, planes, block_ids)`` scatters host pages back into blocks.

Both return a :class:`TransferHandle` at once; the bytes move on the engine's own threads and
(for CUDA) its own non-blocking streams.  Ordering against the inference engine's compute stream
uses CUDA events and stream memory operations only: a save waits on an event recorded on the
``after`` stream at call time (:meth:`CopyEngine.mark`: it sees every kernel queued there before
the call); a restore gates the ``before`` stream at the call (:meth:`CopyEngine.gate`: a wait on a
device-visible flag, set behind the copies), so every kernel queued there after the call sees the
restored bytes, without the caller's thread waiting for the worker.  Nothing here ever
synchronises the device.

:class:`CudaCopyEngine` packs pages on the device with one fused gather/scatter kernel (compiled
at run time by NVRTC) into double-buffered device staging, and moves the packed, page-major
staging with a few large DMA copies (contiguous host regions are coalesced).  That is the
measured way to PCIe line rate; one ``cudaMemcpyAsync`` per slice (``mode="memcpy"``, also the
fallback without NVRTC) reaches about a fifth of it.  :class:`CpuCopyEngine` implements the same
contract for planes in host memory and is what tests run without a GPU.

See ``docs/copy-engine.md`` for how an engine hooks its compute stream in.
"""

from __future__ import annotations

import abc
import bisect
import contextlib
import ctypes
import mmap
import os
import queue
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from hostkv_providers._errors import (
    ClosedError,
    CopyArgumentError,
    CopyEngineError,
    UsedAfterForkError,
)
from hostkv_providers._layout import KVLayout
from hostkv_providers._region import HostPages, HostRegion
from hostkv_providers.device import _cuda
from hostkv_providers.device._hostmem import _REGISTERED_STARTS, CudaPinnedAllocation

__all__ = [
    "CopyArgumentError",
    "CopyEngine",
    "Gate",
    "HostStream",
    "StreamMark",
    "CpuCopyEngine",
    "CudaCopyEngine",
    "KVPlanes",
    "TransferHandle",
    "cuda_available",
    "default_copy_engine",
    "page_regions",
]

_MiB = 1 << 20
_PAGE = mmap.PAGESIZE


def cuda_available() -> bool:
    """Whether a CUDA device is usable in this process (decided once and cached)."""
    return _cuda.available()


class KVPlanes:
    """An inference engine's KV memory: one array of blocks per ``layout.planes`` entry.

    Plane ``p``'s slice for block ``b`` is the ``layout.planes[p].nbytes`` bytes at
    ``ptrs[p] + b * block_strides[p]``.  ``device`` is the CUDA ordinal holding the planes, or
    ``-1`` for host memory.  The object keeps ``keepalive`` (tensors, arrays) referenced so the
    memory outlives every transfer that uses it.

    Use :meth:`from_torch` or :meth:`from_arrays` rather than raw pointers where you can: they
    check shapes and record the bounds of each plane's memory.
    """

    def __init__(
        self,
        layout: KVLayout,
        ptrs: Sequence[int],
        block_strides: Sequence[int],
        num_blocks: int,
        device: int = -1,
        *,
        keepalive: Sequence[object] = (),
        readonly: bool = False,
        extents: Sequence[tuple[int, int]] | None = None,
    ) -> None:
        if not isinstance(layout, KVLayout):
            raise CopyArgumentError(f"layout must be a KVLayout, got {type(layout).__name__}")
        nplanes = len(layout.planes)
        if len(ptrs) != nplanes or len(block_strides) != nplanes:
            raise CopyArgumentError(
                f"the layout has {nplanes} planes but {len(ptrs)} pointers and {len(block_strides)} strides were given")
        if type(num_blocks) is not int or num_blocks <= 0:
            raise CopyArgumentError(f"num_blocks must be a positive int, got {num_blocks!r}")
        if type(device) is not int or device < -1:
            raise CopyArgumentError(f"device must be a CUDA ordinal or -1 (host), got {device!r}")
        for p, (ptr, stride) in enumerate(zip(ptrs, block_strides, strict=True)):
            if type(ptr) is not int or ptr <= 0:
                raise CopyArgumentError(f"plane {p}: pointer must be a positive int, got {ptr!r}")
            if type(stride) is not int or (stride < layout.planes[p].nbytes and num_blocks > 1):
                raise CopyArgumentError(
                    f"plane {p}: block stride {stride!r} is smaller than the plane slice "
                    f"({layout.planes[p].nbytes} bytes): blocks would overlap")
        if extents is not None:
            for p, (base, size) in enumerate(extents):
                end = ptrs[p] + (num_blocks - 1) * block_strides[p] + layout.planes[p].nbytes
                if ptrs[p] < base or end > base + size:
                    raise CopyArgumentError(f"plane {p}: blocks reach past the memory that holds them")
        self.layout = layout
        self.ptrs: tuple[int, ...] = tuple(ptrs)
        self.block_strides: tuple[int, ...] = tuple(block_strides)
        self.num_blocks = num_blocks
        self.device = device
        self.readonly = readonly
        self._keepalive = tuple(keepalive)

    def slice_address(self, plane: int, block: int) -> int:
        """Address of plane ``plane``'s slice of block ``block``."""
        return self.ptrs[plane] + block * self.block_strides[plane]

    @classmethod
    def from_arrays(cls, layout: KVLayout, arrays: Sequence[Any]) -> KVPlanes:
        """Planes in host memory from numpy arrays, one per plane, first dimension = block."""
        import numpy as np

        if len(arrays) != len(layout.planes):
            raise CopyArgumentError(f"the layout has {len(layout.planes)} planes, {len(arrays)} arrays given")
        ptrs, strides, extents, nblocks = [], [], [], None
        readonly = False
        for p, arr in enumerate(arrays):
            if not isinstance(arr, np.ndarray):
                raise CopyArgumentError(f"plane {p}: expected a numpy array, got {type(arr).__name__}")
            nblocks = _plane_geometry(p, layout, arr.shape, nblocks)
            one = arr[0]
            if not one.flags.c_contiguous or one.nbytes != layout.planes[p].nbytes:
                raise CopyArgumentError(
                    f"plane {p}: one block must be {layout.planes[p].nbytes} contiguous bytes, "
                    f"got {one.nbytes} (contiguous={one.flags.c_contiguous})")
            if arr.strides[0] <= 0:
                raise CopyArgumentError(f"plane {p}: the block stride must be positive")
            readonly |= not arr.flags.writeable
            ptrs.append(int(arr.ctypes.data))
            strides.append(int(arr.strides[0]))
            lo = int(arr.ctypes.data)
            extents.append((lo, (arr.shape[0] - 1) * arr.strides[0] + one.nbytes))
        assert nblocks is not None
        return cls(layout, ptrs, strides, nblocks, -1, keepalive=tuple(arrays), readonly=readonly, extents=extents)

    @classmethod
    def from_torch(cls, layout: KVLayout, tensors: Sequence[Any]) -> KVPlanes:
        """Planes from torch tensors (CUDA or CPU), one per plane, first dimension = block.

        A vLLM-style per-layer ``[2, num_blocks, ...]`` cache gives its planes as ``t[0]``
        and ``t[1]``.  Torch is imported only by the caller; nothing here needs it.
        """
        if len(tensors) != len(layout.planes):
            raise CopyArgumentError(f"the layout has {len(layout.planes)} planes, {len(tensors)} tensors given")
        ptrs, strides, nblocks, device = [], [], None, None
        for p, t in enumerate(tensors):
            if not hasattr(t, "data_ptr") or not hasattr(t, "element_size"):
                raise CopyArgumentError(f"plane {p}: expected a torch tensor, got {type(t).__name__}")
            nblocks = _plane_geometry(p, layout, tuple(t.shape), nblocks)
            kind = t.device.type
            if kind == "cuda":
                dev = int(t.device.index if t.device.index is not None else 0)
            elif kind == "cpu":
                dev = -1
            else:
                raise CopyArgumentError(f"plane {p}: tensors on {kind!r} are not supported (cuda or cpu only)")
            if device is None:
                device = dev
            elif dev != device:
                raise CopyArgumentError(f"plane {p}: all planes must be on one device ({device} and {dev} given)")
            one = t[0]
            if not one.is_contiguous() or one.numel() * t.element_size() != layout.planes[p].nbytes:
                raise CopyArgumentError(
                    f"plane {p}: one block must be {layout.planes[p].nbytes} contiguous bytes, "
                    f"got {one.numel() * t.element_size()} (contiguous={one.is_contiguous()})")
            ptrs.append(int(t.data_ptr()))
            strides.append(int(t.stride(0)) * int(t.element_size()))
        assert nblocks is not None and device is not None
        return cls(layout, ptrs, strides, nblocks, device, keepalive=tuple(tensors))

    def __repr__(self) -> str:
        where = "host" if self.device < 0 else f"cuda:{self.device}"
        return f"<KVPlanes {len(self.ptrs)} planes x {self.num_blocks} blocks on {where}>"


def _plane_geometry(p: int, layout: KVLayout, shape: tuple[int, ...], nblocks: int | None) -> int:
    if len(shape) < 1 or shape[0] <= 0:
        raise CopyArgumentError(f"plane {p}: the first dimension (blocks) must be non-empty, shape {shape}")
    if nblocks is not None and shape[0] != nblocks:
        raise CopyArgumentError(f"plane {p}: {shape[0]} blocks, but earlier planes have {nblocks}")
    return int(shape[0])


def page_regions(view: memoryview, address: int, page_nbytes: int, count: int, *, pinned: bool = False,
                 stride: int | None = None) -> list[list[HostRegion]]:
    """Cut a contiguous host buffer into ``count`` pages of one region each (page ``i`` at ``i * stride``)."""
    stride = page_nbytes if stride is None else stride
    if stride < page_nbytes or (count and (count - 1) * stride + page_nbytes > len(view)):
        raise CopyArgumentError(f"a {len(view)}-byte buffer cannot hold {count} pages of {page_nbytes} bytes")
    return [[HostRegion(0, view[i * stride: i * stride + page_nbytes], address + i * stride, pinned)]
            for i in range(count)]


# ============================================================================================
# Handles
# ============================================================================================


class TransferHandle:
    """An asynchronous page transfer.

    ``done()`` polls; ``wait(timeout)`` blocks (``True`` when finished, ``False`` when the
    timeout elapsed) and raises :class:`CopyEngineError` if the transfer failed.  ``nbytes`` is the
    page bytes moved; ``seconds`` the measured transfer time (device time for CUDA), available once
    done.  For CUDA transfers ``event`` is the completion event (a ``CUevent``) and
    ``wait_on(stream)`` makes a stream wait for it without blocking the host; for host transfers
    ``wait_on`` simply waits.
    """

    nbytes: int

    def done(self) -> bool:
        raise NotImplementedError

    def wait(self, timeout: float | None = None) -> bool:
        raise NotImplementedError

    @property
    def seconds(self) -> float | None:
        """Measured seconds of the transfer, ``None`` until it is done (or if it failed)."""
        raise NotImplementedError

    @property
    def event(self) -> Any:
        """The CUDA completion event, or ``None`` for host transfers."""
        return None

    def wait_on(self, stream: Any) -> None:
        """Order ``stream`` after this transfer (host transfers: block until done)."""
        self.wait()

    @property
    def gbps(self) -> float | None:
        """Achieved GB/s (10^9 bytes per second), once done."""
        s = self.seconds
        return None if not s else self.nbytes / s / 1e9


class _JobHandle(TransferHandle):
    """A handle whose work is carried out by an engine worker thread."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._issued = threading.Event()  # the worker finished its part (host: the copy itself)
        self._error: BaseException | None = None
        self._seconds: float | None = None

    def _fail(self, exc: BaseException) -> None:
        self._error = exc
        self._issued.set()

    def _raise(self) -> None:
        if self._error is not None:
            if isinstance(self._error, CopyEngineError):
                raise self._error
            raise CopyEngineError(f"transfer failed: {self._error!r}") from self._error


class _CpuHandle(_JobHandle):
    def done(self) -> bool:
        return self._issued.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        if not self._issued.wait(timeout):
            return False
        self._raise()
        return True

    @property
    def seconds(self) -> float | None:
        return self._seconds if self._issued.is_set() and self._error is None else None


class _GroupHandle(TransferHandle):
    """Several transfers seen as one (used by :class:`StagingPool`)."""

    def __init__(self, handles: Sequence[TransferHandle]) -> None:
        self.handles = list(handles)
        self.nbytes = sum(h.nbytes for h in self.handles)

    def done(self) -> bool:
        return all(h.done() for h in self.handles)

    def wait(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        for h in self.handles:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not h.wait(left):
                return False
        return True

    @property
    def seconds(self) -> float | None:
        secs = [h.seconds for h in self.handles]
        if any(s is None for s in secs):
            return None
        return sum(s for s in secs if s is not None)

    def wait_on(self, stream: Any) -> None:
        for h in self.handles:
            h.wait_on(stream)


# ============================================================================================
# Stream order: marks (a stream's position, captured now) and gates (a stream held back)
# ============================================================================================


class StreamMark:
    """A position in a stream's work, captured on the caller's thread at call time.

    A save handed ``after=mark`` reads the blocks as every kernel queued on that stream before
    the mark left them, however late the save's copies are issued.  Built by
    :meth:`CopyEngine.mark`.
    """

    def wait_in(self, stream: Any) -> None:  # pragma: no cover - abstract
        """Engine side: make the engine's own ``stream`` (or worker) wait for the mark."""
        raise NotImplementedError


class Gate:
    """Holds a stream back: work enqueued on it after :meth:`CopyEngine.gate` returned runs only
    once the gate is opened.  The caller's thread never blocks on it.

    The side that issues the copies calls :meth:`open_after` with their handles (the stream then
    waits for those copies to be complete) or, when there is nothing to wait for,
    :meth:`open_now`.  Every gate must be opened exactly once: a gate that is garbage-collected
    shut is opened with a warning (a stream held forever would hang the engine).
    """

    def __init__(self) -> None:
        self._opened = False
        self._lock = threading.Lock()

    @property
    def opened(self) -> bool:
        return self._opened

    def _claim(self) -> bool:
        with self._lock:
            if self._opened:
                return False
            self._opened = True
            return True

    def open_after(self, handles: Sequence[TransferHandle]) -> None:
        """Open once every transfer in ``handles`` is complete (non-blocking)."""
        if self._claim():
            self._open_after(list(handles))

    def open_now(self) -> None:
        """Open at once (nothing to wait for, or the transfers could not be issued)."""
        if self._claim():
            self._open_now()

    def _open_after(self, handles: list[TransferHandle]) -> None:
        raise NotImplementedError

    def _open_now(self) -> None:
        raise NotImplementedError


class _NoGate(Gate):
    """The gate of ``stream=None``: there is nothing to hold back."""

    def __init__(self) -> None:
        super().__init__()
        self._opened = True

    def _open_after(self, handles: list[TransferHandle]) -> None:
        pass

    def _open_now(self) -> None:
        pass


class HostStream:
    """A FIFO of host jobs run in order on one thread: the CPU copy engine's stand-in for a CUDA
    stream, so the cache's ordering logic (``restore(before=)``, ``save(after=)``) runs and is
    tested without a GPU.  ``enqueue(fn)`` queues a job (a "kernel"); ``synchronize()`` waits
    for everything queued so far.  A job that raises is recorded in ``errors``."""

    def __init__(self, name: str = "hostkv-host-stream") -> None:
        self._worker = _Worker(name)
        self.errors: list[BaseException] = []

    def enqueue(self, fn: Callable[[], object]) -> None:
        def job() -> None:
            try:
                fn()
            except BaseException as exc:  # a failed job must not stop the stream
                self.errors.append(exc)

        self._worker.submit(job)

    def synchronize(self, timeout: float | None = None) -> bool:
        done = threading.Event()
        self._worker.submit(done.set)
        return done.wait(timeout)

    def close(self) -> None:
        self._worker.stop()


class _HostMark(StreamMark):
    def __init__(self, stream: HostStream) -> None:
        self.reached = threading.Event()
        stream.enqueue(self.reached.set)

    def wait_in(self, stream: Any) -> None:
        self.reached.wait()


class _HostGate(Gate):
    def __init__(self, stream: HostStream, worker: _Worker) -> None:
        super().__init__()
        self._event = threading.Event()
        self._worker = worker
        ev = self._event
        stream.enqueue(ev.wait)
        self._finalizer = weakref.finalize(self, _open_leaked, ev.set)

    def _open_after(self, handles: list[TransferHandle]) -> None:
        self._finalizer.detach()
        ev = self._event

        def job() -> None:
            for h in handles:
                with contextlib.suppress(Exception):  # a failed copy still opens the stream
                    h.wait()
            ev.set()

        self._worker.submit(job)  # behind the copies on the same FIFO worker

    def _open_now(self) -> None:
        self._finalizer.detach()
        self._event.set()


def _open_leaked(open_fn: Callable[[], None]) -> None:
    warnings.warn("a stream gate was dropped without being opened; opened now", RuntimeWarning, stacklevel=2)
    open_fn()


# ============================================================================================
# Request validation (shared by both engines)
# ============================================================================================


# One host page of a request: its regions as parallel (offsets, addresses, sizes) tuples.  A plain
# tuple, not a dataclass: a 4,096-page request builds 4,096 of them on the caller's thread.
_Page = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]
# A request's host pages: per-page tuples, or one HostPages (chunk-level, no per-page objects).
_Pages = list[_Page] | HostPages


def _check_ids(planes: KVPlanes, block_ids: Sequence[int]) -> list[int]:
    try:
        ids = [int(b) for b in block_ids]
    except (TypeError, ValueError):
        raise CopyArgumentError("block_ids must be a sequence of ints") from None
    for b, raw in zip(ids, block_ids, strict=True):
        if isinstance(raw, bool) or not 0 <= b < planes.num_blocks:
            raise CopyArgumentError(f"block id {raw!r} is outside [0, {planes.num_blocks})")
    return ids


def _check_pages(layout: KVLayout, pages: Sequence[Any] | HostPages, count: int, *, writable: bool) -> _Pages:
    if isinstance(pages, HostPages):
        if len(pages) != count:
            raise CopyArgumentError(f"{len(pages)} host pages given for {count} block ids")
        if pages.page_nbytes != layout.page_nbytes:
            raise CopyArgumentError(
                f"host pages of {pages.page_nbytes} bytes, the layout's page is {layout.page_nbytes}")
        if writable and pages.readonly:
            raise CopyArgumentError("a save needs writable host pages")
        return pages
    if isinstance(pages, (bytes, bytearray, memoryview, HostRegion)):
        raise CopyArgumentError("host pages must be a sequence with one entry (regions) per block id")
    if len(pages) != count:
        raise CopyArgumentError(f"{len(pages)} host pages given for {count} block ids")
    want = layout.page_nbytes
    out: list[_Page] = []
    append = out.append
    for i, regions in enumerate(pages):
        if type(regions) is not HostRegion and len(regions) == 1:
            regions = regions[0]
        if type(regions) is HostRegion:  # the common case, kept cheap: one region per page
            addr = regions.address
            if (regions.offset != 0 or regions.view.nbytes != want or type(addr) is not int or addr <= 0
                    or (writable and regions.view.readonly)):
                _check_regions(i, (regions,), want, writable)  # raises with the precise reason
            append(((0,), (addr,), (want,)))
            continue
        append(_check_regions(i, regions, want, writable))
    return out


def _check_regions(i: int, regions: Sequence[Any], want: int, writable: bool) -> _Page:
    offsets, addrs, sizes = [], [], []
    pos = 0
    for r in regions:
        if not isinstance(r, HostRegion):
            raise CopyArgumentError(f"page {i}: expected HostRegion objects, got {type(r).__name__}")
        n = r.view.nbytes
        if r.offset != pos:
            raise CopyArgumentError(
                f"page {i}: regions must cover the page in order without gaps or overlaps "
                f"(region at offset {r.offset}, expected {pos})")
        if writable and r.view.readonly:
            raise CopyArgumentError(f"page {i}: a save needs writable host regions")
        if type(r.address) is not int or r.address <= 0:
            raise CopyArgumentError(f"page {i}: bad region address {r.address!r}")
        if n:
            offsets.append(pos)
            addrs.append(r.address)
            sizes.append(n)
        pos += n
    if pos != want:
        raise CopyArgumentError(f"page {i}: regions cover {pos} bytes, the layout's page is {want}")
    return tuple(offsets), tuple(addrs), tuple(sizes)


def _stream_handle(stream: Any, what: str) -> int | None:
    """A raw ``CUstream`` value from a torch stream, a cuda-python stream or an int."""
    if stream is None:
        return None
    if hasattr(stream, "cuda_stream"):
        return int(stream.cuda_stream)
    if isinstance(stream, bool):
        raise CopyArgumentError(f"{what} must be a stream, got {stream!r}")
    try:
        return int(stream)
    except (TypeError, ValueError):
        raise CopyArgumentError(f"{what} must be a torch.cuda.Stream, a CUstream, an int or None, "
                                f"got {type(stream).__name__}") from None


# ============================================================================================
# The engines
# ============================================================================================


class CopyEngine(abc.ABC):
    """Moves pages between KV planes and host memory; see the module docstring.

    Engines are thread-safe.  Transfers of one direction complete in submission order; saves and
    restores run concurrently.  ``close()`` waits for submitted transfers, then frees resources;
    later calls raise :class:`~hostkv_providers.ClosedError`.
    """

    def __init__(self) -> None:
        self._closed = False
        self._lock = threading.Lock()
        self._pid = os.getpid()

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("the copy engine is closed", hint="create a new copy engine")
        if os.getpid() != self._pid:
            # Neither the worker threads nor a CUDA context survive fork(): a job queued here would
            # never run.
            raise UsedAfterForkError("the copy engine was created in another process",
                                     hint="create the copy engine in the child process after fork()")

    @abc.abstractmethod
    def save(self, planes: KVPlanes, block_ids: Sequence[int], dst: Sequence[Any] | HostPages, *,
             after: Any = None) -> TransferHandle:
        """Gather page ``i`` (block ``block_ids[i]`` of every plane) into host regions ``dst[i]``.

        Parameters
        ----------
        planes:
            The engine's KV planes.
        block_ids:
            Blocks to save, any order, repeats allowed.
        dst:
            One entry per block id: a :class:`HostRegion` or a sequence of them covering bytes
            ``[0, layout.page_nbytes)`` of the page in order (writable).
        after:
            The engine's compute stream (``torch.cuda.Stream``, raw ``CUstream`` int or ``None``):
            the save sees every kernel queued there before this call, ordered by an event.
            ``None`` orders against nothing: the caller guarantees the blocks are final.

        Returns
        -------
        TransferHandle
            Done when every byte is in host memory.  The regions must stay alive until then.
        """

    @abc.abstractmethod
    def restore(self, src: Sequence[Any] | HostPages, planes: KVPlanes, block_ids: Sequence[int], *,
                before: Any = None) -> TransferHandle:
        """Scatter host page ``src[i]`` into block ``block_ids[i]`` of every plane.

        ``before``: a compute stream that must not run past this point until the restore is
        complete; it is gated at the call (:meth:`gate`) and opened behind the copies, with no
        host blocking.  ``src`` may be a :class:`~hostkv_providers.device.HostPages`.  Block ids
        must be distinct (two writes to one block race).
        """

    def mark(self, stream: Any) -> StreamMark | None:
        """Capture ``stream``'s current position on the caller's thread (``None`` for ``None``);
        hand it to :meth:`save` as ``after=`` to order a save issued later against the work
        queued on the stream before this call (and nothing queued after it)."""
        if stream is None or isinstance(stream, StreamMark):
            return stream
        raise CopyArgumentError(f"{type(self).__name__} cannot mark a {type(stream).__name__}")

    def gate(self, stream: Any) -> Gate:
        """Hold ``stream`` back from now on until the returned gate is opened (non-blocking).

        This is how a restore issued later, on another thread, still orders every kernel
        enqueued on the engine's stream after the caller's call: the stream waits on the gate,
        and the restore opens it after its copies (:meth:`Gate.open_after`)."""
        if stream is None:
            return _NoGate()
        raise CopyArgumentError(f"{type(self).__name__} cannot gate a {type(stream).__name__}")

    @abc.abstractmethod
    def close(self) -> None:
        """Finish submitted transfers and release streams, staging and threads."""

    def __enter__(self) -> CopyEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_distinct(ids: Sequence[int]) -> None:
    if len(set(ids)) != len(ids):
        raise CopyArgumentError("restore block ids must be distinct (two pages would race for one block)")


class _Worker:
    """One FIFO worker thread: runs submitted jobs in order."""

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            job()

    def submit(self, job: Callable[[], None]) -> None:
        self._queue.put(job)

    def stop(self) -> None:
        self._queue.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join()


class CpuCopyEngine(CopyEngine):
    """The copy engine for planes in host memory (``KVPlanes.device == -1``).

    Same contract as :class:`CudaCopyEngine`; copies run on one worker thread per direction, so
    handles are genuinely asynchronous.  ``after``/``before`` are ``None`` or a
    :class:`HostStream` (a FIFO of host jobs standing in for a CUDA stream, with the same
    ordering rules: a save sees the stream's jobs queued before the call, jobs queued after a
    restore see its bytes).
    """

    def __init__(self) -> None:
        super().__init__()
        self._workers = {"save": _Worker("hostkv-cpu-save"), "restore": _Worker("hostkv-cpu-restore")}

    def _check_planes(self, planes: KVPlanes) -> None:
        if not isinstance(planes, KVPlanes):
            raise CopyArgumentError(f"planes must be KVPlanes, got {type(planes).__name__}")
        if planes.device != -1:
            raise CopyArgumentError(f"CpuCopyEngine needs host planes, these are on cuda:{planes.device}",
                                    hint="use CudaCopyEngine for device planes")

    def mark(self, stream: Any) -> StreamMark | None:
        if stream is None or isinstance(stream, StreamMark):
            return stream
        if not isinstance(stream, HostStream):
            raise CopyArgumentError("CpuCopyEngine has no CUDA streams: it orders against a HostStream (or None), "
                                    f"got {type(stream).__name__}")
        return _HostMark(stream)

    def gate(self, stream: Any) -> Gate:
        if stream is None:
            return _NoGate()
        if not isinstance(stream, HostStream):
            raise CopyArgumentError("CpuCopyEngine has no CUDA streams: it orders against a HostStream (or None), "
                                    f"got {type(stream).__name__}")
        return _HostGate(stream, self._workers["restore"])

    def save(self, planes: KVPlanes, block_ids: Sequence[int], dst: Sequence[Any] | HostPages, *,
             after: Any = None) -> TransferHandle:
        self._check_open()
        self._check_planes(planes)
        mark = self.mark(after)  # a host stream: the copy waits until the stream reached this point
        ids = _check_ids(planes, block_ids)
        pages = _check_pages(planes.layout, dst, len(ids), writable=True)
        return self._submit("save", planes, ids, pages, dst, wait_for=mark)

    def restore(self, src: Sequence[Any] | HostPages, planes: KVPlanes, block_ids: Sequence[int], *,
                before: Any = None) -> TransferHandle:
        self._check_open()
        self._check_planes(planes)
        if planes.readonly:
            raise CopyArgumentError("restore into read-only planes")
        ids = _check_ids(planes, block_ids)
        _check_distinct(ids)
        pages = _check_pages(planes.layout, src, len(ids), writable=False)
        gate = self.gate(before)
        handle = self._submit("restore", planes, ids, pages, src)
        gate.open_after([handle])
        return handle

    def _submit(self, direction: str, planes: KVPlanes, ids: list[int], pages: _Pages,
                keep: object, wait_for: StreamMark | None = None) -> TransferHandle:
        handle = _CpuHandle(len(ids) * planes.layout.page_nbytes)
        gather = direction == "save"

        def job() -> None:
            _ = keep  # the host buffers stay alive until the copy ran
            try:
                if wait_for is not None:
                    wait_for.wait_in(None)
                t0 = time.perf_counter()
                _host_copy(planes, ids, pages, gather)
                handle._seconds = time.perf_counter() - t0
                handle._issued.set()
            except BaseException as exc:
                handle._fail(exc)

        with self._lock:
            self._check_open()
            self._workers[direction].submit(job)
        return handle

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for w in self._workers.values():
            w.stop()


def _host_copy(planes: KVPlanes, ids: list[int], pages: _Pages, gather: bool) -> None:
    """Move plane slices between host planes and host pages with ``memmove`` (GIL released)."""
    memmove = ctypes.memmove
    specs = planes.layout.planes
    for b, page in zip(ids, pages, strict=True):
        if len(page[2]) == 1:
            base = page[1][0]
            for spec in specs:
                src = planes.ptrs[spec.index] + b * planes.block_strides[spec.index]
                if gather:
                    memmove(base + spec.offset, src, spec.nbytes)
                else:
                    memmove(src, base + spec.offset, spec.nbytes)
            continue
        for spec in specs:
            dev = planes.ptrs[spec.index] + b * planes.block_strides[spec.index]
            for off, addr, n in _segments(page, spec.offset, spec.nbytes):
                if gather:
                    memmove(addr, dev + off - spec.offset, n)
                else:
                    memmove(dev + off - spec.offset, addr, n)


def _segments(page: _Page, offset: int, nbytes: int) -> Iterator[tuple[int, int, int]]:
    """``(page_offset, host_address, n)`` pieces of page bytes ``[offset, offset+nbytes)``."""
    offsets, addresses, sizes = page
    k = bisect.bisect_right(offsets, offset) - 1
    end = offset + nbytes
    pos = offset
    while pos < end:
        r_off, r_addr, r_n = offsets[k], addresses[k], sizes[k]
        take = min(end, r_off + r_n) - pos
        yield pos, r_addr + pos - r_off, take
        pos += take
        k += 1


# --------------------------------------------------------------------------------------------
# CUDA
# --------------------------------------------------------------------------------------------

_MAX_CHUNK_PAGES = 512  # block ids travel as a by-value kernel parameter (2 KiB of the 4 KiB limit)

_KERNEL_SOURCE = r"""
typedef unsigned long long u64;
struct Ids { int v[MAX_PAGES]; };

// One work item = one tile of one plane slice of one page.  Items are page-major so that
// neighbouring CTAs touch neighbouring staging bytes.  The plane table holds, per plane,
// {base pointer, block stride, offset in the page, slice bytes}.
template <bool GATHER>
__device__ __forceinline__ void move(const u64* __restrict__ table, int nplanes, int npages,
                                     const Ids& ids, unsigned char* staging, u64 page_nbytes,
                                     u64 tile, u64 tiles) {
    const u64 total = (u64)npages * (u64)nplanes * tiles;
    for (u64 item = blockIdx.x; item < total; item += gridDim.x) {
        const u64 t = item % tiles;
        const u64 rest = item / tiles;
        const int plane = (int)(rest % (u64)nplanes);
        const int page = (int)(rest / (u64)nplanes);
        const u64* e = table + 4 * plane;
        const u64 nb = e[3];
        const u64 lo = t * tile;
        if (lo >= nb) continue;
        const u64 n = (nb - lo < tile) ? nb - lo : tile;
        unsigned char* dev = (unsigned char*)(e[0] + (u64)ids.v[page] * e[1]) + lo;
        unsigned char* stg = staging + (u64)page * page_nbytes + e[2] + lo;
        const unsigned char* src = GATHER ? dev : stg;
        unsigned char* dst = GATHER ? stg : dev;
        if ((((u64)src | (u64)dst | n) & 15) == 0) {
            const uint4* s4 = (const uint4*)src;
            uint4* d4 = (uint4*)dst;
            const u64 n4 = n >> 4;
#if STREAMING
            // Every byte is touched once: evict-first loads/stores keep the engine's working set in L2.
            #pragma unroll 4
            for (u64 i = threadIdx.x; i < n4; i += blockDim.x) __stcs(d4 + i, __ldcs(s4 + i));
#else
            #pragma unroll 4
            for (u64 i = threadIdx.x; i < n4; i += blockDim.x) d4[i] = s4[i];
#endif
        } else {
            for (u64 i = threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
        }
    }
}

extern "C" __global__ void hostkv_gather(const u64* table, int nplanes, int npages, Ids ids,
                                         unsigned char* staging, u64 page_nbytes, u64 tile, u64 tiles) {
    move<true>(table, nplanes, npages, ids, staging, page_nbytes, tile, tiles);
}

extern "C" __global__ void hostkv_scatter(const u64* table, int nplanes, int npages, Ids ids,
                                          unsigned char* staging, u64 page_nbytes, u64 tile, u64 tiles) {
    move<false>(table, nplanes, npages, ids, staging, page_nbytes, tile, tiles);
}
"""


class _Ids(ctypes.Structure):
    _fields_ = [("v", ctypes.c_int32 * _MAX_CHUNK_PAGES)]


class _CudaHandle(_JobHandle):
    """Completion is the CUDA event ``done_event``, recorded by the issuing worker."""

    def __init__(self, nbytes: int, engine: CudaCopyEngine) -> None:
        super().__init__(nbytes)
        self._engine = engine
        self._dev = engine._dev
        self.start_event: Any = None
        self.done_event: Any = None
        self._finished = False
        self.keep: object = None  # host buffers and planes, released once finished
        self._finalizer = weakref.finalize(self, _destroy_events, self._dev, [])

    def _set_events(self, start: Any, done: Any) -> None:
        self.start_event, self.done_event = start, done
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _destroy_events, self._dev, [start, done])
        self._finalizer.atexit = False

    def _query(self) -> bool:
        d = _cuda.driver()
        with self._dev.scope():
            (err,) = d.cuEventQuery(self.done_event)
        if int(err) == int(d.CUresult.CUDA_ERROR_NOT_READY):
            return False
        _cuda.check((err,), "transfer")
        return True

    def _finish(self) -> None:
        if not self._finished:
            self._finished = True
            self.keep = None
            try:
                with self._dev.scope():
                    ms = _cuda.check(_cuda.driver().cuEventElapsedTime(self.start_event, self.done_event),
                                     "elapsed")
                self._seconds = float(ms) / 1e3
            except CopyEngineError:
                self._seconds = None

    def done(self) -> bool:
        if not self._issued.is_set():
            return False
        if self._error is not None:
            return True
        try:
            if not self._query():
                return False
        except CopyEngineError as exc:
            self._error = exc
            return True
        self._finish()
        return True

    def wait(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._issued.wait(timeout):
            return False
        self._raise()
        if timeout is None:
            try:
                with self._dev.scope():
                    _cuda.check(_cuda.driver().cuEventSynchronize(self.done_event), "transfer")
            except CopyEngineError as exc:
                self._error = exc
                raise
        else:
            pause = 5e-5
            while True:
                try:
                    if self._query():
                        break
                except CopyEngineError as exc:
                    self._error = exc
                    raise
                left = deadline - time.monotonic()  # type: ignore[operator]
                if left <= 0:
                    return False
                time.sleep(min(pause, left))
                pause = min(pause * 2, 2e-3)
        self._finish()
        return True

    @property
    def seconds(self) -> float | None:
        return self._seconds if self._finished else None

    @property
    def event(self) -> Any:
        """The completion ``CUevent``; blocks until the worker has recorded it (enqueue only)."""
        self._issued.wait()
        self._raise()
        return self.done_event

    def wait_on(self, stream: Any) -> None:
        s = _stream_handle(stream, "stream")
        if s is None:
            self.wait()
            return
        ev = self.event
        with self._dev.scope():
            _cuda.check(_cuda.driver().cuStreamWaitEvent(s, ev, 0), "cuStreamWaitEvent")


def _coalesce_pages(addresses: Any, page_nbytes: int) -> list[tuple[int, int, int]]:
    """:meth:`CudaCopyEngine._coalesce` for whole pages given by address (numpy, no per-page
    objects): runs of adjacent pages that do not cross into another pinned allocation."""
    import numpy as np

    k = int(addresses.size)
    if not k:
        return []
    brk = np.ones(k, dtype=bool)
    if k > 1:
        brk[1:] = addresses[1:] != addresses[:-1] + np.uint64(page_nbytes)
        if _REGISTERED_STARTS:
            starts = np.array(list(_REGISTERED_STARTS), dtype=np.uint64)  # a copy: it may grow meanwhile
            brk[1:] |= np.isin(addresses[1:], starts)
    first = np.flatnonzero(brk)
    lengths = np.diff(np.append(first, k))
    return [(int(i) * page_nbytes, int(addresses[i]), int(n) * page_nbytes)
            for i, n in zip(first.tolist(), lengths.tolist(), strict=True)]


def _destroy_events(dev: _cuda.Device, events: list[Any]) -> None:
    # Destroying an event whose record is still pending is allowed: the driver frees it later.
    try:
        d = _cuda.driver()
        with dev.scope():
            for ev in events:
                if ev is not None:
                    d.cuEventDestroy(ev)
    except Exception:  # finalizers must not raise
        pass


@dataclass(slots=True)
class _Table:
    dev_ptr: int
    host: Any  # pinned host copy, kept until the engine closes (the upload reads it asynchronously)
    event: Any


class _CudaMark(StreamMark):
    """An event recorded on the caller's stream at call time (destroyed with the mark)."""

    def __init__(self, dev: _cuda.Device, event: Any) -> None:
        self.event = event
        self._finalizer = weakref.finalize(self, _destroy_events, dev, [event])
        self._finalizer.atexit = False

    def wait_in(self, stream: Any) -> None:
        _cuda.check(_cuda.driver().cuStreamWaitEvent(stream, self.event, 0), "cuStreamWaitEvent(mark)")


_FLAG_SLOTS = 1024


class _FlagPool:
    """32-bit flags in mapped, page-locked host memory for :class:`_CudaGate`.

    A gated stream waits (``cuStreamWaitValue32``, GEQ 1) on its slot; the gate is opened by
    ``cuStreamWriteValue32`` on the gate stream behind the copies' completion events (a write
    with the default memory barrier: every copy before it is complete and visible), or by a plain
    host store when there is nothing to wait for.  Host memory, not device memory, so that the
    host can always open a gate (failure paths need no CUDA call) and see which ones are open.
    A slot is reused only once the waiting stream has passed its wait (an event recorded right
    behind the wait on that stream): resetting it earlier would hold that stream forever.
    """

    def __init__(self, dev: _cuda.Device) -> None:
        self._dev = dev
        self._lock = threading.Lock()
        self._blocks: list[tuple[int, Any]] = []  # (host address, ctypes array)
        self._free: list[tuple[Any, int, int]] = []  # (array, slot, device address)
        self._busy: list[tuple[Any, int, int, Any]] = []  # (array, slot, device address, passed event)
        self.stream = dev.stream(low_priority=False)  # opens gates: must not queue behind copies

    def _grow(self) -> None:
        with self._dev.scope():
            host = _cuda.host_alloc(4 * _FLAG_SLOTS, mapped=True)
            dptr = _cuda.host_device_pointer(host)
        arr = (ctypes.c_uint32 * _FLAG_SLOTS).from_address(host)
        self._blocks.append((host, arr))
        self._free.extend((arr, i, dptr + 4 * i) for i in range(_FLAG_SLOTS))

    def _recycle(self) -> None:
        d = _cuda.driver()
        keep = []
        for item in self._busy:
            arr, slot, dptr, passed = item
            if arr[slot] == 0:
                keep.append(item)
                continue
            (err,) = d.cuEventQuery(passed)
            if int(err) == int(d.CUresult.CUDA_SUCCESS):
                d.cuEventDestroy(passed)
                self._free.append((arr, slot, dptr))
            else:
                keep.append(item)
        self._busy = keep

    def gate(self, stream: int) -> _CudaGate:
        d = _cuda.driver()
        with self._lock, self._dev.scope():
            if len(self._busy) >= 64:
                self._recycle()
            if not self._free:
                self._recycle()
                if not self._free:
                    self._grow()
            arr, slot, dptr = self._free.pop()
            arr[slot] = 0
            try:
                _cuda.check(d.cuStreamWaitValue32(stream, dptr, 1,
                                                  int(d.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ)),
                            "cuStreamWaitValue32")
            except CopyEngineError:
                self._free.append((arr, slot, dptr))
                raise
            passed = self._dev.event()
            _cuda.check(d.cuEventRecord(passed, stream), "cuEventRecord(gate)")
            self._busy.append((arr, slot, dptr, passed))
        return _CudaGate(self, arr, slot, dptr)

    def close(self, problems: list[str]) -> None:
        d = _cuda.driver()
        with self._lock:
            for arr, slot, _dptr, _passed in self._busy:
                arr[slot] = 1  # never leave a stream of the engine's held by a closed engine
            (err,) = d.cuStreamSynchronize(self.stream)
            if int(err):
                problems.append(f"gate stream: {_cuda._error_text(err)}")
            for *_rest, passed in self._busy:
                d.cuEventDestroy(passed)
            self._busy.clear()
            d.cuStreamDestroy(self.stream)
            # The flag memory stays mapped: a stream of the engine's may still read a slot.


class _CudaGate(Gate):
    def __init__(self, pool: _FlagPool, arr: Any, slot: int, dptr: int) -> None:
        super().__init__()
        self._pool = pool
        self._arr = arr
        self._slot = slot
        self._dptr = dptr
        self._finalizer = weakref.finalize(self, _open_leaked, self._open_now)
        self._finalizer.atexit = False

    def _open_now(self) -> None:
        self._finalizer.detach()
        self._arr[self._slot] = 1

    def _open_after(self, handles: list[TransferHandle]) -> None:
        self._finalizer.detach()
        d = _cuda.driver()
        pool = self._pool
        flat: list[TransferHandle] = []
        for h in handles:
            flat.extend(h.handles if isinstance(h, _GroupHandle) else [h])
        try:
            events = [h.event for h in flat]
            with pool._dev.scope(), pool._lock:
                for ev in events:
                    if ev is not None:
                        _cuda.check(d.cuStreamWaitEvent(pool.stream, ev, 0), "cuStreamWaitEvent(gate)")
                _cuda.check(d.cuStreamWriteValue32(pool.stream, self._dptr, 1,
                                                   int(d.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT)),
                            "cuStreamWriteValue32")
        except Exception:
            # A failed copy (or a broken context): the engine's stream must not hang.  What was
            # copied is reported by the handles' errors.
            self._arr[self._slot] = 1


class CudaCopyEngine(CopyEngine):
    """The CUDA copy engine for planes in device memory.

    Parameters
    ----------
    device:
        CUDA device ordinal; the planes must live there.
    staging_bytes:
        Size of each of the two device staging buffers per direction (4 in all).  A chunk is
        ``staging_bytes // page_nbytes`` pages (at most 512).  64 MiB keeps every DMA large.
    mode:
        ``"kernel"``: the fused NVRTC gather/scatter kernel plus bulk DMA (the fast path);
        ``"memcpy"``: one ``cuMemcpyAsync`` per plane slice, no staging (fallback, baseline);
        ``"auto"``: ``"kernel"`` when NVRTC works, else ``"memcpy"`` with a warning.
    ctas, threads:
        Launch shape of the pack kernel (grid-stride).  Few CTAs leave the SMs to the engine's
        kernels; default ``ctas`` is a quarter of the multiprocessors.
    tile_bytes:
        Bytes of a plane slice moved by one CTA iteration.
    cache_hints:
        Use evict-first (streaming) loads and stores in the pack kernel, so the copy does not push
        the engine's data out of L2.

    Streams: two non-blocking, lowest-priority streams per direction (pack and DMA), so the pack
    of chunk ``k+1`` overlaps the DMA of chunk ``k``; staging reuse is ordered by events.
    """

    def __init__(self, device: int = 0, *, staging_bytes: int = 64 * _MiB, mode: str = "auto",
                 ctas: int | None = None, threads: int = 256, tile_bytes: int = 16384,
                 cache_hints: bool = True) -> None:
        super().__init__()
        if not _cuda.available():
            raise CopyEngineError(f"CUDA is not usable: {_cuda.unavailable_reason()}", hint="use CpuCopyEngine")
        if mode not in ("auto", "kernel", "memcpy"):
            raise CopyArgumentError(f"mode must be 'auto', 'kernel' or 'memcpy', got {mode!r}")
        if type(staging_bytes) is not int or staging_bytes < _PAGE:
            raise CopyArgumentError(f"staging_bytes must be an int >= {_PAGE}, got {staging_bytes!r}")
        if type(tile_bytes) is not int or tile_bytes <= 0 or tile_bytes % 16:
            raise CopyArgumentError(f"tile_bytes must be a positive multiple of 16, got {tile_bytes!r}")
        if type(threads) is not int or not 32 <= threads <= 1024:
            raise CopyArgumentError(f"threads must be an int in [32, 1024], got {threads!r}")
        self._dev = _cuda.device(device)
        self.device = device
        self._gather_fn: Any = None
        self._scatter_fn: Any = None
        if mode in ("auto", "kernel"):
            try:
                image = _cuda.compile_module(_KERNEL_SOURCE, "hostkv_pack.cu", self._dev.capability,
                                             (f"-DMAX_PAGES={_MAX_CHUNK_PAGES}",
                                              f"-DSTREAMING={int(bool(cache_hints))}"))
                self._gather_fn = _cuda.load_function(self._dev, image, "hostkv_gather")
                self._scatter_fn = _cuda.load_function(self._dev, image, "hostkv_scatter")
                mode = "kernel"
            except CopyEngineError as exc:
                if mode == "kernel":
                    raise
                warnings.warn(f"the pack kernel is unavailable ({exc}); using one memcpy per slice", stacklevel=2)
                mode = "memcpy"
        self.mode = mode
        self.staging_bytes = staging_bytes
        self.ctas = ctas if ctas is not None else max(8, self._dev.sm_count // 4)
        self.threads = threads
        self.tile_bytes = tile_bytes
        dev = self._dev
        self._streams = {name: dev.stream() for name in ("save_pack", "save_dma", "restore_dma", "restore_scatter",
                                                          "aux")}
        self._staging: dict[str, list[int]] = {"save": [], "restore": []}
        self._slot_events: dict[str, list[tuple[Any, Any]]] = {}
        self._slot = {"save": 0, "restore": 0}
        if mode == "kernel":
            aux = self._streams["aux"]
            for direction in ("save", "restore"):
                self._staging[direction] = [dev.mem_alloc_async(staging_bytes, aux) for _ in range(2)]
                self._slot_events[direction] = [(dev.event(), dev.event()) for _ in range(2)]
            with dev.scope():  # our own stream only: the staging exists before any transfer uses it
                _cuda.check(_cuda.driver().cuStreamSynchronize(aux), "cuStreamSynchronize")
        self._tables: dict[tuple[Any, ...], _Table] = {}
        self._table_lock = threading.Lock()
        self._checked: set[tuple[Any, ...]] = set()
        self._workers = {"save": _Worker("hostkv-cuda-save"), "restore": _Worker("hostkv-cuda-restore")}
        self._flags = _FlagPool(dev)

    # -- validation ----------------------------------------------------------------------------
    def _check_planes(self, planes: KVPlanes) -> None:
        if not isinstance(planes, KVPlanes):
            raise CopyArgumentError(f"planes must be KVPlanes, got {type(planes).__name__}")
        if planes.device != self.device:
            where = "host memory" if planes.device < 0 else f"cuda:{planes.device}"
            raise CopyArgumentError(f"this engine copies for cuda:{self.device}, the planes are in {where}",
                                    hint="use CpuCopyEngine for host planes, or an engine per device")
        key = (planes.ptrs, planes.block_strides, planes.num_blocks)
        if key in self._checked:
            return
        for spec in planes.layout.planes:
            ptr = planes.ptrs[spec.index]
            end = ptr + (planes.num_blocks - 1) * planes.block_strides[spec.index] + spec.nbytes
            try:
                start, size, ordinal = self._dev.pointer_range(ptr)
            except CopyEngineError as exc:
                raise CopyArgumentError(f"plane {spec.index}: {ptr:#x} is not device memory ({exc})") from None
            if ordinal != self.device:
                raise CopyArgumentError(f"plane {spec.index}: memory is on cuda:{ordinal}, not cuda:{self.device}")
            if end > start + size:
                raise CopyArgumentError(
                    f"plane {spec.index}: {planes.num_blocks} blocks reach {end - start - size} bytes past "
                    f"the allocation that holds them")
        self._checked.add(key)

    def _table(self, planes: KVPlanes) -> _Table:
        """The device-side plane table for ``planes`` (uploaded once, on the aux stream)."""
        key = (planes.ptrs, planes.block_strides, tuple((s.offset, s.nbytes) for s in planes.layout.planes))
        with self._table_lock:  # both direction workers may ask at once
            table = self._tables.get(key)
            if table is None:
                table = self._tables[key] = self._upload_table(planes)
            return table

    def _upload_table(self, planes: KVPlanes) -> _Table:
        n = len(planes.ptrs)
        nbytes = 32 * n
        host = CudaPinnedAllocation(nbytes, self._dev, threads=1)
        arr = (ctypes.c_uint64 * (4 * n)).from_address(host.address)
        for spec in planes.layout.planes:
            p = spec.index
            arr[4 * p: 4 * p + 4] = [planes.ptrs[p], planes.block_strides[p], spec.offset, spec.nbytes]
        dev_ptr = self._dev.mem_alloc_async(nbytes, self._streams["aux"])
        d = _cuda.driver()
        _cuda.check(d.cuMemcpyHtoDAsync(dev_ptr, host.address, nbytes, self._streams["aux"]), "table upload")
        ev = self._dev.event()
        _cuda.check(d.cuEventRecord(ev, self._streams["aux"]), "cuEventRecord")
        return _Table(dev_ptr, host, ev)

    # -- stream order ----------------------------------------------------------------------------
    def mark(self, stream: Any) -> StreamMark | None:
        if stream is None or isinstance(stream, StreamMark):
            return stream
        s = _stream_handle(stream, "after")
        assert s is not None
        ev = self._dev.event()
        with self._dev.scope():
            _cuda.check(_cuda.driver().cuEventRecord(ev, s), "cuEventRecord(mark)")
        return _CudaMark(self._dev, ev)

    def gate(self, stream: Any) -> Gate:
        if stream is None:
            return _NoGate()
        s = _stream_handle(stream, "before")
        assert s is not None
        self._check_open()
        return self._flags.gate(s)

    # -- the verbs -----------------------------------------------------------------------------
    def save(self, planes: KVPlanes, block_ids: Sequence[int], dst: Sequence[Any] | HostPages, *,
             after: Any = None) -> TransferHandle:
        self._check_open()
        self._check_planes(planes)
        ids = _check_ids(planes, block_ids)
        pages = _check_pages(planes.layout, dst, len(ids), writable=True)
        # Recorded now, on the caller's thread: the save sees exactly the work queued so far.  A
        # mark made earlier (HostKVCache.save marks at its own call) is used as it is.
        mark = self.mark(after)
        handle = _CudaHandle(len(ids) * planes.layout.page_nbytes, self)
        handle.keep = (planes, dst, mark)
        after_ev = mark.event if isinstance(mark, _CudaMark) else None
        self._submit("save", handle, lambda: self._issue_save(handle, planes, ids, pages, after_ev))
        return handle

    def restore(self, src: Sequence[Any] | HostPages, planes: KVPlanes, block_ids: Sequence[int], *,
                before: Any = None) -> TransferHandle:
        self._check_open()
        self._check_planes(planes)
        ids = _check_ids(planes, block_ids)
        _check_distinct(ids)
        pages = _check_pages(planes.layout, src, len(ids), writable=False)
        # The stream is held back from now on (a wait on a device-visible flag); the worker opens
        # it behind the copies.  The caller's thread does not wait for the worker.
        gate = self.gate(before)
        handle = _CudaHandle(len(ids) * planes.layout.page_nbytes, self)
        handle.keep = (planes, src)
        self._submit("restore", handle, lambda: self._issue_restore(handle, planes, ids, pages), gate)
        return handle

    def _submit(self, direction: str, handle: _CudaHandle, issue: Callable[[], None],
                gate: Gate | None = None) -> None:
        def job() -> None:
            try:
                self._dev.activate()
                issue()
                handle._issued.set()
            except BaseException as exc:
                handle._fail(exc)
            if gate is not None:
                if handle._error is None:
                    gate.open_after([handle])
                else:
                    gate.open_now()

        with self._lock:
            self._check_open()
            self._workers[direction].submit(job)

    # -- issuing (worker threads) --------------------------------------------------------------
    def _chunks(self, n: int, page_nbytes: int) -> Iterator[tuple[int, int]]:
        per = max(1, min(_MAX_CHUNK_PAGES, self.staging_bytes // page_nbytes))
        for lo in range(0, n, per):
            yield lo, min(n, lo + per)

    def _launch(self, fn: Any, table: _Table, planes: KVPlanes, ids: Sequence[int], staging: int,
                stream: Any) -> None:
        layout = planes.layout
        nplanes = len(layout.planes)
        tiles = max(1, -(-max(s.nbytes for s in layout.planes) // self.tile_bytes))
        idv = _Ids()
        idv.v[: len(ids)] = list(ids)
        args = [ctypes.c_uint64(table.dev_ptr), ctypes.c_int32(nplanes), ctypes.c_int32(len(ids)), idv,
                ctypes.c_uint64(staging), ctypes.c_uint64(layout.page_nbytes), ctypes.c_uint64(self.tile_bytes),
                ctypes.c_uint64(tiles)]
        params = (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])
        grid = max(1, min(self.ctas, len(ids) * nplanes * tiles))
        _cuda.check(_cuda.driver().cuLaunchKernel(fn, grid, 1, 1, self.threads, 1, 1, 0, stream,
                                                  ctypes.addressof(params), 0), "pack kernel launch")

    @staticmethod
    def _coalesce(pages: _Pages, lo: int, hi: int, page_nbytes: int) -> list[tuple[int, int, int]]:
        """``(staging_offset, host_address, nbytes)`` copies for pages ``[lo, hi)``, merged when both
        sides are contiguous (page-major staging + adjacent host pages = one large DMA) and the
        host side does not cross into another pinned allocation."""
        if isinstance(pages, HostPages):
            return _coalesce_pages(pages.addresses[lo:hi], page_nbytes)
        out: list[tuple[int, int, int]] = []
        s = a = m = -1  # the copy being extended
        base = 0
        for i in range(lo, hi):
            offsets, addresses, sizes = pages[i]
            for off, addr, n in zip(offsets, addresses, sizes, strict=True):
                if s + m == base + off and a + m == addr and addr not in _REGISTERED_STARTS:
                    m += n
                    continue
                if m > 0:
                    out.append((s, a, m))
                s, a, m = base + off, addr, n
            base += page_nbytes
        if m > 0:
            out.append((s, a, m))
        return out

    def _issue_save(self, handle: _CudaHandle, planes: KVPlanes, ids: list[int], pages: _Pages,
                    after_ev: Any) -> None:
        d = _cuda.driver()
        dev = self._dev
        pack, dma = self._streams["save_pack"], self._streams["save_dma"]
        start, done = dev.event(timing=True), dev.event(timing=True)
        handle._set_events(start, done)
        first = dma if self.mode == "memcpy" else pack
        if after_ev is not None:  # the mark owns the event (destroyed with it)
            _cuda.check(d.cuStreamWaitEvent(first, after_ev, 0), "cuStreamWaitEvent(after)")
        _cuda.check(d.cuEventRecord(start, first), "cuEventRecord")
        layout = planes.layout
        if self.mode == "memcpy":
            for b, page in zip(ids, pages, strict=True):
                for spec in layout.planes:
                    src = planes.ptrs[spec.index] + b * planes.block_strides[spec.index]
                    for off, addr, n in _segments(page, spec.offset, spec.nbytes):
                        _cuda.check(d.cuMemcpyDtoHAsync(addr, src + off - spec.offset, n, dma), "cuMemcpyDtoHAsync")
        else:
            table = self._table(planes)
            _cuda.check(d.cuStreamWaitEvent(pack, table.event, 0), "cuStreamWaitEvent(table)")
            for lo, hi in self._chunks(len(ids), layout.page_nbytes):
                s = self._slot["save"]
                self._slot["save"] = s ^ 1
                staging = self._staging["save"][s]
                packed, freed = self._slot_events["save"][s]
                _cuda.check(d.cuStreamWaitEvent(pack, freed, 0), "cuStreamWaitEvent")  # DMA out of slot done
                self._launch(self._gather_fn, table, planes, ids[lo:hi], staging, pack)
                _cuda.check(d.cuEventRecord(packed, pack), "cuEventRecord")
                _cuda.check(d.cuStreamWaitEvent(dma, packed, 0), "cuStreamWaitEvent")
                for off, addr, n in self._coalesce(pages, lo, hi, layout.page_nbytes):
                    _cuda.check(d.cuMemcpyDtoHAsync(addr, staging + off, n, dma), "cuMemcpyDtoHAsync")
                _cuda.check(d.cuEventRecord(freed, dma), "cuEventRecord")
        _cuda.check(d.cuEventRecord(done, dma), "cuEventRecord")

    def _issue_restore(self, handle: _CudaHandle, planes: KVPlanes, ids: list[int], pages: _Pages) -> None:
        d = _cuda.driver()
        dev = self._dev
        dma, scatter = self._streams["restore_dma"], self._streams["restore_scatter"]
        start, done = dev.event(timing=True), dev.event(timing=True)
        handle._set_events(start, done)
        _cuda.check(d.cuEventRecord(start, dma), "cuEventRecord")
        layout = planes.layout
        if self.mode == "memcpy":
            for b, page in zip(ids, pages, strict=True):
                for spec in layout.planes:
                    dst = planes.ptrs[spec.index] + b * planes.block_strides[spec.index]
                    for off, addr, n in _segments(page, spec.offset, spec.nbytes):
                        _cuda.check(d.cuMemcpyHtoDAsync(dst + off - spec.offset, addr, n, dma), "cuMemcpyHtoDAsync")
            _cuda.check(d.cuEventRecord(done, dma), "cuEventRecord")
            return
        table = self._table(planes)
        _cuda.check(d.cuStreamWaitEvent(scatter, table.event, 0), "cuStreamWaitEvent(table)")
        for lo, hi in self._chunks(len(ids), layout.page_nbytes):
            s = self._slot["restore"]
            self._slot["restore"] = s ^ 1
            staging = self._staging["restore"][s]
            loaded, freed = self._slot_events["restore"][s]
            _cuda.check(d.cuStreamWaitEvent(dma, freed, 0), "cuStreamWaitEvent")  # scatter out of slot done
            for off, addr, n in self._coalesce(pages, lo, hi, layout.page_nbytes):
                _cuda.check(d.cuMemcpyHtoDAsync(staging + off, addr, n, dma), "cuMemcpyHtoDAsync")
            _cuda.check(d.cuEventRecord(loaded, dma), "cuEventRecord")
            _cuda.check(d.cuStreamWaitEvent(scatter, loaded, 0), "cuStreamWaitEvent")
            self._launch(self._scatter_fn, table, planes, ids[lo:hi], staging, scatter)
            _cuda.check(d.cuEventRecord(freed, scatter), "cuEventRecord")
        _cuda.check(d.cuEventRecord(done, scatter), "cuEventRecord")

    # -- lifecycle -----------------------------------------------------------------------------
    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for w in self._workers.values():
            w.stop()
        with self._dev.scope():
            self._release()

    def _release(self) -> None:
        d = _cuda.driver()
        problems: list[str] = []

        def attempt(result: Any, what: str) -> None:
            try:
                _cuda.check(result, what)
            except CopyEngineError as exc:
                problems.append(str(exc))

        # Only our own streams are synchronised, never the device or the engine's streams; memory
        # goes back stream-ordered (cuMemFree could synchronise the whole device).
        for s in self._streams.values():
            attempt(d.cuStreamSynchronize(s), "cuStreamSynchronize")
        aux = self._streams["aux"]
        for bufs in self._staging.values():
            for ptr in bufs:
                attempt(d.cuMemFreeAsync(ptr, aux), "cuMemFreeAsync")
        for t in self._tables.values():
            attempt(d.cuMemFreeAsync(t.dev_ptr, aux), "cuMemFreeAsync")
        attempt(d.cuStreamSynchronize(aux), "cuStreamSynchronize")
        for t in self._tables.values():
            t.host.close()
            d.cuEventDestroy(t.event)
        for pair in self._slot_events.values():
            for a, b in pair:
                d.cuEventDestroy(a)
                d.cuEventDestroy(b)
        for s in self._streams.values():
            attempt(d.cuStreamDestroy(s), "cuStreamDestroy")
        self._flags.close(problems)
        self._tables.clear()
        if problems:
            warnings.warn("closing the CUDA copy engine: " + "; ".join(problems), stacklevel=2)


def default_copy_engine(device: int | None = None) -> CopyEngine:
    """A :class:`CudaCopyEngine` on ``device`` (default 0) when CUDA is usable, else a :class:`CpuCopyEngine`."""
    if _cuda.available():
        return CudaCopyEngine(0 if device is None else device)
    return CpuCopyEngine()


# ============================================================================================
# Staging for file-backed providers
# ============================================================================================

