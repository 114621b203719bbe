"""Restore paths side by side in one process (issue 14): how steadily each of the CUDA engine's
ways of moving a 13.4 GB chain from ``pinned://`` into an engine's blocks runs, restores by the
paths in turn for ``--seconds`` so that every path sees the same machine:

* ``batch``: ``direct="batch"`` (the default) into vLLM's ``[2, blocks, ...]`` per layer: one
  ``cuMemcpyBatchAsync`` copy of 32 KiB per page and plane;
* ``batch64``: the same engine into FlashInfer's ``[blocks, 2, ...]`` (K and V of a block
  adjacent): half the copies, of 64 KiB;
* ``auto``: ``direct="auto"``, one 2D copy per plane and run of consecutive blocks (32 KiB rows);
* ``staged``: ``direct="never"``, large DMAs into staging buffers and the scatter kernel;
* ``shared``: ``direct="shared"``, batch copies from the back and the staging path from the front;
* ``scattered``: ``batch`` into a shuffled block table (no run of consecutive blocks);
* ``before``: ``batch`` with ``before=`` a stream of the caller's (the stream gated on a flag until
  the copies are done, as an engine orders its prefill), timed until an event recorded on that
  stream after the call has completed.

Each restore is timed from the call until the host has waited for it (views taken beforehand);
every path's first restore is checked byte for byte on sampled blocks of every layer.  Reports
best / median / worst per path against a bulk pinned copy of 4 GiB measured in the same run.

    python3 benchmarks/bench_restore_paths.py [--seconds 25] [--pages 6400] [--paths ...] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import numpy as np
from bench_engine import CACHE_KW, DIM, HEADS, LAYERS, TOKENS, bulk, scattered

import hostkv_providers as hk
from hostkv_providers.cache import HostKVCache, paged_planes
from hostkv_providers.device import CudaCopyEngine, KVPlanes

PATHS = ("batch", "batch64", "auto", "staged", "shared", "scattered", "before")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=25.0, help="how long the paths take turns")
    ap.add_argument("--pages", type=int, default=6400, help="chain length (6,400 pages of 2 MiB = 13.42 GB)")
    ap.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated, of {PATHS}")
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    paths = args.paths.split(",")
    unknown = set(paths) - set(PATHS)
    if unknown:
        ap.error(f"unknown paths {sorted(unknown)}")
    import torch

    layout = hk.KVLayout(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM, page_tokens=TOKENS, dtype="bfloat16")
    n, P = args.pages, layout.page_nbytes
    nblocks = 2 * n + 8
    caches = [torch.empty((2, nblocks, TOKENS, HEADS, DIM), dtype=torch.bfloat16, device="cuda")
              for _ in range(LAYERS)]
    for c in caches:
        c.view(torch.uint8).random_(0, 256)
    planes = KVPlanes.from_torch(layout, paged_planes(layout, caches))
    # FlashInfer's layout, seen as [2, blocks, ...] (strided) like the pool above
    caches64 = ([torch.zeros((nblocks, 2, TOKENS, HEADS, DIM), dtype=torch.bfloat16, device="cuda").transpose(0, 1)
                 for _ in range(LAYERS)] if "batch64" in paths else [])
    planes64 = KVPlanes.from_torch(layout, paged_planes(layout, caches64)) if caches64 else None
    provider = hk.open(f"pinned://?budget={n * P + (64 << 20)}&block={P}&background=false")
    engines = {mode: CudaCopyEngine(0, direct=mode) for mode in ("batch", "auto", "never", "shared")}
    cache = HostKVCache(provider, hk.Salt("bench/paths", layout), engines["batch"], **CACHE_KW)
    keys = cache.keys(np.arange(n * TOKENS) % 50_000 + 7)
    src, dst = list(range(n)), list(range(n, 2 * n))
    dst_s = scattered(dst)
    assert cache.save(keys, planes, src).wait().stored == n
    torch.cuda.synchronize()
    rows: dict[str, list[float]] = {p: [] for p in paths}
    ok: dict[str, bool] = {}
    gated = torch.cuda.Stream()  # the "before" path's stand-in for an engine's stream
    with provider.lease(keys) as lease:
        pages = provider.view_pages(lease, keys)
        assert pages is not None
        end = time.perf_counter() + args.seconds
        while time.perf_counter() < end:
            for path in paths:
                ids = dst_s if path == "scattered" else dst
                pool = caches64 if path == "batch64" else caches
                if path not in ok:
                    for c in pool:  # poisoned first: the check sees this restore's bytes
                        c[:, ids] = 0
                torch.cuda.synchronize()
                t = time.perf_counter()
                engine = engines[{"staged": "never", "auto": "auto", "shared": "shared"}.get(path, "batch")]
                target = planes64 if path == "batch64" else planes
                assert target is not None
                if path == "before":
                    h = engine.restore(pages, target, ids, before=gated)
                    behind = torch.cuda.Event()
                    behind.record(gated)
                    assert h.wait(timeout=60)
                    behind.synchronize()
                else:
                    assert engine.restore(pages, target, ids).wait(timeout=60)
                rows[path].append((time.perf_counter() - t) * 1e3)
                if path not in ok:
                    ok[path] = same(torch, caches, pool, src, ids)
    link = bulk(torch, 4 << 30)
    h2d_ms = n * P / (link["h2d_gbps"] * 1e9) * 1e3
    out: dict[str, Any] = {"argv": sys.argv, "pages": n, "gb": round(n * P / 1e9, 2), "bulk": link,
                           "bulk_h2d_ms": round(h2d_ms, 1), "bytes_ok": ok, "paths": {}}
    lines = [f"Restores of {n * P / 1e9:.2f} GB from pinned:// by path, in turn for {args.seconds:g} s "
             f"(bulk H2D {link['h2d_gbps']} GB/s = {h2d_ms:.1f} ms for the chain).", "",
             "| path | restores | best / median / worst ms | median x bulk | bytes |",
             "| --- | --- | --- | --- | --- |"]
    for path, ms in rows.items():
        med = statistics.median(ms)
        out["paths"][path] = {"ms": [round(x, 1) for x in ms], "best": round(min(ms), 1), "median": round(med, 1),
                              "worst": round(max(ms), 1), "median_x_bulk": round(h2d_ms / med, 3)}
        lines.append(f"| {path} | {len(ms)} | {min(ms):.1f} / {med:.1f} / {max(ms):.1f} | "
                     f"{h2d_ms / med:.3f}x | {'ok' if ok.get(path) else 'WRONG'} |")
    text = "\n".join(lines) + "\n"
    print(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_restore_paths.json"), "w") as f:
        json.dump(out, f, indent=1)
    with open(os.path.join(args.out, "bench_restore_paths.md"), "w") as f:
        f.write(text)
    cache.close()
    for e in engines.values():
        e.close()
    provider.close()
    return 0 if all(ok.values()) else 1


def same(torch: Any, caches: list[Any], pool: list[Any], src: list[int], ids: list[int]) -> bool:
    """Sampled pages (first, middle, last) of every layer: ``pool``'s blocks ``ids[i]`` hold what
    the source pool's blocks ``src[i]`` held (compared as integers: random bf16 bytes hold NaNs)."""
    torch.cuda.synchronize()
    n = len(ids)
    return all(torch.equal(a.view(torch.int16)[:, src[i]], b.view(torch.int16)[:, ids[i]])
               for a, b in zip(caches, pool, strict=True) for i in (0, 1, n // 2, n - 1))


if __name__ == "__main__":
    sys.exit(main())
