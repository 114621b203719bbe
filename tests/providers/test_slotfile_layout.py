"""Slot file layout version 2: the data region starts aligned to the slot size's largest
power-of-two divisor (at most 2 MiB), so every slot is naturally aligned in the file and the page
cache can hold it in large folios (issue 14 item 8: writes into cached slots at a 4 KiB-aligned
offset measured 67-73 ms per 256 MiB against 54 ms aligned).  Version 1 files, written by every
earlier build, still open, read and take writes; a version this build does not know, or an
offset that disagrees with the header's version, is refused with a typed error."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import xxhash

import hostkv_providers as hk
from hostkv_providers.errors import CorruptStoreError, IncompatibleStoreError
from hostkv_providers.providers import _slotfile
from hostkv_providers.providers._slotfile import FILE_HEADER_DTYPE, SlotFile
from hostkv_providers.testing import chain, page_bytes, put_chain

STORE = b"s" * 16
MiB = 1 << 20


@pytest.mark.parametrize(("slot", "count", "align"), [
    (256 << 10, 1088, 256 << 10),  # the bench_io geometry: 140 KiB of headers -> 256 KiB
    (2 * MiB, 2100, 2 * MiB),  # 2 MiB KV pages: PMD-aligned
    (4 * MiB, 8, 2 * MiB),  # capped at 2 MiB (no folio is larger)
    (12 << 10, 100, 4096),  # 12 KiB = 3 x 4 KiB: 4 KiB, as in version 1
    (16 << 10, 5, 16 << 10),
])
def test_new_files_align_every_slot(tmp_path: Path, slot: int, count: int, align: int) -> None:
    f = SlotFile.create(str(tmp_path / "f.slots"), slot_nbytes=slot, slot_count=count, file_id=1, store_id=STORE)
    try:
        assert f.data_offset % align == 0
        # the header table fits, and no more than one alignment unit is spent on padding
        table_end = _slotfile.FILE_HEADER_NBYTES + count * _slotfile.SLOT_HEADER_NBYTES
        assert table_end <= f.data_offset < table_end + align
        assert all(f.data_offset_of(s) % align == 0 for s in (0, 1, count - 1))
        data = np.random.default_rng(0).bytes(slot)
        f.write(count - 1, slot, 0, data)
        assert bytes(f.data(count - 1, slot)) == data
    finally:
        f.close()
    g = SlotFile.open(str(tmp_path / "f.slots"), writable=False, store_id=STORE)
    try:
        assert g.data_offset == f.data_offset
    finally:
        g.close()


def _rewrite_header(path: Path, **fields: int) -> None:
    raw = bytearray(path.read_bytes()[:128])
    hdr = np.frombuffer(bytes(raw), FILE_HEADER_DTYPE).copy()
    for name, value in fields.items():
        hdr[name] = value
    raw = bytearray(hdr.tobytes())
    raw[120:128] = xxhash.xxh3_64_intdigest(bytes(raw[:120])).to_bytes(8, "little")
    with open(path, "r+b") as fh:
        fh.write(raw)


def test_unknown_versions_and_mismatched_offsets_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "f.slots"
    SlotFile.create(str(path), slot_nbytes=256 << 10, slot_count=64, file_id=1, store_id=STORE).close()
    _rewrite_header(path, layout_version=3)
    with pytest.raises(IncompatibleStoreError, match="layout version 3"):
        SlotFile.open(str(path), writable=False)
    # version 1 claimed, but the data region is where version 2 puts it: not a file anyone wrote
    _rewrite_header(path, layout_version=1)
    with pytest.raises(CorruptStoreError, match="data offset"):
        SlotFile.open(str(path), writable=False)


def test_version_1_stores_still_read_and_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A store whose slot files an earlier build wrote (version 1, 4 KiB-aligned data): this
    build reads every page and writes new ones into the old files, which keep version 1."""
    page = 256 << 10
    url = f"mmap://{tmp_path / 's'}?budget=8MiB&slot=256KiB"
    keys = chain("layout/v1", 20)
    with monkeypatch.context() as m:
        m.setattr(_slotfile, "FILE_LAYOUT_VERSION", 1)
        with hk.open(url) as p:
            put_chain(p, keys[:10], page)
    (data_file,) = (tmp_path / "s").glob("data.*.slots")
    hdr = np.frombuffer(data_file.read_bytes()[:128], FILE_HEADER_DTYPE)
    assert int(hdr["layout_version"][0]) == 1
    legacy_offset = int(hdr["data_offset"][0])
    assert legacy_offset % (256 << 10) != 0  # really the old, unaligned layout
    with hk.open(url) as p:
        assert [p.read_bytes(k) for k in keys[:10]] == [page_bytes(k, page) for k in keys[:10]]
        put_chain(p, keys[10:], page, parent=keys[9])
    with hk.open(url) as p:
        assert [p.read_bytes(k) for k in keys] == [page_bytes(k, page) for k in keys]
    hdr = np.frombuffer(data_file.read_bytes()[:128], FILE_HEADER_DTYPE)
    assert (int(hdr["layout_version"][0]), int(hdr["data_offset"][0])) == (1, legacy_offset)
