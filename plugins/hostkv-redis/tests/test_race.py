"""Two client processes race saves, reads, leases and evictions on one small store: 0 wrong bytes,
and the server-side state is consistent afterwards (checked independently by ``fsck``)."""

from __future__ import annotations

import multiprocessing as mp
import random
from typing import Any

from fsck import fsck
from hostkv_providers import CapacityError, InFlightError, UnknownKeyError
from hostkv_providers.testing import chain, page_bytes

from hostkv_redis import RedisProvider
from hostkv_redis.servers import RedisServer

PAGE = 4096
EXPECTED = (InFlightError, CapacityError, UnknownKeyError)  # per-item outcomes of a race


def _client(url: str, namespace: str, seed: int, steps: int, queue: Any) -> None:
    """One engine node: overlapping chains with the other node, under eviction pressure."""
    rng = random.Random(seed)
    stats: dict[str, Any] = {"wrong": 0, "reads": 0, "hits": 0, "stored": 0, "conflicts": 0, "unexpected": []}
    try:
        p = RedisProvider(url, namespace=namespace)
        for _ in range(steps):
            keys = chain(f"race-{rng.randrange(6)}", 1 + rng.randrange(10))
            op = rng.random()
            if op < 0.45:
                out = p.put_many([(k, keys[i - 1] if i else None, page_bytes(k, PAGE)) for i, k in enumerate(keys)])
                for r in out:
                    if r is True:
                        stats["stored"] += 1
                    elif isinstance(r, EXPECTED):
                        stats["conflicts"] += 1
                    elif r is not False:
                        stats["unexpected"].append(repr(r))
            elif op < 0.75:
                with p.lease(keys) as lease:
                    n = lease.prefix_len
                    outs = [bytearray(PAGE) for _ in range(n)]
                    hits = p.read_many(list(keys[:n]), outs)
                    stats["reads"] += n
                    for k, o, hit in zip(keys, outs, hits, strict=False):
                        if not hit:
                            stats["unexpected"].append("a leased page was missing")
                        elif bytes(o) != page_bytes(k, PAGE):
                            stats["wrong"] += 1
            elif op < 0.9:
                for k, got in zip(keys, p.read_many_bytes(keys), strict=True):
                    stats["reads"] += 1
                    if got is not None:
                        stats["hits"] += 1
                        if got != page_bytes(k, PAGE):
                            stats["wrong"] += 1
            elif op < 0.95:
                p.evict([keys[rng.randrange(len(keys))]])
            else:
                p.evict(nbytes=PAGE * (1 + rng.randrange(4)))
            st = p.stats()
            if st.used_bytes > st.budget_bytes:
                stats["unexpected"].append(f"used {st.used_bytes} > budget {st.budget_bytes}")
        p.close()
    except BaseException as exc:
        stats["unexpected"].append(repr(exc))
    queue.put(stats)


def test_two_processes_race(redis_server: RedisServer) -> None:
    ns = "race"
    RedisProvider(redis_server.url, namespace=ns, budget_bytes=24 * PAGE).close()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_client, args=(redis_server.url, ns, seed, 300, queue)) for seed in (1, 2)]
    for proc in procs:
        proc.start()
    results = [queue.get(timeout=240) for _ in procs]
    for proc in procs:
        proc.join(60)
        assert proc.exitcode == 0
    for r in results:
        assert r["unexpected"] == []
        assert r["wrong"] == 0
    assert sum(r["stored"] for r in results) > 0 and sum(r["reads"] for r in results) > 0
    with redis_server.client() as c:
        assert fsck(c, ns) == []
    with RedisProvider(redis_server.url, namespace=ns) as p:
        st = p.stats()
        assert st.evictions > 0 and st.leased == 0 and st.in_flight == 0
        for info in p.iter_entries():  # every survivor reads back exactly
            assert p.read_bytes(info.key) == page_bytes(info.key, PAGE)
