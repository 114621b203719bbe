"""The template provider proves the contract the only way that counts: the shipped suite."""

from __future__ import annotations

from pathlib import Path

import hostkv_providers as hk
from hostkv_dictstore import DictProvider
from hostkv_providers.testing import ProviderTests


class TestDictConformance(ProviderTests):
    def make_provider(self, tmp_path: Path, budget_bytes: int) -> hk.Provider:
        return DictProvider(budget_bytes)

    # Backdoors reach the medium without the provider's read path.
    def backdoor_read(self, provider: hk.Provider, key: hk.Key) -> bytes | None:
        assert isinstance(provider, DictProvider)
        return provider._data.get(key)

    def backdoor_corrupt(self, provider: hk.Provider, key: hk.Key) -> None:
        assert isinstance(provider, DictProvider)
        blob = bytearray(provider._data[key])
        blob[len(blob) // 2] ^= 0x40
        provider._data[key] = bytes(blob)


def test_found_through_its_entry_point() -> None:
    info = {i.name: i for i in hk.available_providers()}["dict"]
    assert info.distribution == "hostkv-dictstore" and not info.builtin
    with hk.open("dict://?budget=1MiB") as p:
        assert isinstance(p, DictProvider) and p.budget_bytes == 1 << 20
