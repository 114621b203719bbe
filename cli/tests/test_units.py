"""Pure helpers: durations, the tree view, selections, exit-code mapping."""

from __future__ import annotations

import hostkv_providers as hk
import pytest

from hostkv_cli._exits import CLIError, ExitCode, exit_code_for
from hostkv_cli._format import parse_duration
from hostkv_cli._main import _select
from hostkv_cli._store import Forest


def _k(i: int) -> hk.Key:
    return hk.Key(i.to_bytes(32, "big"))


def _e(i: int, parent: int | None, *, tag: str = "t", used: float = 100.0, nbytes: int = 10) -> hk.EntryInfo:
    return hk.EntryInfo(_k(i), None if parent is None else _k(parent), nbytes, tag, 0, float(i), used)


@pytest.mark.parametrize(("text", "seconds"), [
    ("90s", 90), ("15m", 900), ("2h", 7200), ("7d", 604800), ("1w", 604800), ("1h30m", 5400),
    ("250ms", 0.25), ("0s", 0), (" 3D ", 259200),
])
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "5", "h", "1h 2x", "-1s", "1.s"])
def test_parse_duration_rejects(text: str) -> None:
    with pytest.raises(CLIError) as info:
        parse_duration(text)
    assert info.value.code == ExitCode.USAGE


def test_forest_runs_depths_and_orphans() -> None:
    # 1-2-3 then branches 4-5 and 6; separate root 7; 9's parent 8 is missing (an orphan)
    entries = [_e(1, None), _e(2, 1), _e(3, 2), _e(4, 3), _e(5, 4), _e(6, 3), _e(7, None), _e(9, 8)]
    f = Forest(entries)
    assert f.depth[_k(5)] == 4 and f.depth[_k(6)] == 3 and f.depth[_k(9)] == 0
    assert f.orphans == [_k(9)]
    assert f.leaves == 4 and f.branch_points == 1 and f.max_depth == 4
    runs = f.runs()
    assert [(r.keys[0], len(r.keys), r.parent_run) for r in runs] == [
        (_k(1), 3, None), (_k(4), 2, 0), (_k(6), 1, 0), (_k(7), 1, None), (_k(9), 1, None)]
    pos = {k: i for i, k in enumerate(f.order)}
    assert all(pos[k] > pos[bytes(f.entries[k].parent)] for k in f.entries  # type: ignore[arg-type]
               if f.entries[k].parent is not None and k not in f.orphans)


def test_forest_handles_a_very_long_chain() -> None:
    n = 50_000  # far beyond Python's recursion limit
    f = Forest([_e(1, None), *(_e(i, i - 1) for i in range(2, n + 1))])
    assert f.max_depth == n - 1 and len(f.runs()) == 1 and f.runs()[0].nbytes == 10 * n


def test_older_than_never_drops_a_fresh_continuation() -> None:
    # chain 1-2-3-4 where only 4 was used recently; branch 2-5 is old; root 6 is old
    entries = [_e(1, None, used=0), _e(2, 1, used=0), _e(3, 2, used=0), _e(4, 3, used=1e12),
               _e(5, 2, used=0), _e(6, None, used=0)]
    roots = _select(Forest(entries), None, "1s")
    assert set(roots) == {_k(5), _k(6)}


def test_salt_selection_takes_whole_subtrees_of_the_tag() -> None:
    entries = [_e(1, None, tag="a"), _e(2, 1, tag="a"), _e(3, 2, tag="b"), _e(4, None, tag="b")]
    assert set(_select(Forest(entries), "b", None)) == {_k(3), _k(4)}
    assert _select(Forest(entries), "a", None) == []  # 1's subtree holds a "b" page


def test_exit_codes() -> None:
    assert exit_code_for(hk.errors.LockedError("x")) == 3
    assert exit_code_for(hk.errors.InFlightError("x", key=b"k")) == 3
    assert exit_code_for(hk.errors.UnsafeStoreError("x")) == 4
    assert exit_code_for(hk.errors.IncompatibleStoreError("x")) == 4
    assert exit_code_for(hk.CorruptStoreError("x")) == 1
    assert exit_code_for(hk.errors.SpanError("x")) == 2
    assert exit_code_for(hk.errors.UnknownKeyError("x")) == 2
    assert exit_code_for(hk.errors.StorageIOError("x")) == 5
    assert exit_code_for(ValueError("x")) == 5
    assert exit_code_for(CLIError("x", ExitCode.REFUSED)) == 4


def _info(name: str, error: str | None) -> hk.providers.ProviderInfo:
    return hk.providers.ProviderInfo(name, "hostkv-providers", "0.1.0", True, f"x:{name}", frozenset(), error)


def test_demo_prefers_lmdb_and_says_when_it_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    from hostkv_cli import _demo

    monkeypatch.setattr(hk, "available_providers", lambda: [_info("lmdb", None), _info("mmap", None)])
    url, note = _demo._pick_url("./x")
    assert url.startswith("lmdb:///") and url.endswith("/x?budget=256MiB") and note is None
    monkeypatch.setattr(hk, "available_providers",
                        lambda: [_info("lmdb", "ImportError: no lmdb"), _info("mmap", None)])
    url, note = _demo._pick_url("./x")
    assert url.startswith("mmap:///") and note is not None and "ImportError: no lmdb" in note
    monkeypatch.setattr(hk, "available_providers", lambda: [_info("lmdb", "broken"), _info("mmap", "broken")])
    with pytest.raises(CLIError) as info:
        _demo._pick_url("./x")
    assert info.value.code == ExitCode.USAGE
