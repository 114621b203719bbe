"""The provider front's own cost: per-page ``put``/``read`` and a chain ``longest_prefix``, in CPU time.

One provider per run, 2,048 pages of 4 KiB in one chain (small pages, so the Python layers are
what is measured, not the copies): microseconds of ``time.process_time`` per ``put`` and per
``read``, and milliseconds per ``longest_prefix`` of the whole chain.  CPU time of this process
only, so other jobs on a shared machine disturb it less than wall time.  For a before/after
comparison run it alternately against two trees (``PYTHONPATH``) and keep the best of each.

Usage: ``python3 benchmarks/bench_front.py pinned|mmap|lmdb`` (prints ``name put_us read_us lp_ms``).
"""

from __future__ import annotations

import argparse
import hashlib
import tempfile
import time

import hostkv_providers as hk


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("provider", choices=("pinned", "mmap", "lmdb"))
    ap.add_argument("--pages", type=int, default=2048)
    args = ap.parse_args()
    keys, prev = [], bytes(32)
    for i in range(args.pages):
        prev = hashlib.blake2b(prev + i.to_bytes(8, "little"), digest_size=32).digest()
        keys.append(prev)
    blob, out = bytes(4096), bytearray(4096)
    with tempfile.TemporaryDirectory() as d:
        url = {"pinned": "pinned://?budget=64MiB&background=false&pin=no&block=4096&chunk=64MiB",
               "mmap": f"mmap://{d}?budget=64MiB&slot=4096", "lmdb": f"lmdb://{d}?budget=64MiB"}[args.provider]
        with hk.open(url) as p:
            t0 = time.process_time()
            parent = None
            for k in keys:
                p.put(k, parent, blob)
                parent = k
            t1 = time.process_time()
            for k in keys:
                p.read(k, out)
            t2 = time.process_time()
            for _ in range(200):
                p.longest_prefix(keys)
            t3 = time.process_time()
    n = len(keys)
    print(args.provider, f"{(t1 - t0) / n * 1e6:.2f}", f"{(t2 - t1) / n * 1e6:.2f}", f"{(t3 - t2) / 200 * 1e3:.2f}")


if __name__ == "__main__":
    main()
