"""Block tables on the engine's thread: the one-array check (ints, sign, bound, distinctness),
and the prestaging protocol of a layer-wise restore (an engine's first copies begun before the
block ids are checked: released on every refusal, handed to the engine otherwise)."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pytest

from hostkv_providers import InvalidArgumentError, Provider
from hostkv_providers.cache._cache import HostKVCache
from hostkv_providers.device._copy import CpuCopyEngine, KVPlanes
from hostkv_providers.device._engine import BlockIds
from hostkv_providers.device._hostmem import OrdinaryAllocator
from hostkv_providers.errors import CopyArgumentError

from ._cache_common import LAYOUT, NBLOCKS, SALT, _pinned, make_planes, page_of, tokens


class _Planes:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks


@pytest.mark.parametrize("nb", [NBLOCKS, 1 << 40])  # a bitmap of the pool's blocks; a sort
def test_block_table_flags_repeats_like_a_set(nb: int) -> None:
    rng = random.Random(nb)
    for trial in range(300):
        n = rng.randint(1, 60)
        hi = min(nb, NBLOCKS) if trial % 2 else nb
        table = [rng.randrange(hi) for _ in range(n)]
        for given in (table, np.array(table, dtype=np.int64), np.array(table, dtype=np.uint32 if nb < 1 << 32
                                                                              else np.uint64)):
            ids, arr = HostKVCache._block_table(given, n, "pages")
            assert ids == table and all(type(b) is int for b in ids)
            if len(set(table)) < n:  # a repeat is refused at the call (chunks hide it from an engine)
                with pytest.raises(CopyArgumentError, match="distinct"):
                    HostKVCache._check_blocks(_Planes(nb), ids, arr, distinct=True)
            else:
                checked = HostKVCache._check_blocks(_Planes(nb), ids, arr, distinct=True)
                assert type(checked) is BlockIds and list(checked) == table and checked.bound == nb
                assert checked.distinct
            # without distinct= the flag stays off: the engine checks for itself
            assert not HostKVCache._check_blocks(_Planes(nb), ids, arr).distinct


def test_block_table_refuses_what_is_not_a_block() -> None:
    for bad, match in (([1 << 70, 0], "out of range"), ([-(1 << 70), 0], ">= 0"), ([0, -1], ">= 0"),
                       ([0, True], "ints"), ([0, 1.0], "ints"), ([0, "1"], "ints"),
                       (np.array([0, -3]), ">= 0"), (np.array([0.0]), "integer array")):
        with pytest.raises(InvalidArgumentError, match=match):
            HostKVCache._block_table(bad, 4, "pages")
    with pytest.raises(InvalidArgumentError, match="outside the planes' 64 blocks"):
        ids, arr = HostKVCache._block_table([3, 64], 4, "pages")
        HostKVCache._check_blocks(_Planes(NBLOCKS), ids, arr)
    # numpy integers in a list are ints too
    ids, _arr = HostKVCache._block_table([np.int32(3), 4], 4, "pages")
    assert ids == [3, 4] and all(type(b) is int for b in ids)


class _Prestaging(CpuCopyEngine):
    """The CPU engine with the CUDA engine's prestaging verbs (what ``HostKVCache`` calls): its
    token records whether the cache handed it to ``restore`` or released it."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens: list[_Token] = []
        self.taken: list[_Token] = []
        self.restored_ids: list[Any] = []

    def prestage_pages(self, layout: Any) -> int:
        return 3

    def prestage(self, pages: Any, layout: Any, count: int) -> _Token:
        assert layout == LAYOUT and 1 <= len(pages) <= 3 and count >= len(pages)
        t = _Token(pages.addresses.copy())
        self.tokens.append(t)
        return t

    def restore(self, src: Any, planes: KVPlanes, block_ids: Sequence[int], **kw: Any) -> Any:
        pre = kw.pop("prestaged", None)
        self.restored_ids.append(block_ids)
        if pre is not None:
            assert bool((src.addresses[: len(pre.addresses)] == pre.addresses).all())
            self.taken.append(pre)
            pre.release()  # as the CUDA engine does once its inline issue is done
        return super().restore(src, planes, block_ids, **kw)


class _Token:
    def __init__(self, addresses: Any) -> None:
        self.addresses = addresses
        self.releases = 0
        self._lock = threading.Lock()

    def release(self) -> None:
        with self._lock:
            self.releases += 1


@pytest.fixture
def setup() -> Iterator[tuple[HostKVCache, Provider, _Prestaging]]:
    provider = _pinned()
    engine = _Prestaging()
    cache = HostKVCache(provider, SALT, engine, chunk_pages=3, staging_allocator=OrdinaryAllocator())
    yield cache, provider, engine
    cache.close()
    engine.close()
    provider.close()


def test_prestaged_restore_is_handed_to_the_engine(setup: tuple[HostKVCache, Provider, _Prestaging]) -> None:
    cache, _provider, engine = setup
    src = make_planes(4)
    ks = cache.keys(tokens(4 * 8))
    assert cache.save(ks, src, list(range(8))).wait(30).stored == 8
    dst = make_planes(None)
    blocks = [40, 12, 41, 3, 60, 1, 7, 9]
    assert cache.restore(cache.lookup(ks), dst, blocks, layerwise=True).wait(30).pages == 8
    assert len(engine.tokens) == 1 and engine.taken == engine.tokens
    assert engine.tokens[0].releases >= 1  # released (by the engine), and again harmlessly by the cache
    ids = engine.restored_ids[-1]
    assert type(ids) is BlockIds and ids.distinct and list(ids) == blocks
    assert all(page_of(dst, b) == page_of(src, i) for i, b in enumerate(blocks))
    # a ranged restore prestages the range's own first pages
    dst2 = make_planes(None)
    assert cache.restore(cache.lookup(ks), dst2, [20, 21], first_page=5, layerwise=True).wait(30).pages == 2
    assert len(engine.tokens[-1].addresses) == 2 and engine.taken[-1] is engine.tokens[-1]
    assert page_of(dst2, 20) == page_of(src, 5) and page_of(dst2, 21) == page_of(src, 6)
    # page-major restores are not prestaged
    cache.restore(cache.lookup(ks), make_planes(None), blocks).wait(30)
    assert len(engine.tokens) == 2


def test_refused_prestaged_restores_release_and_write_nothing(
        setup: tuple[HostKVCache, Provider, _Prestaging]) -> None:
    cache, _provider, engine = setup
    src = make_planes(5)
    ks = cache.keys(tokens(4 * 6))
    assert cache.save(ks, src, list(range(6))).wait(30).stored == 6
    for bad in ([0, 1, 2, 3, 4, 1.5], [0, 1, 2, 3, 4, -1], [0, 1, 2, 3, 4, NBLOCKS], [0, 1, 2, 3, 4, 1 << 70],
                [0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, True]):
        dst = make_planes(None)
        hit = cache.lookup(ks)
        before = len(engine.tokens)
        with pytest.raises(InvalidArgumentError):
            cache.restore(hit, dst, bad, layerwise=True)
        assert len(engine.tokens) == before + 1, "prestaged before the ids were checked"
        assert engine.tokens[-1].releases == 1 and engine.tokens[-1] not in engine.taken
        assert all(not p.any() for p in dst)
        hit.release()
    # repeated blocks: refused at the call, as other bad ids are
    dst = make_planes(None)
    with pytest.raises(CopyArgumentError, match="distinct"):
        cache.restore(cache.lookup(ks), dst, [1, 2, 3, 3, 4, 5], layerwise=True)
    assert engine.tokens[-1].releases >= 1
    assert all(not p.any() for p in dst)
    # an identical restore in flight: the twin's prestage is released, the first one's copies serve both
    gate = threading.Event()
    real = CpuCopyEngine.restore

    def slow(self: Any, *a: Any, **k: Any) -> Any:
        gate.wait(30)
        return real(self, *a, **k)

    CpuCopyEngine.restore = slow  # type: ignore[method-assign]
    try:
        dst = make_planes(None)
        planes = KVPlanes.from_arrays(LAYOUT, dst)
        blocks = [10, 11, 12, 13, 14, 15]
        first = threading.Thread(target=lambda: cache.restore(cache.lookup(ks), planes, blocks, layerwise=True))
        first.start()
        while not cache._restores:
            threading.Event().wait(0.001)
        h2 = cache.restore(cache.lookup(ks), planes, blocks, layerwise=True)
        # (released before the coalescing wait, then again by restore(): release() is idempotent)
        assert engine.tokens[-1].releases >= 1 and engine.tokens[-1] not in engine.taken
        gate.set()
        first.join(30)
        assert h2.wait(30).pages == 6
    finally:
        CpuCopyEngine.restore = real  # type: ignore[method-assign]
        gate.set()
    assert all(page_of(dst, b) == page_of(src, i) for i, b in enumerate(blocks))
