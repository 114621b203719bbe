"""HostKVCache end to end on a GPU: a 118,828-token Llama-3-8B-like int8 KV saved and restored.

    python3 benchmarks/bench_cache.py [--tokens 118828] [--reps 5] [--out DIR] [--slow-dir DIR]
    python3 benchmarks/bench_cache.py --device cpu --tokens 2048      # smoke run, no GPU

Layout: 32 layers, K and V, 8 KV heads, head dim 128, int8 codes plus float32 per-(token, head)
scales as extra planes (``paged_planes`` over vLLM-style per-layer ``[2, blocks, 16, 8, 128]``
caches), 16-token pages: 7,426 full pages of 1,081,344 bytes (8.03 GB).  Phases:

1. ``pinned``: save every page through ``HostKVCache.save`` (device → pinned arena), then
   ``lookup`` + ``restore`` into other blocks ``--reps`` times (wall time from ``lookup`` to the
   restore handle's ``wait()``), bytes checked on the device against the source blocks.  The
   field's figure to beat: 422 ms for this restore.
2. ``decode``: a launch-heavy, memory-bound decode-like loop (32 layers x 3 GEMVs on distinct
   4096x4096 bf16 weights plus element-wise ops, host-synchronised every step like a sampler) —
   time between tokens alone, then while a full 8 GB save of a new prompt runs.
3. ``tiered``: pinned over mmap or lmdb (``--slow``, ``--slow-dir``): save (lands in pinned memory), restore from
   the fast tier while the write-back runs, the write-back's rate, then a "restart" (a new
   TieredProvider over the same slow store, empty fast tier): index rebuild, restore from the
   slow tier (staged reads, promoting), restore again (now from the fast tier).

Results print as a markdown table and go to ``bench_cache.json`` / ``bench_cache.md`` in ``--out``.
A phase is skipped (and says so) when the ``--budget-s`` wall-clock budget would be exceeded.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from typing import Any

import numpy as np
from _files import data_files, read_prefix, store_files

import hostkv_providers as hk
from hostkv_providers.cache import HostKVCache, paged_planes
from hostkv_providers.device import CpuCopyEngine, KVPlanes, default_copy_engine
from hostkv_providers.providers import TieredProvider

FIELD_MS = 422.0
T0 = time.perf_counter()


def log(*args: object) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s]", *args, flush=True)


class Planes:
    """vLLM-style per-layer int8 caches + float32 scales on the device, ordered as layout.planes."""

    def __init__(self, torch: Any, layout: hk.KVLayout, nblocks: int, device: str) -> None:
        self.codes, self.scales = [], []
        g = torch.Generator(device=device).manual_seed(0)
        for _ in range(layout.num_layers):
            c = torch.empty((2, nblocks, layout.page_tokens, layout.num_kv_heads, layout.head_dim),
                            dtype=torch.int8, device=device)
            c.random_(-128, 128, generator=g)
            s = torch.rand((2, nblocks, layout.page_tokens, layout.num_kv_heads), dtype=torch.float32,
                           device=device, generator=g)
            self.codes.append(c)
            self.scales.append(s)
        self.tensors = paged_planes(layout, [c[0] for c in self.codes], [c[1] for c in self.codes],
                                    key_scales=[s[0] for s in self.scales], value_scales=[s[1] for s in self.scales])
        self.kv = KVPlanes.from_torch(layout, self.tensors)

    def same(self, torch: Any, src: list[int], dst: list[int]) -> bool:
        dev = self.tensors[0].device
        a = torch.tensor(src, device=dev)
        b = torch.tensor(dst, device=dev)
        return all(bool(torch.equal(t.index_select(0, a), t.index_select(0, b))) for t in self.tensors)


def restore_once(torch: Any, cache: HostKVCache, keys: list[hk.Key], planes: Planes, dst: list[int],
                 sync: Any) -> dict[str, float]:
    sync()
    t0 = time.perf_counter()
    hit = cache.lookup(keys)
    t1 = time.perf_counter()
    h = cache.restore(hit, planes.kv, dst[: hit.num_pages])
    res = h.wait(600)
    sync()
    t2 = time.perf_counter()
    return {"pages": res.pages, "nbytes": res.nbytes, "lookup_ms": (t1 - t0) * 1e3, "total_ms": (t2 - t0) * 1e3,
            "gbps": res.nbytes / (t2 - t0) / 1e9, "viewed": res.viewed, "staged": res.staged}


def open_slow(url: str) -> hk.Provider:
    """The slow tier, built from its class directly (works without the package's entry points,
    i.e. with ``PYTHONPATH`` instead of an installed distribution)."""
    scheme, location, options = hk.providers.parse_url(url)
    if scheme == "mmap":
        from hostkv_providers.providers import MmapProvider

        return MmapProvider.from_url(location, options)
    from hostkv_providers.providers import LmdbProvider

    return LmdbProvider.from_url(location, options)


def drop_page_cache(root: str) -> None:
    """fsync and evict every file of a store from the page cache (unmapped pages only)."""
    for path in store_files(root):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def raw_read_files(root: str, limit: int) -> dict[str, float]:
    """GB/s of reading the first ``limit`` bytes of the store's data files (where a fresh store's
    slots are: the rest is preallocated, unwritten space that reads as zeros without any I/O) with
    16 MiB ``readv`` calls, cold then warm."""
    buf = bytearray(16 << 20)
    out: dict[str, float] = {}
    data = data_files(root)
    for label in ("cold_gbps", "warm_gbps"):
        if label == "cold_gbps":
            drop_page_cache(root)
        n, seconds = read_prefix(data, limit, buf)
        out[label] = round(n / seconds / 1e9, 2)
        out["gb"] = round(n / 1e9, 2)
    return out


def summarize(runs: list[dict[str, float]]) -> dict[str, Any]:
    tot = [r["total_ms"] for r in runs]
    return {"runs": runs, "best_ms": min(tot), "median_ms": statistics.median(tot),
            "best_gbps": max(r["gbps"] for r in runs), "pages": runs[0]["pages"], "nbytes": runs[0]["nbytes"]}


def decode_loop(torch: Any, device: str, hidden: int, layers: int) -> tuple[Any, Any]:
    """A launch-heavy, memory-bound decode-like step (distinct weights per layer, host sync)."""
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    ws = [torch.randn(3, hidden, hidden, device=device, dtype=dt) * 0.01 for _ in range(layers)]
    x0 = torch.randn(1, hidden, device=device, dtype=dt)
    stream = torch.cuda.Stream() if device == "cuda" else None

    def step() -> None:
        ctx = torch.cuda.stream(stream) if stream is not None else _null()
        with ctx:
            x = x0
            for w in ws:
                a = x @ w[0]
                b = torch.nn.functional.silu(x @ w[1])
                x = x + (a * b) @ w[2]
                x = x / (x.float().pow(2).mean().sqrt().to(x.dtype) + 1)
        if stream is not None:
            stream.synchronize()  # the sampler needs the logits: one host sync per token

    return step, stream


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def tbt(step: Any, n: int | None = None, until: Any = None, max_steps: int = 100000) -> list[float]:
    out: list[float] = []
    while True:
        t0 = time.perf_counter()
        step()
        out.append((time.perf_counter() - t0) * 1e3)
        if n is not None and len(out) >= n:
            return out
        if until is not None and until():
            return out
        if len(out) >= max_steps:
            return out


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def tbt_stats(xs: list[float]) -> dict[str, float]:
    return {"steps": len(xs), "p50_ms": pct(xs, 0.5), "p90_ms": pct(xs, 0.9), "p99_ms": pct(xs, 0.99),
            "max_ms": max(xs), "mean_ms": statistics.fmean(xs)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=118_828)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--slow", choices=("mmap", "lmdb"), default="mmap", help="the tiered provider's slow tier")
    ap.add_argument("--slow-dir", default="/tmp/hostkv-bench-slow")
    ap.add_argument("--budget-s", type=float, default=330.0, help="skip phases that would run past this")
    ap.add_argument("--decode-hidden", type=int, default=4096)
    ap.add_argument("--decode-layers", type=int, default=32)
    ap.add_argument("--skip", default="", help="comma-separated phases to skip: pinned,decode,tiered,restart")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        log("no CUDA device: use --device cpu for a smoke run")
        return 2
    layout = hk.KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, page_tokens=16, dtype="int8",
                         scale_dtype="float32")
    if args.device == "cpu":
        layout = hk.KVLayout(num_layers=4, num_kv_heads=2, head_dim=128, page_tokens=16, dtype="int8",
                             scale_dtype="float32")
    salt = hk.Salt("bench/llama-3-8b-like", layout, quantization="int8-per-token-head")
    page = layout.page_nbytes
    block = -(-page // 4096) * 4096
    n_pages = args.tokens // layout.page_tokens
    nblocks = 2 * n_pages + 8
    r: dict[str, Any] = {"slow": args.slow, "tokens": args.tokens, "pages": n_pages, "page_nbytes": page,
                         "kv_nbytes": n_pages * page, "device": args.device}
    sync: Any = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    if args.device == "cuda":
        r["gpu"] = torch.cuda.get_device_name(0)
    log(f"{n_pages} pages x {page} B = {n_pages * page / 1e9:.2f} GB; allocating {nblocks} blocks")
    planes = Planes(torch, layout, nblocks, args.device)
    sync()
    engine = default_copy_engine() if args.device == "cuda" else CpuCopyEngine()
    r["engine"] = type(engine).__name__ + (f"/{engine.mode}" if hasattr(engine, "mode") else "")
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 128_000, size=args.tokens)
    t = time.perf_counter()
    keys = hk.chain_keys(salt, tokens)
    r["keys_ms"] = (time.perf_counter() - t) * 1e3
    src = list(range(n_pages))
    dst = list(range(n_pages, 2 * n_pages))
    out_dir = args.out
    os.makedirs(out_dir, exist_ok=True)

    def dump() -> None:
        with open(os.path.join(out_dir, "bench_cache.json"), "w") as f:
            json.dump(r, f, indent=1, default=str)

    def left() -> float:
        return float(args.budget_s) - (time.perf_counter() - T0)

    # -- 1. pinned ---------------------------------------------------------------------------
    budget = n_pages * block + 64 * block
    t = time.perf_counter()
    pinned = hk.providers.PinnedProvider(budget, block=block, chunk=256 * block)
    r["pinned_alloc_s"] = time.perf_counter() - t
    r["pinned_is_pinned"] = pinned.describe()["pinned"]
    log(f"pinned provider: {budget / 1e9:.2f} GB in {r['pinned_alloc_s']:.2f} s (pinned={r['pinned_is_pinned']})")
    cache = HostKVCache(pinned, salt, engine, chunk_pages=256)
    if "pinned" not in skip:
        sync()
        t = time.perf_counter()
        h = cache.save(keys, planes.kv, src)
        t_issue = time.perf_counter() - t
        h.wait_copied(600)
        t_copied = time.perf_counter() - t
        res = h.wait(600)
        t_done = time.perf_counter() - t
        r["pinned_save"] = {"issue_ms": t_issue * 1e3, "copied_s": t_copied, "sealed_s": t_done,
                            "stored": res.stored, "gbps": res.nbytes / t_done / 1e9}
        log(f"save: {res.stored} pages, device blocks free after {t_copied:.2f} s, sealed after {t_done:.2f} s")
        runs = [restore_once(torch, cache, keys, planes, dst, sync) for _ in range(args.reps)]
        r["pinned_restore"] = summarize(runs)
        r["pinned_restore"]["bytes_equal"] = planes.same(torch, src, dst)
        log(f"restore from pinned: best {r['pinned_restore']['best_ms']:.1f} ms, median "
            f"{r['pinned_restore']['median_ms']:.1f} ms, bytes equal {r['pinned_restore']['bytes_equal']}")
        dump()

    # -- 2. decode loop vs a concurrent save -------------------------------------------------
    if "decode" not in skip and left() > 60:
        hidden = args.decode_hidden if args.device == "cuda" else 256
        step, _ = decode_loop(torch, args.device, hidden, args.decode_layers if args.device == "cuda" else 4)
        tbt(step, n=30)  # warm up
        base = tbt(step, n=300)
        keys2 = hk.chain_keys(salt, rng.integers(0, 128_000, size=args.tokens))
        sync()
        t = time.perf_counter()
        h = cache.save(keys2, planes.kv, src)
        issue_ms = (time.perf_counter() - t) * 1e3
        during = tbt(step, until=h.done)
        res = h.wait(600)
        save_s = time.perf_counter() - t
        after = tbt(step, n=300)
        r["decode"] = {"hidden": hidden, "baseline": tbt_stats(base), "during_save": tbt_stats(during),
                       "after": tbt_stats(after), "save_s": save_s, "save_issue_ms": issue_ms,
                       "save_stored": res.stored}
        log(f"TBT p50/p99 ms: alone {pct(base, .5):.2f}/{pct(base, .99):.2f}, during a full save "
            f"{pct(during, .5):.2f}/{pct(during, .99):.2f} ({len(during)} steps, save {save_s:.2f} s)")
        dump()
    cache.close()

    # -- 3. tiered: pinned over mmap/lmdb ----------------------------------------------------------
    if "tiered" not in skip and left() > 60:
        pinned.evict(nbytes=pinned.budget_bytes)  # the fast tier starts empty
        shutil.rmtree(args.slow_dir, ignore_errors=True)
        slow_budget = 2 * budget
        slow_url = f"{args.slow}://{args.slow_dir}?budget={slow_budget}"
        if args.slow == "mmap":
            slow_url += f"&slot={block}"  # one slot per page (the default slot may round pages up)
        slow = open_slow(slow_url)
        tiered = TieredProvider(pinned, slow, budget_bytes=budget, queue_pages=n_pages + 64, own_tiers=False)
        tc = HostKVCache(tiered, salt, engine, chunk_pages=256)
        sync()
        t = time.perf_counter()
        res = tc.save(keys, planes.kv, src).wait(600)
        save_s = time.perf_counter() - t
        r["tiered_save"] = {"sealed_s": save_s, "stored": res.stored, "gbps": res.nbytes / save_s / 1e9}
        log(f"tiered save: {res.stored} pages in {save_s:.2f} s (write-back running)")
        runs = [restore_once(torch, tc, keys, planes, dst, sync) for _ in range(args.reps)]
        r["tiered_restore_fast"] = summarize(runs)
        r["tiered_restore_fast"]["bytes_equal"] = planes.same(torch, src, dst)
        r["tiered_restore_fast"]["write_back_pending_after"] = tiered.stats().extra["pending_write_back"]
        log(f"restore from the fast tier: best {r['tiered_restore_fast']['best_ms']:.1f} ms")
        dump()
        flush_budget = max(5.0, left() - 75)
        t = time.perf_counter()
        flushed = tiered.flush(flush_budget)
        wb_s = time.perf_counter() - t + save_s
        st = tiered.stats().extra
        r["write_back"] = {"complete": flushed, "pages": st["write_backs"], "seconds_since_save": wb_s,
                           "gbps": st["write_backs"] * page / wb_s / 1e9}
        log(f"write-back: {st['write_backs']} pages, complete={flushed}, {r['write_back']['gbps']:.2f} GB/s")
        if left() > 40:
            r["tiered_restore_idle"] = summarize([restore_once(torch, tc, keys, planes, dst, sync)
                                                  for _ in range(args.reps)])
            log(f"restore from the fast tier, write-back idle: best {r['tiered_restore_idle']['best_ms']:.1f} ms")
        tc.close()
        dump()
        if "restart" not in skip and flushed and left() > 30:
            # "restart": a new tiered provider over the same slow store, empty fast tier
            tiered.close()
            slow.close()
            pinned.evict(nbytes=pinned.budget_bytes)
            # The raw baseline: the slow store's files read sequentially, cold (evicted from the
            # page cache first) and then warm, so the restore below reads as a ratio to them.
            r["raw_slow_read"] = raw_read_files(args.slow_dir, n_pages * page)
            log(f"raw read of the slow store's files: {r['raw_slow_read']}")
            drop_page_cache(args.slow_dir)
            t = time.perf_counter()
            slow = open_slow(slow_url)
            tiered2 = TieredProvider(pinned, slow, budget_bytes=budget, queue_pages=n_pages + 64, own_tiers=False)
            r["restart_open_s"] = time.perf_counter() - t
            tc2 = HostKVCache(tiered2, salt, engine, chunk_pages=256)
            cold = restore_once(torch, tc2, keys, planes, dst, sync)
            r["tiered_restore_slow"] = cold
            r["tiered_restore_slow"]["bytes_equal"] = planes.same(torch, src, dst)
            r["tiered_restore_slow"]["promotions"] = tiered2.stats().extra["promotions"]
            log(f"after restart: open {r['restart_open_s']:.2f} s, restore from {args.slow} {cold['total_ms']:.0f} ms "
                f"({cold['staged']} staged pages, bytes equal {r['tiered_restore_slow']['bytes_equal']})")
            dump()
            if left() > 10:
                try:
                    r["tiered_restore_promoted"] = summarize(
                        [restore_once(torch, tc2, keys, planes, dst, sync) for _ in range(max(1, args.reps // 2))])
                    r["tiered_restore_promoted"]["bytes_equal"] = planes.same(torch, src, dst)
                except Exception as exc:  # record it and still print every other figure
                    r["tiered_restore_promoted_error"] = repr(exc)
                    log(f"restore after promotion failed: {exc!r}")
            tc2.close()
        dump()
    text = render(r)
    print(text)
    with open(os.path.join(out_dir, "bench_cache.md"), "w") as f:
        f.write(text)
    dump()
    sys.stdout.flush()
    os._exit(0)  # do not wait for tier finalizers or a pending write-back at exit


def render(r: dict[str, Any]) -> str:
    lines = [f"KV: {r['tokens']:,} tokens = {r['pages']:,} pages x {r['page_nbytes']:,} B = "
             f"{r['kv_nbytes'] / 1e9:.2f} GB (int8 codes + float32 scales); engine {r.get('engine')}; "
             f"{r.get('gpu', r['device'])}", "",
             "| restore through HostKVCache (lookup → wait) | best ms | median ms | GB/s (best) | vs field 422 ms "
             "| bytes equal |",
             "| --- | ---: | ---: | ---: | ---: | --- |"]
    for name, label in (("pinned_restore", "pinned provider (zero-copy views)"),
                        ("tiered_restore_fast", "tiered, fast tier (write-back running)"),
                        ("tiered_restore_idle", "tiered, fast tier (write-back done)"),
                        ("tiered_restore_promoted", "tiered after restart, 2nd restore (promoted)")):
        x = r.get(name)
        if x:
            lines.append(f"| {label} | {x['best_ms']:.1f} | {x['median_ms']:.1f} | {x['best_gbps']:.1f} | "
                         f"{FIELD_MS / x['best_ms']:.2f}x | {x.get('bytes_equal', '-')} |")
    x = r.get("tiered_restore_slow")
    if x:
        lines.append(f"| tiered after restart, 1st restore ({r.get('slow')} reads, promoting) | "
                     f"{x['total_ms']:.1f} | - | "
                     f"{x['gbps']:.1f} | {FIELD_MS / x['total_ms']:.2f}x | {x.get('bytes_equal', '-')} |")
    raw = r.get("raw_slow_read")
    if raw and x:
        lines += ["", f"Raw sequential read of the slow store's data files ({raw['gb']:.2f} GB, 16 MiB "
                  f"reads, same run): cold {raw['cold_gbps']:.2f} GB/s, warm {raw['warm_gbps']:.2f} GB/s. The "
                  f"restart's first restore (cold) ran at {x['gbps']:.2f} GB/s = "
                  f"{x['gbps'] / raw['cold_gbps']:.2f}x the cold raw read."]
    lines.append("")
    if "pinned_save" in r:
        s = r["pinned_save"]
        lines.append(f"Save of all pages to pinned: call returned in {s['issue_ms']:.1f} ms, device blocks free "
                     f"after {s['copied_s']:.2f} s, all sealed after {s['sealed_s']:.2f} s ({s['gbps']:.1f} GB/s).")
    if "tiered_save" in r:
        lines.append(f"Tiered save: sealed in the fast tier after {r['tiered_save']['sealed_s']:.2f} s; "
                     f"write-back to {r.get('slow', 'the slow tier')} {r['write_back']['gbps']:.2f} GB/s "
                     f"(complete: {r['write_back']['complete']}); reopen of the store "
                     f"{r.get('restart_open_s', float('nan')):.2f} s.")
    d = r.get("decode")
    if d:
        lines += ["", "| decode loop (time between tokens) | steps | p50 ms | p90 ms | p99 ms | max ms |",
                  "| --- | ---: | ---: | ---: | ---: | ---: |"]
        size = f"{r['kv_nbytes'] / 1e9:.1f} GB"
        for k, label in (("baseline", "alone"), ("during_save", f"during a full save ({size})"), ("after", "after")):
            v = d[k]
            lines.append(f"| {label} | {v['steps']} | {v['p50_ms']:.2f} | {v['p90_ms']:.2f} | {v['p99_ms']:.2f} | "
                         f"{v['max_ms']:.2f} |")
        lines.append(f"\nThe save ran {d['save_s']:.2f} s; `save()` returned to the decode thread in "
                     f"{d['save_issue_ms']:.2f} ms.")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
