"""The tiered cliff, side by side and repeated (issue 14 item 7): ``HostKVCache.save`` of a chain
of 4 KiB pages on the CPU copy engine into ``tiered://`` (pinned fast tier over an mmap slow tier,
``durability=none``), a fast tier that holds the chain (64 MiB) against one that does not (2 MiB).

The configuration is ``bench_engine.py --phases cliff``'s; this script runs both cases ``--repeat``
times in one process, alternating which goes first (the first save of a process pays its
warm-up), and reports the best and the median of the save time, of the save plus the rest of
the write-back (``flush()``), and of the process CPU time of each (all threads: less sensitive to
a busy machine than wall time).  After each save every page is read back and compared (outside
the timing): a save that reports a page stored must hand back exactly its bytes.

    python3 benchmarks/bench_tiered_cliff.py [--pages 2000] [--repeat 10] [--dir DIR] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import urllib.parse
from typing import Any

import numpy as np

import hostkv_providers as hk
from hostkv_providers.cache import HostKVCache
from hostkv_providers.device import CpuCopyEngine

CASES = (("fits_64MiB", "64MiB"), ("small_2MiB", "2MiB"))


def one_save(where: str | None, fast_budget: str, arrays: list[Any], layout: hk.KVLayout, n: int) -> dict[str, Any]:
    root = tempfile.mkdtemp(prefix="bench-cliff-", dir=where)
    fast = urllib.parse.quote(f"pinned://?budget={fast_budget}&block=4096&background=false&pin=no", safe="")
    slow = urllib.parse.quote(f"mmap://{root}/s?budget=64MiB&slot=4KiB&durability=none", safe="")
    p = hk.open(f"tiered://?fast={fast}&slow={slow}")
    eng = CpuCopyEngine()
    try:
        with HostKVCache(p, hk.Salt("bench/cliff", layout), eng) as c:
            keys = c.keys(list(range(n * layout.page_tokens)))
            t, cpu = time.perf_counter(), time.process_time()
            r = c.save(keys, arrays, list(range(n))).wait()
            save_s, save_cpu = time.perf_counter() - t, time.process_time() - cpu
            p.flush()  # type: ignore[attr-defined]
            total_s, total_cpu = time.perf_counter() - t, time.process_time() - cpu
            extra = p.stats().extra
            buf = bytearray(layout.page_nbytes)
            wrong = 0
            for i, k in enumerate(keys[: r.stored]):
                want = b"".join(np.ascontiguousarray(a[i]).tobytes() for a in arrays)
                wrong += not (p.read(k, buf) and bytes(buf) == want)
        return {"stored": r.stored, "wrong": wrong, "save_s": save_s, "save_cpu_s": save_cpu,
                "with_write_back_s": total_s, "with_write_back_cpu_s": total_cpu,
                "write_through": int(extra["write_through"]), "write_backs": int(extra["write_backs"])}
    finally:
        p.close()
        eng.close()
        shutil.rmtree(root, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--dir", default=None, help="where the mmap stores go (default: a temp dir)")
    ap.add_argument("--out", default=None, help="write bench_tiered_cliff.json there")
    args = ap.parse_args()
    layout = hk.KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, page_tokens=4, dtype="float32")  # 4 KiB
    n = args.pages
    shape = (n, layout.page_tokens, layout.num_kv_heads, layout.head_dim)
    arrays = [np.random.default_rng(0).standard_normal(shape, dtype=np.float32) for _ in layout.planes]
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label, _ in CASES}
    for i in range(args.repeat):
        for label, budget in (CASES if i % 2 == 0 else CASES[::-1]):
            r = one_save(args.dir, budget, arrays, layout, n)
            runs[label].append(r)
            print(f"{label}: save {r['save_s']:.3f} s (with write-back {r['with_write_back_s']:.3f} s; cpu "
                  f"{r['save_cpu_s']:.3f} s), stored {r['stored']}, wrong {r['wrong']}, written through "
                  f"{r['write_through']}", flush=True)
    out: dict[str, Any] = {"argv": sys.argv, "pages": n, "repeat": args.repeat}
    for what in ("save_s", "with_write_back_s", "save_cpu_s", "with_write_back_cpu_s"):
        fits = [r[what] for r in runs["fits_64MiB"]]
        small = [r[what] for r in runs["small_2MiB"]]
        out[what] = {"fits_best": round(min(fits), 3), "small_best": round(min(small), 3),
                     "best_x": round(min(small) / min(fits), 3),
                     "fits_median": round(statistics.median(fits), 3),
                     "small_median": round(statistics.median(small), 3),
                     "median_x": round(statistics.median(small) / statistics.median(fits), 3)}
    out["wrong"] = sum(r["wrong"] for rs in runs.values() for r in rs)
    out["stored_all"] = all(r["stored"] == n for rs in runs.values() for r in rs)
    out["write_through_small"] = [r["write_through"] for r in runs["small_2MiB"]]
    print("| figure | fits 64 MiB best / median | small 2 MiB best / median | ratio best / median |")
    print("| --- | ---: | ---: | ---: |")
    for what in ("save_s", "with_write_back_s", "save_cpu_s", "with_write_back_cpu_s"):
        f = out[what]
        print(f"| {what} | {f['fits_best']} / {f['fits_median']} | {f['small_best']} / {f['small_median']} | "
              f"{f['best_x']}x / {f['median_x']}x |")
    print(f"wrong bytes: {out['wrong']}; every save stored all {n} pages: {out['stored_all']}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_tiered_cliff.json"), "w") as fh:
            json.dump(out, fh, indent=1)
    return 1 if out["wrong"] or not out["stored_all"] else 0


if __name__ == "__main__":
    sys.exit(main())
