"""What the HostKVCache tests share: one small page geometry, engine planes filled from a seed,
token sequences, and a provider without zero-copy views.  Other test files load it by path
(no relative imports here)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from hostkv_providers import (
    KVLayout,
    PinnedProvider,
    Provider,
    Salt,
)
from hostkv_providers.device._hostmem import OrdinaryAllocator

# page = 2 layers x (k, v) x 4 tokens x 2 heads x 32 dims x 4 bytes = 4096 bytes
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, page_tokens=4, dtype="float32")
SALT = Salt("test/model", LAYOUT)
PAGE = LAYOUT.page_nbytes
NBLOCKS = 64


def make_planes(seed: int | None = None) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    shape = (NBLOCKS, LAYOUT.page_tokens, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    if seed is None:
        return [np.zeros(shape, np.float32) for _ in LAYOUT.planes]
    return [rng.standard_normal(shape, dtype=np.float32) for _ in LAYOUT.planes]


def page_of(planes: Sequence[np.ndarray], block: int) -> bytes:
    return b"".join(p[block].tobytes() for p in planes)


def tokens(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 32000, size=n)


class NoViews(Provider):
    """Delegates to a pinned provider but offers no zero-copy views (forces the staged path).
    ``fail_reads`` makes reads of chosen keys report a miss, like a checksum failure would."""

    name = "noviews"

    def __init__(self, inner: PinnedProvider) -> None:
        super().__init__()
        self.inner = inner
        self.fail_reads: set[bytes] = set()

    @classmethod
    def from_url(cls, location: str, options: Any) -> Provider:
        raise NotImplementedError

    def present(self, keys: Sequence[bytes]) -> list[bool]:
        return self.inner.present(keys)

    def entry(self, key: bytes) -> Any:
        return self.inner.entry(key)

    def reserve(self, key: bytes, parent: bytes | None, nbytes: int, *, salt_tag: str = "") -> Any:
        return self.inner.reserve(key, parent, nbytes, salt_tag=salt_tag)

    def write(self, reservation: Any, offset: int, data: object) -> None:
        self.inner.write(reservation, offset, data)

    def seal(self, reservation: Any) -> None:
        self.inner.seal(reservation)

    def abort(self, reservation: Any) -> None:
        self.inner.abort(reservation)

    def read(self, key: bytes, out: object, span: Any = None) -> bool:
        if bytes(key) in self.fail_reads:
            return False
        return self.inner.read(key, out, span)

    def in_flight(self, key: bytes) -> bool:
        return self.inner.in_flight(key)

    def evict(self, keys: Sequence[bytes] | None = None, *, nbytes: int = 0) -> Any:
        return self.inner.evict(keys, nbytes=nbytes)

    def put_anchor(self, key: bytes, name: str, data: object) -> None:
        self.inner.put_anchor(key, name, data)

    def get_anchor(self, key: bytes, name: str) -> bytes | None:
        return self.inner.get_anchor(key, name)

    def list_anchors(self, key: bytes) -> dict[str, int]:
        return self.inner.list_anchors(key)

    def lease(self, keys: Sequence[bytes]) -> Any:
        return self.inner.lease(keys)

    def _release_lease(self, lease: Any) -> None:
        self.inner._release_lease(lease)

    @property
    def budget_bytes(self) -> int:
        return self.inner.budget_bytes

    def stats(self) -> Any:
        return self.inner.stats()

    def close(self) -> None:
        self.inner.close()


class BatchedNoViews(NoViews):
    """Staged like :class:`NoViews`, but with the batch capability: saves go through
    ``put_many`` and staged restores through ``read_many`` (``fail_reads`` applies to both)."""

    name = "batched-noviews"

    def put_many(self, items: Sequence[tuple[bytes, bytes | None, object]], *,
                 salt_tag: str = "") -> list[Any]:
        self.put_many_calls += 1
        return self.inner.put_many(items, salt_tag=salt_tag)

    def read_many(self, keys: Sequence[bytes], outs: Sequence[object]) -> list[bool]:
        got = self.inner.read_many(keys, outs)
        return [g and bytes(k) not in self.fail_reads for k, g in zip(keys, got, strict=True)]

    put_many_calls = 0


def _pinned(pages: int = 256) -> PinnedProvider:
    return PinnedProvider(pages * PAGE, block=PAGE, allocator=OrdinaryAllocator())


class GatedReads(NoViews):
    """A staged provider whose page reads wait for ``gate`` (keeps a restore in flight)."""

    def __init__(self, inner: Provider) -> None:
        super().__init__(inner)
        self.gate = threading.Event()
        self.gate.set()

    def read(self, key: bytes, out: object, span: Any = None) -> bool:
        assert self.gate.wait(30)
        return bool(super().read(key, out, span))

