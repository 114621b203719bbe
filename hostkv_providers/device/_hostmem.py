"""Host memory allocation seam.

The pinned provider asks a :class:`HostAllocator` for its arena, chunk by chunk.  The ordinary
implementation here maps anonymous memory (page-aligned, so it can be registered with the GPU
driver later); :class:`CudaHostAllocator` pre-faults and page-locks it (CUDA is imported only when
that allocator is used, so the pinned provider works where CUDA is absent).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import threading
import time
import warnings
import weakref
from typing import Any, ClassVar, Protocol, runtime_checkable

import numpy as np

from hostkv_providers._errors import CopyEngineError, InvalidArgumentError
from hostkv_providers.device import _cuda

__all__ = [
    "CudaHostAllocator",
    "CudaPinnedAllocation",
    "HostAllocation",
    "HostAllocator",
    "OrdinaryAllocation",
    "OrdinaryAllocator",
    "advise_huge_pages",
    "buffer_address",
    "copy_bytes",
    "pinned_allocator",
]

#: Copies at least this large go through numpy, which releases the GIL while it copies.
_NOGIL_COPY_BYTES = 64 << 10


def copy_bytes(dst: memoryview, src: memoryview) -> None:
    """``dst[:] = src`` for byte views of equal length, without holding the GIL for big copies.

    A memoryview slice assignment is a memcpy *under the GIL*: saving a 1 MiB page that way
    stalls every other Python thread — an engine's decode loop launching kernels — for the whole
    copy.  ``numpy.copyto`` releases the GIL for it (measured: a spinning thread runs throughout
    a 256 MiB ``copyto`` and not at all during the memoryview copy) at about 1-3 µs of extra
    cost per call, so small copies keep the plain path.
    """
    if dst.nbytes < _NOGIL_COPY_BYTES:
        dst[:] = src
        return
    np.copyto(np.frombuffer(dst, np.uint8), np.frombuffer(src, np.uint8))


def advise_huge_pages(mm: mmap.mmap) -> bool:
    """Ask the kernel to back an anonymous mapping with transparent huge pages.

    Most distributions ship THP in ``madvise`` mode, so without this advice an arena is built
    of 4 KiB pages.  On the H200 host (a VM) huge pages halve the cost of first touch (0.35 →
    0.17 s/GiB, flat from 4 to 16 faulting threads) and of ``cuMemHostRegister`` (0.04 → 0.02
    s/GiB), and spare the CPU side a TLB miss every 4 KiB.  Returns whether the advice was
    taken; a kernel without THP (or a platform without ``MADV_HUGEPAGE``) just keeps 4 KiB pages.
    """
    flag = getattr(mmap, "MADV_HUGEPAGE", None)
    if flag is None:
        return False
    try:
        mm.madvise(flag)
    except OSError:
        return False
    return True


def buffer_address(view: memoryview) -> int:
    """Virtual address of a writable buffer's first byte."""
    if view.readonly:
        # ctypes can only take the address of writable buffers; read-only callers pass a view
        # of the same writable memory.
        raise InvalidArgumentError("buffer_address needs a writable buffer")
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


@runtime_checkable
class HostAllocation(Protocol):
    """A block of host memory owned by the caller until :meth:`close`."""

    @property
    def view(self) -> memoryview:
        """Writable bytes of the allocation."""

    @property
    def address(self) -> int:
        """Virtual address of ``view[0]``."""

    @property
    def pinned(self) -> bool:
        """Whether the memory is page-locked and registered with the GPU driver."""

    def close(self) -> None:
        """Free (and unregister) the memory.  Views into it must no longer be used."""


@runtime_checkable
class HostAllocator(Protocol):
    """Makes :class:`HostAllocation` objects."""

    @property
    def pinned(self) -> bool:
        """Whether allocations are page-locked."""

    def allocate(self, nbytes: int) -> HostAllocation:
        """Allocate ``nbytes`` (the implementation may round up to its page size)."""


class _Allocation:
    """What every allocation of this module shares: its view (until ``close``), its address, and
    whether it is page-locked (a class constant)."""

    _pinned: ClassVar[bool]
    _view: memoryview | None
    _address: int

    @property
    def view(self) -> memoryview:
        if self._view is None:
            raise InvalidArgumentError("allocation is closed")
        return self._view

    @property
    def address(self) -> int:
        return self._address

    @property
    def pinned(self) -> bool:
        return self._pinned


class OrdinaryAllocation(_Allocation):
    """Anonymous, page-aligned, pageable memory (``mmap``)."""

    _pinned = False

    def __init__(self, nbytes: int, *, huge_pages: bool = True) -> None:
        if nbytes <= 0:
            raise InvalidArgumentError(f"allocation size must be > 0, got {nbytes}")
        self._map: mmap.mmap | None = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if huge_pages:
            advise_huge_pages(self._map)
        self._view: memoryview | None = memoryview(self._map)
        self._address = buffer_address(self._view)
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            if self._map is None:
                return
            assert self._view is not None
            self._view.release()
            self._view = None
            # a caller may still hold an exported view; the map is then freed when it goes away
            with contextlib.suppress(BufferError):
                self._map.close()
            self._map = None


class OrdinaryAllocator:
    """Allocator of ordinary (pageable) memory; used without CUDA and in tests.

    ``huge_pages`` (default on) advises transparent huge pages for each allocation
    (:func:`advise_huge_pages`).
    """

    pinned = False

    def __init__(self, *, huge_pages: bool = True) -> None:
        self.huge_pages = huge_pages

    def allocate(self, nbytes: int) -> HostAllocation:
        return OrdinaryAllocation(nbytes, huge_pages=self.huge_pages)


_PAGE = mmap.PAGESIZE


# ============================================================================================
# Pinned host memory
# ============================================================================================

_MADV_POPULATE_WRITE = 23  # Linux >= 5.14
_libc: Any = None


def _madvise_fn() -> Any:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _libc.madvise.restype = ctypes.c_int
    return _libc.madvise


def _prefault(address: int, nbytes: int, threads: int) -> None:
    """Fault in ``nbytes`` of fresh anonymous memory using up to ``threads`` threads.

    First touch is what makes pinning slow (0.69 s/GiB on one thread on the H200 host, 0.22 on
    four), so it is done in parallel *before* ``cuMemHostRegister``, which then only locks
    already-present pages (0.04 s/GiB).  ctypes calls release the GIL, so the threads really run
    in parallel; ``MADV_POPULATE_WRITE`` faults without touching bytes, ``memset`` is the
    fallback on older kernels.
    """
    madvise = _madvise_fn()
    piece = max(_PAGE, -(-nbytes // max(1, threads)) // _PAGE * _PAGE)
    spans = [(address + lo, min(piece, nbytes - lo)) for lo in range(0, nbytes, piece)]

    def fault(span: tuple[int, int]) -> None:
        addr, size = span
        if madvise(addr, size, _MADV_POPULATE_WRITE) != 0:
            err = ctypes.get_errno()
            if err not in (errno.EINVAL, errno.ENOSYS, errno.EPERM):
                raise OSError(err, f"madvise(MADV_POPULATE_WRITE) failed: {errno.errorcode.get(err, err)}")
            ctypes.memset(addr, 0, size)  # fresh anonymous memory is zero already; this only faults

    if len(spans) == 1:
        fault(spans[0])
        return
    errors: list[BaseException] = []

    def run(span: tuple[int, int]) -> None:
        try:
            fault(span)
        except BaseException as exc:
            errors.append(exc)

    workers = [threading.Thread(target=run, args=(s,), name="hostkv-prefault") for s in spans]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if errors:
        raise errors[0]


class CudaPinnedAllocation(_Allocation):
    """Page-locked host memory: pre-faulted anonymous memory registered with the driver.

    Falls back to ``cuMemHostAlloc`` where registration is refused.  ``device_address`` is the
    device-side address of the memory when it was allocated ``mapped`` (else ``None``).
    """

    _pinned = True

    def __init__(self, nbytes: int, dev: _cuda.Device, *, mapped: bool = False, threads: int = 4,
                 huge_pages: bool = True) -> None:
        if type(nbytes) is not int or nbytes <= 0:
            raise InvalidArgumentError(f"allocation size must be a positive int, got {nbytes!r}")
        self._dev = dev
        size = -(-nbytes // _PAGE) * _PAGE
        self._lock = threading.Lock()
        self._map: mmap.mmap | None = None
        self._host_alloc = False
        self.method = "register"
        mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        #: whether the mapping was advised to use transparent huge pages (before any fault)
        self.huge_pages = huge_pages and advise_huge_pages(mm)
        view = memoryview(mm)
        address = buffer_address(view)
        #: seconds spent pre-faulting and registering (or in cuMemHostAlloc), for benchmarks
        self.timings: dict[str, float] = {}
        try:
            t0 = time.perf_counter()
            if threads > 0:
                _prefault(address, size, threads)
            t1 = time.perf_counter()
            with dev.scope():
                _cuda.host_register(address, size, mapped=mapped)
            self.timings = {"prefault": t1 - t0, "register": time.perf_counter() - t1}
            self._map = mm
        except (CopyEngineError, OSError) as exc:
            view.release()
            mm.close()
            warnings.warn(f"cuMemHostRegister failed ({exc}); falling back to cuMemHostAlloc", stacklevel=3)
            t0 = time.perf_counter()
            with dev.scope():
                address = _cuda.host_alloc(size, mapped=mapped)
            self.timings = {"hostalloc": time.perf_counter() - t0}
            view = memoryview(_cuda.c_array(ctypes.c_char, size).from_address(address)).cast("B")
            self._host_alloc = True
            self.method = "hostalloc"
        self._view: memoryview | None = view[:nbytes]
        self._address = address
        self._size = size
        _add_start(address)
        self.device_address: int | None = None
        if mapped:
            with dev.scope():
                self.device_address = _cuda.host_device_pointer(address)
        # Dropped without close(): unregister *before* the mapping goes, or a later mmap that
        # reuses the addresses fails with CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED.
        self._finalizer = weakref.finalize(self, _release_pinned, dev, address, self._host_alloc, self._map,
                                           [view, self._view])
        self._finalizer.atexit = False  # no CUDA calls during interpreter shutdown; exit frees it all

    def close(self) -> None:
        with self._lock:
            self._view = None
            self._finalizer()  # runs once


#: Start addresses of the page-locked allocations this module made.  Two allocations can sit
#: back to back in the address space (the pinned arena's chunks often do), but one DMA may not
#: span two registrations (``CUDA_ERROR_INVALID_VALUE``), so host copies never merge across one.
#: Changed only through :func:`_add_start` / :func:`_drop_start` (they version it).
_REGISTERED_STARTS: set[int] = set()
_starts_version = 0  # bumped after every change of the set
_starts_sorted: tuple[int, Any] = (-1, None)  # (version, sorted uint64 array) last built


def _add_start(address: int) -> None:
    global _starts_version
    _REGISTERED_STARTS.add(address)
    _starts_version += 1


def _drop_start(address: int) -> None:
    global _starts_version
    _REGISTERED_STARTS.discard(address)
    _starts_version += 1


def registration_starts(addresses: Any) -> Any:
    """A ``bool`` array: which of ``addresses`` (``uint64``) begin a page-locked allocation of
    this module (a host copy must not run across one).  The sorted starts are built once per
    change of the set, not per call: the copy engine asks for every chunk it stages (a copy of
    the set and ``np.isin`` cost ~0.1 ms a chunk on the H200 host, before layer 0's first DMA)."""
    import numpy as np

    global _starts_sorted
    version, starts = _starts_sorted
    if version != _starts_version:
        version = _starts_version  # read before the set: a change after it rebuilds next time
        starts = np.sort(np.array(list(_REGISTERED_STARTS), dtype=np.uint64))  # a copy: it may grow meanwhile
        _starts_sorted = (version, starts)
    if not len(starts):
        return np.zeros(len(addresses), dtype=bool)
    at = np.minimum(np.searchsorted(starts, addresses), len(starts) - 1)
    return starts[at] == addresses


def _release_pinned(dev: _cuda.Device, address: int, host_alloc: bool, mm: mmap.mmap | None,
                    views: list[memoryview]) -> None:
    _drop_start(address)
    for v in views:
        with contextlib.suppress(BufferError):
            v.release()
    try:
        with dev.scope():  # may run on any thread (a finalizer, a provider's filler)
            if host_alloc:
                _cuda.host_free(address)
            else:
                _cuda.host_unregister(address)
    except Exception as exc:  # cleanup warns, it does not raise
        warnings.warn(f"freeing pinned memory failed: {exc}", stacklevel=2)
    if mm is not None:
        # a caller may still hold a view; the mapping then goes when it does
        with contextlib.suppress(BufferError):
            mm.close()


class CudaHostAllocator:
    """A :class:`~hostkv_providers.HostAllocator` of page-locked memory for one CUDA device.

    Parameters
    ----------
    device:
        CUDA device ordinal whose primary context registers the memory (registration is
        portable: every context may DMA to it).
    mapped:
        Also map the memory into the device address space (``CudaPinnedAllocation.device_address``).
    threads:
        Threads that pre-fault each allocation (no gain measured past 4); 0 leaves the faulting
        to ``cuMemHostRegister`` (one thread, slower).
    huge_pages:
        Advise transparent huge pages before faulting (:func:`advise_huge_pages`): about half
        the pinning time on the H200 host.  Off keeps 4 KiB pages.
    """

    pinned = True

    def __init__(self, device: int = 0, *, mapped: bool = False, threads: int = 4, huge_pages: bool = True) -> None:
        self._dev = _cuda.device(device)
        self.mapped = mapped
        self.threads = threads
        self.huge_pages = huge_pages

    def allocate(self, nbytes: int) -> HostAllocation:
        return CudaPinnedAllocation(nbytes, self._dev, mapped=self.mapped, threads=self.threads,
                                    huge_pages=self.huge_pages)


def pinned_allocator(device: int | None = None, *, mapped: bool = False, threads: int = 4,
                     huge_pages: bool = True) -> HostAllocator | None:
    """A page-locked CUDA host allocator, or ``None`` when CUDA is not usable."""
    if not _cuda.available():
        return None
    return CudaHostAllocator(0 if device is None else device, mapped=mapped, threads=threads, huge_pages=huge_pages)


# ============================================================================================
# KV planes
# ============================================================================================
