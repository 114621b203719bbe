"""The one module that imports ``cuda.bindings``.

Everything CUDA goes through the thin functions here, which turn cuda-python's ``(error, value)``
tuples into :class:`~hostkv_providers.CopyEngineError` (the ``handle_return`` idiom of
``cuda.core``).  The driver API is used throughout: it shares the *primary context* with the CUDA
runtime, so pointers, streams and events of PyTorch (or any runtime user) are interchangeable
with ours.

Whether CUDA is usable is decided once per process by :func:`available`.  On a machine without
an NVIDIA driver ``cuda.bindings`` still imports, but its first call raises cuda.pathfinder's
``DynamicLibNotFoundError`` (the driver library is absent) or returns an error code
(``CUDA_ERROR_NO_DEVICE``, insufficient driver); all of these mean "no CUDA" and the caller falls
back to host-only code.  Nothing else in the package may touch ``cuda.bindings``.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from collections.abc import Iterator
from functools import cache, lru_cache
from typing import Any

from hostkv_providers._errors import CopyEngineError

__all__ = [
    "Device",
    "available",
    "check",
    "compile_module",
    "device",
    "unavailable_reason",
]

_driver: Any = None
_nvrtc: Any = None
_state_lock = threading.Lock()
_reason: str | None = None
_initialized = False


def _error_text(err: Any) -> str:
    try:
        _, name = _driver.cuGetErrorName(err)
        _, desc = _driver.cuGetErrorString(err)
        return f"{name.decode()} ({desc.decode()})"
    except Exception:  # the error path must never raise something else
        return repr(err)


def check(result: Any, what: str = "CUDA call") -> Any:
    """Unwrap a cuda-python driver result tuple, raising :class:`CopyEngineError` on failure.

    Returns ``None`` for a bare status, the value for one output, or the tuple of outputs.
    """
    err = result[0]
    if int(err) != 0:
        raise CopyEngineError(f"{what} failed: {_error_text(err)}")
    rest = result[1:]
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else rest


def _init() -> None:
    """Import the bindings and initialise the driver once; record why CUDA is unusable."""
    global _driver, _initialized, _reason
    with _state_lock:
        if _initialized:
            return
        _initialized = True
        try:
            from cuda.bindings import driver
        except Exception as exc:  # not installed, or a broken install
            _reason = f"cuda.bindings is not importable: {exc!r}"
            return
        _driver = driver
        try:
            err, = driver.cuInit(0)
            if int(err) != 0:
                _reason = f"cuInit failed: {_error_text(err)}"
                return
            err, count = driver.cuDeviceGetCount()
            if int(err) != 0 or count < 1:
                _reason = "no CUDA device is visible"
                return
        except Exception as exc:
            # cuda.pathfinder raises DynamicLibNotFoundError here when there is no driver library.
            _reason = f"the CUDA driver is not usable: {type(exc).__name__}: {exc}"
            return
        _reason = None


def available() -> bool:
    """Whether a CUDA device is usable in this process (decided once, cached)."""
    _init()
    return _reason is None


def unavailable_reason() -> str | None:
    """Why :func:`available` is ``False``, or ``None`` when CUDA is usable."""
    _init()
    return _reason


def driver() -> Any:
    """The ``cuda.bindings.driver`` module (only after :func:`available` returned ``True``)."""
    if not available():
        raise CopyEngineError(f"CUDA is not usable: {_reason}", hint="use the CPU copy engine")
    return _driver


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_uint), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    """``CUmemcpyAttributes`` (driver ABI, CUDA 12.8+)."""

    _fields_ = [("srcAccessOrder", ctypes.c_uint), ("srcLocHint", _MemLocation), ("dstLocHint", _MemLocation),
                ("flags", ctypes.c_uint)]


#: ``CU_MEMCPY_SRC_ACCESS_ORDER_STREAM``: the source is read in stream order.  A save's source is
#: the engine's blocks, written by kernels enqueued before it: reading them early (``ANY``) would
#: copy stale bytes.
_SRC_ORDER_STREAM = 1
_BatchCall = Any  # (dsts, srcs, sizes: addresses of uint64 arrays, count, CUstream handle) -> CUresult


@cache
def batch_memcpy() -> _BatchCall | None:
    """``cuMemcpyBatchAsync`` as a function of raw array addresses, ``fn(dsts, srcs, sizes, count,
    stream) -> CUresult`` (every copy stream-ordered), or ``None`` where the driver has none
    (before CUDA 12.8).  Resolved once.

    Called through ``ctypes`` with the addresses of numpy arrays, not through ``cuda.bindings``:
    the binding takes lists of ``CUdeviceptr`` objects, one per copy, and a restore of 6,400 pages
    is 409,600 copies (per-copy Python objects are what the engine's hot paths must not make).
    ``ctypes`` releases the GIL for the call, so the driver's ~0.5 us per copy runs beside the
    engine's threads.  CUDA 13 drivers export the version without ``failIdx`` (``_v2``), 12.8-12.9
    the one with it; the version asked for decides which entry point comes back."""
    return _resolve_batch() if available() else None


def _resolve_batch() -> _BatchCall | None:
    d = _driver
    try:
        version = int(check(d.cuDriverGetVersion(), "cuDriverGetVersion"))
        if version < 12080:
            return None
        ask = 13000 if version >= 13000 else 12080
        err, ptr, _status = d.cuGetProcAddress(b"cuMemcpyBatchAsync", ask, 0)
        if int(err) != 0 or not ptr:
            return None
    except Exception:
        return None
    vp, sz = ctypes.c_void_p, ctypes.c_size_t
    attrs = _MemcpyAttributes(srcAccessOrder=_SRC_ORDER_STREAM)
    idx = ctypes.c_size_t(0)
    if ask >= 13000:
        fn13 = ctypes.CFUNCTYPE(ctypes.c_uint, vp, vp, vp, sz, vp, vp, sz, vp)(ptr)

        def call(dsts: int, srcs: int, sizes: int, count: int, stream: int) -> int:
            return int(fn13(dsts, srcs, sizes, count, ctypes.addressof(attrs), ctypes.addressof(idx), 1, stream))
    else:
        fn12 = ctypes.CFUNCTYPE(ctypes.c_uint, vp, vp, vp, sz, vp, vp, sz, vp, vp)(ptr)

        def call(dsts: int, srcs: int, sizes: int, count: int, stream: int) -> int:
            fail = ctypes.c_size_t(0)
            return int(fn12(dsts, srcs, sizes, count, ctypes.addressof(attrs), ctypes.addressof(idx), 1,
                            ctypes.addressof(fail), stream))

    return call  # (the closure keeps the attribute structs alive for every call)


@lru_cache(maxsize=256)
def c_array(ctype: Any, n: int) -> Any:
    """``ctype * n``, made once.  ctypes keeps its array types only weakly and a type is a
    reference cycle (its mro and descriptors), so a ``ctype * n`` made per launch or per page
    died as garbage for the collector each time, and an engine's process pays for that in full
    collections (~100 ms with torch loaded)."""
    return ctype * n


def launch(fn: Any, grid: int, threads: int, stream: Any, args: list[Any], what: str) -> None:
    """``cuLaunchKernel`` of ``fn`` over ``grid`` blocks of ``threads`` with ``args`` (ctypes
    scalars or structures, kept alive by the caller's list for the call)."""
    params = c_array(ctypes.c_void_p, len(args))(*[ctypes.addressof(a) for a in args])
    check(driver().cuLaunchKernel(fn, grid, 1, 1, threads, 1, 1, 0, stream, ctypes.addressof(params), 0), what)


def error_text(code: int) -> str:
    """The driver's name for a ``CUresult`` code (for calls made through ``ctypes``)."""
    try:
        return _error_text(_driver.CUresult(code))
    except Exception:
        return f"CUresult {code}"


def nvrtc() -> Any:
    """The ``cuda.bindings.nvrtc`` module; raises :class:`CopyEngineError` if NVRTC is missing."""
    global _nvrtc
    if _nvrtc is None:
        try:
            from cuda.bindings import nvrtc as mod

            check(mod.nvrtcVersion(), "nvrtcVersion")
        except CopyEngineError:
            raise
        except Exception as exc:
            raise CopyEngineError(f"NVRTC is not usable: {type(exc).__name__}: {exc}",
                                  hint="install nvidia-cuda-nvrtc, or use mode='memcpy'") from None
        _nvrtc = mod
    return _nvrtc


class Device:
    """One CUDA device and its primary context (shared with the runtime, hence with torch)."""

    def __init__(self, ordinal: int) -> None:
        d = driver()
        count = check(d.cuDeviceGetCount(), "cuDeviceGetCount")
        if type(ordinal) is not int or not 0 <= ordinal < count:
            raise CopyEngineError(f"CUDA device {ordinal!r} does not exist ({count} visible)")
        self.ordinal = ordinal
        self.handle = check(d.cuDeviceGet(ordinal), "cuDeviceGet")
        self.context = check(d.cuDevicePrimaryCtxRetain(self.handle), "cuDevicePrimaryCtxRetain")
        self._local = threading.local()
        attr = d.CUdevice_attribute
        self.sm_count = int(check(d.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
                                                         self.handle), "cuDeviceGetAttribute"))
        major = check(d.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, self.handle),
                      "cuDeviceGetAttribute")
        minor = check(d.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, self.handle),
                      "cuDeviceGetAttribute")
        self.capability = (int(major), int(minor))
        with self.scope():
            least, _greatest = check(d.cuCtxGetStreamPriorityRange(), "cuCtxGetStreamPriorityRange")
        self.lowest_priority = int(least)

    def activate(self) -> None:
        """Make the primary context current for good: only on threads this package owns."""
        if getattr(self._local, "active", False):
            return
        check(driver().cuCtxSetCurrent(self.context), "cuCtxSetCurrent")
        self._local.active = True

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        """Make the primary context current for a block on a caller's thread, then restore theirs.

        A caller's thread may have another device current (a multi-GPU engine); switching it for
        good would move the caller's own CUDA work to our device.
        """
        if getattr(self._local, "active", False):
            yield
            return
        d = driver()
        current = check(d.cuCtxGetCurrent(), "cuCtxGetCurrent")
        if current is not None and int(current) == int(self.context):
            yield
            return
        check(d.cuCtxPushCurrent(self.context), "cuCtxPushCurrent")
        try:
            yield
        finally:
            d.cuCtxPopCurrent()

    # -- streams and events ------------------------------------------------------------------
    def stream(self, *, low_priority: bool = True) -> Any:
        """A new non-blocking stream (never synchronises with the legacy default stream)."""
        d = driver()
        flags = int(d.CUstream_flags.CU_STREAM_NON_BLOCKING)
        prio = self.lowest_priority if low_priority else 0
        with self.scope():
            return check(d.cuStreamCreateWithPriority(flags, prio), "cuStreamCreateWithPriority")

    def event(self, *, timing: bool = False, blocking: bool = False) -> Any:
        """A new event; ``blocking``: a host wait on it (``cuEventSynchronize``) sleeps until the
        GPU signals it instead of spinning a core (for threads that wait on it in a loop)."""
        d = driver()
        flags = 0 if timing else int(d.CUevent_flags.CU_EVENT_DISABLE_TIMING)
        if blocking:
            flags |= int(d.CUevent_flags.CU_EVENT_BLOCKING_SYNC)
        with self.scope():
            return check(d.cuEventCreate(flags), "cuEventCreate")

    # -- memory ------------------------------------------------------------------------------
    def mem_alloc(self, nbytes: int) -> int:
        with self.scope():
            return int(check(driver().cuMemAlloc(nbytes), f"cuMemAlloc({nbytes})"))

    def mem_alloc_async(self, nbytes: int, stream: Any) -> int:
        """Stream-ordered device memory from the device's default pool (``cuMemAllocAsync``).

        Unlike ``cuMemFree``, its ``cuMemFreeAsync`` never synchronises the device.
        """
        with self.scope():
            return int(check(driver().cuMemAllocAsync(nbytes, stream), f"cuMemAllocAsync({nbytes})"))

    def mem_free_async(self, ptr: int, stream: Any) -> None:
        with self.scope():
            check(driver().cuMemFreeAsync(ptr, stream), "cuMemFreeAsync")

    def mem_free(self, ptr: int) -> None:
        with self.scope():
            check(driver().cuMemFree(ptr), "cuMemFree")

    def pointer_range(self, ptr: int) -> tuple[int, int, int]:
        """``(start, size, device_ordinal)`` of the device allocation containing ``ptr``."""
        d = driver()
        a = d.CUpointer_attribute
        with self.scope():
            start = check(d.cuPointerGetAttribute(a.CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, ptr), "pointer range")
            size = check(d.cuPointerGetAttribute(a.CU_POINTER_ATTRIBUTE_RANGE_SIZE, ptr), "pointer range")
            ordinal = check(d.cuPointerGetAttribute(a.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr), "pointer device")
        return int(start), int(size), int(ordinal)


_devices: dict[int, Device] = {}
_devices_lock = threading.Lock()


def device(ordinal: int = 0) -> Device:
    """The shared :class:`Device` object for ``ordinal``."""
    with _devices_lock:
        dev = _devices.get(ordinal)
        if dev is None:
            dev = Device(ordinal)
            _devices[ordinal] = dev
    return dev


# -- host memory -----------------------------------------------------------------------------
def host_register(address: int, nbytes: int, *, mapped: bool) -> None:
    """Page-lock existing host memory (``cuMemHostRegister``, portable to every context)."""
    d = driver()
    flags = d.CU_MEMHOSTREGISTER_PORTABLE
    if mapped:
        flags |= d.CU_MEMHOSTREGISTER_DEVICEMAP
    check(d.cuMemHostRegister(address, nbytes, flags), "cuMemHostRegister")


def host_unregister(address: int) -> None:
    check(driver().cuMemHostUnregister(address), "cuMemHostUnregister")


def host_alloc(nbytes: int, *, mapped: bool) -> int:
    """Page-locked memory from the driver (``cuMemHostAlloc``); the fallback path."""
    d = driver()
    flags = d.CU_MEMHOSTALLOC_PORTABLE
    if mapped:
        flags |= d.CU_MEMHOSTALLOC_DEVICEMAP
    return int(check(d.cuMemHostAlloc(nbytes, flags), f"cuMemHostAlloc({nbytes})"))


def host_free(address: int) -> None:
    check(driver().cuMemFreeHost(address), "cuMemFreeHost")


def host_device_pointer(address: int) -> int:
    """The device address of mapped, page-locked host memory."""
    return int(check(driver().cuMemHostGetDevicePointer(address, 0), "cuMemHostGetDevicePointer"))


# -- run-time compilation --------------------------------------------------------------------
@cache
def compile_module(source: str, name: str, capability: tuple[int, int], options: tuple[str, ...] = ()) -> bytes:
    """Compile CUDA C++ ``source`` with NVRTC for ``capability``; returns a cubin (or PTX).

    A cubin for the exact architecture is preferred; if this NVRTC does not know the device's
    architecture, PTX for the newest one it knows is returned and the driver JIT-compiles it.
    """
    nv = nvrtc()
    arch = capability[0] * 10 + capability[1]
    try:
        supported = [int(a) for a in check(nv.nvrtcGetSupportedArchs(), "nvrtcGetSupportedArchs")]
    except CopyEngineError:
        supported = [arch]
    use_cubin = arch in supported
    target = arch if use_cubin else max(a for a in supported if a <= arch) if any(a <= arch for a in supported) \
        else min(supported)
    prefix = "sm" if use_cubin else "compute"
    opts = [f"--gpu-architecture={prefix}_{target}".encode(), b"--std=c++17",
            *(o.encode() for o in options)]
    prog = check(nv.nvrtcCreateProgram(source.encode(), name.encode(), 0, [], []), "nvrtcCreateProgram")
    try:
        (err,) = nv.nvrtcCompileProgram(prog, len(opts), opts)
        if int(err) != 0:
            size = check(nv.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
            log = b" " * size
            check(nv.nvrtcGetProgramLog(prog, log), "nvrtcGetProgramLog")
            raise CopyEngineError(f"NVRTC failed to compile {name}: {log.decode(errors='replace').strip()}")
        if use_cubin:
            size = check(nv.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
            image = b" " * size
            check(nv.nvrtcGetCUBIN(prog, image), "nvrtcGetCUBIN")
        else:
            size = check(nv.nvrtcGetPTXSize(prog), "nvrtcGetPTXSize")
            image = b" " * size
            check(nv.nvrtcGetPTX(prog, image), "nvrtcGetPTX")
        return bytes(image)
    finally:
        nv.nvrtcDestroyProgram(prog)


def load_function(dev: Device, image: bytes, name: str) -> Any:
    """Load a compiled module into ``dev``'s context and return the kernel ``name``."""
    d = driver()
    with dev.scope():
        module = check(d.cuModuleLoadData(image), "cuModuleLoadData")
        return check(d.cuModuleGetFunction(module, name.encode()), f"cuModuleGetFunction({name})")
