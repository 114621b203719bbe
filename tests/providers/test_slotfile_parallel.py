"""Batch reads and writes of slot files spread over the I/O threads (``_slotfile._spread``).

Large ``put_many``/``read_many`` batches of the mmap and lmdb providers go out on a few threads
(several requests in flight, hashes on several cores); small ones stay on the caller's thread.
Both paths are run here on the same workload: the bytes, the checksums, a corrupt page and an
I/O error must come out the same way.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import xxhash

import hostkv_providers.providers._slotfile as slotfile
from hostkv_providers import InvalidArgumentError, LmdbProvider, MmapProvider, Provider, StorageIOError
from hostkv_providers.testing import chain, page_bytes

MiB = 1 << 20
PAGE = MiB
N = 24  # 24 MiB per batch: past the parallel threshold, 24 groups of one page each


def _open(kind: str, path: Path) -> Provider:
    if kind == "mmap":
        return MmapProvider(str(path), budget_bytes=64 * MiB, slot_nbytes=PAGE)
    return LmdbProvider(path, budget_bytes=64 * MiB, inline_max=0, file_nbytes=64 * MiB)


@pytest.fixture(params=[("mmap", True), ("mmap", False), ("lmdb", True), ("lmdb", False)],
                ids=["mmap-threads", "mmap-inline", "lmdb-threads", "lmdb-inline"])
def store(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[
        tuple[Provider, bool, list[str]]]:
    kind, threaded = request.param
    if not threaded:
        monkeypatch.setattr(slotfile, "_PARALLEL_MIN_NBYTES", 1 << 62)
    names: list[str] = []
    real_preadv, real_pwritev = os.preadv, os.pwritev

    def preadv(fd: int, bufs: list[memoryview], offset: int) -> int:
        names.append(threading.current_thread().name)
        return real_preadv(fd, bufs, offset)

    def pwritev(fd: int, bufs: list[memoryview], offset: int) -> int:
        names.append(threading.current_thread().name)
        return real_pwritev(fd, bufs, offset)

    monkeypatch.setattr(os, "preadv", preadv)
    monkeypatch.setattr(os, "pwritev", pwritev)
    monkeypatch.setattr(os, "pwrite", lambda fd, b, off: pwritev(fd, [b], off))
    p = _open(kind, tmp_path / "s")
    yield p, threaded, names
    p.close()


def _items(tag: str) -> tuple[list[bytes], list[tuple[bytes, bytes | None, bytes]]]:
    keys = chain(tag, N)
    return keys, [(k, keys[i - 1] if i else None, page_bytes(k, PAGE)) for i, k in enumerate(keys)]


def test_large_batches_round_trip_on_either_path(store: tuple[Provider, bool, list[str]]) -> None:
    p, threaded, names = store
    keys, items = _items("par-rt")
    assert p.put_many(items) == [True] * N  # type: ignore[attr-defined]
    wrote = set(names)
    names.clear()
    outs = [bytearray(PAGE) for _ in keys]
    assert p.read_many(keys, outs) == [True] * N  # type: ignore[attr-defined]
    assert [bytes(o) for o in outs] == [page_bytes(k, PAGE) for k in keys]
    used_pool = {n.startswith("hostkv-io") for n in wrote | set(names)}
    assert (True in used_pool) == threaded  # the threads ran the I/O exactly when they should
    # the seal-time checksums are those of the bytes (the per-page path verifies them too)
    assert all(p.read_bytes(k) == page_bytes(k, PAGE) for k in keys)
    report = p.verify()  # type: ignore[attr-defined]
    assert report.ok


def test_a_corrupt_page_in_a_large_batch_is_a_miss_and_dropped(store: tuple[Provider, bool, list[str]]) -> None:
    p, _, _ = store
    keys, items = _items("par-bad")
    assert p.put_many(items) == [True] * N  # type: ignore[attr-defined]
    info = [e for e in p.iter_entries() if e.key == keys[17]]  # type: ignore[attr-defined]
    assert info
    # flip a byte of page 17 on disk, through the file the provider reads
    target = bytes(page_bytes(keys[17], PAGE)[:64])
    hit = None
    for dirpath, _, files in os.walk(getattr(p, "path", None) or getattr(p, "_path")):  # noqa: B009
        for f in files:
            full = os.path.join(dirpath, f)
            with open(full, "rb") as fh:
                blob = fh.read()
            at = blob.find(target)
            if at >= 0:
                hit = (full, at + 100)
    assert hit is not None
    fd = os.open(hit[0], os.O_RDWR)
    try:
        b = os.pread(fd, 1, hit[1])
        os.pwrite(fd, bytes([b[0] ^ 0xFF]), hit[1])
    finally:
        os.close(fd)
    outs = [bytearray(PAGE) for _ in keys]
    got = p.read_many(keys, outs)  # type: ignore[attr-defined]
    assert got == [True] * 17 + [False] + [True] * (N - 18)
    assert [bytes(o) for o in outs[:17]] == [page_bytes(k, PAGE) for k in keys[:17]]
    assert p.stats().checksum_failures == 1
    assert p.present(keys) == [True] * 17 + [False] * (N - 17)  # dropped with its subtree


def test_an_io_error_on_a_worker_fails_the_batch(store: tuple[Provider, bool, list[str]],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    p, _, _ = store
    keys, items = _items("par-eio")
    written = [0]
    real = os.pwritev

    def failing(fd: int, bufs: list[memoryview], offset: int) -> int:
        # the call that would carry the 18th MiB fails, whatever the grouping (one call for
        # the batch while the pool hashes, or a call per group hashed right before it)
        written[0] += sum(memoryview(b).nbytes for b in bufs)
        if written[0] > 17 * MiB:
            raise OSError(errno.EIO, "simulated I/O error")
        return real(fd, bufs, offset)

    monkeypatch.setattr(os, "pwritev", failing)
    monkeypatch.setattr(os, "pwrite", lambda fd, b, off: failing(fd, [b], off))
    with pytest.raises(StorageIOError):
        p.put_many(items)  # type: ignore[attr-defined]
    assert p.present(keys) == [False] * N  # the chunk is not stored
    assert p.stats().used_bytes == 0  # and its space was given back


def test_large_prefetch_hints_from_the_background(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p = _open("mmap", tmp_path / "s")
    try:
        keys, items = _items("par-pf")
        assert p.put_many(items) == [True] * N  # type: ignore[attr-defined]
        calls: list[tuple[str, int]] = []
        monkeypatch.setattr(slotfile.SlotFile, "will_need",
                            lambda self, off, n: calls.append((threading.current_thread().name, n)))
        p.prefetch(keys)
        slotfile._hint_pool().submit(lambda: None).result(30)  # the hints queued before this ran
        assert sum(n for _, n in calls) == N * PAGE
        assert all(name.startswith("hostkv-hint") for name, _ in calls)
    finally:
        p.close()


# -- the machine-dependent threshold -----------------------------------------------------------


def test_the_parallel_threshold_follows_the_usable_cores() -> None:
    assert slotfile._parallel_min_nbytes(16) == 2 * MiB  # a 4 MiB batch is split
    assert slotfile._parallel_min_nbytes(8) == 2 * MiB
    assert slotfile._parallel_min_nbytes(7) == 8 * MiB
    assert slotfile._parallel_min_nbytes(2) == 8 * MiB  # a 4 MiB batch stays on one thread
    assert slotfile._parallel_min_nbytes(1) == 8 * MiB


def test_usable_cores_are_the_affinity_mask_not_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(3)), raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    assert slotfile._usable_cores() == 3

    def missing(pid: int) -> set[int]:
        raise AttributeError("no affinity API here")

    monkeypatch.setattr(os, "sched_getaffinity", missing, raising=False)
    assert slotfile._usable_cores() == 64  # the fallback: the host's count
    monkeypatch.setattr(os, "cpu_count", lambda: None)
    assert slotfile._usable_cores() == 1


SMALL = 256 * 1024
BATCH = 16  # 4 MiB: split on a machine of many cores, one thread on a small one


@pytest.mark.parametrize("kind", ["mmap", "lmdb"])
@pytest.mark.parametrize("cores", [16, 2])
def test_a_4mib_batch_uses_the_pool_exactly_on_a_many_core_machine(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str, cores: int) -> None:
    """The core count is injected: the choice is deterministic on any machine.  On 16 cores the
    4 MiB batch's reads are split over the I/O threads and its hashes run there while the
    caller writes; on 2 cores everything stays on the caller's thread.  Bytes and seal-time
    checksums are the same either way."""
    monkeypatch.setattr(slotfile, "_PARALLEL_MIN_NBYTES", slotfile._parallel_min_nbytes(cores))
    monkeypatch.setattr(slotfile, "_IO_THREADS", 4)
    io_threads: list[str] = []
    hash_threads: list[str] = []
    real_preadv, real_pwritev, real_digest = os.preadv, os.pwritev, xxhash.xxh3_64_intdigest

    def preadv(fd: int, bufs: list[memoryview], offset: int) -> int:
        io_threads.append("r:" + threading.current_thread().name)
        return real_preadv(fd, bufs, offset)

    def pwritev(fd: int, bufs: list[memoryview], offset: int) -> int:
        io_threads.append("w:" + threading.current_thread().name)
        return real_pwritev(fd, bufs, offset)

    def digest(b: bytes | memoryview) -> int:
        if memoryview(b).nbytes == SMALL:  # a page, not a header
            hash_threads.append(threading.current_thread().name)
        return int(real_digest(b))

    if kind == "mmap":
        p: Provider = MmapProvider(str(tmp_path / "s"), budget_bytes=16 * MiB, slot_nbytes=SMALL)
    else:
        p = LmdbProvider(tmp_path / "s", budget_bytes=16 * MiB, inline_max=0, file_nbytes=16 * MiB)
    try:
        monkeypatch.setattr(os, "preadv", preadv)
        monkeypatch.setattr(os, "pwritev", pwritev)
        monkeypatch.setattr(xxhash, "xxh3_64_intdigest", digest)
        keys = chain(f"cores-{cores}", BATCH)
        items = [(k, keys[i - 1] if i else None, page_bytes(k, SMALL)) for i, k in enumerate(keys)]
        assert p.put_many(items) == [True] * BATCH  # type: ignore[attr-defined]
        assert hash_threads and all(n.startswith("hostkv-io") == (cores == 16) for n in hash_threads)
        assert all(not n.startswith("w:hostkv-io") for n in io_threads)  # writes: the caller's thread
        hash_threads.clear()
        io_threads.clear()
        outs = [bytearray(SMALL) for _ in keys]
        assert p.read_many(keys, outs) == [True] * BATCH  # type: ignore[attr-defined]
        assert [bytes(o) for o in outs] == [page_bytes(k, SMALL) for k in keys]
        on_pool = {n.startswith("r:hostkv-io") for n in io_threads}
        assert (True in on_pool) == (cores == 16)
        # verified where each slice was read: the caller's thread reads one slice itself
        assert any(n.startswith("hostkv-io") for n in hash_threads) == (cores == 16)
        monkeypatch.setattr(xxhash, "xxh3_64_intdigest", real_digest)
        assert p.verify().ok  # type: ignore[attr-defined]  # the checksums are the bytes'
    finally:
        p.close()


@pytest.mark.parametrize("cores", [16, 2])
def test_unverified_reads_use_one_preadv_per_thread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    cores: int) -> None:
    """``verify=never`` has no hash pass that wants small groups: a contiguous 4 MiB batch is one
    ``preadv`` on one thread, or one per I/O thread where the batch is split."""
    monkeypatch.setattr(slotfile, "_PARALLEL_MIN_NBYTES", slotfile._parallel_min_nbytes(cores))
    monkeypatch.setattr(slotfile, "_IO_THREADS", 4)
    path = str(tmp_path / "s")
    p = MmapProvider(path, budget_bytes=16 * MiB, slot_nbytes=SMALL)
    keys = chain("nv", BATCH)
    assert p.put_many([(k, None, page_bytes(k, SMALL)) for k in keys]) == [True] * BATCH
    p.close()
    q = MmapProvider(path, budget_bytes=16 * MiB, slot_nbytes=SMALL, verify="never")
    try:
        calls: list[tuple[str, int]] = []
        real = os.preadv

        def preadv(fd: int, bufs: list[memoryview], offset: int) -> int:
            calls.append((threading.current_thread().name, len(bufs)))
            return real(fd, bufs, offset)

        monkeypatch.setattr(os, "preadv", preadv)
        outs = [bytearray(SMALL) for _ in keys]
        assert q.read_many(keys, outs) == [True] * BATCH
        assert [bytes(o) for o in outs] == [page_bytes(k, SMALL) for k in keys]
        if cores == 16:
            assert sorted(n for _, n in calls) == [4, 4, 4, 4]
            assert sum(name.startswith("hostkv-io") for name, _ in calls) == 3  # and the caller's
        else:
            assert calls == [(threading.current_thread().name, BATCH)]
    finally:
        q.close()


def test_begin_write_runs_zeroes_every_run_and_checks_all_first(tmp_path: Path) -> None:
    sf = slotfile.SlotFile.create(str(tmp_path / "f.slots"), slot_nbytes=4096, slot_count=16, file_id=1,
                                  store_id=bytes(16), durable=False)
    try:
        key = bytes(range(32))
        for slot in range(16):
            sf.write_header(slot, key=key, parent=None, generation=slot + 1, nbytes=4096, checksum=slot)
        with pytest.raises(InvalidArgumentError):
            sf.begin_write_runs([(0, 1), (15, 2)])  # the second run leaves the file
        assert all(sf.header(s) is not None for s in range(16))  # nothing was zeroed
        sf.begin_write_runs([(5, 1), (0, 2), (2, 1), (9, 3), (6, 1)])
        cleared = {0, 1, 2, 5, 6, 9, 10, 11}
        assert [sf.header(s) is None for s in range(16)] == [s in cleared for s in range(16)]
        assert sf.header(3) == slotfile.SlotHeader(key, None, 4, 4096, 3, 0, 0, 0)
    finally:
        sf.close()


@pytest.mark.parametrize("kind", ["mmap", "lmdb"])
def test_a_hash_failing_on_the_pool_fails_the_chunk_after_every_write(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    """A hash task on the I/O pool that raises (here: a stand-in XXH3 that fails on one page)
    fails the whole chunk once the caller's ``pwritev`` calls are over: nothing is stored, the
    space is given back, and no header vouches for the page."""
    monkeypatch.setattr(slotfile, "_PARALLEL_MIN_NBYTES", slotfile._parallel_min_nbytes(16))
    real = xxhash.xxh3_64_intdigest
    keys = chain(f"hash-fail-{kind}", BATCH)
    bad = page_bytes(keys[9], SMALL)

    def digest(b: bytes | memoryview) -> int:
        if threading.current_thread().name.startswith("hostkv-io") and bytes(b[:64]) == bad[:64]:
            raise RuntimeError("simulated hash failure")
        return int(real(b))

    if kind == "mmap":
        p: Provider = MmapProvider(str(tmp_path / "s"), budget_bytes=16 * MiB, slot_nbytes=SMALL)
    else:
        p = LmdbProvider(tmp_path / "s", budget_bytes=16 * MiB, inline_max=0, file_nbytes=16 * MiB)
    try:
        monkeypatch.setattr(xxhash, "xxh3_64_intdigest", digest)
        with pytest.raises(RuntimeError, match="simulated hash failure"):
            p.put_many([(k, None, page_bytes(k, SMALL)) for k in keys])  # type: ignore[attr-defined]
        monkeypatch.setattr(xxhash, "xxh3_64_intdigest", real)
        assert p.present(keys) == [False] * BATCH
        assert p.stats().used_bytes == 0
        assert p.put_many([(k, None, page_bytes(k, SMALL)) for k in keys]) == [True] * BATCH  # type: ignore[attr-defined]
        outs = [bytearray(SMALL) for _ in keys]
        assert p.read_many(keys, outs) == [True] * BATCH  # type: ignore[attr-defined]
        assert [bytes(o) for o in outs] == [page_bytes(k, SMALL) for k in keys]
    finally:
        p.close()


def test_writes_hash_on_the_callers_thread_when_the_pool_takes_no_tasks(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """At interpreter exit a thread pool refuses new tasks (``RuntimeError``): a put_many then
    hashes its pages itself and stores them with the right checksums."""
    monkeypatch.setattr(slotfile, "_PARALLEL_MIN_NBYTES", slotfile._parallel_min_nbytes(16))

    class Refusing:
        def submit(self, *args: object) -> None:
            raise RuntimeError("cannot schedule new futures after interpreter shutdown")

    p = MmapProvider(str(tmp_path / "s"), budget_bytes=16 * MiB, slot_nbytes=SMALL)
    try:
        monkeypatch.setattr(slotfile, "_pool", lambda: Refusing())
        keys = chain("refused", BATCH)
        assert p.put_many([(k, None, page_bytes(k, SMALL)) for k in keys]) == [True] * BATCH
        assert p.verify().ok
        assert all(p.read_bytes(k) == page_bytes(k, SMALL) for k in keys)
    finally:
        p.close()
