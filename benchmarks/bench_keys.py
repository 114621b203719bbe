"""Keying and lookup speed: the two things an engine does on every request.

Measures, in one run:
* ``chain_keys`` over 131,072 tokens in 16-token pages (goal: under 20 ms), with a bare
  ``hashlib.blake2b`` loop over the same pages as the floor;
* ``present``/``longest_prefix`` of an 8,192-key chain on the pinned provider (goal: well under
  1 ms), against a plain ``dict`` membership loop over the same keys.

Usage: ``python3 benchmarks/bench_keys.py [--repeat N]``; prints a markdown table.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import time
from collections.abc import Callable

import numpy as np

import hostkv_providers as hk


def best_ms(fn: Callable[[], object], repeat: int) -> tuple[float, float]:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return min(times), statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()

    layout = hk.KVLayout(32, 8, 128, 16)
    salt = hk.Salt("meta-llama/Meta-Llama-3-8B", layout)
    tokens = np.random.default_rng(0).integers(0, 128_256, 131_072)
    raw_pages = [tokens[i : i + 16].astype("<i8").tobytes() for i in range(0, len(tokens), 16)]

    def raw_hash() -> None:
        prev = bytes(32)
        for page in raw_pages:
            prev = hashlib.blake2b(prev + page, digest_size=32, key=salt.digest).digest()

    rows = []
    k_best, k_med = best_ms(lambda: hk.chain_keys(salt, tokens), args.repeat)
    r_best, _ = best_ms(raw_hash, args.repeat)
    rows.append(
        ("chain_keys, 131,072 tokens (8,192 pages)", k_best, k_med, r_best, "bare blake2b loop, pre-split pages")
    )

    keys = hk.chain_keys(salt, tokens)
    page = 4096
    with hk.providers.PinnedProvider(len(keys) * page, block=page) as p:
        parent = None
        blob = bytes(page)
        for k in keys:
            p.put(k, parent, blob, salt_tag=salt.tag)
            parent = k
        plain = set(keys)
        d_best, _ = best_ms(lambda: [k in plain for k in keys], args.repeat)
        pr_best, pr_med = best_ms(lambda: p.present(keys), args.repeat)
        lp_best, lp_med = best_ms(lambda: p.longest_prefix(keys), args.repeat)
        assert p.longest_prefix(keys) == len(keys)
        rows.append(("pinned present(), 8,192-key chain", pr_best, pr_med, d_best, "set membership loop"))
        rows.append(("pinned longest_prefix(), 8,192-key chain", lp_best, lp_med, d_best, "set membership loop"))

    print("| operation | best ms | median ms | baseline best ms | baseline |")
    print("| --- | ---: | ---: | ---: | --- |")
    for name, best, med, base, base_name in rows:
        print(f"| {name} | {best:.2f} | {med:.2f} | {base:.2f} | {base_name} |")


if __name__ == "__main__":
    main()
