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
the call); a restore orders the ``before`` stream behind its copies, so every kernel queued there
after the call sees the restored bytes: the CUDA engine waits until the worker has issued them,
then the stream waits on their event (with ``stream_gates=True`` it gates the stream at the call
instead, :meth:`CopyEngine.gate`: a wait on a device-visible flag set behind the copies, with the
caveat :class:`CudaCopyEngine` documents); the host engine gates its host stream.  Nothing here ever
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

from hostkv_providers._errors import (
    CopyArgumentError,
)
from hostkv_providers.device import _cuda
from hostkv_providers.device._cpu_engine import CpuCopyEngine
from hostkv_providers.device._cuda_engine import CudaCopyEngine
from hostkv_providers.device._engine import CopyEngine
from hostkv_providers.device._order import Gate, HostStream, StreamMark
from hostkv_providers.device._planes import KVPlanes, cuda_available, page_regions
from hostkv_providers.device._transfer import TransferHandle

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


def default_copy_engine(device: int | None = None) -> CopyEngine:
    """A :class:`CudaCopyEngine` on ``device`` (default 0) when CUDA is usable, else a :class:`CpuCopyEngine`."""
    if _cuda.available():
        return CudaCopyEngine(0 if device is None else device)
    return CpuCopyEngine()
