"""The CUDA copy engine's copies of a save and of a whole restore (a part of
:class:`~._cuda_engine.CudaCopyEngine`, issued on its worker threads): direct runs first (batch or
2D copies, :mod:`._direct`), the rest through the staging slots (the pack kernel and large DMA
copies, or one copy per slice in ``memcpy`` mode), and a ``direct="shared"`` restore, shared
between the side thread's batch copies and the staging path."""

from __future__ import annotations

from typing import Any

from hostkv_providers._errors import CopyEngineError
from hostkv_providers.device import _cuda, _direct
from hostkv_providers.device._cpu_engine import _segments
from hostkv_providers.device._cuda_staging import _CudaBase, _subset
from hostkv_providers.device._cuda_sync import _CudaHandle
from hostkv_providers.device._engine import _Pages
from hostkv_providers.device._planes import KVPlanes


class _CudaIssue(_CudaBase):
    """A save's and a whole restore's copies (a part of :class:`~._cuda_engine.CudaCopyEngine`)."""

    def _issue_save(self, handle: _CudaHandle, planes: KVPlanes, ids: list[int], pages: _Pages,
                    after_ev: Any, dplan: _direct.DirectPlan = _direct.NO_PLAN) -> None:
        d = _cuda.driver()
        dev = self._dev
        pack, dma = self._streams["save_pack"], self._streams["save_dma"]
        start, done = dev.event(timing=True), dev.event(timing=True)
        handle._set_events(start, done)
        first = dma if self.mode == "memcpy" or dplan.runs else pack
        if after_ev is not None:  # the mark owns the event (destroyed with it)
            _cuda.check(d.cuStreamWaitEvent(first, after_ev, 0), "cuStreamWaitEvent(after)")
            if first is not pack and self.mode != "memcpy":
                _cuda.check(d.cuStreamWaitEvent(pack, after_ev, 0), "cuStreamWaitEvent(after)")
        _cuda.check(d.cuEventRecord(start, first), "cuEventRecord")
        layout = planes.layout
        if dplan.runs:  # straight from the blocks into the host pages, then the rest staged
            _direct.issue(d, planes, ids, dplan, layout.planes, dma, to_device=False,
                          side=self._sides.get("save"))
            ids, pages = _subset(ids, pages, dplan.rest)
        if self.mode == "memcpy":
            for b, page in zip(ids, pages, strict=True):
                for spec in layout.planes:
                    src = planes.ptrs[spec.index] + b * planes.block_strides[spec.index]
                    for off, addr, n in _segments(page, spec.offset, spec.nbytes):
                        _cuda.check(d.cuMemcpyDtoHAsync(addr, src + off - spec.offset, n, dma), "cuMemcpyDtoHAsync")
        elif ids:
            table = self._table(planes)
            _cuda.check(d.cuStreamWaitEvent(pack, table.event, 0), "cuStreamWaitEvent(table)")
            for lo, hi in self._chunks(len(ids), layout.page_nbytes):
                s = self._take_slot("save", d, pack)  # (its DMA out of the slot done)
                staging = self._staging["save"][s]
                packed, freed = self._slot_events["save"][s]
                self._launch(self._gather_fn, table, planes, ids[lo:hi], staging, pack)
                _cuda.check(d.cuEventRecord(packed, pack), "cuEventRecord")
                _cuda.check(d.cuStreamWaitEvent(dma, packed, 0), "cuStreamWaitEvent")
                for off, addr, n in self._coalesce(pages, lo, hi, layout.page_nbytes):
                    _cuda.check(d.cuMemcpyDtoHAsync(addr, staging + off, n, dma), "cuMemcpyDtoHAsync")
                _cuda.check(d.cuEventRecord(freed, dma), "cuEventRecord")
        _cuda.check(d.cuEventRecord(done, dma), "cuEventRecord")

    def _issue_restore(self, handle: _CudaHandle, planes: KVPlanes, ids: list[int], pages: _Pages,
                       dplan: _direct.DirectPlan = _direct.NO_PLAN) -> None:
        d = _cuda.driver()
        dev = self._dev
        dma, scatter = self._streams["restore_dma"], self._streams["restore_scatter"]
        start, done = dev.event(timing=True), dev.event(timing=True)
        handle._set_events(start, done)
        _cuda.check(d.cuEventRecord(start, dma), "cuEventRecord")
        layout = planes.layout
        arrays = self._shared_copies(planes, dplan)
        if arrays is not None:
            self._issue_shared(planes, ids, pages, arrays, dma, scatter, done)
            return
        if dplan.runs:  # straight into the blocks first (the staged chunks' events then imply them)
            _direct.issue(d, planes, ids, dplan, layout.planes, dma, to_device=True,
                          side=self._sides.get("restore"))
            ids, pages = _subset(ids, pages, dplan.rest)
        if not ids or self.mode == "memcpy":
            for b, page in zip(ids, pages, strict=True):
                for spec in layout.planes:
                    dst = planes.ptrs[spec.index] + b * planes.block_strides[spec.index]
                    for off, addr, n in _segments(page, spec.offset, spec.nbytes):
                        _cuda.check(d.cuMemcpyHtoDAsync(dst + off - spec.offset, addr, n, dma), "cuMemcpyHtoDAsync")
            # ``done`` on the scatter stream, as every staged or shared restore records it (behind
            # this one's copies by a tail event): a restore whose pages all went direct must not
            # complete before an earlier one's scatter (one direction's transfers complete in
            # submission order, which the cache's handle events rely on), and the copies of the
            # next restore on the DMA stream are not held back by it
            tail = self._restore_tail
            _cuda.check(d.cuEventRecord(tail, dma), "cuEventRecord(tail)")
            _cuda.check(d.cuStreamWaitEvent(scatter, tail, 0), "cuStreamWaitEvent(tail)")
            _cuda.check(d.cuEventRecord(done, scatter), "cuEventRecord")
            return
        table = self._table(planes)
        _cuda.check(d.cuStreamWaitEvent(scatter, table.event, 0), "cuStreamWaitEvent(table)")
        for lo, hi in self._chunks(len(ids), layout.page_nbytes):
            s = self._take_slot("restore", d, dma)  # (its scatter out of the slot done)
            staging = self._staging["restore"][s]
            loaded, freed = self._slot_events["restore"][s]
            for off, addr, n in self._coalesce(pages, lo, hi, layout.page_nbytes):
                _cuda.check(d.cuMemcpyHtoDAsync(staging + off, addr, n, dma), "cuMemcpyHtoDAsync")
            _cuda.check(d.cuEventRecord(loaded, dma), "cuEventRecord")
            _cuda.check(d.cuStreamWaitEvent(scatter, loaded, 0), "cuStreamWaitEvent")
            self._launch(self._scatter_fn, table, planes, ids[lo:hi], staging, scatter)
            _cuda.check(d.cuEventRecord(freed, scatter), "cuEventRecord")
        _cuda.check(d.cuEventRecord(done, scatter), "cuEventRecord")

    def _shared_copies(self, planes: KVPlanes, dplan: _direct.DirectPlan) -> tuple[Any, ...] | None:
        """The batch copies of a ``direct="shared"`` restore that the staging path shares
        (:class:`~._direct.Claims`): one of at least :data:`~._direct.BATCH_SPLIT_MIN` copies, with
        the scatter kernel and the restore side thread there; ``None`` for any other (those go as
        ``direct="batch"`` moves them, as every save does)."""
        if not self.shares_restores or dplan.ids is None or dplan.addresses is None:
            return None
        groups = len(_direct.copy_groups(planes.ptrs, planes.block_strides, planes.layout.planes,
                                         blocks=planes.num_blocks)[3])
        if groups * len(dplan.ids) < _direct.BATCH_SPLIT_MIN:  # (an upper bound: no arrays built twice)
            return None
        arrays = _direct.batch_copies(planes.ptrs, planes.block_strides, planes.layout.planes, dplan.ids,
                                      dplan.addresses, to_device=True, blocks=planes.num_blocks)
        return arrays if arrays[2].size >= _direct.BATCH_SPLIT_MIN else None

    def _issue_shared(self, planes: KVPlanes, ids: list[int], pages: _Pages, arrays: tuple[Any, ...],
                      dma: Any, scatter: Any, done: Any) -> None:
        """A ``direct="shared"`` restore shared with the staging path (:class:`~._direct.Claims`):
        the side thread issues batch copies of pages from the back on its stream (forked off
        ``dma`` here: behind the transfer's start); this thread stages chunks from the front (H2D
        into a staging slot on ``dma``, the scatter kernel on ``scatter``), each once the GPU has
        caught up with the side's copies, with at most two staged chunks queued ahead of the
        link.  ``done`` is recorded on ``scatter`` behind both."""
        d = _cuda.driver()
        side = self._sides["restore"]
        P = planes.layout.page_nbytes
        n = len(ids)
        claims = _direct.Claims(n)
        fn = _cuda.batch_memcpy()
        assert fn is not None
        _cuda.check(d.cuEventRecord(side.fork, dma), "cuEventRecord(fork)")
        wait = side.start(_direct.shared_side(d, fn, arrays, int(arrays[2].size) // n, claims, side),
                          on_exit=claims.side_finished)
        errors: list[BaseException] = []
        try:
            table = self._table(planes)
            _cuda.check(d.cuStreamWaitEvent(scatter, table.event, 0), "cuStreamWaitEvent(table)")
            per = self._per_chunk(P)
            events = self._slot_events["restore"]
            while True:
                _direct.side_lagging(d, claims, side)
                lo, hi = claims.front(per)
                if hi <= lo:
                    break
                # the slot's last chunk off the link first: at most two staged chunks queued, so
                # the claims follow the GPU's progress
                _cuda.check(d.cuEventSynchronize(events[self._slot["restore"]][0]), "cuEventSynchronize(slot)")
                s = self._take_slot("restore", d, dma)
                staging = self._staging["restore"][s]
                loaded, freed = events[s]
                for off, addr, nb in self._coalesce(pages, lo, hi, P):
                    _cuda.check(d.cuMemcpyHtoDAsync(staging + off, addr, nb, dma), "cuMemcpyHtoDAsync")
                _cuda.check(d.cuEventRecord(loaded, dma), "cuEventRecord")
                _cuda.check(d.cuStreamWaitEvent(scatter, loaded, 0), "cuStreamWaitEvent")
                self._launch(self._scatter_fn, table, planes, ids[lo:hi], staging, scatter)
                _cuda.check(d.cuEventRecord(freed, scatter), "cuEventRecord")
        except BaseException as exc:
            claims.close()
            errors.append(exc)
        side.join_into(wait, scatter, errors)
        try:
            _cuda.check(d.cuEventRecord(done, scatter), "cuEventRecord")
        except CopyEngineError as exc:
            errors.append(exc)
        self.shared_pages[0] += claims.taken[0]
        self.shared_pages[1] += claims.taken[1]
        if errors:
            raise errors[0]
