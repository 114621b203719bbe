"""A fresh ``pinned://`` store's first ``put_many``, against the same store pre-faulted and raw copies.

Side by side in one process, ``--rounds`` rounds (sides alternating), 256 KiB pages (``--page``),
``--gib`` GiB per pass, ordinary (pageable) arena memory (``pin=no``; page-locked arenas are
faulted in by their allocator):

* ``put_many`` into a store opened just before the pass, default ``prefault=true`` (the background
  ``MADV_POPULATE_WRITE`` thread races the writes);
* the same with ``prefault=false`` (every first touch faults: the old behaviour);
* the same into a store whose prefault finished (``wait_prefaulted()``) before the pass;
* raw: numpy copy + XXH3-64 of each page into a fresh anonymous mapping, and into one faulted in
  before (the memcpy-speed baseline, with the checksum ``put_many`` must compute too).

Usage: ``python3 benchmarks/bench_pinned_fill.py [--gib 1] [--rounds 3]``; prints a markdown table
of GB/s (median of rounds) and ratios to the pre-faulted raw copy + XXH3.
"""

from __future__ import annotations

import argparse
import hashlib
import mmap
import statistics
import time

import numpy as np
import xxhash

from hostkv_providers.device import OrdinaryAllocator
from hostkv_providers.providers import PinnedProvider


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--page", type=int, default=256 * 1024)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    page = a.page
    n = int(a.gib * (1 << 30)) // page
    budget = n * page
    src = [np.random.default_rng(i).integers(0, 255, page, dtype=np.uint8).tobytes() for i in range(64)]
    keys = [hashlib.blake2b(str(i).encode(), digest_size=32).digest() for i in range(n)]
    items = [(keys[i], keys[i - 1] if i else None, src[i % 64]) for i in range(n)]

    def fill(p: PinnedProvider) -> float:
        t = time.perf_counter()
        for j in range(0, n, 256):
            p.put_many(items[j : j + 256])
        return time.perf_counter() - t

    def store(prefault: bool) -> PinnedProvider:
        return PinnedProvider(budget, block=page, allocator=OrdinaryAllocator(), prefault=prefault)

    def fresh() -> float:
        p = store(True)
        try:
            return fill(p)
        finally:
            p.close()

    def unfaulted() -> float:
        p = store(False)
        try:
            return fill(p)
        finally:
            p.close()

    def ready() -> float:
        p = store(True)
        try:
            p.wait_prefaulted()
            return fill(p)
        finally:
            p.close()

    def raw(faulted: bool) -> float:
        m = mmap.mmap(-1, budget)
        v = np.frombuffer(m, np.uint8)
        if faulted:
            v[::4096] = 1
        t = time.perf_counter()
        for i in range(n):
            s = src[i % 64]
            np.copyto(v[i * page : (i + 1) * page], np.frombuffer(s, np.uint8))
            xxhash.xxh3_64_intdigest(s)
        dt = time.perf_counter() - t
        del v
        m.close()
        return dt

    cases = {
        "put_many, fresh store, prefault=true (default)": fresh,
        "put_many, fresh store, prefault=false": unfaulted,
        "put_many, store after wait_prefaulted()": ready,
        "raw copy + XXH3 into a fresh mapping": lambda: raw(False),
        "raw copy + XXH3 into a faulted mapping": lambda: raw(True),
    }
    times: dict[str, list[float]] = {c: [] for c in cases}
    for _ in range(a.rounds):
        for c, fn in cases.items():
            times[c].append(fn())
    gb = budget / 1e9
    base = statistics.median(times["raw copy + XXH3 into a faulted mapping"])
    print(f"{a.gib:g} GiB of {page // 1024} KiB pages, {a.rounds} rounds (median)\n")
    print("| case | GB/s | vs raw faulted + XXH3 |")
    print("| --- | ---: | ---: |")
    for c, ts in times.items():
        med = statistics.median(ts)
        print(f"| {c} | {gb / med:.2f} | {base / med:.2f}x |")


if __name__ == "__main__":
    main()
