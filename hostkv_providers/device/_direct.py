"""Kernel-free copies for :class:`~hostkv_providers.device.CudaCopyEngine`: DMA straight between
host pages and the engine's blocks where both sides run in order.

A run of pages whose block ids are consecutive and whose host pages are adjacent is, for every
plane, one pitched region on each side: rows of the plane's slice bytes, ``page_nbytes`` apart on
the host and the plane's block stride apart on the device.  One ``cuMemcpy2DAsync`` per plane
moves the whole run — no staging buffer, no pack kernel, so no streaming multiprocessor and no
L2 traffic of the engine's is taken.  Measured on the H200 (32 KiB slices, 2 MiB pages into
consecutive blocks), a trade: a captured decode step beside back-to-back restores runs at
1.00-1.02x of its time alone (1.05-1.08x beside the staging path, whose scatter kernel shares
the SMs), but 2D rows of 32 KiB read from host memory move slower than staged bulk copies: 6,400
pages from one 13 GB buffer at 0.99x of a bulk copy, from the pinned arena's 256 MiB chunks
(runs of 128 pages) at 0.93-0.94x against 0.97-0.98x staged, saves at 0.82x against 0.93x.
Pages outside such runs keep the staging path.

``direct="batch"`` (the engine's default) moves *every* page directly, in any block order: one copy
descriptor per (page, run of adjacent planes), handed to ``cuMemcpyBatchAsync`` (CUDA 12.8+
drivers) a few thousand at a time.  The copy engines do it all, so no SM is shared with the
engine's kernels and no staging buffer is used.  Another trade, measured on the H200 (2 MiB pages
of 64 x 32 KiB slices): a graph-captured decode step beside back-to-back restores or saves runs at
1.00-1.03x of its time alone, shuffled blocks included (1.03-1.08x beside the staging path's
kernels).  The driver spends ~0.5 us of host time per copy (409,600 copies for a 13.4 GB chain),
so a large call is issued by two threads on two streams (:class:`BatchSide`): through
``HostKVCache`` restores then run at 0.93-0.96x of a bulk copy (0.69x from one thread), saves at
0.84-0.94x (the figure moves between runs).  Engines whose K and V of a block are adjacent have
half the copies (:func:`copy_groups`): restores at 0.97x, saves at 0.95x.  Layer-wise restores
stay on the staging path (:func:`stages_all`).  It needs every page in one region (a page in
several pieces takes the staging path) and copies of at least ``DIRECT_BATCH_MIN_SLICE`` (the
slices, or adjacent slices merged; shorter copies are slower still, those layouts keep the
staging path).

``direct="shared"`` plans as ``"batch"`` does, then shares a restore of at least
:data:`BATCH_SPLIT_MIN` copies with the staging path (:class:`Claims`, :func:`shared_side`,
:func:`side_lagging`): the driver's host time per copy was measured at 0.56-1.1 us from one
restore to the next (session 17), and at its worst restores ran at 0.39-0.46x of a bulk copy
(~3 us per copy, inferred); shared, the staging path fills the link whenever the batch copies
fall behind it.  Saves are not shared (their batch copies were not seen to slow down).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from hostkv_providers._errors import CopyArgumentError, CopyEngineError
from hostkv_providers._region import HostPages, HostRegion
from hostkv_providers.device import _cuda
from hostkv_providers.device._hostmem import registration_starts
from hostkv_providers.device._order import _Worker
from hostkv_providers.device._planes import _layer_spans

#: ``direct="auto"``: a run moves directly from this many bytes on (its ``num_planes`` copies are
#: issued in ~10 us each; below this the staging path's one kernel per chunk is cheaper to issue).
DIRECT_MIN_RUN_BYTES = 16 << 20
#: ``direct="auto"``: and only when every plane slice is at least this long (the 2D DMA moves
#: ``slice`` bytes per row; measured at 32 KiB rows; short rows are left to the staging path).
DIRECT_MIN_SLICE = 8 << 10

#: ``direct="batch"``: used only when every copy (a plane slice, or adjacent slices merged by
#: :func:`copy_groups`) is at least this long.  Copies of 32 KiB were measured at 0.95-0.98x of a
#: bulk copy (one issuing thread, the copy engine alone); vLLM measured a cliff below ~28 KiB for
#: host -> device batch copies (vllm-project/vllm#42212), so shorter copies keep the staging path.
DIRECT_BATCH_MIN_SLICE = 32 << 10
#: ``direct="batch"``: copy descriptors per driver call (each call is ~0.5 us of driver time per
#: copy with the GIL released; a bound keeps the first copies starting early).
BATCH_MAX_COPIES = 8192
#: ``direct="batch"``: the first driver call of an issue carries this many copies, and each next
#: call twice as many up to :data:`BATCH_MAX_COPIES`: the copies of a call start moving only once
#: the call returns, so a full first call would leave the link idle for its whole driver time.
BATCH_FIRST_COPIES = 128
#: ``direct="batch"``: a call of at least this many copies is split in two halves, one issued by
#: the calling thread, the other at once by the direction's :class:`BatchSide` thread on its own
#: stream.  The driver's time per copy is host time on the issuing thread: measured on the H200
#: (3.4 GB of 32 KiB slices into shuffled blocks), one thread issued it in 87-89 ms host -> device
#: and 79-83 ms device -> host, two in 67-70 and 68-69 ms (a bulk copy: 61 ms); three, four or six
#: threads gained nothing more.  The threshold itself is a choice, not a measurement: 4,096 copies
#: are ~2 ms of driver time, well above what handing half of them to a waiting thread costs.
BATCH_SPLIT_MIN = 4096
#: ``direct="shared"``: a restore of at least :data:`BATCH_SPLIT_MIN` copies is shared with the
#: staging path (:class:`Claims`): the side thread claims pages from the back for batch copies,
#: first this many copies' worth, each next claim twice as many up to :data:`SHARED_MAX_COPIES`
#: (a claim's driver call is host time, ~0.5-3 us per copy: small claims keep the staging path's
#: view of its progress fresh and the tail after the two meet short).
SHARED_FIRST_COPIES = 128
SHARED_MAX_COPIES = 4096

DIRECT_MODES = ("batch", "shared", "auto", "always", "never")


def check_direct(direct: object) -> str:
    if direct not in DIRECT_MODES:
        raise CopyArgumentError(f"direct must be one of {', '.join(map(repr, DIRECT_MODES))}, got {direct!r}")
    return str(direct)


def batch_usable(layout: Any, planes: Any = None) -> bool:
    """Whether ``direct="batch"`` moves pages of ``layout``: a driver with ``cuMemcpyBatchAsync``,
    and copies of at least :data:`DIRECT_BATCH_MIN_SLICE` — the plane slices, or given the engine's
    ``planes`` the copies :func:`copy_groups` makes of each layer's slices (16 KiB K and V slices
    adjacent in every block are 32 KiB copies).  Per layer: a lower bound on the whole page's
    copies, which may merge across layers too."""
    if _cuda.batch_memcpy() is None:
        return False
    if planes is None:
        return bool(min(spec.nbytes for spec in layout.planes) >= DIRECT_BATCH_MIN_SLICE)
    return _shortest_copy(layout, planes.ptrs, planes.block_strides, planes.num_blocks) >= DIRECT_BATCH_MIN_SLICE


@functools.lru_cache(maxsize=64)
def _shortest_copy(layout: Any, ptrs: tuple[int, ...], strides: tuple[int, ...], blocks: int) -> int:
    """The shortest batch copy of a layer of ``layout`` on these planes (asked per transfer, the
    same planes every time: remembered; the walk over 64 planes costs ~0.1 ms of Python)."""
    return min(int(copy_groups(ptrs, strides, layout.planes[p0: p0 + k], blocks=blocks)[3].min())
               for p0, k, _lo, _nb in _layer_spans(layout))


def stages_all(mode: str) -> bool:
    """Whether an engine in direct ``mode`` stages every page of a layer-wise restore (then its
    first chunks may be prestaged): ``"never"``, and ``"batch"``, whose batch copies are for whole
    pages only — a layer of a 6,400-page hit is 6,400 or more copies of ~0.5 us of driver time
    each, so layer 0 took 11.7-14.7 ms by batch copies against 8.5-8.9 ms staged (H200, 13.4 GB
    hit, session 12)."""
    return mode in ("never", "batch")


def pages_pinned(pages: Any) -> bool:
    """Whether a transfer's host pages all say they are page-locked: ``HostPages.pinned``, or the
    ``pinned`` of every ``HostRegion`` (a page given as one region or a sequence of them).  An
    lmdb store's views are its mapped files (pageable); a cache's bounce buffers are pinned."""
    if isinstance(pages, HostPages):
        return bool(pages.pinned)
    for regions in pages:
        for region in (regions,) if type(regions) is HostRegion else regions:
            if not getattr(region, "pinned", False):
                return False
    return True


class DirectPlan:
    """How the pages of one transfer split: ``runs`` of ``(first page, pages)`` moved directly,
    ``rest`` the indices of the pages left to the staging path (``None``: no page is direct).
    ``ids`` (``direct="batch"``): the block ids as an array; every page is then one run moved by
    batch copies whatever the block order."""

    __slots__ = ("addresses", "ids", "rest", "runs")

    def __init__(self, runs: list[tuple[int, int]], rest: npt.NDArray[np.int64] | None,
                 addresses: npt.NDArray[np.uint64] | None, ids: npt.NDArray[np.uint64] | None = None) -> None:
        self.runs = runs
        self.rest = rest
        self.addresses = addresses
        self.ids = ids

    @property
    def all_direct(self) -> bool:
        return bool(self.runs) and self.rest is not None and not self.rest.size


NO_PLAN = DirectPlan([], None, None)


def plan(mode: str, layout: Any, ids: list[int], addresses: npt.NDArray[np.uint64] | None, *,
         pinned: bool = True, planes: Any = None) -> DirectPlan:
    """Split pages ``0..len(ids)`` into direct runs and the rest (numpy: no per-page objects).

    ``addresses``: the host pages' start addresses (``None`` when a page is in several pieces:
    nothing is direct).  A run breaks where a block id is not its predecessor's plus one, where a
    host page does not follow its predecessor, or where a host page starts another pinned
    allocation (a DMA must not cross from one registration into the next).  ``planes``: the
    engine's planes, whose adjacent slices batch copies merge (:func:`batch_usable`)."""
    n = len(ids)
    if mode == "never" or addresses is None or not n:
        return NO_PLAN
    if mode == "batch":
        # (``pinned=False``: pages the caller says are pageable; batch copies from them would be
        # staged by the driver copy by copy, the engine's staging path moves them in bulk)
        if not pinned or not batch_usable(layout, planes):
            return NO_PLAN
        return DirectPlan([(0, n)], np.empty(0, np.int64), addresses, np.asarray(ids, dtype=np.uint64))
    P = layout.page_nbytes
    if mode == "auto":
        if min(spec.nbytes for spec in layout.planes) < DIRECT_MIN_SLICE:
            return NO_PLAN
        min_pages = max(1, -(-DIRECT_MIN_RUN_BYTES // P))
    else:
        min_pages = 1
    if n < min_pages:
        return NO_PLAN
    idv = np.asarray(ids, dtype=np.int64)
    brk = np.ones(n, dtype=bool)
    if n > 1:
        brk[1:] = (idv[1:] != idv[:-1] + 1) | (addresses[1:] != addresses[:-1] + np.uint64(P))
        brk[1:] |= registration_starts(addresses[1:])
    first = np.flatnonzero(brk)
    lengths = np.diff(np.append(first, n))
    long = lengths >= min_pages
    if not long.any():
        return NO_PLAN
    runs = list(zip(first[long].tolist(), lengths[long].tolist(), strict=True))
    keep = np.ones(n, dtype=bool)
    for lo, k in runs:
        keep[lo : lo + k] = False
    return DirectPlan(runs, np.flatnonzero(keep), addresses)


def copy_groups(ptrs: Sequence[int], strides: Sequence[int], specs: Any, *, blocks: int
                ) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64], npt.NDArray[np.uint64],
                           npt.NDArray[np.uint64]]:
    """Planes ``specs`` merged where one copy can move several: ``(host offsets, device bases, block
    strides, bytes)``, one entry per run of planes that follow each other both in the host page
    and in every block (the next plane's slice starts where this one's ends, the same block
    stride).  An engine whose K and V of a block are adjacent (``[blocks, 2, ...]`` per layer) has
    half the copies; one whose whole block is contiguous (``[blocks, layers, 2, ...]``) one copy
    per page.  Planes of ``blocks`` blocks; with one block nothing is merged: adjacent slices of
    valid planes are one allocation only because the first plane's second block lies past the
    merged bytes, inside its memory (a copy must not span two allocations)."""
    offs: list[int] = []
    base: list[int] = []
    stride: list[int] = []
    size: list[int] = []
    for s in specs:
        p, st = ptrs[s.index], strides[s.index]
        if size and blocks > 1 and stride[-1] == st and offs[-1] + size[-1] == s.offset \
                and base[-1] + size[-1] == p and size[-1] + s.nbytes <= st:
            size[-1] += s.nbytes
            continue
        offs.append(s.offset)
        base.append(p)
        stride.append(st)
        size.append(s.nbytes)
    arr = [np.array(x, dtype=np.uint64) for x in (offs, base, stride, size)]
    return arr[0], arr[1], arr[2], arr[3]


def batch_copies(ptrs: Sequence[int], strides: Sequence[int], specs: Any, ids: npt.NDArray[np.uint64],
                 addresses: npt.NDArray[np.uint64], *, to_device: bool, blocks: int
                 ) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64], npt.NDArray[np.uint64]]:
    """``(dsts, srcs, sizes)`` of the batch copies moving planes ``specs`` of pages at host
    ``addresses`` to or from blocks ``ids`` (planes at ``ptrs``, ``strides`` bytes per block):
    one copy per (page, :func:`copy_groups` entry), page-major, so the host side is read or
    written in order (``blocks``: how many blocks the planes hold).  Arrays only: no Python object
    per copy."""
    offs, base, stride, size = copy_groups(ptrs, strides, specs, blocks=blocks)
    host = (addresses[:, None] + offs[None, :]).ravel()
    dev = (base[None, :] + ids[:, None] * stride[None, :]).ravel()
    sizes = np.broadcast_to(size[None, :], (len(ids), len(size))).ravel()
    return (dev, host, sizes) if to_device else (host, dev, sizes)


class BatchSide:
    """A second issuer for one direction's batch copies: a thread and a stream of its own, and the
    two events that fork the stream off the transfer's stream and join it back.

    Used under the direction's issue lock only (one transfer at a time), so the events are
    recorded again by each transfer: a stream wait takes the event's latest record at the call."""

    __slots__ = ("_closed", "_dev", "_worker", "fork", "join", "progress", "stream")

    def __init__(self, dev: Any, name: str) -> None:
        self._dev = dev
        self.stream = dev.stream()
        self.fork = dev.event()
        self.join = dev.event()
        # recorded after each claim of a shared restore (Claims; the restore side's only, the
        # save side never records it); the staging path's thread waits on it in a loop
        # (side_lagging): a blocking-sync event sleeps there instead of spinning
        self.progress = dev.event(blocking=True)
        self._worker = _Worker(name)
        self._closed = False

    def start(self, job: Callable[[], None], on_exit: Callable[[], None] | None = None
              ) -> Callable[[], BaseException | None]:
        """Run ``job`` on the side thread; the returned call waits for it and gives what it raised.
        ``on_exit`` runs on the side thread when it is done, also when ``job`` never ran (the
        thread could not take the device): what another thread waiting on the job's progress
        needs to stop waiting.  After :meth:`close` a :class:`CopyEngineError` (a job queued
        behind the stopped thread would never run, and its waiter would wait for ever)."""
        if self._closed:
            raise CopyEngineError("the copy engine is closed (its batch side thread is stopped)")
        done = threading.Event()
        failed: list[BaseException] = []

        def run() -> None:
            try:
                self._dev.activate()
                job()
            except BaseException as exc:  # handed to the issuing thread
                failed.append(exc)
            finally:
                try:
                    if on_exit is not None:
                        on_exit()
                finally:
                    done.set()

        if not self._worker.submit(run):  # closed since the check above: nothing queued
            raise CopyEngineError("the copy engine is closed (its batch side thread is stopped)")

        def wait() -> BaseException | None:
            done.wait()
            return failed[0] if failed else None

        return wait

    def join_into(self, wait: Callable[[], BaseException | None], stream: Any, errors: list[BaseException]) -> None:
        """After a job of :meth:`start`: wait for it (what it raised goes to ``errors``), then
        order ``stream`` behind the side's ``join`` record (the job records it last, also when it
        fails; a failure to order goes to ``errors`` too)."""
        failed = wait()
        if failed is not None:
            errors.append(failed)
        try:
            _cuda.check(_cuda.driver().cuStreamWaitEvent(stream, self.join, 0), "cuStreamWaitEvent(join)")
        except CopyEngineError as exc:
            errors.append(exc)

    def close(self, attempt: Callable[[Any, str], None]) -> None:
        """Stop the thread, then free the stream and events (``attempt`` reports a failed call)."""
        self._closed = True
        self._worker.stop()
        d = _cuda.driver()
        attempt(d.cuStreamSynchronize(self.stream), "cuStreamSynchronize")
        d.cuEventDestroy(self.fork)
        d.cuEventDestroy(self.join)
        d.cuEventDestroy(self.progress)
        attempt(d.cuStreamDestroy(self.stream), "cuStreamDestroy")


def _issue_copies(fn: _cuda._BatchCall, arrays: tuple[npt.NDArray[np.uint64], ...], lo: int, hi: int,
                  stream: int) -> None:
    """Copies ``[lo, hi)`` of ``arrays`` (dsts, srcs, sizes) on ``stream``: driver calls from
    :data:`BATCH_FIRST_COPIES` copies, doubling, at most :data:`BATCH_MAX_COPIES`."""
    dsts, srcs, sizes = (a.ctypes.data for a in arrays)
    at = lo
    step = max(1, min(BATCH_FIRST_COPIES, BATCH_MAX_COPIES))
    while at < hi:
        k = min(step, hi - at)
        off = 8 * at  # (byte offset into each uint64 array: no slice objects, no copies)
        err = fn(dsts + off, srcs + off, sizes + off, k, stream)
        if err:
            raise CopyEngineError(f"cuMemcpyBatchAsync failed: {_cuda.error_text(err)}")
        at += k
        step = min(2 * step, BATCH_MAX_COPIES)


def issue_batch(planes: Any, dplan: DirectPlan, specs: Any, stream: Any, *, to_device: bool,
                side: BatchSide | None = None) -> None:
    """Enqueue planes ``specs`` of every page of a ``direct="batch"`` plan on ``stream`` by
    ``cuMemcpyBatchAsync``.  With a ``side`` and at least :data:`BATCH_SPLIT_MIN` copies, the second
    half is issued at once by the side thread on the side stream, forked off ``stream`` (behind
    everything enqueued there so far) and joined back, so what is enqueued on ``stream`` next (the
    transfer's events, the next transfer's copies) runs behind both halves.  The join is made
    also when a half fails to issue, then the first error is raised."""
    fn = _cuda.batch_memcpy()
    assert fn is not None and dplan.ids is not None and dplan.addresses is not None
    arrays = batch_copies(planes.ptrs, planes.block_strides, specs, dplan.ids, dplan.addresses,
                          to_device=to_device, blocks=planes.num_blocks)
    count = int(arrays[2].size)
    handle = int(stream)
    if side is None or count < BATCH_SPLIT_MIN:
        _issue_copies(fn, arrays, 0, count, handle)
        return
    d = _cuda.driver()
    half = count // 2
    _cuda.check(d.cuEventRecord(side.fork, stream), "cuEventRecord(fork)")
    side_stream = side.stream

    def far() -> None:
        _cuda.check(d.cuStreamWaitEvent(side_stream, side.fork, 0), "cuStreamWaitEvent(fork)")
        try:
            _issue_copies(fn, arrays, half, count, int(side_stream))
        finally:
            _cuda.check(d.cuEventRecord(side.join, side_stream), "cuEventRecord(join)")

    wait = side.start(far)
    errors: list[BaseException] = []
    try:
        _issue_copies(fn, arrays, 0, half, handle)
    except BaseException as exc:
        errors.append(exc)
    side.join_into(wait, stream, errors)
    if errors:
        raise errors[0]


class Claims:
    """Pages ``[0, n)`` of one restore shared by two issuers until they meet: the staging path
    takes chunks from the front (:meth:`front`), the batch side runs of pages from the back
    (:meth:`back`).  Why share: batch copies keep the engine's SMs free, but their driver time
    is host time per 32 KiB copy, measured on the H200 at 0.56-1.1 us from one restore to the
    next, and for seconds at a time restores ran at 0.39-0.46x of the link (~3 us per copy,
    inferred; ``docs/benchmarks.md``, session 17), while the staging path moves a chunk in a few large
    DMAs whatever the host does.  The staging path claims a chunk only when the GPU has caught
    up with every batch copy issued so far (:func:`side_lagging`): with a fast host batch copies
    move (nearly) everything, with a slow one the staging path fills the link.

    ``records`` counts the side's progress records, ``side_done`` says it stopped claiming;
    ``started`` is set at its first record or its end."""

    __slots__ = ("_lock", "back_at", "front_at", "records", "side_done", "started", "taken")

    def __init__(self, n: int) -> None:
        self._lock = threading.Lock()
        self.front_at = 0
        self.back_at = n
        self.records = 0
        self.side_done = False
        self.started = threading.Event()
        self.taken = [0, 0]  # pages claimed by the front (staged), by the back (batch copies)

    def front(self, k: int) -> tuple[int, int]:
        """The next ``k`` pages (fewer where the back's claims begin; empty once they meet)."""
        with self._lock:
            lo = self.front_at
            hi = min(lo + k, self.back_at)
            if hi <= lo:
                return lo, lo
            self.front_at = hi
            self.taken[0] += hi - lo
            return lo, hi

    def back(self, k: int) -> tuple[int, int]:
        """The last ``k`` pages not yet claimed (fewer near the front; empty once they meet)."""
        with self._lock:
            hi = self.back_at
            lo = max(self.front_at, hi - k)
            if hi <= lo:
                return hi, hi
            self.back_at = lo
            self.taken[1] += hi - lo
            return lo, hi

    def close(self) -> None:
        """Nothing more to claim (an issuer failed: the transfer fails, its other pages unmoved)."""
        with self._lock:
            self.back_at = self.front_at

    def recorded(self) -> None:
        self.records += 1  # (one writer: the side thread)
        self.started.set()

    def side_finished(self) -> None:
        self.side_done = True
        self.started.set()


def shared_side(d: Any, fn: _cuda._BatchCall, arrays: tuple[npt.NDArray[np.uint64], ...], per_page: int,
                claims: Claims, side: BatchSide) -> Callable[[], None]:
    """The side thread's half of a shared restore: behind ``side.fork``, claims of pages from the
    back of ``claims``, each issued as one ``cuMemcpyBatchAsync`` of its ``per_page`` copies per
    page (``arrays``: :func:`batch_copies` of every page, page-major) and followed by a record of
    ``side.progress``; ``side.join`` recorded last, also when a call fails (then the claims are
    closed and the error raised)."""
    dsts, srcs, sizes = (a.ctypes.data for a in arrays)
    stream = side.stream
    handle = int(stream)

    def job() -> None:
        try:
            _cuda.check(d.cuStreamWaitEvent(stream, side.fork, 0), "cuStreamWaitEvent(fork)")
            k = max(1, SHARED_FIRST_COPIES // per_page)
            kmax = max(1, SHARED_MAX_COPIES // per_page)
            while True:
                lo, hi = claims.back(k)
                if hi <= lo:
                    break
                off = 8 * lo * per_page  # (byte offset into each uint64 array)
                err = fn(dsts + off, srcs + off, sizes + off, (hi - lo) * per_page, handle)
                if err:
                    raise CopyEngineError(f"cuMemcpyBatchAsync failed: {_cuda.error_text(err)}")
                _cuda.check(d.cuEventRecord(side.progress, stream), "cuEventRecord(progress)")
                claims.recorded()
                k = min(2 * k, kmax)
        except BaseException:
            claims.close()
            raise
        finally:
            try:
                _cuda.check(d.cuEventRecord(side.join, stream), "cuEventRecord(join)")
            finally:
                claims.side_finished()

    return job


def side_lagging(d: Any, claims: Claims, side: BatchSide) -> None:
    """Block (the GIL released) until the staging path should claim a chunk: the side has stopped
    claiming, or the GPU has finished every batch copy the side issued so far and the side has
    issued none since (the link would go idle).  Waits for the side's first claim first."""
    claims.started.wait()
    while not claims.side_done:
        seen = claims.records
        _cuda.check(d.cuEventSynchronize(side.progress), "cuEventSynchronize(progress)")
        if claims.records == seen:
            return


def issue(d: Any, planes: Any, ids: list[int], dplan: DirectPlan, specs: Any, stream: Any, *, to_device: bool,
          side: BatchSide | None = None) -> None:
    """Enqueue the direct runs of ``dplan`` for planes ``specs`` on ``stream``: one
    ``cuMemcpy2DAsync`` per (run, plane), or the batch copies of a ``direct="batch"`` plan (half
    of them by ``side``, see :func:`issue_batch`)."""
    assert dplan.addresses is not None
    if dplan.ids is not None:
        issue_batch(planes, dplan, specs, stream, to_device=to_device, side=side)
        return
    P = planes.layout.page_nbytes
    host_mem = d.CUmemorytype.CU_MEMORYTYPE_HOST
    dev_mem = d.CUmemorytype.CU_MEMORYTYPE_DEVICE
    addrs = dplan.addresses
    for lo, k in dplan.runs:
        host0 = int(addrs[lo])
        b0 = ids[lo]
        for spec in specs:
            stride = planes.block_strides[spec.index]
            cp = d.CUDA_MEMCPY2D()
            if to_device:
                cp.srcMemoryType = host_mem
                cp.srcHost = host0 + spec.offset
                cp.srcPitch = P
                cp.dstMemoryType = dev_mem
                cp.dstDevice = planes.ptrs[spec.index] + b0 * stride
                cp.dstPitch = stride
            else:
                cp.srcMemoryType = dev_mem
                cp.srcDevice = planes.ptrs[spec.index] + b0 * stride
                cp.srcPitch = stride
                cp.dstMemoryType = host_mem
                cp.dstHost = host0 + spec.offset
                cp.dstPitch = P
            cp.WidthInBytes = spec.nbytes
            cp.Height = k
            _cuda.check(d.cuMemcpy2DAsync(cp, stream), "cuMemcpy2DAsync(direct)")
