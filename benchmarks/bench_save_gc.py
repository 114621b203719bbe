"""What a cache save and restore cost the engine's process in garbage collection and GIL holds.

Issue 14 item 5 (no decode stalls from the cache).  ``HostKVCache.save`` / ``restore`` of a
``--pages`` chain into ``pinned://`` on the CPU copy engine, with a second thread that sleeps
0.5 ms at a time and records how late it wakes (what an engine thread needing the GIL would
have waited), and ``gc.callbacks`` counting the collections each call set off by generation
and the longest of them.  The pages are small (16 KiB: 32 layers x K/V x 16 tokens x 8 dims,
fp16) so the cost measured is the cache's per-page and per-chunk work, not the bytes.

On the CPU engine the copies themselves run in Python threads (numpy), so the ticker's waits
include them: compare save against restore, and a tree against another (``PYTHONPATH``), not
against the GPU figures, where the copies are DMA.

Usage: ``python3 benchmarks/bench_save_gc.py [--pages 6400] [--reps 3]`` (prints one markdown table).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import hostkv_providers as hk
from hostkv_providers.cache import HostKVCache
from hostkv_providers.device import CpuCopyEngine

LAYOUT = hk.KVLayout(num_layers=32, num_kv_heads=1, head_dim=8, page_tokens=16, dtype="float16")


class _Probe:
    """GC collections by generation (and the longest) plus a 0.5 ms ticker's lateness."""

    def __init__(self) -> None:
        self.counts = [0, 0, 0]
        self.longest = 0.0
        self.late: list[float] = []
        self._t0 = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.counts[info["generation"]] += 1
            self.longest = max(self.longest, time.perf_counter() - self._t0)

    def _tick(self) -> None:
        while not self._stop.is_set():
            t = time.perf_counter()
            time.sleep(0.0005)
            self.late.append(time.perf_counter() - t - 0.0005)

    def __enter__(self) -> _Probe:
        gc.collect()
        gc.callbacks.append(self._gc)
        self._thread = threading.Thread(target=self._tick, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join()
        gc.callbacks.remove(self._gc)


def _timed(fn: Callable[[], object]) -> tuple[float, _Probe]:
    with _Probe() as probe:
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
    return dt, probe


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pages", type=int, default=6400)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    n = args.pages
    rows: dict[str, list[tuple[float, _Probe]]] = {"save": [], "lookup + restore": []}
    page = LAYOUT.page_nbytes
    with hk.open(f"pinned://?budget={n * page * 2}&block={page}&pin=no") as p, \
            HostKVCache(p, hk.Salt("bench/save-gc", LAYOUT), CpuCopyEngine()) as cache:
        shape = (n, LAYOUT.page_tokens, LAYOUT.num_kv_heads, LAYOUT.head_dim)
        planes = [np.random.default_rng(i).standard_normal(shape).astype(np.float16) for i in range(64)]
        out = [np.zeros_like(a) for a in planes]
        ids = list(range(n))
        for rep in range(args.reps):
            keys = cache.keys(np.arange(n * LAYOUT.page_tokens) + rep * 10_000_000)
            def save(keys: list[hk.Key] = keys) -> None:
                cache.save(keys, planes, ids).wait(120)

            rows["save"].append(_timed(save))

            def restore(keys: list[hk.Key] = keys) -> None:
                hit = cache.lookup(keys)
                got = cache.restore(hit, out, ids).wait(120)
                assert got.pages == n, got

            rows["lookup + restore"].append(_timed(restore))
            p.evict(keys[:1])
    print(f"{n} pages of {LAYOUT.page_nbytes // 1024} KiB, CPU copy engine, {args.reps} reps (median; worst)\n")
    print("| call | wall ms | GC passes gen 0 / 1 / 2 per call | longest GC pass ms | GIL wait p99 / max ms |")
    print("| --- | ---: | --- | ---: | --- |")
    for name, got in rows.items():
        wall = statistics.median(dt for dt, _ in got) * 1e3
        counts = "; ".join(" / ".join(map(str, pr.counts)) for _, pr in got)
        longest = max(pr.longest for _, pr in got) * 1e3
        late = [x for _, pr in got for x in pr.late]
        print(f"| {name} | {wall:.1f} | {counts} | {longest:.2f} | "
              f"{np.percentile(late, 99) * 1e3:.2f} / {max(late) * 1e3:.2f} |")


if __name__ == "__main__":
    main()
