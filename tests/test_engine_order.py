"""Stream order (R9) through ``HostKVCache`` on the CPU copy engine, with a ``HostStream``
standing in for the engine's CUDA stream: jobs ("kernels") enqueued on the stream right after
``restore(before=stream)`` returns must see the restored bytes although the restore thread issues
its copies later; ``save(after=stream)`` reads the blocks as of the call.  Each provider path is
covered: zero-copy views and direct saves (pinned), bounce buffers (mmap), and the restore is
slowed down so that a missing gate shows up as poisoned bytes (the negative control proves it).
"""

from __future__ import annotations

import gc
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import hostkv_providers as hk
from hostkv_providers import KVLayout, PinnedProvider, Provider, Salt
from hostkv_providers.cache import HostKVCache
from hostkv_providers.device import CpuCopyEngine, HostStream, OrdinaryAllocator
from hostkv_providers.testing import engine_planes

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, page_tokens=4, dtype="float32")
SALT = Salt("test/order", LAYOUT)
PAGE = LAYOUT.page_nbytes
NBLOCKS = 48
PAGES = 12
POISON = 0xEE


def planes(fill: int | None = None, seed: int = 0) -> list[np.ndarray]:
    return engine_planes(LAYOUT, NBLOCKS, fill=fill, seed=seed)


def pages_of(ps: Sequence[np.ndarray], blocks: Sequence[int]) -> list[bytes]:
    return [b"".join(p[b].tobytes() for p in ps) for b in blocks]


def slowed(fn: Callable[..., Any], seconds: float) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        time.sleep(seconds)
        return fn(*args, **kwargs)

    return call


class CountingAllocator(OrdinaryAllocator):
    """Ordinary memory that counts its allocations (bounce buffers of the cache)."""

    def __init__(self) -> None:
        super().__init__(huge_pages=False)
        self.count = 0

    def allocate(self, nbytes: int) -> Any:
        self.count += 1
        return super().allocate(nbytes)


@pytest.fixture(params=["pinned", "mmap"])
def provider(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Provider]:
    if request.param == "pinned":
        p: Provider = PinnedProvider(4 << 20, block=PAGE, allocator=OrdinaryAllocator(huge_pages=False))
    else:
        p = hk.open(f"mmap://{tmp_path}/store?budget=4MiB&durability=none")
    yield p
    p.close()


@pytest.fixture
def stream() -> Iterator[HostStream]:
    s = HostStream()
    yield s
    s.close()


def stored_chain(cache: HostKVCache, src: list[np.ndarray], label: str) -> list[hk.Key]:
    tokens = [hash((label, i)) % 50_000 for i in range(PAGES * LAYOUT.page_tokens)]
    keys = cache.keys(tokens)
    res = cache.save(keys, src, list(range(PAGES))).wait()
    assert res.stored == PAGES
    return keys


@pytest.mark.parametrize("gates", [True, False])
def test_restore_before_orders_the_stream_on_every_path(provider: Provider, stream: HostStream, gates: bool) -> None:
    """``before=`` orders the stream behind the restored bytes: gated at the call (an engine with
    stream gates), or — an engine without (the CUDA engine's default, ``stream_gates=False``) —
    once the copies are issued, the caller's thread waiting for that outside the cache's lock; a
    layer-wise restore and a restore coalesced into one in flight too."""
    engine = CpuCopyEngine()
    engine.stream_gates = gates  # type: ignore[attr-defined]
    with HostKVCache(provider, SALT, engine, chunk_pages=4) as cache:
        src = planes(seed=1)
        keys = stored_chain(cache, src, "restore")
        expect = pages_of(src, range(PAGES))
        # slow the provider's side of the restore down: without the gate, the stream's job below
        # would run long before the bytes are there
        if hasattr(provider, "views"):
            provider.views = slowed(provider.views, 0.01)  # type: ignore[method-assign]
        provider.read_many = slowed(provider.read_many, 0.01)  # type: ignore[attr-defined]
        stale = 0
        for trial in range(5):
            dst = planes(fill=POISON)
            seen: list[list[bytes]] = []
            ids = list(range(20 + trial, 20 + trial + PAGES))
            hit = cache.lookup(keys)
            twins: list[Any] = []
            if trial == 0:  # the same restore asked at once from another thread: coalesced, ordered the same way
                other = threading.Thread(target=lambda twins=twins, dst=dst, ids=ids: twins.append(
                    cache.restore(cache.lookup(keys), dst, ids, before=stream)))
                other.start()
            handle = cache.restore(hit, dst, ids, before=stream, layerwise=trial % 2 == 1)
            if trial == 0:
                other.join(10)
                assert twins[0] is handle and cache.stats().coalesced_restores == 1
            stream.enqueue(lambda ids=ids, dst=dst, seen=seen: seen.append(pages_of(dst, ids)))  # the "kernel"
            assert stream.synchronize(10)
            assert seen == [expect], f"trial {trial}: the stream read the blocks before the restore"
            assert handle.wait().pages == PAGES
            # negative control: the same restore without before= is not ordered
            dst = planes(fill=POISON)
            hit = cache.lookup(keys)
            handle = cache.restore(hit, dst, ids)
            got = pages_of(dst, ids)
            stale += got != expect
            handle.wait()
        assert stale, "the negative control never saw poisoned bytes: the test cannot detect a race"
    engine.close()


@pytest.mark.parametrize("gates", [True, False])
def test_wait_on_orders_more_streams(provider: Provider, stream: HostStream, gates: bool) -> None:
    engine = CpuCopyEngine()
    engine.stream_gates = gates  # type: ignore[attr-defined]
    other = HostStream("second")
    try:
        with HostKVCache(provider, SALT, engine, chunk_pages=4) as cache:
            src = planes(seed=2)
            keys = stored_chain(cache, src, "wait-on")
            provider.read_many = slowed(provider.read_many, 0.01)  # type: ignore[attr-defined]
            if hasattr(provider, "views"):
                provider.views = slowed(provider.views, 0.01)  # type: ignore[method-assign]
            dst = planes(fill=POISON)
            ids = list(range(30, 30 + PAGES))
            handle = cache.restore(cache.lookup(keys), dst, ids)
            handle.wait_on(other)  # before the copies are issued
            seen: list[list[bytes]] = []
            other.enqueue(lambda: seen.append(pages_of(dst, ids)))
            assert other.synchronize(10)
            assert seen == [pages_of(src, range(PAGES))]
            handle.wait()
            handle.wait_on(stream)  # after: nothing to hold back, the stream runs on
            assert stream.synchronize(10)
            assert handle.event is None  # host copies have no CUDA event
    finally:
        other.close()
        engine.close()


def test_save_after_reads_the_blocks_as_of_the_call(provider: Provider, stream: HostStream) -> None:
    engine = CpuCopyEngine()
    with HostKVCache(provider, SALT, engine, chunk_pages=4) as cache:
        blocks = planes(fill=0)
        x = planes(seed=3)
        y = planes(seed=4)
        ids = list(range(PAGES))

        def write(src: list[np.ndarray], delay: float = 0.0) -> Callable[[], None]:
            def job() -> None:
                time.sleep(delay)
                for d, s in zip(blocks, src, strict=True):
                    d[: PAGES] = s[: PAGES]
            return job

        tokens = list(range(PAGES * LAYOUT.page_tokens))
        keys = cache.keys(tokens)
        stream.enqueue(write(x, delay=0.05))  # the prefill kernel that computes the pages: slow
        handle = cache.save(keys, blocks, ids, after=stream)  # captures the stream position now
        handle.wait_on(stream)  # the blocks are not overwritten before they are copied out
        stream.enqueue(write(y))  # the next user of the blocks
        assert handle.wait().stored == PAGES
        assert handle.copied()
        assert stream.synchronize(10)
        dst = planes(fill=POISON)
        assert cache.restore(cache.lookup(keys), dst, list(range(PAGES))).wait().pages == PAGES
        assert pages_of(dst, range(PAGES)) == pages_of(x, range(PAGES))
    engine.close()


def test_ranged_restore(provider: Provider) -> None:
    engine = CpuCopyEngine()
    with HostKVCache(provider, SALT, engine, chunk_pages=4) as cache:
        src = planes(seed=5)
        keys = stored_chain(cache, src, "ranged")
        dst = planes(fill=POISON)
        hit = cache.lookup(keys)
        res = cache.restore(hit, dst, [40, 41, 42], first_page=5, release=False).wait()
        assert res.pages == 3
        assert pages_of(dst, [40, 41, 42]) == pages_of(src, [5, 6, 7])
        assert cache.restore(hit, dst, [], first_page=PAGES, release=False).wait().pages == 0
        with pytest.raises(hk.InvalidArgumentError):
            cache.restore(hit, dst, [1], first_page=PAGES + 1)
        with pytest.raises(hk.InvalidArgumentError):
            cache.restore(hit, dst, list(range(PAGES)), first_page=1)
        hit.release()
    engine.close()


def test_pinned_saves_go_straight_into_the_arena() -> None:
    """Saves to a provider with its own chain reservation use no bounce buffer at all."""
    alloc = CountingAllocator()
    provider = PinnedProvider(4 << 20, block=PAGE, allocator=OrdinaryAllocator(huge_pages=False))
    engine = CpuCopyEngine()
    try:
        with HostKVCache(provider, SALT, engine, chunk_pages=4, staging_allocator=alloc) as cache:
            src = planes(seed=6)
            keys = cache.keys(list(range(PAGES * LAYOUT.page_tokens)))
            first = cache.save(keys[:5], src, list(range(5))).wait()
            assert (first.stored, first.nbytes) == (5, 5 * PAGE)
            more = cache.save(keys, src, list(range(PAGES)), anchors={PAGES - 1: {"state": b"s" * 10}}).wait()
            assert (more.dedup, more.stored, more.anchors) == (5, PAGES - 5, 1)
            assert alloc.count == 0
            assert provider.stats().in_flight == 0
            dst = planes(fill=POISON)
            assert cache.restore(cache.lookup(keys), dst, list(range(PAGES))).wait().pages == PAGES
            assert pages_of(dst, range(PAGES)) == pages_of(src, range(PAGES))
            assert provider.get_anchor(keys[-1], "state") == b"s" * 10
    finally:
        engine.close()
        provider.close()


def test_direct_save_stops_at_capacity_and_leaves_no_reservation() -> None:
    provider = PinnedProvider(6 * PAGE, block=PAGE, allocator=OrdinaryAllocator(huge_pages=False))
    engine = CpuCopyEngine()
    try:
        with HostKVCache(provider, SALT, engine, chunk_pages=4) as cache:
            src = planes(seed=7)
            keys = cache.keys(list(range(PAGES * LAYOUT.page_tokens)))
            res = cache.save(keys, src, list(range(PAGES))).wait()
            assert res.stored == 6 and res.stopped is not None and "capacity" in res.stopped
            assert provider.longest_prefix(keys) == 6
            st = provider.stats()
            assert st.in_flight == 0 and st.used_bytes <= st.budget_bytes
    finally:
        engine.close()
        provider.close()


def test_a_dropped_gate_opens_with_a_warning(stream: HostStream) -> None:
    engine = CpuCopyEngine()
    gate = engine.gate(stream)
    ran: list[int] = []
    stream.enqueue(lambda: ran.append(1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del gate
        gc.collect()
    assert stream.synchronize(10) and ran == [1]
    assert any(issubclass(w.category, RuntimeWarning) for w in caught)
    engine.close()


def test_a_dropped_cuda_gate_opens_its_flag_with_a_warning() -> None:
    """The CUDA gate's leak finalizer holds the flag, not the gate: a gate dropped shut is
    collected and its flag (the host word the held stream polls) set.  Its finalizer once held
    a bound method of the gate, which kept the gate alive for ever and the stream shut.  Built
    without a device: the gate's constructor only keeps its pool, flag and slot."""
    import ctypes
    import weakref

    from hostkv_providers.device._cuda_sync import _CudaGate

    flags = (ctypes.c_uint32 * 4)()
    # (no pool: a gate uses it only to open after copies)
    gate = _CudaGate(None, flags, 2, 0)  # type: ignore[arg-type]
    gone = weakref.ref(gate)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del gate
        gc.collect()
    assert gone() is None, "the gate is kept alive"
    assert list(flags) == [0, 0, 1, 0]
    assert any(issubclass(w.category, RuntimeWarning) for w in caught)
    opened = _CudaGate(None, flags, 0, 0)  # type: ignore[arg-type]
    opened.open_now()
    assert flags[0] == 1
    flags[0] = 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del opened
        gc.collect()
    assert flags[0] == 0 and not caught  # opened once, by its owner: the finalizer is off


def test_cpu_engine_gates_and_marks(stream: HostStream) -> None:
    engine = CpuCopyEngine()
    assert engine.mark(None) is None
    assert engine.gate(None).opened
    with pytest.raises(hk.errors.CopyArgumentError):
        engine.gate(123)
    mark = engine.mark(stream)
    assert engine.mark(mark) is mark
    g = engine.gate(stream)
    g.open_now()
    g.open_now()  # idempotent
    assert stream.synchronize(10)
    engine.close()


def test_host_pages_coalesce_and_validation() -> None:
    from hostkv_providers.device import HostPages
    from hostkv_providers.device._cuda_staging import _coalesce_pages

    a = np.array([4096, 8192, 12288, 40960, 45056, 4096 * 100], dtype=np.uint64)
    assert _coalesce_pages(a, 4096) == [(0, 4096, 3 * 4096), (3 * 4096, 40960, 2 * 4096), (5 * 4096, 409600, 4096)]
    assert _coalesce_pages(a[:0], 4096) == []
    hp = HostPages(a, 4096, pinned=False, readonly=True)
    assert len(hp) == 6 and len(hp[1:3]) == 2
    assert next(iter(hp)) == ((0,), (4096,), (4096,))
    for bad in ([[1, 2]], [0, 4096]):
        with pytest.raises(hk.InvalidArgumentError):
            HostPages(np.array(bad, dtype=np.uint64), 4096, pinned=False, readonly=True)
    engine = CpuCopyEngine()
    ps = planes(fill=0)
    from hostkv_providers.device import KVPlanes

    kv = KVPlanes.from_arrays(LAYOUT, ps)
    with pytest.raises(hk.errors.CopyArgumentError):  # read-only pages cannot take a save
        engine.save(kv, [0], HostPages(a[:1], PAGE, pinned=False, readonly=True))
    with pytest.raises(hk.errors.CopyArgumentError):  # wrong page size
        engine.restore(HostPages(a[:1], 4096 * 2, pinned=False, readonly=True), kv, [0])
    engine.close()


def test_pinned_view_pages() -> None:
    provider = PinnedProvider(1 << 20, block=PAGE, allocator=OrdinaryAllocator(huge_pages=False))
    try:
        keys = [bytes([i]) * 32 for i in range(1, 5)]
        parent = None
        for k in keys:
            provider.put(k, parent, bytes([k[0]]) * PAGE)
            parent = k
        with provider.lease(keys) as lease:
            hp = provider.view_pages(lease, keys)
            assert hp is not None and len(hp) == 4 and hp.readonly
            views = provider.views(lease, keys)
            assert [int(a) for a in hp.addresses] == [v[0].address for v in views]  # type: ignore[index]
            assert provider.view_pages(lease, [*keys, b"\x09" * 32]) is None  # not leased, not stored
    finally:
        provider.close()


def test_a_stream_the_engine_cannot_order_is_refused_before_the_restore_starts(provider: Provider,
                                                                               stream: HostStream) -> None:
    """Without stream gates the stream is ordered only after the restore is submitted: an engine's
    ``check_stream`` refuses one it cannot order first, so ``restore(before=)`` raises with
    nothing started (no restore registered, the hit still the caller's), and the next restore runs."""
    from hostkv_providers import CopyArgumentError

    engine = CpuCopyEngine()
    engine.stream_gates = False  # type: ignore[attr-defined]

    def check_stream(s: Any) -> None:
        if not isinstance(s, HostStream):
            raise CopyArgumentError(f"cannot order a {type(s).__name__}")

    engine.check_stream = check_stream  # type: ignore[attr-defined]
    with HostKVCache(provider, SALT, engine, chunk_pages=4) as cache:
        src = planes(seed=3)
        keys = stored_chain(cache, src, "refused-stream")
        hit = cache.lookup(keys)
        ids = list(range(30, 30 + PAGES))
        with pytest.raises(CopyArgumentError, match="cannot order"):
            cache.restore(hit, planes(fill=POISON), ids, before=object())
        assert hit.lease is not None and not hit.lease.released
        assert cache.stats().restores == 0 and not cache._restores
        dst = planes(fill=POISON)
        assert cache.restore(hit, dst, ids, before=stream).wait().pages == PAGES
        assert stream.synchronize(10) and pages_of(dst, ids) == pages_of(src, range(PAGES))
    engine.close()


def test_a_small_restore_before_a_stream_does_not_wait_for_a_busy_restore_thread(stream: HostStream) -> None:
    """Without stream gates ``restore(before=)`` waits until the copies are issued.  A restore of at
    most ``chunk_pages`` pages from views issues its one transfer on the caller's thread, so the
    call returns without waiting for the restore thread (held busy here), and the stream is still
    ordered behind the bytes."""
    provider = PinnedProvider(4 << 20, block=PAGE, allocator=OrdinaryAllocator(huge_pages=False))
    engine = CpuCopyEngine()
    engine.stream_gates = False  # type: ignore[attr-defined]
    go = threading.Event()
    try:
        with HostKVCache(provider, SALT, engine, chunk_pages=4) as cache:
            src = planes(seed=5)
            keys = stored_chain(cache, src, "small-busy")
            real = cache._run_restore

            def held(*args: Any, **kwargs: Any) -> Any:
                go.wait(10)
                return real(*args, **kwargs)

            cache._run_restore = held  # type: ignore[method-assign]
            dst = planes(fill=POISON)
            ids = list(range(30, 34))
            handles: list[Any] = []
            caller = threading.Thread(target=lambda: handles.append(
                cache.restore(cache.lookup(keys), dst, ids, before=stream)))
            caller.start()
            caller.join(5)
            returned = not caller.is_alive()
            go.set()
            caller.join(10)
            assert returned, "restore(before=) waited for the busy restore thread"
            seen: list[list[bytes]] = []
            stream.enqueue(lambda: seen.append(pages_of(dst, ids)))
            assert stream.synchronize(10) and seen == [pages_of(src, range(4))]
            assert handles[0].wait(10).pages == 4
    finally:
        go.set()
        engine.close()
        provider.close()
