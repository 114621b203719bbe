"""Prometheus metrics: a HostKVCache over a tiered provider (pinned over lmdb), scraped over HTTP
from a real ``prometheus_client`` exposition server and parsed with its own parser: cache
counters, latency histograms, provider counters per tier, hits attributed per tier, write-backs."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import hostkv_providers as hk
from hostkv_providers.cache import HostKVCache
from hostkv_providers.device import CpuCopyEngine, OrdinaryAllocator
from hostkv_providers.metrics import LatencyHistogram, ProviderCollector, provider_tiers
from hostkv_providers.providers import PinnedProvider, TieredProvider

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

LAYOUT = hk.KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, page_tokens=4, dtype="float32")
SALT = hk.Salt("test/metrics", LAYOUT)
PAGE = LAYOUT.page_nbytes
NBLOCKS = 32


def _pinned(budget: int) -> PinnedProvider:
    return PinnedProvider(budget, block=PAGE, allocator=OrdinaryAllocator())


def _slow(tmp_path: Path) -> hk.Provider:
    try:
        return hk.open(f"lmdb://{tmp_path / 'slow'}?budget={256 * PAGE}")
    except hk.HostKVError:
        return _pinned(256 * PAGE)


@pytest.fixture
def tiered(tmp_path: Path) -> Iterator[TieredProvider]:
    t = TieredProvider(_pinned(64 * PAGE), _slow(tmp_path),
                       budget_bytes=128 * PAGE)
    yield t
    t.close()


def _scrape(registry: object) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Serve ``registry`` on a loopback port, GET /metrics, parse it: {(sample, labels): value}."""
    server, thread = prometheus_client.start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        port = server.server_address[1]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _planes(seed: int | None) -> list[np.ndarray]:
    shape = (NBLOCKS, LAYOUT.page_tokens, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape, dtype=np.float32) if seed is not None else np.zeros(shape, np.float32)
            for _ in LAYOUT.planes]


def test_cache_and_tiers_scraped_over_http(tiered: TieredProvider) -> None:
    engine = CpuCopyEngine()
    cache = HostKVCache(tiered, SALT, engine)
    try:
        tokens = np.arange(10 * LAYOUT.page_tokens)
        keys = cache.keys(tokens)
        src = _planes(3)
        cache.save(keys, src, list(range(10))).wait(30)
        assert tiered.flush(60)
        # the fast tier forgets 4 pages' copies: restoring reads them from the slow tier
        tiered.fast.evict(keys[6:7])
        dst = _planes(None)
        cache.restore(cache.lookup(keys), dst, list(range(10))).wait(30)
        assert all(np.array_equal(a[:10], b[:10]) for a, b in zip(src, dst, strict=True))
        cache.lookup(cache.keys(tokens + 1)).release()  # a miss

        reg = prometheus_client.CollectorRegistry()
        cache.register_prometheus(reg, labels={"engine": "e0"})
        m = _scrape(reg)
        e = (("engine", "e0"),)
        # the cache
        assert m[("hostkv_cache_lookups_total", e)] == 2 and m[("hostkv_cache_misses_total", e)] == 1
        assert m[("hostkv_cache_saved_pages_total", e)] == 10
        assert m[("hostkv_cache_restored_pages_total", e)] == 10
        for op, n in (("lookup", 2), ("save", 1), ("restore", 1)):
            assert m[(f"hostkv_cache_{op}_seconds_count", e)] == n
            assert m[(f"hostkv_cache_{op}_seconds_bucket", (*e, ("le", "+Inf")))] == n
            assert m[(f"hostkv_cache_{op}_seconds_sum", e)] > 0
        # the provider and each tier
        top = (*e, ("provider", "tiered"), ("tier", "store"))
        fast = (*e, ("provider", "pinned"), ("tier", "fast"))
        slow = (*e, ("provider", tiered.slow.name), ("tier", "slow"))
        assert m[("hostkv_provider_entries", top)] == 10
        assert m[("hostkv_provider_seals_total", top)] == 10
        assert m[("hostkv_provider_entries", slow)] == 10  # written back
        assert m[("hostkv_provider_entries", fast)] == tiered.fast.stats().entries
        assert m[("hostkv_provider_budget_bytes", fast)] == 64 * PAGE
        assert m[("hostkv_tier_write_backs_total", (*e, ("store", "store")))] == 10
        assert m[("hostkv_tier_write_back_pending_pages", (*e, ("store", "store")))] == 0
        fast_hits = m[("hostkv_tier_hits_total", (*e, ("store", "store"), ("tier", "fast")))]
        slow_hits = m[("hostkv_tier_hits_total", (*e, ("store", "store"), ("tier", "slow")))]
        assert slow_hits >= 1 and fast_hits >= 1
        st = tiered.stats()
        assert (fast_hits, slow_hits) == (st.extra["fast_hits"], st.extra["slow_hits"])
        if tiered.slow.name == "lmdb":  # counted in the store itself
            assert m[("hostkv_provider_store_checksum_failures_total", slow)] == 0
    finally:
        cache.close()
        engine.close()


def test_provider_collector_alone_and_after_close(tmp_path: Path) -> None:
    p = _pinned(16 * PAGE)
    k = hk.chain_keys(SALT, np.arange(LAYOUT.page_tokens))[0]
    p.put(k, None, b"\x01" * PAGE, salt_tag=SALT.tag)
    buf = bytearray(PAGE)
    assert p.read(k, buf) and not p.read(hk.Key(b"\x07" * 32), buf)
    reg = prometheus_client.CollectorRegistry()
    reg.register(ProviderCollector(p, labels={"node": "n1"}))
    m = _scrape(reg)
    lab = (("node", "n1"), ("provider", "pinned"), ("tier", "store"))
    assert m[("hostkv_provider_hits_total", lab)] == 1
    assert m[("hostkv_provider_seals_total", lab)] == 1
    assert m[("hostkv_provider_used_bytes", lab)] == PAGE
    assert provider_tiers(p) == [("", p)]
    p.close()
    m = _scrape(reg)  # a closed provider: no samples, and the scrape still works
    assert not [k for k in m if k[0].startswith("hostkv_provider_entries")]


def test_latency_histogram_buckets() -> None:
    h = LatencyHistogram((0.001, 0.01, 0.1))
    for s in (0.0005, 0.001, 0.002, 0.05, 3.0):
        h.observe(s)
    assert h.buckets() == [("0.001", 2), ("0.01", 3), ("0.1", 4), ("+Inf", 5)]
    assert h.count == 5 and h.total == pytest.approx(3.0535)
    with pytest.raises(hk.InvalidArgumentError):
        LatencyHistogram((0.1, 0.01))


def test_sidecar_exports_the_engines_store_wide_counters(tmp_path: Path) -> None:
    """A read-only sidecar instance's collector exports the store's live counters: what the
    engine's instance did (hostkv_store_*), while its own per-instance counters stay 0."""
    url = f"mmap://{tmp_path / 'm'}"
    keys = hk.chain_keys(SALT, np.arange(6 * LAYOUT.page_tokens))
    with hk.open(url + "?budget=8MiB") as engine:
        parent = None
        for i, k in enumerate(keys):
            engine.put(k, parent, bytes([i]) * PAGE, salt_tag=SALT.tag)
            parent = k
        buf = bytearray(PAGE)
        assert all(engine.read(k, buf) for k in keys[:4]) and not engine.read(hk.Key(b"\x09" * 32), buf)
        engine.evict(keys[5:])
        with hk.open(url + "?readonly=true") as sidecar:
            reg = prometheus_client.CollectorRegistry()
            reg.register(ProviderCollector(sidecar))
            m = _scrape(reg)
    lab = (("provider", "mmap"), ("scope", "store"), ("tier", "store"))
    assert m[("hostkv_store_hits_total", lab)] == 4 and m[("hostkv_store_misses_total", lab)] == 1
    assert m[("hostkv_store_seals_total", lab)] == 6 and m[("hostkv_store_evictions_total", lab)] == 1
    assert m[("hostkv_store_bytes_read_total", lab)] == 4 * PAGE
    assert m[("hostkv_store_checksum_failures_total", lab)] == 0
    assert m[("hostkv_provider_hits_total", (("provider", "mmap"), ("tier", "store")))] == 0  # the sidecar's own


def test_tiered_store_counters_and_lag_per_tier(tiered: TieredProvider) -> None:
    keys = hk.chain_keys(SALT, np.arange(5 * LAYOUT.page_tokens))
    parent = None
    for i, k in enumerate(keys):
        tiered.put(k, parent, bytes([i + 1]) * PAGE, salt_tag=SALT.tag)
        parent = k
    assert tiered.flush(60)
    assert tiered.read(keys[0], bytearray(PAGE))
    reg = prometheus_client.CollectorRegistry()
    reg.register(ProviderCollector(tiered))
    m = _scrape(reg)

    def lab(provider: str, tier: str, scope: str) -> tuple[tuple[str, str], ...]:
        return (("provider", provider), ("scope", scope), ("tier", tier))

    assert m[("hostkv_store_seals_total", lab("tiered", "store", "store"))] == 5
    assert m[("hostkv_store_hits_total", lab("tiered", "store", "store"))] == 1
    assert m[("hostkv_store_seals_total", lab("pinned", "fast", "process"))] == 5
    slow_scope = "store" if tiered.slow.persistent else "process"
    assert m[("hostkv_store_seals_total", lab(tiered.slow.name, "slow", slow_scope))] == 5  # written back
    assert m[("hostkv_tier_write_back_lag_seconds", (("store", "store"),))] == 0
