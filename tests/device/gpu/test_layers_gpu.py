"""Layer-wise restore on a real GPU: layer ``i``'s completion never fires before layer ``i``'s bytes
are in the blocks, and the whole handle (``before=``, ``wait_on``) still orders everything.

Each trial poisons the destination blocks, restores with ``layerwise=True`` and, right after the
call and with no host synchronisation, enqueues on the engine's stream, per layer ``i``:
``wait_layer_on(i, cs)`` then a kernel that counts bytes of layers ``0..i`` differing from the
expected pages into a device counter.  A negative control checks the *last* layer right behind
layer 0's wait and must see poison in some trial (the layers really complete one by one, and the
check would see bytes that are not there yet).  Host pages: adjacent in pinned memory (one pitched
copy per layer and chunk), shuffled (many small copies), several regions per page (piece by piece);
destination blocks in order and shuffled.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import hostkv_providers as hk
from hostkv_providers.cache import HostKVCache
from hostkv_providers.device import CudaCopyEngine, CudaHostAllocator, HostPages, HostRegion, cuda_available

torch = pytest.importorskip("torch")
if not cuda_available() or not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

pytestmark = pytest.mark.gpu

from ._pool import Pool, engine_for  # noqa: E402  (after the skips: it imports torch)

LAYOUT = hk.KVLayout(num_layers=8, num_kv_heads=8, head_dim=128, page_tokens=16, dtype="bfloat16")  # 512 KiB
SALT = hk.Salt("test/gpu-layers", LAYOUT)
PAGE = LAYOUT.page_nbytes
PAGES = 192
NBLOCKS = 2 * PAGES + 8
TRIALS = 100
L = LAYOUT.num_layers


@pytest.fixture(scope="module", params=["auto", "never", "batch", "batch-split", "shared-split"])
def engine(request: pytest.FixtureRequest) -> Iterator[CudaCopyEngine]:
    """The engine with direct DMA for runs of consecutive blocks (auto), for every page of a
    page-major restore by batch copies (batch; batch-split: each call's second half issued by the
    side thread; shared-split: every page-major restore shared with the staging path; their layer-wise
    restores are staged), and without it (never: staging only)."""
    with engine_for(request.param) as e:
        yield e


@pytest.fixture(scope="module")
def pool() -> Pool:
    return Pool(LAYOUT, NBLOCKS)


def host_copy_of(pool: Pool, blocks: list[int]) -> tuple[Any, np.ndarray]:
    """The pages of ``blocks`` packed into pinned host memory (page ``i`` at ``i * PAGE``)."""
    alloc = CudaHostAllocator(0).allocate(len(blocks) * PAGE)
    buf = np.frombuffer(alloc.view, dtype=np.uint8)
    idx = torch.tensor(blocks, device="cuda")
    packed = torch.cat([t[idx].reshape(len(blocks), -1) for t in pool.tensors], dim=1).view(torch.uint8)
    torch.cuda.synchronize()
    # planes are in layout order, so the concatenation per block is the packed page
    buf[:] = packed.cpu().numpy().reshape(-1)
    return alloc, buf


@pytest.mark.parametrize("order", ["adjacent", "shuffled_host", "regions"])
@pytest.mark.parametrize("blocks", ["in_order", "shuffled", "runs"])
def test_layer_event_never_fires_before_its_bytes(engine: CudaCopyEngine, pool: Pool, order: str,
                                                   blocks: str) -> None:
    rng = random.Random(f"{order}-{blocks}")
    src = list(range(PAGES))
    pool.fill_random(src, seed=3)
    alloc, _buf = host_copy_of(pool, src)
    try:
        perm = list(range(PAGES))
        if order == "shuffled_host":
            rng.shuffle(perm)  # page i comes from host page perm[i]: no two adjacent
        dst = list(range(PAGES, 2 * PAGES))
        if blocks == "shuffled":
            rng.shuffle(dst)
        elif blocks == "runs":  # runs of 40 consecutive blocks (direct under "auto"), the rest shuffled
            tail = dst[160:]
            rng.shuffle(tail)
            dst = dst[80:120] + dst[:40] + tail + dst[120:160] + dst[40:80]
        base = alloc.address
        if order == "regions":
            cut = PAGE // 3 + 16  # a region boundary inside a layer
            view = alloc.view
            pages: Any = [[HostRegion(0, view[i * PAGE: i * PAGE + cut], base + i * PAGE, True),
                           HostRegion(cut, view[i * PAGE + cut: (i + 1) * PAGE], base + i * PAGE + cut, True)]
                          for i in range(PAGES)]
        else:
            pages = HostPages(np.array([base + p * PAGE for p in perm], dtype=np.uint64), PAGE, pinned=True,
                              readonly=True, keepalive=alloc)
        expect_src = [perm[i] for i in range(PAGES)]  # block dst[i] must hold source block perm[i]
        expect = pool.gather(expect_src)
        idx = torch.tensor(dst, device="cuda")
        cs = torch.cuda.Stream()
        trials = TRIALS if order == "adjacent" else 10
        counts = []
        for _trial in range(trials):
            with torch.cuda.stream(cs):
                pool.poison(dst)
            cs.synchronize()
            h = engine.restore(pages, pool.planes, dst, layerwise=True)
            # the engine was idle: layer 0 was issued and recorded on this thread, in the call
            assert h._recorded is not None and h._recorded[0].is_set()  # type: ignore[attr-defined]
            row = []
            for i in range(L):
                h.wait_layer_on(i, cs)
                with torch.cuda.stream(cs):  # the engine's layer-i kernel, enqueued at once
                    row.append(pool.layer_mismatches(idx, expect, range(i + 1)))
            counts.append(row)
            h.wait()
        cs.synchronize()
        stale = [(t, i) for t, row in enumerate(counts) for i, c in enumerate(row) if int(c.item())]
        assert not stale, f"{len(stale)} layer checks read poison, first (trial, layer) {stale[:5]}"
        # the whole transfer: done means every layer
        with torch.cuda.stream(cs):
            pool.poison(dst)
        cs.synchronize()
        h = engine.restore(pages, pool.planes, dst, layerwise=True, before=cs)
        with torch.cuda.stream(cs):
            whole = pool.layer_mismatches(idx, expect, range(L))
        h.wait()
        cs.synchronize()
        assert int(whole.item()) == 0
        assert h.layer_event(L - 1) is not None and h.layer_done(0) and h.wait_layer(3, 1.0)
        if order == "adjacent" and blocks == "in_order":
            # negative control: right behind layer 0's wait, the last layer is not there yet
            control = []
            for _trial in range(10):
                with torch.cuda.stream(cs):
                    pool.poison(dst)
                cs.synchronize()
                h = engine.restore(pages, pool.planes, dst, layerwise=True)
                h.wait_layer_on(0, cs)
                with torch.cuda.stream(cs):
                    control.append(pool.layer_mismatches(idx, expect, range(L - 1, L)))
                h.wait()
            cs.synchronize()
            assert sum(int(c.item()) > 0 for c in control) > 0, "the last layer was always there with layer 0"
    finally:
        torch.cuda.synchronize()
        alloc.close()


def test_layers_range_writes_only_those_layers(engine: CudaCopyEngine, pool: Pool) -> None:
    src = list(range(PAGES))
    pool.fill_random(src, seed=6)
    alloc, _buf = host_copy_of(pool, src)
    try:
        dst = list(range(PAGES, 2 * PAGES))
        expect = pool.gather(src)
        idx = torch.tensor(dst, device="cuda")
        pages = HostPages(np.arange(PAGES, dtype=np.uint64) * PAGE + alloc.address, PAGE, pinned=True, readonly=True)
        pool.poison(dst)
        torch.cuda.synchronize()
        h = engine.restore(pages, pool.planes, dst, layers=range(2, 5))
        h.wait()
        for i in range(L):
            if i in range(2, 5):
                assert int(pool.layer_mismatches(idx, expect, range(i, i + 1)).item()) == 0, i
            else:  # untouched: still all poison
                assert bool((pool.bytes[i][:, idx] == 0xEE).all()), i
        assert h.layer_seconds(4) is not None and 0 < h.layer_seconds(2) <= h.layer_seconds(4)
        with pytest.raises(hk.errors.CopyArgumentError):
            h.layer_event(0)
    finally:
        torch.cuda.synchronize()
        alloc.close()


def test_page_major_restore_completes_every_layer_with_the_whole(engine: CudaCopyEngine, pool: Pool) -> None:
    src = list(range(PAGES))
    pool.fill_random(src, seed=5)
    alloc, _buf = host_copy_of(pool, src)
    try:
        dst = list(range(PAGES, 2 * PAGES))
        expect = pool.gather(src)
        idx = torch.tensor(dst, device="cuda")
        cs = torch.cuda.Stream()
        pages = HostPages(np.arange(PAGES, dtype=np.uint64) * PAGE + alloc.address, PAGE, pinned=True, readonly=True)
        for _trial in range(20):
            with torch.cuda.stream(cs):
                pool.poison(dst)
            cs.synchronize()
            h = engine.restore(pages, pool.planes, dst)
            h.wait_layer_on(0, cs)  # without layerwise: layer 0 is the whole restore
            with torch.cuda.stream(cs):
                bad = pool.layer_mismatches(idx, expect, range(L))
            h.wait()
            cs.synchronize()
            assert int(bad.item()) == 0
            assert h.layer_event(0) == h.event
    finally:
        torch.cuda.synchronize()
        alloc.close()


@pytest.mark.parametrize("kind", ["pinned", "mmap"])
def test_cache_layerwise_restore_orders_each_layer(engine: CudaCopyEngine, pool: Pool, kind: str,
                                                    tmp_path: Any) -> None:
    """HostKVCache.restore(layerwise=True): pinned views go as one layer-major transfer; mmap (bounce
    buffers) completes every layer with the whole restore; both never show a layer early, and
    ``before=`` still orders the stream behind everything."""
    if kind == "pinned":
        provider = hk.open(f"pinned://?budget=256MiB&block={PAGE}&background=false")
    else:
        provider = hk.open(f"mmap://{tmp_path}/mmap?budget=256MiB&durability=none")
    src = list(range(PAGES))
    dst = list(range(PAGES, 2 * PAGES))
    try:
        with HostKVCache(provider, SALT, engine, chunk_pages=32) as cache:
            keys = cache.keys(list(range(PAGES * LAYOUT.page_tokens)))
            pool.fill_random(src, seed=9)
            torch.cuda.synchronize()
            assert cache.save(keys, pool.planes, src).wait().stored == PAGES
            expect = pool.gather(src)
            idx = torch.tensor(dst, device="cuda")
            cs = torch.cuda.Stream()
            counts = []
            trials = TRIALS if kind == "pinned" else 20
            for _trial in range(trials):
                with torch.cuda.stream(cs):
                    pool.poison(dst)
                cs.synchronize()
                h = cache.restore(cache.lookup(keys), pool.planes, dst, layerwise=True)
                row = []
                for i in range(L):
                    h.wait_layer_on(i, cs)  # often before the restore thread issued anything
                    with torch.cuda.stream(cs):
                        row.append(pool.layer_mismatches(idx, expect, range(i + 1)))
                counts.append(row)
                assert h.wait().pages == PAGES
            cs.synchronize()
            stale = sum(int(c.item()) > 0 for row in counts for c in row)
            assert stale == 0, f"{kind}: {stale} layer checks read poison"
            # pinned: one layer-major transfer of every layer (the whole hit's views in one call);
            # mmap: chunk by chunk
            assert len(h._transfers) == (1 if kind == "pinned" else PAGES // 32)
            whole = []
            for _trial in range(20):
                with torch.cuda.stream(cs):
                    pool.poison(dst)
                cs.synchronize()
                h = cache.restore(cache.lookup(keys), pool.planes, dst, layerwise=True, before=cs)
                with torch.cuda.stream(cs):
                    whole.append(pool.layer_mismatches(idx, expect, range(L)))
                h.wait()
            cs.synchronize()
            assert sum(int(c.item()) > 0 for c in whole) == 0
    finally:
        provider.close()


@pytest.mark.parametrize("direct", ["never", "batch"])
def test_prestaged_restores_and_refusals(pool: Pool, direct: str) -> None:
    """A layer-wise restore from pinned views stages layer 0's first chunks before its block ids
    are checked (``CudaCopyEngine.prestage``): those copies write the engine's staging only.  A
    restore refused after them (repeated, out-of-range or non-int block ids) raises its typed error,
    leaves the blocks untouched and the issue lock free; the next restore is exact; prestaged
    copies of other pages are never scattered (``prestaged=`` for pages that do not match).
    ``direct="batch"`` stages layer-wise restores (batch copies are for whole pages), so prestage
    applies there too."""
    engine = CudaCopyEngine(0, direct=direct)
    provider = hk.open(f"pinned://?budget=256MiB&block={PAGE}&background=false")
    src = list(range(PAGES))
    dst = list(range(PAGES, 2 * PAGES))
    idx = torch.tensor(dst, device="cuda")
    cs = torch.cuda.Stream()
    calls: list[Any] = []
    real = engine.prestage

    def spy(*a: Any, **k: Any) -> Any:
        pre = real(*a, **k)
        calls.append(pre)
        return pre

    engine.prestage = spy  # type: ignore[method-assign]
    try:
        with HostKVCache(provider, SALT, engine) as cache:
            keys = cache.keys(list(range(PAGES * LAYOUT.page_tokens)))
            pool.fill_random(src, seed=11)
            torch.cuda.synchronize()
            assert cache.save(keys, pool.planes, src).wait().stored == PAGES
            expect = pool.gather(src)
            bad_tables: list[Any] = [[*dst[:-1], dst[0]], [*dst[:-1], NBLOCKS + 5], [*dst[:-1], 1.5], [*dst[:-1], -1]]
            for bad in bad_tables:
                with torch.cuda.stream(cs):
                    pool.poison(dst)
                cs.synchronize()
                calls.clear()
                with pytest.raises(hk.errors.InvalidArgumentError):  # at the call, or (repeats) from wait()
                    cache.restore(cache.lookup(keys), pool.planes, bad, layerwise=True).wait()
                assert calls and calls[0] is not None, "the refused restore was prestaged first"
                assert not engine._issue_locks["restore"].locked()
                torch.cuda.synchronize()
                assert all(bool((b[:, idx] == 0xEE).all()) for b in pool.bytes), "a refused restore wrote blocks"
                # the next restore (prestaged too) is exact, layer by layer
                h = cache.restore(cache.lookup(keys), pool.planes, dst, layerwise=True)
                h.wait_layer_on(0, cs)
                with torch.cuda.stream(cs):
                    first = pool.layer_mismatches(idx, expect, range(1))
                h.wait_layer_on(L - 1, cs)
                with torch.cuda.stream(cs):
                    every = pool.layer_mismatches(idx, expect, range(L))
                assert h.wait().pages == PAGES
                cs.synchronize()
                assert int(first.item()) == 0 and int(every.item()) == 0
            # a ranged restore: pages [40, 140) of the hit into 100 shuffled blocks
            part = dst[:100]
            random.Random(5).shuffle(part)
            with torch.cuda.stream(cs):
                pool.poison(dst)
            cs.synchronize()
            calls.clear()
            h = cache.restore(cache.lookup(keys), pool.planes, part, first_page=40, layerwise=True, before=cs)
            with torch.cuda.stream(cs):
                ranged = pool.mismatches(part, pool_slice(expect, list(range(40, 140))))
            h.wait()
            cs.synchronize()
            assert calls and calls[0] is not None and int(ranged.item()) == 0
        # the engine alone: prestaged copies of other pages are not scattered into these blocks
        alloc, _buf = host_copy_of(pool, src)
        other, _obuf = host_copy_of(pool, list(reversed(src)))
        try:
            pages = HostPages(np.arange(PAGES, dtype=np.uint64) * PAGE + alloc.address, PAGE, pinned=True,
                              readonly=True)
            wrong = HostPages(np.arange(PAGES, dtype=np.uint64) * PAGE + other.address, PAGE, pinned=True,
                              readonly=True)
            for _trial in range(10):
                with torch.cuda.stream(cs):
                    pool.poison(dst)
                cs.synchronize()
                pre = real(wrong, LAYOUT, PAGES)
                assert pre is not None
                h = engine.restore(pages, pool.planes, dst, layerwise=True, prestaged=pre, before=cs)
                with torch.cuda.stream(cs):
                    bad = pool.layer_mismatches(idx, expect, range(L))
                h.wait()
                cs.synchronize()
                assert int(bad.item()) == 0 and not engine._issue_locks["restore"].locked()
            pre = real(pages, LAYOUT, PAGES)
            assert pre is not None and engine._issue_locks["restore"].locked()
            pre.release()
            pre.release()  # once
            assert not engine._issue_locks["restore"].locked()
        finally:
            torch.cuda.synchronize()
            alloc.close()
            other.close()
    finally:
        provider.close()
        engine.close()


def pool_slice(expect: list[Any], pages: list[int]) -> list[Any]:
    """``expect`` (per plane, ``[2, n, ...]`` by source page) cut to ``pages``."""
    sel = torch.tensor(pages, device="cuda")
    return [e[:, sel] for e in expect]
