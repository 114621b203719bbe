"""Fixtures for the hostkv CLI tests.

In-process tests drive the click command with ``CliRunner`` against pinned providers that the
test fills first (``hk.open`` is redirected to them, since a pinned store lives in one process).
Subprocess tests run the real ``hostkv`` console script against the persistent providers.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hostkv_providers as hk
import numpy as np
import pytest
from click.testing import CliRunner, Result

from hostkv_cli._main import cli
from hostkv_cli._synth import page_bytes

LAYOUT = hk.KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, page_tokens=16)  # 16 KiB pages
SALT_A = hk.Salt("test/model-a", LAYOUT)
SALT_B = hk.Salt("test/model-b", LAYOUT)


def hostkv_exe() -> list[str]:
    """The installed console script, or ``python -m hostkv_cli`` as a fallback."""
    exe = shutil.which("hostkv")
    return [exe] if exe else [sys.executable, "-m", "hostkv_cli"]


def run_hostkv(*args: str, timeout: float = 120, env: dict[str, str] | None = None,
               cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*hostkv_exe(), *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})}, check=False, cwd=cwd)


def usable(scheme: str, *caps: str) -> bool:
    for info in hk.available_providers():
        if info.name == scheme:
            return info.error is None and set(caps) <= info.capabilities
    return False


def persistent_scheme(*caps: str) -> str:
    """The first usable persistent provider (mmap, then lmdb) with ``caps``, or skip."""
    for scheme in ("mmap", "lmdb"):
        if usable(scheme, "persistent", *caps):
            return scheme
    states = {i.name: (i.error or ",".join(sorted(i.capabilities)))
              for i in hk.available_providers() if i.name in ("mmap", "lmdb")}
    pytest.skip(f"no persistent provider with {['persistent', *caps]} is usable yet: {states}")


@dataclass
class Filled:
    """What ``fill`` stored: the chains' keys (for byte checks) and a few handles."""

    chains: dict[str, list[hk.Key]] = field(default_factory=dict)
    page_nbytes: int = LAYOUT.page_nbytes
    reservations: list[Any] = field(default_factory=list)

    @property
    def keys(self) -> list[hk.Key]:
        seen: dict[bytes, hk.Key] = {}
        for ks in self.chains.values():
            for k in ks:
                seen.setdefault(bytes(k), k)
        return list(seen.values())


def fill(p: hk.Provider, *, pages: int = 24, keep_reservations: bool = False) -> Filled:
    """Two salts; salt A has a chain of ``pages`` pages and a fork at half of it; salt B one
    short chain.  Page bytes are ``page_bytes(key)``; anchors on the chain ends."""
    out = Filled()
    rng = np.random.default_rng(7)
    a = rng.integers(0, 50_000, size=pages * LAYOUT.page_tokens)
    half = pages // 2 * LAYOUT.page_tokens
    fork = np.concatenate([a[:half], rng.integers(0, 50_000, size=(pages // 3) * LAYOUT.page_tokens)])
    b = rng.integers(0, 50_000, size=5 * LAYOUT.page_tokens)
    for name, salt, tokens in (("a", SALT_A, a), ("fork", SALT_A, fork), ("b", SALT_B, b)):
        keys = hk.chain_keys(salt, tokens)
        parent = None
        for k in keys:
            res = p.reserve(k, parent, salt.page_nbytes, salt_tag=salt.tag)
            if res is not None:
                res.write(0, page_bytes(k, salt.page_nbytes))
                res.seal()
                if keep_reservations:
                    out.reservations.append(res)
            parent = k
        p.put_anchor(keys[-1], "ssm_state", page_bytes(bytes(reversed(keys[-1])), 1000))
        out.chains[name] = keys
    return out


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


@pytest.fixture
def stores(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str], hk.providers.PinnedProvider]]:
    """``stores(url)`` → a pinned provider that ``hk.open(url)`` will return (not closed by the CLI)."""
    made: dict[str, hk.providers.PinnedProvider] = {}
    real_open = hk.open

    def get(url: str) -> hk.providers.PinnedProvider:
        if url not in made:
            p = real_open(url)
            assert isinstance(p, hk.providers.PinnedProvider)
            real_close = p.close
            p.close = lambda: None  # type: ignore[method-assign]
            p._real_close = real_close  # type: ignore[attr-defined]
            made[url] = p
        return made[url]

    def fake_open(url: str, **options: str) -> hk.Provider:
        return get(url)

    monkeypatch.setattr(hk, "open", fake_open)
    yield get
    for p in made.values():
        p._real_close()  # type: ignore[attr-defined]


def invoke(runner: CliRunner, *args: str) -> Result:
    result = runner.invoke(cli, list(args), catch_exceptions=True)
    # A command may exit non-zero, but never by an uncaught exception (a traceback).
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise AssertionError(f"uncaught {result.exception!r}\n{result.output}") from result.exception
    return result


def tree_snapshot(root: Path) -> dict[str, tuple[str, int, int]]:
    """Every file under ``root``: (sha256, mtime_ns, mode) — to prove nothing was modified."""
    snap: dict[str, tuple[str, int, int]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            path = Path(dirpath) / name
            st = path.lstat()
            digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "-"
            snap[str(path.relative_to(root))] = (digest, st.st_mtime_ns, st.st_mode)
        snap[str(Path(dirpath).relative_to(root)) + "/"] = ("dir", Path(dirpath).stat().st_mtime_ns, 0)
    return snap
