"""mmap provider: identity, locking, permissions, durability modes, recovery, readers, I/O faults."""

from __future__ import annotations

import errno
import json
import os
import stat
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import hostkv_providers.providers._fsutil as fsutil
from hostkv_providers._errors import (
    ClosedError,
    CorruptStoreError,
    HostKVError,
    IncompatibleStoreError,
    InvalidArgumentError,
    LockedError,
    ReservationError,
    StorageIOError,
    UnsafeStoreError,
)
from hostkv_providers._registry import open_provider
from hostkv_providers.providers._slotfile import SlotFile
from hostkv_providers.providers.mmap import _provider as _mmap
from hostkv_providers.providers.mmap._provider import MmapProvider
from hostkv_providers.testing import anchor_bytes, chain, key_of, page_bytes, put_chain, put_page

from ._mmap_common import PAGE, abandon_copy, make, reserve_written

# -- identity and files ---------------------------------------------------------------------------


def test_url_options_and_unknown_option(tmp_path: Path) -> None:
    p = open_provider(f"mmap://{tmp_path}/s?budget=1MiB&durability=sync&slot=16KiB&verify=never")
    assert isinstance(p, MmapProvider)
    assert (p.budget_bytes, p.durability, p.slot_nbytes) == (1 << 20, "sync", PAGE)
    put_page(p, key_of("u"), None, PAGE)
    p.close()
    with pytest.raises(InvalidArgumentError, match="unknown option"):
        open_provider(f"mmap://{tmp_path}/s?budgett=1MiB")
    with pytest.raises(InvalidArgumentError):
        open_provider(f"mmap://{tmp_path}/s?durability=fast")
    # budget and slot size come from the manifest when not given
    p = open_provider(f"mmap://{tmp_path}/s")
    assert isinstance(p, MmapProvider)
    assert (p.budget_bytes, p.slot_nbytes) == (1 << 20, PAGE)
    assert p.present([key_of("u")]) == [True]
    p.close()


def test_files_are_private(tmp_path: Path) -> None:
    p = make(tmp_path / "s")
    put_chain(p, chain("perm", 3), PAGE)
    p.put_anchor(chain("perm", 3)[2], "a", b"x")
    p.close()
    root = tmp_path / "s"
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    for f in root.iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f.name


def test_loose_permissions_and_symlinks_refused(tmp_path: Path) -> None:
    p = make(tmp_path / "s")
    p.close()
    root = tmp_path / "s"
    os.chmod(root, 0o755)
    with pytest.raises(UnsafeStoreError):
        make(root)
    os.chmod(root, 0o700)
    manifest = root / "manifest.json"
    os.chmod(manifest, 0o644)
    with pytest.raises(UnsafeStoreError):
        make(root)
    os.chmod(manifest, 0o600)
    data = next(f for f in root.iterdir() if f.name.endswith(".slots"))
    real = tmp_path / "elsewhere.slots"
    os.rename(data, real)
    os.symlink(real, data)
    with pytest.raises(UnsafeStoreError):
        make(root)
    link = tmp_path / "link"
    os.symlink(root, link)
    with pytest.raises(UnsafeStoreError):
        make(link)


def test_empty_existing_dir_is_adopted(tmp_path: Path) -> None:
    d = tmp_path / "made-by-caller"
    d.mkdir(mode=0o755)
    make(d).close()
    assert stat.S_IMODE(d.stat().st_mode) == 0o700


def test_other_format_version_refused(tmp_path: Path) -> None:
    make(tmp_path / "s").close()
    mpath = tmp_path / "s" / "manifest.json"
    man = json.loads(mpath.read_text())
    for field, value, match in (("format_version", 99, "format version 99"),
                                ("key_algorithm", "md5", "key_algorithm"),
                                ("checksum_algorithm", "crc8", "checksum_algorithm")):
        bad = dict(man, **{field: value})
        mpath.write_text(json.dumps(bad))
        with pytest.raises(IncompatibleStoreError, match=match):
            make(tmp_path / "s")
    mpath.write_text(json.dumps(man))
    with pytest.raises(IncompatibleStoreError, match="slots"):
        make(tmp_path / "s", slot_nbytes=2 * PAGE)
    mpath.write_text("{not json")
    with pytest.raises(CorruptStoreError):
        make(tmp_path / "s")


def test_short_data_file_is_refused_not_sigbus(tmp_path: Path) -> None:
    p = make(tmp_path / "s")
    put_page(p, key_of("x"), None, PAGE)
    p.close()
    data = next(f for f in (tmp_path / "s").iterdir() if f.name.endswith(".slots"))
    os.truncate(data, data.stat().st_size - 4096)
    with pytest.raises(CorruptStoreError, match="declares"):
        make(tmp_path / "s")


# -- processes ------------------------------------------------------------------------------------


def test_second_writer_locked_reader_allowed(tmp_path: Path) -> None:
    p = make(tmp_path / "s")
    keys = chain("lock", 3)
    put_chain(p, keys, PAGE)
    with pytest.raises(LockedError):
        make(tmp_path / "s")
    r = make(tmp_path / "s", readonly=True)
    assert r.present(keys) == [True] * 3
    assert r.read_bytes(keys[1]) == page_bytes(keys[1], PAGE)
    with pytest.raises(InvalidArgumentError, match="read-only"):
        r.reserve(key_of("ro"), None, PAGE)
    with pytest.raises(InvalidArgumentError, match="read-only"):
        r.compact()
    # the reader sees new entries after refresh(); evicted ones become misses
    more = chain("lock-more", 2)
    put_chain(p, more, PAGE)
    assert r.present(more) == [False, False]
    assert r.refresh() is True
    assert r.present(more) == [True, True]
    p.evict([keys[0]])
    # slot reuse by the writer: the reader's stale record reads as a miss, never wrong bytes
    for i in range(40):
        put_page(p, key_of(f"lock-fill-{i}"), None, PAGE)
    for k in keys:
        got = r.read_bytes(k)
        assert got is None or got == page_bytes(k, PAGE)
    r.close()
    p.close()
    p2 = make(tmp_path / "s")  # lock released on close
    p2.close()


def test_use_after_fork_and_lock_survives_child_exit(tmp_path: Path) -> None:
    p = make(tmp_path / "s")
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            p.present([key_of("f")])
            code = 1
        except Exception as exc:
            code = 0 if type(exc).__name__ == "UsedAfterForkError" else 2
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0
    with pytest.raises(LockedError):
        make(tmp_path / "s")
    p.close()


# -- durability modes, group commit, fsync failure -------------------------------------------------


@pytest.mark.parametrize("durability", ["sync", "process", "none"])
def test_durability_modes_roundtrip(tmp_path: Path, durability: str) -> None:
    p = make(tmp_path / "s", durability=durability)
    keys = chain("dur", 6)
    put_chain(p, keys, PAGE)
    p.put_anchor(keys[-1], "s", anchor_bytes(keys[-1], "s", 100))
    p.close()
    p = make(tmp_path / "s", durability=durability)
    assert [p.read_bytes(k) for k in keys] == [page_bytes(k, PAGE) for k in keys]
    assert p.get_anchor(keys[-1], "s") == anchor_bytes(keys[-1], "s", 100)
    p.close()


def test_group_commit_shares_syncs(tmp_path: Path) -> None:
    p = make(tmp_path / "s", durability="sync", budget_bytes=256 * PAGE)
    keys = [key_of(f"gc-{i}") for i in range(64)]
    reservations = reserve_written(p, keys)
    p.seal_many(reservations)
    st = p.stats()
    assert st.seals == 64
    assert st.extra["syncs"] == 1  # one data sync + one journal sync covered all 64 seals
    assert all(p.present(keys))
    # many threads sealing concurrently also batch
    before = p.stats().extra["syncs"]

    def worker(i: int) -> None:
        for j in range(8):
            put_page(p, key_of(f"gc-t{i}-{j}"), None, PAGE)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert p.stats().extra["syncs"] - before <= 64
    p.close()


def test_group_commit_follower_waits_for_the_leaders_commit(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A follower whose record a leader has taken from the queue must wait until that leader's
    commit is over.  It used to return as soon as its record had left the queue: woken by any
    notify (the previous leader's, here the test's) while the new leader was still syncing, its
    seal was acknowledged before its record was written (kill -9 then lost it: found by a
    4-thread kill -9 run, 2 acknowledged seals lost in 13k) and was not failed by a failed sync
    of that commit (R7)."""
    p = make(tmp_path / "s", durability="sync", commit_window=0.3)
    syncing, release = threading.Event(), threading.Event()
    real_sync_fd = fsutil.sync_fd

    def sync_fd(fd: int, what: str, *, data_only: bool = True) -> None:
        if "journal" in what and not release.is_set():
            syncing.set()
            release.wait(10)  # the leader holds here, in the journal sync of the batch
        real_sync_fd(fd, what, data_only=data_only)

    monkeypatch.setattr(fsutil, "sync_fd", sync_fd)
    done: dict[str, float] = {}

    def seal(name: str) -> None:
        put_page(p, key_of(name), None, PAGE)
        done[name] = time.monotonic()

    leader = threading.Thread(target=seal, args=("leader",))
    leader.start()
    time.sleep(0.1)  # inside the leader's commit window: this one queues behind it
    follower = threading.Thread(target=seal, args=("follower",))
    follower.start()
    assert syncing.wait(10), "the leader never reached its journal sync"
    for _ in range(5):  # spurious wake-ups of the follower
        with p._commit_cv:
            p._commit_cv.notify_all()
        time.sleep(0.02)
    follower.join(0.3)
    assert "follower" not in done, "acknowledged before the leader's commit of its record was over"
    released = time.monotonic()
    release.set()
    leader.join(10)
    follower.join(10)
    assert done["follower"] >= released and done["leader"] >= released
    assert p.present([key_of("leader"), key_of("follower")]) == [True, True]
    p.close()


def test_failed_fsync_fails_every_waiting_seal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p = make(tmp_path / "s", durability="sync")
    good = chain("fs-good", 2)
    put_chain(p, good, PAGE)

    def broken(fd: int) -> None:
        raise OSError(errno.EIO, "injected EIO")

    monkeypatch.setattr(fsutil, "fdatasync", broken)
    bad = key_of("fs-bad")
    with pytest.raises(StorageIOError):
        put_page(p, bad, None, PAGE)
    assert p.present([bad]) == [False]
    monkeypatch.undo()
    # never retried into a success: the store refuses further acknowledgements until reopened
    with pytest.raises(StorageIOError, match="earlier sync"):
        put_page(p, key_of("fs-after"), None, PAGE)
    assert p.read_bytes(good[1]) == page_bytes(good[1], PAGE)
    p.close()
    p = make(tmp_path / "s", durability="sync")
    assert p.present(good) == [True, True]
    got = p.read_bytes(bad)
    assert got is None or got == page_bytes(bad, PAGE)
    put_page(p, key_of("fs-after"), None, PAGE)
    p.close()


# -- recovery -------------------------------------------------------------------------------------


def test_journal_truncated_at_every_512_byte_boundary(tmp_path: Path) -> None:
    p = make(tmp_path / "s", budget_bytes=64 * PAGE)
    keys = chain("torn", 12)
    put_chain(p, keys, PAGE)
    image = tmp_path / "image"
    abandon_copy(p, image)
    p.close()
    journal = image / "index.1.journal"
    valid_end = _mmap.REC_NBYTES * (1 + 12)
    for cut in range(0, valid_end + 512, 512):
        work = tmp_path / f"cut{cut}"
        work.mkdir(mode=0o700)
        for f in image.iterdir():
            data = f.read_bytes()
            if f.name == journal.name:
                data = data[: min(cut, valid_end)]
            (work / f.name).write_bytes(data)
            os.chmod(work / f.name, 0o600)
        q = make(work)
        complete = max(0, (min(cut, valid_end) - _mmap.REC_NBYTES) // _mmap.REC_NBYTES)
        present = q.present(keys)
        assert present == [i < complete for i in range(12)], cut
        for k, hit in zip(keys, present, strict=True):
            if hit:
                assert q.read_bytes(k) == page_bytes(k, PAGE)
        put_page(q, key_of(f"after-{cut}"), None, PAGE)  # the store stays writable
        q.close()


def test_torn_last_page_every_512_bytes_is_a_counted_miss(tmp_path: Path) -> None:
    p = make(tmp_path / "s")
    keys = chain("tornpage", 4)
    put_chain(p, keys, PAGE)
    p.close()
    root = tmp_path / "s"
    sf = SlotFile.open(str(next(f for f in root.iterdir() if f.name.endswith(".slots"))), writable=False)
    h = sf.headers()
    slot = int(np.flatnonzero(h["key"] == np.frombuffer(keys[-1], "V32")[0])[0])
    offset = sf.data_offset_of(slot)
    path = sf.path
    sf.close()
    original = page_bytes(keys[-1], PAGE)
    for boundary in range(512, PAGE, 512):
        # the new page's first `boundary` bytes reached the disk, the rest still holds old bytes
        fd = os.open(path, os.O_RDWR)
        os.pwrite(fd, bytes(PAGE - boundary), offset + boundary)
        os.close(fd)
        q = make(root, readonly=True)
        assert q.read_bytes(keys[-1]) is None, boundary
        assert q.stats().checksum_failures == 1
        assert [q.read_bytes(k) for k in keys[:-1]] == [page_bytes(k, PAGE) for k in keys[:-1]]
        q.close()
        fd = os.open(path, os.O_RDWR)
        os.pwrite(fd, original, offset)
        os.close(fd)
    q = make(root)
    assert q.read_bytes(keys[-1]) == original
    q.close()


def test_reopen_many_entries_with_anchors_and_snapshot(tmp_path: Path) -> None:
    p = make(tmp_path / "s", budget_bytes=5000 * 4096, slot_nbytes=4096, snapshot_every=700)
    roots = [key_of(f"many-{i}") for i in range(40)]
    keys = []
    for r in roots:
        ch = [r] + [key_of(f"{r.hex()}-{j}") for j in range(49)]
        put_chain(p, ch, 4096)
        keys += ch
    for k in keys[::97]:
        p.put_anchor(k, "s", anchor_bytes(k, "s", 50))
    p.evict(keys[10:12])  # a subtree from the middle of the first chain
    st = p.stats()
    present = p.present(keys)
    image = tmp_path / "image"
    abandon_copy(p, image)  # journal + snapshot state of a crash
    p.close()
    for where in (tmp_path / "s", image):
        q = MmapProvider(str(where))
        assert q.present(keys) == present
        st2 = q.stats()
        assert (st2.entries, st2.used_bytes, st2.anchors) == (st.entries, st.used_bytes, st.anchors)
        for k in keys[::53]:
            if q.present([k])[0]:
                assert q.read_bytes(k) == page_bytes(k, 4096)
        for k in keys[::97]:
            if q.present([k])[0]:
                assert q.get_anchor(k, "s") == anchor_bytes(k, "s", 50)
        assert q.verify().ok
        q.close()


def test_budget_lowered_on_reopen_evicts_lru(tmp_path: Path) -> None:
    p = make(tmp_path / "s", budget_bytes=32 * PAGE)
    keys = [key_of(f"low-{i}") for i in range(32)]
    for k in keys:
        put_page(p, k, None, PAGE)
    p.read_bytes(keys[0])  # recently used
    p.close()
    q = make(tmp_path / "s", budget_bytes=8 * PAGE)  # same slot size, lower budget
    st = q.stats()
    assert st.used_bytes <= 8 * PAGE and st.entries == 8
    q.close()


# -- compaction -----------------------------------------------------------------------------------


def test_compact_is_dense_and_keeps_everything(tmp_path: Path) -> None:
    p = make(tmp_path / "s", budget_bytes=128 * PAGE)
    keys = [key_of(f"cp-{i}") for i in range(60)]
    for k in keys:
        put_page(p, k, None, PAGE)
    p.put_anchor(keys[5], "a", anchor_bytes(keys[5], "a", 3000))
    p.evict(keys[::2])
    rep = p.compact()
    assert rep.entries == 30 and rep.bytes_after < rep.bytes_before
    for k in keys[1::2]:
        assert p.read_bytes(k) == page_bytes(k, PAGE)
    assert p.get_anchor(keys[5], "a") == anchor_bytes(keys[5], "a", 3000)
    put_page(p, key_of("cp-after"), None, PAGE)
    names = sorted(os.listdir(p.path))
    assert all(".2." in n or n in ("manifest.json", "writer.lock", "counters") for n in names), names
    p.close()
    q = make(tmp_path / "s")
    assert q.present(keys[1::2]) == [True] * 30
    assert q.verify().ok
    q.close()


@pytest.mark.parametrize("failure", [KeyboardInterrupt, "eio"])
def test_compact_interrupted_after_its_commit_keeps_everything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failure: object
) -> None:
    """A signal or an I/O error *after* the manifest's rename (during the directory sync) used to
    roll the compaction back and delete the new generation's files while the manifest on disk
    already named them: the reopened store was empty (found by the CLI's SIGINT-during-compact
    test)."""
    p = make(tmp_path / "s", budget_bytes=128 * PAGE)
    keys = [key_of(f"cpi-{i}") for i in range(40)]
    for k in keys:
        put_page(p, k, None, PAGE)
    p.evict(keys[::2])
    real_write = p._write_manifest

    def write_then_fail(man: object) -> None:
        real_write(man)  # type: ignore[arg-type]
        if failure is KeyboardInterrupt:
            raise KeyboardInterrupt
        raise StorageIOError("injected EIO syncing the directory")

    monkeypatch.setattr(p, "_write_manifest", write_then_fail)
    with pytest.raises((KeyboardInterrupt, StorageIOError)):
        p.compact()
    monkeypatch.undo()
    for k in keys[1::2]:  # this process still serves every entry from the new generation
        assert p.read_bytes(k) == page_bytes(k, PAGE)
    p.close()
    q = make(tmp_path / "s")
    assert q.present(keys[1::2]) == [True] * 20
    for k in keys[1::2]:
        assert q.read_bytes(k) == page_bytes(k, PAGE)
    assert q.verify().ok
    q.close()


def test_compact_refuses_in_flight_and_foreign_writer(tmp_path: Path) -> None:
    p = make(tmp_path / "s")
    res = p.reserve(key_of("inflight"), None, PAGE)
    assert res is not None
    with pytest.raises(ReservationError):
        p.compact()
    res.abort()
    # a second process/open cannot compact while this writer holds the lock
    with pytest.raises(LockedError):
        make(tmp_path / "s").compact()
    p.close()


# -- ENOSPC before any data file is mapped ---------------------------------------------------------


def test_slotfile_create_enospc_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full(fd: int, offset: int, nbytes: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    from hostkv_providers._errors import NoSpaceError

    with pytest.raises(NoSpaceError):
        MmapProvider(str(tmp_path / "s"), budget_bytes=8 * PAGE, slot_nbytes=PAGE)
    assert not [n for n in os.listdir(tmp_path / "s") if n.endswith(".slots") or n.startswith(".tmp")]
    monkeypatch.undo()
    p = MmapProvider(str(tmp_path / "s"), budget_bytes=8 * PAGE, slot_nbytes=PAGE)  # space is back
    put_page(p, key_of("n"), None, PAGE)
    p.close()


# -- found by the power-cut simulation (test_mmap_powercut.py) ---------------------------------------


def test_seal_many_snapshot_keeps_every_record(tmp_path: Path) -> None:
    """``seal_many`` finished its reservations one by one and each finish could write a snapshot:
    the snapshot taken after the first one left the others out (still in flight) and rotated the
    journal holding their seal records away.  They stayed readable in the writer, but no index on
    disk mentioned them: a kill -9 or a power cut lost acknowledged seals."""
    for durability in ("sync", "process"):
        root = tmp_path / durability
        p = MmapProvider(str(root), durability=durability, budget_bytes=64 * PAGE, slot_nbytes=PAGE,
                         snapshot_every=2)
        keys = [key_of(f"sm-{durability}-{i}") for i in range(7)]
        for start in (0, 1, 4):  # batches of 1, 3 and 3 cross the snapshot threshold mid-batch
            batch = []
            for k in keys[start : {0: 1, 1: 4, 4: 7}[start]]:
                res = p.reserve(k, None, 5000)
                assert res is not None
                res.write(0, page_bytes(k, 5000))
                batch.append(res)
            p.seal_many(batch)
        q = MmapProvider(str(root), readonly=True)  # what the disk says, the writer still open
        try:
            assert q.present(keys) == [True] * len(keys)
            assert all(q.read_bytes(k) == page_bytes(k, 5000) for k in keys)
        finally:
            q.close()
            p.close()


@pytest.mark.parametrize("how", ["verify_repair", "close"])
def test_no_snapshot_rotates_away_a_seal_still_being_indexed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             how: str) -> None:
    """``verify(repair=True)`` and ``close()`` wrote a snapshot even while another thread's seal
    had its record journaled but not yet indexed: the snapshot left the entry out and the journal
    rotation dropped its record, so the acknowledged seal was gone from the disk."""
    root = tmp_path / "s"
    p = make(root, durability="sync")
    k, other = key_of("mid-seal"), key_of("mid-seal-other")
    put_page(p, other, None, PAGE)
    fired: list[str] = []
    real = fsutil.crash_point

    def hook(name: str) -> None:
        real(name)
        if name == "mmap.seal.after_journal" and not fired:
            fired.append(name)  # another thread's maintenance call lands right here
            if how == "verify_repair":
                p.verify(repair=True)
            else:
                t = threading.Thread(target=p.close)
                t.start()
                t.join(0.2)  # close waits for nothing; let it write what it writes

    monkeypatch.setattr(fsutil, "crash_point", hook)
    res = p.reserve(k, None, PAGE)
    assert res is not None
    res.write(0, page_bytes(k, PAGE))
    try:
        res.seal()
    except Exception:
        assert how == "close"  # the store closed under the seal: not acknowledged, nothing to check
        return
    finally:
        monkeypatch.setattr(fsutil, "crash_point", real)
    assert fired
    q = MmapProvider(str(root), readonly=True)  # what the disk says (a crash would keep this)
    try:
        assert q.read_bytes(k) == page_bytes(k, PAGE) and q.read_bytes(other) == page_bytes(other, PAGE)
    finally:
        q.close()
        p.close()


# -- found by the EIO/ENOSPC injection (test_mmap_faults.py) ----------------------------------------


@pytest.mark.parametrize("victim", ["manifest.json", "index.1.journal"])
def test_eio_looking_for_a_file_is_not_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                victim: str) -> None:
    """``os.path.lexists`` reads any error as "missing".  An EIO on the manifest's ``lstat`` made
    open create a brand-new store over the existing one (new store id, and the old generation's
    files deleted as leftovers); on the journal's, open replaced a journal full of records by an
    empty one.  Both now raise a typed error and leave the store alone."""
    p = make(tmp_path / "s")
    keys = chain("lx", 4)
    put_chain(p, keys, PAGE)
    p.compact()  # generation 2: a new store of generation 1 would delete it as a leftover
    put_page(p, key_of("lx-journaled"), None, PAGE)  # a record in the journal, not in the snapshot
    p._closed = True  # kill -9: no snapshot at close, the journal holds the last record
    p._release_all()
    victim = victim.replace(".1.", ".2.")
    real = os.lstat

    def failing(path: object, *a: object, **kw: object) -> os.stat_result:
        if str(path).endswith(victim):
            raise OSError(errno.EIO, "injected EIO", str(path))
        return real(path, *a, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "lstat", failing)
    with pytest.raises(StorageIOError, match="I/O error"):
        make(tmp_path / "s")
    monkeypatch.undo()
    q = make(tmp_path / "s")
    assert [q.read_bytes(k) for k in keys] == [page_bytes(k, PAGE) for k in keys]
    assert q.read_bytes(key_of("lx-journaled")) == page_bytes(key_of("lx-journaled"), PAGE)
    q.close()


@pytest.mark.parametrize("call", ["listdir", "fstat"])
def test_eio_in_open_is_a_typed_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, call: str) -> None:
    """Listing the store directory and the journal's ``fstat`` let a bare ``OSError`` out of open
    (and of a seal whose snapshot reopened the journal, and compact's size report)."""
    p = make(tmp_path / "s")
    put_page(p, key_of("t"), None, PAGE)
    p.close()
    real = getattr(os, call)
    target = {"listdir": "_open_data_files", "fstat": "_open_journal_for_append"}[call]

    def failing(arg: object, *a: object) -> object:
        if target in (sys._getframe(1).f_code.co_name, sys._getframe(2).f_code.co_name):
            raise OSError(errno.EIO, "injected EIO")
        return real(arg, *a)

    monkeypatch.setattr(os, call, failing)
    with pytest.raises(StorageIOError, match="I/O error"):
        make(tmp_path / "s")
    monkeypatch.undo()
    q = make(tmp_path / "s")
    assert q.read_bytes(key_of("t")) == page_bytes(key_of("t"), PAGE)
    q.close()


@pytest.mark.parametrize("what", ["fsync_dir", "mmap"])
def test_failed_data_file_creation_after_its_rename(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    what: str) -> None:
    """A new data file whose directory sync (or mapping) failed after its rename stayed under its
    final name, unregistered: every later attempt to add it raised "already exists"
    (InvalidArgumentError) until the store was reopened.  Now the file is removed and writes
    resume in the same instance."""
    p = make(tmp_path / "s", budget_bytes=16 * PAGE, file_nbytes=2 * PAGE)
    put_page(p, key_of("d0"), None, PAGE)
    put_page(p, key_of("d1"), None, PAGE)  # the first data file is full
    calls = []
    if what == "fsync_dir":
        def failing_dir(path: str) -> None:
            calls.append(path)
            raise StorageIOError("injected EIO syncing the directory")

        monkeypatch.setattr(fsutil, "fsync_dir", failing_dir)
    else:
        import mmap as mmap_mod

        def failing_mmap(*a: object, **kw: object) -> object:
            calls.append(a)
            raise OSError(errno.EIO, "injected EIO")

        monkeypatch.setattr(mmap_mod, "mmap", failing_mmap)
    with pytest.raises(StorageIOError):
        put_page(p, key_of("d2"), None, PAGE)
    monkeypatch.undo()
    assert calls
    for i in range(2, 6):  # writes resume: new data files are added
        put_page(p, key_of(f"d{i}"), None, PAGE)
    assert all(p.read_bytes(key_of(f"d{i}")) == page_bytes(key_of(f"d{i}"), PAGE) for i in range(6))
    p.close()


def test_failed_creation_whose_cleanup_failed_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A device that stays broken: the new data file's directory sync fails *and* so does the
    cleanup's unlink.  The unreferenced file under its final name must not block the next create
    of that file id once the device works again (it did: "already exists"); the same holds for
    a compaction retried after one that failed that way."""
    p = make(tmp_path / "s", budget_bytes=16 * PAGE, file_nbytes=2 * PAGE)
    put_page(p, key_of("e0"), None, PAGE)
    put_page(p, key_of("e1"), None, PAGE)

    def failing_dir(path: str) -> None:
        raise StorageIOError("injected EIO syncing the directory")

    def failing_unlink(path: object, *a: object, **kw: object) -> None:
        raise OSError(errno.EIO, "injected EIO", str(path))

    for action in (lambda: put_page(p, key_of("e2"), None, PAGE), p.compact):
        monkeypatch.setattr(fsutil, "fsync_dir", failing_dir)
        monkeypatch.setattr(os, "unlink", failing_unlink)
        with pytest.raises(StorageIOError):
            action()
        monkeypatch.undo()
        assert any(n.startswith("data.") for n in os.listdir(tmp_path / "s"))
    put_page(p, key_of("e2"), None, PAGE)  # a new data file: the leftover is replaced
    p.compact()  # into generation 2: the failed compaction's files are replaced
    assert all(p.read_bytes(key_of(f"e{i}")) == page_bytes(key_of(f"e{i}"), PAGE) for i in range(3))
    p.close()


def test_eio_inspecting_the_store_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An EIO from the store directory's lstat in the permission check was taken for a
    permission problem; the adoption path then called lstat again, and its EIO escaped as a bare
    OSError."""
    make(tmp_path / "s").close()
    real = os.lstat
    target = str(tmp_path / "s")
    seen = []

    def failing(path: object, *a: object, **kw: object) -> os.stat_result:
        if str(path) == target:
            seen.append(path)
        if len(seen) > 1 and str(path) == target:  # the existence check passes, the rest fails
            raise OSError(errno.EIO, "injected EIO", str(path))
        return real(path, *a, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "lstat", failing)
    with pytest.raises(StorageIOError, match="I/O error"):
        make(tmp_path / "s")
    monkeypatch.undo()
    make(tmp_path / "s").close()


def test_fork_while_another_thread_holds_the_lock(tmp_path: Path) -> None:
    """Found while running the suite (``test_use_after_fork_while_busy`` hung now and then): the
    provider's methods take its lock before the fork check, so a child forked while another
    thread of the parent held the lock waited forever instead of raising ``UsedAfterForkError``.
    The child now starts with fresh locks."""
    import signal

    p = make(tmp_path / "s")
    put_page(p, key_of("f"), None, PAGE)
    held, done = threading.Event(), threading.Event()

    def hold() -> None:
        with p._lock:
            held.set()
            done.wait(30)

    t = threading.Thread(target=hold)
    t.start()
    held.wait(30)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        code = 1
        try:
            signal.alarm(10)  # a hang ends as SIGALRM, not as a stuck test run
            p.present([key_of("f")])
        except Exception as exc:
            code = 0 if type(exc).__name__ == "UsedAfterForkError" else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    done.set()
    t.join()
    assert not os.WIFSIGNALED(status), "the child hung on the copied lock"
    assert os.WEXITSTATUS(status) == 0
    assert p.read_bytes(key_of("f")) == page_bytes(key_of("f"), PAGE)
    p.close()


@pytest.mark.parametrize("call", ["read", "read_many"])
def test_a_close_racing_a_read_is_a_closed_error_and_drops_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   call: str) -> None:
    """A read copies without the lock; a close meanwhile closes the data files under it, so the
    copy fails its header check.  That is a ``ClosedError`` for the reader, not a checksum
    failure: the entry is not dropped (the hostile suite's close race once did, and then
    failed with ``StorageIOError`` on the closed journal), and it is intact after a reopen."""
    p = make(tmp_path / "s")
    key = key_of("mmap-close-during-read")
    put_page(p, key, None, PAGE)
    inside, go = threading.Event(), threading.Event()
    name = "read_into" if call == "read" else "read_batch"
    real = getattr(SlotFile, name)

    def slow(self: SlotFile, *args: object, **kw: object) -> object:
        inside.set()
        assert go.wait(10)
        return real(self, *args, **kw)

    monkeypatch.setattr(SlotFile, name, slow)
    got: list[object] = []

    def read() -> None:
        try:
            got.append(p.read(key, bytearray(PAGE)) if call == "read" else p.read_many([key], [bytearray(PAGE)]))
        except BaseException as exc:
            got.append(exc)

    reader = threading.Thread(target=read)
    reader.start()
    assert inside.wait(10)
    p.close()
    go.set()
    reader.join(10)
    assert len(got) == 1 and isinstance(got[0], ClosedError), got
    monkeypatch.undo()
    fresh = make(tmp_path / "s")
    try:
        assert fresh.read_bytes(key) == page_bytes(key, PAGE)
        assert fresh.stats().checksum_failures == 0
    finally:
        fresh.close()


def test_a_refused_open_of_a_foreign_directory_leaves_no_lock_file(tmp_path: Path) -> None:
    """Opening mmap:// over a directory that holds something else (an lmdb store, say) is refused,
    and leaves nothing there: a writer.lock left behind made every later open of that lmdb store
    refuse it as holding a foreign file (a review's finding, reproduced)."""
    d = tmp_path / "other"
    d.mkdir(mode=0o700)
    (d / "data.mdb").write_bytes(b"\0" * 4096)
    (d / "data.mdb").chmod(0o600)
    before = sorted(os.listdir(d))
    with pytest.raises(HostKVError, match="other files"):
        open_provider(f"mmap://{d}?budget=1MiB")
    assert sorted(os.listdir(d)) == before
    # a lock file that was there before is not the open's to remove
    (d / "writer.lock").write_bytes(b"")
    (d / "writer.lock").chmod(0o600)
    with pytest.raises(HostKVError, match="other files"):
        open_provider(f"mmap://{d}?budget=1MiB")
    assert (d / "writer.lock").exists()


def test_a_url_option_without_a_value_is_a_typed_error() -> None:
    for url in ("mmap:///tmp/x?budget", "pinned://?budget=1MiB&pin", "lmdb:///tmp/x?readonly"):
        with pytest.raises(InvalidArgumentError, match="name=value"):
            open_provider(url)
