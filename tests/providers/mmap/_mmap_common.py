"""What the mmap provider's tests share: a small store, written reservations, and a copy of an
open store as a kill -9 would leave it."""

from __future__ import annotations

import os
from pathlib import Path

from hostkv_providers import Key, Reservation
from hostkv_providers.providers.mmap._provider import MmapProvider
from hostkv_providers.testing import page_bytes

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


def reserve_written(p: MmapProvider, keys: list[Key]) -> list[Reservation]:
    """Reserve each key (a root) and write its page: the reservations, none sealed yet."""
    reservations = []
    for k in keys:
        res = p.reserve(k, None, PAGE)
        assert res is not None
        res.write(0, page_bytes(k, PAGE))
        reservations.append(res)
    return reservations
