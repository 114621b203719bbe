"""The mmap provider against the shared conformance suite, with backdoors that read and damage
the slot files directly (not through the provider's read path)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import xxhash

from hostkv_providers._keys import Key
from hostkv_providers._provider import Provider
from hostkv_providers.providers._slotfile import FLAG_ANCHOR, SLOT_MAGIC, SlotFile, header_checksums_ok
from hostkv_providers.providers.mmap._provider import MmapProvider
from hostkv_providers.testing import ProviderTests


def locate(store: str, key: bytes) -> tuple[str, int, int] | None:
    """(data file, byte offset, nbytes) of ``key``'s page, found by scanning slot headers."""
    best: tuple[int, str, int, int] | None = None
    for name in sorted(os.listdir(store)):
        if not name.endswith(".slots"):
            continue
        sf = SlotFile.open(os.path.join(store, name), writable=False)
        try:
            h = sf.headers()
            ok = header_checksums_ok(h) & (h["magic"] == SLOT_MAGIC) & ((h["flags"] & FLAG_ANCHOR) == 0)
            hit = np.flatnonzero(ok & (h["key"] == np.frombuffer(key, "V32")[0]))
            for slot in hit.tolist():
                nbytes = int(h["nbytes"][slot])
                data = bytes(sf.data(slot, nbytes))
                if xxhash.xxh3_64_intdigest(data) != int(h["checksum"][slot]):
                    continue
                gen = int(h["generation"][slot])
                if best is None or gen > best[0]:
                    best = (gen, sf.path, sf.data_offset_of(slot), nbytes)
        finally:
            sf.close()
    return None if best is None else best[1:]


class TestMmapConformance(ProviderTests):
    supports_reopen = True

    def make_provider(self, tmp_path: Path, budget_bytes: int) -> Provider:
        return MmapProvider(str(tmp_path / "store"), budget_bytes=budget_bytes, slot_nbytes=self.page_nbytes)

    def reopen(self, provider: Provider) -> Provider:
        assert isinstance(provider, MmapProvider)
        path, budget = provider.path, provider.budget_bytes
        provider.close()
        return MmapProvider(path, budget_bytes=budget)

    def backdoor_read(self, provider: Provider, key: Key) -> bytes | None:
        assert isinstance(provider, MmapProvider)
        if not provider.present([key])[0]:
            return None
        where = locate(provider.path, key)
        if where is None:
            return None
        path, offset, nbytes = where
        fd = os.open(path, os.O_RDONLY)
        try:
            return os.pread(fd, nbytes, offset)
        finally:
            os.close(fd)

    def backdoor_corrupt(self, provider: Provider, key: Key) -> None:
        assert isinstance(provider, MmapProvider)
        where = locate(provider.path, key)
        assert where is not None, "backdoor_corrupt: key not on the medium"
        path, offset, nbytes = where
        fd = os.open(path, os.O_RDWR)
        try:
            pos = offset + nbytes // 2
            b = os.pread(fd, 1, pos)
            os.pwrite(fd, bytes([b[0] ^ 0x5A]), pos)
        finally:
            os.close(fd)
