"""SGLang HiCache L3, side by side: HostKVStorage (hostkv mmap store) vs SGLang's HiCacheFile.

    python3 benchmarks/bench_engines_sglang.py [--mib 256] [--dir DIR]

Both backends are built by SGLang's own ``StorageBackendFactory`` (``dynamic`` for ours,
``file`` for HiCacheFile) from one ``HiCacheStorageConfig`` and called as HiCacheController
does (tests/integrations/_sglang_engine.py): ``batch_set`` of flat host pages in
``STORAGE_BATCH_SIZE`` batches (*store GB/s*), then a new backend over the same directory (an
engine restart, page cache warm), the hit query and ``batch_get`` (*load GB/s*, *restart hit
rate*; every page's bytes checked).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "integrations"))

import _sglang_engine as eng
from _memo import memoize
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.storage import StorageBackendFactory

# A realistic page (the tests use tiny ones): 64 tokens x 8 layers x K/V x 8 heads x 128 dims
# bf16 = 2 MiB, the host pool's flat page_first page.
eng.PAGE, eng.LAYERS, eng.HEADS, eng.DIM = 64, 8, 8, 128
eng.PAGE_ELEMS = eng.LAYERS * 2 * eng.PAGE * eng.HEADS * eng.DIM

# The payload generator (a PRNG per page) is memoized and warmed before timing, so the figures
# are the engine path and the store, not the PRNG.
memoize(eng, "page_tensor")


def file_backend(path: str) -> Any:
    config = HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
        enable_storage_metrics=False, is_page_first_layout=True, model_name="Qwen/Qwen3-8B",
        extra_config={"file_storage_path": path},
    )
    return StorageBackendFactory.create_backend("file", config, None)


def run(make: Any, n: int) -> dict[str, float]:
    hashes = eng.page_hashes(42, n)
    page_nbytes = eng.PAGE_ELEMS * 2
    for h in hashes:
        eng.page_tensor(h, 0)
    b = make()
    t0 = time.perf_counter()
    assert eng.backup(b, hashes, 0) == n
    t_store = time.perf_counter() - t0
    if hasattr(b, "close"):
        b.close()
    b = make()
    t0 = time.perf_counter()
    hits = eng.hit_query(b, hashes)
    loaded, equal = eng.fetch(b, hashes[:hits], 0)
    t_load = time.perf_counter() - t0
    assert all(equal)
    if hasattr(b, "close"):
        b.close()
    return {"store_GBps": n * page_nbytes / t_store / 1e9, "load_GBps": loaded * page_nbytes / t_load / 1e9,
            "restart_hit_rate": loaded / n, "GB": n * page_nbytes / 1e9}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    base = Path(args.dir or tempfile.mkdtemp(prefix="bench-sglang-"))
    n = args.mib * 1024 * 1024 // (eng.PAGE_ELEMS * 2)
    url = f"mmap://{base / 'hostkv'}?budget={2 * args.mib}MiB&slot=2MiB"
    rows = {"hostkv mmap": run(lambda: eng.make_backend(url), n),
            "SGLang HiCacheFile": run(lambda: file_backend(str(base / "file")), n)}
    print(f"| SGLang 0.5.23 L3 ({n} pages, {rows['hostkv mmap']['GB']:.2f} GB) | store GB/s | load GB/s "
          "| restart hit rate |")
    print("| --- | --- | --- | --- |")
    for name, r in rows.items():
        print(f"| {name} | {r['store_GBps']:.2f} | {r['load_GBps']:.2f} | {r['restart_hit_rate']:.0%} |")
    print(json.dumps(rows))
    if args.dir is None:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
