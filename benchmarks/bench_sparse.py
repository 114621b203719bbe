"""Sparse decode benchmark on a CUDA GPU: in-place reads over PCIe vs HBM vs the link, and
fetch-then-attend with a device slot cache at several hit rates, inside captured CUDA graphs.

    python3 benchmarks/bench_sparse.py [--tokens 1048576] [--layers 16] [--select 2048] [--out DIR]

The pool is a latent (MLA-like) cache — ``--layers`` layers, one 576-dim bf16 plane per layer,
16-token pages (18 KiB per layer slice) — of ``--tokens`` tokens, host-resident in a
``pinned://?mapped=yes`` arena (written through the mirror kernel from an HBM copy of the same
bytes).  Each step selects ``--select`` tokens per query per layer (``select / 16`` distinct random
pages per layer, a different set per layer) and:

* **link**: one bulk pinned host→device copy (1 GiB, and one of a step's selection bytes);
* **in place, mapped**: one launch reads every selected page of every layer through the page
  table over PCIe (``PageMover.digest_pages``, the attention-shaped read: all bytes read, one
  word per item written), eager and as a replayed graph;
* **in place, HBM**: the same read of the same pages from the HBM copy (``digest_slots``);
* **fetch**: one launch copies every selected page of every layer into device slots;
* **fetch-then-attend**: a captured graph of ``SlotCache.resolve`` → ``PageMover.fetch`` of the
  misses → ``digest_slots`` of the step's slots, at target hit rates 0 / 50 / 90 % (the measured
  hit rate is reported).

Bytes are checked at the end: the in-place digests of a selection equal the HBM digests and the
graph's digests, and no kernel refused an id.  Writes ``bench_sparse_<layout>.json`` / ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import numpy as np

from hostkv_providers import KVLayout
from hostkv_providers.device import KVPlanes, PageMover, PageTable, SlotCache
from hostkv_providers.providers import MappedPinnedProvider

GiB = 1 << 30


def log(*args: object) -> None:
    print(*args, flush=True)


def timed(torch: Any, fn: Any, reps: int) -> list[float]:
    """Seconds per call of ``fn`` (CUDA events around each call, on the current stream)."""
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / 1e3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=1 << 20)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--select", type=int, default=2048, help="tokens per query per layer")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--cache-factor", type=int, default=4, help="device slots per layer = factor x selected pages")
    ap.add_argument("--layout", choices=("latent-bf16", "fp8-group"), default="latent-bf16",
                    help="latent-bf16: 576-dim bf16 per token and layer; fp8-group: 512 fp8 codes + 4 fp32 "
                         "scales (one per 128 elements) per token and layer, two planes per layer")
    ap.add_argument("--sweep", action="store_true", help="also time launch shapes (CTAs per SM x threads)")
    ap.add_argument("--tokens-granular", action="store_true",
                    help="also read 2,048 single tokens per layer (latent layout only)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()

    import torch

    torch.cuda.init()
    if args.layout == "latent-bf16":
        layout = KVLayout(num_layers=args.layers, num_kv_heads=1, head_dim=576, page_tokens=16, dtype="bfloat16",
                          kinds=("kv",))
    else:
        layout = KVLayout(num_layers=args.layers, num_kv_heads=1, head_dim=512, page_tokens=16,
                          dtype="float8_e4m3fn", kinds=("kv",), scale_dtype="float32", scale_group=128)
    L, page_nbytes = layout.num_layers, layout.page_nbytes
    slice_nbytes = page_nbytes // L  # one layer's planes of one page (codes and scales)
    npages = args.tokens // layout.page_tokens
    width = args.select // layout.page_tokens
    step_bytes = L * width * slice_nbytes
    results: dict[str, Any] = {"layout": layout.describe(), "pages": npages, "page_nbytes": page_nbytes,
                               "pool_bytes": npages * page_nbytes, "selected_pages_per_layer": width,
                               "step_bytes": step_bytes, "gpu": torch.cuda.get_device_name()}
    log(f"pool: {args.tokens} tokens = {npages} pages x {page_nbytes} B = {npages * page_nbytes / GiB:.1f} GiB; "
        f"step reads {L} layers x {width} pages x {slice_nbytes} B = {step_bytes / 1e6:.1f} MB")

    t0 = time.perf_counter()
    p = MappedPinnedProvider(npages * page_nbytes, block=page_nbytes, device=0)
    results["pin_seconds"] = time.perf_counter() - t0
    log(f"mapped arena pinned in {results['pin_seconds']:.1f} s")
    table = p.page_table()

    # The HBM copy: one [pages, slice] tensor per layer, random bytes; mirrored into the host arena.
    hbm = [torch.empty((npages, spec.nbytes), dtype=torch.uint8, device="cuda") for spec in layout.planes]
    g = torch.Generator(device="cuda").manual_seed(1)
    for plane in hbm:
        plane.random_(0, 256, generator=g)
    hbm_planes = KVPlanes.from_torch(layout, hbm)
    chunk = 4096
    mirror_mover = PageMover(layout, hbm_planes, table, width=chunk)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    keys = [i.to_bytes(8, "big") * 4 for i in range(npages)]
    t0 = time.perf_counter()
    kernel_s = 0.0
    for lo in range(0, npages, chunk):
        hi = min(npages, lo + chunk)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(stream)
        h = p.mirror(mirror_mover, [(k, None) for k in keys[lo:hi]], list(range(lo, hi)), after=stream)
        b.record(stream)
        h.wait()
        assert all(x is True for x in h.stored), h.stored[:4]
        kernel_s += a.elapsed_time(b) / 1e3
    wall = time.perf_counter() - t0
    lease = p.lease(keys)
    slot_of = p.slots(lease, keys)
    assert (slot_of >= 0).all()
    # The mirror kernel alone: rewrite the first chunk's pages from the same HBM rows (the bytes
    # are identical, so the sealed entries and their checksums stay valid).
    ids0 = torch.as_tensor(slot_of[:chunk].astype(np.int32), device="cuda")
    src0 = torch.arange(chunk, dtype=torch.int32, device="cuda")
    raw = timed(torch, lambda: mirror_mover.mirror(src0, ids0), 5)[1:]
    results["mirror"] = {"gbps_kernel": chunk * page_nbytes / min(raw) / 1e9,
                         "gbps_issue_to_launch_end": npages * page_nbytes / kernel_s / 1e9,
                         "gbps_with_reserve_and_seal": npages * page_nbytes / wall / 1e9}
    log(f"mirror kernel (pool -> mapped host): {results['mirror']['gbps_kernel']:.1f} GB/s; "
        f"whole path incl. reserve + host checksum + seal: {results['mirror']['gbps_with_reserve_and_seal']:.1f} GB/s")

    # Selections: per step, per layer, `width` distinct pages; banks for each hit-rate target.
    rng = np.random.default_rng(5)
    S = args.steps

    def bank(hit: float) -> np.ndarray:
        out = np.empty((S, L, width), np.int64)
        keep = round(hit * width)
        for s in range(S):
            for r in range(L):
                fresh = rng.choice(npages, width, replace=False)
                if s and keep:
                    prev = out[s - 1, r]
                    fresh = np.concatenate([prev[:keep], np.setdiff1d(fresh, prev[:keep])[: width - keep]])
                    if len(fresh) < width:  # (rare) top up with pages not in the kept set
                        extra = np.setdiff1d(np.arange(npages), fresh)[: width - len(fresh)]
                        fresh = np.concatenate([fresh, extra])
                    fresh = rng.permutation(fresh)
                out[s, r] = fresh
        return out

    pages0 = bank(0.0)
    sel_slots = torch.as_tensor(slot_of[pages0].astype(np.int32), device="cuda")  # arena slots (mapped)
    sel_pages = torch.as_tensor(pages0.astype(np.int32), device="cuda")  # HBM rows

    # -- the link --------------------------------------------------------------------------
    host = torch.empty(GiB, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(GiB, dtype=torch.uint8, device="cuda")
    bulk = timed(torch, lambda: dst.copy_(host, non_blocking=True), 6)[1:]
    bulk_step = timed(torch, lambda: dst[:step_bytes].copy_(host[:step_bytes], non_blocking=True), 20)[2:]
    link = GiB / min(bulk) / 1e9
    results["link"] = {"bulk_1GiB_gbps": link, "bulk_step_gbps": step_bytes / min(bulk_step) / 1e9}
    log(f"bulk H2D: 1 GiB {link:.1f} GB/s; one step's bytes {results['link']['bulk_step_gbps']:.1f} GB/s")

    # -- in place ----------------------------------------------------------------------------
    small = [torch.zeros((2, spec.nbytes), dtype=torch.uint8, device="cuda") for spec in layout.planes]
    small_planes = KVPlanes.from_torch(layout, small)
    inplace = PageMover(layout, small_planes, table, width=width, rows=L, per_layer=True)
    hbm_mover = PageMover(layout, hbm_planes, table, width=width, rows=L, per_layer=True)
    d_map = torch.zeros(L * width, dtype=torch.int64, device="cuda")
    d_hbm = torch.zeros(L * width, dtype=torch.int64, device="cuda")

    def run_steps(fn: Any) -> float:
        fn(0)
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for s in range(S):
            fn(s)
        b.record()
        b.synchronize()
        return a.elapsed_time(b) / 1e3 / S

    rows: list[dict[str, Any]] = []

    def row(name: str, seconds: float, pcie_bytes: float, note: str = "") -> None:
        gbps = step_bytes / seconds / 1e9
        rows.append({"what": name, "us_per_step": seconds * 1e6, "selection_gbps": gbps, "x_link": gbps / link,
                     "pcie_mb_per_step": pcie_bytes / 1e6, "note": note})
        log(f"{name}: {seconds * 1e6:.0f} us/step, {gbps:.1f} GB/s of selection ({gbps / link:.2f}x link) {note}")

    t = run_steps(lambda s: inplace.digest_pages(sel_slots[s], d_map))
    row("in place, mapped host (eager)", t, step_bytes)
    t = run_steps(lambda s: hbm_mover.digest_slots(sel_pages[s], d_hbm))
    row("in place, HBM (eager)", t, 0)
    # exactness: the same selection read over PCIe and from HBM
    inplace.digest_pages(sel_slots[S - 1], d_map)
    hbm_mover.digest_slots(sel_pages[S - 1], d_hbm)
    torch.cuda.synchronize()
    exact_inplace = bool(torch.equal(d_map, d_hbm))

    sel = torch.full((L, width), -1, dtype=torch.int32, device="cuda")  # padding until a step copies ids in
    cap = torch.cuda.Stream()
    cap.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(cap):
        inplace.digest_pages(sel, d_map)
    torch.cuda.current_stream().wait_stream(cap)
    g_inplace = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g_inplace):
        inplace.digest_pages(sel, d_map)

    def replay_inplace(s: int) -> None:
        sel.copy_(sel_slots[s])
        g_inplace.replay()

    t = run_steps(replay_inplace)
    row("in place, mapped host (graph replay)", t, step_bytes)

    # -- fetch and fetch-then-attend --------------------------------------------------------
    nslots = args.cache_factor * width
    cache_pool = [torch.zeros((nslots, spec.nbytes), dtype=torch.uint8, device="cuda") for spec in layout.planes]
    cache_planes = KVPlanes.from_torch(layout, cache_pool)
    fetcher = PageMover(layout, cache_planes, table, width=width, rows=L, per_layer=True)
    into = torch.arange(width, dtype=torch.int32, device="cuda").repeat(L, 1).contiguous()
    t = run_steps(lambda s: fetcher.fetch(sel_slots[s], into))
    row("fetch all selected pages (eager, no cache)", t, step_bytes)

    out_slots, fetch_ids, fetch_slots = (torch.empty((L, width), dtype=torch.int32, device="cuda") for _ in range(3))
    d_lru = torch.zeros(L * width, dtype=torch.int64, device="cuda")
    lru_results = []
    for hit in (0.0, 0.5, 0.9):
        pages_h = bank(hit)
        bank_h = torch.as_tensor(slot_of[pages_h].astype(np.int32), device="cuda")
        cache = SlotCache(p.num_slots, nslots, width=width, rows=L)
        sel.fill_(-1)
        with torch.cuda.stream(cap):
            cache.resolve(sel, out_slots, fetch_ids, fetch_slots)
            fetcher.fetch(fetch_ids, fetch_slots)
            fetcher.digest_slots(out_slots, d_lru)
        torch.cuda.current_stream().wait_stream(cap)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            cache.resolve(sel, out_slots, fetch_ids, fetch_slots)
            fetcher.fetch(fetch_ids, fetch_slots)
            fetcher.digest_slots(out_slots, d_lru)

        def replay(s: int, graph: Any = graph, bank_h: Any = bank_h) -> None:
            sel.copy_(bank_h[s])
            graph.replay()

        replay(0)  # the first step fills the cache: not timed
        torch.cuda.synchronize()
        m0 = int(cache.misses().sum())
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for s in range(1, S):
            replay(s)
        b.record()
        b.synchronize()
        secs = a.elapsed_time(b) / 1e3 / (S - 1)
        missed = int(cache.misses().sum()) - m0
        measured = 1 - missed / ((S - 1) * L * width)
        # exactness: the graph's digests of the last step equal the in-place read of the same pages
        inplace.digest_pages(bank_h[S - 1], d_map)
        torch.cuda.synchronize()
        exact = bool(torch.equal(d_lru, d_map))
        assert cache.errors() == 0
        lru_results.append({"target_hit": hit, "measured_hit": measured, "exact": exact})
        row(f"fetch-then-attend, slot cache, hit {measured:.0%} (graph replay)", secs,
            missed / (S - 1) * slice_nbytes, "exact" if exact else "MISMATCH")
        cache.close()

    errors = inplace.errors() + hbm_mover.errors() + fetcher.errors() + mirror_mover.errors()

    # -- launch shapes ----------------------------------------------------------------------
    sm = torch.cuda.get_device_properties(0).multi_processor_count
    if args.sweep:
        sweep = []
        for per_sm, threads in ((2, 256), (4, 256), (8, 256), (16, 256), (4, 512), (8, 128)):
            m_in = PageMover(layout, small_planes, table, width=width, rows=L, per_layer=True, ctas=per_sm * sm,
                             threads=threads)
            m_f = PageMover(layout, cache_planes, table, width=width, rows=L, per_layer=True, ctas=per_sm * sm,
                            threads=threads)
            t_in = run_steps(lambda s, m=m_in: m.digest_pages(sel_slots[s], d_map))
            t_f = run_steps(lambda s, m=m_f: m.fetch(sel_slots[s], into))
            errors += m_in.errors() + m_f.errors()
            sweep.append({"ctas_per_sm": per_sm, "threads": threads, "inplace_x_link": step_bytes / t_in / 1e9 / link,
                          "fetch_x_link": step_bytes / t_f / 1e9 / link})
            log(f"shape {per_sm}/SM x {threads}: in place {sweep[-1]['inplace_x_link']:.3f}x, "
                f"fetch {sweep[-1]['fetch_x_link']:.3f}x link")
            m_in.close()
            m_f.close()
        results["sweep"] = sweep

    # -- token-granular reads: 2,048 single tokens per layer ----------------------------------
    if args.tokens_granular and args.layout == "latent-bf16":
        tok = KVLayout(num_layers=1, num_kv_heads=1, head_dim=576, page_tokens=1, dtype="bfloat16", kinds=("kv",))
        tb = tok.page_nbytes  # one token of one layer
        n_items = L * args.select
        # table index (page * L + layer) * 16 + token -> that token's bytes in the mapped arena
        base = table.host[slot_of].astype(np.uint64)  # per page
        offs = (np.arange(L, dtype=np.uint64)[:, None] * np.uint64(slice_nbytes)
                + np.arange(layout.page_tokens, dtype=np.uint64)[None, :] * np.uint64(tb)).reshape(-1)
        tok_table = PageTable((base[:, None] + offs[None, :]).reshape(-1), 0)
        hbase = np.array([hbm[l_].data_ptr() for l_ in range(L)], dtype=np.uint64)  # latent: one plane per layer
        hoffs = (np.arange(npages, dtype=np.uint64)[:, None, None] * np.uint64(slice_nbytes)
                 + np.arange(layout.page_tokens, dtype=np.uint64)[None, None, :] * np.uint64(tb))
        hbm_table = PageTable((hbase[None, :, None] + hoffs).reshape(-1), 0)
        tok_pool_t = torch.zeros((n_items, tb), dtype=torch.uint8, device="cuda")
        tok_pool = KVPlanes.from_torch(tok, [tok_pool_t])
        tok_ids = np.empty((S, n_items), np.int32)
        for s_ in range(S):
            for l_ in range(L):
                t_sel = rng.choice(npages * layout.page_tokens, args.select, replace=False)
                page, j = t_sel // layout.page_tokens, t_sel % layout.page_tokens
                tok_ids[s_, l_ * args.select:(l_ + 1) * args.select] = (page * L + l_) * layout.page_tokens + j
        tok_sel = torch.as_tensor(tok_ids, device="cuda")
        tok_into = torch.arange(n_items, dtype=torch.int32, device="cuda")
        d_t = torch.zeros(n_items, dtype=torch.int64, device="cuda")
        d_h = torch.zeros(n_items, dtype=torch.int64, device="cuda")
        tok_rows = []
        for per_sm, threads in ((4, 256), (8, 128), (16, 64)):
            m_t = PageMover(tok, tok_pool, tok_table, width=n_items, ctas=per_sm * sm, threads=threads)
            m_h = PageMover(tok, tok_pool, hbm_table, width=n_items, ctas=per_sm * sm, threads=threads)
            t_in = run_steps(lambda s, m=m_t: m.digest_pages(tok_sel[s], d_t))
            t_f = run_steps(lambda s, m=m_t: m.fetch(tok_sel[s], tok_into))
            t_h = run_steps(lambda s, m=m_h: m.digest_pages(tok_sel[s], d_h))
            m_t.digest_pages(tok_sel[S - 1], d_t)
            m_h.digest_pages(tok_sel[S - 1], d_h)
            torch.cuda.synchronize()
            exact_t = bool(torch.equal(d_t, d_h))
            errors += m_t.errors() + m_h.errors()
            tok_bytes = n_items * tb
            tok_rows.append({"ctas_per_sm": per_sm, "threads": threads, "us_inplace": t_in * 1e6,
                             "inplace_x_link": tok_bytes / t_in / 1e9 / link, "us_fetch": t_f * 1e6,
                             "fetch_x_link": tok_bytes / t_f / 1e9 / link, "us_hbm": t_h * 1e6, "exact": exact_t})
            log(f"tokens ({n_items} x {tb} B = {tok_bytes / 1e6:.1f} MB), shape {per_sm}/SM x {threads}: in place "
                f"{t_in * 1e6:.0f} us ({tok_rows[-1]['inplace_x_link']:.2f}x link), fetch {t_f * 1e6:.0f} us "
                f"({tok_rows[-1]['fetch_x_link']:.2f}x), HBM {t_h * 1e6:.0f} us, exact {exact_t}")
            m_t.close()
            m_h.close()
        results["tokens"] = tok_rows
        tok_table.close()
        hbm_table.close()
    results.update({"rows": rows, "lru": lru_results, "exact_inplace_vs_hbm": exact_inplace, "kernel_errors": errors})
    p.retire(lease, after=torch.cuda.current_stream())
    torch.cuda.synchronize()
    p.close()

    md = [f"Layout {args.layout}. Pool {args.tokens:,} tokens ({npages:,} pages, "
          f"{npages * page_nbytes / GiB:.1f} GiB host-resident, "
          f"mapped); {L} layers x {width} selected pages x {slice_nbytes} B = {step_bytes / 1e6:.1f} MB per step. "
          f"Link: bulk pinned H2D 1 GiB {link:.1f} GB/s, one step's bytes "
          f"{results['link']['bulk_step_gbps']:.1f} GB/s. Mirror kernel {results['mirror']['gbps_kernel']:.1f} GB/s "
          f"(whole mirror path with reserve, host checksum and seal "
          f"{results['mirror']['gbps_with_reserve_and_seal']:.1f} GB/s).",
          "",
          "| path | µs / step | GB/s of the selection | x link | PCIe MB / step | bytes |",
          "| --- | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        ok = r["note"] or ("exact" if exact_inplace else "MISMATCH")
        md.append(f"| {r['what']} | {r['us_per_step']:.0f} | {r['selection_gbps']:.1f} | {r['x_link']:.2f} | "
                  f"{r['pcie_mb_per_step']:.1f} | {ok} |")
    md.append("")
    md.append(f"kernel errors: {errors}; in-place vs HBM digests equal: {exact_inplace}")
    text = "\n".join(md)
    log(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"bench_sparse_{args.layout}.json"), "w") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(args.out, f"bench_sparse_{args.layout}.md"), "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
