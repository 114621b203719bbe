"""Release hygiene of the four distributions: each ships the Apache-2.0 text it declares, has
classifiers and project URLs, and the README that becomes its package-index page links only
absolutely (relative links break there)."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
DISTS = [ROOT, ROOT / "cli", ROOT / "plugins" / "hostkv-redis", ROOT / "examples" / "custom_provider"]

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - 3.10
    tomllib = pytest.importorskip("tomli")


def _project(dist: Path) -> dict[str, Any]:
    with open(dist / "pyproject.toml", "rb") as f:
        doc: dict[str, Any] = tomllib.load(f)
    return doc


@pytest.mark.parametrize("dist", DISTS, ids=lambda d: d.name or "core")
def test_distribution_metadata(dist: Path) -> None:
    doc = _project(dist)
    project = doc["project"]
    text = (dist / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License") and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text  # the full text, not a stub
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    # PEP 639: a license expression replaces the License :: classifier (setuptools refuses both).
    assert not [c for c in project["classifiers"] if c.startswith("License ::")]
    assert "Typing :: Typed" in project["classifiers"]
    assert any(c.startswith("Programming Language :: Python :: 3.1") for c in project["classifiers"])
    urls = project["urls"]
    assert {"Homepage", "Repository", "Documentation", "Issues"} <= set(urls)
    assert all(u.startswith("https://") for u in urls.values())
    assert any(r.startswith("setuptools>=77") for r in doc["build-system"]["requires"])
    readme = (dist / project["readme"]).read_text()
    relative = [t for t in re.findall(r"\]\(([^)\s]+)\)", readme) if not re.match(r"https?://|#|mailto:", t)]
    assert relative == [], f"relative links break on the package index: {relative}"
    # every absolute link into the repository names a file that exists
    base = urls["Repository"].rstrip("/") + "/blob/main/"
    for target in re.findall(r"\]\((" + re.escape(base) + r"[^)#\s]+)", readme):
        assert (ROOT / target[len(base):]).exists(), target
