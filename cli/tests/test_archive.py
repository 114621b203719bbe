"""``hostkv export`` / ``hostkv import``: round trips between providers, selection, dedup,
identity, and hostile archives (bombs, truncation, bit flips) ending in typed errors."""

from __future__ import annotations

import io
import json
import struct
from pathlib import Path

import hostkv_providers as hk
import msgpack
import numpy as np
import pytest
from click.testing import CliRunner

from hostkv_cli import _archive as A
from hostkv_cli._synth import page_bytes

from .conftest import LAYOUT, SALT_A, SALT_B, fill, invoke, usable

PINNED = "pinned://?budget=16MiB&block=16KiB"


def _persistent(tmp_path: Path) -> list[str]:
    urls = []
    for scheme in ("lmdb", "mmap"):
        if usable(scheme, "persistent"):
            urls.append(f"{scheme}://{tmp_path / scheme}?budget=16MiB")
    return urls


def _export(src: hk.Provider, **select: object) -> bytes:
    buf = io.BytesIO()
    keys = A.select_keys(src, **select)  # type: ignore[arg-type]
    A.export_archive(src, buf, keys)
    return buf.getvalue()


def _same_entries(src: hk.Provider, dst: hk.Provider, keys: list[hk.Key]) -> None:
    for k in keys:
        want = src.read_bytes(k)
        assert want is not None and dst.read_bytes(k) == want
        assert dst.entry(k).salt_tag == src.entry(k).salt_tag  # type: ignore[union-attr]
        assert dst.list_anchors(k) == src.list_anchors(k)
        for name in src.list_anchors(k):
            assert dst.get_anchor(k, name) == src.get_anchor(k, name)


def test_round_trip_across_providers_with_dedup(tmp_path: Path) -> None:
    """pinned -> every persistent provider -> pinned, byte for byte; a second import dedups."""
    urls = _persistent(tmp_path)
    assert urls, "no persistent provider usable"
    with hk.open(PINNED) as src:
        f = fill(src)
        data = _export(src, salt_tags=[SALT_A.tag, SALT_B.tag])
        for url in urls:
            with hk.open(url) as dst:
                rep = A.import_archive(dst, io.BytesIO(data))
                assert rep["imported"] == len(f.keys) and rep["dedup"] == 0 and rep["anchors"] == 3
                again = A.import_archive(dst, io.BytesIO(data))
                assert again["imported"] == 0 and again["dedup"] == len(f.keys) and again["anchors"] == 0
            with hk.open(url) as dst:  # reopened: it was made durable, and re-exports the same
                _same_entries(src, dst, f.keys)
                data2 = _export(dst, salt_tags=[SALT_A.tag, SALT_B.tag])
            with hk.open(PINNED) as back:
                A.import_archive(back, io.BytesIO(data2))
                _same_entries(src, back, f.keys)


def test_selection_by_salt_chain_and_descendants() -> None:
    with hk.open(PINNED) as src:
        f = fill(src)
        a, fork = f.chains["a"], f.chains["fork"]
        # by salt tag: exactly salt B's chain
        with hk.open(PINNED) as dst:
            A.import_archive(dst, io.BytesIO(_export(src, salt_tags=[SALT_B.tag])))
            assert dst.stats().entries == len(f.chains["b"])
        # by chain: the root down to the key (ancestors always come along)
        with hk.open(PINNED) as dst:
            A.import_archive(dst, io.BytesIO(_export(src, keys=[a[5]])))
            assert dst.stats().entries == 6 and dst.longest_prefix(a) == 6
        # with descendants: the fork's shared prefix brings both branches
        with hk.open(PINNED) as dst:
            shared = len(a) // 2
            A.import_archive(dst, io.BytesIO(_export(src, keys=[a[shared - 1]], descendants=True)))
            assert dst.longest_prefix(a) == len(a) and dst.longest_prefix(fork) == len(fork)
            assert dst.stats().entries == len(a) + len(fork) - shared
        with pytest.raises(Exception, match="not stored"):
            A.select_keys(src, keys=[hk.Key(b"\x01" * 32)])


def test_identity_salt_mismatch_refused_before_writing() -> None:
    with hk.open(PINNED) as src:
        fill(src)
        data = _export(src, salt_tags=[SALT_A.tag, SALT_B.tag])
    with hk.open(PINNED) as dst:
        with pytest.raises(A.ArchiveIdentityError, match="not the expected"):
            A.import_archive(dst, io.BytesIO(data), expect_salts=[SALT_A.tag])
        assert dst.stats().entries == 0
        ok = A.import_archive(dst, io.BytesIO(data), expect_salts=[SALT_A.tag, SALT_B.tag])
        assert ok["imported"] == dst.stats().entries > 0


def test_key_stored_under_another_salt_tag_is_refused() -> None:
    with hk.open(PINNED) as src:
        f = fill(src)
        data = _export(src, keys=[f.chains["b"][0]])
    with hk.open(PINNED) as dst:
        k = f.chains["b"][0]
        dst.put(k, None, page_bytes(k, LAYOUT.page_nbytes), salt_tag="someone-else")
        with pytest.raises(A.ArchiveIdentityError, match="someone-else"):
            A.import_archive(dst, io.BytesIO(data))


# ---------------------------------------------------------------------------------------------
# hostile archives
# ---------------------------------------------------------------------------------------------


def _small_archive() -> tuple[bytes, list[hk.Key], dict[bytes, bytes]]:
    with hk.open(PINNED) as src:
        f = fill(src, pages=6)
        data = _export(src, salt_tags=[SALT_A.tag, SALT_B.tag])
        truth = {bytes(k): src.read_bytes(k) for k in f.keys}
    return data, f.keys, truth  # type: ignore[return-value]


def _forge(raw_len: int, payload: bytes, *, max_entry: int = 1 << 20, flags: int = A.F_ZSTD) -> bytes:
    """An archive with one entry record whose digest is right but whose sizes lie."""
    head = msgpack.packb({"format": 1, "salt_tags": ["t"], "entries": 1, "raw_bytes": raw_len,
                          "max_entry_nbytes": max_entry, "shuffle": 1}, use_bin_type=True)
    out = A.MAGIC + struct.pack("<I", len(head)) + head + A._digest(head)
    meta = msgpack.packb({"k": b"\x02" * 32, "p": None, "t": "t", "n": raw_len}, use_bin_type=True)
    rec = A._REC.pack(A.K_ENTRY, flags, 0, len(meta), len(payload), raw_len)
    return out + rec + meta + payload + A._digest(rec, meta, b"")


def _zstd_frame_declaring(content_size: int, actual: int) -> bytes:
    """A valid-looking zstd frame that declares ``content_size`` bytes but holds one RLE block
    of ``actual`` bytes (a ~20-byte "bomb": decompress() would allocate the declared size)."""
    fhd = 0b1110_0000  # 8-byte frame content size, single segment, no checksum, no dictionary
    block = (actual << 3) | (1 << 1) | 1  # last block, RLE
    return (struct.pack("<I", 0xFD2FB528) + bytes([fhd]) + struct.pack("<Q", content_size)
            + block.to_bytes(3, "little") + b"\x00")


def test_zstd_bomb_refused_before_decompressing(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_decompress(*a: object, **k: object) -> bytes:
        raise AssertionError("decompress() reached for a frame whose declared size was not checked")

    frame = _zstd_frame_declaring(4 << 30, 1024)
    assert A.zstandard.frame_content_size(frame) == 4 << 30
    monkeypatch.setattr(A.zstandard.ZstdDecompressor, "decompress", no_decompress)
    with hk.open(PINNED) as dst:
        # the frame lies about its size relative to the record
        with pytest.raises(A.CorruptArchiveError, match="declares 4294967296 bytes"):
            A.import_archive(dst, io.BytesIO(_forge(1024, frame)))
        # the record itself declares more than the header's bound
        with pytest.raises(A.CorruptArchiveError, match="bounds"):
            A.import_archive(dst, io.BytesIO(_forge((4 << 30) - 1, frame)))
        # the header declares entries above the absolute bound
        with pytest.raises(A.CorruptArchiveError, match="bound"):
            A.import_archive(dst, io.BytesIO(_forge(1024, frame, max_entry=1 << 40)))
        # a frame without a declared size is never decompressed either
        unsized = A.zstandard.ZstdCompressor(write_content_size=False).compress(b"x" * 1024)
        with pytest.raises(A.CorruptArchiveError, match="declares -1 bytes"):
            A.import_archive(dst, io.BytesIO(_forge(1024, unsized)))
        assert dst.stats().entries == 0


def test_oversized_lengths_refused_before_reading() -> None:
    good, _, _ = _small_archive()
    with hk.open(PINNED) as dst:
        huge_header = A.MAGIC + struct.pack("<I", 0xFFFFFFFF)
        with pytest.raises(A.CorruptArchiveError, match="header length"):
            A.import_archive(dst, io.BytesIO(huge_header))
        with pytest.raises(A.CorruptArchiveError, match="bad magic"):
            A.import_archive(dst, io.BytesIO(b"PK\x03\x04" + good[4:]))


def test_truncated_archives_are_typed_and_import_only_verified_entries() -> None:
    data, _, truth = _small_archive()
    cuts = sorted({*range(0, 40, 3), *np.linspace(40, len(data) - 1, 40).astype(int).tolist(), len(data) - 1})
    for cut in cuts:
        with hk.open(PINNED) as dst:
            with pytest.raises(A.TruncatedArchiveError):
                A.import_archive(dst, io.BytesIO(data[:cut]))
            for k, want in truth.items():  # whatever was imported is exactly the source's bytes
                got = dst.read_bytes(hk.Key(k))
                assert got is None or got == want


def test_bit_flips_are_detected_and_never_import_wrong_bytes() -> None:
    data, _, truth = _small_archive()
    rng = np.random.default_rng(19)
    for pos in rng.integers(0, len(data), 150):
        bad = bytearray(data)
        bad[pos] ^= 1 << int(rng.integers(0, 8))
        with hk.open(PINNED) as dst:
            with pytest.raises(A.CorruptArchiveError):
                A.import_archive(dst, io.BytesIO(bytes(bad)))
            for k, want in truth.items():
                got = dst.read_bytes(hk.Key(k))
                assert got is None or got == want, f"wrong bytes imported after a flip at {pos}"


def test_spliced_archive_fails_the_total_digest() -> None:
    """Dropping a whole (valid) record is caught by the end record's counts and total."""
    with hk.open(PINNED) as src:
        f = fill(src, pages=3)
        keys = A.select_keys(src, keys=[f.chains["b"][-1]])
        whole = io.BytesIO()
        A.export_archive(src, whole, keys)
    data = whole.getvalue()
    # find the last entry record (before the anchor and end records) by walking the format
    f_in = io.BytesIO(data)
    A.read_header(f_in)
    starts = []
    while True:
        starts.append(f_in.tell())
        kind, _, _, ml, cl, _ = A._REC.unpack(f_in.read(A._REC.size))
        f_in.seek(ml + cl + A._DIGEST, 1)
        if kind == A.K_END:
            break
    # remove the first entry's child (second record): the parent check or the counts catch it
    spliced = data[: starts[1]] + data[starts[2]:]
    with hk.open(PINNED) as dst, pytest.raises(A.CorruptArchiveError):
        A.import_archive(dst, io.BytesIO(spliced))


# ---------------------------------------------------------------------------------------------
# the commands
# ---------------------------------------------------------------------------------------------


def test_cli_export_import_round_trip(runner: CliRunner, tmp_path: Path) -> None:
    urls = _persistent(tmp_path)
    if len(urls) < 2:
        pytest.skip("needs lmdb and mmap")
    src_url, dst_url = urls
    with hk.open(src_url) as src:
        f = fill(src)
    arc = tmp_path / "a.hkv"
    bare = src_url.split("?")[0]  # export opens the source read-only: no budget= there
    r = invoke(runner, "export", "--json", bare, str(arc), "--salt", SALT_A.tag)
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["entries"] == len(set(f.chains["a"]) | set(f.chains["fork"])) and doc["salt_tags"] == [SALT_A.tag]
    r = invoke(runner, "import", str(arc), dst_url, "--expect-salt", SALT_B.tag)
    assert r.exit_code == 4 and "not the expected" in r.output
    assert not (tmp_path / dst_url.split("://")[1].split("?")[0]).exists()  # refused before creating it
    r = invoke(runner, "import", "--json", str(arc), dst_url, "--expect-salt", SALT_A.tag)
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["imported"] == doc["entries"]
    r = invoke(runner, "import", "--dry-run", str(arc), dst_url.split("?")[0])
    assert r.exit_code == 0 and "archive ok" in r.output
    with hk.open(src_url) as src, hk.open(dst_url) as dst:
        _same_entries(src, dst, [*f.chains["a"], *f.chains["fork"]])
    # a damaged archive: exit 1 (integrity), no traceback; nothing matched: exit 2
    bad = bytearray(arc.read_bytes())
    bad[len(bad) // 2] ^= 0x40
    (tmp_path / "bad.hkv").write_bytes(bytes(bad))
    r = invoke(runner, "import", "--allow-ephemeral", str(tmp_path / "bad.hkv"), "pinned://?budget=16MiB")
    assert r.exit_code == 1 and "error:" in r.output
    r = invoke(runner, "export", bare, str(tmp_path / "none.hkv"), "--salt", "nosuch")
    assert r.exit_code == 2 and "nothing matched" in r.output and not (tmp_path / "none.hkv").exists()


def test_cli_review_edges(runner: CliRunner, tmp_path: Path) -> None:
    """A review's findings (session 24), each reproduced before its fix: two archives concatenated
    imported the first's entries only and said ok; export into a missing directory and a keys
    file that is not text were internal errors (exit 5); demo's --tokens had no bound."""
    urls = _persistent(tmp_path)
    if len(urls) < 2:
        pytest.skip("needs lmdb and mmap")
    src_url, dst_url = urls
    with hk.open(src_url) as src:
        fill(src)
    bare = src_url.split("?")[0]
    a, b = tmp_path / "a.hkv", tmp_path / "b.hkv"
    assert invoke(runner, "export", bare, str(a), "--salt", SALT_A.tag).exit_code == 0
    assert invoke(runner, "export", bare, str(b), "--salt", SALT_B.tag).exit_code == 0
    both = tmp_path / "both.hkv"
    both.write_bytes(a.read_bytes() + b.read_bytes())
    for args in (("import", str(both), dst_url), ("import", "--dry-run", str(both), dst_url.split("?")[0])):
        r = invoke(runner, *args)
        assert r.exit_code == 1 and "end record" in r.output, r.output
    r = invoke(runner, "export", bare, str(tmp_path / "no" / "such" / "x.hkv"), "--salt", SALT_A.tag)
    assert r.exit_code == 2 and "cannot write" in r.output
    keys = tmp_path / "keys.bin"
    keys.write_bytes(b"\xff\xfe\x00garbage\n")
    r = invoke(runner, "export", bare, str(tmp_path / "k.hkv"), "--keys-file", str(keys))
    assert r.exit_code == 2 and "must be text" in r.output
    r = invoke(runner, "demo", "--tokens", "99999999999999")
    assert r.exit_code == 2
