"""lmdb provider: the on-disk format, security, identity, bit flips, ENOSPC, map growth, fault
injection, dead-process reclamation, compaction, and the multi-process test (RELIABILITY.md)."""

from __future__ import annotations

import errno
import multiprocessing as mp
import os
import random
import shutil
import stat
import subprocess
import time
from pathlib import Path
from typing import Any

import lmdb
import msgpack
import pytest

from hostkv_providers import open_provider
from hostkv_providers._errors import (
    CapacityError,
    HostKVError,
    IncompatibleStoreError,
    InFlightError,
    InvalidArgumentError,
    LockedError,
    NoSpaceError,
    StorageIOError,
    UnknownKeyError,
    UnsafeStoreError,
)
from hostkv_providers.providers import _fsutil as _fsutil
from hostkv_providers.providers.lmdb._provider import LmdbProvider
from hostkv_providers.testing import anchor_bytes, chain, key_of, page_bytes, put_chain, put_page

from .test_lmdb import ENTRY, backdoor_read

PAGE = 8192


def _store(tmp_path: Path, **kw: Any) -> LmdbProvider:
    kw.setdefault("budget_bytes", 256 * PAGE)
    kw.setdefault("inline_max", 0)
    return LmdbProvider(tmp_path / "store", **kw)


def _fork_and_wait(fn: Any) -> int:
    """Run ``fn()`` in a forked child (the parent must not hold the store open); exit status."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        code = 1
        try:
            fn()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


# ---------------------------------------------------------------------------------------------
# Format: a valid LMDB environment, private files
# ---------------------------------------------------------------------------------------------


def test_mdb_stat_reads_the_environment(tmp_path: Path) -> None:
    tool = shutil.which("mdb_stat")
    if tool is None:
        pytest.skip("mdb_stat not installed (Debian/Ubuntu: apt-get install lmdb-utils)")
    p = _store(tmp_path)
    keys = chain("mdbstat", 5)
    put_chain(p, keys, PAGE)
    p.put_anchor(keys[-1], "state", b"s" * 100)
    p.close()
    out = subprocess.run([tool, "-a", str(tmp_path / "store")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    for db in ("entries", "children", "lru", "anchors", "meta", "free", "files", "flights", "leases", "pages"):
        assert f"Status of {db}" in out.stdout
    # the entries database holds exactly the five entries
    section = out.stdout.split("Status of entries", 1)[1].split("Status of", 1)[0]
    assert "Entries: 5" in section
    env = subprocess.run([tool, "-e", str(tmp_path / "store")], capture_output=True, text=True, timeout=60)
    assert env.returncode == 0 and "Environment Info" in env.stdout


def test_private_permissions(tmp_path: Path) -> None:
    old = os.umask(0o000)  # even a permissive umask must not leak group/other bits
    try:
        p = _store(tmp_path)
        put_page(p, key_of("perm"), None, PAGE)
        p.close()
    finally:
        os.umask(old)
    store = tmp_path / "store"
    assert stat.S_IMODE(os.stat(store).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(store / "slots").st_mode) == 0o700
    files = [store / "data.mdb", store / "lock.mdb", store / "hostkv.lock", *(store / "slots").iterdir()]
    assert len(files) >= 4
    for f in files:
        assert stat.S_IMODE(os.stat(f).st_mode) == 0o600, f


def test_loose_permissions_and_symlinks_are_refused(tmp_path: Path) -> None:
    p = _store(tmp_path)
    put_page(p, key_of("unsafe"), None, PAGE)
    p.close()
    store = tmp_path / "store"
    os.chmod(store, 0o755)
    with pytest.raises(UnsafeStoreError):
        LmdbProvider(store)
    os.chmod(store, 0o700)
    os.chmod(store / "data.mdb", 0o644)
    with pytest.raises(UnsafeStoreError):
        LmdbProvider(store)
    os.chmod(store / "data.mdb", 0o600)
    os.rename(store / "data.mdb", tmp_path / "elsewhere.mdb")
    os.symlink(tmp_path / "elsewhere.mdb", store / "data.mdb")
    with pytest.raises(UnsafeStoreError):
        LmdbProvider(store)
    os.unlink(store / "data.mdb")
    os.rename(tmp_path / "elsewhere.mdb", store / "data.mdb")
    p = LmdbProvider(store)
    assert p.read_bytes(key_of("unsafe")) == page_bytes(key_of("unsafe"), PAGE)
    p.close()


def test_foreign_directory_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "other"
    d.mkdir(mode=0o700)
    (d / "journal.bin").write_bytes(b"x")
    with pytest.raises(IncompatibleStoreError):
        LmdbProvider(d)


def test_url_options(tmp_path: Path) -> None:
    url = f"lmdb://{tmp_path}/u?budget=1MiB&durability=sync&inline_max=0&map_size=2MiB&map_max=64MiB"
    p = open_provider(url)
    assert isinstance(p, LmdbProvider)
    assert p.budget_bytes == 1 << 20 and p.durability == "sync"
    assert p.put(key_of("url"), None, page_bytes(key_of("url"), PAGE))
    p.close()
    for bad in ("durability=fast", "budget=lots", "colour=blue", "inline_max=-1"):
        with pytest.raises(InvalidArgumentError):
            open_provider(f"lmdb://{tmp_path}/u?{bad}")
    with pytest.raises(InvalidArgumentError):
        open_provider("lmdb://?budget=1MiB")


# ---------------------------------------------------------------------------------------------
# Identity (R4)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("field, value", [("format_version", 99), ("key_algorithm", "sha1-truncated"),
                                          ("checksum_algorithm", "crc32"), ("store_version", 2)])
def test_identity_mismatch_is_refused(tmp_path: Path, field: str, value: object) -> None:
    p = _store(tmp_path)
    put_page(p, key_of("identity"), None, PAGE)
    p.close()
    env = lmdb.open(str(tmp_path / "store"), max_dbs=16, mode=0o600)
    meta = env.open_db(b"meta")
    with env.begin(write=True) as txn:
        manifest = msgpack.unpackb(txn.get(b"manifest", db=meta), raw=False)
        manifest[field] = value
        txn.put(b"manifest", msgpack.packb(manifest, use_bin_type=True), db=meta)
    env.close()
    with pytest.raises(IncompatibleStoreError) as info:
        LmdbProvider(tmp_path / "store")
    assert field in str(info.value)


# ---------------------------------------------------------------------------------------------
# Bit flips (R1): in page data, slot headers, inline values and index records
# ---------------------------------------------------------------------------------------------


def _flip_file(path: Path, offset: int) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        b = os.pread(fd, 1, offset)
        os.pwrite(fd, bytes([b[0] ^ (1 << random.randrange(8))]), offset)
    finally:
        os.close(fd)


def test_bit_flips_are_detected_never_returned(tmp_path: Path) -> None:
    rng = random.Random(1234)
    random.seed(1234)
    p = _store(tmp_path, inline_max=PAGE // 2, budget_bytes=512 * PAGE)
    s: Any = p._s
    keys = [key_of(f"flip-{i}") for i in range(48)]

    def refill() -> None:
        for i, k in enumerate(keys):
            if not p.present([k])[0]:
                p.put(k, None, page_bytes(k, PAGE if i % 3 else PAGE // 4))

    def expected(i: int) -> bytes:
        return page_bytes(keys[i], PAGE if i % 3 else PAGE // 4)

    refill()
    flips = detected = 0
    for _ in range(2000):
        i = rng.randrange(len(keys))
        k = keys[i]
        with s.env.begin() as txn:
            raw = bytes(txn.get(k, db=s.dbs["entries"]))
        fields = ENTRY.unpack_from(raw)  # the documented record layout
        nbytes, fid, slot = fields[3], fields[12], fields[13]
        where = rng.choice(["data", "header", "record"] if fid else ["data", "record"])
        if where == "record":
            at = rng.randrange(len(raw))
            bad = bytearray(raw)
            bad[at] ^= 1 << rng.randrange(8)
            with s.env.begin(write=True) as txn:
                txn.put(k, bytes(bad), db=s.dbs["entries"])
        elif fid == 0:
            with s.env.begin(write=True) as txn:
                blob = bytearray(txn.get(k, db=s.dbs["pages"]))
                blob[rng.randrange(len(blob))] ^= 1 << rng.randrange(8)
                txn.put(k, bytes(blob), db=s.dbs["pages"])
        else:
            path = tmp_path / "store" / "slots" / f"{fid:08d}.slots"
            with open(path, "rb") as f:
                head = f.read(128)
            slot_nbytes = int.from_bytes(head[16:24], "little")
            data_offset = int.from_bytes(head[40:48], "little")
            if where == "data":
                _flip_file(path, data_offset + slot * slot_nbytes + rng.randrange(nbytes))
            else:
                _flip_file(path, 4096 + slot * 128 + rng.randrange(128))
        flips += 1
        if rng.random() < 0.05:  # sometimes verify finds it first
            report = p.verify()
            assert report.corrupt == [k], (where, report)
            assert p.verify(repair=True).dropped == 1
            detected += 1
        else:
            out = bytearray(nbytes)
            if p.read(k, out):
                # a flip in a header field that does not identify the page (parent, flags, the
                # header checksum) leaves the page bytes intact: the read is right, verify sees it
                assert where == "header" and bytes(out) == expected(i), where
                assert p.verify().corrupt == [k]
                assert p.verify(repair=True).dropped == 1
            detected += 1
        if flips % 100 == 0:  # every other entry still reads exactly
            for j, other in enumerate(keys):
                got = p.read_bytes(other)
                assert got is None or got == expected(j)
        refill()
    assert flips == detected == 2000
    assert p.stats().checksum_failures + p.stats().extra["store_checksum_failures"] >= 1
    assert p.verify().ok
    p.close()


# ---------------------------------------------------------------------------------------------
# ENOSPC on a real full filesystem, map growth and map_max
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def small_fs(tmp_path: Path) -> Any:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m,mode=0700", "tmpfs", str(mnt)],
                         capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_enospc_is_a_typed_error_and_writes_resume(small_fs: Path) -> None:
    p = LmdbProvider(small_fs / "store", budget_bytes=64 << 20, inline_max=0, file_nbytes=256 << 10,
                     map_size=1 << 20)
    stored: list[bytes] = []
    with pytest.raises(NoSpaceError):
        for i in range(10_000):
            k = key_of(f"enospc-{i}")
            put_page(p, k, None, 16384)
            stored.append(k)
    assert len(stored) > 10
    for k in stored:  # everything acknowledged before the error is intact
        assert p.read_bytes(k) == page_bytes(k, 16384)
    p.evict(stored[: len(stored) // 2])
    for i in range(5):  # freed slots are reused: writes resume
        put_page(p, key_of(f"enospc-after-{i}"), None, 16384)
    p.close()
    p = LmdbProvider(small_fs / "store")
    for k in stored[len(stored) // 2 :]:
        assert p.read_bytes(k) == page_bytes(k, 16384)
    assert p.verify().ok
    p.close()


def test_map_grows_then_map_max_is_a_typed_error(tmp_path: Path) -> None:
    p = _store(tmp_path, inline_max=1 << 20, budget_bytes=1 << 30, map_size=1 << 20, map_max=4 << 20)
    ok: list[bytes] = []
    with pytest.raises(NoSpaceError) as info:
        for i in range(10_000):
            k = key_of(f"map-{i}")
            put_page(p, k, None, 4096)
            ok.append(k)
    assert "map_max" in info.value.hint
    assert p.stats().extra["map_size"] >= 4 << 20  # grew from 1 MiB to the limit
    assert len(ok) > 300
    for k in ok[::17]:
        assert p.read_bytes(k) == page_bytes(k, 4096)
    p.evict(ok[:100])
    put_page(p, key_of("map-after"), None, 4096)  # still usable
    p.close()


# ---------------------------------------------------------------------------------------------
# R7: a failed fsync fails the seal for good
# ---------------------------------------------------------------------------------------------


def test_failed_sync_fails_the_seal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p = _store(tmp_path, durability="sync")
    good = key_of("sync-good")
    put_page(p, good, None, PAGE)

    def eio(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(_fsutil, "fdatasync", eio)
    k = key_of("sync-bad")
    res = p.reserve(k, None, PAGE)
    assert res is not None
    res.write(0, page_bytes(k, PAGE))
    with pytest.raises(StorageIOError):
        res.seal()
    assert res.state == "aborted"
    assert p.present([k]) == [False] and p.in_flight(k) is False
    monkeypatch.undo()
    assert p.put(k, None, page_bytes(k, PAGE))  # a fresh reservation works once the device does
    assert p.read_bytes(k) == page_bytes(k, PAGE) and p.read_bytes(good) == page_bytes(good, PAGE)
    p.close()


# ---------------------------------------------------------------------------------------------
# Reservations and leases across processes; dead owners are reclaimed
# ---------------------------------------------------------------------------------------------


def test_dead_process_reservations_and_leases_are_reclaimed(tmp_path: Path) -> None:
    store = tmp_path / "store"
    p = LmdbProvider(store, budget_bytes=8 * PAGE, inline_max=0)
    keys = [key_of(f"dead-{i}") for i in range(6)]
    for k in keys:
        put_page(p, k, None, PAGE)
    p.close()

    def crashed_child() -> None:
        c = LmdbProvider(store)
        res = c.reserve(key_of("dead-inflight"), None, PAGE)
        assert res is not None
        c.lease(keys)  # leases every entry, then "crashes" without releasing anything
        os._exit(0)

    assert _fork_and_wait(crashed_child) == 0
    p = LmdbProvider(store)  # reclaims on open: the owner is gone
    assert p.stats().in_flight == 0 and p.stats().leased == 0
    assert p.in_flight(key_of("dead-inflight")) is False
    assert p.put(key_of("dead-inflight"), None, page_bytes(key_of("dead-inflight"), PAGE))
    assert p.evict(nbytes=2 * PAGE).entries == 2  # the dead lease no longer pins anything
    p.close()


def test_live_process_reservation_is_in_flight_elsewhere(tmp_path: Path) -> None:
    store = tmp_path / "store"
    LmdbProvider(store, budget_bytes=16 * PAGE, inline_max=0).close()
    k = key_of("cross-inflight")
    ctx = mp.get_context("spawn")
    go, done = ctx.Event(), ctx.Event()
    child = ctx.Process(target=_hold_reservation, args=(str(store), k, go, done))
    child.start()
    try:
        assert go.wait(60)
        p = LmdbProvider(store)
        assert p.in_flight(k) is True
        with pytest.raises(InFlightError):
            p.reserve(k, None, PAGE)
        done.set()
        assert p.wait_sealed(k, 60.0) is True
        assert p.read_bytes(k) == page_bytes(k, PAGE)
        p.close()
    finally:
        done.set()
        child.join(60)
    assert child.exitcode == 0


def _hold_reservation(store: str, key: bytes, go: Any, done: Any) -> None:
    p = LmdbProvider(store)
    res = p.reserve(key, None, PAGE)
    assert res is not None
    res.write(0, page_bytes(key, PAGE))
    go.set()
    done.wait(60)
    res.seal()
    p.close()


def test_budget_is_a_store_property(tmp_path: Path) -> None:
    p = _store(tmp_path, budget_bytes=32 * PAGE)
    keys = [key_of(f"budget-{i}") for i in range(30)]
    for k in keys:
        put_page(p, k, None, PAGE)
    p.close()
    p = LmdbProvider(tmp_path / "store")
    assert p.budget_bytes == 32 * PAGE
    p.close()
    p = LmdbProvider(tmp_path / "store", budget_bytes=10 * PAGE)  # shrinking trims LRU entries
    st = p.stats()
    assert st.budget_bytes == 10 * PAGE and st.used_bytes <= 10 * PAGE
    assert p.present(keys[-10:]) == [True] * 10
    with pytest.raises(CapacityError):
        p.reserve(key_of("budget-huge"), None, 11 * PAGE)
    p.close()


# ---------------------------------------------------------------------------------------------
# Compaction
# ---------------------------------------------------------------------------------------------


def test_compact_shrinks_and_keeps_everything(tmp_path: Path) -> None:
    p = _store(tmp_path, budget_bytes=1024 * PAGE, file_nbytes=64 * PAGE, inline_max=PAGE // 2)
    keys = []
    for c in range(20):
        ks = chain(f"compact-{c}", 20)
        put_chain(p, ks, PAGE)
        keys.append(ks)
        p.put_anchor(ks[-1], "state", anchor_bytes(ks[-1], "state", 300))
    small = [key_of(f"compact-inline-{i}") for i in range(50)]
    for k in small:
        put_page(p, k, None, 1000)
    for ks in keys[::2]:
        p.evict([ks[0]])
    for ks in keys[1::2]:
        p.evict([ks[5]])
    p.evict(small[::2])
    before = p.stats()
    progress: list[tuple[int, int]] = []
    report = p.compact(progress=lambda d, t: progress.append((d, t)))
    assert report.entries == before.entries
    assert report.bytes_after < report.bytes_before
    assert progress and progress[-1][0] == progress[-1][1]
    after = p.stats()
    assert (after.entries, after.used_bytes) == (before.entries, before.used_bytes)
    for ks in keys[1::2]:
        assert p.longest_prefix(ks) == 5
        for k in ks[:5]:
            assert p.read_bytes(k) == page_bytes(k, PAGE)
            assert backdoor_read(p, k) == page_bytes(k, PAGE)
    for k in small[1::2]:
        assert p.read_bytes(k) == page_bytes(k, 1000)
    assert p.verify().ok
    for i in range(30):  # and the store keeps working
        put_page(p, key_of(f"compact-after-{i}"), None, PAGE)
    p.close()
    p = LmdbProvider(tmp_path / "store")
    assert p.verify().ok and p.stats().entries == after.entries + 30
    p.close()


def test_compact_refuses_while_others_have_the_store(tmp_path: Path) -> None:
    store = tmp_path / "store"
    p = LmdbProvider(store, budget_bytes=64 * PAGE, inline_max=0)
    put_page(p, key_of("busy"), None, PAGE)
    with p.lease([key_of("busy")]), pytest.raises(LockedError):
        p.compact()
    p.close()
    ctx = mp.get_context("spawn")
    go, done = ctx.Event(), ctx.Event()
    child = ctx.Process(target=_hold_open, args=(str(store), go, done))
    child.start()
    try:
        assert go.wait(60)
        p = LmdbProvider(store)
        with pytest.raises(LockedError):
            p.compact()
        assert p.read_bytes(key_of("busy")) == page_bytes(key_of("busy"), PAGE)  # still usable
        p.close()
    finally:
        done.set()
        child.join(60)
    assert child.exitcode == 0


def _hold_open(store: str, go: Any, done: Any) -> None:
    p = LmdbProvider(store)
    go.set()
    done.wait(60)
    p.close()


# ---------------------------------------------------------------------------------------------
# Threads in sync mode: group commit keeps every acknowledged seal
# ---------------------------------------------------------------------------------------------


def test_group_commit_threads_sync_mode(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    p = _store(tmp_path, durability="sync", budget_bytes=1024 * PAGE)
    syncs = [0]
    real = _fsutil.fdatasync

    def counting(fd: int) -> None:
        syncs[0] += 1
        real(fd)

    monkeypatch.setattr(_fsutil, "fdatasync", counting)
    errors: list[BaseException] = []

    def writer(t: int) -> None:
        try:
            put_chain(p, chain(f"group-{t}", 25), PAGE)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == []
    assert p.stats().seals == 200
    assert syncs[0] <= 200  # never more than one data sync per seal; batches share one
    p.close()
    p = LmdbProvider(tmp_path / "store")
    for t in range(8):
        ks = chain(f"group-{t}", 25)
        assert p.longest_prefix(ks) == 25
        assert p.read_bytes(ks[-1]) == page_bytes(ks[-1], PAGE)
    p.close()


# ---------------------------------------------------------------------------------------------
# The multi-process test: 2 writer processes + 3 reader processes share one store
# ---------------------------------------------------------------------------------------------

MP_SECONDS = float(os.environ.get("HOSTKV_MP_SECONDS", "6"))
MP_PAGE = 16384


def _mp_writer(store: str, w: int, seconds: float, out: Any) -> None:
    try:
        p = LmdbProvider(store)
        rng = random.Random(w)
        deadline = time.monotonic() + seconds
        seals = evictions = 0
        while time.monotonic() < deadline:
            c = rng.randrange(40)
            ks = chain(f"mp-{c}", 12)  # both writers write the same chains: dedup and in-flight
            parent = None
            for k in ks[: rng.randrange(1, 13)]:
                try:
                    res = p.reserve(k, parent, MP_PAGE)
                except InFlightError:
                    if not p.wait_sealed(k, 30.0):
                        break
                    parent = k
                    continue
                except (UnknownKeyError, CapacityError):
                    break
                if res is not None:
                    res.write(0, page_bytes(k, MP_PAGE))
                    res.seal()
                    seals += 1
                    if rng.random() < 0.2:
                        try:
                            p.put_anchor(k, "state", anchor_bytes(k, "state", 64))
                        except (UnknownKeyError, CapacityError):
                            break  # the other writer evicted the page right after its seal
                parent = k
            if rng.random() < 0.1:
                evictions += p.evict([chain(f"mp-{rng.randrange(40)}", 12)[rng.randrange(12)]]).entries
            st = p.stats()
            if st.used_bytes > st.budget_bytes:
                out.put(("error", f"writer {w}: used {st.used_bytes} > budget {st.budget_bytes}"))
        p.close()
        out.put(("writer", w, seals, evictions))
    except BaseException as exc:  # report, never hang the parent
        out.put(("error", f"writer {w}: {exc!r}"))


def _mp_reader(store: str, r: int, seconds: float, out: Any) -> None:
    try:
        p = LmdbProvider(store)
        rng = random.Random(100 + r)
        deadline = time.monotonic() + seconds
        reads = hits = wrong = 0
        buf = bytearray(MP_PAGE)
        while time.monotonic() < deadline:
            ks = chain(f"mp-{rng.randrange(40)}", 12)
            if rng.random() < 0.1:  # an engine's restore: lookup, lease, zero-copy views
                n = p.longest_prefix(ks)
                with p.lease(ks[:n]) as lease:
                    for k in lease.keys:
                        regions = p.view(lease, k)
                        if regions is not None:
                            reads += 1
                            hits += 1
                            wrong += b"".join(bytes(x.view) for x in regions) != page_bytes(k, MP_PAGE)
            else:
                for k in ks:
                    reads += 1
                    if p.read(k, buf):
                        hits += 1
                        wrong += bytes(buf) != page_bytes(k, MP_PAGE)
                    if rng.random() < 0.1:
                        blob = p.get_anchor(k, "state")
                        wrong += blob is not None and blob != anchor_bytes(k, "state", 64)
        p.close()
        out.put(("reader", r, reads, hits, wrong))
    except BaseException as exc:
        out.put(("error", f"reader {r}: {exc!r}"))


def _mp_victim(store: str, ready: Any) -> None:
    """A reader that is SIGKILLed mid-transaction by the parent."""
    p = LmdbProvider(store)
    s: Any = p._s
    txn = s.env.begin()  # a reader slot held open until the kill
    txn.get(b"x" * 32, db=s.dbs["entries"])
    ready.set()
    time.sleep(600)


def test_two_writers_three_readers(tmp_path: Path) -> None:
    import signal

    store = tmp_path / "store"
    # a budget far below the working set, so the processes evict each other's pages constantly
    LmdbProvider(store, budget_bytes=160 * MP_PAGE, inline_max=0).close()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    ready = ctx.Event()
    victim = ctx.Process(target=_mp_victim, args=(str(store), ready))
    victim.start()
    procs = [ctx.Process(target=_mp_writer, args=(str(store), w, MP_SECONDS, out)) for w in range(2)]
    procs += [ctx.Process(target=_mp_reader, args=(str(store), r, MP_SECONDS, out)) for r in range(3)]
    for pr in procs:
        pr.start()
    results = []
    try:
        assert ready.wait(60)
        os.kill(victim.pid, signal.SIGKILL)  # a reader dies holding a read transaction
        for _ in procs:
            results.append(out.get(timeout=MP_SECONDS + 120))  # a deadlock fails here
    finally:
        for pr in [*procs, victim]:
            pr.join(30)
            if pr.is_alive():
                pr.kill()
    print("multi-process results:", results)
    errors = [r for r in results if r[0] == "error"]
    assert errors == []
    assert all(pr.exitcode == 0 for pr in procs)
    writers = [r for r in results if r[0] == "writer"]
    readers = [r for r in results if r[0] == "reader"]
    assert len(writers) == 2 and len(readers) == 3
    assert sum(r[2] for r in writers) > 0
    assert sum(r[2] for r in readers) > 0 and sum(r[3] for r in readers) > 0
    assert sum(r[4] for r in readers) == 0, "a reader saw wrong bytes"
    # The raw reader table before anyone cleans it: processes that exited cleanly left no slot;
    # only the killed reader's may remain, and reader_check() (run by every open) clears it.
    env = lmdb.open(str(store), max_dbs=16, mode=0o600, lock=True)
    try:
        pids = {int(ln.split()[0]) for ln in env.readers().splitlines()[1:] if ln.strip() and ln.split()[0].isdigit()}
        assert pids <= {victim.pid}, f"stale reader slots of {pids - {victim.pid}}"
        env.reader_check()
        assert not [ln for ln in env.readers().splitlines()[1:] if ln.strip() and ln.split()[0].isdigit()]
    finally:
        env.close()
    p = LmdbProvider(store)
    try:
        st = p.stats()
        assert st.in_flight == 0 and st.leased == 0 and st.used_bytes <= st.budget_bytes
        report = p.verify()
        assert report.ok, report
        for info in p.iter_entries():
            assert p.read_bytes(info.key) == page_bytes(info.key, MP_PAGE)
    finally:
        p.close()


def test_errors_are_typed(tmp_path: Path) -> None:
    p = _store(tmp_path)
    with pytest.raises(InvalidArgumentError):
        p.reserve(key_of("tag"), None, PAGE, salt_tag="x" * 300)
    p.close()
    with pytest.raises(HostKVError):
        LmdbProvider(tmp_path / "store", durability="sometimes")
    with pytest.raises(InvalidArgumentError):
        LmdbProvider(tmp_path / "store", map_size=1 << 20, map_max=1 << 19)


def test_view_stays_valid_when_a_leased_entry_is_dropped(tmp_path: Path) -> None:
    from .test_lmdb import backdoor_corrupt

    p = _store(tmp_path, budget_bytes=8 * PAGE)
    k = key_of("view-drop")
    put_page(p, k, None, PAGE)
    with p.lease([k]) as lease:
        regions = p.view(lease, k)
        assert regions is not None and bytes(regions[0].view) == page_bytes(k, PAGE)
        backdoor_corrupt(p, k, at=10)
        assert p.read(k, bytearray(PAGE)) is False  # dropped: checksum failure
        seen = bytes(regions[0].view)
        fresh = [key_of(f"view-drop-new-{i}") for i in range(20)]
        for f in fresh:  # pressure: every free slot gets reused, but not the leased one's
            put_page(p, f, None, PAGE)
        assert bytes(regions[0].view) == seen
        assert all(bytes(regions[0].view) != page_bytes(f, PAGE) for f in fresh)
        assert p.verify().ok
    assert p.verify().ok  # released: the slot is back on the free list, nothing leaked
    for i in range(8):
        put_page(p, key_of(f"view-drop-after-{i}"), None, PAGE)
    assert p.verify().ok
    p.close()


def test_forked_child_of_an_open_store_gets_a_typed_error(tmp_path: Path) -> None:
    from hostkv_providers._errors import UsedAfterForkError

    p = _store(tmp_path)
    put_page(p, key_of("fork-open"), None, PAGE)

    def child() -> None:
        try:
            LmdbProvider(tmp_path / "store")
        except UsedAfterForkError:
            os._exit(0)
        os._exit(7)

    assert _fork_and_wait(child) == 0
    assert p.read_bytes(key_of("fork-open")) == page_bytes(key_of("fork-open"), PAGE)
    p.close()


def test_readonly_never_modifies_the_store(tmp_path: Path) -> None:
    import hashlib

    from .test_lmdb import backdoor_corrupt

    p = _store(tmp_path)
    keys = chain("ro", 4)
    put_chain(p, keys, PAGE)
    p.put_anchor(keys[0], "state", b"a" * 10)
    p.close()
    store = tmp_path / "store"

    def digest() -> list[tuple[str, str]]:
        files = sorted(f for f in store.rglob("*") if f.is_file() and f.name not in ("lock.mdb", "hostkv.lock"))
        return [(f.name, hashlib.sha256(f.read_bytes()).hexdigest()) for f in files]

    before = digest()
    ro = open_provider(f"lmdb://{store}?readonly=true")
    assert isinstance(ro, LmdbProvider) and ro.readonly
    assert ro.longest_prefix(keys) == 4 and ro.read_bytes(keys[3]) == page_bytes(keys[3], PAGE)
    assert ro.get_anchor(keys[0], "state") == b"a" * 10
    for call in (lambda: ro.reserve(key_of("ro-new"), None, PAGE), lambda: ro.evict(keys), lambda: ro.lease(keys),
                 lambda: ro.put_anchor(keys[0], "x", b"1"), lambda: ro.compact(), lambda: ro.verify(repair=True)):
        with pytest.raises(InvalidArgumentError, match="readonly"):
            call()
    assert ro.verify().ok
    ro.close()
    assert digest() == before
    p = LmdbProvider(store)
    backdoor_corrupt(p, keys[2])
    p.close()
    before = digest()
    ro = LmdbProvider(store, readonly=True)
    assert ro.verify().corrupt == [keys[2]]
    assert ro.read(keys[2], bytearray(PAGE)) is False  # a miss, counted, not dropped
    assert ro.stats().checksum_failures == 1 and ro.present(keys) == [True] * 4
    ro.close()
    assert digest() == before
    with pytest.raises(HostKVError):
        LmdbProvider(tmp_path / "nothing-here", readonly=True)
    assert not (tmp_path / "nothing-here").exists()


def _evict_in_child(store: str, key: bytes) -> None:
    p = LmdbProvider(store)
    assert p.evict([key]).entries >= 1
    p.close()


def test_presence_cache_sees_other_processes_evictions(tmp_path: Path) -> None:
    p = _store(tmp_path)
    keys = chain("cache", 6)
    put_chain(p, keys, PAGE)
    assert p.longest_prefix(keys) == 6 and p.longest_prefix(keys) == 6  # second one: from the cache
    child = mp.get_context("spawn").Process(target=_evict_in_child, args=(str(tmp_path / "store"), keys[3]))
    child.start()
    child.join(120)
    assert child.exitcode == 0
    assert p.longest_prefix(keys) == 3
    assert p.present(keys) == [True] * 3 + [False] * 3
    assert p.deepest_anchor(keys, "state") == 0
    p.close()


@pytest.mark.parametrize("pattern", ["whole", "in-order", "reversed", "overlapping", "regions"])
def test_seal_checksum_for_every_write_pattern(tmp_path: Path, pattern: str) -> None:
    p = _store(tmp_path)
    k = key_of(f"pattern-{pattern}")
    data = page_bytes(k, 3 * PAGE)
    res = p.reserve(k, None, len(data))
    assert res is not None
    if pattern == "whole":
        res.write(0, data)
    elif pattern == "in-order":
        for lo in range(0, len(data), 5000):
            res.write(lo, data[lo : lo + 5000])
    elif pattern == "reversed":
        for lo in reversed(range(0, len(data), 5000)):
            res.write(lo, data[lo : lo + 5000])
    elif pattern == "overlapping":
        res.write(0, bytes(len(data)))  # zeros first, then the real bytes over them
        res.write(0, data)
    else:
        res.write(0, data[:100])
        (region,) = res.regions()  # a copy engine fills the mapped slot directly
        region.view[100:] = data[100:]
        res.mark_written()
    res.seal()
    assert p.read_bytes(k) == data
    assert p.verify().ok
    p.close()


def test_a_reused_slot_never_satisfies_a_stale_record(tmp_path: Path) -> None:
    p = _store(tmp_path, budget_bytes=4 * PAGE)
    s: Any = p._s
    a, b = key_of("stale-a"), key_of("stale-b")
    put_page(p, a, None, PAGE)
    with s.env.begin() as txn:
        stale = bytes(txn.get(a, db=s.dbs["entries"]))
    p.evict([a])
    put_page(p, b, None, PAGE)  # takes the freed slot (lowest free slot first)
    with s.env.begin() as txn:
        rec_b = ENTRY.unpack_from(bytes(txn.get(b, db=s.dbs["entries"])))
    rec_a = ENTRY.unpack_from(stale)
    assert (rec_a[12], rec_a[13]) == (rec_b[12], rec_b[13])  # same file and slot
    with s.env.begin(write=True) as txn:  # resurrect the stale index record of a
        txn.put(a, stale, db=s.dbs["entries"])
    out = bytearray(PAGE)
    assert p.read(a, out) is False  # the slot header echoes b's key and generation, not a's
    assert p.read_bytes(b) == page_bytes(b, PAGE)
    assert p.present([a]) == [False]  # the stale record was dropped
    p.close()


def _grow_in_child(store: str, n: int) -> None:
    p = LmdbProvider(store, inline_max=1 << 20)
    for i in range(n):
        put_page(p, key_of(f"grow-{i}"), None, 16384)
    assert p.stats().extra["map_size"] > 1 << 20
    p.close()


def test_map_grown_by_another_process_is_adopted(tmp_path: Path) -> None:
    store = tmp_path / "store"
    p = LmdbProvider(store, budget_bytes=1 << 30, inline_max=1 << 20, map_size=1 << 20, map_max=1 << 30)
    put_page(p, key_of("grow-parent"), None, 16384)
    child = mp.get_context("spawn").Process(target=_grow_in_child, args=(str(store), 300))
    child.start()
    child.join(120)
    assert child.exitcode == 0
    keys = [key_of(f"grow-{i}") for i in range(300)]
    assert p.longest_prefix(keys) == 300  # the first transaction adopts the larger map
    assert p.read_bytes(keys[-1]) == page_bytes(keys[-1], 16384)
    put_page(p, key_of("grow-parent-2"), None, 16384)
    assert p.stats().extra["map_size"] > 1 << 20
    p.close()


def test_prefetch_asks_the_kernel_for_slot_file_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``prefetch`` issues ``POSIX_FADV_WILLNEED`` over the slot-file data of stored keys (one
    run for adjacent slots), skips inline entries and unknown keys."""
    import hostkv_providers.providers._slotfile as slotfile
    from hostkv_providers.testing import key_of, put_page

    p = LmdbProvider(tmp_path / "s", budget_bytes=1 << 22, inline_max=4096)
    big = [key_of(f"pf-big-{i}") for i in range(4)]
    small = key_of("pf-small")
    for k in big:
        put_page(p, k, None, 16384)
    put_page(p, small, None, 1000)  # inline in LMDB
    calls: list[tuple[int, int]] = []
    monkeypatch.setattr(slotfile.SlotFile, "will_need", lambda self, off, n: calls.append((off, n)))
    p.prefetch([*big, small, key_of("pf-missing")])
    assert sum(n for _, n in calls) == 4 * 16384
    assert len(calls) < 4  # adjacent slots coalesced
    p.close()
