"""The cost of capturing interval-anchor states during a prefill (issue 17, deliver 6).

    python3 benchmarks/bench_hybrid_prefill.py [--tokens 132 528] [--repeat 7]

The tiny Qwen3-Next of ``examples/hybrid_restore`` (4 layers: linear, full, linear, full; 16-token
pages, an anchor every 2 pages), CPU, 2 threads.  Side by side, interleaved round by round:

* ``cold``: one forward over the prompt, no state captured (what a prefill costs without anchors);
* ``split``: ``HybridCacheMap.prefill(..., single_pass=False)``: one forward per segment ending at
  an anchor page, the state read from the cache after each (the previous recipe);
* ``single pass``: ``HybridCacheMap.prefill`` (the default): one forward; the linear layers' scan is
  run segment by segment with its state carried and the conv state sliced from its input.

Prints a markdown table: best and median ms of ``--repeat`` rounds, ratio to ``cold`` (best).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.modules.setdefault("torchvision", None)  # type: ignore[arg-type]  # see examples/hybrid_restore

import torch  # noqa: E402

from hostkv_providers.cache import anchor_depths  # noqa: E402

_DEMO = Path(__file__).resolve().parents[1] / "examples" / "hybrid_restore" / "hybrid_demo.py"


def _demo() -> Any:
    spec = importlib.util.spec_from_file_location("hybrid_demo", _DEMO)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[132, 528])
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    d = _demo()
    model = d.build_model()
    provider, cache, hmap = d.open_cache(model, "pinned://?budget=64MiB")
    print(f"tiny Qwen3-Next, {d.PAGE_TOKENS}-token pages, anchor every {d.ANCHOR_INTERVAL} pages; "
          f"best/median of {args.repeat} interleaved rounds\n")
    print("| tokens | anchors | prefill | best ms | median ms | best / cold |")
    print("| ---: | ---: | --- | ---: | ---: | ---: |")
    with provider, cache, torch.no_grad():
        for n in args.tokens:
            ids = d.prompt(1, n)
            depths = anchor_depths(cache, n // d.PAGE_TOKENS)
            runs = {
                "cold (one forward, no states)": lambda ids=ids: model(input_ids=ids[None], use_cache=True),
                "split (one forward per segment)":
                    lambda ids=ids, depths=depths: hmap.prefill(model, ids[None], depths, single_pass=False),
                "single pass (default)":
                    lambda ids=ids, depths=depths: hmap.prefill(model, ids[None], depths, single_pass=True),
            }
            times: dict[str, list[float]] = {k: [] for k in runs}
            for fn in runs.values():  # warm-up: one-time costs of each shape
                fn()
            for _ in range(args.repeat):
                for name, fn in runs.items():
                    t0 = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - t0)
            cold = min(times["cold (one forward, no states)"])
            for name, ts in times.items():
                print(f"| {n} | {len(depths)} | {name} | {min(ts) * 1e3:.0f} | {statistics.median(ts) * 1e3:.0f} | "
                      f"{min(ts) / cold:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
