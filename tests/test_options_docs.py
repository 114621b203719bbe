"""Each built-in provider declares its URL options once (``OPTIONS``, an ``OptionSet``): its
``from_url`` parses with it, and the options table of its docs page must list the same options,
in the same order, with the same defaults."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import hostkv_providers as hk

DOCS = Path(__file__).resolve().parents[1] / "docs" / "providers"
_ROW = re.compile(r"^\|\s*`([a-z_]+)`\s*\|\s*([^|]*?)\s*\|")


def _docs_table(name: str) -> dict[str, str]:
    """The first table of ``docs/providers/<name>.md`` whose header is ``option | default | ...``."""
    lines = (DOCS / f"{name}.md").read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(r"^\|\s*option\s*\|\s*default\s*\|", line))
    out: dict[str, str] = {}
    for line in lines[start + 2:]:
        m = _ROW.match(line)
        if m is None:
            break
        out[m.group(1)] = m.group(2)
    return out


@pytest.mark.parametrize("name", ["pinned", "mmap", "lmdb", "tiered"])
def test_docs_options_table_matches_the_declaration(name: str) -> None:
    declared = hk.providers.provider_class(name).OPTIONS  # type: ignore[attr-defined]
    assert isinstance(declared, hk.providers.OptionSet) and declared.provider == name
    table = _docs_table(name)
    assert list(table) == list(declared.names), f"options in docs/providers/{name}.md differ from the declaration"
    assert table == declared.shown_defaults()


def test_an_undeclared_option_is_refused_naming_the_declared_ones() -> None:
    with pytest.raises(hk.InvalidArgumentError) as info:
        hk.providers.provider_class("pinned").OPTIONS.parse({"budget": "1MiB", "colour": "red"})  # type: ignore[attr-defined]
    assert "colour" in str(info.value) and "budget, block, chunk" in (info.value.hint or "")


def test_parse_gives_every_declared_option() -> None:
    got = hk.providers.provider_class("mmap").OPTIONS.parse({"budget": "8MiB", "io": "mmap"})  # type: ignore[attr-defined]
    assert got["budget"] == 8 << 20 and got["io"] == "mmap" and got["slot"] is None and got["durability"] == "process"
