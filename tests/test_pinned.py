"""The pinned provider: the conformance suite (two arena variants) and pinned-specific tests."""

from __future__ import annotations

from pathlib import Path

from hostkv_providers import Key, PinnedProvider, Provider
from hostkv_providers._hostmem import OrdinaryAllocator
from hostkv_providers.testing import ProviderTests

PAGE = 4096


def _backdoor_regions(provider: Provider, key: Key) -> list[memoryview] | None:
    assert isinstance(provider, PinnedProvider)
    node = provider._index.get(key)
    if node is None:
        return None
    return [r.view for r in provider._arena.regions(node.loc, node.nbytes, False)]


class _PinnedBackdoors(ProviderTests):
    def backdoor_read(self, provider: Provider, key: Key) -> bytes | None:
        views = _backdoor_regions(provider, key)
        return None if views is None else b"".join(bytes(v) for v in views)

    def backdoor_corrupt(self, provider: Provider, key: Key) -> None:
        views = _backdoor_regions(provider, key)
        assert views is not None, "backdoor_corrupt needs a stored key"
        views[0][17] ^= 0x5A


class TestPinnedConformance(_PinnedBackdoors):
    """One chunk, allocated before the constructor returns."""

    def make_provider(self, tmp_path: Path, budget_bytes: int) -> Provider:
        return PinnedProvider(budget_bytes, block=PAGE, allocator=OrdinaryAllocator(), verify_reads=True)


class TestPinnedBackgroundConformance(_PinnedBackdoors):
    """Several chunks (4 pages each), all but the first pinned by the background thread."""

    def make_provider(self, tmp_path: Path, budget_bytes: int) -> Provider:
        return PinnedProvider(budget_bytes, block=PAGE, chunk=4 * PAGE, allocator=OrdinaryAllocator(),
                              background=True, verify_reads=True)
