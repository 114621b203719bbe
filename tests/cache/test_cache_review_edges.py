"""Edges a review found in HostKVCache's restore (session 24), each reproduced before its fix:
a block id repeated in different chunks (two pages into one block, the restore reported whole),
an empty ranged restore that did not release its hit, and a restore racing close()."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest

import hostkv_providers as hk
from hostkv_providers import ClosedError
from hostkv_providers._errors import CopyArgumentError
from hostkv_providers.cache._cache import HostKVCache
from hostkv_providers.device._copy import CpuCopyEngine
from hostkv_providers.device._hostmem import OrdinaryAllocator

from ._cache_common import PAGE, SALT, make_planes, tokens


def _cache(url: str) -> tuple[HostKVCache, CpuCopyEngine, hk.Provider]:
    p = hk.open(url)
    e = CpuCopyEngine()
    return HostKVCache(p, SALT, e, chunk_pages=3, staging_allocator=OrdinaryAllocator()), e, p


@pytest.mark.parametrize("kind", ["pinned", "mmap"])  # (zero-copy views; bounce buffers)
@pytest.mark.parametrize("layerwise", [False, True])
def test_a_block_id_repeated_in_different_chunks_is_refused_at_the_call(kind: str, layerwise: bool,
                                                                        tmp_path: Path) -> None:
    url = (f"pinned://?budget={PAGE * 16}&block={PAGE}&pin=no" if kind == "pinned"
           else f"mmap://{tmp_path}/s?budget={1 << 22}&durability=none")
    c, e, p = _cache(url)
    try:
        ks = c.keys(tokens(4 * 6))
        assert c.save(ks, make_planes(1), list(range(6))).wait(10).stored == 6
        dst = make_planes(None)
        hit = c.lookup(ks)
        with pytest.raises(CopyArgumentError, match="block 10 is given 2 times"):
            c.restore(hit, dst, [10, 11, 12, 10, 13, 14], layerwise=layerwise)  # chunks of 3: 10 in both
        assert all(not a.any() for a in dst)  # nothing copied
        assert not hit.released  # refused before anything: the hit is the caller's still
        assert c.restore(hit, dst, [10, 11, 12, 15, 13, 14]).wait(10).pages == 6
    finally:
        c.close()
        e.close()
        p.close()


def test_an_empty_ranged_restore_with_release_releases_the_hit() -> None:
    c, e, p = _cache(f"pinned://?budget={PAGE * 16}&block={PAGE}&pin=no")
    try:
        ks = c.keys(tokens(4 * 4))
        c.save(ks, make_planes(1), [0, 1, 2, 3]).wait(10)
        hit = c.lookup(ks)
        dst = make_planes(None)
        c.restore(hit, dst, [10, 11], release=False).wait(10)
        c.restore(hit, dst, [12, 13], first_page=2, release=False).wait(10)
        assert p.stats().leased == 4
        assert c.restore(hit, dst, [], first_page=4).wait(10).pages == 0  # the last range is empty
        assert hit.released and p.stats().leased == 0
    finally:
        c.close()
        e.close()
        p.close()


class _ClosingIds(Sequence[int]):
    """Block ids whose first iteration closes the cache: close() on another thread, at the worst
    moment (after restore()'s open check, before its hand-off to the restore thread)."""

    def __init__(self, ids: range, cache: HostKVCache) -> None:
        self.ids, self.cache, self.fired = list(ids), cache, False

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> int:  # type: ignore[override]
        return self.ids[i]

    def __iter__(self) -> Iterator[int]:
        if not self.fired:
            self.fired = True
            self.cache.close()
        return iter(self.ids)


@pytest.mark.parametrize("layerwise", [False, True])
def test_a_restore_racing_close_raises_closed_error(layerwise: bool) -> None:
    c, e, p = _cache(f"pinned://?budget={PAGE * 16}&block={PAGE}&pin=no")
    try:
        ks = c.keys(tokens(4 * 6))
        c.save(ks, make_planes(1), list(range(6))).wait(10)
        hit = c.lookup(ks)
        with pytest.raises(ClosedError):
            c.restore(hit, make_planes(None), _ClosingIds(range(10, 16), c), layerwise=layerwise)
        hit.release()
        assert p.stats().leased == 0
    finally:
        c.close()
        e.close()
        p.close()


def test_np_ids_with_a_repeat_are_refused_too() -> None:
    c, e, p = _cache(f"pinned://?budget={PAGE * 16}&block={PAGE}&pin=no")
    try:
        ks = c.keys(tokens(4 * 6))
        c.save(ks, make_planes(1), list(range(6))).wait(10)
        with pytest.raises(CopyArgumentError, match="distinct"):
            c.restore(c.lookup(ks), make_planes(None), np.array([20, 21, 22, 23, 24, 20]))  # type: ignore[arg-type]
    finally:
        c.close()
        e.close()
        p.close()
