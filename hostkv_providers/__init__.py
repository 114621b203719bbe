"""hostkv-providers: a host-side tier for LLM KV caches behind one pluggable storage interface.

The names here are an engine integrator's: open a store, name pages, look up, restore and save
through :class:`HostKVCache`, and the errors to catch.  The rest lives in namespaces:

* :mod:`hostkv_providers.errors` -- every error class;
* :mod:`hostkv_providers.providers` -- the built-in providers and a provider author's kit;
* :mod:`hostkv_providers.device` -- host memory and the copy engines;
* :mod:`hostkv_providers.cache` -- the engine layer (admission policies, layouts, HF mappings);
* :mod:`hostkv_providers.testing` -- the conformance suite (needs pytest).

Modules and packages whose names start with ``_`` are private.  Every public name of the
namespaces is also reachable here as an attribute (``hostkv_providers.TreeIndex``), so code
written against the flat face keeps working; new code should import from the namespace.
"""

from __future__ import annotations

import importlib
from typing import Any

from hostkv_providers import cache, device, errors, providers
from hostkv_providers._errors import CapacityError, CorruptStoreError, HostKVError, InvalidArgumentError
from hostkv_providers._keys import ZERO_KEY, Key, MediaItem, Salt, chain_keys
from hostkv_providers._layout import KVLayout
from hostkv_providers._provider import Provider
from hostkv_providers._registry import available_providers, open_provider
from hostkv_providers._reports import EntryInfo, ProviderStats
from hostkv_providers._reservation import Lease, Reservation
from hostkv_providers._span import ByteSpan
from hostkv_providers.cache._cache import CacheHandle, CacheHit, HostKVCache, RestoreResult, SaveResult
from hostkv_providers.device._copy import cuda_available, default_copy_engine

#: ``hostkv_providers.open(url)`` builds a provider from a URL.
open = open_provider  # noqa: A001 - the documented entry point, shadowing is intended

__version__ = "0.1.0"

# Names of the namespaces reachable from the top as well (see the module docstring).
_NAMESPACES = ("errors", "providers", "device", "cache")


def __getattr__(name: str) -> Any:
    for ns in _NAMESPACES:
        module = importlib.import_module(f"hostkv_providers.{ns}")
        if name in getattr(module, "__all__", ()):
            value = getattr(module, name)
            globals()[name] = value
            return value
    raise AttributeError(f"module 'hostkv_providers' has no attribute {name!r}")


def __dir__() -> list[str]:
    names = set(globals())
    for ns in _NAMESPACES:
        names.update(getattr(importlib.import_module(f"hostkv_providers.{ns}"), "__all__", ()))
    return sorted(names)


__all__ = [
    "ZERO_KEY",
    "ByteSpan",
    "CacheHandle",
    "CacheHit",
    "CapacityError",
    "CorruptStoreError",
    "EntryInfo",
    "HostKVCache",
    "HostKVError",
    "InvalidArgumentError",
    "KVLayout",
    "Key",
    "Lease",
    "MediaItem",
    "Provider",
    "ProviderStats",
    "Reservation",
    "RestoreResult",
    "Salt",
    "SaveResult",
    "__version__",
    "available_providers",
    "cache",
    "chain_keys",
    "cuda_available",
    "default_copy_engine",
    "device",
    "errors",
    "open",
    "providers",
]
