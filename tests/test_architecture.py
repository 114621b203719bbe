"""The layering rules that keep the tree navigable, checked on the source itself.

* Code outside the package (cli/, plugins/, examples/, benchmarks/) imports only public names:
  never a private module ``hostkv_providers._x`` / ``hostkv_providers.<ns>._x``, never a private
  name out of a public module.
* Plugins and the template pin the core versions they are tested with (a bounded range).
* Capabilities: every name a provider class reports is a power it implements, and only known
  names are reported.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import hostkv_providers as hk

ROOT = Path(__file__).resolve().parents[1]
OUTSIDE = ("cli", "plugins", "examples", "benchmarks")


def _private_imports(path: Path, label: str | None = None) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    where = label if label is not None else str(path.relative_to(ROOT))
    bad: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            mods = [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            mods = [(node.module, [a.name for a in node.names])]
        else:
            continue
        for mod, names in mods:
            parts = mod.split(".")
            if parts[0] != "hostkv_providers":
                continue
            if any(p.startswith("_") for p in parts[1:]):
                bad.append(f"{where}:{node.lineno}: import of private module {mod}")
            bad += [f"{where}:{node.lineno}: private name {n} from {mod}"
                    for n in names if n.startswith("_")]
    return bad


def _outside_files() -> list[Path]:
    files = [p for d in OUTSIDE for p in sorted((ROOT / d).rglob("*.py"))]
    return [p for p in files if not any(part.startswith(".") or part == "build" for part in p.parts)]


def test_outside_code_imports_only_public_names() -> None:
    files = _outside_files()
    assert len(files) > 20  # the walk found the trees it guards
    bad = [b for p in files for b in _private_imports(p)]
    assert bad == [], "\n".join(bad)


def test_the_check_sees_a_private_import(tmp_path: Path) -> None:
    """The rule above fails on the forms it must catch (and not on public ones)."""
    probe = tmp_path / "probe.py"
    probe.write_text("\n".join(("import hostkv_providers._provider",
                                "from hostkv_providers.providers.mmap._format import OP_SEAL",
                                "from hostkv_providers.providers import _fsutil",
                                "from hostkv_providers.providers import TreeIndex")) + "\n", encoding="utf-8")
    found = _private_imports(probe, "probe.py")
    assert len(found) == 3 and all(":4:" not in f for f in found), found


@pytest.mark.parametrize("pyproject", sorted([*(ROOT / "plugins").glob("*/pyproject.toml"),
                                              ROOT / "examples" / "custom_provider" / "pyproject.toml"]))
def test_plugins_pin_the_core_versions_they_are_tested_with(pyproject: Path) -> None:
    import tomllib

    project = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]
    deps = [d[len("hostkv-providers"):] for d in project.get("dependencies", [])
            if re.match(r"hostkv-providers\s*([<>=!~]|$)", d)]
    assert deps, f"{pyproject} does not depend on hostkv-providers"
    for spec in deps:
        bounded = ">=" in spec and "<" in spec.replace("<=", "")
        assert bounded, f"{pyproject}: hostkv-providers{spec} is not a bounded range"


def test_capabilities_reported_are_implemented() -> None:
    known = set(hk.providers.CAPABILITY_NAMES)
    # device_mapped is a name only because pinned://?mapped=yes implements its Protocol
    assert "device_mapped" in known
    assert "device_mapped" in hk.providers.MappedPinnedProvider.capability_names()
    assert "device_mapped" not in hk.providers.PinnedProvider.capability_names()
    by_name = dict(zip(hk.providers.CAPABILITY_NAMES[len(hk.providers.CAPABILITY_FLAGS):],
                       hk.providers.CAPABILITY_PROTOCOLS, strict=True))
    for info in hk.available_providers():
        if info.error is not None:
            continue
        cls = hk.providers.provider_class(info.name)
        caps = cls.capability_names()
        assert caps <= known, (info.name, caps - known)
        for flag in hk.providers.CAPABILITY_FLAGS:
            assert (flag in caps) == bool(getattr(cls, flag)), (info.name, flag)
        for name, proto in by_name.items():
            members = [m for m in dir(proto) if not m.startswith("_")]
            has = all(getattr(cls, m, None) is not None for m in members)
            assert (name in caps) == has, (info.name, name)


def test_lmdb_does_not_report_pinned_views() -> None:
    """Its views are slot-file mappings or LMDB values, never page-locked memory."""
    caps = hk.providers.provider_class("lmdb").capability_names()
    assert "views" in caps and "pinned_views" not in caps
    assert "pinned_views" in hk.providers.provider_class("pinned").capability_names()
