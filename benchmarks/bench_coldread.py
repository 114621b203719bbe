"""Cold reads of one large file: how many requests in flight and direct I/O change the rate.

Writes ``--gib`` GiB once (fsync), then per case drops the page cache (``/proc/sys/vm/drop_caches``
as root, else ``POSIX_FADV_DONTNEED``) and reads the whole file:

* ``1 thread, 16 MiB readv``: the baseline of ``bench_engine.py``'s restart row;
* ``N threads, 2 MiB preadv``: the file cut into N contiguous ranges, one thread each (what the
  slot files' batch reads do for a large ``read_many``);
* the same with ``O_DIRECT`` into page-aligned buffers (no page cache copy);
* each case also with XXH3-64 of every 2 MiB piece (the verification a restore pays).

Usage: ``python3 benchmarks/bench_coldread.py [--dir DIR] [--gib 4] [--rounds 2]``.
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import statistics
import tempfile
import threading
import time

import xxhash

MiB = 1 << 20


def drop(path: str) -> None:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError:
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def read_range(path: str, lo: int, hi: int, piece: int, direct: bool, hashed: bool) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    buf = mmap.mmap(-1, piece)  # page-aligned, as O_DIRECT needs
    view = memoryview(buf)
    try:
        pos = lo
        while pos < hi:
            n = os.preadv(fd, [view[: min(piece, hi - pos)]], pos)
            if n <= 0:
                break
            if hashed:
                xxhash.xxh3_64_intdigest(view[:n])
            pos += n
    finally:
        view.release()
        buf.close()
        os.close(fd)


def case(path: str, size: int, threads: int, piece: int, direct: bool, hashed: bool) -> float:
    drop(path)
    step = -(-size // threads) // piece * piece or piece
    ranges = [(lo, min(size, lo + step)) for lo in range(0, size, step)]
    t = time.perf_counter()
    ws = [threading.Thread(target=read_range, args=(path, lo, hi, piece, direct, hashed)) for lo, hi in ranges]
    for w in ws:
        w.start()
    for w in ws:
        w.join()
    return size / (time.perf_counter() - t) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--gib", type=float, default=4.0)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    root = tempfile.mkdtemp(prefix="bench-coldread-", dir=a.dir)
    path = os.path.join(root, "data")
    size = int(a.gib * (1 << 30)) // (16 * MiB) * (16 * MiB)
    try:
        block = os.urandom(16 * MiB)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
        for off in range(0, size, len(block)):
            os.pwrite(fd, block, off)
        os.fsync(fd)
        os.close(fd)
        cases = [("1 thread, 16 MiB reads", 1, 16 * MiB, False)]
        for n in (2, 4, 8):
            cases.append((f"{n} threads, 2 MiB reads", n, 2 * MiB, False))
        for n in (1, 4, 8):
            cases.append((f"{n} threads, 2 MiB reads, O_DIRECT", n, 2 * MiB, True))
        rates: dict[str, list[float]] = {}
        for _ in range(a.rounds):
            for hashed in (False, True):
                for name, n, piece, direct in cases:
                    label = name + (", + XXH3" if hashed else "")
                    try:
                        rates.setdefault(label, []).append(case(path, size, n, piece, direct, hashed))
                    except OSError as exc:  # O_DIRECT refused by the file system
                        rates.setdefault(label, []).append(float("nan"))
                        print(f"{label}: {exc}")
        base = statistics.median(rates["1 thread, 16 MiB reads"])
        print(f"{size / 1e9:.2f} GB file, {a.rounds} rounds (median)\n")
        print("| cold read | GB/s | vs 1 thread, 16 MiB reads |")
        print("| --- | ---: | ---: |")
        for label, rs in rates.items():
            med = statistics.median(rs)
            print(f"| {label} | {med:.2f} | {med / base:.2f}x |")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
