"""Fixtures: real redis-server processes on loopback, started per session and killed at teardown.

Tests skip (with the reason) only when no ``redis-server`` binary is installed; CI installs it
(``apt-get install redis-server``).  ``HOSTKV_REDIS_SERVER=/path/to/valkey-server`` runs the suite
against another binary (see ``hostkv_redis.servers.server_binary``).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest

from hostkv_redis import RedisProvider
from hostkv_redis.servers import RedisClusterServers, RedisServer, server_binary

_NEED_SERVER = pytest.mark.skipif(
    server_binary() is None,
    reason="redis-server is not installed (apt-get install redis-server); CI installs it",
)
_names = itertools.count()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        item.add_marker(_NEED_SERVER)


def unique_namespace(label: str = "t") -> str:
    """A namespace no other test in this session uses (so each test gets a fresh, empty store)."""
    return f"{label}{next(_names)}"


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One loopback redis-server for the session; tests isolate themselves by namespace."""
    with RedisServer(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture
def own_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server for one test (for tests that kill or restart it)."""
    with RedisServer(tmp_path / "redis") as server:
        yield server


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterServers]:
    """A 3-master Redis Cluster on loopback ports (no replicas).

    Its node timeout is 15 s, not the 2 s default: with no replicas there is no failover to
    speed up, and on a loaded 2-core CI machine a node that stalled past 2 s was marked failed
    by the others, the cluster reported itself down and a test's teardown gave up
    (``test_chain_across_shards``, once)."""
    with RedisClusterServers(tmp_path_factory.mktemp("cluster"), masters=3, node_timeout_ms=15000) as cluster:
        yield cluster


@pytest.fixture
def make_redis(redis_server: RedisServer) -> Iterator[object]:
    """``make(budget_bytes=..., namespace=None, **kw) -> RedisProvider``; closed at teardown.

    Without ``namespace`` a fresh store (budget default 1 MiB); with one, a second client of it
    (budget default: the store's).
    """
    made: list[RedisProvider] = []

    def make(budget_bytes: int | None = None, namespace: str | None = None, **kw: object) -> RedisProvider:
        if namespace is None and budget_bytes is None:
            budget_bytes = 1 << 20
        p = RedisProvider(redis_server.url, budget_bytes=budget_bytes,
                          namespace=namespace or unique_namespace(), **kw)  # type: ignore[arg-type]
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()


@pytest.fixture(scope="module")
def redis_cluster_ha(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterServers]:
    """A 3-master Redis Cluster with one replica per master (1 s node timeout, for failovers).
    Module-scoped: the failover test kills a master, so no other module shares it."""
    with RedisClusterServers(tmp_path_factory.mktemp("cluster-ha"), masters=3, replicas=1,
                             node_timeout_ms=1000) as cluster:
        yield cluster
