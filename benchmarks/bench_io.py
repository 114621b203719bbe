"""Provider throughput against raw file I/O, ``mmap`` and ``lmdb`` side by side in one process.

Issue 14 item 8: at 256 KiB pages (``--page``), the batch path (``put_many``/``read_many`` of
``--chunk`` pages per call) and per-page ``read`` of each provider, against raw I/O on a file of
the same disk:

* **verified** paths (every page XXH3-64 hashed at write and checked at read, as the contract
  requires) against raw I/O **plus the same XXH3** of every page: that ratio is the provider's
  own cost;
* ``verify=never`` reads (mmap) against raw I/O alone;
* raw I/O is what the batch path does too: one ``pwritev`` per call of ``--chunk`` adjacent
  pages; verified reads one ``preadv`` per 1 MiB group, each hashed right after its copy (the
  best one-thread loop; the older one-``preadv``-then-hash baseline is reported beside it);
  ``verify=never`` reads one ``preadv`` per call; per-page reads one ``pread`` per page;
* **warm** rows interleave the sides chunk by chunk (raw chunk, provider chunk, ...), so all see the
  same machine load, and report the median of the per-chunk ratios; **cold** rows time whole passes
  with the page cache dropped before each (``fsync`` + ``POSIX_FADV_DONTNEED`` of every data file),
  sides alternating, and report the median of ``--cold-rounds`` pass ratios;
* writes: ``put_many`` into fresh space and into slots freed by evicting the previous pass
  (``durability=process``: survives kill -9, no sync), and with ``durability=sync`` against
  raw + XXH3 + one ``fdatasync`` per call, and against raw + XXH3 + two ``fdatasync`` per call
  (data, then 160 bytes per page appended to a journal file and synced: the honest lower bound
  under the stores' ordering rule, data before the index that points at it).

Usage: ``python3 benchmarks/bench_io.py [--dir DIR] [--pages 1024] [--rounds 3]``; prints one
markdown table.  DIR must be on the disk you care about (default: a temp dir under /tmp).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import xxhash

from hostkv_providers.providers import Key, LmdbProvider, MmapProvider

MiB = 1 << 20
#: The raw read baseline's group size: the providers' own (``_slotfile._GROUP_NBYTES``).
GROUP_NBYTES = MiB


def _keys(n: int, tag: str) -> list[Key]:
    return [Key(hashlib.blake2b(f"{tag}/{i}".encode(), digest_size=32).digest()) for i in range(n)]


class _Raw:
    """A preallocated file written and read ``chunk`` pages per call, like the batch paths."""

    def __init__(self, path: str, page: int, npages: int, chunk: int) -> None:
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        os.posix_fallocate(self.fd, 0, page * npages)
        # a journal beside the data, for the two-sync baseline: records appended to it
        self.jfd = os.open(path + ".journal", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        self.jsize = 160 * max(npages, chunk)
        os.posix_fallocate(self.jfd, 0, self.jsize)
        self.jpos = 0
        self.page = page
        self.bufs = [memoryview(bytearray(page)) for _ in range(chunk)]

    def write(self, lo: int, data: list[bytes], sync: bool | int = False) -> None:
        """Hash and write the pages; ``sync`` 1 (or ``True``): one ``fdatasync`` of the data;
        2: that, then a 160-byte record per page appended to the journal file and a second
        ``fdatasync`` of it (the order the stores' crash rules need: data, then the index)."""
        for d in data:
            xxhash.xxh3_64_intdigest(d)
        os.pwritev(self.fd, data, lo * self.page)
        if sync:
            os.fdatasync(self.fd)
        if sync == 2:
            rec = bytes(160 * len(data))
            if self.jpos + len(rec) > self.jsize:
                self.jpos = 0
            os.pwrite(self.jfd, rec, self.jpos)
            self.jpos += len(rec)
            os.fdatasync(self.jfd)

    def close(self) -> None:
        os.close(self.fd)
        os.close(self.jfd)

    def read(self, lo: int, n: int, hashed: bool = True, group: int = GROUP_NBYTES) -> None:
        """``n`` pages from page ``lo``: unhashed, one ``preadv``; hashed, one ``preadv`` per
        ``group`` bytes, each group hashed right after its copy while it is still in the CPU
        caches (the best one-thread loop measured: on the 2-core VM 227 us per 4 MiB call against
        294 us for one ``preadv`` then the hashes; ``group=0``: that one ``preadv`` first)."""
        bufs = self.bufs[:n]
        if not hashed:
            os.preadv(self.fd, bufs, lo * self.page)
            return
        k = max(1, group // self.page) if group else n
        for a in range(0, n, k):
            part = bufs[a : a + k]
            os.preadv(self.fd, part, (lo + a) * self.page)
            for b in part:
                xxhash.xxh3_64_intdigest(b)

    def read_pages(self, lo: int, n: int, hashed: bool = True) -> None:
        b = self.bufs[0]
        for i in range(n):
            os.preadv(self.fd, [b], (lo + i) * self.page)
            if hashed:
                xxhash.xxh3_64_intdigest(b)

    def drop(self) -> None:
        os.fsync(self.fd)
        os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def warm(self) -> None:
        scratch = bytearray(MiB)
        pos = 0
        while os.preadv(self.fd, [scratch], pos) > 0:
            pos += len(scratch)


def _slot_paths(store: str) -> list[str]:
    out = []
    for dirpath, _, names in os.walk(store):
        out += [os.path.join(dirpath, n) for n in names if n.endswith((".slots", ".data", ".mdb"))
                or n.startswith("data")]
    return out


def _drop_files(paths: list[str]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _warm_files(paths: list[str]) -> None:
    scratch = bytearray(MiB)
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            pos = 0
            while os.preadv(fd, [scratch], pos) > 0:
                pos += len(scratch)
        finally:
            os.close(fd)


def _read_many(prov: Any, ks: list[Key], outs: list[bytearray]) -> list[bool]:
    """``read_many``, or a ``read`` loop where a provider has no batch path (older trees)."""
    if hasattr(prov, "read_many"):
        return list(prov.read_many(ks, outs))
    return [prov.read(k, o) for k, o in zip(ks, outs, strict=True)]


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


Row = tuple[str, float, float, float]  # case, provider MiB/s, baseline MiB/s, ratio


def _opener(kind: str, path: str, page: int, budget: int, durability: str = "process",
            verify: str = "read") -> Any:
    if kind == "mmap":
        return MmapProvider(path, budget_bytes=budget, slot_nbytes=page, durability=durability, verify=verify)
    return LmdbProvider(path, budget_bytes=budget, durability=durability, inline_max=0,
                        file_nbytes=max(page, 256 * MiB))


def _round(kind: str, rep: int, root: str, page: int, npages: int, chunk: int, data: list[bytes],
           acc: dict[str, list[tuple[float, float, float]]]) -> None:
    """One round of every case for one provider kind; appends (ratio, provider MiB/s, raw MiB/s)."""
    nb = npages * page
    outs = [bytearray(page) for _ in range(chunk)]
    budget = (npages + 2 * chunk) * page
    store = os.path.join(root, f"{kind}-{rep}")
    raw = _Raw(os.path.join(root, f"raw-{kind}-{rep}.bin"), page, npages, chunk)
    p = _opener(kind, store, page, budget)
    keys = _keys(npages, f"{kind}-{rep}")
    calls = list(range(0, npages, chunk))

    def add(case: str, tp: float, tr: float, nbytes: int) -> None:
        acc.setdefault(f"{kind}: {case}", []).append((tr / tp, nbytes / tp / MiB, nbytes / tr / MiB))

    def put(prov: Any, ks: list[Key], lo: int) -> None:
        items = [(k, None, data[(lo + j) % 16]) for j, k in enumerate(ks)]
        got = prov.put_many(items) if hasattr(prov, "put_many") else [prov.put(*it) for it in items]
        if got != [True] * len(ks):
            raise RuntimeError(f"put_many failed: {got[:3]}")

    def writes(case: str, prov: Any, ks_all: list[Key], sync: bool = False, case2: str = "",
               base: _Raw | None = None, base2: _Raw | None = None) -> None:
        """``put_many`` chunk by chunk against the raw loop (with ``case2``: against a second
        baseline too, raw + two syncs per call, measured in the same interleaving; ``base``,
        ``base2``: the raw files of the two, default the round's)."""
        raw_ = base or raw
        raw2 = base2 or raw
        for lo in range(0, len(ks_all), chunk):
            ks = ks_all[lo : lo + chunk]
            d = [data[(lo + j) % 16] for j in range(len(ks))]
            tr = _timed(lambda: raw_.write(lo, d, sync))  # noqa: B023  (called at once)
            tr2 = _timed(lambda: raw2.write(lo, d, 2)) if case2 else 0.0  # noqa: B023
            tp = _timed(lambda: put(prov, ks, lo))  # noqa: B023
            add(case, tp, tr, len(ks) * page)
            if case2:
                add(case2, tp, tr2, len(ks) * page)

    def warm_reads(case: str, prov: Any, ks_all: list[Key], hashed: bool, per_page: bool) -> None:
        _warm_files(_slot_paths(store))
        raw.warm()
        for c, lo in enumerate(calls):
            ks = ks_all[lo : lo + chunk]
            n = len(ks)
            if per_page:
                sides = {"raw": lambda: raw.read_pages(lo, n, hashed),  # noqa: B023
                         "prov": lambda: [prov.read(k, outs[0]) for k in ks]}  # noqa: B023
            else:
                sides = {"raw": lambda: raw.read(lo, n, hashed),  # noqa: B023
                         "prov": lambda: _read_many(prov, ks, outs[:n])}  # noqa: B023
                if hashed:  # the same provider call against the weaker one-preadv-then-hash loop
                    sides["raw1"] = lambda: raw.read(lo, n, hashed, group=0)  # noqa: B023
            # the sides in turn first (the one after another reads what the CPU caches kept)
            names = list(sides)
            names = names[c % len(names):] + names[: c % len(names)]
            t = {name: _timed(sides[name]) for name in names}
            if "raw1" in t:
                add(case + " (vs one preadv, then the hashes)", t["prov"], t["raw1"], n * page)
            add(case, t["prov"], t["raw"], n * page)

    def cold_reads(case: str, prov: Any, ks_all: list[Key], hashed: bool) -> None:
        def raw_pass() -> None:
            for lo in calls:
                raw.read(lo, min(chunk, npages - lo), hashed)

        def prov_pass() -> None:
            for lo in calls:
                ks = ks_all[lo : lo + chunk]
                _read_many(prov, ks, outs[: len(ks)])

        for r in range(2):
            got: dict[str, float] = {}
            sides = [("raw", raw_pass), ("prov", prov_pass)]
            for name, fn in sides if r % 2 == 0 else sides[::-1]:
                _drop_files(_slot_paths(store))
                raw.drop()
                got[name] = _timed(fn)
            add(case, got["prov"], got["raw"], nb)

    writes("put_many, fresh space", p, keys)
    warm_reads("read_many, warm", p, keys, True, False)
    warm_reads("read per page, warm", p, keys, True, True)
    cold_reads("read_many, cold", p, keys, True)
    # overwrite: evict the whole pass, write new keys into the freed slots
    p.evict(keys)
    keys2 = _keys(npages, f"{kind}-{rep}-2")
    writes("put_many, freed slots", p, keys2)
    p.close()
    if kind == "mmap":  # verify=never: against raw reads without the hash
        q = _opener(kind, store, page, budget, verify="never")
        warm_reads("read_many, warm, verify=never (vs raw, no hash)", q, keys2, False, False)
        cold_reads("read_many, cold, verify=never (vs raw, no hash)", q, keys2, False)
        q.close()
    # durability=sync: put_many (one sync per call) against raw + XXH3 + fdatasync per call
    # (fresh raw files too, one per baseline: the store writes fresh space, whose first write
    # converts unwritten extents, metadata that each fdatasync then commits: measured 2.5-2.9 ms
    # per 4 MiB call against 2.0 ms into written space on the dev machine's disk)
    ps = _opener(kind, store + "-sync", page, budget, durability="sync")
    raw_s1 = _Raw(os.path.join(root, f"raw-{kind}-{rep}-sync1.bin"), page, npages, chunk)
    raw_s2 = _Raw(os.path.join(root, f"raw-{kind}-{rep}-sync2.bin"), page, npages, chunk)
    writes("put_many, durability=sync (vs raw + fdatasync per call)", ps, _keys(npages // 4, f"{kind}-{rep}-3"),
           sync=True, case2="put_many, durability=sync (vs raw + 2 fdatasyncs per call: data, then a journal "
                            "record per page)", base=raw_s1, base2=raw_s2)
    ps.close()
    raw_s1.close()
    raw_s2.close()
    raw.close()
    shutil.rmtree(store, ignore_errors=True)
    shutil.rmtree(store + "-sync", ignore_errors=True)


def bench(root: str, page: int, npages: int, chunk: int, rounds: int) -> list[Row]:
    data = [np.random.default_rng(i).bytes(page) for i in range(16)]
    acc: dict[str, list[tuple[float, float, float]]] = {}
    for rep in range(rounds):
        for kind in ("mmap", "lmdb"):
            _round(kind, rep, root, page, npages, chunk, data, acc)
    return [(n, statistics.median(v[1] for v in vs), statistics.median(v[2] for v in vs),
             statistics.median(v[0] for v in vs)) for n, vs in acc.items()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--page", type=int, default=256 * 1024)
    ap.add_argument("--pages", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    root = tempfile.mkdtemp(prefix="bench-io-", dir=a.dir)
    try:
        rows = bench(root, a.page, a.pages, a.chunk, a.rounds)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs ({usable} usable: the batch paths' parallel "
          f"threshold follows this), {a.page // 1024} KiB pages, {a.pages} pages "
          f"per pass, {a.chunk} per call, {a.rounds} rounds\n")
    print("| case | provider MiB/s | baseline MiB/s | ratio (median of paired) |")
    print("| --- | ---: | ---: | ---: |")
    for name, rp, rr, ratio in rows:
        print(f"| {name} | {rp:,.0f} | {rr:,.0f} | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
