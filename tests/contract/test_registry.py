"""Entry-point registry, URL parsing, options, and the error/span value types."""

from __future__ import annotations

import copy
import textwrap
from pathlib import Path

import pytest

import hostkv_providers as hk
from hostkv_providers._options import Options

PLUGIN_MODULE = '''
from hostkv_providers import PinnedProvider

class FakeProvider(PinnedProvider):
    """A throwaway third-party provider: pinned memory under another name."""
    name = "fakeplugin"

    @classmethod
    def from_url(cls, location, options):
        return cls(1 << 20, block=4096)
'''


@pytest.fixture
def fake_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Install a throwaway plugin distribution (module + dist-info) on sys.path."""
    (tmp_path / "fake_hostkv_plugin.py").write_text(PLUGIN_MODULE)
    info = tmp_path / "fake_hostkv_plugin-9.9.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-hostkv-plugin\nVersion: 9.9\n")
    (info / "entry_points.txt").write_text(
        textwrap.dedent(
            """
            [hostkv_providers.providers]
            fakeplugin = fake_hostkv_plugin:FakeProvider
            pinned = fake_hostkv_plugin:FakeProvider
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv(hk.DISABLE_PLUGINS_ENV, raising=False)
    return tmp_path


def test_builtins_register_through_entry_points() -> None:
    infos = {i.name: i for i in hk.available_providers()}
    assert infos["pinned"].builtin and infos["pinned"].distribution == "hostkv-providers"
    assert infos["pinned"].target == "hostkv_providers.providers.pinned:PinnedProvider"
    assert {"iterate", "verify", "pinned_views"} <= infos["pinned"].capabilities
    assert hk.provider_class("pinned") is hk.PinnedProvider


def test_third_party_plugin_is_discovered(fake_plugin: Path) -> None:
    infos = {i.name: i for i in hk.available_providers()}
    assert infos["fakeplugin"].distribution == "fake-hostkv-plugin"
    assert infos["fakeplugin"].version == "9.9" and not infos["fakeplugin"].builtin
    with hk.open("fakeplugin://") as p:
        assert type(p).__name__ == "FakeProvider" and p.budget_bytes == 1 << 20
    # a plugin cannot shadow a built-in name
    assert hk.provider_class("pinned") is hk.PinnedProvider


def test_env_var_disables_third_party_plugins(fake_plugin: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(hk.DISABLE_PLUGINS_ENV, "1")
    names = {i.name for i in hk.available_providers()}
    assert "fakeplugin" not in names and "pinned" in names
    with pytest.raises(hk.UnknownProviderError):
        hk.open("fakeplugin://")


def test_unknown_scheme_names_installed_providers() -> None:
    with pytest.raises(hk.UnknownProviderError, match=r"installed: .*pinned") as err:
        hk.open("nosuch:///x")
    assert err.value.hint
    assert isinstance(err.value, LookupError)


@pytest.mark.parametrize(
    "url",
    ["pinned", "", "pinned://?budget=1MiB#frag", "pinned://?budget=1MiB&budget=2MiB", "pinned://?budget=lots",
     "pinned://?budget=1MiB&colour=red", "pinned:///some/path?budget=1MiB", "pinned://?budget=1MiB&verify=maybe"],
)
def test_bad_urls_are_typed_errors(url: str) -> None:
    with pytest.raises(hk.InvalidArgumentError):
        hk.open(url)


def test_open_with_options_and_overrides() -> None:
    with hk.open("pinned://?budget=2MiB&block=4096&background=false", budget="1MiB") as p:
        assert isinstance(p, hk.PinnedProvider) and p.budget_bytes == 1 << 20 and p.block_nbytes == 4096
        assert p.describe()["provider"] == "pinned"


def test_parse_url() -> None:
    assert hk.parse_url("mmap:///var/kv?budget=8GiB&durability=sync") == (
        "mmap", "/var/kv", {"budget": "8GiB", "durability": "sync"})
    assert hk.parse_url("redis://127.0.0.1:6379/0") == ("redis", "127.0.0.1:6379/0", {})


@pytest.mark.parametrize(
    ("text", "nbytes"),
    [("4096", 4096), ("8GiB", 8 << 30), ("1.5MB", 1_500_000), ("64 KiB", 65536), ("2g", 2_000_000_000), (7, 7)],
)
def test_parse_size(text: str, nbytes: int) -> None:
    assert hk.parse_size(text) == nbytes


@pytest.mark.parametrize("text", ["", "GiB", "-1", "1 parsec", "1e9", None])
def test_parse_size_rejects(text: object) -> None:
    with pytest.raises(hk.InvalidArgumentError):
        hk.parse_size(text)  # type: ignore[arg-type]


def test_options_reject_unknown_and_list_known() -> None:
    opts = Options("demo", {"budget": "1MiB", "typo": "1"})
    opts.size("budget", 0)
    with pytest.raises(hk.InvalidArgumentError, match="typo") as err:
        opts.finish()
    assert "budget" in err.value.hint


def test_byte_span() -> None:
    s = hk.ByteSpan(4, 8)
    assert s.end == 12 and s.validate(12) is s
    with pytest.raises(hk.SpanError):
        s.validate(11)
    for bad in ((-1, 1), (0, -1), (True, 1), (0, 1.0)):
        with pytest.raises(hk.SpanError):
            hk.ByteSpan(*bad)  # type: ignore[arg-type]
    with pytest.raises(AttributeError):
        s.offset = 3  # type: ignore[misc]


def test_errors_have_hints_builtin_bases_and_survive_reduce() -> None:
    assert issubclass(hk.UnknownKeyError, KeyError) and issubclass(hk.StorageIOError, OSError)
    assert issubclass(hk.LockedError, BlockingIOError) and issubclass(hk.SpanError, ValueError)
    err = hk.InFlightError("busy", key=b"k" * 32)
    back = copy.deepcopy(err)  # goes through __reduce__, as multiprocessing does
    assert isinstance(back, hk.InFlightError) and back.key == b"k" * 32 and back.hint == err.hint
    plain = copy.deepcopy(hk.CapacityError("full", hint="grow"))
    assert str(plain) == "full" and plain.hint == "grow"
    assert str(hk.UnknownKeyError("missing parent")) == "missing parent"


def test_builtins_open_without_installed_metadata(monkeypatch: pytest.MonkeyPatch) -> None:
    """A source tree on PYTHONPATH has no entry-point metadata: the built-ins still open (issue 19)."""
    from importlib import metadata

    from hostkv_providers import _registry

    monkeypatch.setattr(metadata, "entry_points", lambda **kw: [])
    monkeypatch.setattr(_registry, "_classes", {})
    infos = {i.name: i for i in hk.available_providers()}
    assert set(infos) == {"lmdb", "mmap", "pinned", "tiered"}
    assert all(i.builtin and i.error is None for i in infos.values())
    assert infos["pinned"].distribution == "hostkv-providers (source tree)"
    with hk.open("pinned://?budget=1MiB") as store:
        assert store.name == "pinned"
