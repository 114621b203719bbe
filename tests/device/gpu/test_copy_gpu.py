"""CudaCopyEngine on a real GPU: byte-exact round trips, event ordering, errors, pinned memory.

Skipped without CUDA (and without torch, which builds the device planes).  Expected bytes come
from torch on the host, independently of the engine.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any

import numpy as np
import pytest

from hostkv_providers import ClosedError, HostPages, HostRegion, KVLayout, OrdinaryAllocator, PinnedProvider
from hostkv_providers._errors import CopyArgumentError
from hostkv_providers._keys import Salt, chain_keys
from hostkv_providers.cache import StagingPool
from hostkv_providers.device import _direct
from hostkv_providers.device._copy import CudaCopyEngine, KVPlanes, cuda_available, default_copy_engine, page_regions
from hostkv_providers.device._engine import _check_pages
from hostkv_providers.device._hostmem import CudaHostAllocator, pinned_allocator

torch = pytest.importorskip("torch")
if not cuda_available() or not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

pytestmark = pytest.mark.gpu

PLAIN = KVLayout(num_layers=4, num_kv_heads=8, head_dim=128, page_tokens=16, dtype="bfloat16")  # 32 KiB slices
SCALED = KVLayout(num_layers=3, num_kv_heads=3, head_dim=5, page_tokens=3, dtype="int8", scale_dtype="float16")
LATENT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=576, page_tokens=8, dtype="bfloat16", kinds=("kv",))


class DevicePlanes:
    """Per-layer caches shaped like an engine's: [kinds, blocks, tokens, heads, dim] (+ scales)."""

    def __init__(self, layout: KVLayout, nblocks: int, seed: int, fill: int | None = None,
                 block_major: bool = False) -> None:
        self.layout = layout
        g = torch.Generator(device="cuda").manual_seed(seed)
        tensors: list[Any] = []
        self.owners: list[Any] = []
        nk = len(layout.kinds)
        for _ in range(layout.num_layers):
            if block_major:  # [blocks, kinds, tokens, heads, dim] (FlashInfer's): K and V of a block adjacent
                assert layout.scale_dtype is None
                codes = torch.empty((nblocks, nk, layout.page_tokens, layout.num_kv_heads,
                                     layout.head_dim * layout.itemsize), dtype=torch.uint8, device="cuda")
                codes.copy_(torch.randint(0, 256, codes.shape, generator=g, device="cuda", dtype=torch.uint8)
                            if fill is None else torch.full_like(codes, fill))
                self.owners.append(codes)
                tensors += [codes[:, k].flatten(1) for k in range(nk)]
                continue
            shape = (nk, nblocks, layout.page_tokens, layout.num_kv_heads, layout.head_dim * layout.itemsize)
            codes = torch.empty(shape, dtype=torch.uint8, device="cuda")
            scales = torch.empty((nk, nblocks, layout.page_tokens, layout.num_kv_heads,
                                  layout.scale_nbytes // (layout.page_tokens * layout.num_kv_heads) or 1),
                                 dtype=torch.uint8, device="cuda") if layout.scale_dtype else None
            for t in (codes, scales):
                if t is None:
                    continue
                if fill is None:
                    t.copy_(torch.randint(0, 256, t.shape, generator=g, device="cuda", dtype=torch.uint8))
                else:
                    t.fill_(fill)
                self.owners.append(t)
            # codes as the engine's dtype: byte views of the same memory keep the test dtype-agnostic
            for k in range(nk):
                tensors.append(codes[k].view(nblocks, -1))
                if scales is not None:
                    tensors.append(scales[k].view(nblocks, -1))
        self.tensors = tensors
        self.planes = KVPlanes.from_torch(layout, tensors)

    def page(self, block: int) -> bytes:
        return b"".join(bytes(t[block].cpu().numpy().tobytes()) for t in self.tensors)


def pageable_pages(layout: KVLayout, count: int, cuts: tuple[int, ...]) -> tuple[list[list[HostRegion]], list[Any]]:
    bounds = [0, *cuts, layout.page_nbytes]
    pages, keep = [], []
    for _ in range(count):
        regions = []
        for lo, hi in itertools.pairwise(bounds):
            a = np.full(hi - lo, 0xCD, dtype=np.uint8)
            keep.append(a)
            regions.append(HostRegion(lo, memoryview(a), int(a.ctypes.data), False))
        pages.append(regions)
    return pages, keep


def page_bytes(regions: list[HostRegion]) -> bytes:
    return b"".join(bytes(r.view) for r in regions)


@pytest.fixture(scope="module")
def allocator() -> Any:
    alloc = pinned_allocator()
    assert alloc is not None
    return alloc


@pytest.mark.parametrize("mode", ["kernel", "memcpy"])
@pytest.mark.parametrize("layout", [PLAIN, SCALED, LATENT], ids=["plain", "scaled-unaligned", "latent"])
@pytest.mark.parametrize("host", ["pinned", "pageable-split"])
@pytest.mark.parametrize("direct", ["never", "batch"])
def test_round_trip(mode: str, layout: KVLayout, host: str, direct: str, allocator: Any) -> None:
    src = DevicePlanes(layout, 40, seed=1)
    ids = [37, 2, 19, 0, 33, 8, 11, 25, 5, 39, 14]
    # a small staging buffer forces several chunks, so both staging slots are reused (direct=
    # "never": every page staged; "batch", the default: pinned whole pages by batch copies where
    # the layout's copies are long enough, the rest staged)
    eng = CudaCopyEngine(staging_bytes=max(4096, 3 * layout.page_nbytes), mode=mode, direct=direct)
    assert eng.mode == mode
    keep: Any = None
    if host == "pinned":
        mem = allocator.allocate(len(ids) * layout.page_nbytes)
        keep = mem
        pages = page_regions(mem.view, mem.address, layout.page_nbytes, len(ids), pinned=True)
    else:
        cuts = (1, layout.page_nbytes // 3, layout.page_nbytes // 3 + 16, layout.page_nbytes - 7)
        pages, keep = pageable_pages(layout, len(ids), cuts)
    h = eng.save(src.planes, ids, pages)
    assert h.wait(timeout=60)
    assert h.done() and h.seconds is not None and h.seconds > 0
    for i, b in enumerate(ids):
        assert page_bytes(pages[i]) == src.page(b), f"page {i} (block {b})"
    dst = DevicePlanes(layout, 40, seed=2, fill=0)
    dst_ids = [3, 38, 21, 4, 9, 30, 12, 1, 27, 16, 35]
    h2 = eng.restore(pages, dst.planes, dst_ids)
    h2.wait()
    for i, b in enumerate(dst_ids):
        assert dst.page(b) == src.page(ids[i])
    torch.cuda.synchronize()
    for t in dst.tensors:
        rest = [b for b in range(40) if b not in dst_ids]
        assert int(t[rest].count_nonzero()) == 0  # nothing else written
    eng.close()
    del keep


def test_contiguous_pages_coalesce_into_few_copies(allocator: Any) -> None:
    layout = PLAIN
    src = DevicePlanes(layout, 64, seed=3)
    eng = CudaCopyEngine(staging_bytes=8 * layout.page_nbytes, direct="never")  # (the staging path's DMAs)
    mem = allocator.allocate(64 * layout.page_nbytes)
    pages = page_regions(mem.view, mem.address, layout.page_nbytes, 64, pinned=True)
    ids = list(np.random.default_rng(4).permutation(64))
    checked = _check_pages(layout, pages, 64, writable=True)
    copies = eng._coalesce(checked, 0, 8, layout.page_nbytes)
    assert len(copies) == 1 and copies[0][2] == 8 * layout.page_nbytes  # 8 pages, one DMA
    shuffled = [checked[i] for i in (0, 2, 1, 3)]
    assert len(eng._coalesce(shuffled, 0, 4, layout.page_nbytes)) == 4
    eng.save(src.planes, ids, pages).wait()
    for i in (0, 31, 63):
        assert page_bytes(pages[i]) == src.page(ids[i])
    eng.close()
    mem.close()


@pytest.mark.parametrize("direct", ["never", "batch"])
def test_save_waits_for_the_compute_stream(allocator: Any, direct: str) -> None:
    """Work queued on ``after`` before the save is visible to it, though the stream is busy."""
    layout = PLAIN
    dp = DevicePlanes(layout, 16, seed=5, fill=1)
    eng = CudaCopyEngine(direct=direct)
    mem = allocator.allocate(16 * layout.page_nbytes)
    pages = page_regions(mem.view, mem.address, layout.page_nbytes, 16, pinned=True)
    compute = torch.cuda.Stream()
    with torch.cuda.stream(compute):
        torch.cuda._sleep(200_000_000)  # keep the stream busy ~0.1 s
        for t in dp.owners:
            t.fill_(7)
    h = eng.save(dp.planes, list(range(16)), pages, after=compute)
    h.wait()
    assert bytes(mem.view) == b"\x07" * (16 * layout.page_nbytes)
    # a raw CUstream int works the same; the handle is pending while the stream is busy
    with torch.cuda.stream(compute):
        torch.cuda._sleep(1_000_000_000)  # ~0.5 s
        for t in dp.owners:
            t.fill_(8)
    h = eng.save(dp.planes, list(range(16)), pages, after=compute.cuda_stream)
    assert h.wait(timeout=0.001) is False and not h.done() and h.seconds is None
    assert h.wait(timeout=60)
    assert bytes(mem.view) == b"\x08" * (16 * layout.page_nbytes)
    # the legacy default stream (torch's current stream unless told otherwise)
    for t in dp.owners:
        t.fill_(9)
    eng.save(dp.planes, [3], pages[:1], after=torch.cuda.current_stream()).wait()
    assert bytes(pages[0][0].view) == b"\x09" * layout.page_nbytes
    eng.close()


@pytest.mark.parametrize("direct", ["never", "batch"])
def test_restore_orders_the_compute_stream(allocator: Any, direct: str) -> None:
    """Kernels queued on ``before`` after the restore read the restored bytes."""
    layout = PLAIN
    n = 64
    dp = DevicePlanes(layout, n, seed=6, fill=0)
    eng = CudaCopyEngine(direct=direct)
    mem = allocator.allocate(n * layout.page_nbytes)
    np.frombuffer(mem.view, dtype=np.uint8)[:] = 9
    pages = page_regions(mem.view, mem.address, layout.page_nbytes, n, pinned=True)
    compute = torch.cuda.Stream()
    with torch.cuda.stream(compute):
        torch.cuda._sleep(20_000_000)
    eng.restore(pages, dp.planes, list(range(n)), before=compute)
    with torch.cuda.stream(compute):
        sums = [t.to(torch.int64).sum() for t in dp.owners]  # queued right after the call
    compute.synchronize()
    per = sum(t.numel() for t in dp.owners)
    assert sum(int(s) for s in sums) == 9 * per
    # the same through the handle: another stream waits on the event
    np.frombuffer(mem.view, dtype=np.uint8)[:] = 4
    other = torch.cuda.Stream()
    h = eng.restore(pages, dp.planes, list(range(n)))
    h.wait_on(other)
    assert h.event is not None
    with torch.cuda.stream(other):
        total = sum(t.to(torch.int64).sum() for t in dp.owners)
    other.synchronize()
    assert int(total) == 4 * per
    eng.close()


def test_errors(allocator: Any) -> None:
    layout = PLAIN
    dp = DevicePlanes(layout, 8, seed=7)
    eng = CudaCopyEngine()
    mem = allocator.allocate(2 * layout.page_nbytes)
    pages = page_regions(mem.view, mem.address, layout.page_nbytes, 2, pinned=True)
    host = [np.zeros((8, s.nbytes), dtype=np.uint8) for s in layout.planes]
    host_planes = KVPlanes.from_arrays(layout, host)
    with pytest.raises(CopyArgumentError, match="host memory"):
        eng.save(host_planes, [0, 1], pages)
    as_device = KVPlanes(layout, host_planes.ptrs, host_planes.block_strides, 8, device=0)
    with pytest.raises(CopyArgumentError, match="not device memory"):
        eng.save(as_device, [0, 1], pages)
    too_many = KVPlanes(layout, dp.planes.ptrs, dp.planes.block_strides, 10_000, device=0)
    with pytest.raises(CopyArgumentError, match="past"):
        eng.save(too_many, [0, 1], pages)
    with pytest.raises(CopyArgumentError):
        eng.save(dp.planes, [0, 8], pages)
    with pytest.raises(CopyArgumentError):
        eng.save(dp.planes, [0, 1], pages, after="stream")
    with pytest.raises(CopyArgumentError):
        eng.restore(pages, dp.planes, [1, 1])
    with pytest.raises(CopyArgumentError):
        CudaCopyEngine(mode="fast")
    eng.close()
    with pytest.raises(ClosedError):
        eng.save(dp.planes, [0, 1], pages)
    with pytest.raises(ClosedError):
        eng.restore(pages, dp.planes, [0, 1])
    eng.close()


def test_pinned_allocator_and_provider() -> None:
    alloc = CudaHostAllocator(mapped=True)
    mem = alloc.allocate(64 << 20)
    assert mem.pinned and mem.method == "register"  # type: ignore[attr-defined]
    dev_ptr = mem.device_address  # type: ignore[attr-defined]
    assert dev_ptr
    np.frombuffer(mem.view, dtype=np.uint8)[:4096] = 3
    from hostkv_providers.device import _cuda as _cuda
    out = torch.zeros(4096, dtype=torch.uint8, device="cuda")
    d = _cuda.driver()
    s = torch.cuda.Stream()
    _cuda.check(d.cuMemcpyDtoDAsync(out.data_ptr(), dev_ptr, 4096, s.cuda_stream), "copy")
    s.synchronize()
    assert int(out.sum()) == 3 * 4096  # the mapped pointer reaches the same bytes
    mem.close()
    mem.close()

    layout = PLAIN
    provider = PinnedProvider(32 * layout.page_nbytes, block=layout.page_nbytes, chunk=8 * layout.page_nbytes,
                              background=True)
    assert provider.wait_ready(60)
    assert provider.stats().extra["pinned"] is True
    dp = DevicePlanes(layout, 8, seed=8)
    eng = default_copy_engine()
    assert isinstance(eng, CudaCopyEngine)
    keys = chain_keys(Salt(model_id="gpu-test", layout=layout), list(range(4 * layout.page_tokens)))
    parent = None
    for i, k in enumerate(keys):
        res = provider.reserve(k, parent, layout.page_nbytes)
        assert res is not None
        regions = res.regions()
        assert all(r.pinned for r in regions)
        eng.save(dp.planes, [i + 2], [regions]).wait()  # DMA straight into the arena
        res.mark_written()
        res.seal()
        parent = k
    for i, k in enumerate(keys):
        assert provider.read_bytes(k) == dp.page(i + 2)
    eng.close()
    provider.close()


def test_staging_pool_with_cuda() -> None:
    layout = PLAIN
    dp = DevicePlanes(layout, 24, seed=9)
    eng = CudaCopyEngine()
    provider = PinnedProvider(32 * layout.page_nbytes, block=layout.page_nbytes, allocator=OrdinaryAllocator())
    keys = [bytes(k) for k in chain_keys(Salt(model_id="gpu-stage", layout=layout),
                                         list(range(10 * layout.page_tokens)))]
    ids = [23, 1, 7, 15, 3, 20, 9, 11, 0, 5]
    with StagingPool(eng, layout.page_nbytes, pages_per_buffer=3) as pool:
        assert pool.save_to_provider(provider, keys, dp.planes, ids) == 10
        for k, b in zip(keys, ids, strict=True):
            assert provider.read_bytes(k) == dp.page(b)
        out = DevicePlanes(layout, 24, seed=10, fill=0)
        compute = torch.cuda.Stream()
        res = pool.restore_from_provider(provider, keys, out.planes, list(range(10, 20)), before=compute)
        assert res.pages == 10
        compute.synchronize()
        res.wait()
        for i, k in enumerate(keys):
            assert out.page(10 + i) == provider.read_bytes(k)
    eng.close()
    provider.close()


# -- direct DMA between host pages and blocks (runs of consecutive blocks) ------------------------
RUN_IDS = [5, 6, 7, 8, 20, 30, 31, 0, 12, 13, 14, 15, 16, 17, 2]  # runs of 4, 1, 2, 1, 6, 1
RUN_DST = [3, 38, 21, 22, 23, 24, 9, 30, 31, 32, 33, 34, 35, 1, 27]  # runs of 1, 1, 4, 1, 6, 1, 1


@pytest.mark.parametrize("direct", ["always", "never", "auto", "batch", "batch-split", "shared-split"])
@pytest.mark.parametrize("mode", ["kernel", "memcpy"])
@pytest.mark.parametrize(("layout", "block_major"), [(PLAIN, False), (SCALED, False), (LATENT, False), (PLAIN, True)],
                         ids=["plain", "scaled-unaligned", "latent", "plain-block-major"])
def test_direct_runs_round_trip(direct: str, mode: str, layout: KVLayout, block_major: bool, allocator: Any,
                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Saves and restores (page-major and layer-wise) whose ids mix runs of consecutive blocks with
    single blocks: the runs go straight by 2D DMA (``always``), the rest through staging; the bytes
    are the same as through staging alone (``never``), and no other block is written.
    ``batch-split``: every batch call's second half is issued by the side thread on its stream;
    ``plain-block-major``: K and V of a block adjacent, so batch copies move both at once."""
    if direct.endswith("-split"):
        monkeypatch.setattr(_direct, "BATCH_SPLIT_MIN", 2)
        direct = direct.removesuffix("-split")
    src = DevicePlanes(layout, 40, seed=11, block_major=block_major)
    eng = CudaCopyEngine(staging_bytes=max(4096, 3 * layout.page_nbytes), mode=mode, direct=direct)
    assert eng.direct == direct
    n = len(RUN_IDS)
    mem = allocator.allocate(n * layout.page_nbytes)
    try:
        addrs = np.arange(n, dtype=np.uint64) * np.uint64(layout.page_nbytes) + np.uint64(mem.address)
        pages = HostPages(addrs, layout.page_nbytes, pinned=True, readonly=False, keepalive=mem)
        if direct == "always":
            plan = eng._plan(src.planes, RUN_IDS, pages, pages)
            assert [k for _lo, k in plan.runs] == [4, 1, 2, 1, 6, 1]  # every run (min 1 page) goes direct
        if direct in ("batch", "shared"):  # every page by batch copies where slices are >= 32 KiB, else staged
            plan = eng._plan(src.planes, RUN_IDS, pages, pages)
            assert (plan.ids is not None) == (layout is PLAIN) and plan.all_direct == (layout is PLAIN)
            groups = _direct.copy_groups(src.planes.ptrs, src.planes.block_strides, layout.planes,
                                         blocks=src.planes.num_blocks)
            assert len(groups[3]) == len(layout.planes) // (2 if block_major else 1)
        assert eng.save(src.planes, RUN_IDS, pages).wait(timeout=60)
        view = bytes(mem.view)
        P = layout.page_nbytes
        for i, b in enumerate(RUN_IDS):
            assert view[i * P: (i + 1) * P] == src.page(b), f"saved page {i} (block {b})"
        ro = HostPages(addrs, P, pinned=True, readonly=True, keepalive=mem)
        for layerwise in (False, True):
            dst = DevicePlanes(layout, 40, seed=12, fill=0, block_major=block_major)
            h = eng.restore(ro, dst.planes, RUN_DST, layerwise=layerwise)
            for layer in range(layout.num_layers):
                assert h.wait_layer(layer, timeout=60)
            assert h.wait(timeout=60)
            for i, b in enumerate(RUN_DST):
                assert dst.page(b) == src.page(RUN_IDS[i]), f"layerwise={layerwise}: block {b}"
            torch.cuda.synchronize()
            rest = [b for b in range(40) if b not in RUN_DST]
            for t in dst.tensors:
                assert int(t[rest].count_nonzero()) == 0  # nothing else written
    finally:
        eng.close()
        mem.close()


@pytest.mark.parametrize("block_major", [False, True])
def test_batch_shared_with_staging_round_trip(block_major: bool, allocator: Any,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``direct="shared"`` restore the staging path shares (``_direct.Claims``): the side thread
    takes two one-page runs from the back by batch copies, the staging path the rest from the
    front; restores into shuffled blocks give the same bytes as the pages, every page is moved
    once (``shared_pages``), and no other block is written.  The save before it is not shared
    (batch copies only)."""
    layout = PLAIN
    n = 24
    ids = [int(b) for b in np.random.default_rng(5).permutation(64)[:n]]
    dst_ids = [int(b) for b in np.random.default_rng(6).permutation(64)[:n]]
    monkeypatch.setattr(_direct, "BATCH_SPLIT_MIN", 2)

    class TwoRuns(_direct.Claims):
        """Exactly two one-page runs to the side, the front's first claim only after them."""

        __slots__ = ("given", "ready")

        def __init__(self, count: int) -> None:
            super().__init__(count)
            self.given = 0
            self.ready = threading.Event()

        def back(self, k: int) -> tuple[int, int]:
            if self.given == 2:
                return (0, 0)
            self.given += 1
            got = super().back(1)
            if self.given == 2:
                self.ready.set()
            return got

        def front(self, k: int) -> tuple[int, int]:
            assert self.ready.wait(30)
            return super().front(k)

    monkeypatch.setattr(_direct, "Claims", TwoRuns)
    src = DevicePlanes(layout, 64, seed=21, block_major=block_major)
    eng = CudaCopyEngine(staging_bytes=4 * layout.page_nbytes, direct="shared")
    mem = allocator.allocate(n * layout.page_nbytes)
    try:
        if not eng._sides or eng.mode != "kernel":
            pytest.skip("no batch copies or no pack kernel on this driver")
        P = layout.page_nbytes
        addrs = np.arange(n, dtype=np.uint64) * np.uint64(P) + np.uint64(mem.address)
        pages = HostPages(addrs, P, pinned=True, readonly=False, keepalive=mem)
        assert eng.save(src.planes, ids, pages).wait(timeout=60)
        assert eng.shared_pages == [0, 0]  # (saves go by batch copies alone)
        view = bytes(mem.view)
        for i, b in enumerate(ids):
            assert view[i * P: (i + 1) * P] == src.page(b), f"saved page {i} (block {b})"
        dst = DevicePlanes(layout, 64, seed=22, fill=0, block_major=block_major)
        ro = HostPages(addrs, P, pinned=True, readonly=True, keepalive=mem)
        assert eng.restore(ro, dst.planes, dst_ids).wait(timeout=60)
        assert eng.shared_pages == [n - 2, 2]
        for i, b in enumerate(dst_ids):
            assert dst.page(b) == src.page(ids[i]), f"restored block {b}"
        torch.cuda.synchronize()
        rest = [b for b in range(64) if b not in dst_ids]
        for t in dst.tensors:
            assert int(t[rest].count_nonzero()) == 0  # nothing else written
    finally:
        eng.close()
        mem.close()


def test_direct_restore_orders_the_stream_and_layer_zero_is_recorded_at_the_call(allocator: Any) -> None:
    """A layer-wise restore whose pages all go direct enqueues layer 0 on the caller's thread:
    layer 0 is recorded when ``restore()`` returns, ``wait_layer_on(0, s)`` is a plain event wait,
    and a kernel behind it (and behind ``before=``) never sees the poison."""
    layout = PLAIN
    n = 32
    dp = DevicePlanes(layout, 2 * n, seed=13, fill=0)
    eng = CudaCopyEngine(direct="always")
    mem = allocator.allocate(n * layout.page_nbytes)
    try:
        np.frombuffer(mem.view, dtype=np.uint8)[:] = 9
        P = layout.page_nbytes
        pages = HostPages(np.arange(n, dtype=np.uint64) * np.uint64(P) + np.uint64(mem.address), P, pinned=True,
                          readonly=True, keepalive=mem)
        cs = torch.cuda.Stream()
        per_layer = sum(t[n:].numel() for t in dp.tensors[:2])
        bad = []
        for _trial in range(20):
            with torch.cuda.stream(cs):  # (on cs: behind the last trial's checks, not racing them)
                for t in dp.tensors:
                    t[n:].fill_(0xEE)
            cs.synchronize()
            with torch.cuda.stream(cs):
                torch.cuda._sleep(2_000_000)  # the stream is busy: the waits are enqueued, not past
            h = eng.restore(pages, dp.planes, list(range(n, 2 * n)), layerwise=True)
            assert h._recorded is not None and h._recorded[0].is_set()  # recorded at the call
            h.wait_layer_on(0, cs)
            with torch.cuda.stream(cs):
                bad.append(sum((t[n:] != 9).sum() for t in dp.tensors[:2]))
            h.wait_layer_on(layout.num_layers - 1, cs)
            with torch.cuda.stream(cs):
                bad.append(sum((t[n:] != 9).sum() for t in dp.tensors))
            h.wait()
        cs.synchronize()
        assert per_layer and all(int(b.item()) == 0 for b in bad)
        # before= orders everything
        with torch.cuda.stream(cs):
            for t in dp.tensors:
                t[n:].fill_(0xEE)
        cs.synchronize()
        eng.restore(pages, dp.planes, list(range(n, 2 * n)), layerwise=True, before=cs)
        with torch.cuda.stream(cs):
            total = sum((t[n:] != 9).sum() for t in dp.tensors)
        cs.synchronize()
        assert int(total.item()) == 0
    finally:
        eng.close()
        mem.close()
