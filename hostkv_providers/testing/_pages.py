"""Deterministic workload helpers shared by the conformance suite and crash tests.

A page's expected bytes are a pure function of its key (a PRNG seeded by the key), so any process
— the test, a forked or killed child, a reader that never saw the write — can recompute them and
check a read byte for byte without keeping a copy.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from hostkv_providers._keys import Key
from hostkv_providers._layout import KVLayout
from hostkv_providers._provider import Provider

__all__ = ["anchor_bytes", "chain", "key_of", "page_bytes", "put_chain", "put_page"]


def key_of(label: str) -> Key:
    """A 32-byte test key derived from ``label`` (stable across processes and machines)."""
    return Key(hashlib.blake2b(label.encode(), digest_size=32, person=b"hostkv-test").digest())


def chain(label: str, n: int) -> list[Key]:
    """``n`` distinct keys for a chain named ``label`` (root first)."""
    return [key_of(f"{label}/{i}") for i in range(n)]


def _rng(seed: bytes) -> np.random.Generator:
    # Seed from all 32 key bytes (eight uint32 words), so distinct keys give distinct streams.
    words = np.frombuffer(hashlib.blake2b(seed, digest_size=32).digest(), dtype="<u4")
    return np.random.default_rng([int(w) for w in words])


def page_bytes(key: bytes, nbytes: int) -> bytes:
    """The bytes a test stores under ``key`` when the entry is ``nbytes`` long."""
    return _rng(bytes(key) + nbytes.to_bytes(8, "little")).bytes(nbytes)


def anchor_bytes(key: bytes, name: str, nbytes: int) -> bytes:
    """The bytes a test stores as anchor ``name`` of ``key``."""
    return _rng(b"anchor" + bytes(key) + name.encode() + nbytes.to_bytes(8, "little")).bytes(nbytes)


def put_page(provider: Provider, key: Key, parent: Key | None, nbytes: int, *, salt_tag: str = "") -> bool:
    """Store the deterministic page of ``key``; ``False`` if it was already stored (dedup)."""
    return provider.put(key, parent, page_bytes(key, nbytes), salt_tag=salt_tag)


def put_chain(provider: Provider, keys: Sequence[Key], nbytes: int, parent: Key | None = None) -> None:
    """Store a whole chain root first (each page's parent is the previous key)."""
    for key in keys:
        put_page(provider, key, parent, nbytes)
        parent = key


def engine_planes(layout: KVLayout, nblocks: int, *, fill: int | None = None, seed: int = 0) -> list[np.ndarray]:
    """Host arrays standing in for an engine's paged KV planes (one per plane of ``layout``,
    ``nblocks`` blocks): every byte ``fill`` (poison a restore must overwrite), else random
    float32 values from ``seed``."""
    shape = (nblocks, layout.page_tokens, layout.num_kv_heads, layout.head_dim)
    if fill is not None:
        out = [np.empty(shape, np.float32) for _ in layout.planes]
        for p in out:
            p.view(np.uint8).fill(fill)
        return out
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape, dtype=np.float32) for _ in layout.planes]
