"""A host-side model of bench_engine's "decode step beside back-to-back saves" row, on the CPU.

What it isolates is the cache's own host work during a zero-copy save into ``pinned://`` (reserve,
issue, seal, LRU eviction) and when it holds the GIL, against an engine thread that needs the GIL
once per decode step.  The GPU is modelled, not used:

* the copy engine is :class:`CpuCopyEngine` behind a modelled link: every transfer first waits
  (GIL released) on a host stream for ``nbytes`` of the modelled page size at ``--link-gbps``
  (2 MiB pages at 53 GB/s: a 256-page chunk takes ~10 ms, as on the H200), then copies its real,
  small pages;
* the engine's decode step is 0.6 ms of Python, then a 12.4 ms GIL-free wait (the graph replay's
  synchronize), ~13 ms as bench_engine's;
* the store's checksum is ``xxh3-64`` of the small pages on the host (one call per page); on the
  H200 the checksums come from the GPU;
* the long-lived heap (the chains' keys) is frozen with ``gc.freeze()``, as an engine does.

Rows: ``save_window_bytes`` 0 (every chunk reserved and issued at once) against a window of
``--window`` chunks (``HostKVCache``'s default, 2 GiB, is four chunks of 2 MiB pages), alternating,
``--rounds`` each: the step's p50 / p99 / worst against the step alone, and the saves' median time
against the modelled link time of a save.

Usage: ``python3 benchmarks/bench_save_window.py [--pages 6400] [--steps 400] [--rounds 2]``
(prints one markdown table).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import threading
import time
from typing import Any

import numpy as np

import hostkv_providers as hk
from hostkv_providers.cache import HostKVCache
from hostkv_providers.device import CpuCopyEngine, HostStream, KVPlanes

# real pages: 2 layers x (k, v) x 16 tokens x 1 head x 32 dims x 2 bytes = 4 KiB
LAYOUT = hk.KVLayout(num_layers=2, num_kv_heads=1, head_dim=32, page_tokens=16, dtype="bfloat16")


class LinkModelEngine(CpuCopyEngine):
    """The CPU engine behind a modelled device link: each save transfer waits (GIL released)
    for ``pages x model_page / rate`` seconds on a host stream, in order, before it copies."""

    def __init__(self, model_page: int, gbps: float) -> None:
        super().__init__()
        self.link = HostStream("model-link")
        self.seconds_per_page = model_page / (gbps * 1e9)

    def save(self, planes: Any, block_ids: Any, dst: Any, *, after: Any = None) -> Any:
        wait = len(block_ids) * self.seconds_per_page
        self.link.enqueue(lambda: time.sleep(wait))
        return super().save(planes, block_ids, dst, after=self.link)

    def close(self) -> None:
        super().close()
        self.link.close()


def busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def steps(n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        busy(0.0006)
        time.sleep(0.0124)
        out.append(time.perf_counter() - t)
    return out


def quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(len(s) * q))]


def run(window_chunks: int, pages: int, nsteps: int, model_page: int, gbps: float,
        chains: list[list[hk.Key]], planes: KVPlanes, base: float) -> dict[str, float]:
    P = LAYOUT.page_nbytes
    chunk = 256
    engine = LinkModelEngine(model_page, gbps)
    store = hk.open(f"pinned://?budget={P * pages * 3 // 2}&block={P}&checksum=xxh3-64")
    cache = HostKVCache(store, hk.Salt("bench/save-window", LAYOUT), engine, chunk_pages=chunk,
                        save_window_bytes=window_chunks * chunk * P)
    stop = threading.Event()
    saves: list[float] = []

    def saver() -> None:
        i = 0
        while not stop.is_set():
            t = time.perf_counter()
            res = cache.save(chains[i % len(chains)], planes, np.arange(pages)).wait()
            assert res.stored == pages, res
            saves.append(time.perf_counter() - t)
            i += 1

    th = threading.Thread(target=saver, daemon=True)
    try:
        th.start()
        time.sleep(0.05)
        beside = steps(nsteps)
        stop.set()
        th.join()
    finally:
        cache.close()
        store.close()
        engine.close()
    return {"p50": statistics.median(beside) / base, "p99": quantile(beside, 0.99) / base,
            "worst": max(beside) / base, "save_ms": statistics.median(saves) * 1e3, "saves": len(saves)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pages", type=int, default=6400)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--window", type=int, default=4, help="chunks in flight in the bounded rows")
    ap.add_argument("--model-page", type=int, default=2 << 20, help="modelled page size in bytes")
    ap.add_argument("--link-gbps", type=float, default=53.0)
    args = ap.parse_args()
    n = args.pages
    rng = np.random.default_rng(0)
    shape = (n, LAYOUT.page_tokens, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    planes = KVPlanes.from_arrays(LAYOUT, [rng.integers(0, 1 << 16, size=shape, dtype=np.uint16)
                                           for _ in LAYOUT.planes])
    salt = hk.Salt("bench/save-window", LAYOUT)
    chains = [hk.chain_keys(salt, np.arange(n * LAYOUT.page_tokens) + i * 10**7) for i in range(8)]
    # The chains' keys and the planes are the long-lived heap here: frozen, as an engine freezes
    # its own once the model is loaded (vLLM does; docs/integration.md, "Decode stalls"), so full
    # collections do not walk them (measured without: 33-42 ms gen-2 passes dominate both rows).
    gc.collect()
    gc.freeze()
    base = statistics.median(steps(args.steps // 2))
    link_ms = n * args.model_page / (args.link_gbps * 1e9) * 1e3
    print(f"engine step alone {base * 1e3:.2f} ms; modelled link time of a save {link_ms:.0f} ms "
          f"({n} pages of {args.model_page >> 10} KiB at {args.link_gbps:g} GB/s)\n")
    print("| save_window_bytes | round | step p50 / p99 / worst beside saves | save (median) | saves |")
    print("| --- | ---: | --- | ---: | ---: |")
    for r in range(args.rounds):
        for w in (0, args.window):
            m = run(w, n, args.steps, args.model_page, args.link_gbps, chains, planes, base)
            label = "0 (no bound)" if w == 0 else f"{w} chunks"
            print(f"| {label} | {r + 1} | {m['p50']:.3f}x / {m['p99']:.3f}x / {m['worst']:.3f}x "
                  f"| {m['save_ms']:.0f} ms ({m['save_ms'] / link_ms:.2f}x the link time) | {m['saves']} |",
                  flush=True)


if __name__ == "__main__":
    main()
