"""The sharded cluster store: scaling with masters, ``longest_prefix`` across shards, spread.

Three measurements, each on throw-away loopback clusters started by this script:

* ``scaling``: for each master count (``--masters 1,2,3``) a fresh cluster; ``--procs`` client
  processes open the same sharded store, wait on a barrier, each ``put_many``s its own chains
  (``--batch`` pages per call), waits again, then ``read_many``s them into its own buffers.
  Aggregate GB/s = all bytes / (last finish - first start) of the phase.  Median of ``--repeat``.
* ``prefix``: ``longest_prefix`` over an 8,192-key chain (all stored), the single-slot store
  against the sharded one on the same 3-master cluster, alternating, median of 20 calls each.
* ``skew``: a shared ``--shared``-page prompt then 1,000 distinct 32-page continuations; bytes
  held by the most loaded master over the mean.

    python3 plugins/hostkv-redis/benchmarks/bench_cluster.py scaling --masters 1,2,3 --procs 3 \
        --page 1MiB --total 384MiB --repeat 2
    python3 plugins/hostkv-redis/benchmarks/bench_cluster.py prefix
    python3 plugins/hostkv-redis/benchmarks/bench_cluster.py skew --shared 32,30
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from typing import Any

from hostkv_providers import parse_size
from hostkv_providers.testing import chain, page_bytes

from hostkv_redis import RedisProvider, RedisShardedProvider
from hostkv_redis.servers import RedisClusterServers, server_version

SHARDS = 48
GROUP = 4


def _open(url: str, ns: str, single: bool, budget: int | None = None) -> RedisProvider | RedisShardedProvider:
    if single:  # the single-slot layout: the whole store on one master
        return RedisProvider(url, namespace=ns, budget_bytes=budget, cluster=True, retries=8)
    return RedisShardedProvider(url, namespace=ns, budget_bytes=budget, shards=SHARDS, group=GROUP, retries=8)


def _client(url: str, ns: str, idx: int, npages: int, page: int, batch: int, chain_len: int,
            barrier: Any, results: Any, single: bool) -> None:
    p = _open(url, ns, single)
    blob = os.urandom(page)
    keys_all = []
    items_all = []
    for c in range(npages // chain_len):
        keys = chain(f"{ns}-p{idx}-c{c}", chain_len)
        keys_all.append(keys)
        items_all += [(k, keys[i - 1] if i else None, blob) for i, k in enumerate(keys)]
    outs = [bytearray(page) for _ in range(batch)]
    barrier.wait()
    t0 = time.perf_counter()
    for lo in range(0, len(items_all), batch):
        res = p.put_many(items_all[lo : lo + batch])
        assert all(r is True for r in res), [r for r in res if r is not True][:3]
    t1 = time.perf_counter()
    barrier.wait()
    flat = [k for keys in keys_all for k in keys]
    t2 = time.perf_counter()
    hits = 0
    for lo in range(0, len(flat), batch):
        ks = flat[lo : lo + batch]
        hits += sum(p.read_many(ks, outs[: len(ks)]))
    t3 = time.perf_counter()
    assert hits == len(flat)
    results.put((idx, t0, t1, t2, t3, len(items_all) * page))
    p.close()


def scaling(args: argparse.Namespace) -> list[dict[str, Any]]:
    page = parse_size(args.page)
    total = parse_size(args.total)
    rows = []
    ctx = mp.get_context("spawn")
    for m in [int(x) for x in args.masters.split(",")]:
        w, r = [], []
        for rep in range(args.repeat):
            with tempfile.TemporaryDirectory() as d, RedisClusterServers(d, masters=m) as cl:
                ns = f"scale{m}r{rep}"
                _open(cl.url, ns, args.single, 4 * total).close()
                per = total // page // args.procs // args.chain * args.chain
                barrier = ctx.Barrier(args.procs)
                q = ctx.Queue()
                procs = [ctx.Process(target=_client,
                                     args=(cl.url, ns, i, per, page, args.batch, args.chain, barrier, q, args.single))
                         for i in range(args.procs)]
                for pr in procs:
                    pr.start()
                got = [q.get(timeout=600) for _ in procs]
                for pr in procs:
                    pr.join()
                nbytes = sum(g[5] for g in got)
                w.append(nbytes / (max(g[2] for g in got) - min(g[1] for g in got)) / 1e9)
                r.append(nbytes / (max(g[4] for g in got) - min(g[3] for g in got)) / 1e9)
        row = {"layout": "single-slot" if args.single else f"sharded {SHARDS}x{GROUP}", "masters": m,
               "procs": args.procs, "page": page, "bytes": nbytes,
               "write_GBps": round(statistics.median(w), 3), "read_GBps": round(statistics.median(r), 3),
               "write_rounds": [round(x, 3) for x in w], "read_rounds": [round(x, 3) for x in r]}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def prefix(args: argparse.Namespace) -> dict[str, Any]:
    n = 8192
    page = 64
    with tempfile.TemporaryDirectory() as d, RedisClusterServers(d, masters=3) as cl:
        single = RedisProvider(cl.url, namespace="pfx1", budget_bytes=64 << 20, cluster=True)
        sharded = RedisShardedProvider(cl.url, namespace="pfxN", budget_bytes=64 << 20, shards=SHARDS, group=GROUP)
        keys = chain("pfx", n)
        items = [(k, keys[i - 1] if i else None, page_bytes(k, page)) for i, k in enumerate(keys)]
        for lo in range(0, n, 1024):
            single.put_many(items[lo : lo + 1024])
        assert all(r is True for r in sharded.put_many(items))
        fresh = RedisShardedProvider(cl.url, namespace="pfxN", shards=SHARDS, group=GROUP)
        times: dict[str, list[float]] = {"single": [], "sharded": [], "sharded_fresh_client": []}
        for _ in range(20):
            for name, p in (("single", single), ("sharded", sharded), ("sharded_fresh_client", fresh)):
                t0 = time.perf_counter()
                got = p.longest_prefix(keys)
                times[name].append(time.perf_counter() - t0)
                assert got == n
        shards_touched = len({sharded.shard_of(k) for k in keys[::GROUP]})
        out = {"keys": n, "shards_touched": shards_touched, "masters": 3,
               **{f"{k}_ms": round(statistics.median(v) * 1000, 2) for k, v in times.items()}}
        for p in (single, sharded, fresh):
            p.close()
    print(json.dumps(out), flush=True)
    return out


def skew(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    with tempfile.TemporaryDirectory() as d, RedisClusterServers(d, masters=3) as cl:
        for shared in [int(x) for x in args.shared.split(",")]:
            for group in [int(x) for x in args.groups.split(",")]:
                p = RedisShardedProvider(cl.url, namespace=f"skew{shared}g{group}", budget_bytes=1 << 30,
                                         shards=SHARDS, group=group)
                prompt = chain(f"sys{shared}", shared)
                p.put_many([(k, prompt[i - 1] if i else None, b"x" * 1024) for i, k in enumerate(prompt)])
                items = []
                for j in range(1000):
                    cont = chain(f"c{shared}-{j}", 32)
                    items += [(k, cont[i - 1] if i else prompt[-1], b"x" * 1024) for i, k in enumerate(cont)]
                p.put_many(items)
                load = p.load_by_master()
                mean = sum(load.values()) / len(load)
                row = {"shared": shared, "group": group, "shards": SHARDS,
                       "max_over_mean": round(max(load.values()) / mean, 3),
                       "per_master_KiB": sorted(v // 1024 for v in load.values())}
                print(json.dumps(row), flush=True)
                rows.append(row)
                p.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    s = sub.add_parser("scaling")
    s.add_argument("--masters", default="1,2,3")
    s.add_argument("--procs", type=int, default=3)
    s.add_argument("--page", default="1MiB")
    s.add_argument("--total", default="768MiB")
    s.add_argument("--batch", type=int, default=32)
    s.add_argument("--chain", type=int, default=32)
    s.add_argument("--repeat", type=int, default=1)
    s.add_argument("--single", action="store_true", help="the single-slot layout (shards=1) instead")
    sub.add_parser("prefix")
    k = sub.add_parser("skew")
    k.add_argument("--shared", default="32,30")
    k.add_argument("--groups", default="4")
    args = ap.parse_args()
    print(json.dumps({"server": server_version(), "python": sys.version.split()[0], "cpus": os.cpu_count(),
                      "load": os.getloadavg()}), flush=True)
    {"scaling": scaling, "prefix": prefix, "skew": skew}[args.what](args)


if __name__ == "__main__":
    main()
