"""lmdb ``put_many``: a chunk of equal slot pages that fits without evicting is written inside ONE
write transaction (``_batch._put_direct``): no flight records, one commit, and with
``durability=sync`` exactly one slot-file sync, then LMDB's commit, then one index sync per chunk.
Freed slots are reused in place, a failure part-way leaves nothing visible and no slot leaked,
and a writer in another thread waits for the commit instead of racing the write."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path
from typing import Any

import pytest

from hostkv_providers import Key
from hostkv_providers.errors import StorageIOError
from hostkv_providers.providers import LmdbProvider
from hostkv_providers.providers._slotfile import SlotFile
from hostkv_providers.providers.lmdb import _batch as lmdb_batch
from hostkv_providers.testing import chain, key_of, page_bytes

PAGE = 16384


def _open(path: Path, budget_pages: int = 96, **kw: Any) -> LmdbProvider:
    return LmdbProvider(str(path), budget_bytes=budget_pages * PAGE, inline_max=0, **kw)


def _items(keys: list[Key], parents: list[Key | None], nbytes: int = PAGE) -> list[tuple[bytes, bytes | None, object]]:
    return [(k, q, page_bytes(k, nbytes)) for k, q in zip(keys, parents, strict=True)]


def _readback(p: LmdbProvider, keys: list[Key], nbytes: int = PAGE) -> None:
    outs = [bytearray(nbytes) for _ in keys]
    assert p.read_many(keys, outs) == [True] * len(keys)
    assert all(bytes(o) == page_bytes(k, nbytes) for k, o in zip(keys, outs, strict=True))


def _db_counts(p: LmdbProvider) -> dict[str, int]:
    with p._s.read() as txn:
        return {name: int(txn.stat(p._s.dbs[name])["entries"]) for name in ("entries", "flights", "free", "lru")}


def _slots_of(p: LmdbProvider, keys: list[Key]) -> set[tuple[int, int]]:
    out = set()
    with p._s.read() as txn:
        for k in keys:
            from hostkv_providers.providers.lmdb._format import _Entry

            e = _Entry.unpack(k, txn.get(k, db=p._s.dbs["entries"]))
            out.add((e.file_id, e.slot))
    return out


def _direct_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The two-transaction and page-by-page paths fail loudly: what follows must go direct."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a path other than the one-transaction one ran")

    monkeypatch.setattr(lmdb_batch, "_put_batch", refuse)
    monkeypatch.setattr(lmdb_batch, "_put_chunk", refuse)


def test_a_chunk_that_fits_is_one_transaction_without_flights(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p = _open(tmp_path / "s")
    base = key_of("direct-base")
    assert p.put_many(_items([base], [None])) == [True]
    keys = chain("direct", 20)
    # a chain under a stored page, and roots (a forest in one chunk)
    parents: list[Key | None] = [base, *keys[:9], None, *keys[10:19]]
    submits: list[int] = []
    real = p._s.submit

    def counting(fn: Any, **kw: Any) -> Any:
        submits.append(1)
        return real(fn, **kw)

    with monkeypatch.context() as m:
        _direct_only(m)
        m.setattr(p._s, "submit", counting)
        assert p.put_many(_items(keys, parents)) == [True] * 20
        assert len(submits) == 1  # one write transaction for the whole chunk
        assert p.put_many(_items(keys, parents)) == [False] * 20  # dedup, still one transaction each
    c = _db_counts(p)
    assert c["flights"] == 0 and c["entries"] == 21
    assert c["lru"] == 2  # the two leaves: the ends of the two chains (the base gained a child)
    _readback(p, [base, *keys])
    assert p.stats().entries == 21
    p.close()
    q = _open(tmp_path / "s")
    _readback(q, [base, *keys])
    assert q.verify().ok
    # the tree is whole: evicting the base takes its subtree with it
    q.evict([base])
    assert q.present([base, *keys]) == [False] * 11 + [True] * 10
    q.close()


def test_freed_slots_are_reused_in_place_with_mixed_sizes(tmp_path: Path) -> None:
    p = _open(tmp_path / "s", budget_pages=128)
    big, small = chain("big", 16), chain("small", 16)
    assert p.put_many(_items(big, [None] * 16)) == [True] * 16
    assert p.put_many(_items(small, [None] * 16, PAGE // 2)) == [True] * 16
    freed_big, freed_small = _slots_of(p, big), _slots_of(p, small)
    p.evict(big + small)
    files = set(os.listdir(tmp_path / "s" / "slots"))
    # one call, both sizes, a chunk of each: every page lands in a slot of its own size freed above
    nb, ns = chain("big2", 16), chain("small2", 16)
    items = _items(nb, [None] * 16) + _items(ns, [None] * 16, PAGE // 2)
    assert p.put_many(items) == [True] * 32
    assert _slots_of(p, nb) == freed_big and _slots_of(p, ns) == freed_small
    assert set(os.listdir(tmp_path / "s" / "slots")) == files  # no new slot file
    assert _db_counts(p)["free"] == 0
    # sizes mixed inside one chunk go page by page, into the slots freed again
    p.evict(nb + ns)
    mixed = chain("mixed", 8)
    mitems = [(k, None, page_bytes(k, PAGE if i % 2 else PAGE // 2)) for i, k in enumerate(mixed)]
    assert p.put_many(mitems) == [True] * 8
    assert set(os.listdir(tmp_path / "s" / "slots")) == files
    outs = [bytearray(PAGE if i % 2 else PAGE // 2) for i in range(8)]
    assert p.read_many(mixed, outs) == [True] * 8
    assert all(bytes(o) == it[2] for o, it in zip(outs, mitems, strict=True))
    p.close()
    q = _open(tmp_path / "s", budget_pages=128)
    assert q.verify().ok
    q.close()


@pytest.mark.parametrize("durability, where", [("process", "write"), ("sync", "write"), ("sync", "sync")])
def test_a_failure_part_way_leaves_nothing_visible_and_no_slot_leaked(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, durability: str, where: str) -> None:
    """(Only ``durability=sync`` syncs slot files: the failed sync is a case of its own.)"""
    p = _open(tmp_path / "s", durability=durability)
    old = chain("fail-old", 16)
    assert p.put_many(_items(old, [None] * 16)) == [True] * 16
    p.evict(old[4:])  # 12 freed slots and fresh space after them
    before = _db_counts(p)
    used = p.stats().used_bytes
    keys = chain("fail", 20)
    items = _items(keys, [old[0], *keys[:-1]])

    def broken(*args: object) -> int:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    with monkeypatch.context() as m:
        _direct_only(m)
        if where == "write":
            m.setattr(os, "pwritev", broken)
            m.setattr(os, "pwrite", broken)
        else:
            m.setattr(SlotFile, "sync", lambda self: (_ for _ in ()).throw(StorageIOError("sync failed (test)")))
        with pytest.raises(StorageIOError):
            p.put_many(items)
    assert p.present(keys) == [False] * 20
    assert _db_counts(p) == before  # no entry, no flight, every freed slot still free
    assert p.stats().used_bytes == used
    assert p.put_many(items) == [True] * 20  # the space and the slots serve the retry
    _readback(p, [*old[:4], *keys])
    p.close()
    q = _open(tmp_path / "s")
    _readback(q, [*old[:4], *keys])
    assert q.verify().ok
    q.close()


class _EnvProxy:
    """Forwards to the LMDB environment, recording ``sync`` calls (py-lmdb's methods are C)."""

    def __init__(self, env: Any, events: list[str]) -> None:
        self._env, self._events = env, events

    def sync(self, force: bool = False) -> None:
        self._events.append("index-sync")
        self._env.sync(force)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._env, name)


def test_durability_sync_syncs_data_then_commits_then_syncs_the_index_once_per_chunk(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p = _open(tmp_path / "s", budget_pages=256, durability="sync")
    assert p.put_many(_items(chain("sync-warm", 4), [None] * 4)) == [True] * 4  # the slot file exists
    events: list[str] = []
    real_sync, real_commit = SlotFile.sync, type(p._s)._commit_batch

    def slot_sync(self: SlotFile) -> None:
        events.append("slot-sync")
        real_sync(self)

    def commit(self: Any, live: Any, touches: Any) -> None:
        real_commit(self, live, touches)
        events.append("commit")

    keys = chain("sync", 2 * lmdb_batch.PUT_CHUNK)
    with monkeypatch.context() as m:
        _direct_only(m)
        m.setattr(SlotFile, "sync", slot_sync)
        m.setattr(type(p._s), "_commit_batch", commit)
        m.setattr(p._s, "env", _EnvProxy(p._s.env, events))
        assert p.put_many(_items(keys, [None, *keys[:-1]])) == [True] * len(keys)
    # per chunk: the slot bytes, then the commit that publishes them (LMDB's own commit syncs
    # data.mdb's pages inside it); no reservation commit before the data; the index sync (the
    # meta page) once, after the call's last commit
    assert events == ["slot-sync", "commit", "slot-sync", "commit", "index-sync"]
    _readback(p, keys)
    # one chunk: one of each
    events.clear()
    one = chain("sync-one", 8)
    with monkeypatch.context() as m:
        _direct_only(m)
        m.setattr(SlotFile, "sync", slot_sync)
        m.setattr(type(p._s), "_commit_batch", commit)
        m.setattr(p._s, "env", _EnvProxy(p._s.env, events))
        assert p.put_many(_items(one, [None] * 8)) == [True] * 8
    assert events == ["slot-sync", "commit", "index-sync"]
    p.close()
    q = _open(tmp_path / "s", budget_pages=256, durability="sync")
    _readback(q, [*keys, *one])
    q.close()


def test_durability_sync_a_failing_later_chunk_still_syncs_the_committed_ones(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p = _open(tmp_path / "s", budget_pages=256, durability="sync")
    events: list[str] = []
    keys = chain("sync-fail", 2 * lmdb_batch.PUT_CHUNK)
    real_sync = SlotFile.sync
    calls: list[int] = []

    def second_fails(self: SlotFile) -> None:
        calls.append(1)
        if len(calls) == 2:
            raise StorageIOError("sync failed (test)")
        real_sync(self)

    with monkeypatch.context() as m:
        _direct_only(m)
        m.setattr(SlotFile, "sync", second_fails)
        m.setattr(p._s, "env", _EnvProxy(p._s.env, events))
        with pytest.raises(StorageIOError):
            p.put_many(_items(keys, [None] * len(keys)))
    assert events == ["index-sync"]  # the first chunk's commit made durable before the error
    n = lmdb_batch.PUT_CHUNK
    assert p.present(keys) == [True] * n + [False] * n
    assert _db_counts(p)["flights"] == 0
    p.close()


def test_a_writer_in_another_thread_waits_for_the_commit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A drop of the chunk's stored parent from another thread while the chunk's bytes are being
    written cannot interleave with the write (it waits for LMDB's write lock): it runs after
    the commit and takes the whole new subtree with the parent."""
    p = _open(tmp_path / "s")
    base = key_of("wait-base")
    assert p.put_many(_items([base], [None])) == [True]
    keys = chain("wait", 6)
    real = SlotFile.write_slots
    dropper: list[threading.Thread] = []

    def hooked(self: SlotFile, *args: Any, **kwargs: Any) -> None:
        if not dropper:
            t = threading.Thread(target=lambda: p._s.submit(lambda tx: tx.drop(base)))
            dropper.append(t)
            t.start()
            t.join(0.3)
            assert t.is_alive()  # waiting for this transaction
        real(self, *args, **kwargs)

    with monkeypatch.context() as m:
        _direct_only(m)
        m.setattr(SlotFile, "write_slots", hooked)
        assert p.put_many(_items(keys, [base, *keys[:-1]])) == [True] * 6
    dropper[0].join(30)
    assert not dropper[0].is_alive()
    assert p.present([base, *keys]) == [False] * 7
    c = _db_counts(p)
    assert c["entries"] == 0 and c["flights"] == 0
    assert p.stats().used_bytes == 0
    p.close()
    q = _open(tmp_path / "s")
    assert q.verify().ok
    q.close()
