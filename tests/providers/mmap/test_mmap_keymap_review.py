"""A reopened mmap store looks keys up in a key map sorted by their first 8 bytes; numpy searched
that uint64 array with a Python int as float64, whose 53 bits drop the low bits, so keys whose
first 8 bytes differ only there (byte 0, part of byte 1) read as absent after a reopen — stored,
listed by iter_entries and counted, but not found (found by a review helper; fails before)."""

from __future__ import annotations

from pathlib import Path

from hostkv_providers.providers import MmapProvider

PAGE = 4096


def _key(i: int, at: int) -> bytes:
    b = bytearray(b"\x05" * 32)
    b[at] = i
    return bytes(b)


def _open(path: Path) -> MmapProvider:
    return MmapProvider(str(path), budget_bytes=64 * PAGE, slot_nbytes=PAGE, file_nbytes=64 * PAGE)


def test_keys_differing_in_their_low_bytes_are_found_after_a_reopen(tmp_path: Path) -> None:
    keys = [_key(i, 0) for i in range(5)] + [_key(i, 1) for i in range(6, 9)]
    p = _open(tmp_path / "s")
    for i, k in enumerate(keys):
        assert p.put(k, None, bytes([i]) * PAGE)
    p.close()
    p = _open(tmp_path / "s")
    try:
        assert p.stats().entries == len(keys)
        for i, k in enumerate(keys):  # one at a time: the single-key lookup
            assert p.present([k]) == [True], i
            assert p.read_bytes(k) == bytes([i]) * PAGE
        # evicting one after the reopen takes that one out of the key map, no other
        assert p.evict([keys[3]]).entries == 1
        assert [p.present([k])[0] for k in keys] == [i != 3 for i in range(len(keys))]
    finally:
        p.close()
    p = _open(tmp_path / "s")
    try:
        assert p.present(keys) == [i != 3 for i in range(len(keys))]
    finally:
        p.close()
