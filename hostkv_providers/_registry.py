"""Provider discovery through the ``hostkv_providers.providers`` entry-point group.

Built-in providers register through the same group as third-party ones (see ``pyproject.toml``),
so there is one code path.  Entry points are listed lazily and a provider class is imported only
when it is used.  ``HOSTKV_DISABLE_PLUGIN_AUTOLOAD=1`` hides every provider that does not come
from the ``hostkv-providers`` distribution itself.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import metadata
from types import MappingProxyType
from urllib.parse import parse_qsl, urlsplit

from hostkv_providers._errors import InvalidArgumentError, UnknownProviderError
from hostkv_providers._provider import Provider

__all__ = [
    "DISABLE_PLUGINS_ENV",
    "ENTRY_POINT_GROUP",
    "ProviderInfo",
    "available_providers",
    "open_provider",
    "parse_url",
    "provider_class",
]

ENTRY_POINT_GROUP = "hostkv_providers.providers"
DISABLE_PLUGINS_ENV = "HOSTKV_DISABLE_PLUGIN_AUTOLOAD"
_CORE_DIST = "hostkv-providers"

#: The built-in providers, as the core distribution's metadata registers them.  Used as well when
#: that metadata is absent (the library imported from a source tree on ``PYTHONPATH``): the core's
#: own providers must open however the package was put on the path.
_BUILTINS = {
    "lmdb": "hostkv_providers.providers.lmdb:LmdbProvider",
    "mmap": "hostkv_providers.providers.mmap:MmapProvider",
    "pinned": "hostkv_providers.providers.pinned:PinnedProvider",
    "tiered": "hostkv_providers.providers.tiered:TieredProvider",
}
#: Marks the fallback entry points above (they have no distribution object).
_SOURCE_TREE = "hostkv-providers (source tree)"

_lock = threading.Lock()
_classes: dict[str, type[Provider]] = {}


@dataclass(frozen=True)
class ProviderInfo:
    """One installed provider, as ``available_providers()`` reports it."""

    name: str
    distribution: str
    version: str
    builtin: bool
    target: str  # "module:Class"
    capabilities: frozenset[str]
    error: str | None = None  # set when the entry point failed to load


def _dist_name(ep: metadata.EntryPoint) -> tuple[str, str]:
    dist = getattr(ep, "dist", None)
    if dist is None:
        if ep.group == ENTRY_POINT_GROUP and _BUILTINS.get(ep.name) == ep.value:
            return _CORE_DIST, _core_version()
        return "?", "?"
    return dist.metadata["Name"] or "?", dist.version or "?"


def _normalize(name: str) -> str:
    return name.lower().replace("_", "-")


def _entry_points() -> Mapping[str, metadata.EntryPoint]:
    """Entry points by name; the core distribution wins a name clash (it cannot be shadowed)."""
    plugins_off = os.environ.get(DISABLE_PLUGINS_ENV, "").strip() not in ("", "0", "false")
    found: dict[str, metadata.EntryPoint] = {}
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist, _ = _dist_name(ep)
        builtin = _normalize(dist) == _CORE_DIST
        if plugins_off and not builtin:
            continue
        prior = found.get(ep.name)
        if prior is not None and _normalize(_dist_name(prior)[0]) == _CORE_DIST:
            continue
        found[ep.name] = ep
    for name, target in _BUILTINS.items():
        prior = found.get(name)
        if prior is None or _normalize(_dist_name(prior)[0]) != _CORE_DIST:
            found[name] = metadata.EntryPoint(name, target, ENTRY_POINT_GROUP)
    return MappingProxyType(found)


def _core_version() -> str:
    from hostkv_providers import __version__

    return __version__


def provider_class(name: str) -> type[Provider]:
    """The provider class registered under ``name`` (imported on first use)."""
    with _lock:
        cached = _classes.get(name)
    if cached is not None and name in _entry_points():
        return cached
    eps = _entry_points()
    ep = eps.get(name)
    if ep is None:
        known = ", ".join(sorted(eps)) or "none"
        raise UnknownProviderError(
            f"no provider is registered for scheme {name!r} (installed: {known})",
            hint="install the plugin distribution that provides it, or check the URL's scheme",
        )
    cls = ep.load()
    if not (isinstance(cls, type) and issubclass(cls, Provider)):
        raise UnknownProviderError(f"entry point {name!r} ({ep.value}) is not a Provider subclass")
    if cls.name != name:
        raise UnknownProviderError(f"entry point {name!r} loads {cls.__name__} whose name is {cls.name!r}")
    with _lock:
        _classes[name] = cls
    return cls


def available_providers() -> list[ProviderInfo]:
    """Every installed provider with its distribution and capabilities, sorted by name."""
    out = []
    for name, ep in sorted(_entry_points().items()):
        dist, version = _dist_name(ep)
        if getattr(ep, "dist", None) is None and dist == _CORE_DIST:
            dist = _SOURCE_TREE
        try:
            caps = provider_class(name).capability_names()
            error = None
        except Exception as exc:  # a broken plugin must not hide the others
            caps, error = frozenset(), f"{type(exc).__name__}: {exc}"
        builtin = dist == _SOURCE_TREE or _normalize(dist) == _CORE_DIST
        out.append(ProviderInfo(name, dist, version, builtin, ep.value, caps, error))
    return out


def parse_url(url: str) -> tuple[str, str, dict[str, str]]:
    """Split ``scheme://location?opt=value&...`` into its parts; options must be unique."""
    if not isinstance(url, str) or "://" not in url:
        raise InvalidArgumentError(
            f"not a provider URL: {url!r}",
            hint="write scheme://location?options, e.g. pinned://?budget=8GiB or lmdb:///var/cache/kv",
        )
    parts = urlsplit(url)
    if parts.fragment:
        raise InvalidArgumentError(f"provider URLs take no #fragment: {url!r}")
    location = parts.netloc + parts.path
    options: dict[str, str] = {}
    try:
        fields = parse_qsl(parts.query, keep_blank_values=True, strict_parsing=bool(parts.query))
    except ValueError:  # (a field without '=': ?budget)
        raise InvalidArgumentError(f"bad option in {url!r}: write each one as name=value",
                                   hint="e.g. mmap:///var/cache/kv?budget=64GiB&durability=none") from None
    for k, v in fields:
        if k in options:
            raise InvalidArgumentError(f"option {k!r} given twice in {url!r}")
        options[k] = v
    return parts.scheme, location, options


def open_provider(url: str, **options: str) -> Provider:
    """Build a provider from a URL, e.g. ``open("mmap:///nvme/kv?budget=64GiB&durability=sync")``.

    Keyword arguments add or override URL options.
    """
    scheme, location, opts = parse_url(url)
    opts.update({k: str(v) for k, v in options.items()})
    return provider_class(scheme).from_url(location, opts)
