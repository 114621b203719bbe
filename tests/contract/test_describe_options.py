"""``describe()`` reports every declared URL option with the value in effect (issue 13 item 7):
the option declaration (``OPTIONS``) is the one source of parsing, ``describe()`` and the docs."""

from __future__ import annotations

import urllib.parse
from pathlib import Path

import pytest

import hostkv_providers as hk


def _urls(tmp: Path) -> dict[str, tuple[str, dict[str, object]]]:
    fast = "pinned://?budget=4MiB&block=16KiB&background=false&pin=no&verify=read&retain_share=0.25"
    slow = f"lmdb://{tmp / 'slow'}?budget=8MiB&retain_share=0.5"
    return {
        "pinned": (fast, {"budget": 4 << 20, "block": 16384, "background": False, "verify": "read", "pin": "no",
                          "mapped": "no", "retain_share": 0.25}),
        "mmap": (f"mmap://{tmp / 'm'}?budget=8MiB&slot=16KiB&durability=sync&verify=never&snapshot_every=100"
                 "&commit_window_us=250&io=mmap&retain_share=0.3",
                 {"budget": 8 << 20, "slot": 16384, "durability": "sync", "verify": "never", "readonly": False,
                  "snapshot_every": 100, "commit_window_us": 250, "io": "mmap", "retain_share": 0.3}),
        "lmdb": (f"lmdb://{tmp / 'l'}?budget=8MiB&inline_max=1KiB&lease_ttl=60&durability=none",
                 {"budget": 8 << 20, "inline_max": 1024, "lease_ttl": 60.0, "durability": "none", "readonly": False,
                  "retain_share": 0.5}),
        "tiered": ("tiered://?" + urllib.parse.urlencode({"fast": fast, "slow": slow, "queue": "8",
                                                          "promote": "false"}),
                   {"budget": 8 << 20, "queue": 8, "promote": False, "retain_share": 0.5}),
    }


@pytest.mark.parametrize("name", ["pinned", "mmap", "lmdb", "tiered"])
def test_describe_reports_each_declared_option(tmp_path: Path, name: str) -> None:
    url, want = _urls(tmp_path)[name]
    with hk.open(url) as p:
        desc = p.describe()
        declared = type(p).OPTIONS.names  # type: ignore[attr-defined]
        # every option is there but a mapped arena's device (pinned) — tiered's fast= and slow=
        # are the tiers' own describe()
        assert set(declared) - set(desc) <= {"device"}
        for key, value in want.items():
            assert desc[key] == value, (key, desc[key], value)


def test_the_template_describes_its_options() -> None:
    dictstore = pytest.importorskip("hostkv_dictstore")
    with dictstore.DictProvider.from_url("", {"budget": "2MiB", "retain_share": "0.2"}) as p:
        assert {k: p.describe()[k] for k in ("budget", "retain_share")} == {"budget": 2 << 20, "retain_share": 0.2}


def test_secret_options_are_not_described() -> None:
    opts = hk.providers.OptionSet("x", hk.providers.Option("password", "text", None, "-", secret=True),
                                  hk.providers.Option("mode", "text", "a", "a"))

    class Holder:
        _password = "hunter2"
        _mode = "b"

    assert opts.values(Holder()) == {"password": "***", "mode": "b"}
