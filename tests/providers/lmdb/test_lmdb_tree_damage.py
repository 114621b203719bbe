"""Issue 16 item 2: a zeroed sector of LMDB's data.mdb killed ``hostkv verify`` and a reading
process with SIGABRT (``mdb.c: Assertion 'IS_LEAF(mp)' failed``).  LMDB's tree is now walked
in a child process at a restart (the first open), in read-only opens and in ``verify``; the
damage is reported as ``CorruptStoreError`` and no engine process dies by a signal."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import hostkv_providers as hk
from hostkv_providers.providers.lmdb._env import _walk_tree
from hostkv_providers.testing import chain, put_chain


def _dies_walking(path: Path) -> bool:
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        try:
            os.close(2)  # mdb.c prints its assertion to stderr
            _walk_tree(str(path))
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    return os.WIFSIGNALED(status)


@pytest.fixture(scope="module")
def damaged(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store with a zeroed first sector of one B-tree page: one that kills an unguarded walk."""
    root = tmp_path_factory.mktemp("tree")
    src = root / "src"
    with hk.open(f"lmdb://{src}?budget=16MiB&map_size=4MiB&inline_max=4096") as p:
        put_chain(p, chain("tree-damage", 300), 4096)
    for page in range(2, (src / "data.mdb").stat().st_size // 4096):
        trial = root / f"p{page}"
        shutil.copytree(src, trial)
        with open(trial / "data.mdb", "r+b") as fh:
            fh.seek(page * 4096)
            fh.write(bytes(512))
        if _dies_walking(trial):
            return trial
        shutil.rmtree(trial)
    pytest.skip("no page found whose damage trips an LMDB assertion")


def _in_child(fn) -> tuple[int | None, str]:  # type: ignore[no-untyped-def]
    """``fn()`` in a forked child: (signal or None, the outcome's name)."""
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        os.close(rfd)
        try:
            fn()
            out = "ok"
        except hk.HostKVError as exc:
            out = type(exc).__name__
        except BaseException as exc:
            out = f"untyped {type(exc).__name__}"
        os.write(wfd, out.encode())
        os._exit(0)
    os.close(wfd)
    _, status = os.waitpid(pid, 0)
    text = os.read(rfd, 1000).decode()
    os.close(rfd)
    return (os.WTERMSIG(status) if os.WIFSIGNALED(status) else None), text


def test_open_and_verify_report_damage_instead_of_dying(damaged: Path) -> None:
    url = f"lmdb://{damaged}"

    def read_all(readonly: str) -> None:
        with hk.open(url, readonly=readonly) as p:
            for e in p.iter_entries():  # type: ignore[attr-defined]
                p.read_bytes(e.key)

    for readonly in ("true", "false"):
        sig, outcome = _in_child(functools.partial(read_all, readonly))
        assert sig is None, f"readonly={readonly}: died by signal {sig}"
        assert outcome == "CorruptStoreError", outcome
    proc = subprocess.run([sys.executable, "-m", "hostkv_cli", "verify", url], capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 1, (proc.returncode, proc.stderr)
    assert "LMDB's index is damaged" in proc.stderr + proc.stdout
    # item 12: --repair cannot rebuild LMDB's own pages, and the hint says so and what helps
    assert "cannot rebuild LMDB's own pages" in proc.stderr + proc.stdout
    assert "Traceback" not in proc.stderr
