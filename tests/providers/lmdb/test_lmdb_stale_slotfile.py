"""A slot file created inside a write transaction that rolled back stays in this process's
slot-file cache.  Another process then creates the same file id (removing the orphan and
creating a fresh file); this process keeps using the unlinked inode: its reads of the other
process's entries fail and are "confirmed" against the stale handle (the good entry is dropped),
and its own writes land in the unlinked file (acknowledged pages that no other process can read).
"""
from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hostkv_providers._errors import StorageIOError
from hostkv_providers.providers.lmdb._provider import LmdbProvider
from hostkv_providers.testing import chain, page_bytes

PAGE = 8192


def _other_process(path: Path, code: str) -> None:
    script = textwrap.dedent(f"""
        from hostkv_providers.providers.lmdb._provider import LmdbProvider
        from hostkv_providers.testing import chain, page_bytes
        PAGE = {PAGE}
        p = LmdbProvider({str(path)!r}, inline_max=0)
    """) + textwrap.dedent(code) + "\np.close()\n"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def _rolled_back_then_created_elsewhere(path: Path, monkeypatch: pytest.MonkeyPatch) -> LmdbProvider:
    """A store whose first put_many created slot file 1 and rolled back (an EIO), then another
    process stored a page of the same size: it created slot file 1 afresh."""
    a = LmdbProvider(str(path), budget_bytes=64 * PAGE, inline_max=0)
    first = chain("first", 4)

    def broken(*args: object) -> int:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    with monkeypatch.context() as m:
        m.setattr(os, "pwritev", broken)
        with pytest.raises(StorageIOError):
            a.put_many([(k, None, page_bytes(k, PAGE)) for k in first])  # file 1 created, rolled back
    assert a.present(first) == [False] * 4
    _other_process(path, """
        k = chain("theirs", 1)[0]
        assert p.put(k, None, page_bytes(k, PAGE))
    """)
    return a


def test_rolled_back_slot_file_is_not_served_from_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a = _rolled_back_then_created_elsewhere(tmp_path / "s", monkeypatch)
    theirs = chain("theirs", 1)[0]
    out = bytearray(PAGE)
    # this process reads the other's acknowledged page: must be a hit with its bytes
    hit = a.read(theirs, out)
    assert a.present([theirs]) == [True], "the other process's acknowledged page was dropped from the store"
    assert hit and bytes(out) == page_bytes(theirs, PAGE)
    a.close()


def test_writes_after_a_rolled_back_slot_file_reach_the_real_file(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "s"
    a = _rolled_back_then_created_elsewhere(path, monkeypatch)
    mine = chain("mine", 3)
    assert a.put_many([(k, None, page_bytes(k, PAGE)) for k in mine]) == [True] * 3  # acknowledged
    # every other process must read them
    _other_process(path, """
        mine = chain("mine", 3)
        outs = [bytearray(PAGE) for _ in mine]
        got = p.read_many(mine, outs)
        assert got == [True] * 3, f"acknowledged pages unreadable elsewhere: {got}"
        assert all(bytes(o) == page_bytes(k, PAGE) for k, o in zip(mine, outs))
    """)
    a.close()
