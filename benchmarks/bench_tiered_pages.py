"""The tiered provider's per-page cost on the host, beside ``pinned://``: saves and restores
through ``HostKVCache`` (CPU copy engine, no GPU) and the provider's own chain-run seal and
write-back and ``put_many`` of a chain (what the engine adapters call), with the
garbage-collector passes each one set off in the process.

    python3 benchmarks/bench_tiered_pages.py [--pages 6400] [--reps 5] [--dir /tmp]

Pages are 4 KiB (a 2-layer toy layout), so the bytes are small and what is measured is the
Python per page: the objects, lock rounds and queue traffic a save or restore makes for each
page (each surviving object feeds the collector's full passes in an engine's process).  The
fast tier is ``pinned://`` (ordinary memory, ``pin=no``) over ``mmap://`` in ``--dir``; the
``pinned://`` rows use the same fast tier alone; a restart's restore from ``tiered://`` (the
slow tier only) runs beside one from that ``mmap://`` store opened alone.  Sides run in turn,
``--reps`` each; medians.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import tempfile
import time
import urllib.parse
from typing import Any

import numpy as np

import hostkv_providers as hk
from hostkv_providers.cache import HostKVCache
from hostkv_providers.device import CpuCopyEngine
from hostkv_providers.testing import chain

_passes = [0]


def _count(phase: str, info: dict[str, Any]) -> None:
    if phase == "start":
        _passes[0] += 1


def _open(kind: str, root: str, n: int, page: int, fresh: bool = True) -> hk.Provider:
    fast = f"pinned://?budget={4 * n * page}&block={page}&background=false&pin=no"
    slow = f"mmap://{root}/slow?budget={4 * n * page}&slot={page}&durability=none"
    if kind == "pinned":
        return hk.open(fast)
    if kind == "mmap":
        return hk.open(slow)
    if fresh:
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(root)
    q = urllib.parse.quote
    return hk.open(f"tiered://?fast={q(fast, safe='')}&slow={q(slow, safe='')}&queue={n + 64}")


def _restore(prov: hk.Provider, layout: hk.KVLayout, engine: CpuCopyEngine, keys: list[bytes], dst: list[Any],
             src: list[Any]) -> tuple[float, int]:
    n = len(dst[0])
    for x in dst:
        x[:] = 0
    with HostKVCache(prov, hk.Salt("bench-tiered-pages", layout), engine) as cache:
        hit = cache.lookup(keys)
        got = _timed(lambda: cache.restore(hit, dst, list(range(n))).wait())
    assert all(np.array_equal(x, y) for x, y in zip(src, dst, strict=True)), "restored bytes differ"
    return got


def _timed(fn: Any) -> tuple[float, int]:
    _passes[0] = 0
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t, _passes[0]


def _one(kind: str, rep: int, root: str, n: int, layout: hk.KVLayout, engine: CpuCopyEngine,
         src: list[Any], dst: list[Any]) -> dict[str, tuple[float, int]]:
    """One round of one side: a save and a restore through the cache, one chain run through
    the provider alone, and (tiered) a restore after a restart, beside one from the slow tier
    opened alone."""
    page = layout.page_nbytes
    prov = _open(kind, root, n, page)
    tiered = kind == "tiered"
    out: dict[str, tuple[float, int]] = {}
    try:
        cache = HostKVCache(prov, hk.Salt("bench-tiered-pages", layout), engine)
        keys = cache.keys(np.arange(n * 4) % 50_000 + 100_000 * rep)
        out[f"{kind} save (cache)"] = _timed(lambda: cache.save(keys, src, list(range(n))).wait())
        if tiered:
            out[f"{kind} write-back after the save"] = _timed(lambda: prov.flush(300))
        cache.close()
        out[f"{kind} restore (cache)"] = _restore(prov, layout, engine, keys, dst, src)
        pkeys = chain(f"bench-tiered-pages-{kind}-{rep}", n)
        rc = prov.reserve_many(pkeys, [None, *pkeys[:-1]], page)
        rc.mark_written()
        out[f"{kind} run seal (provider)"] = _timed(rc.seal)
        if tiered:
            out[f"{kind} run write-back (provider)"] = _timed(lambda: prov.flush(300))
        # what an engine adapter's saves call: put_many of a chain, 256 pages a call
        mkeys = chain(f"bench-tiered-pages-put-{kind}-{rep}", n)
        blob = np.ascontiguousarray(src[0][0]).tobytes() * len(layout.planes)
        items = [(k, mkeys[i - 1] if i else None, blob) for i, k in enumerate(mkeys)]

        def put_all() -> None:
            for lo in range(0, n, 256):
                assert all(r is True for r in prov.put_many(items[lo: lo + 256]))  # type: ignore[attr-defined]

        out[f"{kind} put_many (provider)"] = _timed(put_all)
        if tiered:
            out[f"{kind} put_many write-back (provider)"] = _timed(lambda: prov.flush(300))
    finally:
        prov.close()
    if tiered:  # a restart: the slow tier alone holds the chain (read, and promoted into the fast tier)
        for side in ("tiered", "mmap"):
            prov = _open(side, root, n, page, fresh=False)
            try:
                out[f"{side} restart restore (cache)"] = _restore(prov, layout, engine, keys, dst, src)
            finally:
                prov.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, default=6400)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    a = ap.parse_args()
    n = a.pages
    layout = hk.KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, page_tokens=4, dtype="float32")
    rng = np.random.default_rng(0)
    src = [rng.standard_normal((n, 4, 2, 32), dtype=np.float32) for _ in layout.planes]
    dst = [np.zeros_like(x) for x in src]
    engine = CpuCopyEngine()
    gc.callbacks.append(_count)
    rows: dict[str, list[tuple[float, int]]] = {}
    root = os.path.join(a.dir, f"bench-tiered-pages-{os.getpid()}")
    try:
        for rep in range(a.reps):
            for kind in ("pinned", "tiered"):
                for name, got in _one(kind, rep, root, n, layout, engine, src, dst).items():
                    rows.setdefault(name, []).append(got)
    finally:
        gc.callbacks.remove(_count)
        engine.close()
        shutil.rmtree(root, ignore_errors=True)
    print(f"{n} pages of {layout.page_nbytes} B, {a.reps} of each, in turn; medians (GC passes: each run's)\n")
    print("| row | ms | GC passes |\n| --- | --- | --- |")
    for name, got in sorted(rows.items(), key=lambda kv: (kv[0].split(" ", 1)[1], kv[0])):
        ms = statistics.median(t for t, _ in got) * 1e3
        print(f"| {name} | {ms:.1f} | {', '.join(str(g) for _, g in got)} |")


if __name__ == "__main__":
    main()
