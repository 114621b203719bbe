"""`hostkv stats` printed neither `retained` nor `retained_bytes` for a store with store-wide
counters (mmap, lmdb): the command took them for per-process counters (a review helper's
finding; fails before)."""

from __future__ import annotations

import hashlib
from pathlib import Path

from click.testing import CliRunner
from hostkv_providers.providers import MmapProvider

from hostkv_cli._main import cli

PAGE = 4096


def test_stats_shows_the_retained_gauges(tmp_path: Path) -> None:
    path = str(tmp_path / "s")
    p = MmapProvider(path, budget_bytes=64 * PAGE, slot_nbytes=PAGE, file_nbytes=64 * PAGE)
    keys = [hashlib.sha256(bytes([i])).digest() for i in range(3)]
    for k in keys:
        p.put(k, None, b"x" * PAGE)
    p.retain([keys[0]])
    p.close()
    r = CliRunner().invoke(cli, ["stats", f"mmap://{path}"])
    assert r.exit_code == 0, r.output
    lines = [line.split() for line in r.output.splitlines()]
    assert ["retained", "1"] in lines, r.output
    assert any(parts[:1] == ["retained_bytes"] for parts in lines), r.output
