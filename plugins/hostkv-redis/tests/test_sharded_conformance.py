"""The core's conformance suite against the sharded cluster store (3 shards, groups of 4 pages,
on the 3-master loopback cluster), with :func:`fsck` of every shard after each test.

Six tests of the suite check properties that this design keeps per shard, not store-wide, and
are skipped here with the reason (see docs/providers/redis.md, "Trade-offs"): the suite's budgets
are a handful of pages, which split three ways leave a shard room for one or two (so a write
that fits the store-wide budget can get ``CapacityError`` in its shard), and the suite's LRU
order is store-wide while a shard evicts its own leaves in its own order.  They stay skipped
because per-shard budgets are the design (a store-wide budget would need a cross-slot counter on
every write), not because of a gap in the tree: the chain-puncture test, skipped before the
cross-shard pins, runs here.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
from conftest import unique_namespace
from hostkv_providers import Key, Provider
from hostkv_providers.testing import ProviderTests
from test_sharded import check_shards, settle

from hostkv_redis import RedisShardedProvider
from hostkv_redis.servers import RedisClusterServers

_PER_SHARD_BUDGET = "budget is per shard (budget / shards): a test budget of a few pages leaves a shard room for 1-2"
_PER_SHARD_LRU = "LRU-leaf order is exact per shard, not across shards"


class TestShardedConformance(ProviderTests):
    supports_reopen = True
    thread_ops: ClassVar[int] = 40
    shards: ClassVar[int] = 3
    group: ClassVar[int] = 4

    @pytest.fixture(autouse=True)
    def _bind_cluster(self, redis_cluster: RedisClusterServers) -> Iterator[None]:
        self.cluster = redis_cluster
        self.made: list[RedisShardedProvider] = []
        self.corrupted = False
        yield
        settle(self.made)  # every open client of a store before any check (a reopened one too)
        for p in self.made:
            problems = check_shards(p, redis_cluster.url)
            if self.corrupted:  # a test that corrupted a page on purpose may leave it unread
                problems = [x for x in problems if "do not match" not in x]
            assert problems == []

    def _open(self, namespace: str, budget_bytes: int | None) -> RedisShardedProvider:
        p = RedisShardedProvider(self.cluster.url, budget_bytes=budget_bytes, namespace=namespace,
                                 shards=self.shards, group=self.group)
        self.made.append(p)
        return p

    def make_provider(self, tmp_path: Path, budget_bytes: int) -> Provider:
        return self._open(unique_namespace("sc"), budget_bytes)

    def reopen(self, provider: Provider) -> Provider:
        assert isinstance(provider, RedisShardedProvider)
        provider.close()
        return self._open(provider.namespace, None)

    def _raw(self, provider: Provider, key: Key) -> tuple[Any, bytes]:
        assert isinstance(provider, RedisShardedProvider)
        s = provider.shard_of(key)
        assert s is not None
        shard = provider.shard_providers[s]
        return shard._link.client(), f"hkv:{{{shard.namespace}}}:d:{key.hex()}".encode()

    def backdoor_read(self, provider: Provider, key: Key) -> bytes | None:
        client, name = self._raw(provider, key)
        value = client.get(name)
        return None if value is None else bytes(value[:-56])

    def backdoor_corrupt(self, provider: Provider, key: Key) -> None:
        self.corrupted = True
        client, name = self._raw(provider, key)
        first = client.getrange(name, 0, 0)
        client.setrange(name, 0, bytes([first[0] ^ 0xFF]))

    def test_lru_leaf_order_with_refresh(self) -> None:  # type: ignore[override]
        pytest.skip(_PER_SHARD_LRU)

    def test_unsatisfiable_reserve_evicts_nothing(self) -> None:  # type: ignore[override]
        pytest.skip(_PER_SHARD_BUDGET)

    def test_in_flight_space_is_not_evictable(self) -> None:  # type: ignore[override]
        pytest.skip(_PER_SHARD_BUDGET)

    def test_leased_entries_survive_pressure(self) -> None:  # type: ignore[override]
        pytest.skip(_PER_SHARD_BUDGET)

    def test_reused_space_never_serves_an_evicted_key(self) -> None:  # type: ignore[override]
        pytest.skip(_PER_SHARD_BUDGET)

    # RetainTests (s6-tree): its budgets of 8-16 pages leave each of 3 shards room for a few, and
    # the retained share is enforced per shard; tests/test_sharded.py covers retain with room.
    def test_retained_prefix_survives_pressure(self) -> None:
        pytest.skip(_PER_SHARD_BUDGET)

    def test_retain_share_bounds_the_retained_bytes(self) -> None:
        pytest.skip(_PER_SHARD_BUDGET + "; the retained share is per shard too")

    def test_reservations_never_evict_retained(self) -> None:
        pytest.skip(_PER_SHARD_BUDGET)

    def test_stateful(self) -> None:  # type: ignore[override]
        pytest.skip(_PER_SHARD_BUDGET + "; the oracle's capacity rule is store-wide")
