"""mmap provider: the periodic snapshot of the seal paths runs without the provider lock.

Before, a seal that crossed the snapshot threshold synced the data files and wrote the whole
index (0.4-1.5 s at 400k entries on the dev VM) while holding the provider lock, so every read,
lookup and lease of every other thread (an engine restoring a prefix) waited for it.  Now the
lock is held to capture the index and to install the file; these tests pin down that the other
threads run meanwhile, and that whatever they change meanwhile is on the disk afterwards.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

import hostkv_providers.providers._fsutil as fsutil
from hostkv_providers._errors import StorageIOError
from hostkv_providers._keys import Key
from hostkv_providers.providers._slotfile import SlotFile
from hostkv_providers.providers.mmap._provider import MmapProvider
from hostkv_providers.testing import key_of, page_bytes, put_page

PAGE = 4096


def make(path: Path, **kw: object) -> MmapProvider:
    kw.setdefault("budget_bytes", 256 * PAGE)
    kw.setdefault("slot_nbytes", PAGE)
    kw.setdefault("snapshot_every", 8)
    return MmapProvider(str(path), **kw)  # type: ignore[arg-type]


def on_disk(root: Path) -> MmapProvider:
    """What the files say now (a reader process; a kill -9 of the writer would leave the same)."""
    return MmapProvider(str(root), readonly=True)


def during_snapshot_write(monkeypatch: pytest.MonkeyPatch, action: Callable[[], None]) -> list[int]:
    """Run ``action`` on another thread while a seal-path snapshot writes its temp file; returns
    a list that gets one element per snapshot written."""
    real = fsutil.write_temp
    written: list[int] = []
    started: list[int] = []

    def hooked(path: str, data: object, *, durable: bool = True) -> str:
        if path.endswith(".snap") and not started:
            started.append(1)
            errors: list[BaseException] = []

            def run() -> None:
                try:
                    action()
                except BaseException as exc:  # re-raised on the test's thread
                    errors.append(exc)

            t = threading.Thread(target=run)
            t.start()
            t.join(30)
            # with the provider lock held here (the old code) the thread could not finish
            assert not t.is_alive(), "another thread's call waited for the snapshot"
            if errors:
                raise errors[0]
        written.append(1)
        return real(path, data, durable=durable)  # type: ignore[arg-type]

    monkeypatch.setattr(fsutil, "write_temp", hooked)
    return written


def fill(p: MmapProvider, tag: str, n: int) -> list[Key]:
    keys = [key_of(f"{tag}-{i}") for i in range(n)]
    for k in keys:
        put_page(p, k, None, PAGE)
    return keys


@pytest.mark.parametrize("durability", ["process", "sync", "none"])
def test_other_threads_run_and_their_changes_survive(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    durability: str) -> None:
    root = tmp_path / "s"
    p = make(root, durability=durability)
    old = fill(p, "old", 6)
    late = [key_of(f"late-{i}") for i in range(5)]

    def meanwhile() -> None:
        # reads, lookups, leases, seals and an eviction, all while the snapshot is written
        assert p.read_bytes(old[0]) == page_bytes(old[0], PAGE)
        assert p.present(old) == [True] * len(old)
        with p.lease(old[:2]):
            pass
        for k in late:
            put_page(p, k, None, PAGE)
        p.evict([old[1]])

    written = during_snapshot_write(monkeypatch, meanwhile)
    if durability == "none":  # records reach the journal in batches: the threshold is far
        p._snap_due = True
    fill(p, "trigger", 4)  # crosses snapshot_every: the seal that does writes the snapshot
    assert written, "no snapshot was written"
    assert p._rotation is None and p._jrecords < 12  # journal rotated to what came after it
    want = {k: k != old[1] for k in old + late}
    if durability != "none":  # (none: records still buffered in the writer are not on disk yet)
        q = on_disk(root)
        try:
            assert q.present(list(want)) == list(want.values())
            for k, there in want.items():
                if there:
                    assert q.read_bytes(k) == page_bytes(k, PAGE)
        finally:
            q.close()
    p.close()
    q = MmapProvider(str(root))
    assert q.present(list(want)) == list(want.values())
    assert q.verify().ok
    q.close()


def test_rotation_waits_for_a_seal_between_record_and_entry(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A seal whose journal record is written but whose index entry is not (``_unfinished``) may
    still sync the old journal (a group commit): the rotation waits, the old journal stays valid
    behind the new snapshot, and a later seal rotates."""
    root = tmp_path / "s"
    p = make(root, durability="sync")
    keys = fill(p, "a", 4)

    def mid_seal() -> None:
        with p._lock:
            p._unfinished += 1  # as between _seal_prepare's record and _seal_finish

    during_snapshot_write(monkeypatch, mid_seal)
    keys += fill(p, "b", 6)
    assert p._rotation is not None, "the rotation should have waited"
    q = on_disk(root)  # new snapshot + the old journal: everything is there
    try:
        assert q.present(keys) == [True] * len(keys)
    finally:
        q.close()
    with p._lock:
        p._unfinished -= 1
    keys += fill(p, "c", 1)  # the next seal to finish rotates
    assert p._rotation is None
    q = on_disk(root)
    try:
        assert q.present(keys) == [True] * len(keys)
        assert all(q.read_bytes(k) == page_bytes(k, PAGE) for k in keys)
    finally:
        q.close()
        p.close()


def test_a_snapshot_written_meanwhile_makes_it_obsolete(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``verify(repair=True)`` (like ``close()`` and open) writes its own snapshot under the lock;
    the seal path's, older, must then not be installed over it."""
    root = tmp_path / "s"
    p = make(root)
    keys = fill(p, "a", 4)

    def repair() -> None:
        keys.extend(fill(p, "mid", 2))
        p.verify(repair=True)

    during_snapshot_write(monkeypatch, repair)
    keys += fill(p, "b", 6)
    assert not [n for n in os.listdir(root) if fsutil.is_temp_name(n)], "a temp file was left behind"
    q = on_disk(root)
    try:
        assert q.present(keys) == [True] * len(keys)
    finally:
        q.close()
        p.close()


def test_failed_data_sync_poisons_the_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A data file whose sync failed may have lost dirty pages (R7): the store acknowledges
    nothing more until it is reopened.  The seal that ran the snapshot is already in the journal
    and the index: it succeeds (the failure is logged and counted)."""
    root = tmp_path / "s"
    p = make(root, durability="process")  # (sync mode syncs data at every commit: nothing dirty)
    keys = fill(p, "a", 4)
    real_sync, real_due = SlotFile.sync, MmapProvider._snapshot_due
    armed = [False]

    def sync(self: SlotFile) -> None:
        if armed[0]:
            armed[0] = False
            raise StorageIOError("injected EIO")
        real_sync(self)

    def due(self: MmapProvider) -> None:
        armed[0] = self._snap_due  # fail the first data sync of the snapshot
        try:
            real_due(self)
        finally:
            armed[0] = False

    monkeypatch.setattr(SlotFile, "sync", sync)
    monkeypatch.setattr(MmapProvider, "_snapshot_due", due)
    with pytest.raises(StorageIOError, match=r"earlier sync.*injected"):
        keys += fill(p, "b", 6)  # stops at the first seal after the one that ran the snapshot
    assert p.stats().extra["snapshot_failures"] == 1
    with pytest.raises(StorageIOError, match="earlier sync"):
        put_page(p, key_of("after"), None, PAGE)
    monkeypatch.undo()
    p.close()
    q = MmapProvider(str(root))
    assert q.present(keys) == [True] * len(keys)
    assert all(q.read_bytes(k) == page_bytes(k, PAGE) for k in keys)
    q.close()


@pytest.mark.parametrize("what", ["close", "compact"])
def test_close_or_compact_meanwhile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, what: str) -> None:
    """``close()`` or ``compact()`` from another thread while the seal path writes its snapshot:
    that snapshot is obsolete (discarded, its temp file removed), the seal that wrote it still
    succeeds, and the store reopens with everything."""
    root = tmp_path / "s"
    p = make(root)
    keys = fill(p, "a", 6)
    p.evict(keys[:2])  # (something for compact to move)
    keys = keys[2:]

    def other() -> None:
        if what == "close":
            p.close()
        else:
            p.compact()

    written = during_snapshot_write(monkeypatch, other)
    if what == "close":
        p._snap_due = True
        keys += fill(p, "b", 1)  # its seal writes the snapshot; the store closes meanwhile
    else:
        keys += fill(p, "b", 4)  # crosses snapshot_every; compacted meanwhile
        p.close()
    assert written
    assert not [n for n in os.listdir(root) if fsutil.is_temp_name(n)], "a temp file was left behind"
    q = MmapProvider(str(root))
    assert q.present(keys) == [True] * len(keys)
    assert all(q.read_bytes(k) == page_bytes(k, PAGE) for k in keys)
    assert q.verify().ok
    q.close()


def test_a_snapshot_written_meanwhile_syncs_the_files_still_being_synced(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The seal path takes the changed data files out of the dirty set before it syncs them
    unlocked; a ``verify(repair=True)`` or ``close()`` snapshot written meanwhile must sync them
    too before it replaces the journal (else a power cut could leave a durable index over data
    that never reached the disk)."""
    root = tmp_path / "s"
    p = make(root, durability="process")
    fill(p, "a", 6)
    synced: list[int] = []
    real_sync = SlotFile.sync
    in_repair = [False]

    def sync(self: SlotFile) -> None:
        if in_repair[0]:
            synced.append(self.file_id)
        real_sync(self)

    def repair() -> None:
        assert p._snap_syncing, "the seal path should be syncing a data file now"
        in_repair[0] = True
        try:
            p.verify(repair=True)
        finally:
            in_repair[0] = False
        assert set(synced) >= p._snap_syncing

    monkeypatch.setattr(SlotFile, "sync", sync)
    during_snapshot_write(monkeypatch, repair)
    fill(p, "b", 4)
    assert synced
    p.close()


def test_a_journal_replaced_but_not_reopened_poisons_the_store(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Once the new journal is renamed in, a failure to sync the directory or to open it leaves
    the writer's descriptor on the old, unlinked journal: records appended there would be lost,
    so no later seal is acknowledged (the one that ran the rotation is already in the journal)."""
    root = tmp_path / "s"
    p = make(root, durability="sync")
    keys = fill(p, "a", 4)
    real_install, real_fsync_dir = MmapProvider._install_journal, fsutil.fsync_dir
    armed = [False]

    def install(self: MmapProvider, tail: bytes) -> None:
        armed[0] = True
        try:
            real_install(self, tail)
        finally:
            armed[0] = False

    def fsync_dir(path: str) -> None:
        if armed[0]:
            raise StorageIOError("injected EIO syncing the directory")
        real_fsync_dir(path)

    monkeypatch.setattr(MmapProvider, "_install_journal", install)
    monkeypatch.setattr(fsutil, "fsync_dir", fsync_dir)
    with pytest.raises(StorageIOError, match="could not be replaced"):
        keys += fill(p, "b", 6)
    assert p.stats().extra["snapshot_failures"] == 1
    monkeypatch.undo()
    p.close()
    q = MmapProvider(str(root))
    assert q.present(keys) == [True] * len(keys)
    q.close()
