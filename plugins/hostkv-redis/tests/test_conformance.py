"""The core's conformance suite against a real redis-server (standalone) and a Redis Cluster."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
from conftest import unique_namespace
from fsck import fsck
from hostkv_providers import Key, Provider
from hostkv_providers.testing import ProviderTests
from redis.cluster import RedisCluster

from hostkv_redis import RedisClusterProvider, RedisProvider
from hostkv_redis.servers import RedisClusterServers, RedisServer


class _RedisBackdoors:
    """Reach the page bytes on the server without the provider's read path; after each test,
    check every store the test used with the independent :func:`fsck`."""

    namespaces: list[str]
    corrupted: bool

    def _fresh_namespace(self, label: str) -> str:
        ns = unique_namespace(label)
        self.namespaces.append(ns)
        return ns

    def _check_stores(self, client: Any) -> None:
        for ns in self.namespaces:
            problems = fsck(client, ns)
            if self.corrupted:  # a test that corrupted a page on purpose may leave it unread
                problems = [p for p in problems if "do not match" not in p]
            assert problems == [], f"store {ns}: {problems}"

    def _raw(self, provider: Provider, key: Key) -> tuple[object, bytes]:
        assert isinstance(provider, RedisProvider)
        client = provider._link.client()
        return client, f"hkv:{{{provider.namespace}}}:d:{key.hex()}".encode()

    def backdoor_read(self, provider: Provider, key: Key) -> bytes | None:
        client, name = self._raw(provider, key)
        value = client.get(name)  # type: ignore[attr-defined]
        return None if value is None else bytes(value[:-56])

    def backdoor_corrupt(self, provider: Provider, key: Key) -> None:
        self.corrupted = True
        client, name = self._raw(provider, key)
        first = client.getrange(name, 0, 0)  # type: ignore[attr-defined]
        client.setrange(name, 0, bytes([first[0] ^ 0xFF]))  # type: ignore[attr-defined]


class TestRedisConformance(_RedisBackdoors, ProviderTests):
    supports_reopen = True

    @pytest.fixture(autouse=True)
    def _bind_server(self, redis_server: RedisServer) -> Iterator[None]:
        self.server = redis_server
        self.namespaces, self.corrupted = [], False
        yield  # set up first, so torn down after the suite's providers are closed
        with redis_server.client() as client:
            self._check_stores(client)

    def make_provider(self, tmp_path: Path, budget_bytes: int) -> Provider:
        return RedisProvider(self.server.url, budget_bytes=budget_bytes, namespace=self._fresh_namespace("c"))

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
    def _bind_cluster(self, redis_cluster: RedisClusterServers) -> Iterator[None]:
        self.cluster = redis_cluster
        self.namespaces, self.corrupted = [], False
        yield
        client = RedisCluster.from_url(redis_cluster.url)
        try:
            for ns in self.namespaces:
                node = client.get_redis_connection(client.get_node_from_key(f"hkv:{{{ns}}}:m"))  # type: ignore[no-untyped-call]
                problems = fsck(node, ns)
                if self.corrupted:
                    problems = [p for p in problems if "do not match" not in p]
                assert problems == [], f"store {ns}: {problems}"
        finally:
            client.close()

    def make_provider(self, tmp_path: Path, budget_bytes: int) -> Provider:
        return RedisClusterProvider(self.cluster.url, budget_bytes=budget_bytes,
                                    namespace=self._fresh_namespace("k"), cluster=True)

    def reopen(self, provider: Provider) -> Provider:
        assert isinstance(provider, RedisProvider)
        provider.close()
        return RedisClusterProvider(self.cluster.url, namespace=provider.namespace, cluster=True)
