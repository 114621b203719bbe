"""Power-cut simulation for the mmap provider (RELIABILITY.md, "power-cut simulation").

A seeded in-process workload (chains of pages written whole, in pieces and through
``Reservation.regions()``, with ``io=pread`` or ``io=mmap``, ``seal``/``seal_many``, aborts,
explicit and policy evictions, anchors, snapshots, compaction, close/reopen, kill -9 and
recovery) runs on a store watched by
:class:`hostkv_providers.testing.powercut.PowerCut`.  At random syncs (power lost while the sync
was in flight) and at random points between operations, an image of what the disk could hold is
built (unsynced 512-byte sectors, file sizes and directory entries each independently old or new),
written to a fresh directory (0700, files 0600), opened with the provider and checked:

* open succeeds on every image;
* 0 wrong bytes: every listed entry is a key the workload wrote, with its size and parent, and
  every read (pages and anchors) returns exactly the bytes sealed for that key, or a miss;
* with ``durability=sync`` every acknowledged seal (and anchor) still live at the capture reads back;
* ``verify()`` reports corruption only for entries that were not required (evicted or
  unacknowledged pages a power cut resurrected torn), never an accounting problem; after
  ``verify(repair=True)`` a reopen verifies clean; new writes succeed.
"""

from __future__ import annotations

import mmap
import os
import random
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from hostkv_providers._errors import CapacityError, HostKVError, UnknownKeyError
from hostkv_providers._keys import Key
from hostkv_providers._reservation import Reservation
from hostkv_providers.providers.mmap._provider import MmapProvider
from hostkv_providers.testing import anchor_bytes, key_of, page_bytes
from hostkv_providers.testing.powercut import PowerCut, write_image

SLOT = 8192
BUDGET = 96 * SLOT  # 768 KiB: policy eviction and slot reuse happen
FILE = 32 * SLOT
SNAP_EVERY = 24
ANCHOR_SIZES = (100, 3000, 9000)  # 9000: a two-slot anchor


def nbytes_of(key: bytes) -> int:
    """Page size of a key: 2-16 KiB, mostly not a multiple of a sector (runs of 1-2 slots)."""
    return 2048 + (key[0] % 8) * 2048 - (key[1] % 3) * 300


def open_store(path: str, durability: str, io: str = "pread") -> MmapProvider:
    return MmapProvider(path, durability=durability, budget_bytes=BUDGET, slot_nbytes=SLOT, file_nbytes=FILE,
                        snapshot_every=SNAP_EVERY, io=io)


@dataclass
class Oracle:
    """What the workload did, as seen by the caller (acknowledgements actually received)."""

    parent_of: dict[Key, Key | None] = field(default_factory=dict)  # every key ever reserved
    acked: set[Key] = field(default_factory=set)
    anchors: dict[tuple[Key, str], list[tuple[int, bool]]] = field(default_factory=dict)  # (size, acked)

    def anchor_sizes(self, key: Key, name: str) -> tuple[set[int], set[int]]:
        """(every size attempted, sizes acceptable when the anchor is required)."""
        hist = self.anchors.get((key, name), [])
        last = max((i for i, (_, ok) in enumerate(hist) if ok), default=-1)
        return {s for s, _ in hist}, {s for s, _ in hist[max(last, 0):]} if last >= 0 else set()


@dataclass
class Tally:
    images: int = 0
    at_sync: int = 0
    required: int = 0
    read_ok: int = 0
    corrupt_reported: int = 0
    recovered_problems: int = 0


class Run:
    """One seeded workload on one store, capturing and checking images as it goes."""

    def __init__(self, tmp: Path, seed: int, durability: str, *, p_sync: float, p_step: float) -> None:
        self.tmp = tmp
        self.seed = seed
        self.mode = durability
        self.io = "mmap" if seed % 2 else "pread"  # page bytes through the mapping or pwrite
        self.root = str(tmp / "store")
        self.rng = random.Random(seed)
        self.img_rng = random.Random(seed * 7919 + 1)
        self.p_sync = p_sync
        self.p_point = p_sync / 6
        self.p_step = p_step
        self.o = Oracle()
        self.tally = Tally()
        self.p: MmapProvider | None = None
        self.live_at_close: set[Key] = set()
        self.chains: list[list[Key]] = []
        self.nkeys = 0
        self.failures: list[str] = []
        self.pc: PowerCut

    # -- oracle helpers --------------------------------------------------------------------------
    def required(self) -> set[Key]:
        """Acknowledged seals the store still holds (explicit and policy evictions excluded)."""
        if not self.o.acked:
            return set()
        keys = sorted(self.o.acked)
        p = self.p
        try:
            if p is None:
                raise UnknownKeyError("no provider")
            present = p.present(keys)
        except HostKVError:  # between close and reopen
            return set(self.live_at_close)
        return {k for k, hit in zip(keys, present, strict=True) if hit}

    # -- capturing -------------------------------------------------------------------------------
    def capture(self, where: str) -> None:
        required = self.required()
        files = self.pc.image(self.img_rng)
        n = self.tally.images
        dest = str(self.tmp / f"img-{n}")
        write_image(files, dest)
        self.tally.images += 1
        self.tally.at_sync += where != "step"
        self.tally.required += len(required)
        try:
            self.check_image(dest, required)
        except Exception as exc:  # AssertionError, or anything a broken image made the provider raise
            self.failures.append(f"image {n} (seed {self.seed}, {self.mode}, at {where}): {exc!r}")
            keep = str(self.tmp.parent / f"failed-{self.mode}-{self.seed}-{n}")
            if not os.path.exists(keep):
                shutil.copytree(dest, keep)
        finally:
            shutil.rmtree(dest, ignore_errors=True)

    def on_sync(self, kind: str) -> None:
        # syncs are where durability is decided; named crash points (several per page) are
        # sampled more thinly
        if self.img_rng.random() < (self.p_point if kind.startswith("point:") else self.p_sync):
            self.capture(kind)

    def check_image(self, dest: str, required: set[Key]) -> None:
        o = self.o
        try:
            q = open_store(dest, self.mode)
        except HostKVError as exc:
            raise AssertionError(f"open failed: {exc!r}") from exc
        try:
            rep = q.verify()
            assert not [p for p in rep.problems if p.startswith("accounting")], rep.problems
            self.tally.recovered_problems += bool(rep.problems)
            self.tally.corrupt_reported += len(rep.corrupt)
            if self.mode == "sync":
                bad = [k.hex()[:12] for k in rep.corrupt if k in required]
                assert not bad, f"verify reports acknowledged live pages corrupt: {bad}"
            listed = {e.key: e for e in q.iter_entries()}
            for k, e in listed.items():
                assert k in o.parent_of, f"listed key {k.hex()[:12]} was never written"
                assert e.nbytes == nbytes_of(k), f"{k.hex()[:12]}: size {e.nbytes} != {nbytes_of(k)}"
                assert e.parent == o.parent_of[k], f"{k.hex()[:12]}: wrong parent"
                assert e.parent is None or e.parent in listed, f"{k.hex()[:12]}: parent not stored"
            for k in o.parent_of:
                got = q.read_bytes(k)
                if got is not None:
                    assert got == page_bytes(k, nbytes_of(k)), f"WRONG BYTES for {k.hex()[:12]}"
                    self.tally.read_ok += 1
                elif self.mode == "sync" and k in required:
                    raise AssertionError(f"acknowledged page {k.hex()[:12]} lost")
            for (k, name) in o.anchors:
                sizes, need = o.anchor_sizes(k, name)
                blob = q.get_anchor(k, name)
                if blob is not None:
                    assert len(blob) in sizes and blob == anchor_bytes(k, name, len(blob)), \
                        f"WRONG ANCHOR {name} of {k.hex()[:12]}"
                elif self.mode == "sync" and k in required and need:
                    raise AssertionError(f"acknowledged anchor {name} of {k.hex()[:12]} lost")
            q.verify(repair=True)
            if self.mode == "sync":
                lost = [k.hex()[:12] for k in required if q.read_bytes(k) != page_bytes(k, nbytes_of(k))]
                assert not lost, f"acknowledged pages lost by verify(repair=True): {lost}"
            fresh = key_of(f"pc-fresh-{self.seed}-{self.tally.images}")
            q.put(fresh, None, page_bytes(fresh, 5000))  # writes resume (may evict an LRU leaf)
            assert q.read_bytes(fresh) == page_bytes(fresh, 5000)
            kept = {e.key for e in q.iter_entries()}
        finally:
            q.close()
        q = open_store(dest, self.mode)
        try:
            rep = q.verify()
            assert rep.ok, f"not clean after verify(repair=True) and reopen: {rep}"
            lost = [k.hex()[:12] for k in kept if q.read_bytes(k) is None]
            assert not lost, f"entries lost by a clean close and reopen: {lost}"
        finally:
            q.close()

    # -- the workload ----------------------------------------------------------------------------
    def new_key(self, parent: Key | None) -> Key:
        k = key_of(f"pc-{self.seed}-{self.nkeys}")
        self.nkeys += 1
        self.o.parent_of[k] = parent
        return k

    def prov(self) -> MmapProvider:
        assert self.p is not None
        return self.p

    def fill(self, res: Reservation) -> None:
        data = page_bytes(res.key, res.nbytes)
        how = self.rng.random()
        if how < 0.5:
            res.write(0, data)
        elif how < 0.8:
            cut = self.rng.randrange(1, res.nbytes)
            res.write(cut, data[cut:])
            res.write(0, data[:cut])
        else:  # stores through the shared mapping (what a copy engine does)
            region = res.regions()[0]
            region.view[:] = data
            res.mark_written()

    def reserve_next(self) -> Reservation | None:
        p = self.prov()
        if self.chains and self.rng.random() < 0.8:
            ch = self.rng.choice(self.chains)
            parent: Key | None = ch[-1] if p.present([ch[-1]])[0] else None
            if parent is None:
                ch = []
                self.chains.append(ch)
        else:
            ch = []
            self.chains.append(ch)
            parent = None
        k = self.new_key(parent)
        try:
            res = p.reserve(k, parent, nbytes_of(k))
        except (CapacityError, UnknownKeyError):
            return None
        assert res is not None
        ch.append(k)
        return res

    def step(self) -> None:
        p = self.prov()
        r = self.rng.random()
        if r < 0.45:
            res = self.reserve_next()
            if res is not None:
                self.fill(res)
                res.seal()
                self.o.acked.add(res.key)
        elif r < 0.55 and self.rng.random() < 0.5:
            # put_many: a short chain under a live chain tail (or a new root), one commit
            ch = self.rng.choice(self.chains) if self.chains else []
            parent: Key | None = ch[-1] if ch and p.present([ch[-1]])[0] else None
            items = []
            for _ in range(self.rng.randint(2, 4)):
                k = self.new_key(parent)
                items.append((k, parent, page_bytes(k, nbytes_of(k))))
                parent = k
            results = p.put_many(items)
            self.chains.append([k for k, _, _ in items])
            self.o.acked.update(k for (k, _, _), ok in zip(items, results, strict=True) if ok is True)
        elif r < 0.55:
            batch = [res for res in (self.reserve_next() for _ in range(self.rng.randint(2, 3))) if res is not None]
            for res in batch:
                self.fill(res)
            if batch:
                p.seal_many(batch)
                self.o.acked.update(res.key for res in batch)
        elif r < 0.60:
            res = self.reserve_next()
            if res is not None:
                res.write(0, page_bytes(res.key, res.nbytes)[: res.nbytes // 2])
                res.abort()
        elif r < 0.68:
            live = [k for k in sorted(self.o.acked) if p.present([k])[0]]
            if live:
                p.evict([self.rng.choice(live)])
        elif r < 0.71:
            p.evict(nbytes=self.rng.choice((SLOT, 4 * SLOT)))
        elif r < 0.83:
            live = [k for k in sorted(self.o.acked) if p.present([k])[0]]
            if live:
                k = self.rng.choice(live)
                name = self.rng.choice(("s", "t"))
                size = self.rng.choice(ANCHOR_SIZES)
                hist = self.o.anchors.setdefault((k, name), [])
                hist.append((size, False))
                try:
                    p.put_anchor(k, name, anchor_bytes(k, name, size))
                except CapacityError:
                    return
                hist[-1] = (size, True)
        elif r < 0.93:
            for k in self.rng.sample(sorted(self.o.parent_of), min(4, len(self.o.parent_of))):
                got = p.read_bytes(k)
                assert got is None or got == page_bytes(k, nbytes_of(k)), "live read returned wrong bytes"
        elif r < 0.96:
            p.compact()
        elif r < 0.98:
            self.live_at_close = self.required()
            p.close()
            self.p = open_store(self.root, self.mode, self.io)
        else:  # kill -9 (no snapshot, no sync), then the recovery writes under the simulator too
            self.live_at_close = self.required()
            p._closed = True
            p._release_all()
            self.p = open_store(self.root, self.mode, self.io)

    def run(self, steps: int) -> Tally:
        os.mkdir(self.root, 0o700)
        with PowerCut(self.root) as pc:
            self.pc = pc
            pc.on_sync = self.on_sync
            self.p = open_store(self.root, self.mode, self.io)
            try:
                for _ in range(steps):
                    self.step()
                    if self.img_rng.random() < self.p_step:
                        self.capture("step")
                self.live_at_close = self.required()
                self.prov().close()
                self.capture("closed")
            finally:
                if self.p is not None:
                    self.p.close()
        return self.tally


def _run(tmp_path: Path, seeds: Sequence[int], durability: str, steps: int) -> list[Tally]:
    tallies = []
    failures: list[str] = []
    for seed in seeds:
        run = Run(tmp_path / f"{durability}-{seed}", seed, durability, p_sync=0.25, p_step=0.08)
        (tmp_path / f"{durability}-{seed}").mkdir()
        tallies.append(run.run(steps))
        failures += run.failures
    assert not failures, "\n".join(failures[:10])
    return tallies


# An image cut mid-write of the counters file opens with a warning and counts in-process: expected
# here, hundreds of times, and it buried the CI log's real failures.
_TORN_COUNTERS = pytest.mark.filterwarnings("ignore:.*is not a counters file:UserWarning",
                                            "ignore:store-wide counters unavailable:UserWarning")


@_TORN_COUNTERS
@pytest.mark.parametrize("durability", ["sync", "process", "none"])
def test_power_cut_images(tmp_path: Path, durability: str) -> None:
    tallies = _run(tmp_path, range(6), durability, steps=90)
    images = sum(t.images for t in tallies)
    print(f"{durability}: {images} images, {sum(t.at_sync for t in tallies)} at a sync, "
          f"{sum(t.read_ok for t in tallies)} pages read back, {sum(t.required for t in tallies)} required, "
          f"{sum(t.corrupt_reported for t in tallies)} reported corrupt by verify")
    assert images >= (100 if durability != "none" else 50)  # none: syncs only at snapshots and compaction



def test_the_model_itself(tmp_path: Path) -> None:
    """The simulator's semantics on plain files: unsynced writes (syscalls and mapping stores) and
    unsynced renames may be lost, synced ones never; unsynced sectors mix independently."""
    root = tmp_path / "d"
    root.mkdir(mode=0o700)
    rng = random.Random(0)
    from hostkv_providers.providers import _fsutil as _fsutil
    with PowerCut(str(root)) as pc:
        fd = os.open(root / "a", os.O_RDWR | os.O_CREAT, 0o600)
        os.write(fd, b"x" * 4096)
        assert pc.image(rng, p_new=1.0, p_name=0.0) == {}  # the create is not durable yet
        assert pc.image(rng, p_new=0.0, p_name=1.0) == {"a": b""}  # nor its bytes
        _fsutil.fsync(fd)
        _fsutil.fsync_dir(str(root))
        assert pc.image(rng, p_new=0.0, p_name=0.0) == {"a": b"x" * 4096}
        m = mmap.mmap(fd, 4096)
        m[512:1024] = b"y" * 512  # a store through a shared mapping, not a system call
        os.pwrite(fd, b"z" * 512, 2048)
        assert pc.image(rng, p_new=0.0)["a"] == b"x" * 4096
        new = pc.image(rng, p_new=1.0)["a"]
        assert new == b"x" * 512 + b"y" * 512 + b"x" * 1024 + b"z" * 512 + b"x" * 1536
        mixes = {pc.image(rng, p_new=0.5)["a"] for _ in range(64)}
        assert len(mixes) == 4  # the two changed sectors reach the disk independently
        _fsutil.fdatasync(fd)
        assert pc.image(rng, p_new=0.0)["a"] == new
        m.close()
        os.close(fd)
        os.rename(root / "a", root / "b")
        assert pc.image(rng, p_name=0.0) == {"a": new}
        assert pc.image(rng, p_name=1.0) == {"b": new}
        _fsutil.fsync_dir(str(root))
        assert pc.image(rng, p_name=0.0) == {"b": new}
        assert pc.syncs == {"file": 2, "dir": 2}


@_TORN_COUNTERS
def test_durability_none_store_opens_after_a_power_cut(tmp_path: Path) -> None:
    """With ``durability=none`` data files were created without a sync: a power cut could leave
    the new name on an empty file, and open refused the whole store (CorruptStoreError)."""
    root = tmp_path / "s"
    root.mkdir(mode=0o700)
    with PowerCut(str(root)) as pc:
        p = open_store(str(root), "none")
        keys = [key_of(f"none-{i}") for i in range(40)]  # several data files
        for k in keys:
            p.put(k, None, page_bytes(k, nbytes_of(k)))
        for i, p_name in enumerate((0.0, 1.0)):
            write_image(pc.image(random.Random(i), p_new=0.0, p_name=p_name), str(tmp_path / f"img{i}"))
            q = open_store(str(tmp_path / f"img{i}"), "none")
            assert all(q.read_bytes(k) in (None, page_bytes(k, nbytes_of(k))) for k in keys)
            q.close()
        p.close()
