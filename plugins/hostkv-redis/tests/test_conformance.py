"""The core's conformance suite against a real redis-server (standalone) and a Redis Cluster."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import pytest
from conftest import unique_namespace
from hostkv_providers import Key, Provider
from hostkv_providers.testing import ProviderTests

from hostkv_redis import RedisClusterProvider, RedisProvider
from hostkv_redis.servers import RedisClusterServers, RedisServer


class _RedisBackdoors:
    """Reach the page bytes on the server without the provider's read path."""

    def _raw(self, provider: Provider, key: Key) -> tuple[object, bytes]:
        assert isinstance(provider, RedisProvider)
        client = provider._link.client()
        return client, f"hkv:{{{provider.namespace}}}:d:{key.hex()}".encode()

    def backdoor_read(self, provider: Provider, key: Key) -> bytes | None:
        client, name = self._raw(provider, key)
        value = client.get(name)  # type: ignore[attr-defined]
        return None if value is None else bytes(value[:-56])

    def backdoor_corrupt(self, provider: Provider, key: Key) -> None:
        client, name = self._raw(provider, key)
        first = client.getrange(name, 0, 0)  # type: ignore[attr-defined]
        client.setrange(name, 0, bytes([first[0] ^ 0xFF]))  # type: ignore[attr-defined]


class TestRedisConformance(_RedisBackdoors, ProviderTests):
    supports_reopen = True

    @pytest.fixture(autouse=True)
    def _bind_server(self, redis_server: RedisServer) -> None:
        self.server = redis_server

    def make_provider(self, tmp_path: Path, budget_bytes: int) -> Provider:
        return RedisProvider(self.server.url, budget_bytes=budget_bytes, namespace=unique_namespace("c"))

    def reopen(self, provider: Provider) -> Provider:
        assert isinstance(provider, RedisProvider)
        provider.close()
        return RedisProvider(self.server.url, namespace=provider.namespace)


class TestRedisClusterConformance(_RedisBackdoors, ProviderTests):
    """A smaller run on a 3-master cluster: the stores land on different masters by namespace."""

    supports_reopen = True
    thread_ops: ClassVar[int] = 40
    stateful_examples: ClassVar[int] = 5

    @pytest.fixture(autouse=True)
    def _bind_cluster(self, redis_cluster: RedisClusterServers) -> None:
        self.cluster = redis_cluster

    def make_provider(self, tmp_path: Path, budget_bytes: int) -> Provider:
        return RedisClusterProvider(self.cluster.url, budget_bytes=budget_bytes, namespace=unique_namespace("k"),
                                    cluster=True)

    def reopen(self, provider: Provider) -> Provider:
        assert isinstance(provider, RedisProvider)
        provider.close()
        return RedisClusterProvider(self.cluster.url, namespace=provider.namespace, cluster=True)
