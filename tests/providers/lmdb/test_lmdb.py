"""The lmdb provider against the conformance suite, twice: pages in slot files, and inline.

The backdoors read the medium without the provider's read path: entry records are decoded here
with their documented ``struct`` layout, and slot bytes are read with ``os.pread`` from the slot
file at the offset its on-disk header declares.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Any

from hostkv_providers._keys import Key
from hostkv_providers._provider import Provider
from hostkv_providers.providers.lmdb._provider import LmdbProvider
from hostkv_providers.testing import ProviderTests

# The documented entry record: version, flags, parent, nbytes, cost, checksum, created, last_used,
# tick, children, hold, generation, file id (0 = inline), slot; then salt tag and a 32-bit CRC.
ENTRY = struct.Struct("<BB32sQQQddQIIQQQ")


def _raw_entry(p: LmdbProvider, key: bytes) -> tuple[int, int, int] | None:
    """``(nbytes, file_id, slot)`` straight from the LMDB ``entries`` database."""
    s: Any = p._s
    with s.env.begin() as txn:
        raw = txn.get(bytes(key), db=s.dbs["entries"])
    if raw is None:
        return None
    fields = ENTRY.unpack_from(raw)
    return fields[3], fields[12], fields[13]


def _slot_location(p: LmdbProvider, file_id: int, slot: int) -> tuple[str, int]:
    path = os.path.join(p.path, "slots", f"{file_id:08d}.slots")
    with open(path, "rb") as f:
        head = f.read(128)
    slot_nbytes, = struct.unpack_from("<Q", head, 16)
    data_offset, = struct.unpack_from("<Q", head, 40)
    return path, data_offset + slot * slot_nbytes


def backdoor_read(p: LmdbProvider, key: bytes) -> bytes | None:
    loc = _raw_entry(p, key)
    if loc is None:
        return None
    nbytes, file_id, slot = loc
    if file_id == 0:
        s: Any = p._s
        with s.env.begin() as txn:
            blob = txn.get(bytes(key), db=s.dbs["pages"])
        return None if blob is None else bytes(blob)
    path, offset = _slot_location(p, file_id, slot)
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, nbytes, offset)
    finally:
        os.close(fd)


def backdoor_corrupt(p: LmdbProvider, key: bytes, at: int = 100) -> None:
    loc = _raw_entry(p, key)
    assert loc is not None, "backdoor_corrupt of a missing key"
    nbytes, file_id, slot = loc
    at %= nbytes
    if file_id == 0:
        s: Any = p._s
        with s.env.begin(write=True) as txn:
            blob = bytearray(txn.get(bytes(key), db=s.dbs["pages"]))
            blob[at] ^= 0x5A
            txn.put(bytes(key), bytes(blob), db=s.dbs["pages"])
        return
    path, offset = _slot_location(p, file_id, slot)
    fd = os.open(path, os.O_RDWR)
    try:
        old = os.pread(fd, 1, offset + at)
        os.pwrite(fd, bytes([old[0] ^ 0x5A]), offset + at)
    finally:
        os.close(fd)


class TestLmdbConformance(ProviderTests):
    """Pages in slot files (``inline_max=0``)."""

    supports_reopen = True
    inline_max = 0

    def make_provider(self, tmp_path: Path, budget_bytes: int) -> Provider:
        return LmdbProvider(tmp_path / "store", budget_bytes=budget_bytes, inline_max=self.inline_max)

    def reopen(self, provider: Provider) -> Provider:
        assert isinstance(provider, LmdbProvider)
        provider.close()
        return LmdbProvider(provider.path, inline_max=self.inline_max)

    def backdoor_read(self, provider: Provider, key: Key) -> bytes | None:
        assert isinstance(provider, LmdbProvider)
        return backdoor_read(provider, key)

    def backdoor_corrupt(self, provider: Provider, key: Key) -> None:
        assert isinstance(provider, LmdbProvider)
        backdoor_corrupt(provider, key)


class TestLmdbInlineConformance(TestLmdbConformance):
    """Every page inline in LMDB (``inline_max`` above every size the suite uses)."""

    inline_max = 1 << 20
