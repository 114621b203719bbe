"""``put_many``'s batch path in ``mmap`` and ``lmdb`` (a chunk of equal pages reserved, written
and sealed as one: ``TreeIndex.begin_batch``/``commit_batch``, lmdb's two column-wise
transactions): the same outcomes as page by page, and the edge cases of a batch — repeated keys,
keys already stored, a failure part-way through a chunk, ENOSPC, a close racing the call."""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from hostkv_providers import ClosedError, HostKVError, InFlightError, Key, UnknownKeyError
from hostkv_providers.errors import CapacityError, StorageIOError
from hostkv_providers.providers import LmdbProvider, MmapProvider
from hostkv_providers.providers._slotfile import SlotFile
from hostkv_providers.providers.lmdb import _batch as lmdb_batch
from hostkv_providers.testing import chain, key_of, page_bytes

PAGE = 16384
Items = list[tuple[bytes, bytes | None, object]]


def _open(kind: str, path: Path, budget_pages: int = 64) -> Any:
    if kind == "mmap":
        return MmapProvider(str(path), budget_bytes=budget_pages * PAGE, slot_nbytes=PAGE)
    return LmdbProvider(str(path), budget_bytes=budget_pages * PAGE, inline_max=0)


@pytest.fixture(params=["mmap", "lmdb"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def store(kind: str, tmp_path: Path) -> Iterator[Any]:
    p = _open(kind, tmp_path / "s")
    yield p
    p.close()


def _items(keys: list[Key], parents: list[Key | None]) -> Items:
    return [(k, q, page_bytes(k, PAGE)) for k, q in zip(keys, parents, strict=True)]


def _batch_only(monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    """Make the page-by-page path fail loudly: what follows must take the batch path."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the page-by-page path ran")

    if kind == "mmap":
        monkeypatch.setattr(MmapProvider, "_put_pages", refuse)
    else:
        monkeypatch.setattr(lmdb_batch, "_put_chunk", refuse)


def _readback(p: Any, keys: list[Key]) -> None:
    outs = [bytearray(PAGE) for _ in keys]
    assert p.read_many(keys, outs) == [True] * len(keys)
    assert [bytes(o) for o in outs] == [page_bytes(k, PAGE) for k in keys]


def _settled(p: Any, entries: int) -> None:
    st = p.stats()
    assert (st.in_flight, st.entries, st.used_bytes) == (0, entries, entries * PAGE)


@pytest.mark.parametrize("shape", ["roots", "chain", "forest"])
def test_batch_path_stores_roots_chains_and_forests(kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    shape: str) -> None:
    p = _open(kind, tmp_path / "s")
    base = chain(f"bp-{shape}-base", 2)
    assert p.put_many(_items(base, [None, base[0]])) == [True, True]
    keys = chain(f"bp-{shape}", 12)
    if shape == "roots":
        parents: list[Key | None] = [None] * 12
    elif shape == "chain":
        parents = [base[1], *keys[:-1]]
    else:  # under stored pages, a fork inside the chunk, a root
        parents = [base[0], keys[0], keys[1], base[1], keys[0], None, keys[5], base[0], keys[7], keys[8], keys[2],
                   keys[3]]
    with monkeypatch.context() as m:
        _batch_only(m, kind)
        assert p.put_many(_items(keys, parents)) == [True] * 12
    assert [e.parent for e in map(p.entry, keys)] == parents
    _readback(p, keys)
    _settled(p, 14)
    p.close()
    q = _open(kind, tmp_path / "s")  # what the records say after a clean close
    assert [e.parent for e in map(q.entry, keys)] == parents
    _readback(q, keys)
    _settled(q, 14)
    # evicting a page takes its subtree as the records link it
    q.evict(keys[:1])
    gone = {"roots": {keys[0]}, "chain": set(keys), "forest": {keys[0], keys[1], keys[2], keys[4], keys[10]}}[shape]
    assert q.present(keys) == [k not in gone for k in keys]
    q.close()


def test_repeated_keys_in_one_call(store: Any) -> None:
    a, b = key_of("dup-a"), key_of("dup-b")
    got = store.put_many(_items([a, b, a], [None, a, None]))
    assert got[:2] == [True, True] and isinstance(got[2], InFlightError)
    _readback(store, [a, b])
    _settled(store, 2)


def test_keys_already_stored_are_dedup_in_the_batch_path(kind: str, store: Any,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    keys = chain("dedup", 8)
    items = _items(keys, [None, *keys[:-1]])
    assert store.put_many(items[:3]) == [True] * 3
    with monkeypatch.context() as m:
        _batch_only(m, kind)
        assert store.put_many(items) == [False] * 3 + [True] * 5  # stored pages are the new ones' parents
        assert store.put_many(items) == [False] * 8
    assert store.longest_prefix(keys) == 8
    _readback(store, keys)
    _settled(store, 8)


def test_a_chunk_that_does_not_fit_stores_a_prefix(kind: str, tmp_path: Path) -> None:
    p = _open(kind, tmp_path / "s", budget_pages=8)
    keys = chain("prefix", 12)
    got = p.put_many(_items(keys, [None, *keys[:-1]]))
    assert got[:8] == [True] * 8
    assert isinstance(got[8], CapacityError) and all(isinstance(g, HostKVError) for g in got[9:])
    assert p.longest_prefix(keys) == 8
    _settled(p, 8)
    p.close()


def _during_write(monkeypatch: pytest.MonkeyPatch, action: Callable[[], None]) -> None:
    """Run ``action`` once, while the next batch's bytes are being written (no provider lock
    held then: another thread could do the same)."""
    real = SlotFile.write_slots
    done: list[bool] = []

    def hooked(self: SlotFile, *args: Any, **kwargs: Any) -> None:
        if not done:
            done.append(True)
            action()
        real(self, *args, **kwargs)

    monkeypatch.setattr(SlotFile, "write_slots", hooked)


def test_a_parent_dropped_part_way_fails_exactly_the_pages_under_it(kind: str, store: Any,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    base = key_of("drop-base")
    assert store.put_many(_items([base], [None])) == [True]
    keys = chain("drop", 4)
    # two pages under the stored page (the second one under the first), two independent roots
    parents: list[Key | None] = [base, keys[0], None, None]

    def drop_base() -> None:  # what a checksum failure seen by a reader does meanwhile
        if kind == "mmap":
            with store._lock:
                store._drop_row(store._idx.row_of(base))
        else:
            store._s.submit(lambda tx: tx.drop(base))

    if kind == "lmdb":
        # the two-transaction path, whose writes run outside LMDB's write lock (a chunk that
        # fits without evicting is written inside one transaction, where a drop waits for the
        # commit: tests/providers/lmdb/test_lmdb_put_direct.py)
        monkeypatch.setattr(lmdb_batch, "_put_direct", lambda *args, **kwargs: None)
    _during_write(monkeypatch, drop_base)
    got = store.put_many(_items(keys, parents))
    assert isinstance(got[0], UnknownKeyError) and isinstance(got[1], UnknownKeyError)
    assert got[2:] == [True, True]
    assert store.present([base, *keys]) == [False, False, False, True, True]
    _readback(store, keys[2:])
    _settled(store, 2)


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO])
def test_a_write_error_stores_nothing_of_the_chunk(kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   code: int) -> None:
    p = _open(kind, tmp_path / "s")
    first = chain("err-first", 4)
    assert p.put_many(_items(first, [None, *first[:-1]])) == [True] * 4
    keys = chain("err", 10)
    items = _items(keys, [first[-1], *keys[:-1]])

    def broken(*args: object) -> int:
        raise OSError(code, os.strerror(code))

    with monkeypatch.context() as m:
        m.setattr(os, "pwritev", broken)
        m.setattr(os, "pwrite", broken)
        with pytest.raises(StorageIOError) as info:
            p.put_many(items)
    assert isinstance(info.value, HostKVError) and info.value.hint
    assert p.present(keys) == [False] * 10 and p.longest_prefix(first) == 4
    _settled(p, 4)
    assert p.put_many(items) == [True] * 10  # the space came back; writes resume
    _readback(p, [*first, *keys])
    p.close()
    q = _open(kind, tmp_path / "s")
    _readback(q, [*first, *keys])
    _settled(q, 14)
    q.close()


def test_close_waits_for_a_put_many_under_way(kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p = _open(kind, tmp_path / "s")
    keys = chain("close-race", 10)
    items = _items(keys, [None, *keys[:-1]])
    writing, release = threading.Event(), threading.Event()

    def hold_the_write() -> None:
        writing.set()
        assert release.wait(30)

    _during_write(monkeypatch, hold_the_write)
    got: list[object] = []
    writer = threading.Thread(target=lambda: got.append(p.put_many(items)))
    writer.start()
    assert writing.wait(30)
    closer = threading.Thread(target=p.close)
    closer.start()
    closer.join(0.3)
    assert closer.is_alive()  # close waits for the call (it must not close files under its writes)
    release.set()
    writer.join(30)
    closer.join(30)
    assert not writer.is_alive() and not closer.is_alive()
    assert got == [[True] * 10]
    with pytest.raises(ClosedError):
        p.put_many(items)
    q = _open(kind, tmp_path / "s")
    _readback(q, keys)
    _settled(q, 10)
    q.close()


def test_a_full_store_evicts_a_chunk_per_chunk_and_reopens_as_it_was(kind: str, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    p = _open(kind, tmp_path / "s", budget_pages=16)
    rounds = [chain(f"full-{r}", 16) for r in range(4)]
    with monkeypatch.context() as m:
        _batch_only(m, kind)
        for keys in rounds:  # each chunk evicts the previous one's 16 pages (drop records in one blob)
            assert p.put_many(_items(keys, [None] * 16)) == [True] * 16
    assert all(p.present(keys) == [False] * 16 for keys in rounds[:-1])
    _readback(p, rounds[-1])
    _settled(p, 16)
    p.close()
    q = _open(kind, tmp_path / "s", budget_pages=16)
    assert all(q.present(keys) == [False] * 16 for keys in rounds[:-1])
    _readback(q, rounds[-1])
    _settled(q, 16)
    assert q.put_many(_items(rounds[0], [None] * 16)) == [True] * 16  # the freed slots serve again
    _readback(q, rounds[0])
    q.close()


def test_mmap_batch_fills_scattered_free_slots_first_fit(tmp_path: Path) -> None:
    p = _open("mmap", tmp_path / "s", budget_pages=32)
    old = chain("scatter-old", 32)
    assert p.put_many(_items(old, [None] * 32)) == [True] * 32
    p.evict(old[1::2])  # every other slot free: no run of two
    files = dict(p._files)
    keys = chain("scatter-new", 16)
    assert p.put_many(_items(keys, [None] * 16)) == [True] * 16
    assert p._files == files  # into the freed slots, no new data file
    taken = sorted(int(p._idx.slot[p._idx.row_of(k)]) for k in keys)
    assert taken == list(range(1, 32, 2))
    _readback(p, [*old[::2], *keys])
    _settled(p, 32)
    p.close()
