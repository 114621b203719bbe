"""Read-only opens (issue 16 item 15: the CLI's read commands open redis:// read-only) and the
store-wide counters kept on the server (issue 19 item 2: ``hostkv stats`` of a running engine)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable

import hostkv_providers as hk
import pytest
from conftest import unique_namespace
from hostkv_providers import InvalidArgumentError, StoreNotFoundError
from hostkv_providers.testing import chain, key_of, page_bytes

from hostkv_redis import RedisProvider
from hostkv_redis.servers import RedisServer

PAGE = 4096
Make = Callable[..., RedisProvider]


def _server_keys(server: RedisServer, namespace: str) -> dict[bytes, bytes]:
    """Every key of the store with a digest of its value (a read-only client must change none)."""
    with server.client() as c:
        out = {}
        for name in c.scan_iter(match=f"hkv:{{{namespace}}}:*"):
            out[name] = c.dump(name)
        return out


def test_readonly_never_creates_a_store(redis_server: RedisServer) -> None:
    ns = unique_namespace("ro-none")
    with pytest.raises(StoreNotFoundError):
        RedisProvider(redis_server.url, namespace=ns, readonly=True)
    with pytest.raises(StoreNotFoundError):
        hk.open(f"{redis_server.url}?namespace={ns}&readonly=true")
    assert _server_keys(redis_server, ns) == {}
    with pytest.raises(InvalidArgumentError, match="read-only"):
        RedisProvider(redis_server.url, namespace=ns, readonly=True, budget_bytes=1 << 20)


def test_readonly_reads_and_refuses_writes_changing_nothing(make_redis: Make, redis_server: RedisServer) -> None:
    w = make_redis()
    keys = chain("ro", 4)
    parent = None
    for k in keys:
        w.put(k, parent, page_bytes(k, PAGE))
        parent = k
    w.put_anchor(keys[-1], "state", b"s" * 10)
    res = w.reserve(key_of("ro-open"), keys[-1], PAGE)  # a writer's reservation in flight
    before = _server_keys(redis_server, w.namespace)
    r = hk.open(f"{redis_server.url}?namespace={w.namespace}&readonly=true")
    try:
        assert isinstance(r, RedisProvider) and r.readonly and r.describe()["readonly"] is True
        assert r.longest_prefix(keys) == 4 and r.present(keys) == [True] * 4
        assert r.read_bytes(keys[2]) == page_bytes(keys[2], PAGE)
        assert r.read_many_bytes(keys) == [page_bytes(k, PAGE) for k in keys]
        assert r.get_anchor(keys[-1], "state") == b"s" * 10
        assert r.deepest_anchor(keys, "state") == 4
        assert r.in_flight(key_of("ro-open")) and not r.in_flight(key_of("nope"))
        assert sorted(e.key for e in r.iter_entries()) == sorted(keys)
        assert r.verify().ok and r.stats().entries == 4
        for call in (lambda: r.reserve(key_of("x"), None, PAGE),
                     lambda: r.put(key_of("x"), None, b"x"),
                     lambda: r.put_many([(key_of("x"), None, b"x")]),
                     lambda: r.evict(keys=[keys[0]]),
                     lambda: r.evict(nbytes=PAGE),
                     lambda: r.put_anchor(keys[0], "a", b"a"),
                     lambda: r.lease(keys),
                     lambda: r.verify(repair=True)):
            with pytest.raises(InvalidArgumentError, match="read-only"):
                call()
    finally:
        r.close()
    assert _server_keys(redis_server, w.namespace) == before
    assert res is not None
    res.abort()


def test_readonly_sees_damage_but_leaves_it(make_redis: Make, redis_server: RedisServer) -> None:
    w = make_redis()
    keys = chain("ro-bad", 3)
    parent = None
    for k in keys:
        w.put(k, parent, page_bytes(k, PAGE))
        parent = k
    with redis_server.client() as c:
        c.setrange(f"hkv:{{{w.namespace}}}:d:{keys[1].hex()}", 0, b"\xff")
        c.delete(f"hkv:{{{w.namespace}}}:d:{keys[2].hex()}")
    r = RedisProvider(redis_server.url, namespace=w.namespace, readonly=True)
    try:
        assert r.read_bytes(keys[1]) is None and r.read_bytes(keys[2]) is None
        assert r.stats().checksum_failures == 2
        assert r.present(keys) == [True] * 3  # not dropped: a writer's verify --repair does that
    finally:
        r.close()
    assert w.read_bytes(keys[1]) is None  # the writer drops it
    assert w.present(keys) == [True, False, False]


def test_store_counters_cover_every_client(make_redis: Make, redis_server: RedisServer) -> None:
    a = make_redis()
    b = make_redis(namespace=a.namespace)
    keys = chain("sc", 3)
    assert a.put(keys[0], None, page_bytes(keys[0], PAGE))
    res = b.reserve(keys[1], keys[0], PAGE)
    assert res is not None
    res.write(0, page_bytes(keys[1], PAGE))
    res.seal()
    assert b.put_many([(keys[2], keys[1], page_bytes(keys[2], PAGE))]) == [True]
    assert a.read_bytes(keys[0]) is not None and b.read_many_bytes(keys)[2] is not None
    assert a.read_bytes(key_of("sc-miss")) is None
    aborted = a.reserve(key_of("sc-abort"), None, PAGE)
    assert aborted is not None
    aborted.abort()
    with redis_server.client() as c:  # a damaged page: a checksum failure, a miss (not a hit)
        c.setrange(f"hkv:{{{a.namespace}}}:d:{keys[2].hex()}", 0, b"\xff")
    assert a.read_bytes(keys[2]) is None
    assert a.evict(nbytes=PAGE).entries >= 1
    c1 = a.store_counters()
    assert c1 == b.store_counters()
    assert c1["seals"] == 3 and c1["bytes_written"] == 3 * PAGE
    assert c1["hits"] == 4 and c1["bytes_read"] == 4 * PAGE  # read_bytes(k0), read_many(k0, k1, k2)
    assert c1["misses"] == 2 and c1["checksum_failures"] == 1
    assert c1["aborts"] == 1 and c1["evictions"] >= 1
    # a read-only client reads them too, and changes none
    r = RedisProvider(redis_server.url, namespace=a.namespace, readonly=True)
    try:
        r.read_bytes(keys[0])
        assert r.store_counters() == c1
    finally:
        r.close()


def test_hostkv_stats_shows_the_store_counters(make_redis: Make, redis_server: RedisServer) -> None:
    """The CLI's read command opens the store read-only and sees another client's traffic."""
    pytest.importorskip("hostkv_cli")
    a = make_redis()
    k = key_of("cli-stats")
    a.put(k, None, page_bytes(k, PAGE))
    a.read_bytes(k)
    url = f"{redis_server.url}?namespace={a.namespace}"
    before = _server_keys(redis_server, a.namespace)
    out = subprocess.run([sys.executable, "-m", "hostkv_cli", "stats", "--json", url],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "no readonly=true option" not in out.stderr
    assert _server_keys(redis_server, a.namespace) == before
    text = json.dumps(json.loads(out.stdout))
    assert '"entries": 1' in text
