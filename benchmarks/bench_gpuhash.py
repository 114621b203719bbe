"""The ``xxh3-256k-tree`` page checksum on the GPU against HBM bandwidth and on the host against
XXH3, side by side in one run (issue 14 item 3's feasibility figure).

    python3 benchmarks/bench_gpuhash.py [--pages 6400]

Pages as in bench_engine.py: 64 planes of 32 KiB (2 MiB pages).  GPU: one kernel over all pages
(``PageHasher``), against a device-to-device copy of the same bytes (read + write: the HBM
bandwidth the hash would have to beat).  Host: ``tree_checksum`` of pages against one XXH3-64
call per page, on one core.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import xxhash

from hostkv_providers import KVLayout
from hostkv_providers.device import KVPlanes, PageHasher
from hostkv_providers.providers import tree_checksum


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pages", type=int, default=6400)
    args = ap.parse_args()
    import torch


    layout = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, page_tokens=16, dtype="bfloat16")
    n = args.pages
    tensors = [torch.randint(0, 256, (n, spec.nbytes), dtype=torch.uint8, device="cuda") for spec in layout.planes]
    planes = KVPlanes.from_torch(layout, tensors)
    hasher = PageHasher.get(0)
    s = torch.cuda.current_stream()
    bids = list(range(n))
    hasher.enqueue(planes, bids[:8], s.cuda_stream).roots()  # warm up (compile, load)
    total = n * layout.page_nbytes
    best = 1e9
    for _ in range(5):
        torch.cuda.synchronize()
        t = time.perf_counter()
        dg = hasher.enqueue(planes, bids, s.cuda_stream)
        dg.digests()
        best = min(best, time.perf_counter() - t)
        roots_t = time.perf_counter()
        dg.roots()
        roots_s = time.perf_counter() - roots_t
    dst = torch.empty_like(tensors[0])
    torch.cuda.synchronize()
    t = time.perf_counter()
    for src in tensors:
        dst.copy_(src)
    torch.cuda.synchronize()
    d2d = time.perf_counter() - t
    print(f"GPU hash of {total / 1e9:.2f} GB: {best * 1e3:.2f} ms = {total / best / 1e12:.2f} TB/s; "
          f"roots on the host {roots_s * 1e3:.2f} ms; D2D copy {d2d * 1e3:.2f} ms = {2 * total / d2d / 1e12:.2f} TB/s "
          f"(read+write)")
    host = np.random.default_rng(0).integers(0, 256, size=(64, layout.page_nbytes), dtype=np.uint8)
    for fn, name in ((tree_checksum, "tree"), (xxhash.xxh3_64_intdigest, "xxh3")):
        t = time.perf_counter()
        for _ in range(3):
            for row in host:
                fn(row)
        dt = time.perf_counter() - t
        print(f"host {name}: {3 * host.nbytes / dt / 1e9:.1f} GB/s (one core)")


if __name__ == "__main__":
    main()
