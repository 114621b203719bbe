"""The sharded store on a 3-master + 3-replica loopback cluster while the cluster changes under
it: a live slot migration during reads and writes, then a master killed and its replica promoted.

Workload: writer threads save new chains (``put_many``), reader threads read chains back
(``read_many_bytes``).  A chain counts as *acknowledged* only when every page's result was
``True`` (with ``wait_replicas=1``: stored and confirmed by a replica).  Page bytes are a
function of the key, so every read is checked: a page is the right bytes or a miss, never
anything else.  Errors during the change must be typed (``HostKVError``); afterwards the same
provider objects (no restart) must serve every acknowledged chain.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from conftest import unique_namespace
from hostkv_providers.errors import HostKVError
from hostkv_providers.testing import chain, page_bytes
from test_sharded import check_shards

from hostkv_redis import RedisShardedProvider
from hostkv_redis.servers import RedisClusterServers, RedisServer

PAGE = 2048
CHAIN = 12


class Load:
    """Writers and readers on one provider; counts what they saw."""

    def __init__(self, p: RedisShardedProvider, label: str, writers: int = 2, readers: int = 2) -> None:
        self.p = p
        self.label = label
        self.acked: list[list[Any]] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.errors: list[BaseException] = []  # typed errors seen (allowed while the cluster changes)
        self.bad: list[str] = []  # wrong bytes or untyped exceptions: never allowed
        self.reads = self.hits = self.writes = 0
        self.threads = [threading.Thread(target=self._write, args=(i,), daemon=True) for i in range(writers)]
        self.threads += [threading.Thread(target=self._read, args=(i,), daemon=True) for i in range(readers)]

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=60)

    def _write(self, w: int) -> None:
        n = 0
        while not self.stop.is_set():
            keys = chain(f"{self.label}-w{w}-{n}", CHAIN)
            n += 1
            try:
                items = [(k, keys[i - 1] if i else None, page_bytes(k, PAGE)) for i, k in enumerate(keys)]
                out = self.p.put_many(items)
            except HostKVError as exc:
                self.errors.append(exc)
                continue
            except BaseException as exc:
                self.bad.append(f"put_many raised {exc!r}")
                return
            with self.lock:
                self.writes += 1
                if all(r is True for r in out):
                    self.acked.append(keys)

    def _read(self, r: int) -> None:
        rng = random.Random(r)
        while not self.stop.is_set():
            with self.lock:
                keys = rng.choice(self.acked) if self.acked else None
            if keys is None:
                time.sleep(0.01)
                continue
            try:
                got = self.p.read_many_bytes(keys)
            except HostKVError as exc:
                self.errors.append(exc)
                continue
            except BaseException as exc:
                self.bad.append(f"read_many_bytes raised {exc!r}")
                return
            with self.lock:
                self.reads += 1
                for k, v in zip(keys, got, strict=True):
                    if v is not None:
                        self.hits += 1
                        if v != page_bytes(k, PAGE):
                            self.bad.append(f"wrong bytes for {k.hex()[:16]}")

    def wait_for(self, writes: int, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while self.writes < writes and not self.bad:
            assert time.monotonic() < deadline, f"only {self.writes} writes; errors {self.errors[-3:]}"
            time.sleep(0.05)

    def check_all_acked(self) -> int:
        """Every acknowledged chain is whole and right, read through the same provider."""
        assert self.bad == []
        with self.lock:
            chains = list(self.acked)
        for keys in chains:
            assert self.p.longest_prefix(keys) == CHAIN
            assert self.p.read_many_bytes(keys) == [page_bytes(k, PAGE) for k in keys]
        return len(chains)


@pytest.fixture
def ha(redis_cluster_ha: RedisClusterServers) -> Iterator[RedisClusterServers]:
    redis_cluster_ha.wait_ok()
    yield redis_cluster_ha


def _open(cluster: RedisClusterServers, **kw: Any) -> RedisShardedProvider:
    return RedisShardedProvider(cluster.url, namespace=unique_namespace("ha"), budget_bytes=256 << 20, shards=24,
                                group=4, retries=8, **kw)


def _migrate_slot(cluster: RedisClusterServers, slot: int, src: RedisServer, dst: RedisServer, batch: int = 20) -> int:
    """The operator's resharding of one slot: IMPORTING/MIGRATING, MIGRATE in small batches
    (so scripts meet a half-moved slot), then SETSLOT NODE on every master."""
    moved = 0
    sid, did = cluster.node_id(src), cluster.node_id(dst)
    with src.client() as s, dst.client() as d:
        d.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", sid)
        s.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", did)
        while keys := s.execute_command("CLUSTER", "GETKEYSINSLOT", slot, batch):
            s.execute_command("MIGRATE", "127.0.0.1", dst.port, "", 0, 10000, "KEYS", *keys)
            moved += len(keys)
            time.sleep(0.01)  # let the load run against the half-moved slot
        d.execute_command("CLUSTER", "SETSLOT", slot, "NODE", did)
        s.execute_command("CLUSTER", "SETSLOT", slot, "NODE", did)
    for m in cluster.masters_now():
        if m not in (src, dst):
            with m.client() as c:
                c.execute_command("CLUSTER", "SETSLOT", slot, "NODE", did)
    return moved


def test_live_slot_migration_during_reads_and_writes(ha: RedisClusterServers) -> None:
    p = _open(ha)
    try:
        src, dst = ha.masters_now()[:2]
        with src.client() as c:
            owned = _slots_of(c)
        mine = [s for s in p.shard_providers if redis.crc.key_slot(s.namespace.encode()) in owned]
        assert len(mine) >= 4
        with src.client() as c:
            errors_before = int(c.info("stats")["total_error_replies"])
        with Load(p, "mig") as load:
            load.wait_for(20)
            moved = 0
            for s in mine[:4]:
                moved += _migrate_slot(ha, redis.crc.key_slot(s.namespace.encode()), src, dst)
                load.wait_for(load.writes + 3)
            before = load.writes
            load.wait_for(before + 10)  # writes and reads go on after the move, same clients
        assert moved > 0
        # the load did meet the half-moved slots: the source refused some of its commands
        # (scripts stopped by the migration guard, ASK/TRYAGAIN), which the clients retried
        with src.client() as c:
            assert int(c.info("stats")["total_error_replies"]) > errors_before
        n = load.check_all_acked()
        assert n >= 30 and load.hits > 0
        for s in mine[:4]:
            assert p._node_of(p.shard_providers.index(s)).port == dst.port
        assert check_shards(p, ha.url) == []
    finally:
        p.close()


def _slots_of(c: Any) -> set[int]:
    raw = c.execute_command("CLUSTER", "NODES")
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    out: set[int] = set()
    for line in text.splitlines():
        parts = line.split()
        if "myself" in parts[2]:
            for r in parts[8:]:
                if r.startswith("["):
                    continue
                lo, _, hi = r.partition("-")
                out.update(range(int(lo), int(hi or lo) + 1))
    return out


def test_master_killed_replica_promoted_nothing_acknowledged_lost(ha: RedisClusterServers) -> None:
    p = _open(ha, wait_replicas=1, wait_timeout=2.0)
    try:
        victim = ha.masters_now()[0]
        replica = ha.replica_of(victim)
        assert replica is not None
        with Load(p, "fo") as load:
            load.wait_for(30)
            acked_before = len(load.acked)
            victim.stop()  # SIGKILL: no goodbye to the cluster
            deadline = time.monotonic() + 60
            while replica not in ha.masters_now():
                assert time.monotonic() < deadline, "the replica was not promoted"
                time.sleep(0.2)
            ha.wait_ok()
            after = load.writes
            load.wait_for(after + 15)  # the same clients write and read again, no restart
        assert acked_before >= 20
        n = load.check_all_acked()
        assert n > acked_before
        assert check_shards(p, f"redis://127.0.0.1:{replica.port}") == []
    finally:
        p.close()
