"""Tensor-parallel ranks saving and restoring their head slices of one chain through one shared
``lmdb://`` store, one process per rank, at the same time.

    python3 benchmarks/bench_tp.py [--pages 1024] [--world 2] [--dir DIR] [--out DIR]
    python3 benchmarks/bench_tp.py --tokens 102407         # the engine-path issue's chain
    python3 benchmarks/bench_tp.py --device cpu --pages 64  # smoke run, no GPU

Layout: Llama-3-8B-like bf16 KV (32 layers x K/V x 8 KV heads x 128 dims, 16-token pages:
2 MiB per whole page); rank ``r`` of ``w`` holds heads ``[r*8/w, (r+1)*8/w)`` (1 MiB per page at
w = 2) in vLLM-style per-layer ``[2, blocks, 16, heads, 128]`` caches, filled from one seeded
whole-model tensor so the slices side by side are the whole KV.  Rank ``r`` uses GPU
``r % device_count``: one GPU per rank on a host with ``w`` GPUs, all ranks sharing one GPU
(and its one host link) otherwise.

Phases, in one run:

1. ``bulk``: this process's raw bulk copies of the same bytes between the GPU and pinned host
   memory (device->host, host->device; best of 3): the link's rate, the ratios' denominator.
2. ``world=1``: one process saves the whole chain (every head) through ``HostKVCache.save`` into
   the store; a new process (a restart) restores it (``lookup`` + ``restore``).
3. ``world=w``: ``w`` rank processes save their slices at the same moment (a barrier), exit; ``w``
   new ones look up (``lookup_ranks``: the prefix every rank has) and restore at the same moment.
   Aggregate GB/s = all ranks' bytes / (last end - first start).

Restored blocks are compared byte for byte with the source data, regenerated on the device.
Restores read a warm page cache (the store was just written).  Results print as a markdown
table and go to ``bench_tp.json`` in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import hostkv_providers as hk

LAYOUT = hk.KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, page_tokens=16, dtype="bfloat16")
MODEL = "bench/llama-3-8b-like"
T0 = time.perf_counter()


def log(*args: object) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s]", *args, file=sys.stderr, flush=True)


def salt(rank: int, world: int) -> hk.Salt:
    return hk.Salt(MODEL, LAYOUT, tp_rank=rank, tp_world_size=world)


def tokens(n: int) -> Any:
    import numpy as np

    return np.random.default_rng(1).integers(0, 128_000, size=n)


def url(path: str, budget: int) -> str:
    return f"lmdb://{path}?budget={budget}"


# -- one rank's process -------------------------------------------------------------------------

class RankPlanes:
    """The rank's slice of the whole model's KV: per layer a ``[2, blocks, 16, heads, 128]``
    cache; ``fill`` writes the seeded whole-model values of the rank's heads."""

    def __init__(self, torch: Any, s: hk.Salt, blocks: int, device: str) -> None:
        from hostkv_providers.cache import paged_planes
        from hostkv_providers.device import KVPlanes

        self.torch, self.salt, self.blocks, self.device = torch, s, blocks, device
        lay = s.local_layout
        self.caches = [torch.zeros((2, blocks, lay.page_tokens, lay.num_kv_heads, lay.head_dim),
                                   dtype=torch.bfloat16, device=device) for _ in range(lay.num_layers)]
        self.tensors = paged_planes(lay, [c[0] for c in self.caches], [c[1] for c in self.caches])
        self.kv = KVPlanes.from_torch(lay, self.tensors)

    def whole_layer(self, layer: int) -> Any:
        """Layer ``layer`` of the whole model (every head), regenerated from its seed."""
        torch = self.torch
        g = torch.Generator(device=self.device).manual_seed(1000 + layer)
        shape = (2, self.blocks, LAYOUT.page_tokens, LAYOUT.num_kv_heads, LAYOUT.head_dim)
        return torch.randn(shape, generator=g, device=self.device, dtype=torch.float32).to(torch.bfloat16)

    def fill(self) -> None:
        h = self.salt.kv_heads
        for i, c in enumerate(self.caches):
            c.copy_(self.whole_layer(i)[:, :, :, h.start : h.stop, :])

    def equal(self, pages: int) -> bool:
        h = self.salt.kv_heads
        return all(bool(self.torch.equal(c[:, :pages], self.whole_layer(i)[:, :pages, :, h.start : h.stop, :]))
                   for i, c in enumerate(self.caches))


def worker(args: argparse.Namespace) -> None:
    """``--worker save|restore``: set up, print ``ready``, wait for ``go``, run, print the result."""
    import torch

    from hostkv_providers.cache import HostKVCache
    from hostkv_providers.device import CpuCopyEngine, default_copy_engine

    rank, world = args.rank, args.world
    s = salt(rank, world)
    if args.device == "cuda":
        dev = rank % torch.cuda.device_count()
        torch.cuda.set_device(dev)
        device = f"cuda:{dev}"
        engine: Any = default_copy_engine(dev)
        sync: Any = torch.cuda.synchronize
    else:
        device, engine, sync = "cpu", CpuCopyEngine(), (lambda: None)
    pages = args.pages
    planes = RankPlanes(torch, s, pages, device)
    if args.worker == "save":
        planes.fill()
    sync()
    with hk.open(url(args.dir, args.budget)) as p, HostKVCache(p, s, engine) as cache:
        keys = cache.keys(tokens(args.tokens))[:pages]
        rank_keys = [c[:pages] for c in cache.rank_keys(tokens(args.tokens))] if args.worker == "restore" else []
        print("ready", flush=True)
        sys.stdin.readline()
        t_start = time.time()
        if args.worker == "save":
            res = cache.save(keys, planes.kv, list(range(pages))).wait(600)
            t_end = time.time()
            out = {"pages": res.stored, "nbytes": res.nbytes}
        else:
            hit = cache.lookup_ranks(rank_keys) if world > 1 else cache.lookup(keys)
            t_hit = time.time()
            rr = cache.restore(hit, planes.kv, list(range(hit.num_pages))).wait(600)
            sync()
            t_end = time.time()
            out = {"pages": rr.pages, "nbytes": rr.nbytes, "hit_pages": hit.num_pages,
                   "lookup_ms": round((t_hit - t_start) * 1e3, 2), "staged": rr.staged, "viewed": rr.viewed}
    if args.worker == "restore":
        out["bytes_equal"] = planes.equal(pages)
    out.update(rank=rank, world=world, device=device, t_start=t_start, t_end=t_end,
               seconds=round(t_end - t_start, 4), gbps=round(out["nbytes"] / (t_end - t_start) / 1e9, 2))
    print(json.dumps(out), flush=True)


# -- the driver -----------------------------------------------------------------------------------

def ranks_run(args: argparse.Namespace, mode: str, world: int) -> dict[str, Any]:
    """``world`` worker processes of ``mode``, started together; the aggregate and per-rank figures."""
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", mode, "--world", str(world), "--pages",
           str(args.pages), "--tokens", str(args.tokens), "--dir", args.dir, "--budget", str(args.budget),
           "--device", args.device]
    procs = [subprocess.Popen([*cmd, "--rank", str(r)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for r in range(world)]
    for pr in procs:
        assert pr.stdout is not None
        line = pr.stdout.readline().strip()
        if line != "ready":
            raise SystemExit(f"a {mode} worker said {line!r}")
    for pr in procs:  # the barrier: every rank is set up; all start now
        assert pr.stdin is not None
        pr.stdin.write("go\n")
        pr.stdin.flush()
    ranks = []
    for pr in procs:
        assert pr.stdout is not None
        ranks.append(json.loads(pr.stdout.readline()))
        if pr.wait(600) != 0:
            raise SystemExit(f"a {mode} worker exited with {pr.returncode}")
    span = max(r["t_end"] for r in ranks) - min(r["t_start"] for r in ranks)
    nbytes = sum(r["nbytes"] for r in ranks)
    return {"mode": mode, "world": world, "ranks": ranks, "nbytes": nbytes, "seconds": round(span, 4),
            "aggregate_gbps": round(nbytes / span / 1e9, 2)}


def bulk(args: argparse.Namespace) -> dict[str, float]:
    """Raw bulk copies of the chain's bytes (one process, one GPU), best of 3 per direction."""
    import torch

    nbytes = args.pages * LAYOUT.page_nbytes
    chunk = min(nbytes, 1 << 30)
    dev = torch.empty(chunk, dtype=torch.uint8, device="cuda")
    host = torch.empty(chunk, dtype=torch.uint8, pin_memory=True)
    out: dict[str, float] = {}
    for name, dst, src in (("d2h_gbps", host, dev), ("h2d_gbps", dev, host)):
        best = float("inf")
        for _ in range(3):
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(max(1, nbytes // chunk)):
                dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t)
        out[name] = round(max(1, nbytes // chunk) * chunk / best / 1e9, 2)
    del dev, host
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pages", type=int, default=1024, help="pages of the chain (default 1024: 2 GiB)")
    ap.add_argument("--tokens", type=int, default=0, help="prompt tokens (default pages*16 + 7); "
                    "102407 is the engine-path issue's chain (6,400 pages, 13.4 GB)")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--dir", default="", help="where the shared lmdb store goes (default: a temp dir)")
    ap.add_argument("--out", default="")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--worker", choices=("save", "restore"), help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--budget", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.tokens:
        args.pages = args.tokens // LAYOUT.page_tokens
    else:
        args.tokens = args.pages * LAYOUT.page_tokens + 7
    if args.worker:
        worker(args)
        return
    nbytes = args.pages * LAYOUT.page_nbytes
    args.budget = 2 * nbytes + (256 << 20)  # both runs' pages, side by side in one store
    with tempfile.TemporaryDirectory(prefix="bench-tp-", dir=args.dir or None) as d:
        args.dir = os.path.join(d, "kv")
        doc: dict[str, Any] = {"pages": args.pages, "tokens": args.tokens, "page_nbytes": LAYOUT.page_nbytes,
                               "nbytes": nbytes, "world": args.world, "device": args.device}
        if args.device == "cuda":
            import torch

            doc["gpus"] = torch.cuda.device_count()
            doc["gpu_name"] = torch.cuda.get_device_name(0)
            doc["bulk"] = bulk(args)
            log("bulk", doc["bulk"])
        for world in sorted({1, args.world}):
            for mode in ("save", "restore"):
                r = ranks_run(args, mode, world)
                doc[f"{mode}_w{world}"] = r
                log(mode, f"world={world}", f"{r['aggregate_gbps']} GB/s in {r['seconds']} s",
                    [(x["rank"], x["gbps"], x.get("bytes_equal")) for x in r["ranks"]])
        with hk.open(url(args.dir, args.budget)) as p:
            st = p.stats()
            doc["store"] = {"entries": st.entries, "used_bytes": st.used_bytes}
    print_table(doc)
    if args.out:
        with open(os.path.join(args.out, "bench_tp.json"), "w") as f:
            json.dump(doc, f, indent=1)


def print_table(doc: dict[str, Any]) -> None:
    b = doc.get("bulk", {})
    print(f"chain: {doc['pages']} pages x {doc['page_nbytes']} B = {doc['nbytes'] / 1e9:.2f} GB; "
          f"{doc.get('gpus', 0)} GPU(s) {doc.get('gpu_name', doc['device'])}; bulk d2h {b.get('d2h_gbps', '-')} "
          f"GB/s, h2d {b.get('h2d_gbps', '-')} GB/s")
    print("| phase | processes | seconds | aggregate GB/s | x bulk | per rank GB/s | bytes equal |")
    print("| --- | ---: | ---: | ---: | ---: | --- | --- |")
    for world in sorted({1, doc["world"]}):
        for mode, ref in (("save", "d2h_gbps"), ("restore", "h2d_gbps")):
            r = doc[f"{mode}_w{world}"]
            ratio = f"{r['aggregate_gbps'] / b[ref]:.2f}x" if ref in b else "-"
            eq = "-" if mode == "save" else str(all(x["bytes_equal"] for x in r["ranks"]))
            print(f"| {mode} | {world} | {r['seconds']:.2f} | {r['aggregate_gbps']:.2f} | {ratio} | "
                  f"{', '.join(str(x['gbps']) for x in r['ranks'])} | {eq} |")


if __name__ == "__main__":
    main()
