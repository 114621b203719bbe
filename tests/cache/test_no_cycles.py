"""The cache leaves no reference cycles behind a save or a restore.

Garbage in a cycle is freed only by the collector; objects of a transfer in flight survive the
young collections into the oldest generation, and their count is what sets off a *full* pass of
the engine's process (~100 ms with torch loaded: the decode stalls of issue 14).  A save's
finisher once held its job, which held the handle: every save left its handle, events, locks
and transfer handles for the collector (60 saves of 6,400 pages: 1,197 objects reached the
oldest generation as garbage, 55 young passes).  Each case runs an operation with the collector
off and asks a collection what was garbage (``hostkv_providers.testing.cycles_left_by``).
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from hostkv_providers import PinnedProvider, Provider
from hostkv_providers.cache._cache import HostKVCache
from hostkv_providers.device._copy import CpuCopyEngine
from hostkv_providers.device._hostmem import OrdinaryAllocator
from hostkv_providers.testing import cache_settled, cycles_left_by

from ._cache_common import PAGE, SALT, NoViews, _pinned, make_planes, tokens


@pytest.fixture(params=["views", "staged", "verified"])
def cache(request: pytest.FixtureRequest) -> Iterator[HostKVCache]:
    """Zero-copy views, staged reads, and views checked after the copy (``verify=read``)."""
    p: Provider = {"views": _pinned, "staged": lambda: NoViews(_pinned()),
                   "verified": lambda: PinnedProvider(256 * PAGE, block=PAGE, allocator=OrdinaryAllocator(),
                                                      verify_reads=True)}[request.param]()
    e = CpuCopyEngine()
    c = HostKVCache(p, SALT, e, chunk_pages=3, staging_allocator=OrdinaryAllocator())
    yield c
    c.close()
    e.close()
    p.close()


def test_saves_and_restores_leave_no_cycles(cache: HostKVCache) -> None:
    src, dst = make_planes(1), make_planes()
    n = 12
    ids = list(range(n))
    chains = iter(range(1, 1000))

    def new_chain() -> list[bytes]:
        return list(cache.keys(tokens(4 * n, seed=next(chains))))

    stored = new_chain()
    assert cache.save(stored, src, ids).wait().stored == n

    def save_new() -> None:
        assert cache.save(new_chain(), src, ids).wait().stored == n

    def save_stored() -> None:
        assert cache.save(stored, src, ids).wait().dedup == n

    def save_with_anchors() -> None:
        cache.save(new_chain(), src, ids, anchors={n - 1: {"state": b"x" * 64}}).wait()

    def continuation() -> None:
        cache.save(new_chain()[:4], src, ids[:4]).wait()

    def restore(**kw: object) -> Callable[[], None]:
        def run() -> None:
            hit = cache.lookup(stored)
            assert hit.num_pages == n
            cache.restore(hit, dst, list(range(n, 2 * n)), release=True, **kw).wait()
        return run

    def miss() -> None:
        cache.lookup(new_chain()).release()

    cases: dict[str, Callable[[], None]] = {
        "save of a new chain": save_new,
        "save of a stored chain": save_stored,
        "save with anchors": save_with_anchors,
        "a short save": continuation,
        "restore": restore(),
        "layer-wise restore": restore(layerwise=True),
        "lookup that misses": miss,
    }
    for op in cases.values():  # warm: threads, pools and buffers made once
        op()
    found = {name: cycles_left_by(op, settle=lambda: cache_settled(cache)) for name, op in cases.items()}
    assert all(not g for g in found.values()), {k: v.most_common(8) for k, v in found.items() if v}
    assert np.array_equal(dst[0][n : 2 * n], src[0][:n])


def test_a_long_chain_saves_and_restores_without_per_page_objects() -> None:
    """A save and a restore of 6,400 pages keep no Python object per page alive: the young
    collections they set off stay a handful (one tracked object per page alive at once would be
    ~9 per 6,400 pages at the default threshold of 700; the seal's per-page regions were ~23)."""
    n = 6400
    p = PinnedProvider((n + 64) * PAGE, block=PAGE, allocator=OrdinaryAllocator())
    e = CpuCopyEngine()
    c = HostKVCache(p, SALT, e, staging_allocator=OrdinaryAllocator())
    shape = (2 * n, *make_planes()[0].shape[1:])
    planes = [np.zeros(shape, np.float32) for _ in make_planes()]
    passes: list[int] = []

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            passes.append(info["generation"])

    try:
        chains = [list(c.keys(tokens(4 * n, seed=s))) for s in (1, 2)]
        c.save(chains[0], planes, list(range(n))).wait()  # warm: threads, pools, arena
        c.restore(c.lookup(chains[0]), planes, list(range(n, 2 * n))).wait()
        gc.collect()
        threshold = gc.get_threshold()
        gc.set_threshold(700, 10, 10)  # (the interpreter's default, whatever another test set)
        gc.callbacks.append(count)
        try:
            assert c.save(chains[1], planes, list(range(n))).wait().stored == n
            saves = len(passes)
            assert c.restore(c.lookup(chains[1]), planes, list(range(n, 2 * n))).wait().pages == n
            restores = len(passes) - saves
        finally:
            gc.callbacks.remove(count)
            gc.set_threshold(*threshold)
        assert saves <= 3 and restores <= 3, (saves, restores)
    finally:
        c.close()
        e.close()
        p.close()
