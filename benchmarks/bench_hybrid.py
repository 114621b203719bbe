"""Anchor reads on the admission path: ``lookup(need_anchor=)`` (copies the state while the
scheduler waits) against a hybrid cache's ``lookup()`` (lists anchors only) + ``restore(...,
anchors_into=buffer)`` (reads the state on the restore thread, one copy into the buffer).

    python3 benchmarks/bench_hybrid.py [--state-mib 74] [--repeat 5]

Side by side in one run, per provider (``pinned://`` in memory, ``lmdb://`` in a temp dir): a
4-page chain (tiny pages: the state dominates) with a ``--state-mib`` state at its last page,
saved once under a plain cache and once under a hybrid one (``required_anchors={"state"}``, the
anchor wrapped in its checked record).  Best of ``--repeat`` each; prints a markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import hostkv_providers as hk
from hostkv_providers.cache import HostKVCache
from hostkv_providers.device import CpuCopyEngine, OrdinaryAllocator

LAYOUT = hk.KVLayout(num_layers=1, num_kv_heads=1, head_dim=64, page_tokens=4, dtype="float32")


def best(fn: Callable[[], Any], repeat: int) -> tuple[float, float]:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times), statistics.median(times)


def run(url: str, state: bytes, repeat: int) -> list[tuple[str, float, float]]:
    provider = hk.open(url)
    engine = CpuCopyEngine()
    planes = [np.ones((8, 4, 1, 64), np.float32) for _ in LAYOUT.planes]
    out = [np.zeros_like(p) for p in planes]
    buf = bytearray(len(state))
    rows: list[tuple[str, float, float]] = []
    try:
        plain = HostKVCache(provider, hk.Salt("bench/plain", LAYOUT), engine, staging_allocator=OrdinaryAllocator())
        hyb = HostKVCache(provider, hk.Salt("bench/hybrid", LAYOUT, state_format="bench"), engine,
                          staging_allocator=OrdinaryAllocator(), required_anchors={"state"})
        toks = np.arange(16)
        for c in (plain, hyb):
            t0 = time.perf_counter()
            c.save(c.keys(toks), planes, [0, 1, 2, 3], anchors={3: {"state": state}}).wait(120)
            rows.append((f"save 4 pages + anchor ({'hybrid record' if c is hyb else 'plain'})",
                         time.perf_counter() - t0, float("nan")))
        pk, hk_ = plain.keys(toks), hyb.keys(toks)

        def old_lookup() -> None:
            hit = plain.lookup(pk, need_anchor="state")
            assert hit.anchor is not None and len(hit.anchor) == len(state)
            hit.release()

        def new_lookup() -> None:
            hit = hyb.lookup(hk_)
            assert hit.num_pages == 4
            hit.release()

        def old_total() -> None:
            hit = plain.lookup(pk, need_anchor="state")
            plain.restore(hit, out, [0, 1, 2, 3]).wait(60)
            np.frombuffer(buf, np.uint8)[:] = np.frombuffer(hit.anchor or b"", np.uint8)  # into the engine's buffer

        def new_total() -> None:
            hit = hyb.lookup(hk_)
            res = hyb.restore(hit, out, [0, 1, 2, 3], anchors_into={"state": buf}).wait(60)
            assert res.pages == 4 and res.anchors["state"].nbytes == len(state)

        for name, fn in (("lookup(need_anchor) - plain cache (admission path)", old_lookup),
                         ("lookup() - hybrid cache (admission path)", new_lookup),
                         ("lookup(need_anchor) + restore + copy into buffer - plain", old_total),
                         ("lookup() + restore(anchors_into=buffer) - hybrid", new_total)):
            b, m = best(fn, repeat)
            rows.append((name, b, m))
        plain.close()
        hyb.close()
    finally:
        engine.close()
        provider.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--state-mib", type=float, default=74.0)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)
    nbytes = int(args.state_mib * (1 << 20))
    state = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8).tobytes()
    budget = f"{int(args.state_mib * 3 + 64)}MiB"
    with tempfile.TemporaryDirectory() as tmp:
        urls = [f"pinned://?budget={budget}", f"lmdb://{Path(tmp) / 'store'}?budget={budget}"]
        print(f"state {args.state_mib:g} MiB, best/median of {args.repeat}\n")
        print("| provider | operation | best ms | median ms |\n| --- | --- | ---: | ---: |")
        for url in urls:
            for name, b, m in run(url, state, args.repeat):
                med = "— (1 run)" if m != m else f"{m * 1e3:.1f}"  # NaN: a one-shot row
                print(f"| {url.split(':')[0]} | {name} | {b * 1e3:.1f} | {med} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
