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

import hostkv_providers.providers._slotfile as slotfile
from hostkv_providers import LmdbProvider, MmapProvider, Provider, StorageIOError
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
    count = [0]
    real = os.pwritev

    def failing(fd: int, bufs: list[memoryview], offset: int) -> int:
        count[0] += 1
        if count[0] == 7:
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
