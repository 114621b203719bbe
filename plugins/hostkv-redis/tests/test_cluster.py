"""Redis Cluster specifics: one store = one slot = one master; stores spread by namespace; a store
whose slot is migrated to another master keeps working (MOVED → topology refresh)."""

from __future__ import annotations

from typing import Any

import hostkv_providers
import redis
from conftest import unique_namespace
from fsck import fsck
from hostkv_providers.testing import chain, page_bytes
from redis.cluster import RedisCluster

from hostkv_redis import RedisClusterProvider
from hostkv_redis.servers import RedisClusterServers

PAGE = 4096


def _owner(cluster: RedisCluster, namespace: str) -> Any:
    return cluster.get_node_from_key(f"hkv:{{{namespace}}}:m")  # type: ignore[no-untyped-call]


def test_stores_spread_over_masters_by_namespace(redis_cluster: RedisClusterServers) -> None:
    names = [unique_namespace("spread") for _ in range(12)]
    rc = RedisCluster.from_url(redis_cluster.url)
    try:
        owners = {_owner(rc, ns).port for ns in names}
        assert len(owners) >= 2  # 12 hash tags over 3 masters
        for ns in names[:3]:
            url = f"redis+cluster://127.0.0.1:{redis_cluster.servers[0].port}?namespace={ns}&budget=1MiB&shards=1"
            with hostkv_providers.open(url) as p:
                assert isinstance(p, RedisClusterProvider)
                keys = chain(ns, 20)
                p.put_many([(k, keys[i - 1] if i else None, page_bytes(k, PAGE)) for i, k in enumerate(keys)])
                assert p.longest_prefix(keys) == 20
            node = rc.get_redis_connection(_owner(rc, ns))
            assert fsck(node, ns) == []
            # every key of the store is on its owner: the hash tag keeps it in one slot
            # meta + 20 entries + 20 pages + 19 child sets (not the leaf) + the LRU set
            assert len(list(node.scan_iter(match=f"hkv:{{{ns}}}:*"))) == 1 + 20 + 20 + 19 + 1
    finally:
        rc.close()


def _migrate_slot(servers: RedisClusterServers, slot: int, src_port: int, dst_port: int) -> None:
    clients: dict[int, Any] = {s.port: s.client() for s in servers.servers}
    try:
        ids = {port: c.execute_command("CLUSTER", "MYID").decode() for port, c in clients.items()}
        src, dst = clients[src_port], clients[dst_port]
        dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", ids[src_port])
        src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", ids[dst_port])
        while keys := src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 200):
            src.execute_command("MIGRATE", "127.0.0.1", dst_port, "", 0, 10000, "KEYS", *keys)
        for c in (dst, src, *clients.values()):
            c.execute_command("CLUSTER", "SETSLOT", slot, "NODE", ids[dst_port])
    finally:
        for c in clients.values():
            c.close()


def test_store_survives_slot_migration(redis_cluster: RedisClusterServers) -> None:
    ns = unique_namespace("move")
    p = RedisClusterProvider(redis_cluster.url, namespace=ns, budget_bytes=64 * PAGE, cluster=True)
    keys = chain("move", 12)
    p.put_many([(k, keys[i - 1] if i else None, page_bytes(k, PAGE)) for i, k in enumerate(keys[:8])])
    lease = p.lease(keys[:8])
    rc = RedisCluster.from_url(redis_cluster.url)
    try:
        src = _owner(rc, ns).port
        dst = next(s.port for s in redis_cluster.servers if s.port != src)
        slot = rc.keyslot(f"hkv:{{{ns}}}:m")  # type: ignore[no-untyped-call]
        _migrate_slot(redis_cluster, slot, src, dst)
        # the provider still talks to the old master: MOVED, refresh, retry, transparently
        assert p.read_many_bytes(keys[:8]) == [page_bytes(k, PAGE) for k in keys[:8]]
        lease.release()
        out = p.put_many([(k, keys[i + 7], page_bytes(k, PAGE)) for i, k in enumerate(keys[8:])])
        assert out == [True] * 4
        assert p.longest_prefix(keys) == 12
        with redis.Redis(port=dst) as node:
            assert fsck(node, ns) == []
        with redis.Redis(port=src) as node:
            assert list(node.scan_iter(match=f"hkv:{{{ns}}}:*")) == []
    finally:
        rc.close()
        p.close()


def test_masters_start_with_distinct_config_epochs(redis_cluster: RedisClusterServers) -> None:
    """The harness sets each node's config epoch before MEET (as redis-cli --cluster create does):
    left at 0 they collide, and a slot migrated while gossip still resolves that can return to
    its old master, whose claim then deletes the keys moved to the new one."""
    epochs = []
    for s in redis_cluster.servers[:redis_cluster.masters]:
        with s.client() as c:
            info = c.execute_command("CLUSTER", "INFO").decode()
        fields = dict(line.split(":", 1) for line in info.split() if ":" in line)
        epochs.append(int(fields["cluster_my_epoch"]))
    assert len(set(epochs)) == len(epochs) and min(epochs) >= 1
