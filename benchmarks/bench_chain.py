"""Saving and leasing one long chain, page by page: the shape of a long prompt's save.

Every page's reservation pins its parent; an index that propagated pins to the root paid
O(depth) per page (quadratic per chain). This measures seconds per chain and per page for each
built-in provider that stores in-process or on disk, so a regression shows as a per-page cost
that grows with the chain.

Usage: ``python3 benchmarks/bench_chain.py [--pages 8192] [--page-bytes 4096]``
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import hostkv_providers as hk


def run(url: str, keys: list[bytes], blob: bytes) -> tuple[float, float, float]:
    with hk.open(url) as p:
        parent = None
        t0 = time.perf_counter()
        half = len(keys) // 2
        t_half = 0.0
        for i, k in enumerate(keys):
            p.put(k, parent, blob)
            parent = k
            if i + 1 == half:
                t_half = time.perf_counter() - t0
        t_save = time.perf_counter() - t0
        t1 = time.perf_counter()
        with p.lease(keys) as lease:
            assert lease.prefix_len == len(keys)
        t_lease = time.perf_counter() - t1
    return t_half, t_save, t_lease


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--pages", type=int, default=8192)
    ap.add_argument("--page-bytes", type=int, default=4096)
    args = ap.parse_args()
    keys = [os.urandom(32) for _ in range(args.pages)]
    blob = bytes(args.page_bytes)
    budget = 2 * args.pages * args.page_bytes
    print("| provider | first half s | whole chain s | 2nd half / 1st half | µs/page | lease(chain) ms |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    with tempfile.TemporaryDirectory() as d:
        urls = {
            "pinned": f"pinned://?budget={budget}&block={args.page_bytes}&background=false",
            "mmap": f"mmap://{d}/mmap?budget={budget}&slot={args.page_bytes}",
            "lmdb": f"lmdb://{d}/lmdb?budget={budget}",
        }
        for name, url in urls.items():
            half, whole, lease = run(url, keys, blob)
            print(f"| {name} | {half:.2f} | {whole:.2f} | {(whole - half) / half:.2f} | "
                  f"{whole / args.pages * 1e6:.0f} | {lease * 1e3:.1f} |")


if __name__ == "__main__":
    main()
