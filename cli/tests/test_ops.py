"""Operator-facing fixes: store-wide counters in ``stats``, selections that match nothing, copies
into stores that keep nothing or cannot fit an entry, ``info`` alignment, the demo's suggested
commands keeping the URL's options and its one-screen summary."""

from __future__ import annotations

import json
import re
from pathlib import Path

import hostkv_providers as hk
import pytest
from click.testing import CliRunner

from hostkv_cli._demo import _read_url

from .conftest import SALT_A, fill, invoke, usable

URL = "pinned://?budget=16MiB&block=16KiB"


def _lmdb(tmp_path: Path) -> str:
    if not usable("lmdb", "persistent"):
        pytest.skip("lmdb provider not usable")
    return f"lmdb://{tmp_path / 'l'}"


def test_stats_shows_store_wide_counters_of_other_processes(runner: CliRunner, tmp_path: Path) -> None:
    url = _lmdb(tmp_path)
    with hk.open(url + "?budget=16MiB") as p:  # "the engine": it evicts, reads, then goes away
        f = fill(p)
        rep = p.evict(f.chains["b"][:1])
        assert rep.entries == 5
        assert p.read(f.chains["a"][0], bytearray(f.page_nbytes))
        engine = p.stats()
    r = invoke(runner, "stats", "--json", url)
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["persistent"] and "evictions" in doc["store_wide"]
    assert doc["evictions"] == 5 and doc["evicted_bytes"] >= 5 * f.page_nbytes  # read from the store
    assert doc["hits"] == 0  # stats(): this command's own instance read nothing
    live = doc["store_counters"]  # the store's live counters: the engine's figures
    assert doc["store_counters_scope"] == "store"
    assert (live["hits"], live["seals"], live["bytes_written"]) == (1, engine.seals, engine.bytes_written)
    assert live["evictions"] == 5 and live["checksum_failures"] == 0
    text = invoke(runner, "stats", url).output
    assert "live counters of the store" in text and "counted per process" not in text
    store_part = text.split("live counters of the store")[1]
    assert re.search(r"\bhits +1\b", store_part) and re.search(r"\bevictions +5\b", store_part)
    assert all(len(line) <= 80 for line in text.splitlines())


def test_ls_and_evict_by_unknown_salt_say_nothing_matched(runner: CliRunner, stores) -> None:  # type: ignore[no-untyped-def]
    p = stores(URL)
    fill(p)
    n = p.stats().entries
    for args in (("ls", "--salt", "nosuch", URL), ("evict", "--salt", "xyz", URL),
                 ("evict", "--dry-run", "--salt", "xyz", URL)):
        r = invoke(runner, *args)
        assert r.exit_code == 2, (args, r.output)
        assert "no entry has salt tag" in r.output and SALT_A.tag in r.output  # the hint lists the tags
    assert p.stats().entries == n
    assert invoke(runner, "ls", "--salt", SALT_A.tag, URL).exit_code == 0


def test_copy_and_import_refuse_a_store_that_keeps_nothing(runner: CliRunner, tmp_path: Path) -> None:
    url = _lmdb(tmp_path)
    with hk.open(url + "?budget=16MiB") as p:
        fill(p)
    r = invoke(runner, "copy", url, "pinned://?budget=64MiB")
    assert r.exit_code == 2 and "not persistent" in r.output and "--allow-ephemeral" in r.output
    arc = tmp_path / "a.hkv"
    assert invoke(runner, "export", url, str(arc), "--salt", SALT_A.tag).exit_code == 0
    r = invoke(runner, "import", str(arc), "pinned://?budget=64MiB")
    assert r.exit_code == 2 and "not persistent" in r.output
    r = invoke(runner, "copy", "--allow-ephemeral", url, "pinned://?budget=64MiB")
    assert r.exit_code == 0, r.output


def test_copy_refuses_up_front_an_entry_larger_than_the_destination(runner: CliRunner, stores) -> None:  # type: ignore[no-untyped-def]
    src = stores("pinned://?budget=16MiB&block=64KiB")
    big = hk.Key(b"\x05" * 32)
    src.put(big, None, b"\x01" * (256 << 10), salt_tag="t")
    dst = stores("pinned://?budget=128KiB&block=16KiB")
    r = invoke(runner, "copy", "--allow-ephemeral", "pinned://?budget=16MiB&block=64KiB",
               "pinned://?budget=128KiB&block=16KiB")
    assert r.exit_code == 2 and "an entry of 256.0 KiB" in r.output, r.output
    assert dst.stats().entries == 0


def test_info_keeps_columns_aligned_for_long_keys(runner: CliRunner, tmp_path: Path) -> None:
    url = _lmdb(tmp_path)
    with hk.open(url + "?budget=16MiB") as p:
        fill(p)
    out = invoke(runner, "info", url).output
    lines = [ln for ln in out.splitlines() if re.match(r"\S.*?\s{2,}\S", ln) and not ln.startswith("SALT")]
    lines = lines[: next(i for i, ln in enumerate(lines) if ln.startswith("deepest page")) + 1]
    starts = {re.match(r"\S.*?\s{2,}(\S)", ln).start(1) for ln in lines}  # type: ignore[union-attr]
    assert any("last_recovery." in ln for ln in lines)
    assert len(starts) == 1, out  # every value starts in the same column


def test_demo_next_commands_keep_the_url_options() -> None:
    assert _read_url("redis://127.0.0.1:6390/0?namespace=nc&budget=1GiB") == "redis://127.0.0.1:6390/0?namespace=nc"
    assert _read_url("lmdb:///x/y?budget=256MiB") == "lmdb:///x/y"
    assert _read_url("mmap:///x?durability=sync&budget=1GiB&verify=never") == "mmap:///x?durability=sync&verify=never"


def test_demo_one_screen_with_options_kept(runner: CliRunner, tmp_path: Path) -> None:
    url = _lmdb(tmp_path) + "?budget=64MiB&durability=none"
    r = invoke(runner, "demo", "--url", url, "--tokens", "2048", "--same-process")
    assert r.exit_code == 0, r.output
    out = r.stdout
    for phrase in ("1 cold lookup A", "0/64", "2 save fork B", "48 shared: dedup", "3 restart",
                   "4 lookup + restore A", "64/64", "every byte matched", "cold A", "-> restored"):
        assert phrase in out, (phrase, out)
    nxt = [ln for ln in out.splitlines() if "hostkv info" in ln]
    assert nxt and "durability=none" in nxt[0] and "budget" not in nxt[0]
    assert all(len(line) <= 80 for line in out.splitlines() if str(tmp_path) not in line), out
    suggested = nxt[0].split("hostkv info ", 1)[1].strip("'")
    assert invoke(runner, "info", suggested).exit_code == 0  # the suggestion works as printed
    # progress on every phase (stderr; bars on a terminal, these labels otherwise)
    for label in ("computing + saving prompt A", "saving fork B", "restarting", "restoring + verifying"):
        assert label in r.stderr, (label, r.stderr)
