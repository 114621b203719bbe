"""The CUDA copy engine: whole pages by ``cuMemcpyBatchAsync`` straight between host pages and
blocks (``direct="batch"``, the default; :mod:`._direct`), else a fused gather/scatter kernel
(NVRTC) into double-buffered device staging and large DMA copies, on dedicated streams; events and
stream memory operations for ordering.

This file is the engine's surface: construction, validation, the verbs (``save``, ``restore``,
``mark``, ``gate``), the hand-off to its worker threads and the lifecycle.  The engine is one
object in layers, each a file of this folder and a base of the next: ``_cuda_staging.py`` (shared
attributes, the pack kernel, plane tables, staging slots, host-page coalescing) ->
``_cuda_issue.py`` (a save's and a whole restore's copies, the shared restore) ->
``_cuda_layers.py`` (layer-wise restores, prestaging) -> here."""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from hostkv_providers._errors import CopyArgumentError, CopyEngineError
from hostkv_providers._region import HostPages
from hostkv_providers.device import _cuda, _direct
from hostkv_providers.device._cuda_layers import _CudaLayers, _Prestaged
from hostkv_providers.device._cuda_staging import _KERNEL_SOURCE, _MAX_CHUNK_PAGES, _page_addresses, _Table
from hostkv_providers.device._cuda_sync import _CudaHandle, _CudaMark, _FlagPool, _Reaper
from hostkv_providers.device._engine import (
    _check_distinct,
    _check_ids,
    _check_layers,
    _check_pages,
    _Pages,
    _stream_handle,
)
from hostkv_providers.device._order import Gate, StreamMark, _NoGate, _Worker
from hostkv_providers.device._planes import _PAGE, KVPlanes, _layer_spans, _MiB
from hostkv_providers.device._transfer import TransferHandle


class CudaCopyEngine(_CudaLayers):
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
    direct:
        Which pages go by DMA straight between host memory and the blocks (no staging buffer, no
        kernel, no SM of the engine's taken) instead of the staging path:

        * ``"batch"`` (the default): every page of a save or a whole restore, in any block
          order, by ``cuMemcpyBatchAsync`` (one copy per page and run of adjacent planes; CUDA
          12.8+ drivers, copies of at least 32 KiB, each page in one region, pinned pages;
          otherwise, and for layer-wise restores, the staging path).  Measured on the H200
          (docs/benchmarks.md, sessions 13-16), a graph-captured decode step beside back-to-back
          restores or saves runs at 1.01-1.03x of its time alone, p99 1.05-1.25x over 1,000
          steps (1.45x beside saves in one run on a slow host; the staging path's kernels: p50
          1.04-1.07x, p99 1.11-1.53x across session 16's runs).
          The driver's ~0.5 us per copy is host time, so calls of 4,096 copies or more are issued
          half by a second thread on a second stream.  Through the cache: with K and V of a block
          adjacent (FlashInfer's layout) restores at 0.97x of a bulk copy and saves at 0.95x;
          with vLLM's ``[2, blocks, ...]`` (32 KiB copies) restores at 0.94-0.96x and saves at
          0.91-0.94x, within ~1% of the staging path side by side, but moving more between runs
          (0.82-0.84x in one run each of sessions 13 and 16).  The driver's time per copy itself
          varies: 0.56-1.1 us from one restore to the next in session 17, and for seconds at a
          time so much that restores ran at 0.39-0.46x of a bulk copy (2 of 8 processes, saves
          unaffected); ``"shared"`` is designed to bound that.  Copies of 32 KiB move less
          steadily than 64 KiB ones: 20 restores of 13.4 GB in one process (session 18) took
          256-318 ms (median 0.89x) with 32 KiB copies, 247-251 ms (0.98x) with 64 KiB copies
          (K and V adjacent), 244-250 ms staged.
        * ``"shared"``: as ``"batch"``, but a restore of 4,096 copies or more is shared with the
          staging path (:class:`~._direct.Claims`): the side thread takes pages from the back by
          batch copies, this engine's worker stages chunks from the front whenever the GPU has
          caught up with the side's copies, so a slow driver costs SM time, not throughput.
          Saves go as ``"batch"`` moves them (their batch copies were never seen to slow down;
          shared, they ran at 0.86-0.91x and cost decode steps).  Measured on the H200
          (docs/benchmarks.md, sessions 17-18).
        * ``"auto"``: runs of consecutive block ids over adjacent host pages, at least 16 MiB of
          planes with slices of at least 8 KiB, one 2D copy per plane and run; ``"always"``: every
          such run; other pages staged.  2D rows of one plane slice move at 0.89-0.94x of a bulk
          copy (0.82x for saves).
        * ``"never"``: every page staged (the fused gather/scatter kernel plus bulk DMA):
          0.92-0.98x, and the only path for short slices; the choice where the last few percent
          of restore or save throughput matter more than the decode step beside them.

    stream_gates:
        How a stream is ordered behind copies not issued yet (``restore(before=)``, a cache
        handle's ``wait_on``/``wait_layer_on`` before the restore thread got that far).
        ``False`` (the default): the caller's thread waits until the copies are *issued* (not
        done), then the stream waits on their event (``cuStreamWaitEvent``): an order CUDA sees.
        ``True``: the stream waits on a device-visible flag at once (``cuStreamWaitValue32``,
        no host wait) that the worker sets behind the copies.  That order is invisible to CUDA:
        streams share the GPU's hardware queues (``CUDA_DEVICE_MAX_CONNECTIONS``, 8 by
        default; 1 in some training and serving setups), and where the gated stream shares one
        with a stream whose later work opens the flag (the copies, the opening write), that
        work queues behind the wait and the stream is held for good.  Measured on the H200:
        ``tests/device/gpu/test_layers_gpu.py`` hung at random in a gated layer-wise restore
        from ``mmap://`` (every host thread idle; docs/benchmarks.md, session 22).  Only for
        processes that control every stream's hardware queue.

    Streams: two non-blocking, lowest-priority streams per direction (pack and DMA), so the pack
    of chunk ``k+1`` overlaps the DMA of chunk ``k``; staging reuse is ordered by events.
    """

    def __init__(self, device: int = 0, *, staging_bytes: int = 64 * _MiB, mode: str = "auto",
                 ctas: int | None = None, threads: int = 256, tile_bytes: int = 16384,
                 cache_hints: bool = True, direct: str = "batch", stream_gates: bool = False) -> None:
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
        self.direct = _direct.check_direct(direct)
        if not isinstance(stream_gates, bool):
            raise CopyArgumentError(f"stream_gates must be a bool, got {stream_gates!r}")
        self.stream_gates = stream_gates
        # prestages holding the restore issue lock (a restore(before=) of this thread waits for a
        # worker that needs it: refused instead of hanging)
        self._prestages: set[_Prestaged] = set()
        # "shared" plans every transfer as "batch" does; large restores are then shared with the
        # staging path (_issue_shared)
        self._share = self.direct == "shared"
        self._planned = "batch" if self._share else self.direct
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
        self._restore_tail = dev.event()  # (re-recorded under the restore issue lock only)
        self._staging: dict[str, list[int]] = {"save": [], "restore": []}
        self._slot_events: dict[str, list[tuple[Any, Any]]] = {}
        self._slot = {"save": 0, "restore": 0}
        if mode == "kernel":
            aux = self._streams["aux"]
            for direction in ("save", "restore"):
                self._staging[direction] = [dev.mem_alloc_async(staging_bytes, aux) for _ in range(2)]
                # (blocking-sync: a shared restore's worker waits on its slots' events per chunk,
                # and a prestaged layer-wise restore on one; the save side's are only waited on
                # by streams, where the flag does nothing)
                self._slot_events[direction] = [(dev.event(blocking=True), dev.event(blocking=True))
                                                for _ in range(2)]
            with dev.scope():  # our own stream only: the staging exists before any transfer uses it
                _cuda.check(_cuda.driver().cuStreamSynchronize(aux), "cuStreamSynchronize")
        self._tables: dict[tuple[Any, ...], _Table] = {}
        self._table_lock = threading.Lock()
        self._checked: set[tuple[Any, ...]] = set()
        self._workers = {"save": _Worker("hostkv-cuda-save"), "restore": _Worker("hostkv-cuda-restore")}
        # One issuer at a time per direction (staging slots and their events): the worker, or the
        # caller's thread for a layer-wise restore's first layer (_inline_first_layer).
        self._issue_locks = {"save": threading.Lock(), "restore": threading.Lock()}
        self._flags = _FlagPool(dev)
        self._reaper = _Reaper(dev)
        # direct="batch": a second thread and stream per direction issue half of each large batch
        self._sides: dict[str, _direct.BatchSide] = {}
        #: Pages of ``direct="shared"`` restores (:meth:`_issue_shared`): ``[staged, by batch
        #: copies]``, summed over the engine's life (what a benchmark reports).
        self.shared_pages = [0, 0]
        if self._planned == "batch" and _cuda.batch_memcpy() is not None:
            self._sides = {name: _direct.BatchSide(dev, f"hostkv-cuda-{name}-side") for name in ("save", "restore")}

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

    def mark(self, stream: Any) -> StreamMark | None:
        if stream is None or isinstance(stream, StreamMark):
            return stream
        s = _stream_handle(stream, "after")
        assert s is not None
        ev = self._dev.event()
        with self._dev.scope():
            _cuda.check(_cuda.driver().cuEventRecord(ev, s), "cuEventRecord(mark)")
        return _CudaMark(self._reaper, ev)

    def gate(self, stream: Any) -> Gate:
        if stream is None:
            return _NoGate()
        s = _stream_handle(stream, "before")
        assert s is not None
        self._check_open()
        return self._flags.gate(s)

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
        dplan = self._plan(planes, ids, pages, dst)
        self._submit("save", handle, lambda: self._issue_save(handle, planes, ids, pages, after_ev, dplan))
        return handle

    def restore(self, src: Sequence[Any] | HostPages, planes: KVPlanes, block_ids: Sequence[int], *,
                before: Any = None, layerwise: bool = False, layers: range | None = None,
                prestaged: _Prestaged | None = None) -> TransferHandle:
        """:meth:`CopyEngine.restore`; ``prestaged``: from :meth:`prestage` for these pages
        (a layer-wise restore of every layer): its chunks are not copied again."""
        try:
            self._check_open()
            self._check_planes(planes)
            ids = _check_ids(planes, block_ids)
            _check_distinct(ids)
            pages = _check_pages(planes.layout, src, len(ids), writable=False)
            moved = _check_layers(planes.layout, layerwise, layers)
            if before is not None and not self.stream_gates:
                self.check_stream(before)  # (waited on below, after the submit: refused here)
                me = threading.get_ident()
                if any(p.owner == me and p is not prestaged for p in list(self._prestages)):
                    raise CopyArgumentError("this thread holds a prestage (the restore issue lock) that this "
                                            "restore does not take: pass it as prestaged= or release() it first")
            dplan = self._plan(planes, ids, pages, src, layerwise=moved is not None)
            if prestaged is not None and not self._prestage_fits(prestaged, planes, pages, moved, dplan):
                prestaged.release()
                prestaged = None
        except BaseException:
            if prestaged is not None:
                prestaged.release()
            raise
        # stream_gates: the stream is held back from now on (a wait on a device-visible flag)
        # and the worker opens it behind the copies.  Otherwise (the default) this thread waits
        # below until the worker has issued them, then the stream waits on their event.
        gate = self.gate(before) if self.stream_gates else None
        handle = _CudaHandle(len(ids) * planes.layout.page_nbytes, self, planes.layout.num_layers)
        handle.keep = (planes, src)
        if moved is None:
            self._submit("restore", handle, lambda: self._issue_restore(handle, planes, ids, pages, dplan), gate)
        else:
            handle.layers = moved if layers is not None else None
            handle.nbytes = len(ids) * sum(span[3] for span in _layer_spans(planes.layout)[moved.start: moved.stop])
            handle._recorded = [threading.Event() for _ in range(planes.layout.num_layers)]
            pre = self._inline_first_layer(handle, planes, ids, pages, moved, dplan, prestaged)
            self._submit("restore", handle,
                         lambda: self._issue_restore_layers(handle, planes, ids, pages, moved, dplan, pre), gate)
        if before is not None and gate is None:
            try:
                handle.wait_on(before)
            except CopyEngineError:
                if handle._error is None:
                    raise  # (a driver error ordering the stream; a failed transfer's handle reports it)
        return handle

    def check_stream(self, stream: Any) -> None:
        """Raise :class:`CopyArgumentError` unless ``stream`` is one this engine can order (a
        ``torch.cuda.Stream``, a ``CUstream`` or its int handle)."""
        _stream_handle(stream, "before")

    def _plan(self, planes: KVPlanes, ids: list[int], pages: _Pages, given: Any, *,
              layerwise: bool = False) -> _direct.DirectPlan:
        """The direct plan of a transfer (``given``: the caller's pages as passed, whose regions
        say whether they are pinned: batch copies are only for pinned pages).  A layer-wise
        restore is staged where :func:`_direct.stages_all` says so (``direct="batch"``)."""
        if self._planned == "never" or (layerwise and _direct.stages_all(self._planned)):
            return _direct.NO_PLAN
        pinned = self._planned != "batch" or _direct.pages_pinned(given)
        return _direct.plan(self._planned, planes.layout, ids, _page_addresses(pages), pinned=pinned, planes=planes)

    def _submit(self, direction: str, handle: _CudaHandle, issue: Callable[[], None],
                gate: Gate | None = None) -> None:
        def job() -> None:
            try:
                self._dev.activate()
                self._reaper.reap()
                with self._issue_locks[direction]:
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

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for w in self._workers.values():
            w.stop()
        # Issues on callers' threads (a layer's first chunks, a prestage held across a cache's
        # checks) finish before the buffers and events they use go; a prestage never released
        # (a caller's bug) does not hang close() for ever.
        held = [lock for lock in self._issue_locks.values() if lock.acquire(timeout=10.0)]
        try:
            with self._dev.scope():
                self._release()
        finally:
            for lock in held:
                lock.release()
        self._reaper.close()  # (what is collected from now on is destroyed where it is collected)

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
        d.cuEventDestroy(self._restore_tail)
        for s in self._streams.values():
            attempt(d.cuStreamDestroy(s), "cuStreamDestroy")
        for side in self._sides.values():
            side.close(attempt)
        self._sides = {}  # (a batch issued after close() takes no side: it fails on the closed streams)
        self._flags.close(problems)
        self._tables.clear()
        if problems:
            warnings.warn("closing the CUDA copy engine: " + "; ".join(problems), stacklevel=2)
