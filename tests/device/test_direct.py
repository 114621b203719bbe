"""The direct-DMA plan of the CUDA copy engine (``device/_direct.py``), on the CPU: which pages of a
transfer go straight between host pages and blocks, which stay on the staging path."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import hostkv_providers as hk
from hostkv_providers.device import _direct
from hostkv_providers.device._hostmem import _add_start, _drop_start
from hostkv_providers.errors import CopyArgumentError

BIG = hk.KVLayout(num_layers=4, num_kv_heads=8, head_dim=128, page_tokens=16, dtype="bfloat16")  # 32 KiB slices
SMALL = hk.KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, page_tokens=4, dtype="float32")  # 1 KiB slices


def addrs(n: int, layout: hk.KVLayout, base: int = 1 << 40) -> np.ndarray:
    return np.arange(n, dtype=np.uint64) * np.uint64(layout.page_nbytes) + np.uint64(base)


def test_runs_break_at_ids_and_host_gaps() -> None:
    ids = [5, 6, 7, 8, 20, 30, 31, 0, 12, 13]
    a = addrs(len(ids), BIG)
    a[8:] += np.uint64(BIG.page_nbytes)  # host pages 8, 9 sit one page further: a break before 8
    plan = _direct.plan("always", BIG, ids, a)
    assert plan.runs == [(0, 4), (4, 1), (5, 2), (7, 1), (8, 2)]
    assert plan.rest is not None and plan.rest.tolist() == [] and plan.all_direct
    ids2 = [5, 6, 7, 8, 9, 10, 11, 12, 40]
    p2 = _direct.plan("always", BIG, ids2, addrs(len(ids2), BIG))
    assert p2.runs == [(0, 8), (8, 1)]


def test_auto_takes_long_runs_of_wide_slices_only() -> None:
    per = -(-_direct.DIRECT_MIN_RUN_BYTES // BIG.page_nbytes)  # pages for 16 MiB
    ids = [*range(100, 100 + per), 7, 3, *range(200, 200 + per - 1)]
    plan = _direct.plan("auto", BIG, ids, addrs(len(ids), BIG))
    assert plan.runs == [(0, per)]  # the second run is one page short
    assert plan.rest is not None and plan.rest.tolist() == list(range(per, len(ids)))
    assert not plan.all_direct
    # slices under 8 KiB: nothing direct however long the run
    ids = list(range(4096 * 8))
    assert _direct.plan("auto", SMALL, ids, addrs(len(ids), SMALL)).runs == []
    assert _direct.plan("always", SMALL, ids[:3], addrs(3, SMALL)).runs == [(0, 3)]


def test_never_no_addresses_and_empty() -> None:
    ids = list(range(64))
    assert _direct.plan("never", BIG, ids, addrs(64, BIG)) is _direct.NO_PLAN
    assert _direct.plan("always", BIG, ids, None) is _direct.NO_PLAN  # pages in several pieces
    assert _direct.plan("always", BIG, [], addrs(0, BIG)) is _direct.NO_PLAN
    assert not _direct.NO_PLAN.all_direct and _direct.NO_PLAN.rest is None


def test_a_run_never_crosses_into_another_registration() -> None:
    ids = list(range(8))
    a = addrs(8, BIG, base=1 << 41)
    start = int(a[5])
    _add_start(start)
    try:
        assert _direct.plan("always", BIG, ids, a).runs == [(0, 5), (5, 3)]
    finally:
        _drop_start(start)


def test_mode_is_checked() -> None:
    """Every mode the engine documents is accepted; batch copies alone stay the default
    (``"shared"`` is opt-in: docs/benchmarks.md, session 17)."""
    import inspect

    from hostkv_providers.device import CudaCopyEngine

    for mode in ("batch", "shared", "auto", "always", "never"):
        assert _direct.check_direct(mode) == mode
    with pytest.raises(CopyArgumentError, match="direct must be one of"):
        _direct.check_direct("yes")
    assert inspect.signature(CudaCopyEngine).parameters["direct"].default == "batch"


def test_registration_starts_follow_the_set() -> None:
    """The sorted starts are rebuilt after every registration and release (the copy engine asks
    per staged chunk): membership always matches the set's."""
    from hostkv_providers.device._hostmem import _REGISTERED_STARTS, registration_starts

    rng = np.random.default_rng(3)
    mine: list[int] = []
    try:
        for _ in range(50):
            if mine and rng.random() < 0.4:
                _drop_start(mine.pop(int(rng.integers(len(mine)))))
            else:
                start = (1 << 42) + int(rng.integers(1 << 20)) * 4096
                _add_start(start)
                mine.append(start)
            probe = np.array([*mine[-3:], (1 << 42) + int(rng.integers(1 << 20)) * 4096 + 1, 0, 2 ** 64 - 1],
                             dtype=np.uint64)
            got = registration_starts(probe)
            assert got.tolist() == [int(a) in _REGISTERED_STARTS for a in probe.tolist()]
        assert not registration_starts(np.array([], dtype=np.uint64)).size
    finally:
        for start in mine:
            _drop_start(start)


# -- direct="batch": one cuMemcpyBatchAsync copy per (page, plane slice), any block order ---------
def test_batch_copies_name_every_slice_page_major() -> None:
    """The batch descriptors, built as arrays, against a per-page reference: page ``i``'s slice of
    plane ``p`` goes between host ``addresses[i] + spec.offset`` and block ``ids[i]`` of the plane."""
    ids = np.array([9, 2, 7, 0, 5], dtype=np.uint64)
    a = addrs(len(ids), BIG)
    nplanes = len(BIG.planes)
    ptrs = [(1 << 36) + (p << 30) for p in range(nplanes)]
    strides = [spec.nbytes + 512 * (spec.index % 2) for spec in BIG.planes]  # padded blocks too
    for specs in (BIG.planes, BIG.planes[2:4]):  # every plane, one layer's
        for to_device in (True, False):
            dsts, srcs, sizes = _direct.batch_copies(ptrs, strides, specs, ids, a, to_device=to_device,
                                                     blocks=10)
            want = [(int(a[i]) + s.offset, ptrs[s.index] + int(ids[i]) * strides[s.index], s.nbytes)
                    for i in range(len(ids)) for s in specs]
            host, dev = (srcs, dsts) if to_device else (dsts, srcs)
            assert list(zip(host.tolist(), dev.tolist(), sizes.tolist(), strict=True)) == want
            assert dsts.dtype == srcs.dtype == sizes.dtype == np.uint64
            assert dsts.flags.c_contiguous and srcs.flags.c_contiguous and sizes.flags.c_contiguous


def _apply(dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray) -> None:
    """Run batch descriptors as the copy engines would, on host memory (``ctypes.memmove``)."""
    import ctypes

    for d, s_, n in zip(dsts.tolist(), srcs.tolist(), sizes.tolist(), strict=True):
        ctypes.memmove(d, s_, n)


@pytest.mark.parametrize("engine_layout", ["kv-planes", "blocks-2", "blocks-layers-2", "padded-blocks-2"])
def test_batch_copies_merge_adjacent_planes_and_move_the_same_bytes(engine_layout: str) -> None:
    """Planes that follow each other in the host page and in every block go as one copy: K and V
    of a block adjacent (``[blocks, 2, ...]`` per layer) halve the copies, a contiguous block
    (``[blocks, layers, 2, ...]``) is one copy per page; vLLM's ``[2, blocks, ...]`` and padded
    blocks (a gap after V) merge nothing they must not.  Both directions, run on host memory, move
    exactly the bytes one copy per slice moves, and touch no other block."""
    layout = hk.KVLayout(num_layers=3, num_kv_heads=2, head_dim=16, page_tokens=4, dtype="float32")  # 512 B slices
    L, S, nb = layout.num_layers, layout.planes[0].nbytes, 9
    if engine_layout == "kv-planes":  # per layer [2, blocks, ...]
        pools = [np.zeros((2, nb, S), np.uint8) for _ in range(L)]
        views = [pools[i // 2][i % 2] for i in range(2 * L)]
        per_page = 2 * L
    elif engine_layout == "blocks-2":  # per layer [blocks, 2, ...]
        pools = [np.zeros((nb, 2, S), np.uint8) for _ in range(L)]
        views = [pools[i // 2][:, i % 2] for i in range(2 * L)]
        per_page = L
    elif engine_layout == "padded-blocks-2":  # per layer [blocks, 3, ...]: K, V, then padding
        pools = [np.zeros((nb, 3, S), np.uint8) for _ in range(L)]
        views = [pools[i // 2][:, i % 2] for i in range(2 * L)]
        per_page = L
    else:  # one [blocks, layers, 2, ...] tensor
        pools = [np.zeros((nb, L, 2, S), np.uint8)]
        views = [pools[0][:, i // 2, i % 2] for i in range(2 * L)]
        per_page = 1
    ptrs = [v.ctypes.data for v in views]
    strides = [v.strides[0] for v in views]
    ids = np.array([7, 2, 5, 0], dtype=np.uint64)
    P = layout.page_nbytes
    src = np.random.default_rng(5).integers(0, 256, (len(ids), P), dtype=np.uint8)
    a = np.uint64(src.ctypes.data) + np.arange(len(ids), dtype=np.uint64) * np.uint64(P)
    dsts, srcs, sizes = _direct.batch_copies(ptrs, strides, layout.planes, ids, a, to_device=True, blocks=nb)
    assert len(sizes) == len(ids) * per_page
    _apply(dsts, srcs, sizes)
    for i, b in enumerate(ids.tolist()):
        for spec, v in zip(layout.planes, views, strict=True):
            assert bytes(v[b]) == bytes(src[i, spec.offset: spec.offset + spec.nbytes])
    others = [b for b in range(nb) if b not in ids.tolist()]
    assert all(not v[others].any() for v in views)
    if engine_layout == "padded-blocks-2":
        assert not any(pool[:, 2].any() for pool in pools)  # the padding is never written
    back = np.zeros_like(src)
    b_addr = np.uint64(back.ctypes.data) + np.arange(len(ids), dtype=np.uint64) * np.uint64(P)
    _apply(*_direct.batch_copies(ptrs, strides, layout.planes, ids, b_addr, to_device=False, blocks=nb))
    assert np.array_equal(back, src)
    # one layer's planes merge within the layer (what batch_usable's per-layer bound looks at)
    groups = _direct.copy_groups(ptrs, strides, layout.planes[2:4], blocks=nb)
    assert len(groups[3]) == (2 if engine_layout == "kv-planes" else 1)


def test_copy_groups_merge_only_what_is_adjacent_on_both_sides() -> None:
    """A quantized layout whose code and scale slices of a block follow each other merges into one
    copy per block; planes adjacent at block 0 but with other strides, planes in another order on
    the device than in the page, and one-block planes (whose memory need not hold the merged
    bytes) are not merged."""
    scaled = hk.KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, page_tokens=4, dtype="int8",
                         scale_dtype="float32")  # per layer k (128 B), k_scale (32), v (128), v_scale (32)
    per_layer = sum(s.nbytes for s in scaled.planes[:4])
    block = 2 * per_layer
    ptrs = [(1 << 40) + s.offset for s in scaled.planes]  # a whole page contiguous in each block
    strides = [block] * len(scaled.planes)
    offs, base, stride, size = _direct.copy_groups(ptrs, strides, scaled.planes, blocks=8)
    assert size.tolist() == [block] and offs.tolist() == [0] and base.tolist() == [ptrs[0]]
    assert stride.tolist() == [block]
    assert _direct.copy_groups(ptrs, strides, scaled.planes[4:], blocks=8)[3].tolist() == [per_layer]
    assert len(_direct.copy_groups(ptrs, strides, scaled.planes, blocks=1)[3]) == len(scaled.planes)
    other = list(strides)
    other[1] = 2 * block  # k_scale adjacent to k at block 0 only
    assert _direct.copy_groups(ptrs, other, scaled.planes[:4], blocks=8)[3].tolist() == [128, 32, 160]
    swapped = [ptrs[2], ptrs[3], ptrs[0], ptrs[1], *ptrs[4:]]  # V before K in the block, K before V in the page
    assert _direct.copy_groups(swapped, strides, scaled.planes[:4], blocks=8)[3].tolist() == [160, 160]


def test_batch_plan_stages_where_it_cannot_apply(monkeypatch: pytest.MonkeyPatch) -> None:
    """``direct="batch"`` takes every page (any order) when the driver has the call and slices are
    long enough; else every page stays on the staging path, which may then be prestaged."""
    ids = [9, 2, 7, 0, 5]
    monkeypatch.setattr(_direct._cuda, "batch_memcpy", lambda: None)  # a driver before CUDA 12.8
    assert _direct.plan("batch", BIG, ids, addrs(5, BIG)) is _direct.NO_PLAN
    monkeypatch.setattr(_direct._cuda, "batch_memcpy", lambda: (lambda *a: 0))
    plan = _direct.plan("batch", BIG, ids, addrs(5, BIG))
    assert plan.runs == [(0, 5)] and plan.all_direct
    assert plan.ids is not None and plan.ids.tolist() == ids
    assert _direct.plan("batch", SMALL, ids, addrs(5, SMALL)) is _direct.NO_PLAN  # 1 KiB slices
    assert _direct.plan("batch", BIG, ids, None) is _direct.NO_PLAN  # a page in several regions
    assert _direct.plan("batch", BIG, ids, addrs(5, BIG), pinned=False) is _direct.NO_PLAN  # pageable pages
    assert _direct.check_direct("batch") == "batch"


def test_layerwise_restores_are_staged_under_batch() -> None:
    """Batch copies are for whole pages: a layer-wise restore under ``direct="batch"`` is staged
    (and may be prestaged), as under ``"never"``; ``"auto"`` and ``"always"`` keep their runs."""
    assert _direct.stages_all("batch") and _direct.stages_all("never")
    assert not _direct.stages_all("auto") and not _direct.stages_all("always")


def test_batch_applies_to_short_slices_its_planes_merge(monkeypatch: pytest.MonkeyPatch) -> None:
    """16 KiB K and V slices are too short for batch copies one by one, but an engine whose K and V
    of a block are adjacent makes 32 KiB copies of them: given its planes, the plan takes every
    page; vLLM's planes (K and V apart) stay staged; without planes the slices decide."""
    from hostkv_providers.device import KVPlanes

    monkeypatch.setattr(_direct._cuda, "batch_memcpy", lambda: (lambda *a: 0))
    mid = hk.KVLayout(num_layers=2, num_kv_heads=8, head_dim=64, page_tokens=16, dtype="bfloat16")  # 16 KiB
    S, nb = mid.planes[0].nbytes, 64
    adjacent = KVPlanes(mid, [(1 << 36) + (i // 2) * (1 << 30) + (i % 2) * S for i in range(4)], [2 * S] * 4, nb)
    apart = KVPlanes(mid, [(1 << 36) + i * (1 << 30) for i in range(4)], [S] * 4, nb)
    ids = [9, 2, 7, 0, 5]
    a = addrs(5, mid)
    assert _direct.plan("batch", mid, ids, a, planes=adjacent).all_direct
    assert _direct.plan("batch", mid, ids, a, planes=apart) is _direct.NO_PLAN
    assert _direct.plan("batch", mid, ids, a) is _direct.NO_PLAN
    assert _direct.batch_usable(mid, adjacent) and not _direct.batch_usable(mid, apart)
    one_block = KVPlanes(mid, adjacent.ptrs, adjacent.block_strides, 1)  # nothing merges for one block
    assert not _direct.batch_usable(mid, one_block)


def test_pages_pinned_reads_every_region() -> None:
    """``direct="batch"`` asks the caller's pages whether they are page-locked: ``HostPages``'
    flag, or every region's (an lmdb store's views are its mapped files, pageable)."""
    from hostkv_providers import HostPages, HostRegion

    buf = memoryview(bytearray(8192))

    def region(pinned: bool, offset: int = 0) -> HostRegion:
        return HostRegion(offset, buf[offset: offset + 4096], 1 << 40, pinned)

    a = addrs(2, BIG)
    assert _direct.pages_pinned(HostPages(a, BIG.page_nbytes, pinned=True, readonly=True))
    assert not _direct.pages_pinned(HostPages(a, BIG.page_nbytes, pinned=False, readonly=True))
    assert _direct.pages_pinned([region(True), [region(True)], (region(True), region(True, 4096))])
    assert not _direct.pages_pinned([region(True), region(False)])
    assert not _direct.pages_pinned([[region(True), region(False, 4096)]])
    assert _direct.pages_pinned([])


# -- direct="batch" from two threads: the fork / join protocol of issue_batch ---------------------
class _Recorder:
    """The driver calls ``issue_batch`` makes, recorded with the calling thread: stream events and
    waits (as the CUDA driver would take them) and the batch calls, as copy index ranges.  The
    real driver runs the same protocol in the GPU tests (``batch-split``); this checks its order
    and its failure paths, which a GPU cannot be made to produce on demand."""

    def __init__(self, base: int, fail_on: object = None) -> None:
        import threading

        self.ops: list[tuple[str, object, object, str]] = []
        self.base = base
        self.fail_on = fail_on
        self._lock = threading.Lock()

    def _add(self, *op: object) -> None:
        import threading

        with self._lock:
            self.ops.append((*op, threading.current_thread().name))  # type: ignore[arg-type]

    def cuEventRecord(self, ev: object, stream: object) -> tuple[int]:
        self._add("record", ev, stream)
        return (0,)

    def cuStreamWaitEvent(self, stream: object, ev: object, flags: int) -> tuple[int]:
        self._add("wait", ev, stream)
        return (0,)

    def cuStreamSynchronize(self, stream: object) -> tuple[int]:
        self._add("sync", None, stream)
        return (0,)

    def cuStreamDestroy(self, stream: object) -> tuple[int]:
        return (0,)

    def cuEventDestroy(self, ev: object) -> tuple[int]:
        return (0,)

    def batch(self, dsts: int, srcs: int, sizes: int, count: int, stream: int) -> int:
        lo = (dsts - self.base) // 8
        self._add("copy", (lo, lo + count), stream)
        return 700 if stream == self.fail_on else 0


class _Dev:
    def __init__(self) -> None:
        self.n = 100

    def stream(self) -> int:
        self.n += 1
        return self.n

    def event(self, **flags: bool) -> str:
        self.n += 1
        return f"ev{self.n}"

    def activate(self) -> None:
        pass


def _split_setup(monkeypatch: pytest.MonkeyPatch, pages: int) -> tuple[_Recorder, _direct.BatchSide, Any, Any]:
    from hostkv_providers.device import KVPlanes

    planes = KVPlanes(BIG, [(1 << 36) + (p << 30) for p in range(len(BIG.planes))],
                      [s.nbytes for s in BIG.planes], 64)
    ids = np.arange(pages, dtype=np.uint64)
    dplan = _direct.DirectPlan([(0, pages)], np.empty(0, np.int64), addrs(pages, BIG), ids)
    real = _direct.batch_copies

    def copies(*a: Any, **k: Any) -> Any:
        out = real(*a, **k)
        rec.base = out[0].ctypes.data  # (copy ranges are read back from the dsts addresses)
        return out

    rec = _Recorder(0)
    monkeypatch.setattr(_direct, "batch_copies", copies)
    monkeypatch.setattr(_direct._cuda, "driver", lambda: rec)
    monkeypatch.setattr(_direct._cuda, "batch_memcpy", lambda: rec.batch)
    side = _direct.BatchSide(_Dev(), "test-side")
    return rec, side, planes, dplan


def _covered(rec: _Recorder) -> list[tuple[int, int]]:
    return sorted(op[1] for op in rec.ops if op[0] == "copy")  # type: ignore[misc]


@pytest.mark.parametrize("fail", [None, "main", "side"])
def test_batch_split_forks_issues_both_halves_and_always_joins(monkeypatch: pytest.MonkeyPatch,
                                                                fail: str | None) -> None:
    """Fork recorded on the transfer's stream before the side waits on it; the side issues the
    second half on its own stream and records the join; the transfer's stream waits on the join
    last.  The halves cover every copy once, at most ``BATCH_MAX_COPIES`` per call.  A half that
    fails to issue still leaves the join made, and the error is raised."""
    from hostkv_providers.errors import CopyEngineError

    monkeypatch.setattr(_direct, "BATCH_MAX_COPIES", 100)
    monkeypatch.setattr(_direct, "BATCH_FIRST_COPIES", 100)
    monkeypatch.setattr(_direct, "BATCH_SPLIT_MIN", 2)
    stream = 7
    pages = 40  # 40 x 8 planes = 320 copies: halves of 160, calls of 100 + 60 each
    rec, side, planes, dplan = _split_setup(monkeypatch, pages)
    rec.fail_on = {"main": stream, "side": side.stream, None: None}[fail]
    try:
        if fail is None:
            _direct.issue_batch(planes, dplan, BIG.planes, stream, to_device=True, side=side)
        else:
            with pytest.raises(CopyEngineError, match="cuMemcpyBatchAsync failed"):
                _direct.issue_batch(planes, dplan, BIG.planes, stream, to_device=True, side=side)
    finally:
        side.close(lambda result, what: None)
    ops = [op for op in rec.ops if op[0] != "sync"]
    assert ops[0][:3] == ("record", side.fork, stream)
    assert ops[-1][:3] == ("wait", side.join, stream)
    side_ops = [op[:3] for op in ops if op[3] == "test-side"]
    assert side_ops[0] == ("wait", side.fork, side.stream)
    assert side_ops[-1] == ("record", side.join, side.stream)
    main_copies = [op[1] for op in ops if op[0] == "copy" and op[2] == stream]
    side_copies = [op[1] for op in ops if op[0] == "copy" and op[2] == side.stream]
    if fail is None:
        assert main_copies == [(0, 100), (100, 160)] and side_copies == [(160, 260), (260, 320)]
    elif fail == "main":
        assert main_copies == [(0, 100)] and side_copies == [(160, 260), (260, 320)]  # the side goes on
    else:
        assert main_copies == [(0, 100), (100, 160)] and side_copies == [(160, 260)]


def test_batch_calls_ramp_up_from_a_small_first_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each half's first driver call is small (its copies start moving when the call returns) and
    the next ones double up to ``BATCH_MAX_COPIES``; together they cover every copy once, in
    order."""
    monkeypatch.setattr(_direct, "BATCH_MAX_COPIES", 100)
    monkeypatch.setattr(_direct, "BATCH_FIRST_COPIES", 25)
    monkeypatch.setattr(_direct, "BATCH_SPLIT_MIN", 2)
    rec, side, planes, dplan = _split_setup(monkeypatch, 60)  # 480 copies: halves of 240
    try:
        _direct.issue_batch(planes, dplan, BIG.planes, 7, to_device=False, side=side)
    finally:
        side.close(lambda result, what: None)
    main = [op[1] for op in rec.ops if op[0] == "copy" and op[2] == 7]
    far = [op[1] for op in rec.ops if op[0] == "copy" and op[2] == side.stream]
    assert main == [(0, 25), (25, 75), (75, 175), (175, 240)]
    assert far == [(240, 265), (265, 315), (315, 415), (415, 480)]


def test_batch_split_only_from_the_threshold_and_never_after_close(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under ``BATCH_SPLIT_MIN`` copies one stream issues them all (no fork, no join); a closed
    side refuses work instead of queueing it behind its stopped thread."""
    from hostkv_providers.errors import CopyEngineError

    rec, side, planes, dplan = _split_setup(monkeypatch, 4)  # 32 copies
    monkeypatch.setattr(_direct, "BATCH_SPLIT_MIN", 33)
    _direct.issue_batch(planes, dplan, BIG.planes, 7, to_device=False, side=side)
    assert [op[:3] for op in rec.ops] == [("copy", (0, 32), 7)]
    monkeypatch.setattr(_direct, "BATCH_SPLIT_MIN", 32)
    rec.ops.clear()
    _direct.issue_batch(planes, dplan, BIG.planes, 7, to_device=False, side=side)
    assert _covered(rec) == [(0, 16), (16, 32)]
    side.close(lambda result, what: None)
    with pytest.raises(CopyEngineError, match="closed"):
        side.start(lambda: None)


# -- direct="shared": batch copies shared with the staging path (Claims, the side, the lag test) ----
def test_claims_meet_in_the_middle_and_close() -> None:
    """The front takes chunks from page 0, the back runs from the last page, until they meet; each
    page is claimed once; ``close`` leaves nothing to either."""
    c = _direct.Claims(10)
    assert c.front(3) == (0, 3)
    assert c.back(4) == (6, 10)
    assert c.back(4) == (3, 6)  # (fewer: the front has page 2)
    assert c.front(3) == (3, 3) and c.back(1) == (3, 3)  # met: empty claims from both ends
    assert c.taken == [3, 7]
    d = _direct.Claims(5)
    assert d.front(1) == (0, 1)
    d.close()
    assert d.front(1)[0] == d.front(1)[1] and d.back(9)[0] == d.back(9)[1]


class _LagDriver(_Recorder):
    """A :class:`_Recorder` whose ``cuEventSynchronize`` runs a hook (the side recording more, as
    a side thread would between the staging path's reads)."""

    def __init__(self) -> None:
        super().__init__(0)
        self.on_sync: list[Any] = []

    def cuEventSynchronize(self, ev: object) -> tuple[int]:
        self._add("sync-event", ev, None)
        if self.on_sync:
            self.on_sync.pop(0)()
        return (0,)


@pytest.mark.parametrize("fail", [False, True])
def test_shared_side_claims_from_the_back_records_progress_and_always_joins(
        monkeypatch: pytest.MonkeyPatch, fail: bool) -> None:
    """The side waits on the fork, then claims pages from the back in runs that double from
    ``SHARED_FIRST_COPIES`` up to ``SHARED_MAX_COPIES`` copies, one batch call per claim (the
    copies of exactly its pages) and a progress record after each; the join is recorded last.
    A failing call closes the claims (the front then stops too), still joins, and raises."""
    from hostkv_providers.errors import CopyEngineError

    monkeypatch.setattr(_direct, "SHARED_FIRST_COPIES", 16)
    monkeypatch.setattr(_direct, "SHARED_MAX_COPIES", 64)
    rec = _Recorder(0, fail_on=9 if fail else None)
    monkeypatch.setattr(_direct._cuda, "driver", lambda: rec)
    side = _direct.BatchSide(_Dev(), "test-side")
    side.stream = 9
    per_page = 8
    arrays = tuple(np.zeros(40 * per_page, np.uint64) for _ in range(3))
    rec.base = arrays[0].ctypes.data
    claims = _direct.Claims(40)
    assert claims.front(3) == (0, 3)  # the staging path has the first chunk already
    job = _direct.shared_side(rec, rec.batch, arrays, per_page, claims, side)
    try:
        if fail:
            with pytest.raises(CopyEngineError, match="cuMemcpyBatchAsync failed"):
                job()
        else:
            job()
    finally:
        side.close(lambda result, what: None)
    ops = [op[:3] for op in rec.ops if op[0] != "sync"]  # (close()'s stream sync)
    assert ops[0] == ("wait", side.fork, 9) and ops[-1] == ("record", side.join, 9)
    copies = [op[1] for op in rec.ops if op[0] == "copy"]
    assert claims.side_done and claims.started.is_set()
    if fail:
        assert copies == [(38 * 8, 40 * 8)] and claims.records == 0
        assert claims.front(1)[0] == claims.front(1)[1]  # closed: nothing left for the front
        return
    # pages [38, 40), [34, 38), [26, 34), [18, 26), [10, 18), [3, 10): 2, 4, 8, 8, 8 pages, then the rest
    assert copies == [(304, 320), (272, 304), (208, 272), (144, 208), (80, 144), (24, 80)]
    assert claims.records == 6 == sum(1 for op in ops if op == ("record", side.progress, 9))
    assert claims.taken == [3, 37]


def test_side_lagging_waits_until_the_gpu_caught_up_with_no_newer_claim(monkeypatch: pytest.MonkeyPatch) -> None:
    """The staging path's turn comes when a wait on the side's progress event ends with no record
    made meanwhile, or once the side stopped; not before the side's first record."""
    import threading

    rec = _LagDriver()
    monkeypatch.setattr(_direct._cuda, "driver", lambda: rec)
    side = _direct.BatchSide(_Dev(), "test-side")
    try:
        claims = _direct.Claims(4)
        got: list[str] = []
        t = threading.Thread(target=lambda: got.append(str(_direct.side_lagging(rec, claims, side))))
        t.start()
        t.join(0.05)
        assert t.is_alive()  # no record yet: waiting for the side's first claim
        # two waits each see a newer record (the side kept issuing), the third does not
        rec.on_sync = [claims.recorded, claims.recorded]
        claims.recorded()
        t.join(5)
        assert got == ["None"]
        assert sum(1 for op in rec.ops if op[0] == "sync-event") == 3
        rec.ops.clear()
        claims.side_finished()
        _direct.side_lagging(rec, claims, side)  # the side stopped: at once, no wait
        assert not rec.ops
    finally:
        side.close(lambda result, what: None)


def test_side_on_exit_runs_even_when_the_job_never_ran(monkeypatch: pytest.MonkeyPatch) -> None:
    """A side thread that cannot take the device never runs the job but still calls ``on_exit``
    (the staging path's wait for the side's first claim ends) and hands the error to ``wait``."""
    rec = _Recorder(0)
    monkeypatch.setattr(_direct._cuda, "driver", lambda: rec)

    class NoDevice(_Dev):
        def activate(self) -> None:
            raise RuntimeError("no device on this thread")

    side = _direct.BatchSide(NoDevice(), "test-side")
    try:
        claims = _direct.Claims(4)
        ran: list[int] = []
        wait = side.start(lambda: ran.append(1), on_exit=claims.side_finished)
        err = wait()
        assert isinstance(err, RuntimeError) and not ran
        assert claims.side_done and claims.started.is_set()
        _direct.side_lagging(rec, claims, side)  # returns at once
    finally:
        side.close(lambda result, what: None)


def test_a_restore_without_staged_pages_completes_on_the_scatter_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """A page-major restore whose pages all go direct records its ``done`` on the scatter stream,
    behind its copies (a tail event recorded on the DMA stream after them): like a staged or
    shared restore's, so one direction's restores complete in the order they were submitted (the
    cache's handle events take the last transfer's).  The DMA stream itself never waits."""
    from hostkv_providers.device import CudaCopyEngine

    rec = _Recorder(0)
    monkeypatch.setattr(_direct._cuda, "driver", lambda: rec)
    issued: list[object] = []
    monkeypatch.setattr(_direct, "issue", lambda d, planes, ids, dplan, specs, stream, **k: issued.append(stream))
    eng = CudaCopyEngine.__new__(CudaCopyEngine)
    eng._dev = _Dev()  # type: ignore[assignment]
    eng._streams = {"restore_dma": 11, "restore_scatter": 12}
    eng._restore_tail = "tail"
    eng._sides = {}
    eng._share = False
    eng.mode = "kernel"

    class Handle:
        def _set_events(self, start: object, done: object) -> None:
            self.events = (start, done)

    h = Handle()
    n = 3
    dplan = _direct.DirectPlan([(0, n)], np.empty(0, np.int64), addrs(n, BIG), np.arange(n, dtype=np.uint64))
    eng._issue_restore(h, _PlanesStub(), [0, 1, 2], [], dplan)  # type: ignore[arg-type]
    start, done = h.events
    assert issued == [11]  # the copies on the DMA stream
    assert [op[:3] for op in rec.ops] == [("record", start, 11), ("record", "tail", 11), ("wait", "tail", 12),
                                          ("record", done, 12)]


class _PlanesStub:  # (what _issue_restore reads of the planes here: the layout)
    layout = BIG
