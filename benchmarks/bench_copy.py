"""Copy-engine benchmark on a CUDA GPU: every figure is a ratio to raw copies of the same run.

    python3 benchmarks/bench_copy.py [--pages 4096] [--out DIR] [--quick]

Measures, for a Llama-3-8B-like layout (32 layers, K and V, 8 KV heads, head dim 128, bf16,
16-token pages: 2 MiB pages of 64 slices of 32 KiB) and for 64 KiB / 256 KiB slices:

* raw bulk pinned copies (one ``cuMemcpyAsync`` of the whole volume) in each direction and both
  at once — the line rate of this machine;
* ``CudaCopyEngine.save`` / ``restore`` of scattered pages (random block ids) into/from pinned
  host pages, alone and at the same time; wall-clock from the call to ``wait()`` returning.
  Every engine here runs the staging path (``direct="never"``: the pack kernel, its launch shapes
  and staging sizes are what this measures); the default engine's batch copies are measured
  through the cache by ``bench_engine.py``;
* the one-memcpy-per-slice path (``mode="memcpy"``) for reference;
* the slowdown of a compute-bound GEMM loop and of a launch-heavy, memory-bound loop on the
  engine's compute stream while saves run continuously;
* pinning: seconds per GiB of the pinned allocator (pre-fault + register) vs ``cuMemHostAlloc``,
  and the start-up time a background-pinned ``PinnedProvider`` blocks for.

Prints a markdown table last and writes ``bench_copy.json`` / ``bench_copy.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from hostkv_providers import KVLayout, PinnedProvider
from hostkv_providers.device import CudaCopyEngine, KVPlanes, cuda_available, page_regions, pinned_allocator

GiB = 1 << 30

#: the staging path (what this benchmark measures; batch copies, the default, skip the kernel)
STAGED: dict[str, Any] = {"direct": "never"}


def log(*args: object) -> None:
    print(*args, flush=True)


def make_planes(torch: Any, layout: KVLayout, nblocks: int) -> tuple[KVPlanes, list[Any]]:
    """Per-layer caches [2, blocks, tokens, heads, dim] like vLLM's, filled with random bytes."""
    owners, tensors = [], []
    for _ in range(layout.num_layers):
        t = torch.empty((2, nblocks, layout.page_tokens, layout.num_kv_heads, layout.head_dim),
                        dtype=torch.bfloat16, device="cuda")
        t.view(torch.int16).random_(-32768, 32767)
        owners.append(t)
        tensors += [t[0], t[1]]
    return KVPlanes.from_torch(layout, tensors), owners


def cu() -> Any:
    """The bare CUDA driver API (``cuda.bindings.driver``): the raw baselines measure the driver
    itself, not the library's wrapper of it."""
    from cuda.bindings import driver

    return driver


def check(result: Any, what: str) -> Any:
    """Unwrap a driver result tuple ``(status, *outputs)``; raise on a failed status."""
    if int(result[0]) != 0:
        raise RuntimeError(f"{what} failed: {result[0]!r}")
    rest = result[1:]
    return None if not rest else rest[0] if len(rest) == 1 else rest


def raw_copy(d: Any, dst: int, src: int, nbytes: int, stream: Any, kind: str) -> None:
    fn = {"d2h": d.cuMemcpyDtoHAsync, "h2d": d.cuMemcpyHtoDAsync}[kind]
    check(fn(dst, src, nbytes, stream), "raw copy")


def time_raw(torch: Any, d: Any, dev_buf: Any, host_a: Any, host_b: Any, nbytes: int, reps: int) -> dict[str, float]:
    sa, sb = torch.cuda.Stream(), torch.cuda.Stream()
    out: dict[str, list[float]] = {"d2h": [], "h2d": [], "bidir": []}
    half = dev_buf.numel() // 2
    for _ in range(reps + 1):
        for kind in ("d2h", "h2d"):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            if kind == "d2h":
                raw_copy(d, host_a.address, dev_buf.data_ptr(), nbytes, sa.cuda_stream, "d2h")
            else:
                raw_copy(d, dev_buf.data_ptr(), host_a.address, nbytes, sa.cuda_stream, "h2d")
            sa.synchronize()
            out[kind].append(nbytes / (time.perf_counter() - t0) / 1e9)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        raw_copy(d, host_a.address, dev_buf.data_ptr(), nbytes, sa.cuda_stream, "d2h")
        raw_copy(d, dev_buf.data_ptr() + half, host_b.address, nbytes, sb.cuda_stream, "h2d")
        sa.synchronize()
        sb.synchronize()
        out["bidir"].append(2 * nbytes / (time.perf_counter() - t0) / 1e9)
    return {k: statistics.median(v[1:]) for k, v in out.items()}  # first round is warm-up


def time_engine(eng: CudaCopyEngine, planes: KVPlanes, ids_save: list[int], ids_restore: list[int],
                pages_a: list[Any], pages_b: list[Any], reps: int, page_nbytes: int) -> dict[str, float]:
    res: dict[str, list[float]] = {"save": [], "restore": [], "bidir": [], "save_dev": [], "restore_dev": [],
                                   "issue_ms": []}
    n = len(ids_save) * page_nbytes
    for i in range(reps + 1):
        t0 = time.perf_counter()
        h = eng.save(planes, ids_save, pages_a)
        t_issue = time.perf_counter() - t0
        h.wait()
        t1 = time.perf_counter()
        h2 = eng.restore(pages_b, planes, ids_restore)
        h2.wait()
        t2 = time.perf_counter()
        hs = eng.save(planes, ids_save, pages_a)
        hr = eng.restore(pages_b, planes, ids_restore)
        hs.wait()
        hr.wait()
        t3 = time.perf_counter()
        if i == 0:
            continue  # warm-up: compile, table upload, first-touch of staging
        res.setdefault("bidir_save_dev", []).append(hs.gbps or 0.0)
        res.setdefault("bidir_restore_dev", []).append(hr.gbps or 0.0)
        res["save"].append(n / (t1 - t0) / 1e9)
        res["restore"].append(n / (t2 - t1) / 1e9)
        res["bidir"].append(2 * n / (t3 - t2) / 1e9)
        res["save_dev"].append(h.gbps or 0.0)
        res["restore_dev"].append(h2.gbps or 0.0)
        res["issue_ms"].append(t_issue * 1e3)
    return {k: statistics.median(v) for k, v in res.items()}


def slowdown(torch: Any, kind: str, window: float, loads: dict[str, Callable[[Any], None]],
             priority: int = 0) -> dict[str, Any]:
    """Per-iteration time of a loop on its own stream, alone and during each load run back to back.

    Each load is called with the loop's stream (a save orders itself after it, as an engine's would).
    ``priority``: the loop stream's torch priority (-1: high; the engine's streams are the lowest).
    """
    stream = torch.cuda.Stream(priority=priority)
    if kind == "gemm":
        a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
        b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")

        def body() -> None:
            for _ in range(10):
                torch.mm(a, b)
    else:  # launch-heavy, memory-bound: many small elementwise kernels like a decode step
        xs = [torch.randn(4 << 20, device="cuda") for _ in range(4)]

        def body() -> None:
            for _ in range(64):
                xs[0].mul_(1.0001).add_(xs[1])

    def measure(seconds: float) -> float:
        times: list[float] = []
        t_end = time.perf_counter() + seconds
        with torch.cuda.stream(stream):
            while len(times) < 10 or time.perf_counter() < t_end:
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record(stream)
                body()
                e1.record(stream)
                e1.synchronize()
                times.append(e0.elapsed_time(e1))
        return float(statistics.median(times))

    def bracket(load: Any) -> dict[str, float]:
        """alone, loaded, alone again: the slowdown is against the mean of the two alone windows."""
        before = measure(window)
        stop = threading.Event()
        count = [0]

        def loop() -> None:
            while not stop.is_set():
                load()
                count[0] += 1

        th = threading.Thread(target=loop)
        th.start()
        time.sleep(0.2)
        loaded = measure(window)
        stop.set()
        th.join()
        after = measure(window)
        base = (before + after) / 2
        return {"alone_ms": base, "ms": loaded, "slowdown": loaded / base - 1, "loads": count[0]}

    measure(0.3)
    return {name: bracket(lambda load=load: load(stream)) for name, load in loads.items()}


def interference_loads(torch: Any, engines: dict[str, CudaCopyEngine], planes: KVPlanes, ids_save: list[int],
                       pages_a: list[Any], ids_restore: list[int], pages_b: list[Any],
                       raw_src: tuple[int, int, int]) -> dict[str, Callable[[Any], None]]:
    d = cu()
    copy_stream = torch.cuda.Stream()
    host, dev_ptr, nbytes = raw_src

    def raw(kind: str) -> Callable[[Any], None]:
        def load(_stream: Any) -> None:
            if kind == "d2h":
                raw_copy(d, host, dev_ptr, nbytes, copy_stream.cuda_stream, "d2h")
            else:
                raw_copy(d, dev_ptr, host, nbytes, copy_stream.cuda_stream, "h2d")
            copy_stream.synchronize()
        return load

    loads: dict[str, Callable[[Any], None]] = {"raw_d2h": raw("d2h"), "raw_h2d": raw("h2d")}
    def save(eng: CudaCopyEngine) -> Callable[[Any], None]:
        def load(stream: Any) -> None:
            eng.save(planes, ids_save, pages_a, after=stream).wait()
        return load

    def restore(eng: CudaCopyEngine) -> Callable[[Any], None]:
        def load(_stream: Any) -> None:
            eng.restore(pages_b, planes, ids_restore).wait()
        return load

    for name, eng in engines.items():
        loads[f"save_{name}"] = save(eng)
        loads[f"restore_{name}"] = restore(eng)
    first = next(iter(engines.values()))

    def unordered(_stream: Any) -> None:
        first.save(planes, ids_save, pages_a).wait()

    loads["save_unordered"] = unordered
    return loads


def tune(torch: Any, planes: KVPlanes, ids_save: list[int], pages_a: list[Any], ids_restore: list[int],
         pages_b: list[Any], reps: int, page_nbytes: int, raw: dict[str, float]) -> dict[str, Any]:
    """Throughput and interference of a few pack-kernel launch shapes (CTAs x threads)."""
    out: dict[str, Any] = {}
    for ctas, threads in ((33, 256), (132, 256), (8, 1024), (66, 512), (16, 1024)):
        eng = CudaCopyEngine(ctas=ctas, threads=threads, **STAGED)
        t: dict[str, Any] = dict(time_engine(eng, planes, ids_save, ids_restore, pages_a, pages_b, reps, page_nbytes))

        def save(stream: Any, eng: CudaCopyEngine = eng) -> None:
            eng.save(planes, ids_save, pages_a, after=stream).wait()

        def restore(_stream: Any, eng: CudaCopyEngine = eng) -> None:
            eng.restore(pages_b, planes, ids_restore).wait()

        loads: dict[str, Callable[[Any], None]] = {"save": save, "restore": restore}
        t["gemm"] = slowdown(torch, "gemm", 1.0, loads)
        t["decode_like"] = slowdown(torch, "small", 1.0, loads)
        eng.close()
        out[f"{ctas}x{threads}"] = t
        log(f"tune {ctas}x{threads}", {k: v for k, v in t.items() if k in ("save", "restore", "bidir")},
            t["gemm"], t["decode_like"])
    return out


def pinning(gib: float, provider_gib: float) -> dict[str, Any]:
    """Alternate cuMemHostAlloc and our allocator so neither profits from memory the VM already backs."""
    nbytes = int(gib * GiB)
    out: dict[str, Any] = {"gib": gib, "hostalloc_s_per_gib": [], "ours_s_per_gib": [], "ours8_s_per_gib": [],
                           "ours1_s_per_gib": [], "register_only_s_per_gib": [], "small_pages_s_per_gib": [],
                           "phases": {}}
    for _ in range(2):
        t0 = time.perf_counter()
        ptr = int(check(cu().cuMemHostAlloc(nbytes, cu().CU_MEMHOSTALLOC_PORTABLE), f"cuMemHostAlloc({nbytes})"))
        out["hostalloc_s_per_gib"].append((time.perf_counter() - t0) / gib)
        check(cu().cuMemFreeHost(ptr), "cuMemFreeHost")
        for threads, key, huge in ((4, "ours_s_per_gib", True), (8, "ours8_s_per_gib", True),
                                   (1, "ours1_s_per_gib", True), (0, "register_only_s_per_gib", True),
                                   (4, "small_pages_s_per_gib", False)):
            alloc = pinned_allocator(threads=threads, huge_pages=huge)
            assert alloc is not None
            t0 = time.perf_counter()
            mem = alloc.allocate(nbytes)
            out[key].append((time.perf_counter() - t0) / gib)
            out["method"] = getattr(mem, "method", "?")
            out["phases"][key] = {k: round(v / gib, 3) for k, v in getattr(mem, "timings", {}).items()}
            mem.close()
    t0 = time.perf_counter()
    prov = PinnedProvider(int(provider_gib * GiB), block=2 << 20, background=True)
    out["provider_blocked_s"] = time.perf_counter() - t0
    prov.wait_ready()
    out["provider_whole_s"] = time.perf_counter() - t0
    out["provider_gib"] = provider_gib
    prov.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pages", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--quick", action="store_true", help="fewer pages and rounds (smoke run)")
    ap.add_argument("--only", choices=("all", "interference", "tune", "pinning"), default="all",
                    help="interference: only the 32 KiB layout's slowdown figures; tune: pack-kernel launch shapes; "
                         "pinning: only the pinning figures")
    args = ap.parse_args()
    import torch

    if not cuda_available() or not torch.cuda.is_available():
        log("no CUDA device")
        return 2
    if args.quick:
        args.pages, args.reps = min(args.pages, 512), 1
    torch.zeros(1, device="cuda")  # the primary context, current on this thread for the raw driver calls
    d = cu()
    check(d.cuInit(0), "cuInit")
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "command": " ".join(sys.argv),
                               "pages": args.pages}
    log("device", results["device"], "SMs", sm_count)

    only_interference = args.only in ("interference", "tune")
    if not only_interference:
        t0 = time.perf_counter()
        results["pinning"] = pinning(1.0 if args.quick else 4.0, 2.0 if args.quick else 16.0)
        log("pinning", results["pinning"], f"{time.perf_counter() - t0:.1f}s")
        if args.only == "pinning":
            print(json.dumps(results["pinning"], indent=1))
            return 0

    base = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, page_tokens=16, dtype="bfloat16")
    total = args.pages * base.page_nbytes
    alloc = pinned_allocator()
    assert alloc is not None
    host_a = alloc.allocate(total)
    host_b = alloc.allocate(total)
    np.frombuffer(host_b.view, dtype=np.uint8)[:: 4096] = 1
    dev_buf = torch.empty(2 * total, dtype=torch.uint8, device="cuda")
    raw = time_raw(torch, d, dev_buf, host_a, host_b, total, args.reps)
    del dev_buf
    torch.cuda.empty_cache()
    results["raw"] = raw
    log("raw GB/s", raw)

    rng = np.random.default_rng(0)
    rows = []
    for slice_kib, tokens in ((32, 16),) if only_interference else ((32, 16), (64, 32), (256, 128)):
        layout = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, page_tokens=tokens, dtype="bfloat16")
        npages = total // layout.page_nbytes
        planes, owners = make_planes(torch, layout, 2 * npages)
        perm = [int(x) for x in rng.permutation(2 * npages)]
        ids_save, ids_restore = perm[:npages], perm[npages:]
        pages_a = page_regions(host_a.view, host_a.address, layout.page_nbytes, npages, pinned=True)
        pages_b = page_regions(host_b.view, host_b.address, layout.page_nbytes, npages, pinned=True)
        eng = CudaCopyEngine(**STAGED)
        r0 = time_engine(eng, planes, ids_save, ids_restore, pages_a, pages_b, args.reps, layout.page_nbytes)
        r: dict[str, Any] = dict(r0)
        r.update(slice_kib=slice_kib, page_mib=layout.page_nbytes / (1 << 20), npages=npages)
        # host pages in shuffled order: no coalescing, one DMA per page
        if slice_kib == 32:
            order = [int(x) for x in rng.permutation(npages)]
            shuffled = [pages_a[i] for i in order]
            h = eng.save(planes, ids_save, shuffled)
            h.wait()
            t0 = time.perf_counter()
            eng.save(planes, ids_save, shuffled).wait()
            r["save_shuffled_host"] = total / (time.perf_counter() - t0) / 1e9
            # a bit-exact spot check of the benchmark's own transfer
            probe = 17
            got = bytes(shuffled[probe][0].view[: layout.plane_nbytes])
            want = bytes(owners[0][0][ids_save[probe]].contiguous().view(torch.uint8).cpu().numpy().tobytes())
            r["spot_check_ok"] = got == want
            if args.only == "tune":
                eng.close()
                results["tune"] = tune(torch, planes, ids_save, pages_a, ids_restore, pages_b, args.reps,
                                       layout.page_nbytes, raw)
                rows.append(r)
                break
            engines = {"default": CudaCopyEngine(**STAGED),
                       "no_cache_hints": CudaCopyEngine(cache_hints=False, **STAGED),
                       "ctas8_t1024": CudaCopyEngine(ctas=8, threads=1024, **STAGED),
                       "ctas16_t512": CudaCopyEngine(ctas=16, threads=512, **STAGED),
                       "ctas132": CudaCopyEngine(ctas=132, **STAGED)}
            raw_src = (host_b.address, owners[0].data_ptr(), min(total, owners[0].numel() * 2))
            loads = interference_loads(torch, engines, planes, ids_save, pages_a, ids_restore, pages_b, raw_src)
            window = 0.3 if args.quick else 1.0
            small = {k: v for k, v in loads.items() if k in (
                "raw_h2d", "save_default", "save_unordered", "restore_default", "restore_ctas8_t1024",
                "restore_ctas16_t512", "restore_ctas132", "save_no_cache_hints")}
            if only_interference:
                results["decode_like"] = slowdown(torch, "small", window, small)
                log("decode_like", results["decode_like"])
                results["decode_like_high_priority"] = slowdown(torch, "small", window, small, priority=-1)
                log("decode_like_high_priority", results["decode_like_high_priority"])
            else:
                gemm = {k: v for k, v in loads.items() if k in (
                    "raw_d2h", "raw_h2d", "save_default", "save_unordered", "restore_default")}
                results["gemm"] = slowdown(torch, "gemm", window, gemm)
                log("gemm", results["gemm"])
                results["decode_like"] = slowdown(torch, "small", window, small)
                log("decode_like", results["decode_like"])
                hi = {k: v for k, v in loads.items() if k in ("raw_h2d", "save_default", "restore_default")}
                results["decode_like_high_priority"] = slowdown(torch, "small", window, hi, priority=-1)
                log("decode_like_high_priority", results["decode_like_high_priority"])
            for e in engines.values():
                e.close()
            if only_interference:
                eng.close()
                rows.append(r)
                break
            # staging size
            for mib in (16, 128, 256):
                e = CudaCopyEngine(staging_bytes=mib << 20, **STAGED)
                r[f"staging_{mib}MiB"] = time_engine(e, planes, ids_save, ids_restore, pages_a, pages_b, args.reps,
                                                     layout.page_nbytes)
                e.close()
                log(f"staging {mib} MiB", r[f"staging_{mib}MiB"])
            # one memcpy per slice, on a slice of the volume (it is slow)
            mem = CudaCopyEngine(mode="memcpy", **STAGED)
            k = min(npages, 512)
            mem.save(planes, ids_save[:k], pages_a[:k]).wait()
            t0 = time.perf_counter()
            mem.save(planes, ids_save[:k], pages_a[:k]).wait()
            r["memcpy_save"] = k * layout.page_nbytes / (time.perf_counter() - t0) / 1e9
            t0 = time.perf_counter()
            mem.restore(pages_b[:k], planes, ids_restore[:k]).wait()
            r["memcpy_restore"] = k * layout.page_nbytes / (time.perf_counter() - t0) / 1e9
            mem.close()
        eng.close()
        rows.append(r)
        log(f"slice {slice_kib} KiB", r)
        del planes, owners
        torch.cuda.empty_cache()
    results["rows"] = rows
    host_a.close()
    host_b.close()

    md = render(results)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_copy.json"), "w") as f:
        json.dump(results, f, indent=2)
    with open(os.path.join(args.out, "bench_copy.md"), "w") as f:
        f.write(md)
    log(md)
    return 0


def fmt(values: list[float]) -> str:
    return " / ".join(f"{v:.3f}" for v in values)


def slow_lines(x: dict[str, Any], what: str) -> list[str]:
    def one(v: dict[str, Any]) -> str:
        return f"{100 * v['slowdown']:+.1f}% ({v['alone_ms']:.2f} -> {v['ms']:.2f} ms, {v['loads']} loads)"

    parts = "; ".join(f"{k}: {one(v)}" for k, v in x.items())
    return [f"- {what} on its own stream; slowdown while each load runs back to back, against unloaded windows "
            f"just before and after: {parts}."]


def staging_lines(row: dict[str, Any], raw: dict[str, float]) -> list[str]:
    out = []
    for k, v in row.items():
        if k.startswith("staging_"):
            out.append(f"- 32 KiB slices with {k.removeprefix('staging_')} staging buffers: save "
                       f"{v['save'] / raw['d2h']:.2f}x, restore {v['restore'] / raw['h2d']:.2f}x, both "
                       f"{v['bidir'] / raw['bidir']:.2f}x.")
    return out


def render(r: dict[str, Any]) -> str:
    raw = r["raw"]
    lines = [
        f"Device: {r['device']}; {r['pages']} scattered pages of the Llama-3-8B-like layout "
        f"({r['pages'] * 2 / 1024:.1f} GiB per direction); wall-clock from the call to `wait()` returning; "
        "ratios are to raw bulk pinned copies of the same run.",
        "",
        f"Raw bulk pinned copy: device→host {raw['d2h']:.1f} GB/s, host→device {raw['h2d']:.1f} GB/s, "
        f"both at once {raw['bidir']:.1f} GB/s.",
        "",
        "| slice | page | pages | save GB/s (x raw) | restore GB/s (x raw) | save+restore GB/s (x raw bidir) | "
        "device-timed save / restore / both-at-once GB/s | caller ms per save() |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in r["rows"]:
        lines.append(
            f"| {row['slice_kib']} KiB | {row['page_mib']:.0f} MiB | {row['npages']} | "
            f"{row['save']:.1f} ({row['save'] / raw['d2h']:.2f}x) | "
            f"{row['restore']:.1f} ({row['restore'] / raw['h2d']:.2f}x) | "
            f"{row['bidir']:.1f} ({row['bidir'] / raw['bidir']:.2f}x) | "
            f"{row['save_dev']:.1f} / {row['restore_dev']:.1f} / "
            f"{row['bidir_save_dev']:.1f}+{row['bidir_restore_dev']:.1f} | {row['issue_ms']:.1f} |")
    first = r["rows"][0]
    if "tune" in r:
        lines += ["", "| pack kernel CTAs x threads | save x raw | restore x raw | both x raw bidir | "
                  "GEMM loop: save / restore | memory-bound loop: save / restore |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for name, t in r["tune"].items():
            g, m = t["gemm"], t["decode_like"]
            lines.append(f"| {name} | {t['save'] / raw['d2h']:.2f} | {t['restore'] / raw['h2d']:.2f} | "
                         f"{t['bidir'] / raw['bidir']:.2f} | {100 * g['save']['slowdown']:+.1f}% / "
                         f"{100 * g['restore']['slowdown']:+.1f}% | {100 * m['save']['slowdown']:+.1f}% / "
                         f"{100 * m['restore']['slowdown']:+.1f}% |")
        return "\n".join(lines) + "\n"
    if "pinning" not in r:  # --only interference
        return "\n".join([*lines, "", *slow_lines(r["decode_like"], "Launch-heavy, memory-bound loop (128 small "
                                                  "elementwise kernels)"),
                          *slow_lines(r["decode_like_high_priority"], "The same loop on a high-priority stream")]) \
            + "\n"
    lines += [
        "",
        f"- 32 KiB slices, host pages in shuffled order (one DMA per 2 MiB page, no coalescing): save "
        f"{first['save_shuffled_host']:.1f} GB/s ({first['save_shuffled_host'] / raw['d2h']:.2f}x); "
        f"spot check of the bytes: {'ok' if first['spot_check_ok'] else 'MISMATCH'}.",
        f"- One `cuMemcpyAsync` per 32 KiB slice (`mode=\"memcpy\"`, 512 pages): save {first['memcpy_save']:.1f} GB/s "
        f"({first['memcpy_save'] / raw['d2h']:.2f}x), restore {first['memcpy_restore']:.1f} GB/s "
        f"({first['memcpy_restore'] / raw['h2d']:.2f}x).",
        *slow_lines(r["gemm"], "Compute-bound loop (10 bf16 8192^3 GEMMs)"),
        *slow_lines(r["decode_like"], "Launch-heavy, memory-bound loop (128 small elementwise kernels)"),
        *slow_lines(r["decode_like_high_priority"], "The same loop on a high-priority stream (torch priority -1)"),
        *staging_lines(first, raw),
        f"- Pinning {r['pinning']['gib']:.0f} GiB, alternating (two rounds, each figure s/GiB): pre-fault on 4 "
        f"threads (transparent huge pages) + `cuMemHostRegister` ({r['pinning']['method']}) "
        f"{fmt(r['pinning']['ours_s_per_gib'])}; the same with 4 KiB pages "
        f"{fmt(r['pinning']['small_pages_s_per_gib'])}; huge pages "
        f"on 8 threads {fmt(r['pinning']['ours8_s_per_gib'])}; on 1 thread "
        f"{fmt(r['pinning']['ours1_s_per_gib'])}; `cuMemHostRegister` of untouched memory "
        f"{fmt(r['pinning']['register_only_s_per_gib'])}; "
        f"`cuMemHostAlloc` {fmt(r['pinning']['hostalloc_s_per_gib'])}; s/GiB by phase (second round, 4 threads) "
        f"{r['pinning']['phases']['ours_s_per_gib']}; a {r['pinning']['provider_gib']:.0f} GiB "
        "`PinnedProvider(background=True)` blocks start-up "
        f"{r['pinning']['provider_blocked_s']:.3f} s "
        f"({r['pinning']['provider_blocked_s'] / r['pinning']['provider_gib']:.4f} s per GiB of arena), "
        f"whole arena ready after {r['pinning']['provider_whole_s']:.2f} s.",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
