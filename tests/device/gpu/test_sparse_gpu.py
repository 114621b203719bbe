"""Sparse attention on a real GPU: the device-mapped pinned arena, the NVRTC fetch / mirror /
in-place kernels, the device slot cache, CUDA-graph capture and replay, and fences that keep a
page's block from being reused while a kernel may still read it through the mapping.

Skipped without CUDA (and torch, which builds the pools).  Expected bytes come from host PRNG
pages and :func:`page_digest` on the host, independently of the kernels.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from hostkv_providers import KVLayout
from hostkv_providers.device import (
    KVPlanes,
    PageMover,
    PageTable,
    SlotCache,
    cuda_available,
    page_digest,
)
from hostkv_providers.errors import CopyArgumentError
from hostkv_providers.providers import MappedPinnedProvider, open_provider

torch = pytest.importorskip("torch")
if not cuda_available() or not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

pytestmark = pytest.mark.gpu

FP8 = KVLayout(num_layers=4, num_kv_heads=2, head_dim=128, page_tokens=16, dtype="float8_e4m3fn",
               scale_dtype="float32", scale_group=64)  # 4 KiB codes + 256 B scales per plane slice
ODD = KVLayout(num_layers=3, num_kv_heads=3, head_dim=5, page_tokens=3, dtype="int8", scale_dtype="float16")
LATENT = KVLayout(num_layers=6, num_kv_heads=1, head_dim=576, page_tokens=16, dtype="bfloat16", kinds=("kv",))


def block_for(layout: KVLayout) -> int:
    return -(-layout.page_nbytes // 4096) * 4096


def key(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8


def host_page(layout: KVLayout, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, layout.page_nbytes, dtype=np.uint8).tobytes()


def provider(layout: KVLayout, pages: int) -> MappedPinnedProvider:
    b = block_for(layout)
    return MappedPinnedProvider(pages * b, block=b, chunk=max(b, pages * b // 3 // b * b))


def store(p: MappedPinnedProvider, layout: KVLayout, ids: range, seed: int = 0) -> dict[int, bytes]:
    out = {}
    for i in ids:
        data = host_page(layout, seed + i)
        res = p.reserve(key(i), None, layout.page_nbytes)
        assert res is not None
        res.write(0, data)
        p.seal(res)
        out[i] = data
    return out


class Pool:
    """A device pool shaped like an engine's: one [slots, plane bytes] uint8 tensor per plane."""

    def __init__(self, layout: KVLayout, slots: int, fill: int = 0xA5) -> None:
        self.layout = layout
        self.tensors = [torch.full((slots, s.nbytes), fill, dtype=torch.uint8, device="cuda")
                        for s in layout.planes]
        self.planes = KVPlanes.from_torch(layout, self.tensors)

    def slot(self, s: int, layer: int | None = None) -> bytes:
        return b"".join(self.tensors[p.index][s].cpu().numpy().tobytes() for p in self.layout.planes
                        if layer is None or p.layer == layer)


def planes_of(layout: KVLayout, page: bytes, layer: int | None = None) -> bytes:
    return b"".join(page[s.offset: s.offset + s.nbytes] for s in layout.planes if layer is None or s.layer == layer)


def item_digest(layout: KVLayout, page: bytes, layer: int | None) -> int:
    masked = bytearray(layout.page_nbytes)
    for s in layout.planes:
        if layer is None or s.layer == layer:
            masked[s.offset: s.offset + s.nbytes] = page[s.offset: s.offset + s.nbytes]
    return page_digest(masked)


def dev(a: Any, dtype: Any = None) -> Any:
    return torch.as_tensor(np.asarray(a), device="cuda", dtype=dtype or torch.int32).contiguous()


# -- mapping -------------------------------------------------------------------------------


def test_mapped_url_and_in_place_reads() -> None:
    b = block_for(FP8)
    p = open_provider(f"pinned://?mapped=yes&budget={24 * b}&block={b}")
    try:
        assert isinstance(p, MappedPinnedProvider) and "device_mapped" in p.capability_names()
        pages = store(p, FP8, range(20))
        table = p.page_table()
        assert table.length == 24 and table.ptr
        with p.lease([key(i) for i in range(20)]) as lease:
            ptrs = p.device_pointers(lease, [key(i) for i in range(20)])
            assert (ptrs != 0).all()
            slots = p.slots(lease, [key(i) for i in range(20)])
            pool = Pool(FP8, 4)
            mover = PageMover(FP8, pool.planes, table, width=20)
            out = torch.zeros(20, dtype=torch.int64, device="cuda")
            mover.digest_pages(dev(slots), out)
            p.retire(lease, after=torch.cuda.current_stream())
            got = out.cpu().numpy().view(np.uint64).tolist()
        assert got == [page_digest(pages[i]) for i in range(20)]
        assert mover.errors() == 0
    finally:
        p.close()


@pytest.mark.parametrize("layout", [FP8, ODD, LATENT], ids=["fp8-group-scales", "odd-int8-scales", "latent-bf16"])
@pytest.mark.parametrize("per_layer", [False, True], ids=["whole-page", "per-layer"])
def test_fetch_random_selections(layout: KVLayout, per_layer: bool) -> None:
    p = provider(layout, 40)
    try:
        pages = store(p, layout, range(40), seed=100)
        rows, width, nslots = (layout.num_layers if per_layer else 1), 16, 24
        pool = Pool(layout, nslots)
        mover = PageMover(layout, pool.planes, p.page_table(), width=width, rows=rows, per_layer=per_layer)
        rng = np.random.default_rng(1)
        with p.lease([key(i) for i in range(40)]) as lease:
            slot_of = p.slots(lease, [key(i) for i in range(40)])
            for _ in range(3):
                chosen = np.stack([rng.choice(40, width, replace=False) for _ in range(rows)])
                ids = slot_of[chosen].astype(np.int32)
                ids[:, ::5] = -1  # padding
                into = np.stack([rng.choice(nslots, width, replace=False) for _ in range(rows)]).astype(np.int32)
                mover.fetch(dev(ids), dev(into))
                torch.cuda.synchronize()
                for r in range(rows):
                    layer = r if per_layer else None
                    for i in range(width):
                        if ids[r, i] >= 0:
                            assert pool.slot(int(into[r, i]), layer) == planes_of(layout, pages[int(chosen[r, i])],
                                                                                   layer)
                # the pool read and the in-place read agree, and equal the host digest
                a = torch.zeros(rows * width, dtype=torch.int64, device="cuda")
                b = torch.zeros(rows * width, dtype=torch.int64, device="cuda")
                mover.digest_pages(dev(ids), a)
                mover.digest_slots(dev(np.where(ids >= 0, into, -1)), b)
                want = [0 if ids[r, i] < 0 else item_digest(layout, pages[int(chosen[r, i])], r if per_layer else None)
                        for r in range(rows) for i in range(width)]
                assert a.cpu().numpy().view(np.uint64).tolist() == want
                assert b.cpu().numpy().view(np.uint64).tolist() == want
            p.retire(lease, after=torch.cuda.current_stream())
        assert mover.errors() == 0
    finally:
        p.close()


def test_bad_ids_are_never_followed() -> None:
    p = provider(FP8, 8)
    try:
        store(p, FP8, range(4))
        pool = Pool(FP8, 4, fill=0x33)
        mover = PageMover(FP8, pool.planes, p.page_table(), width=4)
        mover.fetch(dev([p.num_slots, 0, 1 << 30, 2]), dev([0, 7, 1, -1]))
        assert mover.errors() == 4
        assert all(bool((t == 0x33).all()) for t in pool.tensors)
        with pytest.raises(CopyArgumentError):
            mover.fetch(dev([0, 1, 2]), dev([0, 1, 2]))  # not the fixed shape
        with pytest.raises(CopyArgumentError):
            mover.fetch(dev([0, 1, 2, 3], torch.int64), dev([0, 1, 2, 3]))
    finally:
        p.close()


def test_write_through_mirror_codes_and_scales() -> None:
    p = provider(FP8, 16)
    try:
        pool = Pool(FP8, 8)
        g = torch.Generator(device="cuda").manual_seed(4)
        for t in pool.tensors:
            t.copy_(torch.randint(0, 256, t.shape, generator=g, device="cuda", dtype=torch.uint8))
        mover = PageMover(FP8, pool.planes, p.page_table(), width=8)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        h = p.mirror(mover, [(key(i), None) for i in range(6)], [7, 0, 3, 1, 6, 2], after=stream)
        h.wait()
        assert h.stored == [True] * 6
        out = bytearray(FP8.page_nbytes)
        for i, s in enumerate([7, 0, 3, 1, 6, 2]):
            assert p.read(key(i), out) and bytes(out) == pool.slot(s)
        assert p.verify().corrupt == []
    finally:
        p.close()


def test_graph_capture_resolve_fetch_attend() -> None:
    layout = FP8
    npages, rows, width, nslots = 96, layout.num_layers, 12, 40
    p = provider(layout, npages)
    try:
        pages = store(p, layout, range(npages), seed=7)
        pool = Pool(layout, nslots)
        mover = PageMover(layout, pool.planes, p.page_table(), width=width, rows=rows, per_layer=True)
        cache = SlotCache(p.num_slots, nslots, width=width, rows=rows)
        lease = p.lease([key(i) for i in range(npages)])
        slot_of = p.slots(lease, [key(i) for i in range(npages)])
        page_of_slot = {int(s): i for i, s in enumerate(slot_of)}
        sel = torch.full((rows, width), -1, dtype=torch.int32, device="cuda")
        out_slots, fetch_ids, fetch_slots = (torch.empty_like(sel) for _ in range(3))
        digests = torch.zeros(rows * width, dtype=torch.int64, device="cuda")
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):  # warm-up outside the capture (module loads, allocations)
            cache.resolve(sel, out_slots, fetch_ids, fetch_slots)
            mover.fetch(fetch_ids, fetch_slots)
            mover.digest_slots(out_slots, digests)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            cache.resolve(sel, out_slots, fetch_ids, fetch_slots)
            mover.fetch(fetch_ids, fetch_slots)
            mover.digest_slots(out_slots, digests)
        rng = np.random.default_rng(2)
        prev = None
        for step in range(12):
            chosen = np.stack([rng.choice(npages, width, replace=False) for _ in range(rows)])
            if prev is not None and step % 2:
                chosen[:, : width // 2] = prev[:, : width // 2]  # hits
            prev = chosen
            sel.copy_(dev(slot_of[chosen]))
            graph.replay()
            torch.cuda.synchronize()
            got = digests.cpu().numpy().view(np.uint64).reshape(rows, width)
            o = out_slots.cpu().numpy()
            for r in range(rows):
                for i in range(width):
                    page = pages[int(chosen[r, i])]
                    assert got[r, i] == item_digest(layout, page, r)
                    assert pool.slot(int(o[r, i]), r) == planes_of(layout, page, r)
        resident = cache.resident()
        for r in range(rows):
            placed = resident[r][resident[r] >= 0]
            assert len(set(placed.tolist())) == len(placed)
            assert all(int(x) in page_of_slot for x in np.nonzero(resident[r] >= 0)[0])
        assert cache.errors() == 0 and mover.errors() == 0
        assert 0 < int(cache.misses().sum()) < 12 * rows * width  # the odd steps hit
        p.retire(lease, after=torch.cuda.current_stream())
    finally:
        p.close()


def test_fenced_block_is_not_reused_while_a_kernel_may_read_it() -> None:
    layout = FP8
    p = provider(layout, 8)
    try:
        pages = store(p, layout, range(8), seed=300)  # the arena is full
        pool = Pool(layout, 2, fill=0)
        mover = PageMover(layout, pool.planes, p.page_table(), width=1)
        stream = torch.cuda.Stream()
        lease = p.lease([key(3)])
        slot = int(p.slots(lease, [key(3)])[0])
        ids, into = dev([slot]), dev([0])
        with torch.cuda.stream(stream):
            torch.cuda._sleep(500_000_000)  # the read runs long after the host moves on
            mover.fetch(ids, into)
        p.retire(lease, after=stream)
        # The host fills the arena with new pages: every other block is evicted and rewritten,
        # the fenced one must not be (its bytes are still to be read through the mapping).
        taken = []
        for i in range(100, 107):
            res = p.reserve(key(i), None, layout.page_nbytes)
            assert res is not None
            taken.append(res.regions()[0].address)
            res.write(0, host_page(layout, i))
            p.seal(res)
        addr = int(p.slot_addresses()[slot])
        assert addr not in taken and p.present([key(3)])[0]
        assert p.poll() == 1  # still waiting on the kernel
        stream.synchronize()
        assert pool.slot(0) == planes_of(layout, pages[3])
        assert p.poll() == 0
        # after the fence, the block may hold a new page, and a fetch reads the new bytes
        p.evict([key(3)])
        res = p.reserve(key(200), None, layout.page_nbytes)
        assert res is not None and res.regions()[0].address == addr
        fresh = host_page(layout, 200)
        res.write(0, fresh)
        p.seal(res)
        mover.fetch(ids, dev([1]))
        torch.cuda.synchronize()
        assert pool.slot(1) == planes_of(layout, fresh)
    finally:
        p.close()


def test_close_waits_for_fences() -> None:
    p = provider(FP8, 4)
    pages = store(p, FP8, range(2))
    pool = Pool(FP8, 1, fill=0)
    mover = PageMover(FP8, pool.planes, p.page_table(), width=1)
    stream = torch.cuda.Stream()
    lease = p.lease([key(1)])
    ids = dev(p.slots(lease, [key(1)]))
    into = dev([0])
    with torch.cuda.stream(stream):
        torch.cuda._sleep(100_000_000)
        mover.fetch(ids, into)
    p.retire(lease, after=stream)
    p.close()  # must not unmap the arena under the pending read
    stream.synchronize()
    assert pool.slot(0) == planes_of(FP8, pages[1])


def test_page_table_on_device_memory_matches_host_mapped() -> None:
    """The HBM baseline of the benchmark: the same kernel through a table of device addresses."""
    layout = LATENT
    p = provider(layout, 6)
    try:
        pages = store(p, layout, range(6), seed=9)
        hbm = torch.tensor(np.frombuffer(b"".join(pages[i] for i in range(6)), np.uint8), device="cuda")
        table = PageTable([hbm.data_ptr() + i * layout.page_nbytes for i in range(6)], 0)
        pool = Pool(layout, 2)
        mover = PageMover(layout, pool.planes, table, width=6)
        out = torch.zeros(6, dtype=torch.int64, device="cuda")
        mover.digest_pages(dev(list(range(6))), out)
        assert out.cpu().numpy().view(np.uint64).tolist() == [page_digest(pages[i]) for i in range(6)]
        table.close()
    finally:
        p.close()


def test_copy_engine_saves_into_mapped_pages_and_fetch_reads_them() -> None:
    """The DMA alternative to the mirror kernel: CudaCopyEngine.save into mapped reservations."""
    from hostkv_providers.device import CudaCopyEngine

    layout = FP8
    p = provider(layout, 8)
    try:
        src = Pool(layout, 4)
        g = torch.Generator(device="cuda").manual_seed(8)
        for t in src.tensors:
            t.copy_(torch.randint(0, 256, t.shape, generator=g, device="cuda", dtype=torch.uint8))
        ress = [p.reserve(key(i), None, layout.page_nbytes) for i in range(4)]
        with CudaCopyEngine(0) as eng:
            eng.save(src.planes, [3, 1, 0, 2], [r.regions() for r in ress],  # type: ignore[union-attr]
                     after=torch.cuda.current_stream()).wait()
        for r in ress:
            r.mark_written()  # type: ignore[union-attr]
            p.seal(r)  # type: ignore[arg-type]
        dst = Pool(layout, 4, fill=0)
        mover = PageMover(layout, dst.planes, p.page_table(), width=4)
        with p.lease([key(i) for i in range(4)]) as lease:
            mover.fetch(dev(p.slots(lease, [key(i) for i in range(4)])), dev([0, 1, 2, 3]))
            p.retire(lease, after=torch.cuda.current_stream())
        torch.cuda.synchronize()
        assert [dst.slot(i) for i in range(4)] == [src.slot(b) for b in (3, 1, 0, 2)]
    finally:
        p.close()
