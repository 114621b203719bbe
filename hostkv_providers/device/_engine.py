"""The copy-engine contract (:class:`CopyEngine`) and the request validation both engines share."""

from __future__ import annotations

import abc
import os
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from hostkv_providers._errors import (
    ClosedError,
    CopyArgumentError,
    UsedAfterForkError,
)
from hostkv_providers._layout import KVLayout
from hostkv_providers._region import HostPages, HostRegion
from hostkv_providers.device._order import Gate, StreamMark, _NoGate
from hostkv_providers.device._planes import KVPlanes
from hostkv_providers.device._transfer import TransferHandle

# ============================================================================================
# Request validation (shared by both engines)
# ============================================================================================


# One host page of a request: its regions as parallel (offsets, addresses, sizes) tuples.  A plain
# tuple, not a dataclass: a 4,096-page request builds 4,096 of them on the caller's thread.
_Page = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]
# A request's host pages: per-page tuples, or one HostPages (chunk-level, no per-page objects).
_Pages = list[_Page] | HostPages


class BlockIds(list[int]):
    """Block ids the caller already checked: plain ints in ``[0, bound)`` (``HostKVCache`` checks
    every restore's and save's ids once; the engine then takes them as they are instead of
    checking 6,400 of them again on the engine's thread)."""

    __slots__ = ("bound", "distinct")

    def __init__(self, ids: list[int], bound: int, *, distinct: bool = False) -> None:
        super().__init__(ids)
        self.bound = bound
        self.distinct = distinct  # the caller found no repeated id (a restore skips its own check)


def _check_ids(planes: KVPlanes, block_ids: Sequence[int]) -> list[int]:
    if type(block_ids) is BlockIds and block_ids.bound <= planes.num_blocks:
        return block_ids
    # Fast path (C-level loops only): a list or range of plain ints, the common case; a restore
    # of 6,400 pages otherwise spends about a millisecond here, holding the GIL.
    if isinstance(block_ids, range) or (isinstance(block_ids, list) and set(map(type, block_ids)) <= {int}):
        ids = list(block_ids)
        if not ids or (min(ids) >= 0 and max(ids) < planes.num_blocks):
            return ids
    # Integers only, in an ordered container: int(1.7) or int("2") picked a block, np.True_
    # block 1, and a set's order is not the caller's (pages saved from the wrong blocks).
    if isinstance(block_ids, np.ndarray):
        if block_ids.ndim != 1 or block_ids.dtype.kind not in "iu":
            raise CopyArgumentError(f"block_ids must be a 1-D integer array, got {block_ids.dtype} "
                                    f"with {block_ids.ndim} dimensions")
        raws: list[Any] = block_ids.tolist()
    elif isinstance(block_ids, Sequence) and not isinstance(block_ids, (str, bytes, bytearray)):
        raws = list(block_ids)
    else:
        raise CopyArgumentError(f"block_ids must be a sequence of ints, got {type(block_ids).__name__}")
    ids = []
    for raw in raws:
        if isinstance(raw, (bool, np.bool_)) or not isinstance(raw, (int, np.integer)):
            raise CopyArgumentError(f"block ids must be ints, got {raw!r}")
        b = int(raw)
        if not 0 <= b < planes.num_blocks:
            raise CopyArgumentError(f"block id {raw!r} is outside [0, {planes.num_blocks})")
        ids.append(b)
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
    if isinstance(pages, (bytes, bytearray, memoryview, HostRegion)) or not isinstance(pages, Sequence):
        raise CopyArgumentError("host pages must be a sequence with one entry (regions) per block id")
    if len(pages) != count:
        raise CopyArgumentError(f"{len(pages)} host pages given for {count} block ids")
    want = layout.page_nbytes
    out: list[_Page] = []
    append = out.append
    for i, regions in enumerate(pages):
        if type(regions) is not HostRegion:
            if not isinstance(regions, Sequence):
                raise CopyArgumentError(f"host page {i}: expected a HostRegion or a sequence of them, "
                                        f"got {type(regions).__name__}")
            if len(regions) == 1:
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
                before: Any = None, layerwise: bool = False, layers: range | None = None) -> TransferHandle:
        """Scatter host page ``src[i]`` into block ``block_ids[i]`` of every plane.

        ``before``: a compute stream that must not run past this point until the restore is
        complete; it is gated at the call (:meth:`gate`) and opened behind the copies, with no
        host blocking.  ``src`` may be a :class:`~hostkv_providers.device.HostPages`.  Block ids
        must be distinct (two writes to one block race).

        ``layerwise``: move layer 0 of every page first, then layer 1, ... and complete each
        layer on its own (:meth:`TransferHandle.layer_event`, :meth:`~TransferHandle.wait_layer_on`),
        so an engine's layer ``i`` waits for layer ``i``'s bytes only.  ``before`` still orders
        the stream behind the whole restore.  Without it every layer completes with the whole
        transfer (page-major order, the fastest for a restore nobody waits on per layer).

        ``layers``: a ``range`` of layers; only their planes are written (layer by layer, as
        with ``layerwise``), the others' bytes in the blocks are left as they are.  A restore of
        many pages can so be split into layer 0 of each part as soon as the part's pages are at
        hand, then the other layers of all of them (``HostKVCache.restore(layerwise=True)``).
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


def _check_layers(layout: KVLayout, layerwise: object, layers: object) -> range | None:
    """Validate ``restore(layerwise=, layers=)``; the layers to move (``None``: all, page-major)."""
    if not isinstance(layerwise, bool):
        raise CopyArgumentError(f"layerwise must be a bool, got {layerwise!r}")
    if layers is None:
        return range(layout.num_layers) if layerwise else None
    if not isinstance(layers, range) or layers.step != 1 or not 0 <= layers.start < layers.stop <= layout.num_layers:
        raise CopyArgumentError(f"layers must be a non-empty range(a, b) within [0, {layout.num_layers}), "
                                f"got {layers!r}")
    return layers


def _check_distinct(ids: Sequence[int]) -> None:
    if type(ids) is BlockIds and ids.distinct:
        return
    if len(set(ids)) != len(ids):
        raise CopyArgumentError("restore block ids must be distinct (two pages would race for one block)")
