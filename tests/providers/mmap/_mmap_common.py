"""What the mmap provider's tests share: a small store, and a copy of an open store as a kill -9
would leave it."""

from __future__ import annotations

import os
from pathlib import Path

from hostkv_providers.providers.mmap._provider import MmapProvider

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
