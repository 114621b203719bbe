"""The CUDA copy engine's layer-wise restores (a part of :class:`~._cuda_engine.CudaCopyEngine`):
layer ``l`` of every page, then layer ``l + 1``, with an event per layer; the first layer's first
chunks issued on the caller's thread (:meth:`_CudaLayers._inline_first_layer`), and prestaging
(:meth:`_CudaLayers.prestage`: layer 0's first chunks moved into staging before the restore's
block ids are checked)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from hostkv_providers._region import HostPages
from hostkv_providers.device import _cuda, _direct
from hostkv_providers.device._cpu_engine import _segments
from hostkv_providers.device._cuda_issue import _CudaIssue
from hostkv_providers.device._cuda_staging import _coalesce_pages, _page_addresses, _subset, _Table
from hostkv_providers.device._cuda_sync import _CudaHandle
from hostkv_providers.device._engine import _Pages
from hostkv_providers.device._planes import KVPlanes, _layer_spans

# A layer-wise restore's first staged chunks issued on the caller's thread (0.6-1.2 ms for two, H200):
# two keep the DMA busy (~0.6 ms a chunk of 32 MiB) through the hand-off to the worker, which
# issues the rest; the whole first layer there held an engine's thread ~2.6 ms (H200).
_INLINE_CHUNKS = 2


@dataclass
class _LayerJob:
    """A layer-major restore in the making (:meth:`CudaCopyEngine._layers_begin`): its events, the
    pages left to the staging path, and ``last``, the stream every layer's event is recorded on."""

    handle: _CudaHandle
    spans: list[tuple[int, int, int, int]]
    layer_evs: list[Any]
    done: Any
    ids_s: list[int]
    pages_s: _Pages
    addresses: Any
    table: _Table | None
    last: Any
    resume_layer: int = -1  # a layer issued in part (its first chunks, on the caller's thread)
    resume_at: int = 0  # the staged page it goes on from
    # Per staged chunk ``(c0, c1)``: its runs of adjacent host pages, each with the 2D copy that
    # moves one layer of it (``(first row in the chunk, host address, its CUDA_MEMCPY2D)``).  The
    # same for every layer but the source offset and the row width: built once, not per layer
    # (32x the coalescing and struct building, ~0.15 ms a chunk of Python holding the GIL).
    runs: dict[tuple[int, int], list[tuple[int, int, Any]]] = field(default_factory=dict)
    # ``(layer, c0, c1)`` -> the staging slot :meth:`CudaCopyEngine.prestage` already loaded
    prestaged: dict[tuple[int, int, int], int] = field(default_factory=dict)



class _Prestaged:
    """The first staged chunks of layer 0 of a layer-wise restore, moved host -> staging by
    :meth:`CudaCopyEngine.prestage` before the restore's block ids are known.  Those copies write
    the engine's own staging buffers only, so they may run while the caller checks what the
    restore writes (6,400 block ids and the hit's views: ~1 ms of Python on the H200 host, which
    layer 0 otherwise waits for).  Holds the restore issue lock (the staging slots are in use)
    until :meth:`CudaCopyEngine.restore` takes it (``prestaged=``) or :meth:`release` drops it."""

    def __init__(self, engine: _CudaLayers, layout: Any, start: Any, addresses: Any,
                 chunks: list[tuple[int, int, int]], runs: dict[tuple[int, int], list[tuple[int, int, Any]]]) -> None:
        self.engine = engine
        self.layout = layout
        self.start: Any = start  # the transfer's start event, recorded before the first copy
        self.addresses = addresses  # the staged pages' host addresses
        self.chunks = chunks  # (c0, c1, staging slot) in issue order
        self.runs = runs  # their 2D copies (a _LayerJob's runs)
        self._held = True
        self._once = threading.Lock()
        self.owner = threading.get_ident()  # the thread that holds the issue lock through it

    def take_start(self) -> Any:
        """The start event, owned by the caller from now on."""
        ev, self.start = self.start, None
        return ev

    def release(self) -> None:
        """Give the issue lock back (once); the staged bytes are simply never read.  Later
        copies into the same slots are ordered behind these on the DMA stream.  Unused (no
        restore took it: a refused restore), it first waits for its copies, which read the
        caller's pages: once the caller's restore has raised, nothing reads them any more (the
        caller may drop its lease and the store reuse the memory).  Refusals only: its chunks
        (~1.3 ms) behind whatever the DMA stream still had queued."""
        with self._once:
            if not self._held:
                return
            self._held = False
            self.engine._prestages.discard(self)
        try:
            if self.start is not None:
                engine = self.engine
                if self.chunks:
                    loaded = engine._slot_events["restore"][self.chunks[-1][2]][0]
                    with engine._dev.scope():  # (the lock still held: nobody re-records it)
                        _cuda.driver().cuEventSynchronize(loaded)
                engine._reaper.bury([self.start])
                self.start = None
        finally:
            self.engine._issue_locks["restore"].release()



class _CudaLayers(_CudaIssue):
    """Layer-wise restores and prestaging (a part of :class:`~._cuda_engine.CudaCopyEngine`)."""

    # prestages holding the restore issue lock (a restore(before=) of this thread waits for a
    # worker that needs it: refused instead of hanging)
    _prestages: set[_Prestaged]

    def prestage(self, pages: HostPages, layout: Any, count: int) -> _Prestaged | None:
        """Begin a layer-wise restore of ``count`` pages before its block ids are checked: the
        host -> staging copies of layer 0 of its first chunks (``pages``: the first pages' views,
        at least that many), which touch no engine memory.  ``None`` where it does not apply
        (another restore is being issued, memcpy mode, ``direct="auto"`` or ``"always"``, pages
        not in one region each) or fails; otherwise pass the result to
        :meth:`restore` (``prestaged=``) or call its ``release()``.  The issue lock is held until
        then: keep that span short."""
        if self.mode != "kernel" or not isinstance(pages, HostPages) or count < 1:
            return None
        if not _direct.stages_all(self._planned):
            return None  # (its pages go by direct DMA: nothing is staged)
        if pages.page_nbytes != layout.page_nbytes or layout.num_layers < 2:
            return None
        lock = self._issue_locks["restore"]
        if not lock.acquire(blocking=False):
            return None
        pre: _Prestaged | None = None
        try:
            self._check_open()
            spans = _layer_spans(layout)
            nb = spans[0][3]
            per = self._per_chunk(nb)
            k = min(count, len(pages), per * _INLINE_CHUNKS)
            if k < min(count, per * _INLINE_CHUNKS):
                lock.release()  # (held, every later restore's issue would wait for it for good)
                return None  # too few views for the first chunks
            d = _cuda.driver()
            with self._dev.scope():
                start = self._dev.event(timing=True)
                pre = _Prestaged(self, layout, start, pages.addresses[:k].copy(), [], {})
                self._prestages.add(pre)
                _cuda.check(d.cuEventRecord(start, self._streams["restore_dma"]), "cuEventRecord")
                for c0 in range(0, k, per):
                    c1 = min(k, c0 + per)
                    s = self._stage_layer_chunk(d, pre.runs, pre.addresses, c0, c1, spans[0], layout.page_nbytes)
                    pre.chunks.append((c0, c1, s))
            return pre
        except Exception:
            if pre is not None:
                pre.release()  # copies already enqueued land in staging nobody reads
            else:
                lock.release()
            return None

    def prestage_pages(self, layout: Any) -> int:
        """How many leading pages :meth:`prestage` stages (the views it needs)."""
        nb = _layer_spans(layout)[0][3]
        return self._per_chunk(nb) * _INLINE_CHUNKS

    def _prestage_fits(self, pre: _Prestaged, planes: KVPlanes, pages: _Pages, moved: range | None,
                       dplan: _direct.DirectPlan) -> bool:
        """Whether the restore's own pages begin with the prestaged ones (same layout, layer 0
        first, every page staged): else they are copied again."""
        k = len(pre.addresses)
        return (pre.engine is self and pre.layout == planes.layout and moved is not None and moved.start == 0
                and not dplan.runs and isinstance(pages, HostPages) and len(pages) >= k
                and bool((pages.addresses[:k] == pre.addresses).all()))

    def _stage_layer_chunk(self, d: Any, runs_cache: dict[tuple[int, int], list[tuple[int, int, Any]]],
                           addresses: Any, c0: int, c1: int, span: tuple[int, int, int, int], P: int) -> int:
        """Copy one layer (``span``) of the pages ``[c0, c1)`` (their ``addresses``, each one
        region) into the next restore staging slot, layer-major; returns the slot, its
        ``loaded`` event recorded.  The caller holds the restore issue lock."""
        dma = self._streams["restore_dma"]
        _p0, _np, lo, nb = span
        s = self._take_slot("restore", d, dma)  # (its scatter out of the slot done)
        staging = self._staging["restore"][s]
        loaded = self._slot_events["restore"][s][0]
        runs = runs_cache.get((c0, c1))
        if runs is None:
            host_mem = d.CUmemorytype.CU_MEMORYTYPE_HOST
            dev_mem = d.CUmemorytype.CU_MEMORYTYPE_DEVICE
            runs = runs_cache[(c0, c1)] = []
            for off, addr, m in _coalesce_pages(addresses[c0:c1], P):
                cp = d.CUDA_MEMCPY2D()
                cp.srcMemoryType = host_mem
                cp.srcPitch = P
                cp.dstMemoryType = dev_mem
                cp.Height = m // P
                runs.append((off // P, addr, cp))
        for row, addr, cp in runs:  # (the driver reads the struct during the call)
            cp.srcHost = addr + lo
            cp.dstDevice = staging + row * nb
            cp.dstPitch = nb
            cp.WidthInBytes = nb
            _cuda.check(d.cuMemcpy2DAsync(cp, dma), "cuMemcpy2DAsync")
        _cuda.check(d.cuEventRecord(loaded, dma), "cuEventRecord")
        return s

    def _inline_first_layer(self, handle: _CudaHandle, planes: KVPlanes, ids: list[int], pages: _Pages,
                            moved: range, dplan: _direct.DirectPlan,
                            prestaged: _Prestaged | None = None) -> _LayerJob | None:
        """Start a layer-wise restore on the caller's thread, when no restore is being issued by
        the worker: the first layer's direct runs and its first staged chunks (``_INLINE_CHUNKS``;
        a layer that fits in them is recorded before the call returns; all of it after a
        :meth:`prestage`, which also holds the issue lock already), so layer 0's copies start
        at the call, not after the hand-off to the worker (~0.4 ms) — the engine's layer-0 prefill
        waits for exactly these; the worker goes on from there.  The restore issue lock keeps the
        staging buffers and their events to one issuer at a time; when the worker holds it, or in
        ``memcpy`` mode (a copy per slice: too long for the caller's thread), ``None``: the worker
        issues every layer."""
        if prestaged is None:
            if self.mode != "kernel" and not dplan.all_direct:
                return None
            lock = self._issue_locks["restore"]
            if not lock.acquire(blocking=False):
                return None
            if self._closed:  # close() gave up waiting for this lock (a caller's bug): the worker refuses
                lock.release()
                return None
            release = lock.release
        else:  # the lock is held since prestage()
            release = prestaged.release
        # Prestaged (a cache's restore): the whole first layer here.  Handed to the worker after a
        # few chunks, the rest of layer 0 waited for the GIL behind the caller's and the cache's
        # threads (default 5 ms switch interval): layer 0 took 8.3-9.9 ms on the device against
        # 8.2 issued here, H200; restore() returns ~1 ms later for it.
        chunks = None if prestaged is not None else _INLINE_CHUNKS
        try:
            with self._dev.scope():
                job = self._layers_begin(handle, planes, ids, pages, moved, dplan, prestaged)
                self._layers_issue(job, planes, ids, dplan, [moved.start], chunks=chunks)
        except Exception:  # the worker issues every layer and reports what fails there
            return None  # (copies already enqueued repeat the same bytes; the stream gate stays the worker's)
        finally:
            release()
        return job

    def _issue_restore_layers(self, handle: _CudaHandle, planes: KVPlanes, ids: list[int], pages: _Pages,
                              moved: range, dplan: _direct.DirectPlan = _direct.NO_PLAN,
                              pre: _LayerJob | None = None) -> None:
        """A layer-major restore: layer ``l`` of every page, then layer ``l + 1``; an event per layer.

        Direct runs (``dplan``) move layer ``l``'s planes by one 2D copy each.  Within a host page a
        layer's planes are adjacent, so layer ``l`` of a run of adjacent host pages is a pitched
        region (rows of the layer's bytes, ``page_nbytes`` apart): for the staged pages one
        ``cuMemcpy2DAsync`` moves it into layer-major staging, then the scatter kernel writes that
        layer's planes of those pages into their blocks.  Layer ``l``'s event is recorded behind its
        last copy (on the scatter stream when any page is staged, else on the DMA stream: the same
        stream for every layer), so stream order makes it imply every earlier layer.  ``pre``:
        :meth:`_inline_first_layer` began the transfer and issued layer ``moved.start``.
        """
        job = pre if pre is not None else self._layers_begin(handle, planes, ids, pages, moved, dplan)
        # (the first layer again when the caller issued only its first chunks: it goes on from there)
        done_first = pre is not None and job.resume_layer != moved.start
        rest = [lay for lay in moved if not (done_first and lay == moved.start)]
        self._layers_issue(job, planes, ids, dplan, rest)
        _cuda.check(_cuda.driver().cuEventRecord(job.done, job.last), "cuEventRecord")

    def _layers_begin(self, handle: _CudaHandle, planes: KVPlanes, ids: list[int], pages: _Pages, moved: range,
                      dplan: _direct.DirectPlan, prestaged: _Prestaged | None = None) -> _LayerJob:
        d = _cuda.driver()
        dev = self._dev
        spans = _layer_spans(planes.layout)
        dma, scatter = self._streams["restore_dma"], self._streams["restore_scatter"]
        start = prestaged.take_start() if prestaged is not None else None
        recorded = start is not None  # (prestage() recorded it before its copies)
        start, done = (start if recorded else dev.event(timing=True)), dev.event(timing=True)
        # One event per layer moved, indexed by layer: the first now, the others as their layers
        # are issued (creating 32 events up front delayed layer 0's first copy by ~0.25 ms).
        layer_evs: list[Any] = [None] * len(spans)
        layer_evs[moved.start] = dev.event(timing=True)
        handle._set_events(start, done, layer_evs)
        if handle._recorded is None:
            handle._recorded = [threading.Event() for _ in spans]
        if not recorded:
            _cuda.check(d.cuEventRecord(start, dma), "cuEventRecord")
        ids_s, pages_s = _subset(ids, pages, dplan.rest) if dplan.runs else (ids, pages)
        staged = bool(ids_s) and self.mode == "kernel"
        table = None
        if staged:
            table = self._table(planes, layers=True)
            _cuda.check(d.cuStreamWaitEvent(scatter, table.event, 0), "cuStreamWaitEvent(table)")
        job = _LayerJob(handle, spans, layer_evs, done, ids_s, pages_s,
                        _page_addresses(pages_s) if staged else None, table, scatter if staged else dma)
        if prestaged is not None and staged:
            job.runs = prestaged.runs
            job.prestaged = {(moved.start, c0, c1): slot for c0, c1, slot in prestaged.chunks}
        return job

    def _layers_issue(self, job: _LayerJob, planes: KVPlanes, ids: list[int], dplan: _direct.DirectPlan,
                      layers: list[int], chunks: int | None = None) -> None:
        """Issue ``layers`` (in order) of a layer-major restore begun by :meth:`_layers_begin`.

        ``chunks``: issue only that many staged chunks of the first of ``layers`` (its direct runs
        too) and stop there, its event not recorded yet; a later call for that layer goes on from
        there (``job.resume_layer`` / ``job.resume_at``)."""
        d = _cuda.driver()
        layout = planes.layout
        P = layout.page_nbytes
        dma, scatter = self._streams["restore_dma"], self._streams["restore_scatter"]
        ids_s, pages_s, addresses = job.ids_s, job.pages_s, job.addresses
        n = len(ids_s)
        for layer in layers:
            ev = job.layer_evs[layer]
            if ev is None:
                ev = job.layer_evs[layer] = self._dev.event(timing=True)
            span = job.spans[layer]
            p0, np_, lo, nb = span
            resumed = layer == job.resume_layer
            start_at = job.resume_at if resumed else 0
            if dplan.runs and not resumed:  # before the staged chunks on the DMA stream: their events imply these
                # (2D runs of direct="auto"/"always": a layer-wise restore never has a batch plan)
                _direct.issue(d, planes, ids, dplan, layout.planes[p0: p0 + np_], dma, to_device=True)
            if job.table is None:  # memcpy mode (or every page direct): one copy per slice, on the DMA stream
                for spec in layout.planes[p0: p0 + np_]:
                    for b, page in zip(ids_s, pages_s, strict=True):
                        dst = planes.ptrs[spec.index] + b * planes.block_strides[spec.index]
                        for off, addr, m in _segments(page, spec.offset, spec.nbytes):
                            _cuda.check(d.cuMemcpyHtoDAsync(dst + off - spec.offset, addr, m, dma),
                                        "cuMemcpyHtoDAsync")
            else:
                per = self._per_chunk(nb)
                for c0 in range(start_at, n, per):
                    if chunks is not None:
                        if not chunks:  # the caller's share of this layer is issued: the worker goes on
                            job.resume_layer, job.resume_at = layer, c0
                            return
                        chunks -= 1
                    c1 = min(n, c0 + per)
                    s_pre = job.prestaged.pop((layer, c0, c1), None) if job.prestaged else None
                    if s_pre is not None:  # loaded by prestage() before the ids were checked
                        s = s_pre
                    elif addresses is not None:
                        s = self._stage_layer_chunk(d, job.runs, addresses, c0, c1, span, P)
                    else:  # pages in several regions: the layer's bytes piece by piece
                        assert not isinstance(pages_s, HostPages)
                        s = self._take_slot("restore", d, dma)
                        staging = self._staging["restore"][s]
                        for j in range(c0, c1):
                            for off, addr, m in _segments(pages_s[j], lo, nb):
                                _cuda.check(d.cuMemcpyHtoDAsync(staging + (j - c0) * nb + off - lo, addr, m, dma),
                                            "cuMemcpyHtoDAsync")
                        _cuda.check(d.cuEventRecord(self._slot_events["restore"][s][0], dma), "cuEventRecord")
                    staging = self._staging["restore"][s]
                    loaded, freed = self._slot_events["restore"][s]
                    _cuda.check(d.cuStreamWaitEvent(scatter, loaded, 0), "cuStreamWaitEvent")
                    self._launch(self._scatter_fn, job.table, planes, ids_s[c0:c1], staging, scatter, span)
                    _cuda.check(d.cuEventRecord(freed, scatter), "cuEventRecord")
            _cuda.check(d.cuEventRecord(ev, job.last), "cuEventRecord")
            job.handle._set_recorded(layer)  # layer l's event is recorded: its waiters may use it now
