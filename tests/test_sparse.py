"""Sparse-attention bookkeeping on the CPU: group-wise scale layouts, the host-mapped pinned arena
(slots, fences, the write-through mirror), the host page mover and the host slot cache.

The GPU counterparts (real device mapping, the NVRTC kernels, graph capture) are in
``tests/gpu/test_sparse_gpu.py``.  Expected bytes come from a PRNG seeded per page, never from
the code under test.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hostkv_providers import KVLayout
from hostkv_providers.device import (
    CpuCopyEngine,
    CpuPageMover,
    CpuSlotCache,
    DeviceMappingError,
    KVPlanes,
    PageTable,
    cuda_available,
    page_digest,
    page_regions,
)
from hostkv_providers.errors import CapacityError, CopyArgumentError, HostKVError, InvalidArgumentError
from hostkv_providers.providers import MappedPinnedProvider, Provider, open_provider
from hostkv_providers.testing import ProviderTests

FP8_GROUPED = KVLayout(num_layers=3, num_kv_heads=2, head_dim=128, page_tokens=4, dtype="float8_e4m3fn",
                       scale_dtype="float32", scale_group=64)
INT8_BLOCK = KVLayout(num_layers=2, num_kv_heads=3, head_dim=64, page_tokens=8, dtype="int8",
                      scale_dtype="float16", scale_block_tokens=8)
LATENT = KVLayout(num_layers=4, num_kv_heads=1, head_dim=96, page_tokens=4, dtype="bfloat16", kinds=("kv",))


def page_bytes(layout: KVLayout, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, layout.page_nbytes, dtype=np.uint8).tobytes()


def key(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8


class Fence:
    """An engine's epoch fence: passes when the engine says so."""

    def __init__(self) -> None:
        self.passed = False

    def done(self) -> bool:
        return self.passed


def host_pool(layout: KVLayout, slots: int, fill: int = 0) -> tuple[KVPlanes, list[np.ndarray]]:
    arrays = [np.full((slots, s.nbytes), fill, np.uint8) for s in layout.planes]
    return KVPlanes.from_arrays(layout, arrays), arrays


def slot_bytes(layout: KVLayout, arrays: list[np.ndarray], slot: int, layer: int | None = None) -> bytes:
    return b"".join(arrays[s.index][slot].tobytes() for s in layout.planes if layer is None or s.layer == layer)


def plane_bytes(layout: KVLayout, page: bytes, layer: int | None = None) -> bytes:
    return b"".join(page[s.offset: s.offset + s.nbytes] for s in layout.planes if layer is None or s.layer == layer)


def store(provider: MappedPinnedProvider, layout: KVLayout, n: int, seed: int = 0) -> list[bytes]:
    pages = [page_bytes(layout, seed + i) for i in range(n)]
    for i, data in enumerate(pages):
        res = provider.reserve(key(i), None, layout.page_nbytes)
        assert res is not None
        res.write(0, data)
        provider.seal(res)
    return pages


# -- layouts -------------------------------------------------------------------------------


def test_group_scales_size_and_order() -> None:
    lay = FP8_GROUPED
    assert lay.scale_shape == (4, 2, 2)
    assert lay.scale_nbytes == 4 * 2 * 2 * 4
    assert lay.page_nbytes == 3 * 2 * (4 * 2 * 128 + 64)
    kinds = [s.kind for s in lay.planes[:4]]
    assert kinds == ["k", "k_scale", "v", "v_scale"]
    assert INT8_BLOCK.scale_shape == (1, 3, 1) and INT8_BLOCK.scale_nbytes == 6
    offsets = [s.offset for s in INT8_BLOCK.planes]
    assert offsets == sorted(offsets) and INT8_BLOCK.planes[-1].offset + INT8_BLOCK.planes[-1].nbytes == \
        INT8_BLOCK.page_nbytes


def test_existing_layouts_keep_their_description() -> None:
    old = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, page_tokens=4, dtype="int8", scale_dtype="float16")
    assert "scale_group" not in old.describe() and "scale_block_tokens" not in old.describe()
    assert old.scale_shape == (4, 2, 1) and old.scale_nbytes == 4 * 2 * 2
    grouped = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, page_tokens=4, dtype="int8",
                       scale_dtype="float16", scale_group=8)
    # the same bytes as per-head scales, but a different description (salt): never shared keys
    assert grouped.page_nbytes == old.page_nbytes and grouped.describe() != old.describe()


@pytest.mark.parametrize("kwargs", [
    {"scale_group": 64},  # no scale_dtype
    {"scale_dtype": "float32", "scale_group": 48},  # not a divisor of 128
    {"scale_dtype": "float32", "scale_block_tokens": 3},
    {"scale_dtype": "float32", "scale_group": 0},
    {"scale_dtype": "float32", "scale_group": True},
])
def test_group_scale_validation(kwargs: dict[str, object]) -> None:
    with pytest.raises(InvalidArgumentError):
        KVLayout(num_layers=1, num_kv_heads=1, head_dim=128, page_tokens=16, dtype="int8", **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("layout", [FP8_GROUPED, INT8_BLOCK], ids=["fp8-group64", "int8-per-block"])
def test_group_scale_pages_round_trip_through_the_copy_engine(layout: KVLayout) -> None:
    planes, arrays = host_pool(layout, 6)
    rng = np.random.default_rng(7)
    for a in arrays:
        a[:] = rng.integers(0, 256, a.shape, dtype=np.uint8)
    before = [slot_bytes(layout, arrays, b) for b in range(6)]
    buf = np.zeros(4 * layout.page_nbytes, np.uint8)
    view, addr = memoryview(buf).cast("B"), int(buf.ctypes.data)
    with CpuCopyEngine() as eng:
        eng.save(planes, [5, 0, 3, 1], page_regions(view, addr, layout.page_nbytes, 4)).wait()
        assert [buf[i * layout.page_nbytes:(i + 1) * layout.page_nbytes].tobytes() for i in range(4)] == \
            [before[5], before[0], before[3], before[1]]
        for a in arrays:
            a[:] = 0
        eng.restore(page_regions(view, addr, layout.page_nbytes, 4), planes, [2, 4, 0, 5]).wait()
    assert [slot_bytes(layout, arrays, b) for b in (2, 4, 0, 5)] == [before[5], before[0], before[3], before[1]]


# -- the mapped provider -------------------------------------------------------------------


@pytest.mark.skipif(cuda_available(), reason="mapping is possible here")
def test_mapping_without_cuda_is_a_typed_error() -> None:
    with pytest.raises(DeviceMappingError) as info:
        MappedPinnedProvider(1 << 20, block=64 << 10)
    assert isinstance(info.value, HostKVError) and info.value.hint
    with pytest.raises(DeviceMappingError):
        open_provider("pinned://?mapped=yes&budget=1MiB")


def test_mapped_url_refuses_pageable_memory() -> None:
    with pytest.raises(InvalidArgumentError):
        open_provider("pinned://?mapped=yes&pin=no&budget=1MiB")
    with pytest.raises(InvalidArgumentError):
        open_provider("pinned://?device=1&budget=1MiB&pin=no")  # device= only with mapped=yes


@pytest.fixture
def host_mapped() -> MappedPinnedProvider:
    block = -(-FP8_GROUPED.page_nbytes // 4096) * 4096
    p = MappedPinnedProvider(16 * block, block=block, chunk=4 * block, device=-1)
    yield p
    p.close()


def test_capability_and_slots(host_mapped: MappedPinnedProvider) -> None:
    p = host_mapped
    assert "device_mapped" in MappedPinnedProvider.capability_names()
    assert p.num_slots == 16
    store(p, FP8_GROUPED, 5)
    addrs = p.slot_addresses()
    assert addrs.dtype == np.uint64 and len(addrs) == 16 and len(set(addrs.tolist())) == 16
    with p.lease([key(0), key(3), key(9)]) as lease:
        slots = p.slots(lease, [key(3), key(0), key(9), key(4)])
        assert slots[2] == -1 and slots[3] == -1  # not stored / not leased
        assert 0 <= slots[0] < 16 and 0 <= slots[1] < 16 and slots[0] != slots[1]
        ptr = p.device_pointer(lease, key(3))
        assert ptr == int(addrs[slots[0]])
        assert p.device_pointer(lease, key(4)) is None
        # the address holds the entry's bytes (host-mapped: the device address is the host's)
        view = p.view(lease, key(3))
        assert view is not None and view[0].address == ptr
    with pytest.raises(InvalidArgumentError):
        p.slots(lease, [key(0)])  # released


def test_a_scattered_entry_has_no_slot(host_mapped: MappedPinnedProvider) -> None:
    p, lay = host_mapped, FP8_GROUPED
    store(p, lay, 16)
    p.evict([key(i) for i in range(0, 16, 2)])  # free runs of one block each
    two = 2 * p.block_nbytes
    res = p.reserve(key(99), None, two)
    assert res is not None and len(res.regions()) == 2  # scattered over two runs
    res.write(0, b"x" * two)
    p.seal(res)
    p.evict([key(i) for i in range(1, 16, 2)])
    res = p.reserve(key(98), None, two)
    assert res is not None and len(res.regions()) == 1  # one contiguous run
    res.write(0, b"y" * two)
    p.seal(res)
    with p.lease([key(99), key(98)]) as lease:
        slots = p.slots(lease, [key(99), key(98)])
        assert slots[0] == -1 and slots[1] >= 0
        assert p.device_pointer(lease, key(99)) is None
        assert p.device_pointer(lease, key(98)) == p.view(lease, key(98))[0].address  # type: ignore[index]


class TestHostMappedConformance(ProviderTests):
    """The mapped arena keeps the whole provider contract (host-mapped, so it runs on CPU)."""

    @staticmethod
    def _regions(provider: Provider, key: bytes) -> list[memoryview] | None:
        assert isinstance(provider, MappedPinnedProvider)
        regions = provider._entry_regions(key)
        return None if regions is None else [r.view for r in regions]

    def backdoor_read(self, provider: Provider, key: bytes) -> bytes | None:  # type: ignore[override]
        views = self._regions(provider, key)
        return None if views is None else b"".join(bytes(v) for v in views)

    def backdoor_corrupt(self, provider: Provider, key: bytes) -> None:  # type: ignore[override]
        views = self._regions(provider, key)
        assert views is not None, "backdoor_corrupt needs a stored key"
        views[0][17] ^= 0x5A

    def make_provider(self, tmp_path: Path, budget_bytes: int) -> Provider:
        return MappedPinnedProvider(budget_bytes, block=4096, device=-1, verify_reads=True)


def test_retired_pages_stay_until_their_fence_passes(host_mapped: MappedPinnedProvider) -> None:
    p, lay = host_mapped, FP8_GROUPED
    pages = store(p, lay, 16)  # the arena is full
    lease = p.lease([key(2), key(7)])
    held = p.slots(lease, [key(2), key(7)]).tolist()
    addrs = p.slot_addresses()
    fence = Fence()
    p.retire(lease, after=fence)
    lease.release()  # an early release after retire changes nothing: the fence ends the lease
    with pytest.raises(InvalidArgumentError):
        p.slots(lease, [key(2)])
    # new pages evict everything else, never the fenced ones, and never reuse their blocks
    for i in range(100, 140):
        res = p.reserve(key(i), None, lay.page_nbytes)
        assert res is not None
        assert res.regions()[0].address not in (addrs[held[0]], addrs[held[1]])
        res.write(0, page_bytes(lay, i))
        p.seal(res)
    assert p.present([key(2), key(7)]) == [True, True]
    out = bytearray(lay.page_nbytes)
    assert p.read(key(2), out) and bytes(out) == pages[2]
    assert p.stats().extra["retiring_leases"] == 1
    # every page fenced: a new page cannot evict any of them (leases win), and nothing is evicted
    rest = [key(i) for i in range(100, 140) if p.present([key(i)])[0]]
    lease2 = p.lease(rest)
    p.retire(lease2, after=fence)
    with pytest.raises(CapacityError):
        p.reserve(key(300), None, lay.page_nbytes)
    assert all(p.present(rest))
    fence.passed = True
    assert p.poll() == 0
    # now the pages are ordinary leaves again
    p.evict([key(2), key(7)])
    assert p.present([key(2), key(7)]) == [False, False]


@pytest.mark.parametrize("how", ["put_many", "reserve_many"])
def test_a_chain_run_counts_passed_fences_as_room(how: str) -> None:
    """A chain run (``put_many``'s run path, ``reserve_many``'s) polls the fences first, as a
    page's reservation does: with every other page leased, the room is the retired pages whose
    fence has passed, and the run takes it as one run (before, it found no room as a run and
    went page by page)."""
    from hostkv_providers.testing import chain
    from hostkv_providers.testing import page_bytes as chain_page

    P = 4096
    p = MappedPinnedProvider(8 * P, block=P, chunk=8 * P, device=-1)
    try:
        old = [key(i) for i in range(4)]
        new = [key(i) for i in range(10, 14)]
        for k in old + new:
            p.put(k, None, bytes(P))
        fence = Fence()
        p.retire(p.lease(old), after=fence)
        held = p.lease(new)  # (a lease polls the fences: taken before the fence passes)
        fence.passed = True  # (not polled yet: the four old blocks are still held)
        run = chain(f"fenced-{how}", 2)
        per_page = [0]
        orig = p._reserve_locked

        def counting(*a: object, **kw: object) -> object:
            per_page[0] += 1
            return orig(*a, **kw)  # type: ignore[arg-type]

        p._reserve_locked = counting  # type: ignore[method-assign,assignment]
        if how == "put_many":
            items = [(k, run[i - 1] if i else None, chain_page(k, P)) for i, k in enumerate(run)]
            assert p.put_many(items) == [True, True]
        else:
            rc = p.reserve_many(run, [None, run[0]], P)
            assert rc.run is not None and rc.error is None
            rc.abort()
        held.release()
        assert per_page[0] == 0  # (one run, no page-by-page fallback)
        assert p.present(new) == [True] * 4
    finally:
        p.close()


def test_corrupt_retired_page_keeps_its_block_until_the_fence(host_mapped: MappedPinnedProvider) -> None:
    p, lay = host_mapped, FP8_GROUPED
    store(p, lay, 3)
    lease = p.lease([key(1)])
    slot = int(p.slots(lease, [key(1)])[0])
    fence = Fence()
    p.retire(lease, after=fence)
    # flip a byte in the arena behind the provider's back, then let verify drop the entry
    addr = int(p.slot_addresses()[slot])
    import ctypes

    ctypes.c_uint8.from_address(addr).value ^= 0xFF
    report = p.verify(repair=True)
    assert report.dropped == 1 and not p.present([key(1)])[0]
    # while the fence is pending, no new page may take the dropped page's block
    got = []
    for i in range(40, 80):
        res = p.reserve(key(i), None, lay.page_nbytes)
        assert res is not None
        got.append(res.regions()[0].address)
        res.write(0, page_bytes(lay, i))
        p.seal(res)
    assert addr not in got
    assert p.stats().extra["limbo_entries"] == 1
    fence.passed = True
    p.poll()
    assert p.stats().extra["limbo_entries"] == 0



# -- the host page mover -------------------------------------------------------------------


@pytest.mark.parametrize("per_layer", [False, True], ids=["whole-page", "per-layer"])
def test_fetch_random_selections_exact(host_mapped: MappedPinnedProvider, per_layer: bool) -> None:
    p, lay = host_mapped, FP8_GROUPED
    pages = store(p, lay, 12, seed=50)
    rows, width, nslots = (lay.num_layers if per_layer else 1), 6, 8
    pool, arrays = host_pool(lay, nslots, fill=0xEE)
    table = p.page_table()
    mover = CpuPageMover(lay, pool, table, width=width, rows=rows, per_layer=per_layer)
    rng = np.random.default_rng(3)
    with p.lease([key(i) for i in range(12)]) as lease:
        slot_of_key = p.slots(lease, [key(i) for i in range(12)])
        for _ in range(5):
            chosen = np.stack([rng.choice(12, width, replace=False) for _ in range(rows)])
            ids = slot_of_key[chosen].astype(np.int32)
            ids[:, -1] = -1  # padding
            into = np.stack([rng.choice(nslots, width, replace=False) for _ in range(rows)]).astype(np.int32)
            mover.fetch(ids, into)
            for r in range(rows):
                for i in range(width - 1):
                    layer = r if per_layer else None
                    assert slot_bytes(lay, arrays, int(into[r, i]), layer) == \
                        plane_bytes(lay, pages[int(chosen[r, i])], layer)
            digests = mover.digest_slots(np.where(ids >= 0, into, -1).astype(np.int32))
            assert np.array_equal(digests, mover.digest_pages(ids))
        assert mover.errors() == 0
        p.retire(lease, after=None)


def test_fetch_never_follows_a_bad_id(host_mapped: MappedPinnedProvider) -> None:
    p, lay = host_mapped, FP8_GROUPED
    store(p, lay, 2)
    pool, arrays = host_pool(lay, 4, fill=0x11)
    mover = CpuPageMover(lay, pool, p.page_table(), width=4)
    mover.fetch(np.array([p.num_slots, 0, -1, 1], np.int32), np.array([0, 9, 2, -5], np.int32))
    assert mover.errors() == 3
    assert all(a.min() == 0x11 and a.max() == 0x11 for a in arrays)  # nothing was written
    with pytest.raises(CopyArgumentError):
        mover.fetch(np.zeros(3, np.int32), np.zeros(4, np.int32))  # the fixed shape


def test_digest_matches_host_reference(host_mapped: MappedPinnedProvider) -> None:
    p, lay = host_mapped, INT8_BLOCK
    q = MappedPinnedProvider(8 * 8192, block=8192, chunk=4 * 8192, device=-1)
    try:
        pages = store(q, lay, 3, seed=9)
        pool, _ = host_pool(lay, 2)
        mover = CpuPageMover(lay, pool, q.page_table(), width=3)
        with q.lease([key(0), key(1), key(2)]) as lease:
            ids = q.slots(lease, [key(2), key(0), key(1)]).astype(np.int32)
            d = mover.digest_pages(ids)
        assert d.tolist() == [page_digest(pages[2]), page_digest(pages[0]), page_digest(pages[1])]
    finally:
        q.close()
    del p


def test_write_through_mirror_codes_and_scales(host_mapped: MappedPinnedProvider) -> None:
    p, lay = host_mapped, FP8_GROUPED
    pool, arrays = host_pool(lay, 6)
    rng = np.random.default_rng(11)
    for a in arrays:
        a[:] = rng.integers(0, 256, a.shape, dtype=np.uint8)
    mover = CpuPageMover(lay, pool, p.page_table(), width=4)
    h = p.mirror(mover, [(key(1), None), (key(2), None), (key(3), None)], [4, 0, 2])
    h.wait()
    assert h.sealed and h.stored == [True, True, True]
    out = bytearray(lay.page_nbytes)
    for k, slot in ((1, 4), (2, 0), (3, 2)):
        assert p.read(key(k), out) and bytes(out) == slot_bytes(lay, arrays, slot)
    # a child of a mirrored page, and a repeat (dedup: not written again)
    h2 = p.mirror(mover, [(key(4), key(1)), (key(2), None)], [5, 1])
    h2.wait()
    assert h2.stored == [True, False]
    assert p.entry(key(4)).parent == key(1)  # type: ignore[union-attr]
    assert p.read(key(4), out) and bytes(out) == slot_bytes(lay, arrays, 5)
    # a parent that is not stored fails that page only
    h3 = p.mirror(mover, [(key(6), key(99))], [3])
    assert isinstance(h3.stored[0], HostKVError) and not p.present([key(6)])[0]


def test_page_table_validation() -> None:
    with pytest.raises(CopyArgumentError):
        PageTable([], -1)
    with pytest.raises(CopyArgumentError):
        PageTable([1, 2], -2)
    t = PageTable([4096, 8192], -1)
    assert t.length == 2 and t.ptr == 0


# -- the host slot cache -------------------------------------------------------------------


def check_cache(cache: CpuSlotCache, sel: np.ndarray, out: np.ndarray) -> None:
    resident = cache.resident()
    for r in range(cache.rows):
        for p, s in zip(sel[r].tolist(), out[r].tolist(), strict=True):
            if p < 0:
                assert s == -1
            else:
                assert s >= 0 and resident[r, p] == s and cache.page_of[r, s] == p
        placed = resident[r][resident[r] >= 0]
        assert len(set(placed.tolist())) == len(placed)  # no slot holds two pages


def test_slot_cache_hits_misses_and_duplicates() -> None:
    rows, width, npages, nslots = 2, 8, 64, 16
    cache = CpuSlotCache(npages, nslots, width=width, rows=rows)
    rng = np.random.default_rng(5)
    out, fids, fslots = (np.zeros((rows, width), np.int32) for _ in range(3))
    prev = None
    for step in range(40):
        sel = np.stack([rng.choice(npages, width, replace=False) for _ in range(rows)]).astype(np.int32)
        if prev is not None and step % 2:
            sel[:, : width // 2] = prev[:, : width // 2]  # half of the last step again: hits
        sel[0, -1] = sel[0, 0]  # a duplicate
        sel[1, -1] = -1  # padding
        before = cache.misses().copy()
        cache.resolve(sel, out, fids, fslots)
        check_cache(cache, sel, out)
        fetched = fids >= 0
        assert np.array_equal(fslots[fetched], out[fetched])
        assert (cache.misses() - before).tolist() == fetched.sum(axis=1).tolist()
        # a page fetched once per step even when selected twice
        assert fids[0].tolist().count(int(sel[0, 0])) <= 1
        if prev is not None and step % 2:
            assert not np.isin(fids[:, : width // 2], prev[:, : width // 2]).any()  # those were hits
        prev = sel
    assert cache.errors() == 0


def test_slot_cache_needs_room_for_a_selection() -> None:
    with pytest.raises(CopyArgumentError):
        CpuSlotCache(10, 4, width=8)


def test_host_mapped_url_and_retire_forms() -> None:
    block = -(-FP8_GROUPED.page_nbytes // 4096) * 4096
    p = open_provider(f"pinned://?mapped=yes&device=-1&budget={8 * block}&block={block}")
    try:
        assert isinstance(p, MappedPinnedProvider) and p.device == -1
        store(p, FP8_GROUPED, 2)
        lease = p.lease([key(0)])
        p.retire(lease, after=None)  # nothing in flight: released now
        assert lease.released and p.poll() == 0
        lease, fence = p.lease([key(1)]), Fence()
        p.retire(lease, after=fence)
        with pytest.raises(InvalidArgumentError):
            p.retire(lease, after=Fence())  # once
        with p.lease([key(0)]) as other, pytest.raises(InvalidArgumentError):
            p.retire(other, after=object())  # a host-mapped provider takes no streams
        fence.passed = True  # close() waits for every fence
    finally:
        p.close()


class BrokenFence:
    def done(self) -> bool:
        raise CopyArgumentError("the device faulted")


def test_failed_fence_releases_with_a_warning(host_mapped: MappedPinnedProvider) -> None:
    p = host_mapped
    store(p, FP8_GROUPED, 1)
    lease = p.lease([key(0)])
    p.retire(lease, after=Fence())
    p._retiring[0] = (BrokenFence(), lease)  # the fence's device went away
    with pytest.warns(UserWarning, match="fence failed"):
        assert p.poll() == 0
    p.evict([key(0)])
    assert not p.present([key(0)])[0]


def test_failed_mirror_aborts_its_pages(host_mapped: MappedPinnedProvider, monkeypatch: pytest.MonkeyPatch) -> None:
    p, lay = host_mapped, FP8_GROUPED
    pool, _ = host_pool(lay, 2)
    mover = CpuPageMover(lay, pool, p.page_table(), width=2)
    h = p.mirror(mover, [(key(1), None)], [0])
    assert h.sealed and p.present([key(1)])[0]  # host movers finish at once
    # the kernel of the next mirror fails (a faulted device): its pages are aborted, not sealed
    monkeypatch.setattr(p, "_launch_mirror", lambda *args: BrokenFence())
    h2 = p.mirror(mover, [(key(2), None), (key(3), key(1))], [1, 0])
    assert h2.sealed and all(isinstance(x, HostKVError) for x in h2.stored)
    assert p.present([key(2), key(3)]) == [False, False] and not p.in_flight(key(2))
