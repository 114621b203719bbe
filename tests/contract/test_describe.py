"""Persistent providers report what opening the store found (``hostkv info`` shows it)."""

from __future__ import annotations

from pathlib import Path

import pytest

import hostkv_providers as hk
from hostkv_providers.testing import key_of, put_page


@pytest.mark.parametrize("scheme", ["mmap", "lmdb"])
def test_describe_reports_last_recovery_and_durability(tmp_path: Path, scheme: str) -> None:
    url = f"{scheme}://{tmp_path / 'store'}?budget=8MiB"
    with hk.open(url) as p:
        put_page(p, key_of("describe"), None, 4096)
    with hk.open(url) as p:
        desc = p.describe()
        assert desc["durability"] == "process" and desc["persistent"] is True
        rec = desc["last_recovery"]
        assert rec["readonly"] is False and rec["seconds"] >= 0 and rec["at"].endswith("Z")
        if scheme == "mmap":
            assert rec["entries"] == 1 and rec["problems_total"] == 0
        else:
            assert rec["dead_owners_reclaimed"] == 0
