"""mmap provider against raw file I/O, side by side in one process on the same disk.

Measures, for 256 KiB pages (``--page``):

* sequential and random page **writes**: ``reserve``/``write``/``seal`` (``durability=process``)
  vs ``os.pwrite`` of the same bytes into a ``posix_fallocate``-d file; "random" writes land in
  slots freed in random order (the provider) / at random page offsets (raw);
* sequential and random page **reads**, cold (``fsync`` + ``POSIX_FADV_DONTNEED`` on the data
  file, mappings dropped first) and page-cache warm: ``read(key, out)`` with ``verify=read``
  (the default: XXH3 of every page) and ``verify=never``, vs ``os.preadv`` into the same buffer
  at the same file offsets in the same order ("sequential" is the provider's slot order: after
  the random writes, page order is not slot order).  Cold rows time *whole passes* (cache
  dropped before each, sides alternating, ``--cold-rounds`` of each): interleaving cold reads
  chunk by chunk would let one side's kernel read-ahead run on while the other side is timed;
* every per-page case also against **raw + XXH3**: the same raw loop plus the XXH3-64 of each
  page (of ``out`` after a read, of the source before a write) -- the checksum the contract
  requires (recorded at seal, verified on read), so that ratio is the provider's own cost;
* the same writes and reads through the **batch** path, ``put_many``/``read_many`` of 16 pages
  per call, against the per-page raw loop and against raw vectored I/O (``pwritev``/``preadv``
  of each run of adjacent pages: what the batch path does too);
* **seal rate** of 16 KiB pages with ``sync`` and ``process``, from 1 and 8 threads (group
  commit: concurrent seals share one data sync and one journal sync);
* **reopen** time of a store of 10k / 100k / 1M entries (built synthetically: slot headers and a
  snapshot written with numpy, then opened by the provider), warm page cache.

Usage: ``python3 benchmarks/bench_mmap.py [--dir DIR] [--pages N] [--reopen 10000,100000,1000000]``;
prints a markdown table.  DIR must be on the disk you care about (default: a temp dir under
``/tmp``); it is deleted at the end.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable

import numpy as np
import xxhash

from hostkv_providers.providers import Key, MmapProvider
from hostkv_providers.providers.mmap.format import (
    FILE_HEADER_NBYTES,
    OP_SEAL,
    RECORD_DTYPE,
    SLOT_HEADER_DTYPE,
    SLOT_MAGIC,
    SlotFile,
    fold_records,
)

MiB = 1 << 20


def _keys(n: int, tag: str) -> list[bytes]:
    import hashlib

    return [hashlib.blake2b(f"{tag}/{i}".encode(), digest_size=32).digest() for i in range(n)]


def _drop(paths: list[str]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _rate(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / MiB


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


class _Side:
    """Per-chunk seconds and bytes of one side of an interleaved comparison."""

    def __init__(self) -> None:
        self.chunks: dict[str, list[tuple[float, int]]] = {}

    def add(self, case: str, seconds: float, nbytes: int) -> None:
        self.chunks.setdefault(case, []).append((seconds, nbytes))

    def rate(self, case: str) -> float | None:
        """Median MiB/s over the chunks: a burst of load on this shared machine hits a few
        chunks, and a median ignores them where a sum would not."""
        if case not in self.chunks:
            return None
        return statistics.median(_rate(n, t) for t, n in self.chunks[case])

    def ratio(self, case: str, other: _Side) -> float | None:
        """Median over chunks of (this side's rate / ``other``'s rate of the adjacent chunk)."""
        if case not in self.chunks or case not in other.chunks:
            return None
        return statistics.median(t_o / t for (t, _), (t_o, _) in zip(self.chunks[case], other.chunks[case],
                                                                     strict=True))


def _runs(idx: list[int]) -> list[list[int]]:
    """``idx`` split where consecutive pages stop being adjacent (for vectored raw I/O)."""
    out: list[list[int]] = []
    for i in idx:
        if out and out[-1][-1] + 1 == i:
            out[-1].append(i)
        else:
            out.append([i])
    return out


Row = tuple[str, float, float, float, float | None, float | None, float | None, float | None]


def bench_io(root: str, page: int, npages: int, repeat: int, chunk: int = 16, cold_rounds: int = 3) -> list[Row]:
    """Rows ``(case, provider MiB/s, raw MiB/s, ratio, raw+XXH3 MiB/s, ratio, raw vectored MiB/s,
    ratio)`` (``None``: no such side), medians over chunks (warm) or passes (cold).

    The sides are *interleaved* in chunks of ``chunk`` pages (raw chunk, provider chunk, raw
    chunk, ...), so all see the same machine load: on a busy machine a sequential A-then-B
    comparison mostly measures the load.  Rates are medians over chunks, ratios medians of the
    per-chunk ratios of adjacent chunks.  Per-page cases call
    ``reserve``/``write``/``seal`` and ``read`` once per page, against one ``pwrite``/``preadv``
    per page.  Batch cases (``put_many``/``read_many`` of one chunk per call) are compared with
    the same per-page raw loop *and* with raw vectored I/O (one ``pwritev``/``preadv`` per run of
    adjacent pages in the chunk: all 16 when sequential, one page each when random), because the
    provider's batch path coalesces adjacent runs the same way.
    """
    rng = random.Random(0)
    data = [np.random.default_rng(i).bytes(page) for i in range(16)]
    order_seq = list(range(npages))
    order_rnd = order_seq[:]
    rng.shuffle(order_rnd)
    half = order_rnd[: npages // 2]
    in_half = set(half)
    raw, rawh, rawv, prov = _Side(), _Side(), _Side(), _Side()
    digest = xxhash.xxh3_64_intdigest
    for rep in range(repeat):
        # one file per raw side: every side then touches its own bytes once per chunk (on a
        # machine whose L3 holds a whole run, a side re-reading bytes another side has just
        # touched would be served from the CPU cache)
        raw_paths = [os.path.join(root, f"raw-{name}.bin") for name in ("plain", "xxh3", "vectored")]
        raw_fds = [os.open(rp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600) for rp in raw_paths]
        for f in raw_fds:
            os.posix_fallocate(f, 0, page * npages)
        fd, fd_h, fd_v = raw_fds
        bufs = [bytearray(page) for _ in range(chunk)]
        out = bufs[0]
        for io in ("pread", "mmap"):
            store = os.path.join(root, f"store-{io}-{rep}")
            p = MmapProvider(store, budget_bytes=page * npages, slot_nbytes=page, file_nbytes=page * npages, io=io)
            sfx = "" if io == "pread" else ", io=mmap"

            def raw_write(idx: list[int], fd: int = fd) -> None:
                for i in idx:
                    os.pwrite(fd, data[i % 16], i * page)

            def raw_write_h(idx: list[int], fd: int = fd_h) -> None:
                for i in idx:
                    digest(data[i % 16])
                    os.pwrite(fd, data[i % 16], i * page)

            def raw_write_v(idx: list[int], fd: int = fd_v) -> None:
                for run in _runs(idx):
                    os.pwritev(fd, [data[i % 16] for i in run], run[0] * page)

            # where page i lies in the provider's data file (slot); raw reads of page i read that
            # position of the raw file, so both sides read the same offsets in the same order
            pos = list(range(npages))

            def raw_read(idx: list[int], fd: int = fd, out: bytearray = out, pos: list[int] = pos) -> None:
                for i in idx:
                    os.preadv(fd, [out], pos[i] * page)

            def raw_read_h(idx: list[int], fd: int = fd_h, out: bytearray = out, pos: list[int] = pos) -> None:
                for i in idx:
                    os.preadv(fd, [out], pos[i] * page)
                    digest(out)

            def raw_read_v(idx: list[int], fd: int = fd_v, bufs: list[bytearray] = bufs, pos: list[int] = pos) -> None:
                k = 0
                for run in _runs([pos[i] for i in idx]):
                    os.preadv(fd, bufs[k : k + len(run)], run[0] * page)
                    k += len(run)

            def put(ks: list[bytes], idx: list[int], p: MmapProvider = p) -> None:
                for i in idx:
                    res = p.reserve(ks[i], None, page)
                    assert res is not None
                    res.write(0, data[i % 16])
                    res.seal()

            def put_many(ks: list[bytes], idx: list[int], p: MmapProvider = p) -> None:
                if p.put_many([(ks[i], None, data[i % 16]) for i in idx]) != [True] * len(idx):
                    raise RuntimeError("benchmark put_many failed")

            def cold(p: MmapProvider = p, raw_fds: list[int] = raw_fds) -> None:
                for f in raw_fds:
                    os.fsync(f)
                    os.posix_fadvise(f, 0, 0, os.POSIX_FADV_DONTNEED)
                for sf in p._files.values():
                    sf.sync()
                    sf.drop_cache()

            def warm(p: MmapProvider = p, raw_fds: list[int] = raw_fds) -> None:
                """Bring both sides' files back into the page cache (a cold pass dropped them)."""
                scratch = bytearray(1 << 20)
                for f in raw_fds + [sf.fd for sf in p._files.values()]:
                    pos = 0
                    while os.preadv(f, [scratch], pos) > 0:
                        pos += len(scratch)

            def interleave(case: str, raw_fn: Callable[[list[int]], None], prov_fn: Callable[[list[int]], None],
                           idx: list[int], raw_v: Callable[[list[int]], None] | None = None,
                           raw_h: Callable[[list[int]], None] | None = None) -> None:
                sides = [(raw, raw_fn), (prov, prov_fn), (rawh, raw_h), (rawv, raw_v)]
                for lo in range(0, len(idx), chunk):
                    part = idx[lo : lo + chunk]
                    for side, fn in sides:
                        if fn is not None:
                            side.add(case, timed(lambda part=part, fn=fn: fn(part)), page * len(part))  # type: ignore[misc]

            def passes(case: str, raw_fn: Callable[[list[int]], None], prov_fn: Callable[[list[int]], None],
                       idx: list[int], raw_v: Callable[[list[int]], None] | None = None,
                       raw_h: Callable[[list[int]], None] | None = None) -> None:
                """Cold reads: whole passes over ``idx`` (in ``chunk``-page calls), the page cache
                dropped before each, sides in a rotating order."""
                sides = [(s, fn) for s, fn in [(raw, raw_fn), (prov, prov_fn), (rawh, raw_h), (rawv, raw_v)]
                         if fn is not None]
                for r in range(cold_rounds):
                    for side, fn in sides[r % len(sides):] + sides[: r % len(sides)]:
                        cold()
                        t0 = time.perf_counter()
                        for lo in range(0, len(idx), chunk):
                            fn(idx[lo : lo + chunk])
                        side.add(case, time.perf_counter() - t0, page * len(idx))

            # Writes, per page into one half and put_many into the other: first into fresh
            # preallocated space (on this VM the kernel's first write of an unwritten extent
            # dominates and varies from file to file), then overwriting slots freed by eviction
            # (raw: the same offsets again) -- where the provider's own costs show; then into
            # slots freed in random order.
            keys = _keys(npages, f"io-{io}-{rep}")
            keys2 = _keys(npages, f"io2-{io}-{rep}")
            keys3 = _keys(npages, f"io3-{io}-{rep}")
            first, second = order_seq[: npages // 2], order_seq[npages // 2 :]
            interleave("write, sequential, fresh space" + sfx, raw_write, functools.partial(put, keys), first,
                       raw_h=raw_write_h)
            interleave("write, sequential, fresh space, put_many" + sfx, raw_write,
                       functools.partial(put_many, keys), second, raw_write_v, raw_write_h)
            p.evict(keys)
            for f in raw_fds:  # from here on every raw side overwrites written extents, as the provider does
                for i in range(npages):
                    os.pwrite(f, data[i % 16], i * page)
            interleave("write, sequential" + sfx, raw_write, functools.partial(put, keys2), first, raw_h=raw_write_h)
            interleave("write, sequential, put_many" + sfx, raw_write, functools.partial(put_many, keys2), second,
                       raw_write_v, raw_write_h)
            live = list(keys2)
            if io == "pread":
                quarter = half[: npages // 4]
                rest = half[npages // 4 :]
                p.evict([keys2[i] for i in half])  # random holes in the provider's slots ...
                interleave("write, random (into freed slots)", raw_write, functools.partial(put, keys3), quarter,
                           raw_h=raw_write_h)
                interleave("write, random (into freed slots), put_many", raw_write,
                           functools.partial(put_many, keys3), rest, raw_write_v, raw_write_h)
                live = [keys3[i] if i in in_half else keys2[i] for i in range(npages)]
            pos[:] = [int(p._idx.slot[p._idx.row_of(k)]) for k in live]  # one data file: slot = position
            in_slot_order = sorted(range(npages), key=pos.__getitem__)

            def get(live: list[bytes], idx: list[int], p: MmapProvider = p, out: bytearray = out) -> None:
                for i in idx:
                    if not p.read(live[i], out):
                        raise RuntimeError("benchmark read missed")

            def get_many(live: list[bytes], idx: list[int], p: MmapProvider = p,
                         bufs: list[bytearray] = bufs) -> None:
                if not all(p.read_many([live[i] for i in idx], bufs[: len(idx)])):
                    raise RuntimeError("benchmark read_many missed")

            for verify in ((True, False) if io == "pread" else (True,)):
                p._verify_reads = verify
                vs = "" if verify else ", verify=never"
                for kind, order in (("sequential", in_slot_order), ("random", order_rnd)):
                    if io == "mmap" and kind == "random":
                        continue
                    for how, fn, rv in (("", get, None), (", read_many", get_many, raw_read_v)):
                        # raw + XXH3 is the floor of verify=read; with verify=never it means nothing
                        rh = raw_read_h if verify else None
                        passes(f"read cold, {kind}{vs}{how}{sfx}", raw_read, functools.partial(fn, live), order,
                               rv, rh)
                        warm()
                        interleave(f"read warm, {kind}{vs}{how}{sfx}", raw_read, functools.partial(fn, live), order,
                                   rv, rh)
            p.close()
            shutil.rmtree(store)
        for f, rp in zip(raw_fds, raw_paths, strict=True):
            os.close(f)
            os.unlink(rp)
    rows: list[Row] = []
    for case in prov.chunks:
        pv, raw_rate, ratio = prov.rate(case), raw.rate(case), prov.ratio(case, raw)
        assert pv is not None and raw_rate is not None and ratio is not None
        rows.append((case, pv, raw_rate, ratio, rawh.rate(case), prov.ratio(case, rawh), rawv.rate(case),
                     prov.ratio(case, rawv)))
    return rows


def bench_seals(root: str, n: int) -> list[tuple[str, float]]:
    page = 16384
    payload = np.random.default_rng(1).bytes(page)
    rows = []
    for durability in ("process", "sync"):
        for threads in (1, 8):
            store = os.path.join(root, f"seal-{durability}-{threads}")
            p = MmapProvider(store, budget_bytes=(n + 64) * page, slot_nbytes=page, durability=durability)
            keys = _keys(n, f"seal-{durability}-{threads}")
            per = n // threads

            def work(ks: list[bytes], p: MmapProvider = p) -> None:
                for k in ks:
                    p.put(k, None, payload)

            ts = [threading.Thread(target=work, args=(keys[i * per : (i + 1) * per],)) for i in range(threads)]
            t0 = time.perf_counter()
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            dt = time.perf_counter() - t0
            syncs = p.stats().extra["syncs"]
            p.close()
            shutil.rmtree(store)
            rows.append((f"seal 16 KiB, durability={durability}, {threads} thread(s)"
                         + (f" ({per * threads / max(syncs, 1):.1f} seals per sync)" if durability == "sync" else ""),
                         per * threads / dt))
    return rows


def build_synthetic(store: str, n: int, chain_len: int = 16) -> None:
    """A store of ``n`` 4 KiB entries (chains of ``chain_len``) written directly: valid slot
    headers and a snapshot, as a writer that sealed them and closed would leave them."""
    slot = 4096
    p = MmapProvider(store, budget_bytes=n * slot, slot_nbytes=slot, file_nbytes=n * slot)
    p.close()
    data_path = next(os.path.join(store, f) for f in os.listdir(store) if f.endswith(".slots"))
    rng = np.random.default_rng(n)
    keys = rng.integers(0, 2**63, size=(n, 4), dtype=np.int64).view("V32").reshape(n)
    csum = xxhash.xxh3_64_intdigest(bytes(slot))
    sf = SlotFile.open(data_path, writable=True)
    h = np.zeros(n, SLOT_HEADER_DTYPE)
    h["magic"] = SLOT_MAGIC
    h["key"] = keys
    idx = np.arange(n)
    has_parent = idx % chain_len != 0
    h["parent"][has_parent] = keys[idx[has_parent] - 1]
    h["flags"] = has_parent.astype(np.uint32)
    h["generation"] = idx + 1
    h["nbytes"] = slot
    h["checksum"] = csum
    raw = h.view(np.uint8).reshape(n, 128)
    sums = np.fromiter((xxhash.xxh3_64_intdigest(raw[i, :120].tobytes()) for i in range(n)), np.uint64, n)
    h["header_checksum"] = sums
    sf.headers()[:n] = h
    sf.sync()
    sf.close()
    recs = np.zeros(n, RECORD_DTYPE)
    recs["op"] = OP_SEAL
    recs["key"] = keys
    recs["parent"] = h["parent"]
    recs["flags"] = has_parent.astype(np.uint8)
    recs["hint"][has_parent] = idx[has_parent]  # 1 + the parent's position (idx - 1)
    recs["file"] = 0
    recs["slot"] = idx
    recs["nslots"] = 1
    recs["nbytes"] = slot
    recs["gen"] = idx + 1
    recs["checksum"] = csum
    recs["created"] = time.time()
    recs["seq"] = idx + 1
    fold_records(recs)
    with open(os.path.join(store, "manifest.json"), encoding="utf-8") as mf:
        man_store_id = bytes.fromhex(json.load(mf)["store_id"])
    head = bytearray(64)
    head[:8] = b"HKVSNAP1"
    head[8:24] = man_store_id
    head[24:32] = (n + 1).to_bytes(8, "little")
    head[32:40] = n.to_bytes(8, "little")
    head[40:48] = (1).to_bytes(8, "little")
    head[56:64] = xxhash.xxh3_64_intdigest(bytes(head[:56])).to_bytes(8, "little")
    with open(os.path.join(store, "index.1.snap"), "wb") as f:
        f.write(bytes(head).ljust(4096, b"\0"))
        f.write(recs.tobytes())
    os.chmod(os.path.join(store, "index.1.snap"), 0o600)
    _ = FILE_HEADER_NBYTES


def bench_reopen(root: str, counts: list[int], repeat: int) -> list[tuple[str, float, float, float, float, int]]:
    rows = []
    for n in counts:
        store = os.path.join(root, f"reopen-{n}")
        build_synthetic(store, n)
        times, rtimes = [], []
        entries = 0
        for _ in range(repeat):
            t0 = time.perf_counter()
            p = MmapProvider(store)
            k = p._idx.key_of(n // 2)
            assert p.present([k]) == [True]
            times.append(time.perf_counter() - t0)
            entries = p.stats().entries
            p._jrecords = 0  # close without rewriting the snapshot: keep the synthetic one
            p.close()
            t0 = time.perf_counter()
            r = MmapProvider(store, readonly=True)
            rtimes.append(time.perf_counter() - t0)
            r.close()
        shutil.rmtree(store)
        rows.append((f"{n:,}", min(times), statistics.median(times), min(rtimes), statistics.median(rtimes),
                     entries))
    return rows


def bench_snapshot_stall(root: str, counts: list[int], rounds: int = 2) -> list[tuple[str, str, float, float]]:
    """How long other threads wait while a writer snapshots its index: a thread calls
    ``present()`` every millisecond while the writer writes a snapshot (a) the way open, close
    and repair do, under the provider lock throughout (what the seal paths did before), and (b)
    the way the seal paths do now (``_snapshot_due``: the lock only to capture the live rows and
    to install the file).  Rows ``(entries, way, snapshot s, longest present() s)``, medians."""
    rows = []
    for n in counts:
        store = os.path.join(root, f"stall-{n}")
        build_synthetic(store, n)
        p = MmapProvider(store)
        probe = [p._idx.key_of(i) for i in range(0, n, max(1, n // 16))]
        results: dict[str, list[tuple[float, float]]] = {"under the lock": [], "seal path (now)": []}
        for _ in range(rounds):
            for way in results:
                lat: list[float] = []
                stop = threading.Event()

                def poll(lat: list[float] = lat, stop: threading.Event = stop, p: MmapProvider = p,
                         probe: list[Key] = probe) -> None:
                    while not stop.is_set():
                        t0 = time.perf_counter()
                        p.present(probe)
                        lat.append(time.perf_counter() - t0)
                        time.sleep(0.001)

                th = threading.Thread(target=poll)
                th.start()
                time.sleep(0.05)
                t0 = time.perf_counter()
                if way == "under the lock":
                    p._snapshot()
                else:
                    p._snap_due = True
                    p._snapshot_due()
                dt = time.perf_counter() - t0
                time.sleep(0.05)
                stop.set()
                th.join()
                results[way].append((dt, max(lat)))
        p.close()
        shutil.rmtree(store)
        for way, got in results.items():
            rows.append((f"{n:,}", way, statistics.median(t for t, _ in got), statistics.median(w for _, w in got)))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=None, help="where to put the files (default: a temp dir in /tmp)")
    ap.add_argument("--page", type=int, default=256 * 1024)
    ap.add_argument("--pages", type=int, default=1024, help="pages per I/O run (default 1024 = 256 MiB)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--seals", type=int, default=800)
    ap.add_argument("--reopen", default="10000,100000,1000000")
    ap.add_argument("--cold-rounds", type=int, default=3, help="cold passes per side and case (default 3)")
    ap.add_argument("--stall", default="100000,1000000", help="entry counts for the snapshot-stall rows")
    args = ap.parse_args()
    base = args.dir or tempfile.gettempdir()
    os.makedirs(base, exist_ok=True)
    root = tempfile.mkdtemp(prefix="hostkv-bench-mmap-", dir=base)
    os.chmod(root, 0o700)
    try:
        io_rows = bench_io(root, args.page, args.pages, args.repeat, cold_rounds=args.cold_rounds)
        seal_rows = bench_seals(root, args.seals)
        reopen_rows = bench_reopen(root, [int(x) for x in args.reopen.split(",") if x], args.repeat)
        stall_rows = bench_snapshot_stall(root, [int(x) for x in args.stall.split(",") if x])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"### mmap provider vs raw file I/O ({args.page // 1024} KiB pages, {args.pages} pages per run, "
          f"{args.repeat} runs; warm: medians over 16-page chunks, cold: over {args.cold_rounds} whole passes "
          "per run)\n")
    print("| case | mmap provider MiB/s | raw, one call per page MiB/s | ratio | raw + XXH3 MiB/s | ratio "
          "| raw, vectored MiB/s | ratio |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")

    def col(rate: float | None, ratio: float | None) -> str:
        return f"{rate:,.0f} | {ratio:.2f}x" if rate is not None and ratio is not None else "- | -"

    for name, pv, rv, ratio, hv, hratio, vv, vratio in io_rows:
        print(f"| {name} | {pv:,.0f} | {rv:,.0f} | {ratio:.2f}x | {col(hv, hratio)} | {col(vv, vratio)} |")
    print("\n| seals | per second |")
    print("| --- | ---: |")
    for name, rate in seal_rows:
        print(f"| {name} | {rate:,.0f} |")
    print("\n| reopen (entries) | writer open, s (best / median) | reader open, s (best / median) | entries loaded |")
    print("| ---: | ---: | ---: | ---: |")
    for n, t, tm, rt, rtm, e in reopen_rows:
        print(f"| {n} | {t:.3f} / {tm:.3f} | {rt:.3f} / {rtm:.3f} | {e:,} |")
    print("\n| snapshot (entries) | written | snapshot s | longest present() of another thread meanwhile, s |")
    print("| ---: | --- | ---: | ---: |")
    for n, way, dt, wait in stall_rows:
        print(f"| {n} | {way} | {dt:.3f} | {wait:.3f} |")


if __name__ == "__main__":
    main()
