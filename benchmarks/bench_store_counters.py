"""The hot-path cost of store-wide live counters (``<store>/counters``), side by side in one run.

Two instances of the same kind of store in one process: one with its store-wide counter row (as
every writer has), one with it detached (``_store_sink = None``: the in-process counters only,
as before).  Each side reads the same warm pages with ``read`` (one page per call) and
``read_many`` (64 per call), and stores pages with ``put``, in alternating rounds; the table gives
the median per-page time of each side and their ratio.

Usage: ``python3 benchmarks/bench_store_counters.py [--pages 2000] [--rounds 5] [--provider mmap]``
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import tempfile
import time
from typing import Any

import hostkv_providers as hk

PAGE = 16 << 10


def _key(tag: str, i: int) -> bytes:
    return hashlib.sha256(f"{tag}/{i}".encode()).digest()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pages", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--provider", default="mmap", choices=["mmap", "lmdb"])
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        url = f"{a.provider}://{d}/%s?budget=1GiB" + ("&slot=16KiB" if a.provider == "mmap" else "")
        sides: dict[str, Any] = {"counted": hk.open(url % "on"), "detached": hk.open(url % "off")}
        sides["detached"]._store_sink = None  # the in-process counters only
        data = bytes(PAGE)
        keys = [_key("k", i) for i in range(a.pages)]
        for p in sides.values():
            for k in keys:
                p.put(k, None, data)
        times: dict[tuple[str, str], list[float]] = {}
        buf = bytearray(PAGE)
        outs = [bytearray(PAGE) for _ in range(64)]
        for r in range(a.rounds):
            for name, p in sides.items():
                t0 = time.perf_counter()
                for k in keys:
                    p.read(k, buf)
                times.setdefault(("read", name), []).append((time.perf_counter() - t0) / len(keys))
                if isinstance(p, hk.providers.SupportsBatch):
                    t0 = time.perf_counter()
                    for i in range(0, len(keys), 64):
                        p.read_many(keys[i:i + 64], outs[: len(keys[i:i + 64])])
                    times.setdefault(("read_many(64)", name), []).append((time.perf_counter() - t0) / len(keys))
                fresh = [_key(f"w{r}", i) for i in range(a.pages // 4)]
                t0 = time.perf_counter()
                for k in fresh:
                    p.put(k, None, data)
                times.setdefault(("put", name), []).append((time.perf_counter() - t0) / len(fresh))
        print(f"| {a.provider}, {PAGE >> 10} KiB pages | with store-wide row (us/page) | detached (us/page) | ratio |")
        print("| --- | --- | --- | --- |")
        for op in ("read", "read_many(64)", "put"):
            if (op, "counted") not in times:
                continue
            on = statistics.median(times[(op, "counted")]) * 1e6
            off = statistics.median(times[(op, "detached")]) * 1e6
            print(f"| {op} | {on:.2f} | {off:.2f} | {on / off:.3f} |")
        # the add itself, isolated from the medium, beside the in-process counting the front
        # already does per read (two dict adds): what one read() adds
        sink = sides["counted"]._store_sink
        counts = {"hits": 0, "bytes_read": 0}
        n = 200_000
        add: list[float] = []
        dict_add: list[float] = []
        for _ in range(a.rounds):
            t0 = time.perf_counter()
            for _ in range(n):
                sink.add_hit(PAGE)
            t1 = time.perf_counter()
            for _ in range(n):
                counts["hits"] += 1
                counts["bytes_read"] += PAGE
            t2 = time.perf_counter()
            add.append((t1 - t0) / n)
            dict_add.append((t2 - t1) / n)
        on, off = statistics.median(add) * 1e6, statistics.median(dict_add) * 1e6
        print(f"| one hit's store-wide add (add_hit) vs the front's dict adds, alone | {on:.3f} | {off:.3f} "
              f"| {on / off:.2f} |")
        for p in sides.values():
            p.close()


if __name__ == "__main__":
    main()
