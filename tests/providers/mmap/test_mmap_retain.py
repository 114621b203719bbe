"""Retained entries in the mmap store: marks journaled (``OP_RETAIN``, format version 2), kept
across kill -9 and snapshots, seen by readers; version-1 stores still open (and are upgraded)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from hostkv_providers import open_provider
from hostkv_providers.errors import CapacityError, InvalidArgumentError, RetainedError
from hostkv_providers.providers.mmap._provider import MMAP_FORMAT_VERSION, MmapProvider
from hostkv_providers.providers.mmap._recovery import _MANIFEST_CHECKSUM, _manifest_digest
from hostkv_providers.testing import chain, put_chain

PAGE = 16384


def make(path: Path, **kw: object) -> MmapProvider:
    kw.setdefault("budget_bytes", 64 * PAGE)
    kw.setdefault("slot_nbytes", PAGE)
    return MmapProvider(str(path), **kw)  # type: ignore[arg-type]


def _retained(p: MmapProvider) -> set[bytes]:
    return {i.key for i in p.iter_entries() if i.retained}


@pytest.mark.parametrize("durability", ["sync", "process"])
def test_marks_survive_kill_9(tmp_path: Path, durability: str) -> None:
    keys = chain("mmap-retain-kill", 4)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child never returns
        try:
            p = make(tmp_path / "s", durability=durability)
            put_chain(p, keys, PAGE)
            p.retain([keys[2]])
            p.retain([keys[3]])
            p.unretain([keys[3]])
        finally:
            os.kill(os.getpid(), signal.SIGKILL)  # no close: no snapshot, the journal only
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status)
    with make(tmp_path / "s") as p:
        assert _retained(p) == {keys[2]}
        assert p.stats().retained == 1 and p.stats().retained_bytes == 3 * PAGE
        with pytest.raises(RetainedError):
            p.evict([keys[0]])
        p.evict(nbytes=1 << 40)
        assert p.present(keys) == [True, True, True, False]


def test_marks_of_an_evicted_entry_do_not_come_back(tmp_path: Path) -> None:
    keys = chain("mmap-retain-reseal", 2)
    with make(tmp_path / "s") as p:
        put_chain(p, keys, PAGE)
        p.retain([keys[1]])
        p.unretain([keys[1]])
        p.evict([keys[1]])
        put_chain(p, keys[1:], PAGE, parent=keys[0])  # the same key, a new entry
    with make(tmp_path / "s") as p:
        assert _retained(p) == set()


def test_readers_see_the_marks(tmp_path: Path) -> None:
    keys = chain("mmap-retain-reader", 2)
    with make(tmp_path / "s") as w:
        put_chain(w, keys, PAGE)
        w.retain([keys[1]])  # durability=process: the record is in the page cache, readers see it
        with make(tmp_path / "s", readonly=True) as r:
            assert _retained(r) == {keys[1]}
            with pytest.raises(InvalidArgumentError):
                r.retain([keys[0]])


def test_version_1_store_opens_and_is_upgraded(tmp_path: Path) -> None:
    keys = chain("mmap-retain-v1", 2)
    with make(tmp_path / "s") as p:
        put_chain(p, keys, PAGE)
    mpath = tmp_path / "s" / "manifest.json"
    man = json.loads(mpath.read_text())
    body = {k: v for k, v in man.items() if k != _MANIFEST_CHECKSUM}
    body["format_version"] = 1
    body[_MANIFEST_CHECKSUM] = _manifest_digest({k: v for k, v in body.items() if k != _MANIFEST_CHECKSUM})
    mpath.write_text(json.dumps(body))
    with make(tmp_path / "s", readonly=True) as r:  # a reader reads it as it is
        assert r.present(keys) == [True, True]
    assert json.loads(mpath.read_text())["format_version"] == 1
    with make(tmp_path / "s") as p:  # a writer upgrades it before it writes any v2 record
        assert json.loads(mpath.read_text())["format_version"] == MMAP_FORMAT_VERSION == 2
        p.retain([keys[1]])
    with make(tmp_path / "s") as p:
        assert _retained(p) == {keys[1]}


def test_retain_share_option(tmp_path: Path) -> None:
    keys = chain("mmap-retain-share", 10)
    url = f"mmap://{tmp_path / 's'}?budget={16 * PAGE}&slot={PAGE}&retain_share=0.25"
    with open_provider(url) as p:
        put_chain(p, keys, PAGE)
        with pytest.raises(CapacityError):
            p.retain([keys[4]])  # 5 pages > 4
        assert p.retain([keys[3]]) == 1  # type: ignore[attr-defined]
    for bad in ("0", "1.5", "x"):
        with pytest.raises(InvalidArgumentError):
            open_provider(f"mmap://{tmp_path / 's'}?retain_share={bad}")
