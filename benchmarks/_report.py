"""Shared by the engine side-by-side benchmarks (bench_engines_{lmcache,sglang,vllm}): their one
table, a row per backend with the same three figures, then the rows as JSON."""

from __future__ import annotations

import json
from typing import Any


def print_rows(title: str, rows: dict[str, dict[str, Any]]) -> None:
    """Print ``rows`` (backend -> ``store_GBps``, ``load_GBps``, ``restart_hit_rate``) as a markdown
    table under ``title`` (its first cell), then as one line of JSON."""
    print(f"| {title} | store GB/s | load GB/s | restart hit rate |")
    print("| --- | --- | --- | --- |")
    for name, r in rows.items():
        print(f"| {name} | {r['store_GBps']:.2f} | {r['load_GBps']:.2f} | {r['restart_hit_rate']:.0%} |")
    print(json.dumps(rows))
