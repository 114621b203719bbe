"""Retained prefixes on the server (issue 19 item 4): marks every client sees, the sharded store's
chains across shards, and the accounting the independent fsck checks."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from conftest import unique_namespace
from fsck import fsck
from hostkv_providers import CapacityError, RetainedError, UnknownKeyError
from hostkv_providers.testing import chain, key_of, page_bytes

from hostkv_redis import RedisProvider, RedisShardedProvider
from hostkv_redis.servers import RedisClusterServers, RedisServer

PAGE = 4096
Make = Callable[..., RedisProvider]


def _put_chain(p: Any, keys: list[Any]) -> None:
    assert p.put_many([(k, keys[i - 1] if i else None, page_bytes(k, PAGE)) for i, k in enumerate(keys)]) \
        == [True] * len(keys)


def test_marks_are_store_wide_and_hold_under_pressure(make_redis: Make, redis_server: RedisServer) -> None:
    a = make_redis(budget_bytes=16 * PAGE)
    b = make_redis(namespace=a.namespace)
    prompt = chain("rt-prompt", 4)
    _put_chain(a, prompt)
    assert a.retain([prompt[-1]]) == 1
    info = b.entry(prompt[-1])  # another client sees the mark
    assert info is not None and info.retained
    st = b.stats()
    assert st.retained == 1 and st.retained_bytes == 4 * PAGE
    for i in range(40):  # far more than the budget passes through another client
        b.put(key_of(f"rt-fill-{i}"), None, page_bytes(key_of(f"rt-fill-{i}"), PAGE))
    assert b.present(prompt) == [True] * 4
    with pytest.raises(RetainedError):
        b.evict([prompt[0]])
    assert b.unretain([prompt[-1]]) == 1 and a.stats().retained_bytes == 0
    b.evict(nbytes=1 << 40)
    assert a.present(prompt) == [False] * 4
    with redis_server.client() as c:
        assert fsck(c, a.namespace) == []


def test_share_option_and_all_or_nothing(redis_server: RedisServer) -> None:
    ns = unique_namespace("rt-share")
    p = RedisProvider(f"{redis_server.url}", budget_bytes=10 * PAGE, namespace=ns, retain_share=0.3)
    try:
        keys = chain("rt-share", 5)
        _put_chain(p, keys)
        with pytest.raises(CapacityError, match="retained share"):
            p.retain([keys[3]])  # 4 pages > 3
        assert p.retain([keys[2]]) == 1  # 3 pages fit
        with pytest.raises(UnknownKeyError):
            p.retain([keys[4], key_of("rt-missing")])
        assert p.entry(keys[4]) is not None and not p.entry(keys[4]).retained  # type: ignore[union-attr]
        assert p.describe()["retain_share"] == 0.3
    finally:
        p.close()
    with pytest.raises(Exception, match="retain_share"):
        RedisProvider(redis_server.url, namespace=ns, retain_share=2.0)


def test_a_damaged_retained_page_is_dropped_and_accounted(make_redis: Make, redis_server: RedisServer) -> None:
    p = make_redis(budget_bytes=16 * PAGE)
    keys = chain("rt-bad", 3)
    _put_chain(p, keys)
    p.retain([keys[2]])
    with redis_server.client() as c:
        c.setrange(f"hkv:{{{p.namespace}}}:d:{keys[1].hex()}", 0, b"\xff")
    assert p.read_bytes(keys[1]) is None  # never wrong bytes: dropped with its subtree
    st = p.stats()
    assert st.retained == 0 and st.retained_bytes == 0
    assert p.present(keys) == [True, False, False]
    with redis_server.client() as c:
        assert fsck(c, p.namespace) == []


@pytest.fixture
def sharded(redis_cluster: RedisClusterServers) -> Iterator[Callable[..., RedisShardedProvider]]:
    made: list[RedisShardedProvider] = []

    def make(**kw: Any) -> RedisShardedProvider:
        p = RedisShardedProvider(redis_cluster.url, namespace=unique_namespace("rt-sh"), **kw)
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()


def test_sharded_retain_counts_ancestors_in_other_shards(sharded: Callable[..., RedisShardedProvider]) -> None:
    p = sharded(budget_bytes=6 * 64 * PAGE, shards=6, group=2)
    keys = chain("rt-sh", 10)  # 5 groups, spread over the shards
    _put_chain(p, keys)
    assert p.retain([keys[-1]]) == 1
    st = p.stats()
    assert st.retained == 1 and st.retained_bytes == 10 * PAGE  # every ancestor, once
    assert p.retain([keys[-1], keys[5]]) == 1  # keys[5]'s ancestors are counted already
    assert p.stats().retained_bytes == 10 * PAGE
    for target in ([keys[0]], [keys[4]], [keys[9]]):
        with pytest.raises(RetainedError):
            p.evict(target)
    p.evict(nbytes=1 << 40)
    assert p.present(keys) == [True] * 10
    assert p.unretain(keys) == 2
    st = p.stats()
    assert st.retained == 0 and st.retained_bytes == 0
    assert p.evict([keys[0]]).entries == 10
