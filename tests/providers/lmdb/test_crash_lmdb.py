"""kill -9 cycles and named crash points for the lmdb provider (RELIABILITY.md R1-R3).

A forked child writes/reads/evicts/leases/compacts; it is SIGKILLed at a random moment (or kills
itself at a named crash point); the store is reopened and every listed entry must read back its
exact bytes and every acknowledged seal must be present.  Opening never needs a repair: after the
last cycle ``verify()`` must report no corruption and no index problem.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hostkv_providers.providers import _fsutil as _fsutil
from hostkv_providers.providers.lmdb._provider import LmdbProvider
from hostkv_providers.testing.crash import CrashHarness, Workload

CYCLES = int(os.environ.get("HOSTKV_CRASH_CYCLES", "200"))
WORKLOAD = Workload(page_nbytes=8192, steps=300, chains=3, chain_len=12)


def _url(store: Path, **opts: object) -> str:
    query = "&".join(f"{k}={v}" for k, v in {"budget": WORKLOAD.budget_bytes(3), **opts}.items())
    return f"lmdb://{store}?{query}"


def _assert_clean(store: Path) -> None:
    p = LmdbProvider(store)
    try:
        report = p.verify()
        assert report.ok, report
        readers = [line for line in p._s.env.readers().splitlines()[1:] if line.strip()]
        assert readers == [] or all(str(os.getpid()) in r for r in readers), readers
    finally:
        p.close()


@pytest.mark.slow
@pytest.mark.parametrize("durability, inline_max", [("process", 0), ("sync", 4096)])
def test_kill9_cycles(tmp_path: Path, durability: str, inline_max: int) -> None:
    store = tmp_path / "store"
    h = CrashHarness(_url(store, durability=durability, inline_max=inline_max), WORKLOAD,
                     seed=7 if durability == "process" else 11)
    n = CYCLES if durability == "process" else max(10, CYCLES // 10)
    failures = []
    killed = 0
    for _ in range(n):
        r = h.cycle(kill_after=h.rng.uniform(0.0, 0.06))
        killed += r.killed
        if not r.ok:
            failures.append(r.describe())
    assert failures == []
    assert killed >= n // 2  # most cycles really died mid-workload
    _assert_clean(store)


@pytest.mark.parametrize("durability, inline_max", [("sync", 0), ("process", 4096)])
def test_kill9_cycles_four_threads(tmp_path: Path, durability: str, inline_max: int) -> None:
    """Four threads seal at once in the child (concurrent transactions, ``put_many`` next to
    per-page seals); the single-threaded cycles above cannot show races between them."""
    sync = durability == "sync"
    # 600 steps either way: the kill comes at most 0.3 s after the 40th seal, and on fast storage
    # (tmpfs, where fsync costs nothing) 150 sync steps ended first in over half the cycles.
    w = Workload(page_nbytes=4096, steps=600, threads=4, p_batch=0.1)
    url = f"lmdb://{tmp_path / 'store'}?budget={w.budget_bytes(3)}&durability={durability}&inline_max={inline_max}"
    h = CrashHarness(url, w, seed=31)
    results = h.run(25, max_kill_after=0.3 if sync else 0.1)
    failed = [r.describe() for r in results if not r.ok]
    assert not failed, failed[:3]
    assert sum(r.killed for r in results) >= 12
    _assert_clean(tmp_path / "store")


def test_kill9_with_compaction(tmp_path: Path) -> None:
    store = tmp_path / "store"
    w = Workload(page_nbytes=8192, steps=200, chains=3, chain_len=10, p_compact=0.02, p_evict=0.08)
    h = CrashHarness(_url(store), w, seed=3)
    failures = [r.describe() for r in (h.cycle(kill_after=h.rng.uniform(0.0, 0.1)) for _ in range(20))
                if not r.ok]
    assert failures == []
    _assert_clean(store)


LMDB_POINTS = sorted(p for p in _fsutil.CRASH_POINTS if p.startswith("lmdb."))


def test_every_crash_point_is_registered() -> None:
    assert len(LMDB_POINTS) == 8


@pytest.mark.parametrize("point", LMDB_POINTS)
def test_named_crash_point(tmp_path: Path, point: str) -> None:
    store = tmp_path / "store"
    compacting = point.startswith("lmdb.compact")
    w = Workload(page_nbytes=8192, steps=200, chains=2, chain_len=8,
                 p_compact=0.3 if compacting else 0.0, p_evict=0.1 if compacting else 0.03)
    # small slot files (8 slots each), so new files are created all the time
    durability = "sync" if "after_commit" in point else "process"
    h = CrashHarness(_url(store, durability=durability, file_size=65536), w, seed=5)
    warm = h.cycle()  # a clean cycle first, so there is something to lose
    assert warm.ok, warm.describe()
    r = h.cycle(crash_at=f"{point}:2")
    assert r.killed, f"crash point {point} was never reached"
    assert r.ok, r.describe()
    after = h.cycle()  # and the store keeps working
    assert after.ok, after.describe()
    _assert_clean(store)
