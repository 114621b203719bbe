"""Explicit eviction of a whole saved chain, and how long it holds the GIL.

Issue 14 item 5 (no decode stalls from the cache): ``provider.evict(keys[:1])`` removes the chain
under its root (a saved prompt of ``--pages`` pages).  Each row reports the wall time of the call
and the longest time a second thread, waking every 0.5 ms, waited beyond its sleep: what an
engine thread needing the GIL (a decode step back from its synchronize) would have waited.

Usage: ``python3 benchmarks/bench_evict.py [--pages 6400] [--reps 5] [--dir DIR]``; prints one
markdown table (pinned:// and mmap://, the latter also reopened before the evict; 4 KiB pages:
the cost is per entry, not per byte).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from typing import Any

import numpy as np

import hostkv_providers as hk
from hostkv_providers.testing import chain

PAGE = 4096


class _Ticker:
    """A thread that sleeps 0.5 ms at a time and records how late it wakes (the GIL wait)."""

    def __init__(self) -> None:
        self.late: list[float] = []
        self._stop = threading.Event()
        self._th = threading.Thread(target=self._run, daemon=True)
        self._th.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            t = time.perf_counter()
            time.sleep(0.0005)
            self.late.append(time.perf_counter() - t - 0.0005)

    def close(self) -> None:
        self._stop.set()
        self._th.join()


def _store(prov: Any, keys: list[hk.Key], data: bytes) -> None:
    rc = prov.reserve_many(keys, [None, *keys[:-1]], PAGE, salt_tag="bench")
    for r in rc.reservations:
        if r is not None:
            r.write(0, data)
    rc.mark_written()
    rc.seal()


def run(url: str, n: int, reps: int, reopen: bool = False) -> tuple[float, float, float]:
    """Median wall ms of evicting the chain, median and worst GIL wait ms of the ticker
    (``reopen``: the store closed and opened again between the save and the evict, so the
    chain's entries come from the store's load, not from this process's writes)."""
    prov = hk.open(url)
    keys = chain(f"bench-evict-{url}", n)
    data = np.random.default_rng(0).bytes(PAGE)
    walls, waits = [], []
    try:
        for _ in range(reps):
            _store(prov, keys, data)
            if reopen:
                prov.close()
                prov = hk.open(url)
            ticker = _Ticker()
            time.sleep(0.01)
            ticker.late.clear()
            t = time.perf_counter()
            report = prov.evict(keys[:1])
            walls.append(time.perf_counter() - t)
            time.sleep(0.002)
            ticker.close()
            waits.append(max(ticker.late, default=0.0))
            if report.entries != n:
                raise RuntimeError(f"{url}: evicted {report.entries} of {n}")
    finally:
        prov.close()
    return statistics.median(walls) * 1e3, statistics.median(waits) * 1e3, max(waits) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pages", type=int, default=6400)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    n = args.pages
    root = tempfile.mkdtemp(prefix="bench-evict-", dir=args.dir)
    budget = 2 * n * PAGE + (8 << 20)
    urls = [f"pinned://?budget={budget}&block={PAGE}&background=false",
            f"mmap://{os.path.join(root, 'store')}?budget={budget}&slot={PAGE}"]
    print(f"{n} pages of {PAGE} B, evict(keys[:1]), {args.reps} repetitions\n")
    print("| store | evict (median) | longest GIL wait of another thread (median / worst) |")
    print("| --- | ---: | ---: |")
    for url, reopen in ((urls[0], False), (urls[1], False), (urls[1], True)):
        wall, wait, worst = run(url, n, args.reps, reopen)
        name = url.split(":")[0] + "://" + (", reopened" if reopen else "")
        print(f"| {name} | {wall:.1f} ms | {wait:.2f} / {worst:.2f} ms |")


if __name__ == "__main__":
    main()
