"""The sharded cluster store (``redis+cluster://...?shards=N``): placement, spread under skew,
cross-shard chains, budget and LRU per shard, checked against the server with :func:`fsck`."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import hostkv_providers
import pytest
from conftest import unique_namespace
from fsck import fsck
from hostkv_providers.errors import IncompatibleStoreError, UnknownKeyError
from hostkv_providers.testing import chain, page_bytes
from redis.cluster import RedisCluster

from hostkv_redis import RedisShardedProvider
from hostkv_redis.servers import RedisClusterServers

PAGE = 1024


def _items(keys: list[Any], nbytes: int = PAGE, parent: Any = None) -> list[tuple[Any, Any, bytes]]:
    return [(k, keys[i - 1] if i else parent, page_bytes(k, nbytes)) for i, k in enumerate(keys)]


def settle(providers: Iterable[RedisShardedProvider]) -> None:
    """Apply every cross-shard pin release still queued in the outboxes, through each open
    provider's public maintenance call (:meth:`RedisShardedProvider.reconcile_pins` drains every
    outbox first), so that no release is left for a renewal thread to apply during a check.

    Why a check needs it: :func:`fsck` reads a shard in several commands, not in one atomic step.
    Releases queued by scripts (the budget guard's LRU evictions in ``put_many``, expired
    reservations) are applied by the renewal thread about once a second; one ``xunpin`` that lands
    between fsck's read of the entries and its ``HLEN`` of their pin hashes reads as ``xc 1 != 0
    pins`` although every script keeps ``xc == HLEN(x:<P>)`` atomically.  Once the outboxes are
    empty, a renewal thread's drain finds nothing (one of its own already in flight only repeats
    releases applied here: ``xunpin`` is idempotent), so a client that holds no lease or
    reservation changes nothing while the check runs."""
    for p in providers:
        if not p.closed:
            p.reconcile_pins()


def check_shards(p: RedisShardedProvider, cluster_url: str, *, settled: bool = True) -> list[str]:
    """fsck of every shard on the master that owns it now, after :func:`settle` of ``p`` (every
    other open client of the store must be settled by the caller too; ``settled=False``: as the
    outboxes are, for a client without a renewal thread)."""
    if settled:
        settle([p])
    rc = RedisCluster.from_url(cluster_url)
    problems = []
    try:
        for s in p.shard_providers:
            node = rc.get_redis_connection(rc.get_node_from_key(f"hkv:{{{s.namespace}}}:m"))  # type: ignore[no-untyped-call]
            problems += [f"{s.namespace}: {x}" for x in fsck(node, s.namespace)]
    finally:
        rc.close()
    return problems


@pytest.fixture
def sharded(redis_cluster: RedisClusterServers) -> Iterator[Any]:
    made: list[tuple[RedisShardedProvider, bool]] = []

    def make(budget: int | None = 64 << 20, namespace: str | None = None, check: bool = True,
             **kw: Any) -> RedisShardedProvider:
        p = RedisShardedProvider(redis_cluster.url, budget_bytes=budget, namespace=namespace or unique_namespace("sh"),
                                 **kw)
        made.append((p, check))
        return p

    yield make
    settle([p for p, check in made if check])  # every client of a checked store, before any check
    for p, check in made:
        problems = check_shards(p, redis_cluster.url) if check else []
        if not check:  # a large store: drop it (fsck scans every node's keyspace per shard)
            for s in p.shard_providers:
                s.evict(nbytes=1 << 62)
        p.close()
        assert problems == []


def test_url_opens_the_sharded_store(redis_cluster: RedisClusterServers) -> None:
    ns = unique_namespace("url")
    with hostkv_providers.open(f"redis+cluster://127.0.0.1:{redis_cluster.servers[0].port}"
                               f"?namespace={ns}&budget=48MiB&shards=12&group=8") as p:
        assert isinstance(p, RedisShardedProvider)
        assert p.describe()["shards"] == 12 and p.budget_bytes == 48 << 20
    with pytest.raises(IncompatibleStoreError):
        RedisShardedProvider(redis_cluster.url, namespace=ns, shards=16, group=8)


def test_shards_spread_evenly_over_masters(sharded: Any) -> None:
    p = sharded(shards=48)
    owners: dict[str, int] = {}
    for s in range(48):
        name = str(p._node_of(s).name)
        owners[name] = owners.get(name, 0) + 1
    assert sorted(owners.values()) == [16, 16, 16]  # equal slot ranges, evenly spread tags


@pytest.mark.parametrize("shared", [32, 30])
def test_shared_prompt_with_1000_continuations_spreads(sharded: Any, shared: int) -> None:
    """Every request shares a system prompt, then diverges into 1,000 distinct continuations:
    the most loaded master holds <= 1.25x the mean (32 shared pages: aligned with the groups;
    30: the divergence is inside a group, whose shard gets up to group-1 pages of each)."""
    p = sharded(budget=256 << 20, shards=48, group=4, check=False)
    prompt = chain(f"sys{shared}", shared)
    assert p.put_many(_items(prompt)) == [True] * shared
    items = []
    for j in range(1000):
        items += _items(chain(f"cont{shared}-{j}", 32), parent=prompt[-1])
    out = p.put_many(items)
    assert out == [True] * len(items)
    load = p.load_by_master()
    assert sum(load.values()) == (shared + 32_000) * PAGE
    mean = sum(load.values()) / len(load)
    assert len(load) == 3 and max(load.values()) <= 1.25 * mean, load
    probe = prompt + chain(f"cont{shared}-7", 32)
    assert p.longest_prefix(probe) == shared + 32
    assert p.read_many_bytes(probe[-3:]) == [page_bytes(k, PAGE) for k in probe[-3:]]


def test_chain_across_shards(sharded: Any) -> None:
    p = sharded(shards=24, group=4)
    keys = chain("x", 40)
    assert p.put_many(_items(keys)) == [True] * 40
    shards = {p.shard_of(k) for k in keys}
    assert len(shards) >= 5  # 10 groups on several shards
    assert p.longest_prefix(keys) == 40
    assert p.longest_prefix(keys + chain("y", 3)) == 40
    # a fresh client (no placement memory) finds everything by locating shard by shard
    q = sharded(budget=None, namespace=p.namespace, shards=24, group=4)
    assert q.longest_prefix(keys) == 40
    assert q.present([keys[21], chain("y", 1)[0]]) == [True, False]
    more = chain("x", 45)[40:]
    assert q.put_many([(k, (keys + more)[39 + i], page_bytes(k, PAGE)) for i, k in enumerate(more)]) == [True] * 5
    assert p.longest_prefix(keys + more) == 45
    # the contract's reserve/write/seal for a page that starts a new group in another shard
    nxt = chain("x", 46)[45]
    res = p.reserve(nxt, more[-1], PAGE)
    assert res is not None
    p.write(res, 0, page_bytes(nxt, PAGE))
    p.seal(res)
    assert p.longest_prefix(keys + more + [nxt]) == 46
    assert p.reserve(nxt, more[-1], PAGE) is None  # dedup
    with pytest.raises(UnknownKeyError):
        p.reserve(chain("z", 2)[1], chain("z", 1)[0], PAGE)
    # a lease pins what it found, shard by shard
    with p.lease(keys) as lz:
        assert lz.prefix_len == 40
        # the leased page stays; its subtree in the other shards (6 pages) goes
        assert p.evict(keys=[keys[39]]).skipped >= 1
    st = p.stats()
    assert st.entries == 40 and st.used_bytes == 40 * PAGE
    assert p.present([*more, nxt]) == [False] * 6


def test_evict_keys_at_a_group_tail_takes_the_later_groups(sharded: Any) -> None:
    """``evict(keys)`` of a group's last page removes its subtree in the other shards too."""
    p = sharded(shards=24, group=4)
    keys = chain("cut", 16)
    p.put_many(_items(keys))
    assert p.evict(keys=[keys[7]]).entries == 9  # keys[7] and the two groups below it
    assert p.stats().entries == 7
    assert p.present(keys) == [True] * 7 + [False] * 9
    assert p.longest_prefix(keys) == 7
    with p.lease(keys) as lz:
        assert lz.prefix_len == 7
    assert p.deepest_anchor(keys, "state") == 0
    # put back: the chain is whole again
    assert p.put_many(_items(keys[7:], parent=keys[6])) == [True] * 9
    assert p.longest_prefix(keys) == 16
    p.put_anchor(keys[13], "state", b"s" * 10)
    assert p.deepest_anchor(keys, "state") == 14


def test_budget_holds_per_shard_and_lru_leaves_go_first(sharded: Any) -> None:
    shards = 6
    p = sharded(budget=shards * 40 * PAGE, shards=shards, group=4)
    per = p.shard_providers[0].budget_bytes
    assert per == 40 * PAGE
    hot = chain("hot", 8)
    p.put_many(_items(hot))
    for j in range(60):
        c = chain(f"fill{j}", 8)
        p.put_many(_items(c))
        # read every round: the hot chain stays recent, and shrinks from its end only.  (Not
        # "stays whole": a shard whose other pages are all pinned by child groups elsewhere has
        # the hot chain's pages as its only leaves, see docs/providers/redis.md, "Not done".)
        n = p.longest_prefix(hot)
        assert p.present(hot) == [True] * n + [False] * (8 - n)
        p.read_many_bytes(hot)
        if n < 8:
            assert p.put_many(_items(hot[n:], parent=hot[n - 1] if n else None)) == [True] * (8 - n)
    st = p.stats()
    assert st.evictions > 0
    assert st.used_bytes <= p.budget_bytes
    for s in p.shard_providers:
        assert s.stats().used_bytes <= per


def test_put_many_error_in_a_parent_group_fails_its_descendants(sharded: Any) -> None:
    p = sharded(shards=8, group=2)
    keys = chain("err", 6)
    missing_parent = chain("nope", 1)[0]
    out = p.put_many([(keys[0], missing_parent, page_bytes(keys[0], PAGE)),
                      *[(k, keys[i], page_bytes(k, PAGE)) for i, k in enumerate(keys[1:])]])
    assert all(isinstance(r, UnknownKeyError) for r in out)
    assert p.present(keys) == [False] * 6


def test_one_renewal_thread_keeps_every_shards_leases(sharded: Any) -> None:
    import threading
    import time

    p = sharded(shards=6, group=2, lease_ttl=1.0)
    assert sum(t.name == "hostkv-redis-renew" for t in threading.enumerate()) >= 1
    keys = chain("renew", 12)
    p.put_many(_items(keys))
    with p.lease(keys) as lz:
        assert lz.prefix_len == 12
        assert len({p.shard_of(k) for k in keys}) >= 3
        time.sleep(2.5)  # past the TTL: only renewal keeps the pins
        assert p.evict(keys=keys).entries == 0
    assert p.evict(keys=[keys[0], keys[1]]).entries == 12  # the whole chain, across shards
