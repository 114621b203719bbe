"""The mmap store's on-disk record format: constants, the 160-byte index record dtype, its fold64
checksum, and the (vectorised) record encoders and decoders."""

from __future__ import annotations

import logging
import os
import re
import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from hostkv_providers._errors import (
    HostKVError,
    UnsafeStoreError,
)
from hostkv_providers.providers._slotfile import (
    _ZERO_KEY,
)

if TYPE_CHECKING:
    from ._base import _MmapReservation


MMAP_FORMAT = "hostkv-mmap"
#: On-disk format of this provider (manifest ``format_version``) that writers write.  Version 2
#: added ``OP_RETAIN`` records (retained entries); version-1 stores are read, and a writer that
#: opens one upgrades its manifest.  Any other version is refused.
MMAP_FORMAT_VERSION = 2
MMAP_READABLE_VERSIONS = (1, 2)
RECORD_FOLD = "fold64-v1"

_DEFAULT_BUDGET = 1 << 30
_DEFAULT_SLOT = 256 * 1024
_MAX_FILE = 1 << 30
_SNAPSHOT_MIN = 65536
_NONE_BATCH = 256
_NONE_INTERVAL = 1.0
_JOURNAL_CHUNK = 256 << 10
_MANIFEST_LIMIT = 64 * 1024
_TAG_MAX = 16
_PUT_BATCH = 256  # put_many items per commit: bounds the lock pass and the bytes one commit pins

_log = logging.getLogger(__name__)

OP_SEAL = 1
OP_DROP = 2
OP_ANCHOR = 3
OP_RETAIN = 4  # the entry ``key`` is retained (flag _REC_DELETE: no longer retained); format v2
_REC_DELETE = 2  # record flag: the anchor named by an OP_ANCHOR record (or the OP_RETAIN mark) is removed

RECORD_DTYPE = np.dtype(
    [
        ("op", "u1"),
        ("flags", "u1"),  # bit0: has parent
        ("tag_len", "u1"),
        ("name_len", "u1"),
        ("nslots", "<u4"),
        ("key", "V32"),
        ("parent", "V32"),  # OP_ANCHOR: bytes [40, 104) of the record hold the anchor name
        ("tag", "V16"),
        ("hint", "<u8"),  # OP_SEAL in a snapshot: 1 + the position of the parent's record (0: none)
        ("pad", "<u8"),
        ("file", "<u4"),
        ("slot", "<u4"),
        ("nbytes", "<u8"),
        ("gen", "<u8"),
        ("checksum", "<u8"),
        ("created", "<f8"),
        ("seq", "<u8"),  # journal order; in a snapshot, the entry's LRU tick
        ("fold", "<u8"),
    ]
)
REC_NBYTES = RECORD_DTYPE.itemsize
assert REC_NBYTES == 160
_WORDS = REC_NBYTES // 8
_FOLD_SEED = np.uint64(0x9E3779B97F4A7C15)
_FOLD_MUL = np.uint64(0x9FB21C651E98DF25)  # odd: multiplication is a bijection mod 2**64

_JOURNAL_MAGIC = b"HKVJRNL1"
_MODE_CODE = {"sync": 1, "process": 2, "none": 3}
_SNAP_MAGIC = b"HKVSNAP1"
_SNAP_HEADER = 4096
_DATA_NAME = re.compile(r"^data\.(\d{1,9})\.(\d{4,9})\.slots$")
_KNOWN_NAME = re.compile(
    r"^(manifest\.json|writer\.lock|(data\.\d{1,9}\.\d{4,9}\.slots)|index\.\d{1,9}\.(snap|journal))$")
# ------------------------------------------------------------------------------------------------
# Records
# ------------------------------------------------------------------------------------------------


def fold64(words: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """Vectorised 64-bit record checksum over the first ``_WORDS - 1`` words of each row.

    ``h = (h ^ w) * M`` per word (odd ``M``: a bijection), so any change confined to one word
    always changes the result and torn records (zero tails) are caught; it is not cryptographic,
    it only has to catch torn writes and bit rot, and it runs at numpy speed on a million rows
    (in row chunks that stay in cache: the 19 column passes would otherwise stream the whole
    array from memory 19 times).
    """
    n = words.shape[0]
    out = np.empty(n, dtype=np.uint64)
    step = 8192
    with np.errstate(over="ignore"):
        for lo in range(0, n, step):
            w = words[lo : lo + step]
            h = np.full(w.shape[0], _FOLD_SEED, dtype=np.uint64)
            for i in range(_WORDS - 1):
                h ^= w[:, i]
                h *= _FOLD_MUL
            h ^= h >> np.uint64(31)
            out[lo : lo + step] = h
    return out


_M64 = (1 << 64) - 1
_REC_STRUCT = struct.Struct("<BBBBI32s32s16sQQIIQQQdQ")  # RECORD_DTYPE without "fold"
assert _REC_STRUCT.size == REC_NBYTES - 8
_REC_WORDS = struct.Struct(f"<{_WORDS - 1}Q")


def fold64_one(raw: bytes, _unpack: Any = _REC_WORDS.unpack_from, _seed: int = int(_FOLD_SEED),
               _mul: int = int(_FOLD_MUL), _m64: int = _M64) -> int:
    """:func:`fold64` of one record (pure Python: cheaper than numpy for a single row).  The
    constants are bound as defaults: this runs once per seal, and global lookups plus two
    ``int(np.uint64)`` conversions were a quarter of its time."""
    h = _seed
    for w in _unpack(raw):
        h = ((h ^ w) * _mul) & _m64
    return h ^ (h >> 31)


def _encode_seals(reservations: Sequence[_MmapReservation], digests: Sequence[int], tag: bytes, created: float,
                  seq0: int) -> list[bytes]:
    """The seal records of a ``put_many`` chunk, byte for byte what :meth:`MmapProvider._encode`
    gives per record.  The fold of many records runs vectorised: 19 multiplications of Python
    ints cost ~2.6 µs per record, numpy passes over a chunk's columns a fraction of that per
    record from about 8 records on."""
    pack = _REC_STRUCT.pack
    tag16 = tag.ljust(16, b"\0")
    bodies = [pack(OP_SEAL, 1 if r.parent is not None else 0, len(tag), 0, r.nslots, r.key, r.parent or _ZERO_KEY,
                   tag16, 0, 0, r.file, r.slot, r.nbytes, r.gen, d, created, seq0 + j)
              for j, (r, d) in enumerate(zip(reservations, digests, strict=True))]
    if len(bodies) < 8:
        return [b + fold64_one(b).to_bytes(8, "little") for b in bodies]
    words = np.frombuffer(b"".join(bodies), dtype=np.uint64).reshape(len(bodies), _WORDS - 1)
    folds: list[int] = fold64(words).tolist()
    return [b + f.to_bytes(8, "little") for b, f in zip(bodies, folds, strict=True)]


def _encode_seal_batch(keys: bytes, parents: Sequence[bytes | None], tag: bytes, nslots: int,
                       files: npt.NDArray[np.int64], slots: npt.NDArray[np.int64], nbytes: int, gen0: int,
                       digests: npt.NDArray[np.uint64], created: float, seq0: int) -> bytes:
    """The seal records of a ``put_many`` batch of equal pages as one blob, byte for byte what
    :func:`_encode_seals` gives record by record (``keys``: the 32-byte keys joined; generations
    ``gen0 + j``): :func:`_seal_batch_head` then :func:`_seal_batch_finish`."""
    head = _seal_batch_head(keys, parents, tag, nslots, files, slots, nbytes, gen0)
    return _seal_batch_finish(head, digests, created, seq0)


#: Record words that depend on the bytes (the checksum), the seal time and the journal order:
#: the last three of the fold (``checksum``, ``created``, ``seq``).
_LATE_WORDS = 3
#: Batches up to this many records fold as one big integer (below); larger ones with numpy.
_LANES_MAX = 32
_M64 = (1 << 64) - 1
_lanes_cache: dict[int, tuple[int, int, int]] = {}


def _lanes(n: int) -> tuple[int, int, int]:
    """For the fold of ``n`` records as one integer, each record's 64-bit state in its own
    128-bit lane (a product by the 64-bit multiplier stays inside its lane, so one big-integer
    ``(h ^ w) * M & mask`` folds every record at once: 3 operations per word instead of 2 numpy
    calls, which a small batch pays per call): ``(ones, mask, index)``, the integers with 1,
    2**64 - 1 and the lane's index in every lane."""
    got = _lanes_cache.get(n)
    if got is None:
        ones = sum(1 << (128 * j) for j in range(n))
        got = _lanes_cache[n] = (ones, ones * _M64, sum(j << (128 * j) for j in range(n)))
    return got


def _lane_words(cols: npt.NDArray[np.uint64]) -> list[int]:
    """Rows of ``cols`` (``(words, n)`` uint64) as lane integers (see :func:`_lanes`)."""
    w, n = cols.shape
    spread = np.zeros((w, n, 2), np.uint64)
    spread[:, :, 0] = cols
    raw = spread.tobytes()
    step = 16 * n
    fb = int.from_bytes
    return [fb(raw[i : i + step], "little") for i in range(0, w * step, step)]


def _seal_batch_head(keys: bytes, parents: Sequence[bytes | None], tag: bytes, nslots: int,
                     files: npt.NDArray[np.int64], slots: npt.NDArray[np.int64], nbytes: int,
                     gen0: int) -> tuple[npt.NDArray[Any], int | npt.NDArray[np.uint64] | None]:
    """The part of a batch's seal records known at reservation: every field but the checksum,
    the seal time and the seq, and the fold over the words before them (a lane integer for a
    small batch, a numpy row for a middle one, ``None``: fold64 at the end for a large one)."""
    n = len(files)
    recs = np.zeros(n, RECORD_DTYPE)
    recs["op"] = OP_SEAL
    if parents.count(None) != n:
        recs["flags"] = [p is not None for p in parents]
        recs["parent"] = np.frombuffer(b"".join([p or _ZERO_KEY for p in parents]), "V32")
    if tag:
        recs["tag_len"] = len(tag)
        recs["tag"] = np.void(tag.ljust(16, b"\0"))
    recs["nslots"] = nslots
    recs["key"] = np.frombuffer(keys, "V32")
    recs["file"] = files
    recs["slot"] = slots
    recs["nbytes"] = nbytes
    recs["gen"] = np.arange(gen0, gen0 + n, dtype=np.uint64)
    early = recs.view(np.uint64).reshape(n, _WORDS)[:, : _WORDS - 1 - _LATE_WORDS].T
    if n <= _LANES_MAX:
        ones, mask, _ = _lanes(n)
        mul = int(_FOLD_MUL)
        h = int(_FOLD_SEED) * ones
        for w in _lane_words(early):
            h = ((h ^ w) * mul) & mask
        return recs, h
    if n > 64:
        return recs, None  # fold64 at the end: per element it is cheaper than per row
    # fold64 with the words as rows (one contiguous row per ufunc call); integer array
    # arithmetic wraps without warnings
    hv = np.full(n, _FOLD_SEED, dtype=np.uint64)
    for w in early.copy():
        hv ^= w
        hv *= _FOLD_MUL
    return recs, hv


def _seal_batch_finish(head: tuple[npt.NDArray[Any], int | npt.NDArray[np.uint64] | None],
                       digests: npt.NDArray[np.uint64], created: float, seq0: int) -> bytes:
    """The records of :func:`_seal_batch_head` completed (checksums, seal time, seqs, folds),
    as one blob."""
    recs, h = head
    n = len(recs)
    recs["checksum"] = digests
    recs["created"] = created
    recs["seq"] = np.arange(seq0, seq0 + n, dtype=np.uint64)
    if h is None:
        recs["fold"] = fold64(recs.view(np.uint64).reshape(n, _WORDS))
    elif isinstance(h, int):
        ones, mask, index = _lanes(n)
        mul = int(_FOLD_MUL)
        created_bits = int.from_bytes(struct.pack("<d", created), "little")
        for w in (_lane_words(digests.reshape(1, n))[0], created_bits * ones, seq0 * ones + index):
            h = ((h ^ w) * mul) & mask
        h = (h ^ (h >> 31)) & mask
        recs["fold"] = np.frombuffer(h.to_bytes(16 * n, "little"), np.uint64)[::2]
    else:
        for w in recs.view(np.uint64).reshape(n, _WORDS)[:, _WORDS - 1 - _LATE_WORDS : _WORDS - 1].T.copy():
            h ^= w
            h *= _FOLD_MUL
        h ^= h >> np.uint64(31)
        recs["fold"] = h
    return recs.tobytes()


def _encode_drops(keys: npt.NDArray[Any], seq: int) -> bytes:
    """The drop records of many entries (``V32`` keys) as one blob, byte for byte what
    ``_encode(OP_DROP, key, seq=seq)`` gives for each."""
    recs = np.zeros(len(keys), RECORD_DTYPE)
    recs["op"] = OP_DROP
    recs["key"] = keys
    recs["seq"] = seq
    _seal_folds(recs)
    return recs.tobytes()


def _build_records(cols: dict[str, Any]) -> npt.NDArray[Any]:
    """Snapshot records from :meth:`MmapProvider._snapshot_columns`, folded: the seals, then
    the anchors (stamped with the newest tick: they must sort after their entry's seal)."""
    rows = cols["rows"]
    recs = np.zeros(len(rows), RECORD_DTYPE)
    if len(rows):
        par = cols["parent_row"]
        hasp = par >= 0
        recs["op"] = OP_SEAL
        recs["key"] = cols["key"]
        recs["flags"] = hasp.astype(np.uint8)
        recs["parent"][hasp] = cols["parent_key"]
        for name in ("tag", "tag_len", "file", "slot", "nslots", "nbytes", "gen", "checksum", "created", "seq"):
            recs[name] = cols[name]
        # the parent's position in this snapshot: reopening resolves parents without a search
        pos_of_row = np.full(cols["n_rows"], -1, np.int64)
        pos_of_row[rows] = np.arange(len(rows))
        recs["hint"][hasp] = (pos_of_row[par[hasp]] + 1).astype(np.uint64)
        _seal_folds(recs)
    if cols["anchors"]:
        ext = np.frombuffer(b"".join(cols["anchors"]), RECORD_DTYPE).copy()
        ext["seq"] = cols["clock"]
        _seal_folds(ext)
        recs = np.concatenate([recs, ext])
    return recs


def _columns(recs: npt.NDArray[Any]) -> npt.NDArray[np.uint64]:
    """Records as a ``(_WORDS, n)`` array of uint64 columns (transposed in cache-sized chunks).

    Every loader step then reads contiguous columns instead of striding through 160-byte
    records once per field, which is what makes a million-entry open fast."""
    n = len(recs)
    words = recs.view(np.uint64).reshape(n, _WORDS)
    out = np.empty((_WORDS, n), dtype=np.uint64)
    step = 16384
    for lo in range(0, n, step):
        out[:, lo : lo + step] = words[lo : lo + step].T
    return out


def _fold_columns(W: npt.NDArray[np.uint64]) -> npt.NDArray[np.bool_]:
    """Which columns-records pass their fold checksum (and have an op)."""
    n = W.shape[1]
    h = np.full(n, _FOLD_SEED, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for i in range(_WORDS - 1):
            h ^= W[i]
            h *= _FOLD_MUL
        h ^= h >> np.uint64(31)
    ok: npt.NDArray[np.bool_] = (h == W[_WORDS - 1]) & ((W[0] & np.uint64(0xFF)) != 0)
    return ok


def _records_of(W: npt.NDArray[np.uint64], pos: npt.NDArray[np.intp]) -> npt.NDArray[Any]:
    """Structured records for a few column positions (anchors)."""
    rows: npt.NDArray[Any] = np.ascontiguousarray(W[:, pos].T).view(RECORD_DTYPE).reshape(len(pos))
    return rows


def _seal_folds(recs: npt.NDArray[Any]) -> None:
    if len(recs):
        recs["fold"] = fold64(recs.view(np.uint64).reshape(len(recs), _WORDS))


def _folds_ok(recs: npt.NDArray[Any]) -> npt.NDArray[np.bool_]:
    if not len(recs):
        return np.zeros(0, dtype=np.bool_)
    ok: npt.NDArray[np.bool_] = fold64(recs.view(np.uint64).reshape(len(recs), _WORDS)) == recs["fold"]
    return ok


def _u64x4(keys: npt.NDArray[Any]) -> npt.NDArray[np.uint64]:
    """32-byte keys as an ``(n, 4)`` uint64 array (for fast vectorised equality)."""
    out: npt.NDArray[np.uint64] = np.ascontiguousarray(keys).view("<u8").reshape(len(keys), 4)
    return out


def _key_u64(key: bytes) -> int:
    return int.from_bytes(key[:8], "little")

def _read_exact(fd: int, offset: int, nbytes: int) -> bytes:
    chunks = []
    done = 0
    while done < nbytes:
        chunk = os.pread(fd, min(nbytes - done, 1 << 30), offset + done)
        if not chunk:
            break
        chunks.append(chunk)
        done += len(chunk)
    return b"".join(chunks)


def _unsafe(msg: str) -> HostKVError:

    return UnsafeStoreError(msg)
