"""Review mends of what operators read (a helper, reproduced; each failed before): read_bytes()
never counted a miss (hit ratios came out too high); the cache's evictions counter went back to 0
once its provider was closed (a Prometheus counter must never go backwards); a constant label
named like one of the collector's own (tier, provider ...) was silently overwritten."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

import hostkv_providers as hk
from hostkv_providers.cache import HostKVCache
from hostkv_providers.device import CpuCopyEngine, OrdinaryAllocator
from hostkv_providers.providers import MmapProvider, PinnedProvider

PAGE = 4096


def _k(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


@pytest.mark.parametrize("kind", ["pinned", "mmap"])
def test_a_read_bytes_miss_is_counted(tmp_path: Path, kind: str) -> None:
    p: hk.Provider = (PinnedProvider(16 * PAGE, block=PAGE, allocator=OrdinaryAllocator()) if kind == "pinned" else
                      MmapProvider(str(tmp_path / "s"), budget_bytes=16 * PAGE, slot_nbytes=PAGE,
                                   file_nbytes=64 * PAGE))
    try:
        p.put(_k(0), None, b"x" * PAGE)
        assert p.read_bytes(_k(0)) == b"x" * PAGE
        assert p.read_bytes(_k(1)) is None
        st = p.stats()
        assert (st.hits, st.misses) == (1, 1)
        if kind == "mmap":
            assert p.store_counters()["misses"] == 1  # type: ignore[attr-defined]
    finally:
        p.close()


def test_the_cache_evictions_counter_never_goes_back_when_its_provider_closes() -> None:
    layout = hk.KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, page_tokens=4, dtype="float32")
    page = layout.page_nbytes
    p = PinnedProvider(4 * page, block=page, allocator=OrdinaryAllocator())
    engine = CpuCopyEngine()
    cache = HostKVCache(p, hk.Salt("review/metrics", layout), engine)
    try:
        for i in range(8):  # 8 roots into a 4-page budget: 4 evictions
            p.put(_k(i), None, b"\1" * page)
        assert cache.stats().evictions == 4
        p.close()
        assert cache.stats().evictions == 4
    finally:
        cache.close()
        engine.close()


@pytest.mark.parametrize("label", ["tier", "provider", "name", "scope", "store", "0bad", "__reserved"])
def test_constant_labels_the_collector_sets_itself_or_invalid_names_are_refused(label: str) -> None:
    pytest.importorskip("prometheus_client")
    from hostkv_providers.metrics import ProviderCollector

    p = PinnedProvider(8 * PAGE, block=PAGE, allocator=OrdinaryAllocator())
    try:
        with pytest.raises(hk.InvalidArgumentError):
            ProviderCollector(p, labels={label: "blue"})
        ProviderCollector(p, labels={"engine": "blue"})  # any other name is fine
    finally:
        p.close()
