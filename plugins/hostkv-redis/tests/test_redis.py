"""What the conformance suite cannot see: many clients, expiry, batching, identity, URLs, OOM."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import hostkv_providers
import pytest
from conftest import unique_namespace
from fsck import fsck
from hostkv_providers import (
    CapacityError,
    IncompatibleStoreError,
    InFlightError,
    InvalidArgumentError,
    NoSpaceError,
    UnknownKeyError,
)
from hostkv_providers.testing import chain, key_of, page_bytes

from hostkv_redis import (
    RedisClusterProvider,
    RedisProvider,
    RedissProvider,
    ReservationLostError,
    ServerOutOfMemoryError,
)
from hostkv_redis.servers import RedisServer

PAGE = 4096
Make = Callable[..., RedisProvider]


def _expire_now(server: RedisServer, namespace: str) -> None:
    """Backdoor: make every lease and reservation of the store look expired (as if its client
    had died ``ttl`` ago), deterministically, without waiting."""
    with server.client() as c:
        for zset in ("lz", "fz"):
            name = f"hkv:{{{namespace}}}:{zset}"
            for member in c.zrange(name, 0, -1):
                c.zadd(name, {member: 0})


def _put_chain(p: RedisProvider, keys: list[Any], parent: Any = None) -> None:
    for k in keys:
        p.put(k, parent, page_bytes(k, PAGE))
        parent = k


def _consistent(server: RedisServer, p: RedisProvider, quiescent: bool = True) -> None:
    with server.client() as c:
        assert fsck(c, p.namespace, quiescent=quiescent) == []


# -- URLs, registration, identity --------------------------------------------------------------
def test_entry_points_and_url(redis_server: RedisServer) -> None:
    names = {i.name: i for i in hostkv_providers.available_providers()}
    for scheme in ("redis", "rediss", "redis+cluster", "rediss+cluster"):
        assert names[scheme].distribution == "hostkv-redis"
        assert names[scheme].error is None
        assert {"persistent", "multiprocess", "iterate", "verify"} <= names[scheme].capabilities
    assert hostkv_providers.provider_class("rediss") is RedissProvider
    assert hostkv_providers.provider_class("redis+cluster") is RedisClusterProvider
    ns = unique_namespace()
    url = f"redis://127.0.0.1:{redis_server.port}/0?budget=64KiB&namespace={ns}&lease_ttl=5&verify=never"
    with hostkv_providers.open(url) as p:
        assert isinstance(p, RedisProvider)
        assert p.budget_bytes == 65536
        assert p.describe()["lease_ttl_s"] == 5.0
        assert p.put(key_of("u"), None, b"x" * PAGE)
    with hostkv_providers.open(f"redis://127.0.0.1:{redis_server.port}/0?namespace={ns}") as p:
        assert p.budget_bytes == 65536  # the store's recorded budget
        assert p.read_bytes(key_of("u")) == b"x" * PAGE


@pytest.mark.parametrize("url, what", [
    ("redis://127.0.0.1:1/0?bogus=1", "unknown option"),
    ("redis://127.0.0.1:1/0?namespace=a{b}", "namespace"),
    ("redis://127.0.0.1:1/0?namespace=a*", "namespace"),
    ("redis:///nohost", "needs a host"),
    ("redis://127.0.0.1:1/0?budget=lots", "not a size"),
    ("redis://127.0.0.1:1/0?lease_ttl=-1", "lease_ttl"),
    ("redis://127.0.0.1:1/0?verify=maybe", "verify"),
])
def test_bad_urls(url: str, what: str) -> None:
    with pytest.raises(InvalidArgumentError, match=what):
        hostkv_providers.open(url)


def test_unreachable_server_is_typed() -> None:
    from hostkv_redis.servers import free_port

    with pytest.raises(hostkv_providers.StorageIOError) as err:
        RedisProvider(f"redis://127.0.0.1:{free_port()}/0", timeout=0.5, retries=0)
    assert err.value.hint


def test_password_redacted(redis_server: RedisServer) -> None:
    with pytest.raises(hostkv_providers.StorageIOError) as err:
        RedisProvider(f"redis://user:s3cret@127.0.0.1:{redis_server.port}/0", retries=0)
    assert "s3cret" not in str(err.value)


def test_identity_and_budget(make_redis: Make, redis_server: RedisServer) -> None:
    p = make_redis(budget_bytes=8 * PAGE)
    ns = p.namespace
    _put_chain(p, chain("id", 6))
    with pytest.raises(IncompatibleStoreError, match="budget"):
        RedisProvider(redis_server.url, namespace=ns, budget_bytes=4 * PAGE)
    # shrinking with resize evicts LRU leaves down to the new budget
    q = make_redis(namespace=ns, budget_bytes=4 * PAGE, resize=True)
    assert q.budget_bytes == 4 * PAGE and q.stats().used_bytes <= 4 * PAGE
    assert q.longest_prefix(chain("id", 6)) == 4
    # a shrink that leases forbid is refused, and evicts nothing
    with q.lease(chain("id", 4)), pytest.raises(CapacityError):
        RedisProvider(redis_server.url, namespace=ns, budget_bytes=PAGE, resize=True)
    assert q.longest_prefix(chain("id", 6)) == 4
    # another format on the server is refused
    with redis_server.client() as c:
        c.hset(f"hkv:{{{ns}}}:m", "format", "999")
    with pytest.raises(IncompatibleStoreError, match="format"):
        RedisProvider(redis_server.url, namespace=ns)
    with redis_server.client() as c:
        c.hset(f"hkv:{{{ns}}}:m", "format", str(hostkv_providers.FORMAT_VERSION))


# -- many clients ------------------------------------------------------------------------------
def test_leases_are_respected_by_other_clients(make_redis: Make, redis_server: RedisServer) -> None:
    a = make_redis(budget_bytes=6 * PAGE)
    b = make_redis(namespace=a.namespace)
    keys = chain("lease-x", 4)
    _put_chain(a, keys)
    with a.lease(keys) as lease:
        assert lease.prefix_len == 4
        assert b.stats().leased == 4
        # b fills the rest; then nothing is evictable but its own chain
        _put_chain(b, chain("lease-b", 2))
        with pytest.raises(CapacityError):
            b.put(key_of("lease-big"), None, b"y" * (3 * PAGE))
        assert b.evict(keys).skipped == 4
        assert b.longest_prefix(keys) == 4
        _consistent(redis_server, a)
    # released: b may now evict them
    assert b.put(key_of("lease-big"), None, b"y" * (3 * PAGE))
    assert b.longest_prefix(keys) < 4
    _consistent(redis_server, a)


def test_dead_clients_lease_and_reservation_expire(make_redis: Make, redis_server: RedisServer) -> None:
    a = make_redis(budget_bytes=4 * PAGE, keepalive=False)
    b = make_redis(namespace=a.namespace)
    keys = chain("dead", 3)
    _put_chain(a, keys)
    lease = a.lease(keys)
    res = a.reserve(key_of("dead-open"), keys[-1], PAGE)
    assert res is not None
    assert b.in_flight(key_of("dead-open"))
    with pytest.raises(InFlightError):
        b.reserve(key_of("dead-open"), keys[-1], PAGE)
    with pytest.raises(CapacityError):
        b.put(key_of("dead-big"), None, b"z" * (2 * PAGE))
    _expire_now(redis_server, a.namespace)  # a "crashed" ttl ago
    assert not b.in_flight(key_of("dead-open"))  # reaped
    st = b.stats()
    assert st.leased == 0 and st.in_flight == 0
    assert st.extra["expired_leases"] == 1 and st.extra["expired_reservations"] == 1
    # the space and the pins are back: b may take the key and evict a's chain
    assert b.put(key_of("dead-open"), keys[-1], page_bytes(key_of("dead-open"), PAGE))
    assert b.put(key_of("dead-big"), None, b"z" * (2 * PAGE))
    # a's late seal cannot publish anything
    res.write(0, b"\x00" * PAGE)
    with pytest.raises(ReservationLostError):
        res.seal()
    lease.release()  # stale: must not unpin anything it no longer holds
    _consistent(redis_server, b)


def test_renew_keeps_leases_alive(make_redis: Make, redis_server: RedisServer) -> None:
    a = make_redis(keepalive=False, lease_ttl=1000.0)
    keys = chain("renew", 2)
    _put_chain(a, keys)
    lease = a.lease(keys)
    res = a.reserve(key_of("renew-open"), None, PAGE)
    assert res is not None
    with redis_server.client() as c:
        lz, fz = f"hkv:{{{a.namespace}}}:lz", f"hkv:{{{a.namespace}}}:fz"
        before = (c.zscore(lz, lease.token), c.zscore(fz, res.key.hex()))
        c.zadd(lz, {lease.token: before[0] - 500_000})
        c.zadd(fz, {res.key.hex(): before[1] - 50_000})
        assert a.renew() == []
        after = (c.zscore(lz, lease.token), c.zscore(fz, res.key.hex()))
    assert after[0] >= before[0] and after[1] >= before[1]
    res.abort()
    lease.release()
    assert a.renew() == []


def test_in_flight_dedup_across_clients(make_redis: Make) -> None:
    a = make_redis()
    b = make_redis(namespace=a.namespace)
    k = key_of("shared-page")
    res = a.reserve(k, None, PAGE)
    assert res is not None
    with pytest.raises(InFlightError) as err:
        b.reserve(k, None, PAGE)
    assert err.value.key == k
    res.write(0, page_bytes(k, PAGE))
    res.seal()
    assert b.wait_sealed(k, 5.0)
    assert b.reserve(k, None, PAGE) is None  # dedup
    assert b.stats().dedup == 1


def test_lru_is_store_wide(make_redis: Make) -> None:
    a = make_redis(budget_bytes=4 * PAGE)
    b = make_redis(namespace=a.namespace)
    old, new = key_of("lru-old"), key_of("lru-new")
    a.put(old, None, page_bytes(old, PAGE))
    a.put(new, None, page_bytes(new, PAGE))
    _put_chain(a, chain("lru-fill", 2))
    assert b.read_bytes(old) == page_bytes(old, PAGE)  # b's read refreshes it for everyone
    a.put(key_of("lru-push"), None, b"p" * PAGE)
    assert a.present([old, new]) == [True, False]


# -- batching ----------------------------------------------------------------------------------
class _Trips:
    """Counts network round trips (calls through the connection wrapper)."""

    def __init__(self, p: RedisProvider, monkeypatch: pytest.MonkeyPatch) -> None:
        self.n = 0
        run = p._link.run

        def counted(fn: Any, on_nostore: Any) -> Any:
            self.n += 1
            return run(fn, on_nostore)

        monkeypatch.setattr(p._link, "run", counted)


def test_long_chains_are_batched(make_redis: Make, monkeypatch: pytest.MonkeyPatch, redis_server: RedisServer) -> None:
    p = make_redis(budget_bytes=8192 * 64)
    keys = chain("long", 8192)
    trips = _Trips(p, monkeypatch)
    data = [bytes([i % 251]) * 64 for i in range(8192)]
    result = p.put_many([(k, keys[i - 1] if i else None, data[i]) for i, k in enumerate(keys)])
    assert result == [True] * 8192
    assert trips.n == 2 * 8  # per 1,024 pages: one reserve script, one pipeline of SETs + seal script
    trips.n = 0
    assert p.longest_prefix(keys) == 8192
    assert p.longest_prefix([*keys[:5000], key_of("nope"), *keys[5001:]]) == 5000
    assert p.present(keys[::2]) == [True] * 4096
    assert trips.n == 3
    trips.n = 0
    with p.lease(keys) as lease:
        assert lease.prefix_len == 8192
        outs = [bytearray(64) for _ in keys]
        assert p.read_many(list(lease.keys), outs) == [True] * 8192
    assert trips.n == 3  # lease, one pipelined read of 8,192 pages, release
    assert all(bytes(o) == d for o, d in zip(outs, data, strict=True))
    assert p.deepest_anchor(keys, "state") == 0
    p.put_anchor(keys[6000], "state", b"s")
    assert p.deepest_anchor(keys, "state") == 6001
    _consistent(redis_server, p)


def test_put_many_outcomes(make_redis: Make, redis_server: RedisServer) -> None:
    p = make_redis(budget_bytes=8 * PAGE)
    other = make_redis(namespace=p.namespace)
    keys = chain("many", 5)
    p.put(keys[0], None, page_bytes(keys[0], PAGE))
    held = other.reserve(key_of("many-busy"), None, PAGE)
    assert held is not None
    items: list[tuple[Any, Any, bytes]] = [
        (k, keys[i - 1] if i else None, page_bytes(k, PAGE)) for i, k in enumerate(keys)]
    items.append((key_of("many-busy"), None, b"b" * PAGE))
    items.append((key_of("many-orphan"), key_of("many-missing"), b"o" * PAGE))
    items.append((key_of("many-huge"), None, b"h" * (9 * PAGE)))
    out = p.put_many(items)
    assert out[:5] == [False, True, True, True, True]
    assert isinstance(out[5], InFlightError)
    assert isinstance(out[6], UnknownKeyError)
    assert isinstance(out[7], CapacityError)
    assert p.read_many_bytes(keys) == [page_bytes(k, PAGE) for k in keys]
    held.abort()
    # a chain whose middle page fails: the pages after it fail too, nothing dangles
    q = make_redis(budget_bytes=3 * PAGE)
    ks = chain("many-cut", 5)
    out = q.put_many([(k, ks[i - 1] if i else None, page_bytes(k, PAGE)) for i, k in enumerate(ks)])
    assert out[:3] == [True, True, True]
    assert isinstance(out[3], CapacityError)  # the batch's own pages are in flight: not evictable
    assert isinstance(out[4], UnknownKeyError)  # its parent failed
    assert q.longest_prefix(ks) == 3
    _consistent(redis_server, p)
    _consistent(redis_server, q)


def _staging_keys(server: RedisServer, p: RedisProvider) -> list[bytes]:
    with server.client() as c:
        return list(c.scan_iter(match=f"hkv:{{{p.namespace}}}:w:*", count=1000))


def test_put_many_leaves_no_staging_keys(make_redis: Make, redis_server: RedisServer) -> None:
    """Every outcome of the put script (stored, dup, busy, noparent, cap, the same key twice)
    either renames the staged bytes into place or deletes them: nothing waits for its TTL."""
    p = make_redis(budget_bytes=4 * PAGE)
    other = make_redis(namespace=p.namespace)
    keys = chain("stage", 3)
    k = key_of("stage-twice")
    out = p.put_many([(keys[0], None, page_bytes(keys[0], PAGE)), (k, None, page_bytes(k, PAGE)),
                      (k, None, page_bytes(k, PAGE))])
    assert out == [True, True, False]
    # the probe saw nothing, so everything is shipped and the put script decides
    held = other.reserve(keys[1], keys[0], PAGE)
    assert held is not None
    run = p._run

    def blind(fn: Any) -> Any:  # the probe (the first call of put_many) finds nothing
        p._run = run  # type: ignore[method-assign]
        return b"0" * 4

    p._run = blind  # type: ignore[method-assign]
    out = p.put_many([(keys[0], None, page_bytes(keys[0], PAGE)), (keys[1], keys[0], page_bytes(keys[1], PAGE)),
                      (keys[2], keys[1], page_bytes(keys[2], PAGE)),
                      (key_of("stage-huge"), None, b"h" * (5 * PAGE))])
    assert out[0] is False  # stored meanwhile: dedup, not a second entry
    assert isinstance(out[1], InFlightError)
    assert isinstance(out[2], UnknownKeyError)
    assert isinstance(out[3], CapacityError)
    assert p.stats().entries == 2
    held.abort()
    assert _staging_keys(redis_server, p) == []
    _consistent(redis_server, p)


def test_put_many_parent_busy_at_probe_is_not_shipped(make_redis: Make, monkeypatch: pytest.MonkeyPatch) -> None:
    p = make_redis()
    other = make_redis(namespace=p.namespace)
    keys = chain("busy-parent", 3)
    held = other.reserve(keys[0], None, PAGE)
    assert held is not None
    shipped: list[int] = []
    publish = p._publish

    def spy(checked: Any, views: Any, hexes: Any, ship: Any, salt_tag: str) -> Any:
        shipped.extend(ship)
        return publish(checked, views, hexes, ship, salt_tag)

    monkeypatch.setattr(p, "_publish", spy)
    out = p.put_many([(k, keys[i - 1] if i else None, page_bytes(k, PAGE)) for i, k in enumerate(keys)])
    assert isinstance(out[0], InFlightError)
    assert isinstance(out[1], UnknownKeyError) and isinstance(out[2], UnknownKeyError)
    assert shipped == []  # no bytes sent for a chain whose root another writer holds
    held.abort()


def test_put_many_retried_pipeline_is_idempotent(make_redis: Make, redis_server: RedisServer,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A reply lost after the server ran the pipeline: the client sends it again (same
    generations); the second run reports the pages stored, once, and deletes the re-staged bytes."""
    import hostkv_redis._provider as impl

    p = make_redis()
    keys = chain("retry", 6)
    send = impl._send_raw

    def twice(client: Any, commands: Any, count: int, meanwhile: Any = None) -> list[Any]:
        send(client, commands, count, meanwhile)  # its replies are "lost"
        return send(client, commands, count, meanwhile)

    monkeypatch.setattr(impl, "_send_raw", twice)
    monkeypatch.setattr(impl, "_GROUP_PAGES", 2)
    out = p.put_many([(k, keys[i - 1] if i else None, page_bytes(k, PAGE)) for i, k in enumerate(keys)])
    assert out == [True] * 6
    st = p.stats()
    assert st.entries == 6 and st.used_bytes == 6 * PAGE and st.extra["store_seals"] == 6
    assert p.read_many_bytes(keys) == [page_bytes(k, PAGE) for k in keys]
    assert _staging_keys(redis_server, p) == []
    _consistent(redis_server, p)


def test_put_many_batches_by_bytes_and_groups(make_redis: Make, redis_server: RedisServer,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    import hostkv_redis._provider as impl

    monkeypatch.setattr(impl, "_BATCH_BYTES", 5 * PAGE)
    monkeypatch.setattr(impl, "_GROUP_BYTES", 2 * PAGE)
    p = make_redis(budget_bytes=64 * PAGE)
    trips = _Trips(p, monkeypatch)
    keys = chain("bytes", 12)
    sizes = [PAGE, 3 * PAGE, PAGE, PAGE, 6 * PAGE, PAGE, 2 * PAGE, PAGE, PAGE, PAGE, 4 * PAGE, PAGE]
    data = [page_bytes(k, n) for k, n in zip(keys, sizes, strict=True)]
    out = p.put_many([(k, keys[i - 1] if i else None, data[i]) for i, k in enumerate(keys)])
    assert out == [True] * 12
    # batches of <= 5 pages' bytes (a bigger page alone): [1,3,1] [1] [6] [1,2,1,1] [1,4] [1]
    assert trips.n == 2 * 6
    assert p.read_many_bytes(keys) == data
    with redis_server.client() as c:  # the LRU set holds the chain's one leaf
        assert c.zrange(f"hkv:{{{p.namespace}}}:lru", 0, -1) == [keys[-1].hex().encode()]
    _consistent(redis_server, p)


def test_put_many_evicts_lru_leaves_never_its_own_or_leased(make_redis: Make, redis_server: RedisServer) -> None:
    p = make_redis(budget_bytes=6 * PAGE)
    old = chain("evict-old", 4)
    out = p.put_many([(k, old[i - 1] if i else None, page_bytes(k, PAGE)) for i, k in enumerate(old)])
    assert out == [True] * 4
    new = chain("evict-new", 4)
    out = p.put_many([(k, new[i - 1] if i else None, page_bytes(k, PAGE)) for i, k in enumerate(new)])
    assert out == [True] * 4
    assert p.longest_prefix(old) == 2 and p.longest_prefix(new) == 4  # old's two leaves went
    with p.lease(new):
        more = chain("evict-more", 5)
        out = p.put_many([(k, more[i - 1] if i else None, page_bytes(k, PAGE)) for i, k in enumerate(more)])
        # two fit after evicting old's last two pages; then only leased or own pages remain
        assert out[:2] == [True, True]
        assert isinstance(out[2], CapacityError) and isinstance(out[3], UnknownKeyError)
        assert p.longest_prefix(new) == 4 and p.longest_prefix(old) == 0
    assert _staging_keys(redis_server, p) == []
    _consistent(redis_server, p)


def test_put_many_server_out_of_memory_is_typed(tmp_path: Any) -> None:
    with RedisServer(tmp_path / "oom", extra_args=("--maxmemory", "3mb", "--maxmemory-policy", "noeviction")) as s:
        p = RedisProvider(s.url, budget_bytes=64 << 20, namespace="oom")
        keys = chain("oom-many", 24)
        out = p.put_many([(k, keys[i - 1] if i else None, page_bytes(k, 256 << 10)) for i, k in enumerate(keys)])
        stored = [k for k, r in zip(keys, out, strict=True) if r is True]
        errors = [r for r in out if r is not True]
        assert stored and errors
        assert any(isinstance(r, ServerOutOfMemoryError) for r in errors)
        assert all(isinstance(r, (ServerOutOfMemoryError, UnknownKeyError)) for r in errors)
        assert p.read_many_bytes(stored) == [page_bytes(k, 256 << 10) for k in stored]
        st = p.stats()
        assert st.in_flight == 0 and st.used_bytes == len(stored) * (256 << 10)
        with s.client() as c:
            assert fsck(c, "oom") == []
            assert list(c.scan_iter(match="hkv:{oom}:w:*")) == []
        p.close()


def test_put_many_random_batches_keep_every_invariant(make_redis: Make, redis_server: RedisServer) -> None:
    """Seeded random put_many batches over a fixed tree of 24 keys (duplicates, parents inside and
    outside the batch or absent, pages of 1-3 units) under a small budget, with another client's
    reservations and this client's leases in the way.  After every call: the outcome of each item
    agrees with the store, stored bytes read back exactly, the budget holds, no staging key is
    left, and the independent fsck finds nothing."""
    import random

    rng = random.Random(8)
    p = make_redis(budget_bytes=10 * PAGE)
    other = make_redis(namespace=p.namespace)
    keys = [key_of(f"rnd-{i}") for i in range(24)]
    parent = [None if i == 0 or rng.random() < 0.2 else keys[rng.randrange(i)] for i in range(24)]
    size = [PAGE * rng.randint(1, 3) for _ in range(24)]
    held: list[Any] = []
    lease = None
    for _ in range(60):
        picks = sorted(rng.sample(range(24), rng.randint(1, 8)))
        if rng.random() < 0.3:
            picks.append(picks[0])  # the same key twice in one call
        out = p.put_many([(keys[i], parent[i], page_bytes(keys[i], size[i])) for i in picks])
        present = p.present(keys)
        for i, r in zip(picks, out, strict=True):
            if r is True or r is False:
                if r is True and present[i]:
                    assert parent[i] is None or present[keys.index(parent[i])]
            else:
                assert isinstance(r, (CapacityError, UnknownKeyError, InFlightError)), r
        stored = [k for k, there in zip(keys, present, strict=True) if there]
        assert p.read_many_bytes(stored) == [page_bytes(k, size[keys.index(k)]) for k in stored]
        st = p.stats()
        assert st.used_bytes <= st.budget_bytes
        assert _staging_keys(redis_server, p) == []
        _consistent(redis_server, p)
        # change what is in the way for the next call
        if held and rng.random() < 0.5:
            held.pop().abort()
        if rng.random() < 0.3:
            i = rng.randrange(24)
            if parent[i] is None or present[keys.index(parent[i])]:
                try:
                    r = other.reserve(keys[i], parent[i], size[i])
                except (InFlightError, CapacityError, UnknownKeyError):
                    r = None
                if r is not None:
                    held.append(r)
        if lease is not None and rng.random() < 0.5:
            lease.release()
            lease = None
        if lease is None and rng.random() < 0.3:
            lease = p.lease(rng.sample(keys, 4))
        if rng.random() < 0.1:
            p.evict(nbytes=PAGE * rng.randint(1, 4))
    for r in held:
        r.abort()
    if lease is not None:
        lease.release()
    _consistent(redis_server, p)


def test_read_many_misses_and_bad_buffers(make_redis: Make) -> None:
    p = make_redis()
    k = key_of("rm")
    p.put(k, None, page_bytes(k, PAGE))
    outs = [bytearray(PAGE), bytearray(PAGE)]
    assert p.read_many([k, key_of("rm-miss")], outs) == [True, False]
    assert bytes(outs[0]) == page_bytes(k, PAGE)
    with pytest.raises(InvalidArgumentError):
        p.read_many([k], [bytearray(10)])
    with pytest.raises(InvalidArgumentError):
        p.read_many([k], [])
    with pytest.raises(InvalidArgumentError):
        p.put_many([(k, None)])  # type: ignore[list-item]


# -- corruption from outside -------------------------------------------------------------------
def test_bytes_deleted_outside_are_a_miss(make_redis: Make, redis_server: RedisServer) -> None:
    p = make_redis()
    keys = chain("orphan", 4)
    side = chain("orphan-side", 3)
    _put_chain(p, keys)
    _put_chain(p, side)
    d = f"hkv:{{{p.namespace}}}:d:"
    with redis_server.client() as c:
        c.delete(d + keys[1].hex())  # e.g. a server-side maxmemory eviction
        c.rename(d + keys[3].hex(), d + keys[2].hex())
        c.set(d + side[1].hex(), b"short")  # not one of ours at all
        c.set(d + side[2].hex(), b"\x00" * (PAGE + 56))  # right length, no valid trailer
    assert p.read_bytes(keys[2]) is None  # bytes of another key under its name: key echo mismatch
    assert p.read_bytes(keys[1]) is None
    outs = [bytearray(PAGE) for _ in side]
    assert p.read_many(side, outs) == [True, False, False]
    assert bytes(outs[0]) == page_bytes(side[0], PAGE)
    assert p.longest_prefix(keys) == 1 and p.longest_prefix(side) == 1
    assert p.stats().checksum_failures == 4
    _consistent(redis_server, p)


def test_read_many_into_views(make_redis: Make) -> None:
    p = make_redis()
    keys = chain("views", 3)
    _put_chain(p, keys)
    big = bytearray(3 * PAGE + 100)
    views = [memoryview(big)[i * PAGE : (i + 1) * PAGE] for i in range(3)]
    assert p.read_many(keys, views) == [True, True, True]
    assert bytes(big[: 3 * PAGE]) == b"".join(page_bytes(k, PAGE) for k in keys)
    roomy = [bytearray(PAGE + 10) for _ in keys]
    assert p.read_many(keys, roomy) == [True, True, True]
    assert all(bytes(o[:PAGE]) == page_bytes(k, PAGE) for o, k in zip(roomy, keys, strict=True))
    with pytest.raises(InvalidArgumentError):
        p.read_many(keys, [bytes(PAGE)] * 3)  # read-only buffers


def test_server_out_of_memory_is_typed(tmp_path: Any) -> None:
    with RedisServer(tmp_path / "oom", extra_args=("--maxmemory", "3mb", "--maxmemory-policy", "noeviction")) as s:
        p = RedisProvider(s.url, budget_bytes=64 << 20, namespace="oom")
        stored = []
        with pytest.raises(NoSpaceError) as err:
            for i in range(64):
                k = key_of(f"oom-{i}")
                p.put(k, None, page_bytes(k, 256 << 10))
                stored.append(k)
        assert isinstance(err.value, ServerOutOfMemoryError)
        assert stored and p.read_many_bytes(stored) == [page_bytes(k, 256 << 10) for k in stored]
        st = p.stats()
        assert st.in_flight == 0 and st.used_bytes == len(stored) * (256 << 10)
        p.close()


def test_sealed_pages_never_expire(make_redis: Make, redis_server: RedisServer) -> None:
    """RENAME carries the staging key's TTL over; the seal script must PERSIST the page."""
    p = make_redis()
    a, b = key_of("ttl-a"), key_of("ttl-b")
    p.put(a, None, page_bytes(a, PAGE))
    p.put_many([(b, a, page_bytes(b, PAGE))])
    with redis_server.client() as c:
        assert [c.pttl(f"hkv:{{{p.namespace}}}:d:{k.hex()}") for k in (a, b)] == [-1, -1]


def _hold_and_die(url: str, namespace: str, ready: Any) -> None:
    p = RedisProvider(url, namespace=namespace, lease_ttl=0.5, reservation_ttl=0.5)
    keys = chain("killed", 3)
    held = (p.lease(keys), p.reserve(key_of("killed-open"), keys[-1], PAGE))  # kept alive until killed
    ready.set()
    threading.Event().wait(600)  # SIGKILLed by the parent long before this
    del held


def test_killed_clients_pins_expire(make_redis: Make, redis_server: RedisServer) -> None:
    """A client process SIGKILLed while holding a lease and a reservation: once its TTL passes,
    the server reaps both (no timing assertion: the test waits for it, bounded)."""
    b = make_redis(budget_bytes=4 * PAGE)
    keys = chain("killed", 3)
    _put_chain(b, keys)
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    child = ctx.Process(target=_hold_and_die, args=(redis_server.url, b.namespace, ready))
    child.start()
    try:
        assert ready.wait(120)
        assert b.stats().leased == 3 and b.in_flight(key_of("killed-open"))
        os.kill(child.pid or 0, signal.SIGKILL)
    finally:
        child.join(60)
    deadline = time.monotonic() + 60
    while b.in_flight(key_of("killed-open")) or b.stats().leased:  # in_flight() reaps
        assert time.monotonic() < deadline, "the dead client's pins never expired"
        time.sleep(0.1)
    assert b.put(key_of("killed-big"), None, b"k" * (4 * PAGE))  # everything was evictable again
    assert b.longest_prefix(keys) == 0
    _consistent(redis_server, b)
