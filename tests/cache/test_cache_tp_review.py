"""Review mends of HostKVCache's tensor-parallel lookup and the staging pool (a helper,
reproduced; each failed before): lookup_ranks(need_anchor=) on a hybrid cache returned a hit
without its anchor; lookup_ranks raised a bare TypeError for rank_keys without len() and was
missing from the lookup latency histogram; StagingPool.save_to_provider raised CapacityError
after storing pages, losing the stored count it documents."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from hostkv_providers import HostKVCache, InvalidArgumentError, KVLayout, PinnedProvider, Salt
from hostkv_providers._keys import chain_keys
from hostkv_providers.cache import StagingPool
from hostkv_providers.device import CpuCopyEngine, OrdinaryAllocator
from hostkv_providers.device._copy import KVPlanes

LAYOUT = KVLayout(num_layers=2, num_kv_heads=4, head_dim=64, page_tokens=4, dtype="float32")
WORLD = 2


def _planes(salt: Salt, seed: int) -> list[np.ndarray]:
    lay = salt.local_layout
    rng = np.random.default_rng(seed)
    shape = (16, lay.page_tokens, lay.num_kv_heads, lay.head_dim)
    return [rng.standard_normal(shape, dtype=np.float32) for _ in lay.planes]


def test_lookup_ranks_on_a_hybrid_cache_hands_out_the_needed_anchor() -> None:
    eng = CpuCopyEngine()
    salts = [Salt("m", LAYOUT, tp_rank=r, tp_world_size=WORLD) for r in range(WORLD)]
    page = salts[0].local_layout.page_nbytes
    p = PinnedProvider(64 * page, block=page, allocator=OrdinaryAllocator())
    caches = [HostKVCache(p, s, eng, required_anchors=["ssm"], staging_allocator=OrdinaryAllocator())
              for s in salts]
    toks = np.arange(16)
    chains = caches[0].rank_keys(toks)
    for r, c in enumerate(caches):
        res = c.save(chains[r], _planes(salts[r], r), [0, 1, 2, 3],
                     anchors={3: {"ssm": f"r{r}".encode()}}).wait(30)
        assert res.stored == 4 and res.anchors == 1
    with caches[0].lookup(chains[0], need_anchor="ssm") as own:
        assert own.num_pages == 4 and own.anchor == b"r0"  # plain lookup: fine
    with caches[0].lookup_ranks(chains, need_anchor="ssm") as hit:
        assert hit.num_pages == 4
        assert hit.anchor == b"r0", f"TP hit on a hybrid cache carries no anchor: {hit.anchor!r}"
        buf = bytearray(2)
        assert hit.read_anchor(buf) == 2 and bytes(buf) == b"r0"
    for c in caches:
        c.close()
    p.close()
    eng.close()


@pytest.fixture
def cache() -> Iterator[HostKVCache]:
    eng = CpuCopyEngine()
    salt = Salt("m", LAYOUT, tp_rank=0, tp_world_size=2)
    page = salt.local_layout.page_nbytes
    p = PinnedProvider(64 * page, block=page, allocator=OrdinaryAllocator())
    c = HostKVCache(p, salt, eng, staging_allocator=OrdinaryAllocator())
    yield c
    c.close()
    p.close()
    eng.close()


@pytest.mark.parametrize("bad", [None, 5, "iter"])
def test_lookup_ranks_refuses_bad_rank_keys_with_a_typed_error(cache: HostKVCache, bad: object) -> None:
    if bad == "iter":
        bad = iter(cache.rank_keys(np.arange(16)))
    with pytest.raises(InvalidArgumentError):
        cache.lookup_ranks(bad)  # type: ignore[arg-type]


def test_lookup_ranks_is_timed_like_lookup(cache: HostKVCache) -> None:
    chains = cache.rank_keys(np.arange(16))
    cache.lookup(chains[0]).release()
    cache.lookup_ranks(chains).release()
    assert cache.stats().lookups == 2
    assert cache._lookup_lat.count == cache.stats().lookups  # the histogram prometheus exports


STAGE_LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, page_tokens=4, dtype="float32")


def test_save_to_provider_stops_at_the_budget_instead_of_raising() -> None:
    page = STAGE_LAYOUT.page_nbytes
    eng = CpuCopyEngine()
    planes = KVPlanes.from_arrays(STAGE_LAYOUT, [np.ones((16, 4, 2, 32), np.float32) for _ in STAGE_LAYOUT.planes])
    p = PinnedProvider(4 * page, block=page, allocator=OrdinaryAllocator())  # room for 4 pages
    keys = [bytes(k) for k in chain_keys(Salt("t", STAGE_LAYOUT), list(range(8 * 4)))]
    with StagingPool(eng, page, pages_per_buffer=2) as pool:
        n = pool.save_to_provider(p, keys, planes, list(range(8)))
    assert n == 4 == sum(p.present(keys))
    p.close()
    eng.close()
