"""LMCache storage, side by side: HostKVBackend (hostkv mmap store) vs LMCache's LocalDiskBackend.

    python3 benchmarks/bench_engines_lmcache.py [--mib 256] [--dir DIR]

Both run under LMCache's own StorageManager (tests/integrations/_lmcache_engine.py): chunks
allocated by the manager, ``batched_put`` (*store GB/s*: bytes over the time until the backend
has no put in flight), then a new StorageManager over the same directory (an engine restart,
page cache warm), ``batched_contains`` and ``batched_get(location=...)`` (*load GB/s*, *restart
hit rate*; every chunk's bytes checked).  LMCache's local disk backend keeps its index in memory
only, so it is expected to hit nothing after a restart.  A third row runs LMCache's
``RemoteBackend`` over our ``HostKVConnector`` (``remote_storage_plugins``).
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

import _lmcache_engine as eng
import torch
from _memo import memoize
from _report import print_rows

# A realistic chunk (the tests use tiny ones): 256 tokens x 8 layers x K/V x 8 heads x 128 dims
# bf16 = 8 MiB (MemoryFormat.KV_2LTD).
eng.CHUNK, eng.LAYERS, eng.HEADS, eng.DIM = 256, 8, 8, 128
eng.SHAPE = torch.Size([2, eng.LAYERS, eng.CHUNK, eng.HEADS * eng.DIM])

# The payload generator (a PRNG per page) is memoized and warmed before timing, so the figures
# are the engine path and the store, not the PRNG.
memoize(eng, "chunk_tensor")


def _wait(manager: Any, name: str, keys: list[Any]) -> None:
    backend = manager.storage_backends[name]
    deadline = time.monotonic() + 600
    while any(backend.exists_in_put_tasks(k) for k in keys) and time.monotonic() < deadline:
        time.sleep(0.005)


def run(make: Any, name: str, n: int) -> dict[str, float]:
    m = make()
    keys = eng.chunk_keys(m, 42, n)
    nbytes = eng.SHAPE.numel() * 2
    for k in keys:
        eng.chunk_tensor(k)
    t0 = time.perf_counter()
    eng.put(m, keys, per_call=8)
    _wait(m, name, keys)
    t_store = time.perf_counter() - t0
    m.close()
    m = make()
    t0 = time.perf_counter()
    hits, equal = eng.retrieve(m, keys)
    t_load = time.perf_counter() - t0
    m.close()
    ok = sum(equal)
    assert ok == hits or name == "LocalDiskBackend"
    return {"store_GBps": n * nbytes / t_store / 1e9, "load_GBps": (ok * nbytes / t_load / 1e9) if ok else 0.0,
            "restart_hit_rate": ok / n, "GB": n * nbytes / 1e9}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    base = Path(args.dir or tempfile.mkdtemp(prefix="bench-lmcache-"))
    n = args.mib * 1024 * 1024 // (eng.SHAPE.numel() * 2)
    url = f"mmap://{base / 'hostkv'}?budget={2 * args.mib}MiB&slot=8MiB"
    url_remote = f"mmap://{base / 'hostkv-remote'}?budget={2 * args.mib}MiB&slot=8MiB"
    cpu_gb = 2.5 * args.mib / 1024  # LMCache's allocator holds every chunk of a retrieve at once
    rows = {"hostkv mmap": run(lambda: eng.make_manager(url, cpu_gb=cpu_gb), "hostkv", n),
            # LMCache's RemoteBackend over our RemoteConnector (it buffers through LMCache's
            # local CPU backend, which the remote path requires).
            "hostkv mmap, RemoteConnector": run(lambda: eng.make_manager(url_remote, cpu_gb=cpu_gb, remote=True),
                                                eng.REMOTE, n),
            "LMCache LocalDiskBackend": run(lambda: eng.make_manager(None, disk=str(base / "disk") + "/",
                                                                     cpu_gb=cpu_gb), "LocalDiskBackend", n)}
    print_rows(f"LMCache 0.5.6 ({n} chunks, {rows['hostkv mmap']['GB']:.2f} GB)", rows)
    if args.dir is None:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
