"""The tree index's own cost per page: ``begin`` + ``commit`` of a 20,000-page chain, CPU time.

Usage: ``python3 benchmarks/bench_index.py TREE`` (TREE: the source tree to import, for a
before/after comparison of two checkouts; the object index of older trees is driven through its
``Node`` API).  Prints microseconds per page, best of 5.
"""

from __future__ import annotations

import hashlib
import sys
import time
from typing import Any

side = sys.argv[1] if len(sys.argv) > 1 else "."
sys.path.insert(0, side)

import hostkv_providers.providers as hp  # noqa: E402


def main() -> None:
    keys, prev = [], bytes(32)
    for i in range(20000):
        prev = hashlib.blake2b(prev + i.to_bytes(8, "little"), digest_size=32).digest()
        keys.append(prev)
    node_api: Any = getattr(hp, "Node", None)  # the object index (older trees) exported it
    best = 9e9
    for _ in range(5):
        idx: Any = hp.TreeIndex(1 << 40)
        c0 = time.process_time()
        parent = None
        for k in keys:
            idx.begin(k, parent, 4096)
            if node_api is not None:
                idx.commit(k, node_api(k, parent, 4096, 0, "", 1, None, 0.0))
            else:
                idx.commit(k, nbytes=4096, csum=1)
            parent = k
        best = min(best, time.process_time() - c0)
    print(f"{side}: {best / len(keys) * 1e6:.2f} us per begin+commit")


if __name__ == "__main__":
    main()
