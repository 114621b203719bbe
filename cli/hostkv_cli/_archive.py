"""``hostkv export`` / ``hostkv import``: a portable, checksummed archive of part of a store.

An archive carries chosen entries (by salt tag, by the chain up to a key, by a list of keys),
always closed under ancestors and written parents first, so any provider can import it: the
destination refuses an entry whose parent is not sealed.

Format (version 1; every integer little-endian)::

    MAGIC    8 bytes  b"HKVARC\\x00\\x01"
    HEADER   u32 n | msgpack map (n <= 1 MiB) | xxh3-128 of the map (16 bytes)
    RECORD*  kind u8 | flags u8 | reserved u16 | meta_len u32 | comp_len u32 | raw_len u32
             | msgpack meta (meta_len) | payload (comp_len) | xxh3-128 (16 bytes) of
             the 16 header bytes + meta + the *decompressed* payload
    END      a record of kind "Z" whose meta holds the counts and the xxh3-128 of all record
             digests: a truncated archive has no END, a spliced one fails the total digest

Kinds: ``E`` entry (meta: key, parent, salt tag, nbytes; payload: the page bytes), ``A`` anchor
of the entry before it (meta: key, name; payload: the blob), ``Z`` end.  Payloads are one zstd
frame each (flag bit 0) that declares its content size, optionally byte-shuffled (flag bit 1,
element width in the header: the high bytes of bf16/fp16 values, mostly exponent, compress far
better grouped together).

Reading is bounded (RELIABILITY S2): every length is checked against its limit before anything
is allocated or read, and a zstd frame's *declared* content size must equal the record's
``raw_len`` (itself bounded by the header's largest entry) before it is decompressed: a frame of
40 bytes may declare 4 GiB, and ``decompress`` would allocate that whatever ``max_output_size``
says.  Every defect is a typed :class:`ArchiveError`; nothing is written to the destination
from a record before its digest matched.
"""

from __future__ import annotations

import os
import struct
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO

import click
import hostkv_providers as hk
import msgpack
import numpy as np
import xxhash
import zstandard

from . import __version__
from ._copy import refuse_ephemeral
from ._exits import CLIError, ExitCode
from ._format import emit_json, fmt_size, json_option
from ._store import Forest, open_store, progress_bar, require_iterate

__all__ = [
    "ArchiveError",
    "ArchiveIdentityError",
    "CorruptArchiveError",
    "TruncatedArchiveError",
    "export_archive",
    "import_archive",
    "read_archive",
    "register",
    "select_keys",
]

MAGIC = b"HKVARC\x00\x01"
FORMAT_VERSION = 1
_REC = struct.Struct("<BBHIII")  # kind, flags, reserved, meta_len, comp_len, raw_len
_DIGEST = 16
#: bounds checked before reading (S2)
MAX_HEADER_NBYTES = 1 << 20
MAX_META_NBYTES = 64 << 10
MAX_ENTRY_NBYTES = 1 << 30  # a page of every layer of a very large model is well below
MAX_ANCHOR_NBYTES = 256 << 20
F_ZSTD = 1
F_SHUFFLE = 2
K_ENTRY, K_ANCHOR, K_END = ord("E"), ord("A"), ord("Z")

Progress = Callable[[int, int], None]


class ArchiveError(hk.HostKVError):
    """An archive that cannot be imported (root of the archive errors).  The subclasses also
    derive from the store errors of the same meaning, so the CLI's exit codes follow: a damaged
    archive exits 1 (integrity), a foreign one 4 (refused)."""

    default_hint = "export the archive again from its source store"


class CorruptArchiveError(ArchiveError, hk.CorruptStoreError):
    """A record fails its checksum, bounds or structure (bit flips, a foreign or hostile file)."""


class TruncatedArchiveError(CorruptArchiveError):
    """The archive ends before its end record (an interrupted export or copy)."""

    default_hint = "the file is incomplete: copy or export it again"


class ArchiveIdentityError(ArchiveError, hk.errors.IncompatibleStoreError):
    """The archive's salt tags are not the ones the import expects, or a key already in the
    destination is stored under another salt tag."""

    default_hint = "import only archives made for this model configuration (check --expect-salt)"


def _digest(*parts: bytes | bytearray | memoryview) -> bytes:
    h = xxhash.xxh3_128()
    for part in parts:
        h.update(part)
    return h.digest()


def _shuffle(data: bytes | bytearray | memoryview, width: int) -> bytes:
    """Group byte j of every ``width``-byte element together (plane j at j * n / width).
    One strided copy per plane: 2x faster than a transpose's ``tobytes``."""
    a = np.frombuffer(data, dtype=np.uint8)
    out = np.empty_like(a)
    planes = out.reshape(width, -1)
    for j in range(width):
        planes[j] = a[j::width]
    return out.tobytes()


def _unshuffle(data: bytes, width: int) -> bytes:
    planes = np.frombuffer(data, dtype=np.uint8).reshape(width, -1)
    out = np.empty((planes.shape[1], width), dtype=np.uint8)
    for j in range(width):
        out[:, j] = planes[j]
    return out.tobytes()


# --------------------------------------------------------------------------------------------
# selection
# --------------------------------------------------------------------------------------------


def select_keys(src: hk.Provider, *, salt_tags: Sequence[str] = (), keys: Sequence[bytes] = (),
                descendants: bool = False) -> list[bytes]:
    """The keys to export, closed under ancestors, parents first.

    ``salt_tags`` selects every entry of those tags (needs ``iterate``); each key of ``keys``
    brings the chain from its root down to it (and, with ``descendants``, its whole subtree).
    A key not stored is a :class:`CLIError` (exit 2): an archive never silently lacks a page
    that was asked for.
    """
    forest: Forest | None = None
    if salt_tags or descendants:
        forest = Forest(list(require_iterate(src, "export --salt/--descendants").iter_entries()))
    chosen: set[bytes] = set()
    if forest is not None and salt_tags:
        want = set(salt_tags)
        chosen.update(k for k, e in forest.entries.items() if e.salt_tag in want)
    for k in keys:
        info = src.entry(k)
        if info is None:
            raise CLIError(f"key {k.hex()} is not stored", hint="see `hostkv ls`")
        if descendants and forest is not None:
            chosen.update(forest.subtree_keys(k))
        chosen.add(bytes(k))
    # close under ancestors, walking parents through the public per-key lookup
    todo = list(chosen)
    parents: dict[bytes, bytes | None] = {}
    while todo:
        k = todo.pop()
        if k in parents:
            continue
        info = forest.entries.get(k) if forest is not None else None
        if info is None:
            info = src.entry(k)
        if info is None:  # evicted meanwhile: its subtree cannot be imported either
            raise CLIError(f"entry {k.hex()} disappeared while the export was prepared",
                           ExitCode.BUSY, hint="run the export again")
        p = None if info.parent is None or bytes(info.parent) == bytes(hk.ZERO_KEY) else bytes(info.parent)
        parents[k] = p
        if p is not None and p not in parents:
            todo.append(p)
    # parents first: depth order (a key's depth = its parent's + 1)
    depth: dict[bytes, int] = {}

    def _depth(k: bytes) -> int:
        chain = []
        while k not in depth:
            chain.append(k)
            p = parents[k]
            if p is None:
                depth[k] = 0
                chain.pop()
                break
            k = p
        base = depth[k]
        for i, c in enumerate(reversed(chain)):
            depth[c] = base + i + 1
        return depth[chain[0]] if chain else base

    for k in parents:
        _depth(k)
    return sorted(parents, key=lambda k: (depth[k], k))


# --------------------------------------------------------------------------------------------
# export
# --------------------------------------------------------------------------------------------


class _Writer:
    def __init__(self, out: BinaryIO, level: int, shuffle: int) -> None:
        self.out = out
        self.cctx = zstandard.ZstdCompressor(level=level, write_content_size=True, write_checksum=False)
        self.shuffle = shuffle
        self.total = xxhash.xxh3_128()
        self.nbytes = 0

    def record(self, kind: int, meta: dict[str, Any], raw: bytes | bytearray | memoryview, *,
               compress: bool = True) -> None:
        meta_b = msgpack.packb(meta, use_bin_type=True)
        flags = 0
        payload: bytes | bytearray | memoryview = raw
        if compress and len(raw):
            body = raw
            if self.shuffle > 1 and len(raw) % self.shuffle == 0:
                body = _shuffle(raw, self.shuffle)
                flags |= F_SHUFFLE
            payload = self.cctx.compress(body)
            flags |= F_ZSTD
        head = _REC.pack(kind, flags, 0, len(meta_b), len(payload), len(raw))
        digest = _digest(head, meta_b, raw)
        self.total.update(digest)
        for part in (head, meta_b, payload, digest):
            self.out.write(part)
        self.nbytes += len(head) + len(meta_b) + len(payload) + _DIGEST


def export_archive(src: hk.Provider, out: BinaryIO, keys: Sequence[bytes], *, level: int = 1,
                   shuffle: int = 1, progress: Progress | None = None) -> dict[str, Any]:
    """Write the entries ``keys`` (parents first, e.g. from :func:`select_keys`) and their
    anchors to ``out``.  Returns counters.  Entries the source cannot read back intact (a
    checksum failure is a miss) are a :class:`CLIError` with exit 1: an archive is all or
    nothing."""
    if shuffle not in (1, 2, 4, 8):
        raise CLIError(f"--shuffle must be 1, 2, 4 or 8, got {shuffle}")
    infos = []
    for k in keys:
        info = src.entry(k)
        if info is None:
            raise CLIError(f"entry {k.hex()} disappeared during the export", ExitCode.BUSY,
                           hint="run the export again")
        infos.append(info)
    tags = sorted({i.salt_tag for i in infos})
    header = {
        "format": FORMAT_VERSION, "tool": f"hostkv-cli {__version__}", "created": time.time(),
        "source": src.name, "salt_tags": tags, "entries": len(infos),
        "raw_bytes": sum(i.nbytes for i in infos),
        "max_entry_nbytes": max((i.nbytes for i in infos), default=0),
        "shuffle": shuffle, "level": level,
    }
    head_b = msgpack.packb(header, use_bin_type=True)
    out.write(MAGIC + struct.pack("<I", len(head_b)) + head_b + _digest(head_b))
    w = _Writer(out, level, shuffle)
    w.nbytes = len(MAGIC) + 4 + len(head_b) + _DIGEST
    buf = bytearray()
    anchors = 0
    anchor_bytes = 0
    t0 = time.perf_counter()
    # No lease: the source is open read-only (a lease is a write on persistent stores); an
    # entry evicted meanwhile reads as a miss and stops the export.
    for i, info in enumerate(infos):
        if len(buf) != info.nbytes:
            buf = bytearray(info.nbytes)
        if not src.read(info.key, buf):
            raise CLIError(f"entry {bytes(info.key).hex()} could not be read back intact "
                           "(corrupt or evicted); nothing of it was exported", ExitCode.INTEGRITY,
                           hint="run `hostkv verify` on the source")
        parent = None if info.parent is None or bytes(info.parent) == bytes(hk.ZERO_KEY) else bytes(info.parent)
        w.record(K_ENTRY, {"k": bytes(info.key), "p": parent, "t": info.salt_tag, "n": info.nbytes}, buf)
        for name in sorted(info.anchors):
            blob = src.get_anchor(info.key, name)
            if blob is None:
                continue
            w.record(K_ANCHOR, {"k": bytes(info.key), "a": name}, blob)
            anchors += 1
            anchor_bytes += len(blob)
        if progress is not None:
            progress(i + 1, len(infos))
    seconds = time.perf_counter() - t0
    w.record(K_END, {"entries": len(infos), "anchors": anchors, "total": w.total.digest()}, b"", compress=False)
    raw = sum(i.nbytes for i in infos) + anchor_bytes
    return {"entries": len(infos), "anchors": anchors, "salt_tags": tags, "raw_bytes": raw,
            "archive_bytes": w.nbytes, "ratio": raw / w.nbytes if w.nbytes else 0.0,
            "seconds": seconds}


# --------------------------------------------------------------------------------------------
# reading (bounded)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Record:
    """One verified record: its kind, its metadata and its decompressed bytes."""

    kind: str
    meta: dict[str, Any]
    data: bytes


def _read_exact(f: BinaryIO, n: int, what: str) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise TruncatedArchiveError(f"the archive ends inside {what} ({len(data)} of {n} bytes)")
    return data


def _unpack(data: bytes, what: str) -> dict[str, Any]:
    try:
        # bounded: the buffer was capped before it was read, and msgpack caps every length it
        # decodes at the buffer's size
        meta = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise CorruptArchiveError(f"{what} is not valid msgpack ({type(exc).__name__})") from None
    if not isinstance(meta, dict):
        raise CorruptArchiveError(f"{what} is not a map")
    return meta


def _field(meta: dict[str, Any], name: str, types: type | tuple[type, ...], what: str) -> Any:
    v = meta.get(name)
    if not isinstance(v, types) or (isinstance(v, bool) and types is int):
        raise CorruptArchiveError(f"{what}: field {name!r} is missing or has the wrong type")
    return v


def read_header(f: BinaryIO) -> dict[str, Any]:
    """Check the magic and the header's digest and bounds; return the header map."""
    magic = f.read(len(MAGIC))
    if magic != MAGIC:
        if len(magic) < len(MAGIC) and MAGIC.startswith(magic):
            raise TruncatedArchiveError("the archive ends inside its magic number")
        raise CorruptArchiveError("not a hostkv archive (bad magic number)",
                                  hint="give a file written by `hostkv export`")
    (n,) = struct.unpack("<I", _read_exact(f, 4, "the header length"))
    if n > MAX_HEADER_NBYTES:
        raise CorruptArchiveError(f"header length {n} exceeds the {MAX_HEADER_NBYTES}-byte bound")
    head_b = _read_exact(f, n, "the header")
    if _read_exact(f, _DIGEST, "the header digest") != _digest(head_b):
        raise CorruptArchiveError("the archive header fails its checksum")
    h = _unpack(head_b, "the header")
    fmt = _field(h, "format", int, "header")
    if fmt != FORMAT_VERSION:
        raise ArchiveIdentityError(f"archive format {fmt} is not supported (this hostkv reads {FORMAT_VERSION})",
                           hint="import it with the hostkv version that wrote it")
    tags = _field(h, "salt_tags", list, "header")
    if not all(isinstance(t, str) for t in tags):
        raise CorruptArchiveError("header: salt_tags must be strings")
    for name in ("entries", "raw_bytes", "max_entry_nbytes", "shuffle"):
        _field(h, name, int, "header")
    if not 0 <= h["max_entry_nbytes"] <= MAX_ENTRY_NBYTES:
        raise CorruptArchiveError(f"header declares entries of {h['max_entry_nbytes']} bytes "
                                  f"(bound {MAX_ENTRY_NBYTES})")
    if h["shuffle"] not in (1, 2, 4, 8):
        raise CorruptArchiveError(f"header: bad shuffle width {h['shuffle']}")
    return h


def read_archive(f: BinaryIO, header: dict[str, Any] | None = None) -> Iterator[Record]:
    """Yield the verified records of an archive (after :func:`read_header`), ending with the
    end record.  Raises :class:`CorruptArchiveError` / :class:`TruncatedArchiveError`."""
    h = read_header(f) if header is None else header
    dctx = zstandard.ZstdDecompressor()
    total = xxhash.xxh3_128()
    entries = anchors = 0
    tags = set(h["salt_tags"])
    while True:
        head = _read_exact(f, _REC.size, "a record header")
        kind, flags, reserved, meta_len, comp_len, raw_len = _REC.unpack(head)
        if kind not in (K_ENTRY, K_ANCHOR, K_END) or reserved or flags & ~(F_ZSTD | F_SHUFFLE):
            raise CorruptArchiveError(f"bad record header (kind {kind}, flags {flags}) after "
                                      f"{entries} entries")
        limit = {K_ENTRY: h["max_entry_nbytes"], K_ANCHOR: MAX_ANCHOR_NBYTES, K_END: 0}[kind]
        if meta_len > MAX_META_NBYTES or raw_len > limit:
            raise CorruptArchiveError(f"record declares {meta_len} metadata / {raw_len} payload bytes "
                                      f"(bounds {MAX_META_NBYTES} / {limit})")
        # a compressed frame is never much larger than its content; a raw one is exactly it
        comp_limit = raw_len + raw_len // 128 + 1024  # above ZSTD_COMPRESSBOUND
        if comp_len > comp_limit or (not flags & F_ZSTD and comp_len != raw_len):
            raise CorruptArchiveError(f"record payload of {comp_len} bytes for {raw_len} declared")
        meta_b = _read_exact(f, meta_len, "record metadata")
        payload = _read_exact(f, comp_len, "a record payload")
        digest = _read_exact(f, _DIGEST, "a record digest")
        if flags & F_ZSTD:
            try:
                declared = zstandard.frame_content_size(payload)
            except zstandard.ZstdError:
                raise CorruptArchiveError("a record payload is not a zstd frame") from None
            if declared != raw_len:  # -1 (unknown) included: never decompress an unbounded frame
                raise CorruptArchiveError(f"a zstd frame declares {declared} bytes, its record {raw_len}")
            try:
                data = dctx.decompress(payload, max_output_size=raw_len)
            except zstandard.ZstdError as exc:
                raise CorruptArchiveError(f"a record payload does not decompress ({exc})") from None
            if len(data) != raw_len:
                raise CorruptArchiveError(f"a record decompressed to {len(data)} bytes, {raw_len} declared")
            if flags & F_SHUFFLE:
                if raw_len % h["shuffle"]:
                    raise CorruptArchiveError("a shuffled record is not a whole number of elements")
                data = _unshuffle(data, h["shuffle"])
        else:
            data = payload
        if _digest(head, meta_b, data) != digest:
            raise CorruptArchiveError(f"record {entries + anchors + 1} fails its checksum "
                                      f"(after {entries} entries)")
        meta = _unpack(meta_b, "record metadata")
        if kind == K_END:
            if (meta.get("entries") != entries or meta.get("anchors") != anchors
                    or entries != h["entries"]):
                raise CorruptArchiveError(f"the end record counts {meta.get('entries')} entries / "
                                          f"{meta.get('anchors')} anchors, the archive holds {entries} / "
                                          f"{anchors} (header: {h['entries']})")
            # the end record's own digest is not part of the total it carries
            if meta.get("total") != total.digest():
                raise CorruptArchiveError("the archive's records do not add up to its total digest "
                                          "(records spliced, reordered or dropped)")
            if f.read(1):  # (two archives concatenated: the second's entries were dropped unsaid)
                raise CorruptArchiveError("bytes follow the archive's end record (archives concatenated, or "
                                          "trailing data)")
            yield Record("Z", meta, b"")
            return
        total.update(digest)
        key = _field(meta, "k", bytes, "record")
        if len(key) != 32:
            raise CorruptArchiveError("record: a key must be 32 bytes")
        if kind == K_ENTRY:
            parent = meta.get("p")
            if parent is not None and (not isinstance(parent, bytes) or len(parent) != 32):
                raise CorruptArchiveError("record: a parent must be 32 bytes or nil")
            tag = _field(meta, "t", str, "record")
            if tag not in tags:
                raise CorruptArchiveError(f"record: salt tag {tag!r} is not among the header's")
            if _field(meta, "n", int, "record") != raw_len:
                raise CorruptArchiveError("record: entry size does not match its payload")
            entries += 1
            yield Record("E", meta, data)
        else:
            _field(meta, "a", str, "record")
            anchors += 1
            yield Record("A", meta, data)


# --------------------------------------------------------------------------------------------
# import
# --------------------------------------------------------------------------------------------


def check_identity(h: dict[str, Any], expect_salts: Sequence[str]) -> None:
    """Refuse an archive (its header ``h``) holding salt tags other than ``expect_salts``."""
    if expect_salts:
        foreign = sorted(set(h["salt_tags"]) - set(expect_salts))
        if foreign:
            raise ArchiveIdentityError(
                f"the archive holds salt tag(s) {', '.join(foreign)}, not the expected "
                f"{', '.join(sorted(expect_salts))}; nothing was imported")


def import_archive(dst: hk.Provider, f: BinaryIO, *, expect_salts: Sequence[str] = (),
                   dry_run: bool = False, progress: Progress | None = None,
                   header: dict[str, Any] | None = None) -> dict[str, Any]:
    """Import an archive into ``dst``: parents first, keys already there skipped (dedup), every
    record verified before anything of it is written.

    ``expect_salts`` (the salt tags this destination's engine uses): an archive with any other
    tag is refused before anything is written (:class:`ArchiveIdentityError`).  A key already in
    ``dst`` under another salt tag is refused too.  ``dry_run`` verifies the whole archive
    without writing.
    """
    h = read_header(f) if header is None else header
    check_identity(h, expect_salts)
    imported = dedup = anchors = 0
    imported_bytes = 0
    last_key: bytes | None = None
    total = h["entries"]
    done = 0
    t0 = time.perf_counter()
    for rec in read_archive(f, h):
        if rec.kind == "Z":
            break
        if rec.kind == "A":
            if last_key is None or rec.meta["k"] != last_key:
                raise CorruptArchiveError("an anchor record does not follow its entry")
            if not dry_run and dst.list_anchors(last_key).get(rec.meta["a"]) != len(rec.data):
                dst.put_anchor(last_key, rec.meta["a"], rec.data)
                anchors += 1
            elif dry_run:
                anchors += 1
            continue
        key, parent, tag = rec.meta["k"], rec.meta["p"], rec.meta["t"]
        last_key = key
        done += 1
        if not dry_run:
            have = dst.entry(key)
            if have is not None:
                if have.salt_tag != tag:
                    raise ArchiveIdentityError(
                        f"key {key.hex()} is stored in the destination under salt tag "
                        f"{have.salt_tag!r}, the archive has {tag!r}")
                dedup += 1
            else:
                if parent is not None and dst.entry(parent) is None:
                    raise CorruptArchiveError(
                        f"entry {key.hex()} comes before its parent {parent.hex()} "
                        "(an archive lists parents first)")
                try:
                    res = dst.reserve(key, parent, len(rec.data), salt_tag=tag)
                except hk.errors.InFlightError:
                    if not dst.wait_sealed(key, 30.0):
                        raise
                    res = None
                if res is None:
                    dedup += 1
                else:
                    with res:
                        res.write(0, rec.data)
                    imported += 1
                    imported_bytes += len(rec.data)
        if progress is not None:
            progress(done, total)
    seconds = time.perf_counter() - t0
    return {"entries": h["entries"], "imported": imported, "imported_bytes": imported_bytes,
            "dedup": dedup, "anchors": anchors, "salt_tags": h["salt_tags"], "source": h.get("source"),
            "dry_run": dry_run, "seconds": seconds}


# --------------------------------------------------------------------------------------------
# commands
# --------------------------------------------------------------------------------------------


def _parse_key(text: str) -> bytes:
    t = text.strip().lower()
    if len(t) != 64 or any(c not in "0123456789abcdef" for c in t):
        raise CLIError(f"not a key: {text!r}", hint="give the 64 hex digits of a key (see `hostkv ls --json`)")
    return bytes.fromhex(t)


def register(group: click.Group) -> None:
    @group.command(name="export")
    @click.argument("url")
    @click.argument("archive", type=click.Path(dir_okay=False, allow_dash=True))
    @click.option("--salt", "salt_tags", multiple=True, metavar="TAG", help="Every entry of this salt tag; repeatable.")
    @click.option("--key", "key_hex", multiple=True, metavar="HEX",
                  help="The chain from its root down to this key (64 hex digits); repeatable.")
    @click.option("--keys-file", type=click.File("r"), help="A file of keys, one 64-hex key a line (like --key).")
    @click.option("--descendants", is_flag=True, help="With --key: also every entry below each key.")
    @click.option("--level", type=click.IntRange(1, 19), default=1, show_default=True,
                  help="zstd level (1: the best ratio on shuffled bf16 KV, and the fastest).")
    @click.option("--shuffle", type=click.Choice(["1", "2", "4"]), default="2", show_default=True,
                  help="Byte-shuffle width before compressing: 2 for bf16/fp16 KV, 1 for int8/fp8.")
    @json_option
    def export_cmd(url: str, archive: str, salt_tags: tuple[str, ...], key_hex: tuple[str, ...],
                   keys_file: Any, descendants: bool, level: int, shuffle: str, as_json: bool) -> None:
        """Write part of URL to ARCHIVE (a portable, checksummed, zstd-compressed file).

        Choose entries by salt tag, by chain (--key: the root down to that key), or both; the
        selection always includes every ancestor, so the archive imports into any store.
        ARCHIVE "-" writes to standard output.  URL is opened read-only.
        """
        keys = [_parse_key(k) for k in key_hex]
        if keys_file is not None:
            try:
                keys += [_parse_key(line) for line in keys_file if line.strip() and not line.startswith("#")]
            except UnicodeDecodeError:
                raise click.UsageError("--keys-file must be text: one 64-hex key a line") from None
        if not salt_tags and not keys:
            raise click.UsageError("choose what to export: --salt TAG, --key HEX or --keys-file FILE")
        if descendants and not keys:
            raise click.UsageError("--descendants goes with --key or --keys-file")
        with open_store(url, readonly=True) as src:
            selected = select_keys(src, salt_tags=salt_tags, keys=keys, descendants=descendants)
            if not selected:
                raise CLIError(f"nothing matched: no entry of salt tag(s) {', '.join(salt_tags)}",
                               ExitCode.USAGE, hint="see the salt tags with `hostkv info`")
            tmp = None
            if archive == "-":
                out: BinaryIO = sys.stdout.buffer
            else:
                path = os.path.abspath(archive)
                tmp = f"{path}.tmp-{os.getpid()}"
                try:
                    out = open(tmp, "wb")  # noqa: SIM115 - renamed into place only when complete
                except OSError as exc:  # (a missing directory, no permission: the user's to fix)
                    raise CLIError(f"cannot write {archive}: {exc.strerror or exc}", ExitCode.USAGE,
                                   hint="write the archive into an existing directory you can write to") from None
            try:
                with progress_bar("exporting", enabled=not as_json or sys.stderr.isatty()) as bar:
                    doc = export_archive(src, out, selected, level=level, shuffle=int(shuffle), progress=bar)
                if tmp is not None:
                    out.flush()
                    os.fsync(out.fileno())
                    out.close()
                    os.replace(tmp, path)
                    tmp = None
                else:
                    out.flush()
            finally:
                if tmp is not None:
                    out.close()
                    os.unlink(tmp)
        doc.update(url=url, archive=archive)
        if as_json:
            emit_json(doc)
            return
        rate = doc["raw_bytes"] / doc["seconds"] / 1e9 if doc["seconds"] else 0.0
        click.echo(f"exported {doc['entries']} entries + {doc['anchors']} anchors "
                   f"({fmt_size(doc['raw_bytes'])}) to {archive}: {fmt_size(doc['archive_bytes'])}, "
                   f"ratio {doc['ratio']:.2f}, {rate:.2f} GB/s", err=archive == "-")

    @group.command(name="import")
    @click.argument("archive", type=click.Path(dir_okay=False, allow_dash=True, exists=False))
    @click.argument("url")
    @click.option("--expect-salt", "expect", multiple=True, metavar="TAG",
                  help="Refuse the archive unless every entry has one of these salt tags; repeatable.")
    @click.option("--dry-run", is_flag=True, help="Verify the whole archive; write nothing.")
    @click.option("--allow-ephemeral", is_flag=True,
                  help="Import into a non-persistent store (pinned://) although it is gone when hostkv exits.")
    @json_option
    def import_cmd(archive: str, url: str, expect: tuple[str, ...], dry_run: bool, allow_ephemeral: bool,
                   as_json: bool) -> None:
        """Import ARCHIVE (from `hostkv export`) into URL (created if needed).

        Parents go first, keys already stored are skipped (dedup), every record is verified
        before it is written; a damaged archive stops with exit 1 and what came before it stays
        imported (each entry was verified).  A salt mismatch is refused (exit 4).
        """
        if archive == "-":
            f: BinaryIO = sys.stdin.buffer
        else:
            if not os.path.isfile(archive):
                raise CLIError(f"no archive at {archive}")
            f = open(archive, "rb")  # noqa: SIM115 - closed below
        try:
            # the header and the identity first: a foreign or broken archive creates no store
            header = read_header(f)
            check_identity(header, expect)
            with open_store(url, readonly=dry_run, must_exist=dry_run, create=not dry_run) as dst, \
                    progress_bar("importing", enabled=not as_json or sys.stderr.isatty()) as bar:
                if not dry_run:
                    refuse_ephemeral(dst, allow_ephemeral, "import")
                doc = import_archive(dst, f, expect_salts=expect, dry_run=dry_run, progress=bar,
                                     header=header)
        finally:
            if archive != "-":
                f.close()
        doc.update(url=url, archive=archive)
        if as_json:
            emit_json(doc)
            return
        if dry_run:
            click.echo(f"archive ok: {doc['entries']} entries, {doc['anchors']} anchors, "
                       f"salt tag(s) {', '.join(doc['salt_tags'])}; nothing written")
            return
        rate = doc["imported_bytes"] / doc["seconds"] / 1e9 if doc["seconds"] else 0.0
        click.echo(f"imported {doc['imported']} entries ({fmt_size(doc['imported_bytes'])}, {rate:.2f} GB/s), "
                   f"{doc['dedup']} already present, {doc['anchors']} anchors")
