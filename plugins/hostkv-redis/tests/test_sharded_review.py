"""Review findings in the sharded store (``RedisShardedProvider``), one reproduction each: every
test failed before its fix.  Each store here is checked with :func:`fsck` per shard at teardown
(``sharded`` fixture of test_sharded)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from conftest import unique_namespace
from hostkv_providers.errors import CapacityError, HostKVError, InvalidArgumentError
from hostkv_providers.testing import chain, key_of, page_bytes
from test_sharded import check_shards, settle

from hostkv_redis import RedisProvider, RedisShardedProvider
from hostkv_redis.servers import RedisClusterServers, RedisServer

PAGE = 1024


def items(keys: list[Any], parent: Any = None, nbytes: int = PAGE) -> list[tuple[Any, Any, bytes]]:
    return [(k, keys[i - 1] if i else parent, page_bytes(k, nbytes)) for i, k in enumerate(keys)]


def split_chain(p: RedisShardedProvider, name: str, n: int, g: int) -> list[Any]:
    """A chain of ``n`` pages whose groups (of ``g``) lie in pairwise different shards."""
    for j in range(5000):
        keys = chain(f"{name}{j}", n)
        heads = p._chain_shards(keys).tolist()[::g]
        if len(set(heads)) == len(heads):
            return keys
    raise AssertionError("no split chain found")


def key_in(p: RedisShardedProvider, shard: int, name: str, avoid: tuple[int, ...] = ()) -> bytes:
    """A root key placed in ``shard`` (``-1``: any shard not in ``avoid``)."""
    for j in range(10000):
        k = chain(f"{name}{j}", 1)[0]
        s = int(p._chain_shards([k])[0])
        if s == shard or (shard < 0 and s not in avoid):
            return k
    raise AssertionError


@pytest.fixture
def sharded(redis_cluster: RedisClusterServers) -> Iterator[Any]:
    """``make(budget=64 MiB, namespace=None, shards=6, group=2, **kw)``; every store is settled
    and checked with fsck per shard at teardown."""
    made: list[RedisShardedProvider] = []

    def make(budget: int | None = 64 << 20, namespace: str | None = None, shards: int = 6, group: int = 2,
             **kw: Any) -> RedisShardedProvider:
        p = RedisShardedProvider(redis_cluster.url, budget_bytes=budget, namespace=namespace or unique_namespace("rv"),
                                 shards=shards, group=group, **kw)
        made.append(p)
        return p

    yield make
    settle(made)
    problems = {p.namespace: check_shards(p, redis_cluster.url) for p in made}
    for p in made:
        p.close()
    assert all(not x for x in problems.values()), problems


def _corrupt(p: RedisShardedProvider, key: bytes) -> None:
    s = p.shard_of(key)
    assert s is not None
    shard = p.shard_providers[s]
    c = shard._link.client()
    name = f"hkv:{{{shard.namespace}}}:d:{key.hex()}"
    first = c.getrange(name, 0, 0)
    c.setrange(name, 0, bytes([first[0] ^ 0xFF]))


# -- 1. a forced drop takes the child groups in other shards along ------------------------------
def test_checksum_failure_drops_the_subtree_in_other_shards(sharded: Any) -> None:
    p = sharded()
    keys = split_chain(p, "ckx", 6, 2)  # groups [0,1] [2,3] [4,5] on three different shards
    assert p.put_many(items(keys)) == [True] * 6
    _corrupt(p, keys[1])  # the last page of the first group: its child group lives elsewhere
    assert p.read(keys[1], bytearray(PAGE)) is False  # dropped with its subtree
    assert p.present(keys) == [True] + [False] * 5  # as a single-slot store
    assert p.read_bytes(keys[2]) is None
    assert p.stats().entries == 1
    # a fresh client (no placement memory) finds none of them either
    q = sharded(budget=None, namespace=p.namespace)
    assert q.present(keys) == [True] + [False] * 5


@pytest.mark.parametrize("how", ["read_bytes", "read_many", "read_many_bytes"])
def test_batch_reads_drop_the_subtree_in_other_shards(sharded: Any, how: str) -> None:
    """(the shards' own fronts drop what a batch read finds damaged; the cascade follows)"""
    p = sharded()
    keys = split_chain(p, "ckb" + how, 6, 2)
    assert p.put_many(items(keys)) == [True] * 6
    _corrupt(p, keys[3])
    if how == "read_bytes":
        assert p.read_bytes(keys[3]) is None
    elif how == "read_many":
        assert p.read_many(keys[:4], [bytearray(PAGE) for _ in range(4)]) == [True] * 3 + [False]
    else:
        assert p.read_many_bytes(keys[:4])[3] is None
    assert p.present(keys) == [True] * 3 + [False] * 3


def test_verify_repair_drops_the_subtree_in_other_shards(sharded: Any) -> None:
    p = sharded()
    keys = split_chain(p, "ckv", 6, 2)
    assert p.put_many(items(keys)) == [True] * 6
    _corrupt(p, keys[1])
    report = p.verify(repair=True)
    assert report.corrupt == [keys[1]]
    assert p.present(keys) == [True] + [False] * 5
    assert report.dropped == 5


def test_a_cascade_left_by_a_dead_client_is_carried_out(sharded: Any) -> None:
    """The cascade is queued in the same script as the drop: a client that dies before carrying
    it out leaves it to the others (here: the maintenance call of a second client)."""
    p = sharded()
    keys = split_chain(p, "ckd", 4, 2)
    assert p.put_many(items(keys)) == [True] * 4
    _corrupt(p, keys[1])
    a = p.shard_of(keys[1])
    assert a is not None
    # the drop alone, as a shard's front makes it (what a client dying right after would leave)
    assert p.shard_providers[a].read_bytes(keys[1]) is None
    assert p.present(keys) == [True, False, True, True]  # the cascade is still queued
    q = sharded(budget=None, namespace=p.namespace)
    q.reconcile_pins()
    assert q.present(keys) == [True, False, False, False]


# -- 2. a failed retain's undo ---------------------------------------------------------------
def test_failed_retain_leaves_remote_refcounts_intact(sharded: Any) -> None:
    p = sharded(budget=6 * 64 * PAGE, retain_share=0.5)  # a shard retains up to 32 pages
    keys = split_chain(p, "ru", 4, 2)  # groups [0,1] in shard A, [2,3] in shard B
    assert p.put_many(items(keys)) == [True] * 4
    a_shard, b_shard = p.shard_of(keys[0]), p.shard_of(keys[2])
    # a big root page in a third shard: marking it exceeds that shard's retained share
    big = key_in(p, -1, "ru-big", (a_shard, b_shard))
    assert p.put_many([(big, None, page_bytes(big, 40 * PAGE))]) == [True]
    with pytest.raises(CapacityError):
        p.retain([keys[2], big])  # keys[2] is marked, then big fails: undone
    assert p.stats().retained_bytes == 0
    # retain keys[2] alone: it and its three ancestors (two of them in shard A) are held
    assert p.retain([keys[2]]) == 1
    assert p.stats().retained_bytes == 3 * PAGE
    assert p.unretain([keys[2]]) == 1
    assert p.stats().retained_bytes == 0  # (fsck at teardown: every ra exact)


# -- 3. put_many with bad data in one shard ------------------------------------------------
def test_bad_data_in_one_shard_stores_nothing(sharded: Any) -> None:
    p = sharded()
    keys = split_chain(p, "bad", 6, 2)  # groups [0,1] [2,3] [4,5] in three different shards
    its: list[tuple[Any, Any, Any]] = list(items(keys))
    its[5] = (keys[5], keys[4], "not a buffer")  # bad data in the last group only
    with pytest.raises(InvalidArgumentError):
        p.put_many(its)
    assert p.present(keys) == [False] * 6  # a refused call stores nothing (single-slot store)
    its[5] = (keys[5], keys[4], b"")  # no bytes: refused too
    with pytest.raises(InvalidArgumentError):
        p.put_many(its)
    assert p.present(keys) == [False] * 6
    assert p.put_many(items(keys)) == [True] * 6


def test_a_shard_that_raises_keeps_the_pins_of_the_others(sharded: Any, monkeypatch: Any) -> None:
    """A shard's put_many that raises (its server went away) must not cost the pages that the
    other shards published their pins: else removing their parent leaves them orphaned."""
    p = sharded()
    keys = split_chain(p, "bad2", 6, 2)  # groups [0,1] [2,3] [4,5] in three different shards
    last = p.shard_providers[p._chain_shards(keys).tolist()[4]]

    def down(*a: Any, **kw: Any) -> Any:
        raise HostKVError("the shard's server went away")

    monkeypatch.setattr(last, "put_many", down)
    with pytest.raises(HostKVError):
        p.put_many(items(keys))
    monkeypatch.undo()
    stored = p.present(keys)
    assert stored == [True] * 4 + [False] * 2
    # keys[1] is pinned by the published [2,3]: evict(keys) follows the pin or skips keys[1]
    # (the pin of [4,5], whose outcome the caller never learnt, stays until reconcile_pins
    # finds it old and held by no page: the safe side)
    p.evict(keys=[keys[1]])
    bits = p.present(keys)
    assert bits == sorted(bits, reverse=True), (stored, bits)  # prefix-closed


# -- 4. a write that can never fit its shard evicts nothing --------------------------------
def test_reserve_that_can_never_fit_evicts_nothing(sharded: Any) -> None:
    p = sharded(budget=6 * 16 * PAGE)
    keys = split_chain(p, "ov", 6, 2)
    assert p.put_many(items(keys)) == [True] * 6
    big = key_in(p, p.shard_of(keys[0]), "ov-big")  # a root in the shard that holds keys[0:2]
    with pytest.raises(CapacityError):
        p.reserve(big, None, 17 * PAGE)  # larger than its shard's whole budget share
    assert p.present(keys) == [True] * 6  # "nothing was evicted"
    assert p.stats().evictions == 0


def test_put_many_that_can_never_fit_evicts_nothing(sharded: Any) -> None:
    p = sharded(budget=6 * 16 * PAGE)
    keys = split_chain(p, "ovp", 6, 2)
    assert p.put_many(items(keys)) == [True] * 6
    big = key_in(p, p.shard_of(keys[0]), "ovp-big")
    out = p.put_many([(big, None, page_bytes(big, 17 * PAGE))])
    assert isinstance(out[0], CapacityError)
    assert p.present(keys) == [True] * 6
    assert p.stats().evictions == 0


def test_a_shard_full_of_pinned_pages_still_makes_room(sharded: Any) -> None:
    """(what _make_room_in is for stays: a write that fits once the child groups go)"""
    p = sharded(budget=6 * 4 * PAGE)
    keys = split_chain(p, "ovr", 4, 2)  # [0,1] in A (1 pinned by [2,3] in B)
    assert p.put_many(items(keys)) == [True] * 4
    a = p.shard_of(keys[0])
    fill = key_in(p, a, "ovr-fill")
    assert p.put(fill, None, page_bytes(fill, 2 * PAGE)) is True  # A is full: 4 pages, no leaf but fill
    big = key_in(p, a, "ovr-big")
    assert p.put(big, None, page_bytes(big, 3 * PAGE)) is True  # needs the pinned pages' room
    assert p.present([big]) == [True]


# -- 5. evict(nbytes) --------------------------------------------------------------------------
def test_evict_nbytes_frees_what_was_asked_when_everything_is_evictable(sharded: Any) -> None:
    p = sharded()
    keys = split_chain(p, "evn", 4, 2)  # [0,1] in shard A (1 pinned by [2,3] in shard B)
    assert p.put_many(items(keys)) == [True] * 4
    report = p.evict(nbytes=4 * PAGE)  # the whole store; every entry is evictable
    assert report.nbytes >= 4 * PAGE, report
    assert p.present(keys) == [False] * 4


def test_evict_one_byte_takes_one_page(sharded: Any) -> None:
    p = sharded()
    roots: list[bytes] = []
    for s in range(6):  # six unrelated one-page roots, one per shard
        roots.append(key_in(p, s, f"evb{s}-"))
    assert p.put_many([(k, None, page_bytes(k, PAGE)) for k in roots]) == [True] * 6
    report = p.evict(nbytes=1)
    assert report.entries == 1, report  # single-slot store: the one least recently used leaf
    assert sum(p.present(roots)) == 5


# -- 6. the same key under another parent --------------------------------------------------
def _pair(p: RedisShardedProvider) -> tuple[bytes, bytes]:
    for j in range(10000):
        x, k = chain(f"dup{j}", 2)
        if int(p._chain_shards([x])[0]) != int(p._chain_shards([k])[0]):
            return x, k
    raise AssertionError


def test_same_key_under_another_parent_is_a_dedup(sharded: Any) -> None:
    p = sharded()
    x, k = _pair(p)
    assert p.put(x, None, page_bytes(x, PAGE)) is True
    assert p.put(k, x, page_bytes(k, PAGE)) is True  # k in x's group (x's shard)
    assert p.put(k, None, page_bytes(k, PAGE)) is False  # already stored: dedup
    assert p.reserve(k, None, PAGE) is None
    assert p.put_many([(k, None, page_bytes(k, PAGE))]) == [False]
    assert p.stats().entries == 2


def test_evict_removes_the_only_copy(sharded: Any) -> None:
    p = sharded()
    x, k = _pair(p)
    p.put(x, None, page_bytes(x, PAGE))
    p.put(k, x, page_bytes(k, PAGE))
    p.put(k, None, page_bytes(k, PAGE))
    p.evict(keys=[k])
    q = sharded(budget=None, namespace=p.namespace)  # no placement memory
    assert q.present([k]) == [False]


def test_pages_under_a_key_stored_elsewhere_go_under_the_stored_one(sharded: Any) -> None:
    """A put_many naming another parent for a stored key: a dedup, and the pages after it in the
    call hang under the stored copy (another client finds the chain whole)."""
    p = sharded()
    x, k = _pair(p)
    assert p.put_many(items([x, k])) == [True, True]
    tail = chain("dup-tail", 3)
    assert p.put_many(items([k, *tail])) == [False, True, True, True]  # k as a root: stored already
    q = sharded(budget=None, namespace=p.namespace)
    assert q.longest_prefix([x, k, *tail]) == 5
    assert q.stats().entries == 5


# -- 7. a lookup never changes where later writes go ---------------------------------------
def test_a_lookup_of_two_roots_does_not_misplace_later_writes(sharded: Any) -> None:
    p = sharded(group=4)
    a = key_of("memo-a")
    sa = int(p._chain_shards([a])[0])
    for j in range(10000):
        b = key_of(f"memo-b{j}")
        if int(p._chain_shards([b])[0]) == sa:
            break
    for j in range(10000):  # a continuation of b whose group boundary is a real shard change
        tail = chain(f"memo-tail{j}", 4)
        if int(p._chain_shards([b, *tail])[3]) != sa and int(p._chain_shards([b, *tail])[4]) != sa:
            break
    assert p.put(a, None, page_bytes(a, PAGE)) is True
    assert p.put(b, None, page_bytes(b, PAGE)) is True
    assert p.longest_prefix([a, b]) == 2  # both stored (a single-slot store says 2 as well)
    assert p.put_many(items(tail, parent=b)) == [True] * 4
    assert p.longest_prefix([b, *tail]) == 5
    q = sharded(budget=None, namespace=p.namespace, group=4)  # another client
    assert q.longest_prefix([b, *tail]) == 5


# -- 8, 9. constructor arguments -----------------------------------------------------------
BAD: list[tuple[str, Any, dict[str, Any]]] = [
    ("timeout=-1", None, {"timeout": -1}),
    ("timeout='5'", None, {"timeout": "5"}),
    ("timeout=nan", None, {"timeout": float("nan")}),
    ("retries=-1", None, {"retries": -1}),
    ("retries='3'", None, {"retries": "3"}),
    ("url=123", 123, {}),
    ("namespace=''", None, {"namespace": ""}),
    ("namespace='a b'", None, {"namespace": "a b"}),
    ("namespace='x\\n'", None, {"namespace": "x\n"}),
    ("namespace=53 chars", None, {"namespace": "n" * 53}),
]


@pytest.mark.parametrize(("label", "url", "kw"), BAD, ids=[b[0] for b in BAD])
def test_sharded_bad_arguments_are_typed(redis_cluster: RedisClusterServers, label: str, url: Any,
                                         kw: dict[str, Any]) -> None:
    kw = {"namespace": unique_namespace("ct"), **kw}
    with pytest.raises(InvalidArgumentError):
        p = RedisShardedProvider(redis_cluster.url if url is None else url, budget_bytes=1 << 20,
                                 shards=3, group=2, **kw)
        p.close()


@pytest.mark.parametrize(("label", "url", "kw"), BAD[:7], ids=[b[0] for b in BAD[:7]])
def test_single_slot_reference(redis_server: RedisServer, label: str, url: Any, kw: dict[str, Any]) -> None:
    """(the single-slot provider refuses the same arguments typed)"""
    kw = {"namespace": unique_namespace("ct"), **kw}
    with pytest.raises(InvalidArgumentError):
        p = RedisProvider(redis_server.url if url is None else url, budget_bytes=1 << 20, **kw)
        p.close()


def test_a_cascade_through_retained_pages_leaves_nothing_retained(redis_cluster: RedisClusterServers) -> None:
    """A drop of keys[1] whose cascade removed the retained keys[5] (three shards) left keys[0]
    counted as retained for good (retained_bytes, and evict refused it); the single-slot store
    ends with nothing retained (a second review's finding; fails before)."""
    p = RedisShardedProvider(redis_cluster.url, budget_bytes=64 << 20, namespace=unique_namespace("r2"),
                             shards=6, group=2)
    try:
        keys = split_chain(p, "ret", 6, 2)  # groups [0,1] [2,3] [4,5] on three shards
        assert p.put_many(items(keys)) == [True] * 6
        assert p.retain([keys[5]]) == 1
        assert p.stats().retained_bytes == 6 * PAGE
        _corrupt(p, keys[1])
        assert p.read(keys[1], bytearray(PAGE)) is False  # dropped; the cascade takes keys[2..5]
        assert p.present(keys) == [True] + [False] * 5
        st = p.stats()
        assert (st.retained, st.retained_bytes) == (0, 0)
        assert p.evict([keys[0]]).entries == 1
    finally:
        p.reconcile_pins()
        p.close()
