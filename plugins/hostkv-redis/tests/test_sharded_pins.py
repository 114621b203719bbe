"""Cross-shard pins of the sharded cluster store: a group's first page pins its parent in the
other shard, so eviction takes leaves only store-wide (never punctures a chain), ``evict(keys)``
follows the subtree across shards, and a child written while its parent is evicted fails typed.
Every test ends with :func:`fsck` of every shard (pin counts included)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import unique_namespace
from hostkv_providers.errors import UnknownKeyError
from hostkv_providers.testing import chain, page_bytes
from test_sharded import check_shards, settle

from hostkv_redis import RedisShardedProvider
from hostkv_redis.servers import RedisClusterServers

PAGE = 1024
G = 4


def _items(keys: list[Any], parent: Any = None) -> list[tuple[Any, Any, bytes]]:
    return [(k, keys[i - 1] if i else parent, page_bytes(k, PAGE)) for i, k in enumerate(keys)]


@pytest.fixture
def sharded(redis_cluster: RedisClusterServers) -> Iterator[Any]:
    made: list[RedisShardedProvider] = []

    def make(budget: int | None = 64 << 20, namespace: str | None = None, **kw: Any) -> RedisShardedProvider:
        kw.setdefault("shards", 12)
        p = RedisShardedProvider(redis_cluster.url, budget_bytes=budget, group=G,
                                 namespace=namespace or unique_namespace("pin"), **kw)
        made.append(p)
        return p

    yield make
    settle(made)  # every client of a store before any check (see settle)
    problems = []
    for p in made:
        problems += check_shards(p, redis_cluster.url)
        p.close()
    assert problems == []


def _split_chain(p: RedisShardedProvider, name: str, n: int = 2 * G) -> list[Any]:
    """A chain whose groups lie in pairwise different shards (so every group boundary is a
    cross-shard link)."""
    for j in range(1000):
        keys = chain(f"{name}{j}", n)
        shards = p._chain_shards(keys).tolist()
        heads = shards[::G]
        if len(set(heads)) == len(heads):
            return keys
    raise AssertionError("no split chain found")


def _entry(p: RedisShardedProvider, key: Any) -> dict[str, str]:
    s = p.shard_of(key)
    assert s is not None
    shard = p.shard_providers[s]
    raw: dict[bytes, bytes] = shard._link.client().hgetall(f"hkv:{{{shard.namespace}}}:e:{key.hex()}")  # type: ignore[assignment]
    return {k.decode(): v.decode() for k, v in raw.items()}


def _closed(p: RedisShardedProvider, keys: list[Any]) -> None:
    """Prefix closure over a chain: a stored page's parent is stored.  Read group by group, root
    first: one ``present`` of the whole chain reads its shards' masters in parallel, so with an
    evictor running beside it (which removes children before their parent) it can see a child
    group before, and its parent after, one eviction of both: a torn view, not an open tree (the
    likely reading of a CI failure of 2026-12-04, ``[True, True, True, False, True, ...]``).
    Read root first, a child seen after its parent was seen missing needs a child written in
    between, and here children are written only by the thread that checks."""
    bits = [b for i in range(0, len(keys), G) for b in p.present(keys[i : i + G])]
    assert bits == sorted(bits, reverse=True), bits


def test_a_group_tail_with_a_child_group_elsewhere_is_pinned(sharded: Any) -> None:
    p = sharded()
    keys = _split_chain(p, "pin")
    assert p.put_many(_items(keys)) == [True] * len(keys)
    tail = _entry(p, keys[G - 1])
    assert tail["xc"] == "1" and tail["ch"] == "0"  # a local leaf, held by the group below
    head = _entry(p, keys[G])
    assert head["xp"] == keys[G - 1].hex() and head["xs"] == str(p.shard_of(keys[G - 1]))
    # eviction under pressure removes leaves store-wide: the chain shrinks from its end only
    left = len(keys)
    while left:
        r = p.evict(nbytes=1)
        assert r.entries >= 1
        left -= r.entries
        assert p.stats().entries == left
        _closed(p, keys)
        assert p.longest_prefix(keys) == left
    # the pin went with the child group: the tail was a leaf again when its turn came
    assert p.present(keys) == [False] * len(keys)


def test_budget_pressure_never_punctures_a_chain(sharded: Any) -> None:
    """A store whose shards are full evicts for new writes: old chains lose their ends first."""
    p = sharded(budget=12 * 6 * PAGE, shards=12)
    chains = [_split_chain(p, f"press{c}-", 3 * G) for c in range(10)]
    for keys in chains:
        out = p.put_many(_items(keys))
        assert all(r is True or isinstance(r, Exception) for r in out), out
        for other in chains:
            _closed(p, other)
    assert p.stats().used_bytes <= p.budget_bytes


def test_evict_keys_removes_the_subtree_across_shards(sharded: Any) -> None:
    p = sharded()
    keys = _split_chain(p, "sub", 3 * G)
    branch = chain("branch", 2 * G)  # a second subtree under the same group tail
    assert p.put_many(_items(keys)) == [True] * len(keys)
    assert p.put_many(_items(branch, parent=keys[2 * G - 1])) == [True] * len(branch)
    assert _entry(p, keys[2 * G - 1])["xc"] in ("1", "2")  # 2 unless both heads share a shard
    r = p.evict(keys=[keys[1]])
    assert r.entries == len(keys) - 1 + len(branch) and r.skipped == 0
    assert p.present(keys) == [True] + [False] * (len(keys) - 1)
    assert p.present(branch) == [False] * len(branch)
    assert p.stats().entries == 1


def test_evict_keys_skips_a_leased_descendant_and_its_ancestors(sharded: Any) -> None:
    p = sharded()
    keys = _split_chain(p, "lz", 3 * G)
    assert p.put_many(_items(keys)) == [True] * len(keys)
    with p.lease([keys[-1]]):  # the last page, two shards away
        r = p.evict(keys=[keys[0]])
        assert r.entries == 0 and r.skipped >= 1
        _closed(p, keys)
        assert p.longest_prefix(keys) == len(keys)
    assert p.evict(keys=[keys[0]]).entries == len(keys)


def test_a_child_of_an_evicted_parent_fails_typed(sharded: Any) -> None:
    """Another client knows where the parent was; it is evicted; the child's write must fail."""
    p = sharded()
    keys = _split_chain(p, "gone")
    q = sharded(budget=None, namespace=p.namespace)
    assert p.put_many(_items(keys[:G])) == [True] * G
    assert q.longest_prefix(keys[:G]) == G  # q now remembers the parent's placement
    assert p.evict(keys=[keys[G - 1]]).entries == 1
    with pytest.raises(UnknownKeyError):
        q.reserve(keys[G], keys[G - 1], PAGE)
    out = q.put_many(_items(keys[G:], parent=keys[G - 1]))
    assert all(isinstance(r, UnknownKeyError) for r in out), out
    assert p.present(keys[G:]) == [False] * G


def test_an_in_flight_child_group_pins_its_parent(sharded: Any) -> None:
    p = sharded()
    keys = _split_chain(p, "fl")
    assert p.put_many(_items(keys[:G])) == [True] * G
    res = p.reserve(keys[G], keys[G - 1], PAGE)
    assert res is not None
    assert p.evict(keys=[keys[0]]).entries == 0
    assert p.evict(nbytes=1 << 30).entries == 0  # nothing is a leaf store-wide
    p.abort(res)  # the release goes through the child shard's outbox, drained by abort
    assert _entry(p, keys[G - 1])["xc"] == "0"
    assert p.evict(nbytes=1 << 30).entries == G


def test_concurrent_child_writes_and_parent_evictions_keep_the_tree_closed(sharded: Any) -> None:
    """One client evicts a group tail and writes it back in a loop; another writes the child
    group below it: every child write either succeeds with its parent pinned or fails typed,
    and the chain is prefix-closed whenever it is looked at."""
    p = sharded()
    keys = _split_chain(p, "race", 3 * G)
    q = sharded(budget=None, namespace=p.namespace)
    assert p.put_many(_items(keys[:G])) == [True] * G
    assert q.longest_prefix(keys[:G]) == G
    stop = threading.Event()
    errors: list[BaseException] = []

    def evictor() -> None:
        try:
            while not stop.is_set():
                p.evict(keys=[keys[G - 1]])
                p.put_many(_items(keys[G - 1 : G], parent=keys[G - 2]))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    t = threading.Thread(target=evictor)
    t.start()
    outcomes = {"ok": 0, "typed": 0}
    try:
        for _ in range(60):
            out = q.put_many(_items(keys[G:], parent=keys[G - 1]))
            for r in out:
                if r is True or r is False:
                    outcomes["ok"] += 1
                else:
                    assert isinstance(r, UnknownKeyError), r
                    outcomes["typed"] += 1
            _closed(q, keys)
    finally:
        stop.set()
        t.join()
    assert not errors
    assert outcomes["ok"] + outcomes["typed"] == 60 * 2 * G
    _closed(p, keys)
    p._drain()
    q._drain()


def test_reconcile_releases_a_pin_no_page_holds(sharded: Any) -> None:
    """A client that died between pinning a parent and publishing the child leaves the parent
    pinned (the safe side); ``verify(repair=True)`` releases it once it is old enough."""
    p = sharded()
    keys = _split_chain(p, "rec")
    assert p.put_many(_items(keys[:G])) == [True] * G
    ps = p.shard_of(keys[G - 1])
    token = p._pin_token(int(p._chain_shards(keys)[G]), keys[G])
    assert p._fan([(ps, "xpin", ["1", keys[G - 1].hex(), token])]) == [b"1"]
    assert p.evict(nbytes=1 << 30).entries == 0  # the pinned tail holds its group
    assert p.reconcile_pins() == 0  # young: may be a write under way
    p._pin_grace_ms = 0
    p.verify(repair=True)
    assert _entry(p, keys[G - 1])["xc"] == "0"
    assert p.evict(nbytes=1 << 30).entries == G


def test_queued_releases_keep_pin_counts_exact_until_applied(sharded: Any) -> None:
    """A release queued in the outbox (a group-first page evicted by its shard's own script) leaves
    the parent pinned, with ``xc`` still equal to its pins, until a client applies it; applying it
    (here through the public ``reconcile_pins``) makes the parent a leaf again.  No renewal thread
    (``keepalive=False``), so nothing applies it behind the test's back."""
    p = sharded(keepalive=False)
    assert p._keeper is None
    keys = _split_chain(p, "queued")
    assert p.put_many(_items(keys)) == [True] * len(keys)
    a, b = p.shard_of(keys[G - 1]), p.shard_of(keys[G])
    assert a is not None and b is not None and a != b
    # the child shard's own eviction (no client-side drain): the whole group, its head last
    assert p.shard_providers[b].evict(nbytes=G * PAGE).entries == G
    outbox = f"hkv:{{{p.shard_providers[b].namespace}}}:xo"
    assert p.shard_providers[b]._link.client().llen(outbox) == 1
    tail = _entry(p, keys[G - 1])
    assert tail["xc"] == "1"  # still pinned: the safe side
    assert check_shards(p, p._url, settled=False) == []  # and counted exactly meanwhile
    assert p.reconcile_pins() == 0  # drains the outbox first; no dead pin besides
    assert p.shard_providers[b]._link.client().llen(outbox) == 0
    assert _entry(p, keys[G - 1])["xc"] == "0"
    assert check_shards(p, p._url, settled=False) == []
    assert p.evict(nbytes=1).entries == 1  # the tail is a leaf again
    assert p.present(keys) == [True] * (G - 1) + [False] * (G + 1)


def test_a_shard_full_of_pages_whose_child_groups_went_makes_room(sharded: Any) -> None:
    """A shard full of group tails whose child groups (in other shards) were already evicted
    there, their releases still queued: a write into it applies them and retries (not
    ``CapacityError`` until a renewal thread happens to drain; here there is none)."""
    p = sharded(budget=12 * 2 * G * PAGE, keepalive=False)  # 2 groups per shard
    assert p._keeper is None
    found: dict[int, list[list[Any]]] = {}
    for j in range(4000):
        keys = chain(f"full{j}-", 2 * G)
        a, b = p._chain_shards(keys).tolist()[::G]
        if a != b:
            found.setdefault(a, []).append(keys)
            if len(found[a]) == 3:
                break
    a = next(s for s, cs in found.items() if len(cs) == 3)
    first, second, new = found[a]
    for keys in (first, second):
        assert p.put_many(_items(keys)) == [True] * len(keys)
    for keys in (first, second):  # the child groups go by their own shard's script: queued releases
        b = p.shard_of(keys[G])
        assert b is not None and b != a
        assert p.shard_providers[b].evict(nbytes=G * PAGE).entries == G
    assert [_entry(p, keys[G - 1])["xc"] for keys in (first, second)] == ["1", "1"]
    assert p.shard_providers[a].stats().used_bytes == p.shard_providers[a].budget_bytes
    # `new` starts a group in the full shard: it fits once the stale pins are released
    assert p.put_many(_items(new[:G])) == [True] * G
    assert p.present(new[:G]) == [True] * G
    _closed(p, first)
    _closed(p, second)
