"""vLLM's secondary tier, side by side: HostKVTier (hostkv mmap store) vs vLLM's own ``fs`` tier.

    python3 benchmarks/bench_engines_vllm.py [--mib 256] [--dir DIR]

Both tiers run under vLLM's own TieringOffloadingManager (TieringOffloadingSpec, CPU), driven as
its scheduler does (tests/integrations/_vllm_engine.py): a prompt of ``--mib`` of 1 MiB chunks
is stored (prepare_store, rows filled, complete_store -> cascade) -- *store GB/s* is the bytes
over the time until every cascade job reported back; then the manager is shut down and a new one
opened over the same directory (an engine restart; the page cache stays warm) and the prompt
looked up and promoted -- *load GB/s* is the bytes over the time until every promotion is done,
*restart hit rate* the share of chunks hit, every hit's bytes checked.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "integrations"))

import _vllm_engine as eng
from _memo import memoize
from _report import print_rows

ROW = 1 << 20  # 1 MiB chunks (the per-chunk scheduler work is vLLM's, the same for both tiers)



# The payload generator (a PRNG per page) is memoized and warmed before timing, so the figures
# are the engine path and the store, not the PRNG.
memoize(eng, "row_bytes")


def run(tier: dict[str, Any], n: int) -> dict[str, float]:
    keys = eng.prompt_keys(42, n)
    cfg = dict(cpu_chunks=n + 8, worker_block_bytes=ROW)
    m = eng.make_manager(eng.make_config(tier, **cfg))  # type: ignore[arg-type]
    nbytes = eng.primary_rows(m).shape[1] * n
    for k in keys:
        eng.row_bytes(k, nbytes // n)
    t0 = time.perf_counter()
    eng.store(m, "bench-store", keys, per_step=64)
    t_store = time.perf_counter() - t0
    m.shutdown()
    m = eng.make_manager(eng.make_config(tier, **cfg))  # type: ignore[arg-type]
    t0 = time.perf_counter()
    hits, equal = eng.load(m, "bench-load", keys, max_steps=20_000)
    t_load = time.perf_counter() - t0
    m.shutdown()
    assert all(equal)
    return {"store_GBps": nbytes / t_store / 1e9, "load_GBps": hits * (nbytes / n) / t_load / 1e9,
            "restart_hit_rate": hits / n, "GB": nbytes / 1e9}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--dir", default=None, help="where the stores go (default: a temp dir)")
    args = ap.parse_args()
    base = Path(args.dir or tempfile.mkdtemp(prefix="bench-vllm-"))
    n = args.mib * 1024 * 1024 // ROW
    rows = {}
    for name, tier in (
        ("hostkv mmap", eng.hostkv_tier(f"mmap://{base / 'hostkv'}?budget={2 * args.mib}MiB&slot=1MiB")),
        ("vLLM fs tier", {"type": "fs", "root_dir": str(base / "fs")}),
    ):
        rows[name] = run(tier, n)
    print_rows(f"vLLM 0.33.0 tier ({n} chunks, {rows['hostkv mmap']['GB']:.2f} GB)", rows)
    if args.dir is None:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
