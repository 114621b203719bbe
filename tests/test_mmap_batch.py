"""mmap provider: batched seals, reads and puts (seal_many, read_many, put_many)."""

from __future__ import annotations

import os
from pathlib import Path

from hostkv_providers._mmap import MmapProvider
from hostkv_providers.testing import key_of, page_bytes

PAGE = 16384


def make(path: Path, **kw: object) -> MmapProvider:
    kw.setdefault("budget_bytes", 64 * PAGE)
    kw.setdefault("slot_nbytes", PAGE)
    return MmapProvider(str(path), **kw)  # type: ignore[arg-type]


def abandon_copy(p: MmapProvider, dest: Path) -> None:
    """Copy an open store as a kill -9 would leave it (page-cache state, no close())."""
    dest.mkdir(mode=0o700)
    for name in os.listdir(p.path):
        with open(os.path.join(p.path, name), "rb") as f:
            data = f.read()
        fd = os.open(dest / name, os.O_WRONLY | os.O_CREAT, 0o600)
        os.write(fd, data)
        os.close(fd)


def test_snapshot_during_seal_many_keeps_every_acknowledged_seal(tmp_path: Path) -> None:
    # The first seal of the batch to reach the index crosses snapshot_every; a snapshot taken
    # then would rotate the journal away from the other records of the batch while their
    # entries are not in the index yet, and a kill -9 after seal_many returned lost them.
    p = make(tmp_path / "s", snapshot_every=1)
    keys = [key_of(f"snap-{i}") for i in range(8)]
    reservations = []
    for k in keys:
        res = p.reserve(k, None, PAGE)
        assert res is not None
        res.write(0, page_bytes(k, PAGE))
        reservations.append(res)
    p.seal_many(reservations)
    abandon_copy(p, tmp_path / "image")
    p.close()
    q = make(tmp_path / "image")
    assert q.present(keys) == [True] * 8
    assert [q.read_bytes(k) for k in keys] == [page_bytes(k, PAGE) for k in keys]
    q.close()
