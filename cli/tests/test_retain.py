"""``hostkv retain`` / ``unretain`` and the retained marks in ``info`` and ``ls``."""

from __future__ import annotations

import json
from pathlib import Path

import hostkv_providers as hk
from click.testing import CliRunner

from .conftest import SALT_B, fill, invoke, run_hostkv

URL = "pinned://?budget=16MiB&block=16KiB"


def test_retain_by_key_prefix_and_salt(runner: CliRunner, stores) -> None:  # type: ignore[no-untyped-def]
    p = stores(URL)
    f = fill(p)
    a = f.chains["a"]
    r = invoke(runner, "retain", URL, "--key", a[5].hex())
    assert r.exit_code == 0, r.output
    assert "retained 1 of 1" in r.output and "retained now: 1 entries" in r.output
    doc = json.loads(invoke(runner, "retain", "--json", URL, "--key", a[5].hex()[:12], "--key", a[2].hex()).stdout)
    assert doc["selected"] == 2 and doc["marked"] == 1 and doc["retained"] == 2
    assert doc["retained_bytes"] == 6 * f.page_nbytes  # a[0..5], each once
    # --prefix: the entry and every continuation below it
    doc = json.loads(invoke(runner, "retain", "--json", URL, "--prefix", f.chains["b"][2].hex()).stdout)
    assert doc["selected"] == 3 and doc["marked"] == 3
    doc = json.loads(invoke(runner, "unretain", "--json", URL, "--salt", SALT_B.tag).stdout)
    assert doc["cleared"] == 3 and doc["retained"] == 2
    # the marks hold against eviction: evict --key on the chain root is refused, nothing goes
    r = invoke(runner, "evict", URL, "--key", a[0].hex())
    assert r.exit_code == 2 and "retained" in r.output and "unretain" in r.output
    assert p.present(a[:6]) == [True] * 6
    invoke(runner, "evict", URL, "--to", "0")
    assert p.present(a[:6]) == [True] * 6 and not any(p.present(a[6:]))
    doc = json.loads(invoke(runner, "unretain", "--json", URL, "--key", a[5].hex(), "--key", a[2].hex()).stdout)
    assert doc["cleared"] == 2 and doc["retained"] == 0 and doc["retained_bytes"] == 0


def test_info_and_ls_show_the_marks(runner: CliRunner, stores) -> None:  # type: ignore[no-untyped-def]
    p = stores(URL)
    f = fill(p)
    b = f.chains["b"]
    r = invoke(runner, "ls", URL)
    assert "RET" not in r.output  # no column while nothing is retained
    assert isinstance(p, hk.providers.SupportsRetain)
    p.retain([b[-1]])
    doc = json.loads(invoke(runner, "info", "--json", URL).stdout)
    assert doc["retained"] == 1 and doc["retained_bytes"] == len(b) * f.page_nbytes + 1000  # with its anchor
    r = invoke(runner, "info", URL)
    assert "retained" in r.output and "1 entries" in r.output
    assert all(len(line) <= 80 for line in r.output.splitlines())
    flat = json.loads(invoke(runner, "ls", "--json", URL).stdout)
    marked = {e["key"] for e in flat["entries"] if e["retained"]}
    assert marked == {b[-1].hex()}
    r = invoke(runner, "ls", URL)
    assert "RET" in r.output and "R = retained" in r.output
    tree = json.loads(invoke(runner, "ls", "--tree", "--json", URL).stdout)
    assert sum(run["retained"] for run in tree["runs"]) == 1


def test_usage_errors(runner: CliRunner, stores) -> None:  # type: ignore[no-untyped-def]
    p = stores(URL)
    f = fill(p)
    for args in ((), ("--key", f.chains["a"][0].hex(), "--salt", SALT_B.tag)):
        r = invoke(runner, "retain", URL, *args)
        assert r.exit_code == 2
    r = invoke(runner, "retain", URL, "--key", "ab" * 32)  # not stored
    assert r.exit_code == 2 and "not stored" in r.output
    r = invoke(runner, "retain", URL, "--salt", "nosuchtag")
    assert r.exit_code == 2 and "salt tag" in r.output
    r = invoke(runner, "retain", URL, "--prefix", f.chains["a"][0].hex())  # 24+ pages of 16 MiB: fits
    assert r.exit_code == 0, r.output
    assert isinstance(p, hk.providers.SupportsRetain)
    p.unretain([e.key for e in p.iter_entries()])


def test_retain_persists_through_the_console_script(tmp_path: Path) -> None:
    url = f"mmap://{tmp_path / 's'}?budget=4MiB&slot=16KiB"
    with hk.open(url) as p:
        fill(p, pages=6)
        key = next(e.key for e in p.iter_entries() if e.salt_tag == SALT_B.tag and e.parent is not None)
    r = run_hostkv("retain", url, "--key", key.hex())
    assert r.returncode == 0, r.stderr
    r = run_hostkv("info", "--json", url)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["retained"] == 1
    r = run_hostkv("evict", url, "--salt", SALT_B.tag)
    assert r.returncode == 2 and "unretain" in r.stderr
    r = run_hostkv("unretain", url, "--key", key.hex())
    assert r.returncode == 0 and "unretained 1 of 1" in r.stdout
