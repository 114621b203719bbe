"""The CPU copy engine: the same contract for planes in host memory (tests without a GPU)."""

from __future__ import annotations

import bisect
import ctypes
import time
from collections.abc import Iterator, Sequence
from typing import Any

from hostkv_providers._errors import (
    CopyArgumentError,
)
from hostkv_providers._layout import PlaneSpec
from hostkv_providers._region import HostPages
from hostkv_providers.device._engine import (
    CopyEngine,
    _check_distinct,
    _check_ids,
    _check_layers,
    _check_pages,
    _Page,
    _Pages,
)
from hostkv_providers.device._order import Gate, HostStream, StreamMark, _HostGate, _HostMark, _NoGate, _Worker
from hostkv_providers.device._planes import KVPlanes
from hostkv_providers.device._transfer import TransferHandle, _CpuHandle


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
                before: Any = None, layerwise: bool = False, layers: range | None = None) -> TransferHandle:
        self._check_open()
        self._check_planes(planes)
        if planes.readonly:
            raise CopyArgumentError("restore into read-only planes")
        ids = _check_ids(planes, block_ids)
        _check_distinct(ids)
        pages = _check_pages(planes.layout, src, len(ids), writable=False)
        moved = _check_layers(planes.layout, layerwise, layers)
        gate = self.gate(before)
        handle = self._submit("restore", planes, ids, pages, src, moved=moved, limited=layers is not None)
        gate.open_after([handle])
        return handle

    def _submit(self, direction: str, planes: KVPlanes, ids: list[int], pages: _Pages, keep: object,
                wait_for: StreamMark | None = None, moved: range | None = None,
                limited: bool = False) -> TransferHandle:
        handle = _CpuHandle(len(ids) * planes.layout.page_nbytes, planes.layout.num_layers, moved is not None)
        if limited and moved is not None:
            handle.layers = moved
            handle.nbytes = len(ids) * sum(s.nbytes for s in planes.layout.planes if s.layer in moved)
        gather = direction == "save"

        def job() -> None:
            _ = keep  # the host buffers stay alive until the copy ran
            try:
                if wait_for is not None:
                    wait_for.wait_in(None)
                t0 = time.perf_counter()
                if moved is not None:
                    specs = planes.layout.planes
                    for layer in moved:
                        _host_copy(planes, ids, pages, gather, [s for s in specs if s.layer == layer])
                        handle._set(layer)
                else:
                    _host_copy(planes, ids, pages, gather)
                handle._seconds = time.perf_counter() - t0
                handle._set(None)
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


def _host_copy(planes: KVPlanes, ids: list[int], pages: _Pages, gather: bool,
               specs: Sequence[PlaneSpec] | None = None) -> None:
    """Move plane slices (``specs``: those planes only) between host planes and host pages with
    ``memmove`` (GIL released)."""
    memmove = ctypes.memmove
    specs = planes.layout.planes if specs is None else specs
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
