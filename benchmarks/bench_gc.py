"""What a store's index costs the garbage collector: issue #14's decode-step stalls.

An engine process keeps its host KV index for hours; CPython's full collections walk every
GC-tracked object, so an index with one Python object per page makes every full pass (and the
decode step it lands in) slower as the store fills.  This fills a pinned provider with N pages
(``put_many`` of 4 KiB pages in chains of 512, ordinary memory) and reports the GC-tracked
objects the store added and the time of a full ``gc.collect()`` (best of ``--repeat``).

Usage: ``python3 benchmarks/bench_gc.py [--pages 200000] [--repeat 5]`` (prints one markdown row).
Run it against two trees (``PYTHONPATH``) for a before/after comparison.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import time

import hostkv_providers as hk


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pages", type=int, default=200_000)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    page = 4096
    gc.collect()
    base_objects = len(gc.get_objects())
    base_times = []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        gc.collect()
        base_times.append(time.perf_counter() - t0)
    budget = args.pages * page
    url = f"pinned://?budget={budget}&block={page}&chunk={min(budget, 256 << 20)}&background=false&pin=no"
    blob = bytes(page)
    with hk.open(url) as p:
        prev = bytes(32)
        for lo in range(0, args.pages, 512):
            items: list[tuple[bytes, bytes | None, bytes]] = []
            parent: bytes | None = None
            for i in range(lo, min(lo + 512, args.pages)):
                prev = hashlib.blake2b(prev + i.to_bytes(8, "little"), digest_size=32).digest()
                items.append((prev, parent, blob))
                parent = prev
            p.put_many(items)  # type: ignore[attr-defined]
            del items
        assert p.stats().entries == args.pages
        gc.collect()
        objects = len(gc.get_objects()) - base_objects
        times = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            gc.collect()
            times.append(time.perf_counter() - t0)
    print(f"| {args.pages:,} pages | {objects:,} | {min(base_times) * 1e3:.1f} | {min(times) * 1e3:.1f} |")


if __name__ == "__main__":
    main()
