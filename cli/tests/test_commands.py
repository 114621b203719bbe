"""Every command through click's CliRunner, against pinned stores the tests fill first."""

from __future__ import annotations

import json

import hostkv_providers as hk
import pytest
from click.testing import CliRunner

from hostkv_cli._synth import page_bytes

from .conftest import SALT_A, SALT_B, fill, invoke

URL = "pinned://?budget=16MiB&block=16KiB"
URL2 = "pinned://?budget=8MiB&block=16KiB"


def test_providers_lists_builtins_and_shows_broken_ones(runner: CliRunner, monkeypatch: pytest.MonkeyPatch) -> None:
    real = hk.available_providers()
    broken = hk.providers.ProviderInfo("broken", "hostkv-broken", "9.9", False, "nowhere:Nothing", frozenset(),
                             "ModuleNotFoundError: No module named 'nowhere'")
    monkeypatch.setattr(hk, "available_providers", lambda: [*real, broken])
    r = invoke(runner, "providers")
    assert r.exit_code == 0
    assert "pinned" in r.output and "iterate" in r.output
    assert "broken" in r.output and "error: ModuleNotFoundError" in r.output
    assert all(len(line) <= 80 for line in r.output.splitlines())
    doc = json.loads(invoke(runner, "providers", "--json").stdout)
    by_name = {d["name"]: d for d in doc}
    assert by_name["pinned"]["distribution"] == "hostkv-providers"
    assert set(by_name["pinned"]["capabilities"]) >= {"iterate", "verify"}
    assert by_name["broken"]["error"].startswith("ModuleNotFoundError")


def test_info_human_and_json(runner: CliRunner, stores) -> None:  # type: ignore[no-untyped-def]
    f = fill(stores(URL))
    r = invoke(runner, "info", URL)
    assert r.exit_code == 0, r.output
    assert all(len(line) <= 80 for line in r.output.splitlines())
    assert SALT_A.tag in r.output and SALT_B.tag in r.output
    doc = json.loads(invoke(runner, "info", "--json", URL).stdout)
    assert doc["entries"] == len(f.keys)
    assert doc["roots"] == 2 and doc["leaves"] == 3 and doc["branch_points"] == 1
    assert doc["anchors"] == 3 and doc["anchor_bytes"] == 3000
    tags = {t["tag"]: t for t in doc["salt_tags"]}
    assert tags[SALT_B.tag]["pages"] == 5
    assert tags[SALT_A.tag]["nbytes"] == (len(f.keys) - 5) * SALT_A.page_nbytes
    assert doc["max_depth"] == 23


def test_ls_flat_tree_salt_limit(runner: CliRunner, stores) -> None:  # type: ignore[no-untyped-def]
    f = fill(stores(URL))
    flat = json.loads(invoke(runner, "ls", "--json", URL).stdout)
    assert flat["total"] == len(f.keys)
    depth = {e["key"]: e["depth"] for e in flat["entries"]}
    assert [depth[k.hex()] for k in f.chains["a"]] == list(range(24))
    # parents are listed before their children
    pos = {e["key"]: i for i, e in enumerate(flat["entries"])}
    assert all(e["parent"] is None or pos[e["parent"]] < pos[e["key"]] for e in flat["entries"])

    only_b = json.loads(invoke(runner, "ls", "--json", "--salt", SALT_B.tag, URL).stdout)
    assert {e["key"] for e in only_b["entries"]} == {k.hex() for k in f.chains["b"]}

    limited = invoke(runner, "ls", "--limit", "3", URL)
    assert limited.exit_code == 0 and "more (of" in limited.output
    assert len([ln for ln in limited.output.splitlines() if ln[:1] in "0123456789abcdef"]) == 3

    tree = json.loads(invoke(runner, "ls", "--tree", "--json", URL).stdout)
    runs = tree["runs"]
    # chain a forks at page 12: one shared run of 12, then two branches (12 and 8 pages), plus b
    assert sorted(r["pages"] for r in runs) == [5, 8, 12, 12]
    trunk = next(r for r in runs if r["children"])
    assert trunk["depth_start"] == 0 and trunk["depth_end"] == 11 and len(trunk["children"]) == 2
    anchored = {a["key"] for r in runs for a in r["anchors"]}
    assert anchored == {f.chains[c][-1].hex() for c in ("a", "fork", "b")}
    human = invoke(runner, "ls", "--tree", URL)
    assert human.exit_code == 0
    assert "├─" in human.output and "└─" in human.output and "ssm_state@d23" in human.output
    assert all(len(line) <= 80 for line in human.output.splitlines())


def test_stats_json(runner: CliRunner, stores) -> None:  # type: ignore[no-untyped-def]
    f = fill(stores(URL))
    doc = json.loads(invoke(runner, "stats", "--json", URL).stdout)
    assert doc["entries"] == len(f.keys) and doc["name"] == "pinned"
    assert "used_bytes" in invoke(runner, "stats", URL).output


def test_verify_reports_then_repairs(runner: CliRunner, stores) -> None:  # type: ignore[no-untyped-def]
    p = stores(URL)
    f = fill(p, keep_reservations=True)
    assert invoke(runner, "verify", URL).exit_code == 0
    # Flip one byte of page 5 of chain a straight in the arena (the reservation's region).
    victim = f.chains["a"][5]
    res = next(r for r in f.reservations if r.key == victim)
    region = res._regions[0].view
    region[100] ^= 0xFF
    r = invoke(runner, "verify", URL)
    assert r.exit_code == 1
    assert victim.hex() in r.output and "1 corrupt" in r.output
    assert p.present([victim]) == [True]  # without --repair nothing is dropped
    r = invoke(runner, "verify", "--repair", "--json", URL)
    assert r.exit_code == 1  # problems were found (and repaired)
    doc = json.loads(r.stdout)
    assert doc["found"]["corrupt"] == [victim.hex()]
    # the victim goes with its subtree: the rest of chain a and the whole fork below page 5
    assert doc["repair"]["dropped"] == (24 - 5) + 8
    assert p.longest_prefix(f.chains["a"]) == 5
    assert p.longest_prefix(f.chains["b"]) == 5
    assert invoke(runner, "verify", URL).exit_code == 0


def test_evict_by_key_salt_size_and_dry_run(runner: CliRunner, stores) -> None:  # type: ignore[no-untyped-def]
    p = stores(URL)
    f = fill(p)
    n = len(f.keys)
    dry = json.loads(invoke(runner, "evict", "--salt", SALT_B.tag, "--dry-run", "--json", URL).stdout)
    assert dry["selected_entries"] == 5 and p.stats().entries == n
    r = invoke(runner, "evict", "--salt", SALT_B.tag, URL)
    assert r.exit_code == 0 and "evicted 5 entries" in r.output
    assert p.longest_prefix(f.chains["b"]) == 0 and p.longest_prefix(f.chains["a"]) == 24
    # a unique prefix of the fork's first own page removes just the fork's branch (8 pages)
    r = invoke(runner, "evict", "--key", f.chains["fork"][12].hex()[:12], URL)
    assert r.exit_code == 0 and "evicted 8 entries" in r.output
    assert p.longest_prefix(f.chains["a"]) == 24
    r = invoke(runner, "evict", "--to", "100KiB", "--json", URL)
    doc = json.loads(r.stdout)
    assert doc["used_after"] <= 100 * 1024 and doc["entries"] > 0
    assert p.longest_prefix(f.chains["a"]) * SALT_A.page_nbytes <= 100 * 1024


def test_evict_older_than_keeps_fresh_continuations(runner: CliRunner, stores) -> None:  # type: ignore[no-untyped-def]
    p = stores(URL)
    f = fill(p)
    r = invoke(runner, "evict", "--older-than", "1h", "--json", URL)
    assert json.loads(r.stdout)["entries"] == 0 and p.stats().entries == len(f.keys)
    r = invoke(runner, "evict", "--older-than", "0s", URL)
    assert r.exit_code == 0 and p.stats().entries == 0


@pytest.mark.parametrize("args", [
    ("evict", URL),
    ("evict", "--to", "1MiB", "--salt", "x", URL),
    ("evict", "--key", "zz", URL),
    ("evict", "--key", "00" * 31, URL),
    ("evict", "--older-than", "soon", URL),
    ("evict", "--to", "lots", URL),
    ("ls", "--limit", "0", URL),
    ("info",),
    ("info", "no-scheme"),
    ("info", "nosuch://x"),
    ("info", "pinned://?budget=lots"),
    ("info", "pinned://?colour=blue"),
    ("info", "mmap:///definitely/not/here"),
    ("copy", URL, URL),
    ("bench", "--page-size", "0", URL),
    ("frobnicate",),
])
def test_usage_errors_exit_2_without_traceback(runner: CliRunner, stores, args: tuple[str, ...]) -> None:  # type: ignore[no-untyped-def]
    fill(stores(URL))
    r = invoke(runner, *args)
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output
    assert "error" in r.output.lower()


def test_unknown_key_prefix_and_missing_key(runner: CliRunner, stores) -> None:  # type: ignore[no-untyped-def]
    fill(stores(URL))
    assert invoke(runner, "evict", "--key", "ffffffffffffffff", URL).exit_code in (0, 2)
    r = invoke(runner, "evict", "--key", "ab" * 32, "--json", URL)
    assert r.exit_code == 0 and json.loads(r.stdout)["not_stored"] == ["ab" * 32]


def test_copy_parents_first_with_anchors_and_dedup(runner: CliRunner, stores) -> None:  # type: ignore[no-untyped-def]
    src, dst = stores(URL), stores(URL2)
    f = fill(src)
    r = invoke(runner, "copy", "--allow-ephemeral", "--json", URL, URL2)
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["copied"] == len(f.keys) and doc["dedup"] == 0 and doc["anchors"] == 3
    for k in f.keys:
        assert dst.read_bytes(k) == page_bytes(k, SALT_A.page_nbytes)
        d, s = dst.entry(k), src.entry(k)
        assert d is not None and s is not None and d.salt_tag == s.salt_tag
    assert dst.get_anchor(f.chains["b"][-1], "ssm_state") == src.get_anchor(f.chains["b"][-1], "ssm_state")
    again = json.loads(invoke(runner, "copy", "--allow-ephemeral", "--json", URL, URL2).stdout)
    assert again["copied"] == 0 and again["dedup"] == len(f.keys) and again["anchors"] == 0


def test_copy_refuses_more_than_the_destination_budget(runner: CliRunner, stores) -> None:  # type: ignore[no-untyped-def]
    fill(stores(URL), pages=200)
    r = invoke(runner, "copy", "--allow-ephemeral", URL, "pinned://?budget=1MiB&block=16KiB")
    assert r.exit_code == 2 and "budget" in r.output


def test_copy_skips_unreadable_subtrees(runner: CliRunner, stores) -> None:  # type: ignore[no-untyped-def]
    src = stores("pinned://?budget=16MiB&block=16KiB&verify=read")
    dst = stores(URL2)
    f = fill(src, keep_reservations=True)
    victim = f.chains["b"][2]
    next(r for r in f.reservations if r.key == victim)._regions[0].view[0] ^= 1
    r = invoke(runner, "copy", "--allow-ephemeral", "pinned://?budget=16MiB&block=16KiB&verify=read", URL2)
    assert r.exit_code == 1 and "NOT copied: 3" in r.output
    assert dst.longest_prefix(f.chains["b"]) == 2 and dst.longest_prefix(f.chains["a"]) == 24


def test_bench_cleans_up(runner: CliRunner, stores) -> None:  # type: ignore[no-untyped-def]
    p = stores(URL)
    f = fill(p)
    before = p.stats().entries
    r = invoke(runner, "bench", "--pages", "16", "--page-size", "64KiB", "--lookups", "3", "--json", URL)
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["pages"] == 16 and doc["mismatches"] == 0 and doc["write"]["MB_per_s"] > 0
    assert p.stats().entries == before and p.longest_prefix(f.chains["a"]) == 24


def test_bench_refuses_to_evict_real_pages(runner: CliRunner, stores) -> None:  # type: ignore[no-untyped-def]
    p = stores("pinned://?budget=1MiB&block=16KiB")
    fill(p, pages=40)
    r = invoke(runner, "bench", "--page-size", "256KiB", "pinned://?budget=1MiB&block=16KiB")
    assert r.exit_code == 2 and "evict real pages" in r.output


def test_demo_on_a_memory_provider(runner: CliRunner) -> None:
    r = invoke(runner, "demo", "--url", "pinned://?budget=64MiB", "--tokens", "2048", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["ok"] and doc["save_b"]["dedup"] == doc["fork_shared_pages"] == 48
    assert doc["save_b"]["written"] == 16
    assert all(c["wrong_pages"] == 0 and c["hit"] == 64 for c in doc["restore"]["chains"])


def test_compact_and_verify_need_the_capability(runner: CliRunner, stores) -> None:  # type: ignore[no-untyped-def]
    fill(stores(URL))
    r = invoke(runner, "compact", URL)
    assert r.exit_code == 2 and "no compact capability" in r.output


def test_internal_errors_are_reported_not_traced(runner: CliRunner, monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(url: str, **kw: str) -> hk.Provider:
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(hk, "open", boom)
    r = invoke(runner, "stats", URL)
    assert r.exit_code == 5 and "internal error: RuntimeError: disk on fire" in r.output
    assert "Traceback" not in r.output


@pytest.mark.parametrize(("exc", "code"), [
    (hk.errors.LockedError("held by pid 1"), 3),
    (hk.errors.UnsafeStoreError("mode 0755"), 4),
    (hk.errors.IncompatibleStoreError("format 9"), 4),
    (hk.CorruptStoreError("index torn"), 1),
    (hk.errors.NoSpaceError("ENOSPC"), 5),
    (hk.errors.UnknownProviderError("no foo"), 2),
])
def test_typed_errors_map_to_exit_codes(runner: CliRunner, monkeypatch: pytest.MonkeyPatch,
                                        exc: hk.HostKVError, code: int) -> None:
    def fail(url: str, **kw: str) -> hk.Provider:
        raise exc

    monkeypatch.setattr(hk, "open", fail)
    r = invoke(runner, "info", URL)
    assert r.exit_code == code
    assert f"error: {exc.message}" in r.output and f"hint: {exc.hint}" in r.output
