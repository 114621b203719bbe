"""Layer-wise restore on the CPU copy engine and through ``HostKVCache`` (no GPU needed).

A ``HostStream`` stands in for the engine's CUDA stream.  A job enqueued on it right after
``wait_layer_on(i, stream)`` must see layer ``i`` (and every earlier layer) of every page in the
blocks, never the poison they held before.  That layer ``i`` opens the stream *before* the rest
of the restore is done is shown without any timing: the copy of the later layers is held until
the stream job gated on layer 0 has run, which would deadlock (and time out) if layer 0 only
completed with the whole restore.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import hostkv_providers as hk
from hostkv_providers import KVLayout, PinnedProvider, Provider, Salt
from hostkv_providers.cache import HostKVCache
from hostkv_providers.device import CpuCopyEngine, HostPages, HostStream, KVPlanes, OrdinaryAllocator
from hostkv_providers.device import _cpu_engine as cpu_engine_mod
from hostkv_providers.errors import CopyArgumentError, InvalidArgumentError
from hostkv_providers.testing import engine_planes

LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=16, page_tokens=4, dtype="float32")
SALT = Salt("test/layers", LAYOUT)
PAGE = LAYOUT.page_nbytes
NBLOCKS = 40
PAGES = 12
POISON = 0xEE
LAST = LAYOUT.num_layers - 1


def planes(fill: int | None = None, seed: int = 0) -> list[np.ndarray]:
    return engine_planes(LAYOUT, NBLOCKS, fill=fill, seed=seed)


def layer_ok(arrays: Sequence[np.ndarray], expect: Sequence[np.ndarray], blocks: Sequence[int], upto: int) -> bool:
    """Layers ``0..upto`` of ``blocks`` hold the expected bytes (``expect`` indexed like ``blocks``)."""
    return all(np.array_equal(arrays[s.index][list(blocks)].view(np.uint8), expect[s.index].view(np.uint8))
               for s in LAYOUT.planes if s.layer <= upto)


def host_pages(src: Sequence[np.ndarray], blocks: Sequence[int]) -> tuple[HostPages, np.ndarray]:
    """The pages of ``blocks`` packed into one contiguous buffer, as ``HostPages``."""
    buf = np.empty(len(blocks) * PAGE, np.uint8)
    for i, b in enumerate(blocks):
        for s in LAYOUT.planes:
            buf[i * PAGE + s.offset: i * PAGE + s.offset + s.nbytes] = src[s.index][b].view(np.uint8).ravel()
    base = int(buf.ctypes.data)
    return HostPages(np.arange(len(blocks), dtype=np.uint64) * PAGE + base, PAGE, pinned=False, readonly=True,
                     keepalive=buf), buf


class HeldCopy:
    """Wraps the CPU engine's host copy: copies of planes of layer >= 1 wait for ``release``."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.calls: list[tuple[int, ...]] = []
        self._orig = cpu_engine_mod._host_copy

    def __call__(self, planes: Any, ids: Any, pages: Any, gather: bool, specs: Any = None) -> None:
        layers = tuple(sorted({s.layer for s in (specs or LAYOUT.planes)}))
        self.calls.append(layers)
        if not gather and max(layers) >= 1:
            assert self.release.wait(10), "the stream gated on layer 0 never ran before the later layers"
        self._orig(planes, ids, pages, gather, specs)


@pytest.fixture
def stream() -> Iterator[HostStream]:
    s = HostStream()
    yield s
    s.close()


@pytest.fixture
def engine() -> Iterator[CpuCopyEngine]:
    e = CpuCopyEngine()
    yield e
    e.close()


# ---------------------------------------------------------------------------------------------
# The engine
# ---------------------------------------------------------------------------------------------


def test_engine_layerwise_restore_is_byte_exact_and_moves_layer_major(engine: CpuCopyEngine,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    src = planes(seed=1)
    pages, _buf = host_pages(src, range(PAGES))
    dst = planes(fill=POISON)
    held = HeldCopy()
    held.release.set()
    monkeypatch.setattr(cpu_engine_mod, "_host_copy", held)
    ids = list(range(20, 20 + PAGES))
    h = engine.restore(pages, KVPlanes.from_arrays(LAYOUT, dst), ids, layerwise=True)
    assert h.wait(10)
    assert held.calls == [(0,), (1,), (2,), (3,)]  # one copy per layer, in layer order
    expect = [p[:PAGES] for p in src]
    assert layer_ok(dst, expect, ids, LAYOUT.num_layers - 1)
    assert h.num_layers == LAYOUT.num_layers
    assert all(h.layer_done(i) and h.wait_layer(i, 0) for i in range(LAYOUT.num_layers))
    assert h.layer_event(0) is None  # host copies have no CUDA events
    # a page-major restore: every layer completes with the whole transfer
    dst2 = planes(fill=POISON)
    h2 = engine.restore(pages, KVPlanes.from_arrays(LAYOUT, dst2), ids)
    assert h2.wait_layer(2, 10) and h2.done()
    assert layer_ok(dst2, expect, ids, LAYOUT.num_layers - 1)


@pytest.mark.parametrize("bad", [-1, 4, 1.0, True, "0", None])
def test_engine_layer_out_of_range_is_refused(engine: CpuCopyEngine, bad: Any) -> None:
    src = planes(seed=2)
    pages, _buf = host_pages(src, range(2))
    h = engine.restore(pages, KVPlanes.from_arrays(LAYOUT, planes(fill=0)), [0, 1], layerwise=True)
    h.wait(10)
    for call in (h.layer_done, h.wait_layer, h.layer_event, h.layer):
        with pytest.raises(CopyArgumentError):
            call(bad)
    with pytest.raises(CopyArgumentError):
        h.wait_layer_on(bad, None)


def test_engine_layerwise_must_be_a_bool(engine: CpuCopyEngine) -> None:
    pages, _buf = host_pages(planes(seed=3), range(1))
    with pytest.raises(CopyArgumentError):
        engine.restore(pages, KVPlanes.from_arrays(LAYOUT, planes(fill=0)), [0], layerwise=1)  # type: ignore[arg-type]


def test_engine_layer_gate_opens_before_the_later_layers(engine: CpuCopyEngine, stream: HostStream,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    src = planes(seed=4)
    pages, _buf = host_pages(src, range(PAGES))
    dst = planes(fill=POISON)
    held = HeldCopy()
    monkeypatch.setattr(cpu_engine_mod, "_host_copy", held)
    ids = list(range(PAGES))
    expect = [p[:PAGES] for p in src]
    gate = engine.gate(stream)  # the stream is held from here ...
    h = engine.restore(pages, KVPlanes.from_arrays(LAYOUT, dst), ids, layerwise=True)
    gate.open_after([h.layer(0)])  # ... until layer 0 is in place
    seen: list[bool] = []

    def layer0_kernel() -> None:
        seen.append(layer_ok(dst, expect, ids, 0))
        held.release.set()  # only now may the later layers be copied

    stream.enqueue(layer0_kernel)
    assert h.wait(15)
    assert stream.synchronize(10)
    assert seen == [True] and not stream.errors
    assert layer_ok(dst, expect, ids, LAYOUT.num_layers - 1)


def test_engine_failed_layerwise_restore_wakes_layer_waiters(engine: CpuCopyEngine,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*_a: Any, **_k: Any) -> None:
        raise OSError("copy failed")

    monkeypatch.setattr(cpu_engine_mod, "_host_copy", broken)
    pages, _buf = host_pages(planes(seed=5), range(2))
    h = engine.restore(pages, KVPlanes.from_arrays(LAYOUT, planes(fill=0)), [0, 1], layerwise=True)
    with pytest.raises(hk.errors.CopyEngineError):
        h.wait_layer(3, 10)
    assert h.layer_done(0) and h.done()


# ---------------------------------------------------------------------------------------------
# Through HostKVCache
# ---------------------------------------------------------------------------------------------


@pytest.fixture(params=["pinned", "mmap"])
def provider(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Provider]:
    if request.param == "pinned":
        p: Provider = PinnedProvider(4 << 20, block=PAGE, allocator=OrdinaryAllocator(huge_pages=False))
    else:
        p = hk.open(f"mmap://{tmp_path}/store?budget=4MiB&durability=none")
    yield p
    p.close()


def saved(cache: HostKVCache, src: list[np.ndarray]) -> list[hk.Key]:
    keys = cache.keys(list(range(PAGES * LAYOUT.page_tokens)))
    assert cache.save(keys, KVPlanes.from_arrays(LAYOUT, src), list(range(PAGES))).wait().stored == PAGES
    return keys


def test_cache_layer_waits_never_see_stale_blocks(provider: Provider, stream: HostStream) -> None:
    src = planes(seed=6)
    expect = [p[:PAGES] for p in src]
    engine = CpuCopyEngine()
    try:
        with HostKVCache(provider, SALT, engine, chunk_pages=5) as cache:
            keys = saved(cache, src)
            dst_ids = list(range(PAGES, 2 * PAGES))
            for _trial in range(20):
                dst = planes(fill=POISON)
                h = cache.restore(cache.lookup(keys), KVPlanes.from_arrays(LAYOUT, dst), dst_ids, layerwise=True)
                seen: list[tuple[int, bool]] = []
                for layer in range(LAYOUT.num_layers):
                    h.wait_layer_on(layer, stream)
                    stream.enqueue(lambda layer=layer, dst=dst, seen=seen: seen.append(
                        (layer, layer_ok(dst, expect, dst_ids, layer))))
                assert h.wait(10).pages == PAGES
                assert stream.synchronize(10)
                assert seen == [(i, True) for i in range(LAYOUT.num_layers)]
                assert all(h.layer_done(i) for i in range(LAYOUT.num_layers))
                assert h.wait_layer(3, 0)
            # pinned: one layer-major transfer of every layer (the views of the whole hit in one
            # call, through the lease's rows); mmap: chunk by chunk, page-major
            if isinstance(provider, PinnedProvider):
                assert len(h._transfers) == 1
                assert h._transfers[0].nbytes == PAGES * PAGE
            else:
                assert len(h._transfers) == -(-PAGES // 5) and all(t.layers is None for t in h._transfers)
    finally:
        engine.close()


def test_cache_layer_gate_opens_before_the_rest_of_the_restore(stream: HostStream,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Zero-copy pinned views: layer 0's gated job runs while the later layers are still held."""
    provider = PinnedProvider(4 << 20, block=PAGE, allocator=OrdinaryAllocator(huge_pages=False))
    engine = CpuCopyEngine()
    src = planes(seed=7)
    expect = [p[:PAGES] for p in src]
    try:
        with HostKVCache(provider, SALT, engine, chunk_pages=4) as cache:
            keys = saved(cache, src)
            held = HeldCopy()
            monkeypatch.setattr(cpu_engine_mod, "_host_copy", held)
            dst = planes(fill=POISON)
            ids = list(range(PAGES, 2 * PAGES))
            h = cache.restore(cache.lookup(keys), KVPlanes.from_arrays(LAYOUT, dst), ids, layerwise=True)
            h.wait_layer_on(0, stream)  # the restore thread may not have issued anything yet
            seen: list[bool] = []

            def layer0_kernel() -> None:
                seen.append(layer_ok(dst, expect, ids, 0))
                held.release.set()

            stream.enqueue(layer0_kernel)
            assert h.wait(15).pages == PAGES
            assert stream.synchronize(10)
            assert seen == [True]
            assert layer_ok(dst, expect, ids, LAYOUT.num_layers - 1)
    finally:
        engine.close()
        provider.close()


def test_cache_before_stream_still_orders_the_whole_restore(provider: Provider, stream: HostStream) -> None:
    src = planes(seed=8)
    expect = [p[:PAGES] for p in src]
    engine = CpuCopyEngine()
    try:
        with HostKVCache(provider, SALT, engine, chunk_pages=5) as cache:
            keys = saved(cache, src)
            ids = list(range(PAGES, 2 * PAGES))
            for _trial in range(10):
                dst = planes(fill=POISON)
                h = cache.restore(cache.lookup(keys), KVPlanes.from_arrays(LAYOUT, dst), ids, before=stream,
                                  layerwise=True)
                seen: list[bool] = []
                stream.enqueue(lambda dst=dst, seen=seen: seen.append(layer_ok(dst, expect, ids, LAST)))
                h.wait(10)
                assert stream.synchronize(10)
                assert seen == [True]
    finally:
        engine.close()


def test_cache_layer_api_misuse(stream: HostStream) -> None:
    provider = PinnedProvider(4 << 20, block=PAGE, allocator=OrdinaryAllocator(huge_pages=False))
    engine = CpuCopyEngine()
    try:
        with HostKVCache(provider, SALT, engine) as cache:
            keys = saved(cache, planes(seed=9))
            hit = cache.lookup(keys)
            with pytest.raises(InvalidArgumentError):
                cache.restore(hit, KVPlanes.from_arrays(LAYOUT, planes(fill=0)), list(range(PAGES)),
                              layerwise="yes")  # type: ignore[arg-type]
            h = cache.restore(hit, KVPlanes.from_arrays(LAYOUT, planes(fill=0)), list(range(PAGES)), layerwise=True)
            for bad in (-1, LAYOUT.num_layers, 0.5, True):
                for call in (h.layer_done, h.wait_layer, h.layer_event):
                    with pytest.raises(InvalidArgumentError):
                        call(bad)
                with pytest.raises(InvalidArgumentError):
                    h.wait_layer_on(bad, stream)
            h.wait(10)
            # an empty restore: every layer is complete at once
            empty = cache.restore(cache.lookup(cache.keys([99_999] * LAYOUT.page_tokens)),
                                  KVPlanes.from_arrays(LAYOUT, planes(fill=0)), [], layerwise=True)
            assert empty.layer_done(3) and empty.wait_layer(0, 0) and empty.layer_event(0) is None
            empty.wait_layer_on(1, stream)
            assert stream.synchronize(10)
    finally:
        engine.close()
        provider.close()


def test_engine_layers_range_writes_only_those_layers(engine: CpuCopyEngine) -> None:
    src = planes(seed=10)
    pages, _buf = host_pages(src, range(PAGES))
    dst = planes(fill=POISON)
    ids = list(range(PAGES))
    h = engine.restore(pages, KVPlanes.from_arrays(LAYOUT, dst), ids, layers=range(1, 3))
    assert h.wait(10) and h.layers == range(1, 3)
    assert h.moves_layer(1) and h.moves_layer(2) and not h.moves_layer(0) and not h.moves_layer(3)
    for s in LAYOUT.planes:
        got = dst[s.index][:PAGES].view(np.uint8)
        if s.layer in (1, 2):
            assert np.array_equal(got, src[s.index][:PAGES].view(np.uint8))
        else:
            assert (got == POISON).all()  # layers not asked for are left as they are
    for layer in (0, 3):  # a layer the transfer does not write is never reported complete
        for call in (h.layer_done, h.wait_layer, h.layer_event, h.layer):
            with pytest.raises(CopyArgumentError):
                call(layer)
    assert h.wait_layer(2, 0) and h.layer_done(1)


@pytest.mark.parametrize("bad", [range(0), range(2, 2), range(0, 5), range(0, 4, 2), range(-1, 2), [0, 1], (0, 1), 1])
def test_engine_bad_layers_are_refused(engine: CpuCopyEngine, bad: Any) -> None:
    pages, _buf = host_pages(planes(seed=11), range(1))
    with pytest.raises(CopyArgumentError):
        engine.restore(pages, KVPlanes.from_arrays(LAYOUT, planes(fill=0)), [0], layers=bad)


def test_cache_layerwise_falls_back_when_a_chunk_has_no_chunk_views(stream: HostStream,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole hit's views are refused: the restore goes chunk by chunk (page-major, each chunk's
    views taken on its own), and every layer then completes with the whole restore."""
    provider = PinnedProvider(4 << 20, block=PAGE, allocator=OrdinaryAllocator(huge_pages=False))
    engine = CpuCopyEngine()
    src = planes(seed=12)
    expect = [p[:PAGES] for p in src]
    try:
        with HostKVCache(provider, SALT, engine, chunk_pages=5) as cache:
            keys = saved(cache, src)
            real = provider.view_pages
            calls = [0]

            def flaky(lease: Any, ks: Any) -> Any:
                calls[0] += 1
                return None if calls[0] == 1 else real(lease, ks)

            monkeypatch.setattr(provider, "view_pages", flaky)
            dst = planes(fill=POISON)
            ids = list(range(PAGES, 2 * PAGES))
            h = cache.restore(cache.lookup(keys), KVPlanes.from_arrays(LAYOUT, dst), ids, layerwise=True)
            seen: list[tuple[int, bool]] = []
            for layer in range(LAYOUT.num_layers):
                h.wait_layer_on(layer, stream)
                stream.enqueue(lambda layer=layer: seen.append((layer, layer_ok(dst, expect, ids, layer))))
            r = h.wait(10)
            assert stream.synchronize(10)
            assert r.pages == PAGES and r.viewed == PAGES
            assert seen == [(i, True) for i in range(LAYOUT.num_layers)]
            assert calls[0] == 1 + -(-PAGES // 5)  # the refused whole-hit call, then one per chunk
            assert all(t.layers is None for t in h._transfers)
            assert layer_ok(dst, expect, ids, LAST)
            rep = provider.evict(keys[:1])  # every view lease is gone: nothing is left leased
            assert rep.entries == PAGES and rep.skipped == 0
    finally:
        engine.close()
        provider.close()


def test_cache_layerwise_verified_restore_truncates_at_a_flipped_byte() -> None:
    import ctypes

    provider = PinnedProvider(4 << 20, block=PAGE, allocator=OrdinaryAllocator(huge_pages=False), verify_reads=True)
    engine = CpuCopyEngine()
    src = planes(seed=13)
    try:
        with HostKVCache(provider, SALT, engine, chunk_pages=5) as cache:
            keys = saved(cache, src)
            ids = list(range(PAGES, 2 * PAGES))
            dst = planes(fill=POISON)
            ok = cache.restore(cache.lookup(keys), KVPlanes.from_arrays(LAYOUT, dst), ids, layerwise=True).wait(10)
            assert ok.pages == PAGES and ok.stopped is None
            for bad in (PAGES - 1, 7, 0):
                with provider.lease([keys[bad]]) as lease:
                    (reg,) = provider.view(lease, keys[bad])
                    byte = ctypes.c_uint8.from_address(reg.address + PAGE // 2 + 3)
                    byte.value ^= 0x04  # a flipped bit in the store's RAM
                r = cache.restore(cache.lookup(keys), KVPlanes.from_arrays(LAYOUT, planes(fill=0)), ids,
                                  layerwise=True).wait(10)
                assert r.pages == bad and r.stopped is not None and "checksum" in r.stopped, (bad, r)
                byte.value ^= 0x04
    finally:
        engine.close()
        provider.close()


def test_cache_hit_released_during_a_layerwise_restore_stays_pinned_until_it_is_done(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The layer-wise path reads through the hit's own lease: releasing the hit meanwhile
    (``release=False``, then ``hit.release()``) must not let its pages go before the copies."""
    provider = PinnedProvider(4 << 20, block=PAGE, allocator=OrdinaryAllocator(huge_pages=False))
    engine = CpuCopyEngine()
    src = planes(seed=14)
    expect = [p[:PAGES] for p in src]
    try:
        with HostKVCache(provider, SALT, engine, chunk_pages=5) as cache:
            keys = saved(cache, src)
            held = HeldCopy()
            monkeypatch.setattr(cpu_engine_mod, "_host_copy", held)
            dst = planes(fill=POISON)
            ids = list(range(PAGES, 2 * PAGES))
            hit = cache.lookup(keys)
            h = cache.restore(hit, KVPlanes.from_arrays(LAYOUT, dst), ids, layerwise=True, release=False)
            assert h.wait_layer(0, 10)  # layer 0 is in; layers 1.. are held back
            hit.release()
            assert hit.released
            rep = provider.evict(keys[:1])
            assert rep.entries == 0 and rep.skipped > 0  # still leased: the restore reads them
            held.release.set()
            assert h.wait(10).pages == PAGES
            assert layer_ok(dst, expect, ids, LAST)
            rep = provider.evict(keys[:1])
            assert rep.entries == PAGES and rep.skipped == 0
    finally:
        engine.close()
        provider.close()


def test_cache_ranged_layerwise_restore(stream: HostStream) -> None:
    """``first_page=`` with ``layerwise``: pages [4, 12) of the hit, each layer ordered on its own."""
    provider = PinnedProvider(4 << 20, block=PAGE, allocator=OrdinaryAllocator(huge_pages=False))
    engine = CpuCopyEngine()
    src = planes(seed=15)
    try:
        with HostKVCache(provider, SALT, engine, chunk_pages=3) as cache:
            keys = saved(cache, src)
            dst = planes(fill=POISON)
            ids = list(range(PAGES, PAGES + 8))
            expect = [p[4:PAGES] for p in src]
            h = cache.restore(cache.lookup(keys), KVPlanes.from_arrays(LAYOUT, dst), ids, first_page=4,
                              layerwise=True)
            seen: list[bool] = []
            for layer in range(LAYOUT.num_layers):
                h.wait_layer_on(layer, stream)
                stream.enqueue(lambda layer=layer: seen.append(layer_ok(dst, expect, ids, layer)))
            assert h.wait(10).pages == 8
            assert stream.synchronize(10)
            assert seen == [True] * LAYOUT.num_layers
            assert (dst[0][PAGES + 8:].view(np.uint8) == POISON).all()  # nothing else was written
    finally:
        engine.close()
        provider.close()


def test_cache_restore_of_one_chunk_issues_its_copy_on_the_callers_thread(stream: HostStream) -> None:
    """A restore of at most ``chunk_pages`` pages from chunk-level views (a ranged restore, a short
    hit) is handed to the engine before ``restore()`` returns, on the caller's thread, as one
    transfer; a longer one is issued chunk by chunk on the restore thread.  Both order ``before=``
    behind the bytes (the poisoned blocks are never seen by the gated job)."""
    provider = PinnedProvider(4 << 20, block=PAGE, allocator=OrdinaryAllocator(huge_pages=False))
    engine = CpuCopyEngine()
    src = planes(seed=17)
    callers: list[threading.Thread] = []
    inner = engine.restore

    def restore(*args: Any, **kwargs: Any) -> Any:
        callers.append(threading.current_thread())
        return inner(*args, **kwargs)

    engine.restore = restore  # type: ignore[method-assign]
    try:
        with HostKVCache(provider, SALT, engine, chunk_pages=4) as cache:
            keys = saved(cache, src)
            for first, count, on_caller in ((0, 4, True), (8, 3, True), (0, PAGES, False)):
                callers.clear()
                dst = planes(fill=POISON)
                ids = list(range(PAGES, PAGES + count))
                expect = [p[first : first + count] for p in src]
                h = cache.restore(cache.lookup(keys), KVPlanes.from_arrays(LAYOUT, dst), ids, first_page=first,
                                  before=stream)
                if on_caller:
                    assert callers == [threading.current_thread()]  # issued before restore() returned
                seen: list[bool] = []
                stream.enqueue(lambda dst=dst, ids=ids, expect=expect, seen=seen: seen.append(
                    layer_ok(dst, expect, ids, LAST)))
                assert h.wait(10).pages == count
                assert stream.synchronize(10) and seen == [True]
                if not on_caller:
                    assert len(callers) == 3 and threading.current_thread() not in callers  # a chunk each
    finally:
        engine.close()
        provider.close()


def test_a_restore_failing_after_its_copy_was_issued_reports_only_once_the_copy_is_done(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A layer-wise restore's copy is issued on the caller's thread; if the restore thread then
    fails (here: the GPU check of verified views cannot be set up), the handle reports the
    failure only once that copy is done — never while it still writes the engine's blocks or
    reads the hit's pages (the engine, told the restore failed, recomputes into those blocks)."""
    import hostkv_providers.cache._restore as restore_mod

    provider = PinnedProvider(4 << 20, block=PAGE, allocator=OrdinaryAllocator(huge_pages=False), verify_reads=True)
    engine = CpuCopyEngine()
    src = planes(seed=19)
    release = threading.Event()
    real_copy = cpu_engine_mod._host_copy

    def held(*args: Any, **kwargs: Any) -> Any:
        if not args[3]:  # gather=False: a restore's copy, held until the test lets it go
            assert release.wait(10)
        return real_copy(*args, **kwargs)

    def broken(planes: Any) -> Any:
        raise RuntimeError("the page hasher could not be built")

    try:
        with HostKVCache(provider, SALT, engine, chunk_pages=PAGES) as cache:
            keys = saved(cache, src)
            monkeypatch.setattr(cpu_engine_mod, "_host_copy", held)
            monkeypatch.setattr(restore_mod, "restore_check", broken)
            hit = cache.lookup(keys)
            dst = planes(fill=POISON)
            h = cache.restore(hit, KVPlanes.from_arrays(LAYOUT, dst), list(range(PAGES, 2 * PAGES)), layerwise=True)
            assert not h.wait_layer(0, 0.3) and not h.done()  # the copy still runs: nothing reported
            assert not hit.lease.released  # type: ignore[union-attr]  # its pages are still read
            release.set()
            with pytest.raises(RuntimeError, match="page hasher"):
                h.wait(10)
            assert hit.lease.released  # type: ignore[union-attr]
            assert layer_ok(dst, [p[:PAGES] for p in src], list(range(PAGES, 2 * PAGES)), LAST)  # copy done
    finally:
        release.set()
        engine.close()
        provider.close()


def test_a_restore_refused_on_the_callers_thread_leaves_no_gate_and_no_handle_behind(stream: HostStream) -> None:
    """``restore()`` raising after it registered its handle and gated ``before=`` (a hybrid
    cache refusing ``anchors_into``) finishes that handle: the stream is not left gated, the
    same restore asked again runs, and the hit stays the caller's (not released)."""
    layout_salt = Salt("test/layers-hybrid", LAYOUT, state_format="t/v1:float32")
    provider = PinnedProvider(4 << 20, block=PAGE, allocator=OrdinaryAllocator(huge_pages=False))
    engine = CpuCopyEngine()
    src = planes(seed=23)
    try:
        with HostKVCache(provider, layout_salt, engine, chunk_pages=4, required_anchors={"ssm"}) as cache:
            keys = cache.keys(list(range(PAGES * LAYOUT.page_tokens)))
            assert cache.save(keys, KVPlanes.from_arrays(LAYOUT, src), list(range(PAGES)),
                              anchors=lambda i: {"ssm": b"s%d" % i}).wait().stored == PAGES
            for count in (3, PAGES):  # one chunk (started on this thread), and several
                hit = cache.lookup(keys)
                assert hit.num_pages == PAGES
                dst = planes(fill=POISON)
                ids = list(range(PAGES, PAGES + count))
                with pytest.raises(InvalidArgumentError):
                    cache.restore(hit, KVPlanes.from_arrays(LAYOUT, dst), ids, before=stream,
                                  anchors_into={"ssm": b"read-only"})
                ran: list[bool] = []
                stream.enqueue(lambda ran=ran: ran.append(True))
                assert stream.synchronize(10) and ran == [True]  # not left gated
                assert not hit.released  # a refused call leaves the hit to its caller
                h = cache.restore(hit, KVPlanes.from_arrays(LAYOUT, dst), ids, before=stream)
                res = h.wait(10)  # finished: not coalesced into the refused handle
                assert res.viewed + res.staged == count  # (pages: cut back to a page with the anchor)
                assert hit.released
    finally:
        engine.close()
        provider.close()
