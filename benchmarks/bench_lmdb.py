"""The lmdb provider, side by side with raw py-lmdb and the mmap provider, in one run.

Measures:
* ``longest_prefix`` of an 8,192-key chain, warm (goal: under 2 ms), against a raw py-lmdb
  ``Cursor.getmulti`` of the same keys and the mmap provider;
* page write (reserve + write + seal) and read throughput for 2 MiB pages, against raw py-lmdb
  ``put``/``get`` of the same bytes (one transaction per page, no sync: the same durability as
  ``process``) and against the mmap provider;
* seal rate per durability mode (64 KiB pages; one thread, and 8 threads for group commit);
* open time of a store holding 1,000,000 entries (built directly in LMDB with the provider's own
  record format, in large transactions), and the first lookup after that open.

Usage: ``python3 benchmarks/bench_lmdb.py [--dir DIR] [--quick]``; prints a markdown table.
Results on a busy machine vary run to run: compare the ratios, not the absolute numbers.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import lmdb

from hostkv_providers.providers import Key, LmdbProvider
from hostkv_providers.providers.lmdb.format import Counters, Entry
from hostkv_providers.testing import page_bytes

MiB = 1 << 20


def keys_of(label: str, n: int) -> list[Key]:
    out = []
    prev = bytes(32)
    for i in range(n):
        prev = hashlib.blake2b(prev + label.encode() + i.to_bytes(8, "little"), digest_size=32).digest()
        out.append(Key(prev))
    return out


def best_ms(fn: Callable[[], object], repeat: int) -> tuple[float, float]:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return min(times), statistics.median(times)


def mmap_provider(path: str, budget: int, slot: int, durability: str = "process") -> Any:
    try:
        from hostkv_providers.providers import MmapProvider
    except ImportError:
        return None
    return MmapProvider(path, budget_bytes=budget, slot_nbytes=slot, durability=durability)


def bench_lookup(root: str, rows: list[tuple[str, ...]], repeat: int) -> None:
    keys = keys_of("lookup", 8192)
    blob = bytes(4096)
    p = LmdbProvider(os.path.join(root, "lookup"), budget_bytes=8192 * 4096 * 2, inline_max=4096)
    parent = None
    for k in keys:  # inline 4 KiB pages: the lookup never touches page bytes anyway
        p.put(k, parent, blob)
        parent = k
    assert p.longest_prefix(keys) == 8192
    best, med = best_ms(lambda: p.longest_prefix(keys), repeat)
    env: Any = p._s.env
    db = p._s.dbs["entries"]

    def raw() -> int:
        with env.begin() as txn:
            return len(txn.cursor(db=db).getmulti(keys))

    raw_best, _ = best_ms(raw, repeat)
    p.close()
    rows.append(("longest_prefix, 8,192-key chain (warm)", f"{best:.2f} ms (median {med:.2f})",
                 f"raw getmulti {raw_best:.2f} ms", f"{best / raw_best:.2f}x", "goal < 2 ms"))
    m = mmap_provider(os.path.join(root, "lookup-mmap"), 8192 * 4096 * 2, 4096)
    if m is not None:
        parent = None
        for k in keys:
            m.put(k, parent, blob)
            parent = k
        m_best, _ = best_ms(lambda: m.longest_prefix(keys), repeat)
        m.close()
        rows.append(("longest_prefix, 8,192-key chain: mmap provider", f"{best:.2f} ms", f"mmap {m_best:.2f} ms",
                     f"{best / m_best:.2f}x", "in-memory index"))


def bench_throughput(root: str, rows: list[tuple[str, ...]], npages: int) -> None:
    page = 2 * MiB
    keys = keys_of("tp", npages)
    data = [page_bytes(k, page) for k in keys[:8]]  # 8 distinct payloads, reused
    total = npages * page / 1e9
    out = bytearray(page)

    p = LmdbProvider(os.path.join(root, "tp"), budget_bytes=(npages + 8) * page, inline_max=0)
    t0 = time.perf_counter()
    for i, k in enumerate(keys):
        p.put(k, None, data[i % 8])
    w_lmdb = total / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    for _ in range(2):
        for k in keys:
            assert p.read(k, out)
    r_lmdb = 2 * total / (time.perf_counter() - t0)
    p.close()

    env = lmdb.open(os.path.join(root, "raw"), map_size=(npages + 64) * page * 2, sync=False, metasync=False,
                    writemap=False, mode=0o600)
    t0 = time.perf_counter()
    for i, k in enumerate(keys):
        with env.begin(write=True) as txn:
            txn.put(k, data[i % 8])
    w_raw = total / (time.perf_counter() - t0)
    mv = memoryview(out)
    t0 = time.perf_counter()
    for _ in range(2):
        for k in keys:
            with env.begin(buffers=True) as txn:
                mv[:] = txn.get(k)
    r_raw = 2 * total / (time.perf_counter() - t0)
    env.close()
    rows.append(("write 2 MiB pages (reserve+write+seal)", f"{w_lmdb:.2f} GB/s", f"raw lmdb put {w_raw:.2f} GB/s",
                 f"{w_lmdb / w_raw:.2f}x", f"{npages} pages, durability=process"))
    rows.append(("read 2 MiB pages (checksum-verified)", f"{r_lmdb:.2f} GB/s", f"raw lmdb get {r_raw:.2f} GB/s",
                 f"{r_lmdb / r_raw:.2f}x", "warm page cache"))
    m = mmap_provider(os.path.join(root, "tp-mmap"), (npages + 8) * page, page)
    if m is not None:
        t0 = time.perf_counter()
        for i, k in enumerate(keys):
            m.put(k, None, data[i % 8])
        w_m = total / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        for _ in range(2):
            for k in keys:
                assert m.read(k, out)
        r_m = 2 * total / (time.perf_counter() - t0)
        m.close()
        rows.append(("write 2 MiB pages: vs mmap provider", f"{w_lmdb:.2f} GB/s", f"mmap {w_m:.2f} GB/s",
                     f"{w_lmdb / w_m:.2f}x", ""))
        rows.append(("read 2 MiB pages: vs mmap provider", f"{r_lmdb:.2f} GB/s", f"mmap {r_m:.2f} GB/s",
                     f"{r_lmdb / r_m:.2f}x", ""))


def bench_seals(root: str, rows: list[tuple[str, ...]], n: int) -> None:
    page = 64 * 1024
    blob = page_bytes(b"seal", page)
    rates: dict[str, float] = {}
    for mode in ("none", "process", "sync"):
        count = n if mode != "sync" else max(50, n // 8)
        p = LmdbProvider(os.path.join(root, f"seal-{mode}"), budget_bytes=(count * 9 + 16) * page, inline_max=0,
                         durability=mode)
        keys = keys_of(f"seal-{mode}", count)
        t0 = time.perf_counter()
        for k in keys:
            p.put(k, None, blob)
        rates[mode] = count / (time.perf_counter() - t0)
        # 8 threads: concurrent seals share a transaction (and, for sync, one sync)
        tkeys = [keys_of(f"seal-{mode}-t{t}", count) for t in range(8)]

        def run(ks: list[Key], p: LmdbProvider = p) -> None:
            for k in ks:
                p.put(k, None, blob)

        threads = [threading.Thread(target=run, args=(ks,)) for ks in tkeys]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        rate8 = 8 * count / (time.perf_counter() - t0)
        p.close()
        rows.append((f"seal rate, durability={mode}", f"{rates[mode]:,.0f}/s (1 thread)",
                     f"{rate8:,.0f}/s (8 threads)", f"{rate8 / rates[mode]:.2f}x", "64 KiB pages"))
        m = mmap_provider(os.path.join(root, f"seal-mmap-{mode}"), (count + 16) * page, page, mode)
        if m is not None:
            t0 = time.perf_counter()
            for k in keys:
                m.put(k, None, blob)
            m_rate = count / (time.perf_counter() - t0)
            m.close()
            rows.append((f"seal rate, durability={mode}: vs mmap provider", f"{rates[mode]:,.0f}/s",
                         f"mmap {m_rate:,.0f}/s", f"{rates[mode] / m_rate:.2f}x", "1 thread"))


def build_million(path: str, n: int) -> None:
    """Write ``n`` entries (1,000-key chains of 16-byte inline pages) straight into a fresh
    store's LMDB databases, in the provider's own record format."""
    p = LmdbProvider(path, budget_bytes=1 << 40, inline_max=64, map_size=64 * MiB, map_max=8 << 30)
    p.close()
    env = lmdb.open(path, map_size=4 << 30, max_dbs=16, mode=0o600, sync=False, metasync=False, writemap=False)
    dbs = {name: env.open_db(name.encode()) for name in ("meta", "entries", "children", "lru", "pages")}
    blob = bytes(16)
    from hostkv_providers.providers import checksum

    digest = checksum(blob)
    now = time.time()
    chain_len = 1000
    tick = 0
    sealed = 0
    for c0 in range(0, n // chain_len, 50):
        entries, children, lru, pages = [], [], [], []
        for c in range(c0, min(c0 + 50, n // chain_len)):
            parent = None
            for i, k in enumerate(keys_of(f"m{c}", chain_len)):
                tick += 1
                e = Entry(k, parent, 16, 16, digest, now, tick, tick, 0, 0, "bench")
                e.children = 0 if i == chain_len - 1 else 1
                entries.append((k, e.pack()))
                pages.append((k, blob))
                if parent is not None:
                    children.append((parent + k, b""))
                if e.children == 0:
                    lru.append((e.lru_key, b""))
                parent = k
                sealed += 16
        with env.begin(write=True) as txn:
            for db, items in (("entries", entries), ("pages", pages), ("children", children), ("lru", lru)):
                items.sort()
                txn.cursor(db=dbs[db]).putmulti(items)
    with env.begin(write=True) as txn:
        c = Counters(txn.get(b"counters", db=dbs["meta"]))
        c.used = c.sealed = sealed
        c.tick = c.gen = tick
        txn.put(b"counters", c.pack(), db=dbs["meta"])
    env.sync(True)
    env.close()


def bench_open(root: str, rows: list[tuple[str, ...]], n: int) -> None:
    path = os.path.join(root, "million")
    t0 = time.perf_counter()
    build_million(path, n)
    build_s = time.perf_counter() - t0
    probe = keys_of("m7", 1000)
    times = []
    first = []
    for _ in range(5):
        # (the closed provider released this process's environment: this open is a cold one)
        t0 = time.perf_counter()
        p = LmdbProvider(path)
        times.append((time.perf_counter() - t0) * 1e3)
        t0 = time.perf_counter()
        assert p.longest_prefix(probe) == 1000
        first.append((time.perf_counter() - t0) * 1e3)
        entries = p.stats().entries
        p.close()
    assert entries == n
    rows.append((f"open a store of {n:,} entries", f"{min(times):.1f} ms (median {statistics.median(times):.1f})",
                 f"first 1,000-key lookup {min(first):.2f} ms", "-",
                 f"built in {build_s:.1f} s directly in LMDB; open does not scan the index"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dir", default=None, help="where to put the stores (default: a temp dir)")
    ap.add_argument("--quick", action="store_true", help="smaller sizes (a smoke run)")
    ap.add_argument("--repeat", type=int, default=30)
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="bench-lmdb-", dir=args.dir)
    rows: list[tuple[str, ...]] = []
    try:
        bench_lookup(root, rows, args.repeat)
        bench_throughput(root, rows, 32 if args.quick else 128)
        bench_seals(root, rows, 200 if args.quick else 1000)
        bench_open(root, rows, 100_000 if args.quick else 1_000_000)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"python {sys.version.split()[0]}, py-lmdb {lmdb.__version__} (LMDB {'.'.join(map(str, lmdb.version()))}), "
          f"{os.cpu_count()} CPUs\n")
    print("| measurement | lmdb provider | baseline | ratio | notes |")
    print("| --- | --- | --- | --- | --- |")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
