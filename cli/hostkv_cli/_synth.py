"""Deterministic synthetic page bytes: any process recomputes a page's expected bytes from its key.

This is how ``demo`` and ``bench`` check that every byte read back is the byte written, without
keeping a copy: the bytes are a PRNG stream seeded by the page key (RELIABILITY.md's oracle).
"""

from __future__ import annotations

import numpy as np

__all__ = ["page_bytes"]


def page_bytes(key: bytes, nbytes: int) -> bytes:
    """``nbytes`` pseudo-random bytes determined by ``key`` alone."""
    seed = int.from_bytes(bytes(key[:16]), "little")
    return np.random.Generator(np.random.PCG64(seed)).bytes(nbytes)
