"""hostkv-redis against raw redis-py on the same server, in one run.

Measures, for each page size:

* **write**: ``put_many`` of chains (a probe script for already stored / in-flight pages, then one
  pipeline of SETs to staging keys with a put script after every 16 pages or 4 MiB, which
  publishes them) against raw pipelined ``SET`` of the same bytes in the same batch size;
* **read**: ``read_many`` into caller buffers (trailer + XXH3 verified, LRU refreshed) against raw
  pipelined ``GET`` of the same bytes;

and the latency of ``longest_prefix`` over an 8,192-key chain against raw pipelined ``EXISTS``.
Each round, the two systems take turns batch by batch, first writing every batch, then reading
every batch (who goes first alternates per batch and per round), so load from other jobs on a
shared host hits both alike; each system's batch times are summed, and the median over rounds is
reported, with the per-round write ratios.  ``--no-interleave`` times each system's whole write
and read phase in turn instead (one system writes, reads and frees its data, then the other).
By default a throw-away ``redis-server`` is started on loopback (``--url`` uses an existing one;
only keys under its own namespace and ``bench:raw:*`` are touched).

    python3 plugins/hostkv-redis/benchmarks/bench_redis.py --sizes 64KiB,256KiB,1MiB,2MiB --total 512MiB --repeat 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import redis
from hostkv_providers import format_size, parse_size
from hostkv_providers.testing import chain

from hostkv_redis import RedisProvider
from hostkv_redis.servers import RedisServer, server_version


def _median_time(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_size(url: str, page: int, total: int, batch: int, repeat: int, interleave: bool) -> dict[str, Any]:
    npages = max(batch, total // page // batch * batch)
    data = [os.urandom(page) for _ in range(min(npages, 64))]  # reuse 64 distinct buffers
    raw = redis.Redis.from_url(url)
    rounds: dict[str, list[float]] = {"ours_write": [], "raw_write": [], "ours_read": [], "raw_read": []}
    for r in range(repeat):
        ns = f"bench{page}x{r}"
        keys = chain(ns, npages)  # chains of `batch` pages: parents inside each batch
        p = RedisProvider(url, namespace=ns, budget_bytes=2 * npages * page)
        raw_names = [f"bench:raw:{k.hex()}".encode() for k in keys]
        outs = [bytearray(page) for _ in range(batch)]

        def ours_write(lo: int, p: RedisProvider = p, keys: list[Any] = keys) -> None:
            items = [(keys[i], keys[i - 1] if i > lo else None, data[i % len(data)]) for i in range(lo, lo + batch)]
            out = p.put_many(items)
            assert all(x is True for x in out), out[:3]

        def raw_write(lo: int, names: list[bytes] = raw_names) -> None:
            pipe = raw.pipeline(transaction=False)
            for i in range(lo, lo + batch):
                pipe.set(names[i], data[i % len(data)])
            pipe.execute()

        def ours_read(lo: int, p: RedisProvider = p, keys: list[Any] = keys, outs: list[bytearray] = outs) -> None:
            assert all(p.read_many(keys[lo : lo + batch], outs))

        def raw_read(lo: int, names: list[bytes] = raw_names) -> None:
            pipe = raw.pipeline(transaction=False)
            for i in range(lo, lo + batch):
                pipe.get(names[i])
            got = pipe.execute()
            assert all(v is not None for v in got)

        def ours_clean(p: RedisProvider = p, ns: str = ns) -> None:
            p.evict(nbytes=npages * page * 2)
            p.close()
            raw.delete(f"hkv:{{{ns}}}:m", f"hkv:{{{ns}}}:lru", f"hkv:{{{ns}}}:fz", f"hkv:{{{ns}}}:lz")

        def raw_clean(names: list[bytes] = raw_names) -> None:
            for lo in range(0, npages, 1000):
                raw.delete(*names[lo : lo + 1000])

        batches = range(0, npages, batch)
        systems: dict[str, tuple[Callable[[int], None], Callable[[int], None], Callable[[], None]]] = {
            "ours": (ours_write, ours_read, ours_clean), "raw": (raw_write, raw_read, raw_clean)}
        first = ["ours", "raw"] if r % 2 == 0 else ["raw", "ours"]
        if interleave:
            # Batch by batch, the two systems take turns (who goes first alternates per batch and
            # per round), so a burst of load from other jobs on a shared host hits both alike.
            for phase, fns in (("write", {w: f[0] for w, f in systems.items()}),
                               ("read", {w: f[1] for w, f in systems.items()})):
                spent = {"ours": 0.0, "raw": 0.0}
                for b, lo in enumerate(batches):
                    for who in first if b % 2 == 0 else first[::-1]:
                        t0 = time.perf_counter()
                        fns[who](lo)
                        spent[who] += time.perf_counter() - t0
                for who, t in spent.items():
                    rounds[f"{who}_{phase}"].append(t)
            for who in first:
                systems[who][2]()
        else:
            # Each system writes, reads, then frees its data, so both start from the same server
            # memory state; which one goes first alternates per round.
            for who in first:
                write, read, clean = systems[who]
                for phase, fn in (("write", write), ("read", read)):
                    t0 = time.perf_counter()
                    for lo in batches:
                        fn(lo)
                    rounds[f"{who}_{phase}"].append(time.perf_counter() - t0)
                clean()
    raw.close()
    nbytes = npages * page
    med = {k: statistics.median(v) for k, v in rounds.items()}
    return {
        "page": page, "pages": npages, "batch": batch, "bytes": nbytes,
        "ours_write_gbs": nbytes / med["ours_write"] / 1e9, "raw_write_gbs": nbytes / med["raw_write"] / 1e9,
        "ours_read_gbs": nbytes / med["ours_read"] / 1e9, "raw_read_gbs": nbytes / med["raw_read"] / 1e9,
        "write_ratio": med["raw_write"] / med["ours_write"], "read_ratio": med["raw_read"] / med["ours_read"],
        "write_ratios": [rw / ow for rw, ow in zip(rounds["raw_write"], rounds["ours_write"], strict=True)],
    }


def bench_prefix(url: str, n: int, repeat: int) -> dict[str, Any]:
    ns = "benchprefix"
    keys = chain(ns, n)
    p = RedisProvider(url, namespace=ns, budget_bytes=n * 4096 * 2)
    small = b"\x00" * 64  # only the index matters for longest_prefix
    for lo in range(0, n, 1024):
        p.put_many([(keys[i], keys[i - 1] if i else None, small) for i in range(lo, min(n, lo + 1024))])
    raw = redis.Redis.from_url(url)
    raw_names = [f"bench:raw:{k.hex()}".encode() for k in keys]
    for lo in range(0, n, 1024):
        raw.mset({name: small for name in raw_names[lo : lo + 1024]})

    def raw_prefix() -> int:
        pipe = raw.pipeline(transaction=False)
        for name in raw_names:
            pipe.exists(name)
        hits = pipe.execute()
        count = 0
        for h in hits:
            if not h:
                break
            count += 1
        return count

    assert p.longest_prefix(keys) == n and raw_prefix() == n
    ours: list[float] = []
    rawt: list[float] = []
    for _ in range(repeat):
        ours.append(_median_time(lambda: p.longest_prefix(keys), 1))
        rawt.append(_median_time(raw_prefix, 1))
    miss_half = [*keys[: n // 2], chain("absent", 1)[0], *keys[n // 2 + 1 :]]
    ours_half = _median_time(lambda: p.longest_prefix(miss_half), repeat)
    p.evict(nbytes=n * 4096 * 2)
    p.close()
    for lo in range(0, n, 1000):
        raw.delete(*raw_names[lo : lo + 1000])
    raw.close()
    return {"keys": n, "ours_ms": statistics.median(ours) * 1e3, "raw_ms": statistics.median(rawt) * 1e3,
            "ours_half_ms": ours_half * 1e3, "ratio": statistics.median(rawt) / statistics.median(ours)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="an existing server (default: start redis-server on loopback)")
    ap.add_argument("--sizes", default="64KiB,256KiB,2MiB", help="page sizes, comma-separated")
    ap.add_argument("--total", default="256MiB", help="bytes written and read per size and round")
    ap.add_argument("--batch", type=int, default=64, help="pages per put_many/read_many and per raw pipeline")
    ap.add_argument("--repeat", type=int, default=3, help="rounds per measurement (median reported)")
    ap.add_argument("--prefix-keys", type=int, default=8192)
    ap.add_argument("--no-interleave", dest="interleave", action="store_false",
                    help="time each system's whole write (then read) phase in turn, not batch by batch")
    ap.add_argument("--json", action="store_true", help="print JSON instead of markdown")
    args = ap.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    total = parse_size(args.total)

    def run(url: str) -> dict[str, Any]:
        with redis.Redis.from_url(url) as c:
            version = c.info("server").get("redis_version", "?")
        return {"server": f"redis-server {version}", "redis_py": redis.__version__,
                "binary": server_version() if not args.url else "external",
                "sizes": [bench_size(url, s, total, args.batch, args.repeat, args.interleave) for s in sizes],
                "prefix": bench_prefix(url, args.prefix_keys, max(5, args.repeat))}

    if args.url:
        result = run(args.url)
    else:
        with tempfile.TemporaryDirectory() as tmp, RedisServer(tmp) as server:
            result = run(server.url)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    how = "batches of the two systems interleaved" if args.interleave else "whole phases in turn"
    print(f"Server: {result['server']} on loopback; redis-py {result['redis_py']}; "
          f"batch {args.batch} pages; {how}; median of {args.repeat} rounds.\n")
    print("| page | pages | write ours GB/s | write raw GB/s | ours/raw | (per round) "
          "| read ours GB/s | read raw GB/s | ours/raw |")
    print("| ---: | ---: | ---: | ---: | ---: | :--- | ---: | ---: | ---: |")
    for r in result["sizes"]:
        print(f"| {format_size(r['page'])} | {r['pages']} | {r['ours_write_gbs']:.2f} | {r['raw_write_gbs']:.2f} "
              f"| {r['write_ratio']:.2f}x | {' '.join(f'{x:.2f}' for x in r['write_ratios'])} "
              f"| {r['ours_read_gbs']:.2f} | {r['raw_read_gbs']:.2f} "
              f"| {r['read_ratio']:.2f}x |")
    pr = result["prefix"]
    print(f"\n`longest_prefix` over a {pr['keys']}-key chain: ours {pr['ours_ms']:.1f} ms (one script call), "
          f"raw pipelined EXISTS {pr['raw_ms']:.1f} ms ({pr['ratio']:.1f}x faster than raw); "
          f"a chain missing its middle key: {pr['ours_half_ms']:.1f} ms.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
