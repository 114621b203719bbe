"""``dict://`` — the smallest complete provider: page bytes in a Python dict (the template).

Two layers do the work.  The front (:class:`hostkv_providers.providers.Provider`) validates
arguments, checks close/fork, counts stats and applies the checksum rule.  The driver base
:class:`hostkv_providers.providers.IndexedProvider` implements every driver over the shared
in-process :class:`~hostkv_providers.providers.TreeIndex` (the prefix-closed tree, leaf-LRU
eviction, the budget guard, leases, anchors, retained entries, a checksum per entry).  What is left
is the medium: three methods that keep, return and forget an entry's bytes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import hostkv_providers as hk
from hostkv_providers import providers as hp

__all__ = ["DictProvider"]


class DictProvider(hp.IndexedProvider):
    """Entries in process memory; budget-bounded; not persistent."""

    name = "dict"
    #: The URL options, declared once: parsing and ``describe()`` come from this.
    OPTIONS = hp.OptionSet(
        "dict",
        hp.Option("budget", "size", 64 << 20, "64MiB"),
        hp.Option("retain_share", "number", 0.5, "0.5"),
    )

    def __init__(self, budget_bytes: int, *, retain_share: float = 0.5) -> None:
        super().__init__(budget_bytes, retain_share=retain_share)
        self._data: dict[hk.Key, bytes] = {}  # the "medium"

    @classmethod
    def from_url(cls, location: str, options: Mapping[str, str]) -> DictProvider:
        o = cls.OPTIONS.parse(options)  # unknown options are refused, naming the accepted ones
        if location not in ("", "/"):
            raise hk.InvalidArgumentError("dict:// takes no path", hint="use dict://?budget=64MiB")
        return cls(o["budget"], retain_share=o["retain_share"])

    # The medium: called under the provider's lock, with validated keys.
    def _store(self, key: hk.Key, data: bytes) -> None:
        self._data[key] = data

    def _load(self, key: hk.Key) -> bytes | None:
        return self._data.get(key)  # checked against the seal's checksum before it is copied out

    def _discard(self, keys: Sequence[hk.Key]) -> None:
        for key in keys:
            self._data.pop(key, None)
