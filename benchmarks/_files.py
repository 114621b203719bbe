"""Shared by the benchmarks that read a store's files cold (bench_cache, bench_engine): list a
store's files and time a sequential read of their first bytes, the figure a restore from the
store is compared with."""

from __future__ import annotations

import os
import time


def store_files(root: str) -> list[str]:
    """Every file below ``root``, sorted."""
    out = []
    for dirpath, _dirs, files in os.walk(root):
        out += [os.path.join(dirpath, f) for f in files]
    return sorted(out)


def data_files(root: str) -> list[str]:
    """The store's data files (``data*``: where its slots are), or every file where it has none."""
    files = store_files(root)
    return [p for p in files if os.path.basename(p).startswith("data")] or files


def read_prefix(paths: list[str], limit: int, buf: bytearray | None = None) -> tuple[int, float]:
    """Read the first ``limit`` bytes of ``paths`` in order with 16 MiB ``readv`` calls (a fresh
    store's slots are at the front: the rest is preallocated space that reads as zeros without
    any I/O); returns the bytes read and the seconds it took."""
    buf = bytearray(16 << 20) if buf is None else buf
    n = 0
    t = time.perf_counter()
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            while n < limit:
                k = os.readv(fd, [buf])
                if not k:
                    break
                n += k
        finally:
            os.close(fd)
    return n, time.perf_counter() - t
