"""``hostkv bench``: page write / lookup / read figures on a scratch namespace of a store.

The pages are keyed under a salt with a fresh random namespace, so they can never collide with
(or be mistaken for) real pages; the chain is evicted again at the end, also after an error or
Ctrl-C.  The benchmark never pushes real pages out: it shrinks itself to the free budget.
"""

from __future__ import annotations

import statistics
import sys
import time
import uuid
from typing import Any

import click
import hostkv_providers as hk
import numpy as np

from ._exits import CLIError
from ._format import emit_json, fmt_size, json_option, table
from ._store import open_store, progress_bar
from ._synth import page_bytes

__all__ = ["register", "run_bench"]


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]


def run_bench(p: hk.Provider, pages: int, page_nbytes: int, lookups: int,
              progress: Any = None) -> dict[str, Any]:
    """Write, look up and read back a ``pages``-long chain; evict it; return the figures."""
    st = p.stats()
    free = p.budget_bytes - st.used_bytes
    fit = free // page_nbytes
    if fit < 4:
        raise CLIError(
            f"only {fmt_size(free)} of the budget is free; the benchmark would evict real pages",
            hint="run it on a store with free budget, or a scratch store such as pinned://?budget=1GiB",
        )
    pages = min(pages, fit)
    layout = hk.KVLayout(num_layers=1, num_kv_heads=1, head_dim=page_nbytes, page_tokens=1,
                         dtype="uint8", kinds=("kv",))
    salt = hk.Salt("hostkv-bench", layout, namespace=f"bench-{uuid.uuid4().hex}")
    tokens = np.random.default_rng().integers(0, 128_000, size=pages)
    keys = hk.chain_keys(salt, tokens)
    datas = [page_bytes(k, page_nbytes) for k in keys[: min(pages, 64)]]  # reuse: bytes are bytes
    write_ms: list[float] = []
    read_ms: list[float] = []
    stored: list[bytes] = []
    out = bytearray(page_nbytes)
    mismatches = 0
    try:
        t_all = time.perf_counter()
        parent: bytes | None = None
        for i, k in enumerate(keys):
            t0 = time.perf_counter()
            res = p.reserve(k, parent, page_nbytes, salt_tag=salt.tag)
            if res is not None:
                with res:
                    res.write(0, datas[i % len(datas)])
                stored.append(k)
            write_ms.append((time.perf_counter() - t0) * 1e3)
            parent = k
            if progress is not None:
                progress(i + 1, 2 * pages)
        write_s = time.perf_counter() - t_all

        t0 = time.perf_counter()
        for _ in range(lookups):
            n = p.longest_prefix(keys)
        lookup_s = time.perf_counter() - t0
        if n != pages:
            raise CLIError(f"longest_prefix found {n} of the {pages} pages just written",
                           hint="the store evicted the benchmark's pages: give it more budget")

        t_all = time.perf_counter()
        with p.lease(keys) as lease:
            for i, k in enumerate(lease.keys):
                t0 = time.perf_counter()
                ok = p.read(k, out)
                read_ms.append((time.perf_counter() - t0) * 1e3)
                if not ok or out != datas[i % len(datas)]:
                    mismatches += 1
                if progress is not None:
                    progress(pages + i + 1, 2 * pages)
        read_s = time.perf_counter() - t_all
    finally:
        # always (also when the first seal returned but was not counted yet): the scratch chain
        # must not stay in the store
        if stored or p.present([keys[0]])[0]:
            p.evict([keys[0]])
    mb = pages * page_nbytes / 1e6
    return {
        "provider": p.name, "pages": pages, "page_nbytes": page_nbytes,
        "write": {"MB_per_s": round(mb / write_s, 1), "ms_p50": round(_pct(write_ms, 0.5), 4),
                  "ms_p99": round(_pct(write_ms, 0.99), 4), "seconds": round(write_s, 4)},
        "read": {"MB_per_s": round(mb / read_s, 1), "ms_p50": round(_pct(read_ms, 0.5), 4),
                 "ms_p99": round(_pct(read_ms, 0.99), 4), "seconds": round(read_s, 4)},
        "lookup": {"chain_pages": pages, "calls": lookups,
                   "us_per_call": round(lookup_s / lookups * 1e6, 2),
                   "ns_per_key": round(lookup_s / lookups / pages * 1e9, 1)},
        "mismatches": mismatches,
        "cleaned_up": True,
        "write_ms_mean": round(statistics.fmean(write_ms), 4) if write_ms else 0.0,
    }


def register(group: click.Group) -> None:
    @group.command()
    @click.argument("url")
    @click.option("--pages", type=click.IntRange(min=4), default=512, show_default=True,
                  help="Length of the benchmark chain.")
    @click.option("--page-size", default="256KiB", show_default=True, metavar="SIZE",
                  help="Bytes per page.")
    @click.option("--lookups", type=click.IntRange(min=1), default=200, show_default=True,
                  help="longest_prefix calls over the whole chain.")
    @json_option
    def bench(url: str, pages: int, page_size: str, lookups: int, as_json: bool) -> None:
        """Page write / lookup / read figures on a scratch namespace (cleaned up after)."""
        nbytes = hk.providers.parse_size(page_size)
        if nbytes <= 0:
            raise CLIError("--page-size must be positive")
        with (
            open_store(url, readonly=False, must_exist=False, create=True) as p,
            progress_bar("benchmarking", enabled=not as_json or sys.stderr.isatty(), interrupt_here=True) as bar,
        ):
            doc = run_bench(p, pages, nbytes, lookups, bar)
        doc["url"] = url
        if as_json:
            emit_json(doc)
        else:
            click.echo(f"{doc['provider']}: {doc['pages']} pages of {fmt_size(nbytes)} "
                       f"({fmt_size(doc['pages'] * nbytes)})")
            w, r, lk = doc["write"], doc["read"], doc["lookup"]
            table(("OP", "MB/s", "ms/page p50", "ms/page p99"),
                  [("write+seal", w["MB_per_s"], w["ms_p50"], w["ms_p99"]),
                   ("read", r["MB_per_s"], r["ms_p50"], r["ms_p99"])], right=(1, 2, 3))
            click.echo(f"lookup: longest_prefix over {lk['chain_pages']} keys: "
                       f"{lk['us_per_call']} us/call ({lk['ns_per_key']} ns/key)")
            click.echo("scratch pages evicted again")
        if doc["mismatches"]:
            click.echo(f"WRONG BYTES read back for {doc['mismatches']} pages", err=True)
            click.get_current_context().exit(1)
