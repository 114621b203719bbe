"""What the HostKVCache tests share: one small page geometry, engine planes filled from a seed,
and token sequences."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hostkv_providers import KVLayout, Salt

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
