"""The copy engine's contract on the host: CpuCopyEngine, KVPlanes, handles, StagingPool.

Expected page bytes are built independently of the engine: by concatenating each plane's block
bytes in ``layout.planes`` order with numpy.
"""

from __future__ import annotations

import itertools
import mmap
import os
import threading
from typing import Any

import numpy as np
import pytest

from hostkv_providers import (
    ClosedError,
    CopyEngineError,
    HostRegion,
    InvalidArgumentError,
    KVLayout,
    OrdinaryAllocator,
    PinnedProvider,
)
from hostkv_providers._keys import Salt, chain_keys
from hostkv_providers.cache import StagingPool
from hostkv_providers.device import _cpu_engine, _cuda_staging, _hostmem, pinned_allocator
from hostkv_providers.device._copy import (
    CopyArgumentError,
    CpuCopyEngine,
    CudaCopyEngine,
    KVPlanes,
    TransferHandle,
    cuda_available,
    default_copy_engine,
    page_regions,
)
from hostkv_providers.device._hostmem import buffer_address

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, page_tokens=4, dtype="float16")
SCALED = KVLayout(num_layers=2, num_kv_heads=3, head_dim=5, page_tokens=3, dtype="int8", scale_dtype="float16")
LATENT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=12, page_tokens=4, dtype="bfloat16", kinds=("kv",))


def make_arrays(layout: KVLayout, nblocks: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=(nblocks, spec.nbytes), dtype=np.uint8) for spec in layout.planes]


def expected_page(layout: KVLayout, arrays: list[np.ndarray], block: int) -> bytes:
    return b"".join(arrays[spec.index][block].tobytes() for spec in layout.planes)


class Buffers:
    """Host pages, each cut into regions at the given page offsets, backed by separate buffers."""

    def __init__(self, layout: KVLayout, count: int, cuts: tuple[int, ...] = ()) -> None:
        self.page = layout.page_nbytes
        bounds = [0, *sorted(c for c in cuts if 0 < c < self.page), self.page]
        self.arrays: list[list[np.ndarray]] = []
        self.pages: list[list[HostRegion]] = []
        for _ in range(count):
            parts, regions = [], []
            for lo, hi in itertools.pairwise(bounds):
                a = np.full(hi - lo, 0xAB, dtype=np.uint8)
                parts.append(a)
                regions.append(HostRegion(lo, memoryview(a), int(a.ctypes.data), False))
            self.arrays.append(parts)
            self.pages.append(regions)

    def bytes(self, i: int) -> bytes:
        return b"".join(p.tobytes() for p in self.arrays[i])

    def fill(self, i: int, data: bytes) -> None:
        pos = 0
        for p in self.arrays[i]:
            p[:] = np.frombuffer(data[pos:pos + p.size], dtype=np.uint8)
            pos += p.size


@pytest.fixture
def engine() -> Any:
    eng = CpuCopyEngine()
    yield eng
    eng.close()


# -- round trips -----------------------------------------------------------------------------


@pytest.mark.parametrize("layout", [LAYOUT, SCALED, LATENT], ids=["kv", "scaled", "latent"])
@pytest.mark.parametrize("cuts", [(), (7,), (1, 100, 101, 250)], ids=["one", "two", "many"])
def test_save_restore_round_trip(engine: CpuCopyEngine, layout: KVLayout, cuts: tuple[int, ...]) -> None:
    arrays = make_arrays(layout, 16, seed=1)
    planes = KVPlanes.from_arrays(layout, arrays)
    ids = [11, 0, 5, 15, 3, 3]  # scattered, one repeated (a save may repeat)
    bufs = Buffers(layout, len(ids), cuts)
    h = engine.save(planes, ids, bufs.pages)
    assert h.wait() is True
    assert h.done()
    for i, b in enumerate(ids):
        assert bufs.bytes(i) == expected_page(layout, arrays, b)
    assert h.nbytes == len(ids) * layout.page_nbytes
    assert h.seconds is not None and h.seconds >= 0

    fresh = [np.zeros_like(a) for a in arrays]
    target = KVPlanes.from_arrays(layout, fresh)
    dst_ids = [2, 9, 14, 7, 1]
    h2 = engine.restore(bufs.pages[:5], target, dst_ids)
    h2.wait()
    for i, b in enumerate(dst_ids):
        assert expected_page(layout, fresh, b) == bufs.bytes(i)
    untouched = set(range(16)) - set(dst_ids)
    assert all(not fresh[p][b].any() for p in range(len(fresh)) for b in untouched)


def test_region_boundaries_everywhere(engine: CpuCopyEngine) -> None:
    """A cut at every byte offset of a small page moves the same bytes."""
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, page_tokens=2, dtype="int8", scale_dtype="int8")
    arrays = make_arrays(layout, 4, seed=2)
    planes = KVPlanes.from_arrays(layout, arrays)
    for cut in range(1, layout.page_nbytes):
        bufs = Buffers(layout, 2, (cut,))
        engine.save(planes, [3, 1], bufs.pages).wait()
        assert bufs.bytes(0) == expected_page(layout, arrays, 3)
        assert bufs.bytes(1) == expected_page(layout, arrays, 1)


def test_realistic_dtype_arrays_and_strided_planes(engine: CpuCopyEngine) -> None:
    """Planes as [blocks, tokens, heads, dim] float16, K and V interleaved in one array."""
    layout = LAYOUT
    rng = np.random.default_rng(3)
    per_layer = [rng.standard_normal((10, 2, 4, 2, 8)).astype(np.float16) for _ in range(layout.num_layers)]
    planes_list = [per_layer[spec.layer][:, 0 if spec.kind == "k" else 1] for spec in layout.planes]
    planes = KVPlanes.from_arrays(layout, planes_list)
    assert planes.block_strides[0] == 2 * layout.plane_nbytes
    bufs = Buffers(layout, 3, (33,))
    engine.save(planes, [9, 4, 0], bufs.pages).wait()
    for i, b in enumerate([9, 4, 0]):
        want = b"".join(per_layer[s.layer][b, 0 if s.kind == "k" else 1].tobytes() for s in layout.planes)
        assert bufs.bytes(i) == want


def test_torch_cpu_tensors(engine: CpuCopyEngine) -> None:
    torch = pytest.importorskip("torch")
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, page_tokens=4, dtype="bfloat16")
    gen = torch.Generator().manual_seed(4)
    caches = [torch.randn(2, 6, 4, 2, 4, generator=gen).to(torch.bfloat16) for _ in range(2)]  # vLLM [2, blocks, ...]
    tensors = [caches[s.layer][0 if s.kind == "k" else 1] for s in layout.planes]
    planes = KVPlanes.from_torch(layout, tensors)
    assert planes.device == -1 and planes.num_blocks == 6
    bufs = Buffers(layout, 2)
    engine.save(planes, [5, 2], bufs.pages).wait()

    def raw(t: Any) -> bytes:
        return bytes(t.contiguous().view(torch.uint8).numpy().tobytes())

    for i, b in enumerate([5, 2]):
        assert bufs.bytes(i) == b"".join(raw(t[b]) for t in tensors)
    zeros = [torch.zeros_like(c) for c in caches]
    target = KVPlanes.from_torch(layout, [zeros[s.layer][0 if s.kind == "k" else 1] for s in layout.planes])
    engine.restore(bufs.pages, target, [0, 1]).wait()
    assert torch.equal(zeros[1][1][0].view(torch.int16), caches[1][1][5].view(torch.int16))
    assert torch.equal(zeros[0][0][1].view(torch.int16), caches[0][0][2].view(torch.int16))


def test_page_regions_helper_and_contiguous_buffer(engine: CpuCopyEngine) -> None:
    arrays = make_arrays(LAYOUT, 8, seed=5)
    planes = KVPlanes.from_arrays(LAYOUT, arrays)
    buf = bytearray(LAYOUT.page_nbytes * 4)
    view = memoryview(buf)
    pages = page_regions(view, buffer_address(view), LAYOUT.page_nbytes, 4)
    engine.save(planes, [7, 6, 5, 4], pages).wait()
    for i, b in enumerate([7, 6, 5, 4]):
        assert bytes(buf[i * LAYOUT.page_nbytes:(i + 1) * LAYOUT.page_nbytes]) == expected_page(LAYOUT, arrays, b)
    with pytest.raises(CopyArgumentError):
        page_regions(view, buffer_address(view), LAYOUT.page_nbytes, 5)


def test_single_region_per_page_and_empty_request(engine: CpuCopyEngine) -> None:
    arrays = make_arrays(LAYOUT, 4, seed=6)
    planes = KVPlanes.from_arrays(LAYOUT, arrays)
    a = np.zeros(LAYOUT.page_nbytes, dtype=np.uint8)
    engine.save(planes, [2], [HostRegion(0, memoryview(a), int(a.ctypes.data), False)]).wait()
    assert a.tobytes() == expected_page(LAYOUT, arrays, 2)
    h = engine.save(planes, [], [])
    assert h.wait() and h.nbytes == 0


def test_same_direction_runs_in_submission_order(engine: CpuCopyEngine) -> None:
    arrays = [np.zeros_like(a) for a in make_arrays(LAYOUT, 4, seed=7)]
    planes = KVPlanes.from_arrays(LAYOUT, arrays)
    handles = []
    for value in range(1, 6):
        bufs = Buffers(LAYOUT, 1)
        bufs.fill(0, bytes([value]) * LAYOUT.page_nbytes)
        handles.append((engine.restore(bufs.pages, planes, [1]), bufs))
    handles[-1][0].wait()
    assert all(h.done() for h, _ in handles)
    assert all((a[1] == 5).all() for a in arrays)


def test_concurrent_callers(engine: CpuCopyEngine) -> None:
    arrays = make_arrays(LAYOUT, 64, seed=8)
    planes = KVPlanes.from_arrays(LAYOUT, arrays)
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        try:
            rng = np.random.default_rng(seed)
            for _ in range(20):
                ids = [int(x) for x in rng.choice(64, size=5, replace=False)]
                bufs = Buffers(LAYOUT, 5, (int(rng.integers(1, LAYOUT.page_nbytes)),))
                engine.save(planes, ids, bufs.pages).wait()
                for i, b in enumerate(ids):
                    assert bufs.bytes(i) == expected_page(LAYOUT, arrays, b)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


# -- handles ---------------------------------------------------------------------------------


def test_handle_timeout_and_failure(engine: CpuCopyEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    arrays = make_arrays(LAYOUT, 4, seed=9)
    planes = KVPlanes.from_arrays(LAYOUT, arrays)
    gate = threading.Event()
    engine._workers["save"].submit(gate.wait)  # hold the save worker
    bufs = Buffers(LAYOUT, 1)
    h = engine.save(planes, [0], bufs.pages)
    assert isinstance(h, TransferHandle)
    assert not h.done()
    assert h.wait(timeout=0.01) is False
    assert h.seconds is None and h.gbps is None
    gate.set()
    assert h.wait(timeout=30) is True
    assert h.gbps is not None or h.seconds == 0

    def boom(*args: object) -> None:
        raise OSError("simulated copy failure")

    monkeypatch.setattr(_cpu_engine, "_host_copy", boom)
    bad = engine.save(planes, [1], Buffers(LAYOUT, 1).pages)
    with pytest.raises(CopyEngineError, match="simulated copy failure"):
        bad.wait()
    assert bad.done() and bad.seconds is None
    with pytest.raises(CopyEngineError):
        bad.wait_on(None)
    assert bad.event is None


# -- errors ----------------------------------------------------------------------------------


def test_request_errors(engine: CpuCopyEngine) -> None:
    arrays = make_arrays(LAYOUT, 4, seed=10)
    planes = KVPlanes.from_arrays(LAYOUT, arrays)
    page = LAYOUT.page_nbytes
    good = Buffers(LAYOUT, 2).pages
    cases: list[tuple[Any, ...]] = [
        ([0, 4], good),  # block id out of range
        ([0, -1], good),
        ([0, True], good),  # bools are not block ids
        (["x", 1], good),
        ([0], good),  # page count mismatch
        ([0, 1], Buffers(LAYOUT, 1).pages),
        ([0], b"\0" * page),  # bytes are not a page list
    ]
    for ids, dst in cases:
        with pytest.raises(CopyArgumentError):
            engine.save(planes, ids, dst)
    a = np.zeros(page, dtype=np.uint8)
    addr = int(a.ctypes.data)
    view = memoryview(a)
    coverage_errors = [
        [HostRegion(0, view[:10], addr, False)],  # too short
        [HostRegion(0, view[:10], addr, False), HostRegion(11, view[11:], addr + 11, False)],  # gap
        [HostRegion(0, view[:10], addr, False), HostRegion(9, view[9:], addr + 9, False)],  # overlap
        [HostRegion(4, view[4:], addr + 4, False)],  # does not start at 0
        [HostRegion(0, view.toreadonly(), addr, False)],  # read-only for a save
        [HostRegion(0, view, 0, False)],  # null address
        ["not a region"],
    ]
    for regions in coverage_errors:
        with pytest.raises(CopyArgumentError):
            engine.save(planes, [0], [regions])
    # a read-only source region is fine for a restore
    engine.restore([[HostRegion(0, view.toreadonly(), addr, False)]], planes, [0]).wait()
    with pytest.raises(CopyArgumentError, match="distinct"):
        engine.restore(Buffers(LAYOUT, 2).pages, planes, [1, 1])
    with pytest.raises(CopyArgumentError, match="streams"):
        engine.save(planes, [0], Buffers(LAYOUT, 1).pages, after=123)
    with pytest.raises(CopyArgumentError, match="streams"):
        engine.restore(Buffers(LAYOUT, 1).pages, planes, [0], before=123)
    with pytest.raises(CopyArgumentError):
        engine.save("planes", [0], Buffers(LAYOUT, 1).pages)  # type: ignore[arg-type]
    frozen = [a.copy() for a in arrays]
    for f in frozen:
        f.flags.writeable = False
    ro = KVPlanes.from_arrays(LAYOUT, frozen)
    engine.save(ro, [1], Buffers(LAYOUT, 1).pages).wait()  # reading read-only planes is fine
    with pytest.raises(CopyArgumentError, match="read-only"):
        engine.restore(Buffers(LAYOUT, 1).pages, ro, [0])
    device_planes = KVPlanes(LAYOUT, planes.ptrs, planes.block_strides, 4, device=0)
    with pytest.raises(CopyArgumentError, match="host planes"):
        engine.save(device_planes, [0], Buffers(LAYOUT, 1).pages)
    # every error is also a ValueError and a CopyEngineError
    assert issubclass(CopyArgumentError, ValueError) and issubclass(CopyArgumentError, InvalidArgumentError)
    assert issubclass(CopyArgumentError, CopyEngineError)


def test_kvplanes_errors() -> None:
    arrays = make_arrays(LAYOUT, 4, seed=11)
    n = len(LAYOUT.planes)
    ok = KVPlanes.from_arrays(LAYOUT, arrays)
    with pytest.raises(CopyArgumentError):
        KVPlanes(LAYOUT, ok.ptrs[:-1], ok.block_strides, 4)
    with pytest.raises(CopyArgumentError):
        KVPlanes(LAYOUT, (0,) * n, ok.block_strides, 4)
    with pytest.raises(CopyArgumentError):
        KVPlanes(LAYOUT, (-5,) * n, ok.block_strides, 4)
    with pytest.raises(CopyArgumentError, match="overlap"):
        KVPlanes(LAYOUT, ok.ptrs, (1,) * n, 4)
    with pytest.raises(CopyArgumentError):
        KVPlanes(LAYOUT, ok.ptrs, ok.block_strides, 0)
    with pytest.raises(CopyArgumentError):
        KVPlanes(LAYOUT, ok.ptrs, ok.block_strides, 4, device=-2)
    with pytest.raises(CopyArgumentError):
        KVPlanes("layout", ok.ptrs, ok.block_strides, 4)  # type: ignore[arg-type]
    with pytest.raises(CopyArgumentError, match="past"):
        KVPlanes(LAYOUT, ok.ptrs, ok.block_strides, 5, extents=[(p, 4 * s) for p, s in zip(ok.ptrs, ok.block_strides,
                                                                                            strict=True)])
    with pytest.raises(CopyArgumentError):
        KVPlanes.from_arrays(LAYOUT, arrays[:-1])
    with pytest.raises(CopyArgumentError, match="blocks"):
        KVPlanes.from_arrays(LAYOUT, [*arrays[:-1], arrays[-1][:3]])
    with pytest.raises(CopyArgumentError, match="contiguous"):
        KVPlanes.from_arrays(LAYOUT, [a[:, ::2] for a in arrays])
    with pytest.raises(CopyArgumentError):
        KVPlanes.from_arrays(LAYOUT, [list(a) for a in arrays])
    with pytest.raises(CopyArgumentError):
        KVPlanes.from_torch(LAYOUT, arrays)
    assert "host" in repr(ok)


def test_closed_engine() -> None:
    eng = CpuCopyEngine()
    arrays = make_arrays(LAYOUT, 2, seed=12)
    planes = KVPlanes.from_arrays(LAYOUT, arrays)
    pending = eng.save(planes, [0], Buffers(LAYOUT, 1).pages)
    eng.close()
    assert pending.done()  # close finishes submitted work
    assert eng.closed
    with pytest.raises(ClosedError):
        eng.save(planes, [0], Buffers(LAYOUT, 1).pages)
    with pytest.raises(ClosedError):
        eng.restore(Buffers(LAYOUT, 1).pages, planes, [0])
    eng.close()  # idempotent
    with CpuCopyEngine() as ctx:
        ctx.save(planes, [1], Buffers(LAYOUT, 1).pages).wait()
    assert ctx.closed


def test_used_after_fork(engine: CpuCopyEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    from hostkv_providers import UsedAfterForkError

    planes = KVPlanes.from_arrays(LAYOUT, make_arrays(LAYOUT, 2, seed=15))
    real = os.getpid()
    monkeypatch.setattr(os, "getpid", lambda: real + 1)  # what a forked child sees
    with pytest.raises(UsedAfterForkError):
        engine.save(planes, [0], Buffers(LAYOUT, 1).pages)
    with pytest.raises(UsedAfterForkError):
        engine.restore(Buffers(LAYOUT, 1).pages, planes, [0])


def test_coalescing_of_host_copies() -> None:
    """Page-major staging + adjacent host pages merge into one copy; anything else splits."""
    page = LAYOUT.page_nbytes
    base = 1 << 40
    contiguous = [((0,), (base + i * page,), (page,)) for i in range(4)]
    assert CudaCopyEngine._coalesce(contiguous, 0, 4, page) == [(0, base, 4 * page)]
    assert CudaCopyEngine._coalesce(contiguous, 1, 3, page) == [(0, base + page, 2 * page)]
    reordered = [contiguous[i] for i in (0, 2, 1, 3)]
    assert CudaCopyEngine._coalesce(reordered, 0, 4, page) == [
        (0, base, page), (page, base + 2 * page, page), (2 * page, base + page, page),
        (3 * page, base + 3 * page, page)]
    split = ((0, 100), (base, base + 100), (100, page - 100))  # one page in two adjacent pieces
    far = ((0, 100), (base + 10 * page, base + 7 * page), (100, page - 100))  # two far-apart pieces
    assert CudaCopyEngine._coalesce([split, far], 0, 2, page) == [
        (0, base, page), (page, base + 10 * page, 100), (page + 100, base + 7 * page, page - 100)]
    assert CudaCopyEngine._coalesce([], 0, 0, page) == []


def test_coalescing_never_spans_two_pinned_allocations(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two pinned chunks can sit back to back in the address space; one DMA across both fails
    with CUDA_ERROR_INVALID_VALUE (seen on the H200 restoring pages that straddled two arena
    chunks), so the merge stops at every allocation this module registered."""
    page = LAYOUT.page_nbytes
    base = 1 << 40
    second = base + 2 * page  # where a second allocation starts, adjacent to the first
    monkeypatch.setattr(_cuda_staging, "_REGISTERED_STARTS", {base, second})
    pages = [((0,), (base + i * page,), (page,)) for i in range(4)]
    assert CudaCopyEngine._coalesce(pages, 0, 4, page) == [(0, base, 2 * page), (2 * page, second, 2 * page)]


# -- without CUDA ----------------------------------------------------------------------------


@pytest.mark.skipif(cuda_available(), reason="checks the no-CUDA fallback")
def test_no_cuda_fallbacks() -> None:
    from hostkv_providers.device import _cuda as _cuda
    assert cuda_available() is False
    assert _cuda.unavailable_reason()
    assert pinned_allocator() is None
    eng = default_copy_engine()
    assert isinstance(eng, CpuCopyEngine)
    eng.close()
    with pytest.raises(CopyEngineError, match="not usable"):
        CudaCopyEngine()
    with pytest.raises(CopyEngineError):
        _cuda.driver()
    provider = PinnedProvider(1 << 20, block=4096)  # falls back to ordinary memory
    assert provider.stats().extra["pinned"] is False
    provider.close()


def test_prefault_threads() -> None:
    size = 8 << 20
    mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = memoryview(mm)
    _hostmem._prefault(buffer_address(view), size, 4)
    assert view[0] == 0 and view[size - 1] == 0 and view[size // 2] == 0
    view.release()
    mm.close()


# -- staging ---------------------------------------------------------------------------------


def _chain(n: int) -> list[bytes]:
    salt = Salt(model_id="test", layout=LAYOUT)
    keys = [bytes(k) for k in chain_keys(salt, list(range(n * LAYOUT.page_tokens)))]
    assert len(keys) == n
    return keys


def test_staging_pool_round_trip(engine: CpuCopyEngine) -> None:
    arrays = make_arrays(LAYOUT, 32, seed=13)
    planes = KVPlanes.from_arrays(LAYOUT, arrays)
    page = LAYOUT.page_nbytes
    provider = PinnedProvider(page * 64, block=4096, allocator=OrdinaryAllocator())
    keys = _chain(11)
    ids = [3, 31, 7, 0, 12, 19, 25, 4, 8, 16, 2]
    with StagingPool(engine, page, pages_per_buffer=3, buffers=2) as pool:
        assert pool.save_to_provider(provider, keys, planes, ids, salt_tag="t") == 11
        for k, b in zip(keys, ids, strict=True):
            assert provider.read_bytes(k) == expected_page(LAYOUT, arrays, b)
        # dedup: saving again stores nothing new but reports the whole chain stored
        seals = provider.stats().seals
        assert pool.save_to_provider(provider, keys, planes, ids) == 11
        assert provider.stats().seals == seals
        fresh = [np.zeros_like(a) for a in arrays]
        target = KVPlanes.from_arrays(LAYOUT, fresh)
        dst = list(range(20, 31))
        with provider.lease(keys) as lease:
            assert lease.prefix_len == 11
            done = pool.restore_from_provider(provider, keys, target, dst)
            assert done.pages == 11
            assert done.wait()
        for k, b in zip(keys, dst, strict=True):
            assert expected_page(LAYOUT, fresh, b) == provider.read_bytes(k)
        # a miss stops the restore: evict the 6th page (and its subtree)
        provider.evict([keys[5]])
        fresh2 = [np.zeros_like(a) for a in arrays]
        res = pool.restore_from_provider(provider, keys, KVPlanes.from_arrays(LAYOUT, fresh2), dst)
        res.wait()
        assert res.pages == 5
        assert expected_page(LAYOUT, fresh2, dst[4]) == provider.read_bytes(keys[4])
        assert not any(f[dst[5]].any() for f in fresh2)
        with pytest.raises(CopyArgumentError):
            pool.restore_from_provider(provider, keys[:2], target, [1])
        small = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, page_tokens=4, dtype="float16")
        with pytest.raises(CopyArgumentError, match="bytes"):
            pool.save_to_provider(provider, keys[:1], KVPlanes.from_arrays(small, make_arrays(small, 2, 1)), [0])
    with pytest.raises(ClosedError):
        pool.restore_from_provider(provider, keys, target, dst)
    with pytest.raises(InvalidArgumentError):
        StagingPool(engine, page, buffers=1)
    provider.close()


def test_staging_pool_stops_when_chain_breaks(engine: CpuCopyEngine) -> None:
    arrays = make_arrays(LAYOUT, 8, seed=14)
    planes = KVPlanes.from_arrays(LAYOUT, arrays)
    page = LAYOUT.page_nbytes
    provider = PinnedProvider(page * 16, block=4096, allocator=OrdinaryAllocator())
    keys = _chain(4)
    other = provider.reserve(keys[0], None, page)  # another writer holds the root in flight
    assert other is not None
    with StagingPool(engine, page, pages_per_buffer=2) as pool:
        assert pool.save_to_provider(provider, keys, planes, [0, 1, 2, 3], in_flight_timeout=0.05) == 0
    other.abort()
    provider.close()
