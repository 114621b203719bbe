"""EIO and ENOSPC at every I/O call site of the mmap provider (RELIABILITY.md, "ENOSPC / EIO").

:class:`hostkv_providers.testing.faults.IOFaults` patches the ``os`` functions (open, write,
pwrite, read, pread, preadv, fstat, posix_fallocate, ftruncate, rename, replace, unlink, listdir,
lstat, stat, mkdir, chmod), ``mmap.mmap`` and the package's ``fsync``/``fdatasync`` indirections,
counting only calls on the store's directory and files.  A representative workload (create, chains
of one- and two-slot pages, reads, ``seal_many``, anchors, eviction, snapshots, new data files,
compaction, a kill -9 and the recovery that follows, close) is run once to count its calls; then
once per index ``n`` on a fresh store with the ``n``-th call failing: EIO at every call (both
modes), ENOSPC at every call that can report it (``process``), and a *sticky* EIO — that call
and every later one fail until the step is over, so error paths' own cleanup fails too — at
every third call (``sync``).  Each run checks:

* every operation succeeds or raises a ``HostKVError`` subclass — never a bare ``OSError``;
* the fault clears and writes resume: in the same instance when it stays usable, otherwise (a
  typed refusal, e.g. a store poisoned by a failed sync) after a reopen;
* with ``durability=sync``, after a failed sync of a store file the same instance acknowledges
  no further seal (R7);
* a reader opened while the writer is still open — what ``kill -9`` would leave — and the writer
  reopened after ``close()`` both read every acknowledged page and anchor exactly, and nothing
  else but exact bytes or misses; ``verify()`` finds nothing corrupt.
"""

from __future__ import annotations

import errno
import functools
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from hostkv_providers._errors import HostKVError, StorageIOError
from hostkv_providers._keys import Key
from hostkv_providers.providers.mmap._provider import MmapProvider
from hostkv_providers.testing import anchor_bytes, key_of, page_bytes
from hostkv_providers.testing.faults import IOFaults

SLOT = 8192
RESUME_PAGES = 6


def nbytes_of(key: bytes) -> int:
    return 3000 + (key[0] % 4) * 4000  # 3000..15000: one or two slots


@functools.cache
def expected(key: Key) -> bytes:
    return page_bytes(key, nbytes_of(key))


def open_store(root: str, durability: str) -> MmapProvider:
    return MmapProvider(root, durability=durability, budget_bytes=96 * SLOT, slot_nbytes=SLOT, file_nbytes=6 * SLOT,
                        snapshot_every=10)


@dataclass
class State:
    root: str
    mode: str
    p: MmapProvider | None = None
    acked: dict[Key, Key | None] = field(default_factory=dict)  # key -> parent
    evicted: set[Key] = field(default_factory=set)
    anchors: dict[Key, int] = field(default_factory=dict)  # acknowledged anchor "s" -> size
    written: dict[Key, Key | None] = field(default_factory=dict)  # every key reserved

    def prov(self) -> MmapProvider:
        if self.p is None:
            self.p = open_store(self.root, self.mode)
        return self.p

    def put(self, label: str, parent: Key | None) -> Key:
        k = key_of(label)
        self.written[k] = parent
        p = self.prov()
        if p.put(k, parent, expected(k)):
            self.acked[k] = parent
        return k

    def put_many(self, labels: list[str]) -> None:
        p = self.prov()
        batch = []
        try:
            for label in labels:
                k = key_of(label)
                self.written[k] = None
                res = p.reserve(k, None, nbytes_of(k))
                assert res is not None
                batch.append(res)
                res.write(0, expected(k))
        except BaseException:
            for res in batch:
                res.abort()
            raise
        p.seal_many(batch)
        self.acked.update((r.key, None) for r in batch)

    def batch_put(self, labels: list[str]) -> None:
        """A chain through ``put_many`` (the batch path: one pwritev per run, one commit)."""
        keys = [key_of(label) for label in labels]
        items = [(k, keys[i - 1] if i else None, expected(k)) for i, k in enumerate(keys)]
        for k, parent, _ in items:
            self.written[k] = parent
        got = self.prov().put_many(items)
        for (k, parent, _), ok in zip(items, got, strict=True):
            if ok is True or ok is False:  # stored now, or already stored
                self.acked[k] = parent

    def batch_read(self) -> None:
        keys = list(self.written)
        outs = [bytearray(nbytes_of(k)) for k in keys]
        for k, ok, out in zip(keys, self.prov().read_many(keys, outs), outs, strict=True):
            assert not ok or bytes(out) == expected(k), "wrong bytes from read_many"

    def anchor(self, key: Key, size: int) -> None:
        self.prov().put_anchor(key, "s", anchor_bytes(key, "s", size))
        self.anchors[key] = size

    def evict(self, key: Key) -> None:
        # announced first: a failed eviction may still have removed it
        self.evicted.update(k for k, par in self.acked.items() if k == key or par == key)
        self.prov().evict([key])

    def read_all(self) -> None:
        p = self.prov()
        for k in list(self.written):
            got = p.read_bytes(k)
            assert got is None or got == expected(k), "wrong bytes in the live store"

    def close(self) -> None:
        p, self.p = self.p, None
        if p is not None:
            p.close()

    def crash(self) -> None:
        """What kill -9 leaves: descriptors and the lock dropped, no snapshot, no sync; plus the
        leftovers of a crash mid-``atomic_write`` and mid-compaction, for recovery to reclaim."""
        p, self.p = self.p, None
        if p is not None:
            p._closed = True
            p._release_all()
        for name in (".tmp-index.2.snap.1.deadbeef", "data.3.0000.slots"):
            # builtin open and fchmod: the injector counts (and fails) only the library's calls
            with open(os.path.join(self.root, name), "xb") as f:
                os.fchmod(f.fileno(), 0o600)
                f.write(b"leftover")


def workload(s: State) -> list[tuple[str, Callable[[], object]]]:
    """The steps, in order (each a separate provider operation or two)."""
    chain: list[Key] = []

    def put_chain(lo: int, hi: int) -> None:
        for i in range(lo, hi):
            chain.append(s.put(f"f-a{i}", chain[-1] if chain else None))

    return [
        ("open", s.prov),
        ("chain", lambda: put_chain(0, 5)),
        ("read", s.read_all),
        ("anchor", lambda: s.anchor(chain[2], 9000)),
        ("seal_many", lambda: s.put_many(["f-m0", "f-m1", "f-m2"])),
        ("put_many", lambda: s.batch_put(["f-b0", "f-b1", "f-b2"])),
        ("read_many", s.batch_read),
        ("evict", lambda: s.evict(chain.pop())),
        ("anchor2", lambda: s.anchor(chain[1], 300)),
        ("more", lambda: put_chain(5, 9)),  # a snapshot, new data files
        ("get_anchor", lambda: s.prov().get_anchor(chain[2], "s")),
        ("compact", lambda: s.prov().compact()),
        ("after_compact", lambda: s.put("f-c0", None)),
        ("crash", s.crash),
        ("recover", s.prov),  # a journal to replay, its torn tail zeroed, a snapshot at open
        ("read2", s.read_all),
        ("tail", lambda: s.put("f-t0", None)),
        ("close", s.close),  # a snapshot, syncs
    ]


def check_store(s: State, q: MmapProvider, where: str) -> None:
    for k in s.written:
        got = q.read_bytes(k)
        if got is not None:
            assert got == expected(k), f"{where}: WRONG BYTES for {k.hex()[:12]}"
        elif k in s.acked and k not in s.evicted:
            raise AssertionError(f"{where}: acknowledged page {k.hex()[:12]} lost")
    for k, size in s.anchors.items():
        if k in s.evicted:
            continue
        assert q.get_anchor(k, "s") == anchor_bytes(k, "s", size), f"{where}: acknowledged anchor lost"
    for e in q.iter_entries():
        assert e.key in s.written, f"{where}: a key never written is listed"


@dataclass
class Outcome:
    fired: tuple[str, tuple[str, str, int], str] | None
    error: str  # the typed error the faulted step raised ("" if it absorbed the fault)
    resumed_in_place: bool


def run_faulted(tmp: Path, mode: str, n: int, err: int, *, sticky: bool = False) -> Outcome:
    root = str(tmp / f"{mode}-{n}-{errno.errorcode[err]}")
    with IOFaults(root, sites=False) as inj:  # installed throughout: counts, and no real syncs
        inj.arm(n, err, sticky=sticky)
        return _faulted(root, mode, inj)


def _faulted(root: str, mode: str, inj: IOFaults) -> Outcome:
    s = State(root, mode)
    error = ""
    for name, step in workload(s):
        try:
            step()
        except HostKVError as exc:
            assert inj.fired is not None, f"{name}: {exc!r} without a fault"
            error = f"{name}: {type(exc).__name__}"
            break
        except Exception as exc:
            raise AssertionError(f"step {name} raised a non-library error {exc!r} (fault {inj.fired})") from exc
        if inj.fired is not None and name.startswith("close"):
            break
    inj.disarm()
    fired = inj.fired
    assert fired is not None, "the armed call was never reached"
    # a failed sync of a data file or the journal the store uses (not of a temp file, of a
    # failed compaction's files, or of the directory)
    in_use = set()
    if s.p is not None and not s.p.closed:
        in_use = {sf.path for sf in s.p._files.values()} | {s.p._p(s.p._journal_name(s.p._gen))}
    sync_failed = fired[0] in ("fsync", "fdatasync") and fired[2] in in_use
    # writes resume: in place if the instance is still usable, else after a reopen
    resumed = False
    if s.p is not None and not s.p.closed:
        try:
            for i in range(RESUME_PAGES):  # enough to need a new data file
                s.put(f"f-resume-{i}", None)
            resumed = True
        except StorageIOError:  # refused after the fault (a store poisoned by a failed sync...)
            pass
        except HostKVError as exc:
            raise AssertionError(f"writing after the fault raised {exc!r} (fault {fired})") from exc
        if mode == "sync" and sync_failed:
            assert key_of("f-resume-0") not in s.acked, f"a seal was acknowledged after a failed sync ({fired})"
    if s.p is not None and not s.p.closed:
        # what kill -9 would leave: a reader of the files while the writer still holds them
        q = MmapProvider(root, readonly=True)
        try:
            check_store(s, q, "reader before close")
        finally:
            q.close()
        try:
            s.close()
        except HostKVError:
            s.p = None
    s.p = None
    for i in range(RESUME_PAGES):  # opens the store again if needed
        s.put(f"f-resume-r{i}", None)
    q = s.prov()
    check_store(s, q, "after reopen")
    rep = q.verify()
    assert not rep.corrupt, f"verify finds corrupt entries: {rep}"
    s.close()
    return Outcome(fired, error, resumed)


def count_calls(tmp: Path, mode: str) -> IOFaults:
    root = str(tmp / f"{mode}-count")
    s = State(root, mode)
    with IOFaults(root) as inj:
        for _, step in workload(s):
            step()
    q = open_store(root, mode)
    check_store(s, q, "clean run")
    q.close()
    return inj


#: Every kind of call the workload must reach (a kind missing here would be a gap in coverage).
EXPECTED_KINDS = {"open", "rename", "unlink", "listdir", "lstat", "stat", "mkdir", "write", "pwrite", "read", "pread",
                  "preadv", "fstat", "posix_fallocate", "ftruncate", "mmap", "fsync", "fdatasync"}
#: Calls that can report ENOSPC on Linux (the others get EIO only).
ENOSPC_KINDS = {"open", "rename", "mkdir", "write", "pwrite", "posix_fallocate", "ftruncate", "fsync", "fdatasync"}


# a fault injected into the counters file's open: the store warns and counts in-process (expected)
@pytest.mark.filterwarnings("ignore:store-wide counters unavailable:UserWarning")
@pytest.mark.parametrize("mode", ["sync", "process"])
def test_every_io_call_fails_cleanly(tmp_path: Path, mode: str) -> None:
    inj = count_calls(tmp_path, mode)
    missing = EXPECTED_KINDS - set(inj.kinds)
    assert not missing, f"never reached: {sorted(missing)}"
    kind_at = ["", *inj.calls]  # 1-based
    every = range(1, inj.count + 1)
    # (errno, sticky, call indices); the two modes share most code, so they split the second plan
    plans = [(errno.EIO, False, list(every))]  # a one-off EIO at every call
    if mode == "process":  # ENOSPC wherever Linux can report it (process is the default mode)
        plans.append((errno.ENOSPC, False, [n for n in every if kind_at[n] in ENOSPC_KINDS]))
    else:  # a device that stays broken from call n on: the error paths' own cleanup fails too
        plans.append((errno.EIO, True, list(every)[::3]))
    failures: list[str] = []
    runs = 0
    outcomes: dict[str, int] = {}
    in_place = 0
    for err, sticky, indices in plans:
        for n in indices:
            runs += 1
            try:
                out = run_faulted(tmp_path, mode, n, err, sticky=sticky)
            except AssertionError as exc:
                failures.append(f"{errno.errorcode[err]}{' (sticky)' if sticky else ''} at call {n} "
                                f"({kind_at[n]}): {exc}")
                continue
            finally:
                shutil.rmtree(tmp_path / f"{mode}-{n}-{errno.errorcode[err]}", ignore_errors=True)
            label = out.error.split(": ")[-1] if out.error else "absorbed"
            outcomes[label] = outcomes.get(label, 0) + 1
            in_place += out.resumed_in_place
    print(f"\n{mode}: {inj.count} store I/O calls from {len(inj.sites)} call sites; by kind "
          f"{dict(sorted(inj.kinds.items()))}; {runs} faulted runs: {dict(sorted(outcomes.items()))}; "
          f"writes resumed in the same instance after {in_place}, the others after a reopen")
    assert not failures, f"{len(failures)} of {runs} faulted runs failed:\n" + "\n".join(failures[:15])
