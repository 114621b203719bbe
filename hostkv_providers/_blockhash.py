"""The block-tree page checksum ``xxh3-256k-tree``: one format that the host and the GPU both compute.

An entry of ``n`` bytes is cut into 256 KiB blocks; the last block, of ``r`` bytes, is
zero-padded to ``max(256, r rounded up to 64)`` bytes (every block is then hashed by XXH3's
long-input loop, a multiple of its 64-byte stripe, which the GPU kernel runs); block ``i`` gets
``d[i] = XXH3-64(block i)`` (the standard XXH3-64, seed 0); the entry's checksum is::

    root = fmix64( sum_i fmix64(d[i] + (i + 1) * P1)  +  n * P2 )      (all mod 2**64)

with ``fmix64`` MurmurHash3's 64-bit finaliser and ``P1``/``P2`` XXH3's ``PRIME64_1``/``_2``.
The blocks are 256 KiB, not 64 KiB, because python-xxhash releases the GIL only for inputs *over*
64 KiB: the host's seal threads then hash in parallel.  The blocks are independent, so a GPU kernel
hashes all blocks of a batch of pages at once while they are still in HBM
(``hostkv_providers.device``), and the host hashes the very same blocks with the ``xxhash``
library at its usual rate (one call per block).  The combination is a wrapping sum, so it
vectorises with numpy over any number of blocks.

Three implementations live here, tested equal to one another and to the GPU kernel:

* :func:`tree_checksum_parts` — the host's: ``xxhash`` per block over an entry's regions.
* :func:`block_digests_numpy` — XXH3-64 of equal-length blocks written out in numpy, vectorised over
  blocks (a transcription of the algorithm the GPU kernel runs, for tests and as a reference;
  ``xxhash`` is ~20x faster on the host).
* :func:`roots_from_digests` — the combination, vectorised over many entries.

A store tags which algorithm an entry's checksum is (``xxh3-64`` for the whole-entry XXH3 of
:mod:`hostkv_providers._checksum`, this one otherwise), so stores written before keep reading.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import xxhash

__all__ = [
    "BLOCK",
    "SECRET",
    "TREE_ALGORITHM",
    "block_digests_numpy",
    "nblocks",
    "padded_len",
    "roots_from_digests",
    "tree_checksum",
    "tree_checksum_parts",
]

TREE_ALGORITHM = "xxh3-256k-tree"
BLOCK = 1 << 18

_U64 = np.uint64
_MASK = (1 << 64) - 1
P32_1, P32_2, P32_3 = 0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D
P64_1, P64_2, P64_3 = 0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9
P64_4, P64_5 = 0x85EBCA77C2B2AE63, 0x27D4EB2F165667C5
_FMIX1, _FMIX2 = 0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53

#: XXH3's default 192-byte secret (``XXH3_kSecret`` of xxhash.h).
SECRET = bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671f"
    "cb79e64eccc0e578825ad07dccff7221b8084674f743248ee03590e6813a264c"
    "3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364"
    "eac5ac8334d3ebc3c581a0fffa1363eb170ddd51b7f0da49d316552629d4689e"
    "2b16be587d47a1fc8ff8b8d17ad031ce45cb3a8f95160428afd7fbcabb4b407e"
)
_ZEROS = bytes(BLOCK)


def nblocks(nbytes: int) -> int:
    """How many 256 KiB blocks an entry of ``nbytes`` bytes has."""
    return -(-nbytes // BLOCK)


def padded_len(nbytes: int) -> int:
    """The hashed length of a last block of ``nbytes`` bytes (``0 < nbytes <= BLOCK``)."""
    return max(256, -(-nbytes // 64) * 64)


def _fmix64(x: np.ndarray[Any, np.dtype[np.uint64]]) -> np.ndarray[Any, np.dtype[np.uint64]]:
    x = x ^ (x >> _U64(33))
    x = x * _U64(_FMIX1)
    x = x ^ (x >> _U64(33))
    x = x * _U64(_FMIX2)
    out: np.ndarray[Any, np.dtype[np.uint64]] = x ^ (x >> _U64(33))
    return out


def roots_from_digests(digests: np.ndarray[Any, np.dtype[np.uint64]], nbytes: int | Sequence[int]) -> list[int]:
    """Entry checksums from their block digests.

    ``digests`` is ``(entries, blocks)`` for entries of one size ``nbytes`` (an int), or a flat
    array of every entry's digests one after another when ``nbytes`` is a sequence of sizes.
    """
    d = np.asarray(digests, dtype=_U64)
    with np.errstate(over="ignore"):
        if isinstance(nbytes, int):
            nb = nblocks(nbytes)
            if d.ndim != 2 and nb == 0:
                raise ValueError("give the digests of empty entries as a (entries, 0) array")
            rows = d if d.ndim == 2 else d.reshape(-1, nb)
            if rows.shape[1] != nb:
                raise ValueError(f"{rows.shape[1]} digests per entry for entries of {nb} blocks")
            idx = np.arange(1, nb + 1, dtype=_U64) * _U64(P64_1)
            sums = _fmix64(rows + idx).sum(axis=1, dtype=_U64) if nb else np.zeros(len(rows), _U64)
            out = _fmix64(sums + _U64((nbytes * P64_2) & _MASK))
            return [int(v) for v in out]
        sizes = [int(n) for n in nbytes]
        counts = np.array([nblocks(n) for n in sizes], dtype=np.int64)
        if int(counts.sum()) != d.size:
            raise ValueError(f"{d.size} digests for entries of {int(counts.sum())} blocks")
        starts = np.zeros(len(sizes), dtype=np.int64)
        np.cumsum(counts[:-1], out=starts[1:])
        pos = np.arange(d.size, dtype=np.int64) - np.repeat(starts, counts)
        mixed = _fmix64(d + (pos.astype(_U64) + _U64(1)) * _U64(P64_1))
        sums = np.zeros(len(sizes), dtype=_U64)
        np.add.at(sums, np.repeat(np.arange(len(sizes)), counts), mixed)
        tail = np.array([(n * P64_2) & _MASK for n in sizes], dtype=_U64)
        return [int(v) for v in _fmix64(sums + tail)]


def _digests_of(parts: Iterable[object]) -> tuple[list[int], int]:
    """Block digests of the concatenation of ``parts`` (buffers) and its length."""
    out: list[int] = []
    h: Any = None  # the streaming hasher of a block that spans parts
    fill = 0
    total = 0
    for part in parts:
        mv = memoryview(part).cast("B")  # type: ignore[arg-type]
        n = mv.nbytes
        total += n
        pos = 0
        if h is not None:
            take = min(BLOCK - fill, n)
            h.update(mv[:take])
            fill += take
            pos = take
            if fill == BLOCK:
                out.append(int(h.intdigest()))
                h = None
        whole_end = pos + (n - pos) // BLOCK * BLOCK
        intdigest = xxhash.xxh3_64_intdigest
        for off in range(pos, whole_end, BLOCK):
            out.append(int(intdigest(mv[off : off + BLOCK])))
        if whole_end < n:
            h = xxhash.xxh3_64()
            h.update(mv[whole_end:])
            fill = n - whole_end
    if h is not None:
        h.update(_ZEROS[: padded_len(fill) - fill])
        out.append(int(h.intdigest()))
    return out, total


def _fmix_int(x: int) -> int:
    x ^= x >> 33
    x = (x * _FMIX1) & _MASK
    x ^= x >> 33
    x = (x * _FMIX2) & _MASK
    return x ^ (x >> 33)


def _root_int(digests: Sequence[int], nbytes: int) -> int:
    """:func:`roots_from_digests` for one entry in plain ints (numpy costs ~20 us a call; an
    entry has a few dozen blocks)."""
    acc = 0
    for i, d in enumerate(digests):
        acc += _fmix_int((d + (i + 1) * P64_1) & _MASK)
    return _fmix_int((acc + nbytes * P64_2) & _MASK)


def tree_checksum_parts(parts: Iterable[object]) -> int:
    """The ``xxh3-256k-tree`` checksum of the concatenation of ``parts`` (no copy of the bytes)."""
    parts = list(parts)
    if len(parts) == 1:
        return tree_checksum(parts[0])
    digests, total = _digests_of(parts)
    return _root_int(digests, total)


def tree_checksum(data: object) -> int:
    """The ``xxh3-256k-tree`` checksum of one buffer."""
    mv = memoryview(data).cast("B")  # type: ignore[arg-type]
    n = mv.nbytes
    if 256 <= n <= BLOCK and not n % 64:
        # one block that needs no padding: its digest is XXH3-64 of the bytes (a 4 KiB page's
        # seal without the streaming hasher and the block loop)
        return _root_int((int(xxhash.xxh3_64_intdigest(mv)),), n)
    digests, total = _digests_of((mv,))
    return _root_int(digests, total)


# -- the numpy transcription of XXH3-64 of blocks (the GPU kernel's algorithm) ----------------
def _secret_words(offset: int) -> np.ndarray[Any, np.dtype[np.uint64]]:
    return np.frombuffer(SECRET[offset : offset + 64], dtype="<u8").astype(_U64)


def _mul128_fold64(a: np.ndarray[Any, np.dtype[np.uint64]],
                   b: np.ndarray[Any, np.dtype[np.uint64]]) -> np.ndarray[Any, np.dtype[np.uint64]]:
    lo32 = _U64(0xFFFFFFFF)
    s32 = _U64(32)
    a_lo, a_hi, b_lo, b_hi = a & lo32, a >> s32, b & lo32, b >> s32
    lo_lo, hi_lo, lo_hi, hi_hi = a_lo * b_lo, a_hi * b_lo, a_lo * b_hi, a_hi * b_hi
    cross = (lo_lo >> s32) + (hi_lo & lo32) + lo_hi
    upper = (hi_lo >> s32) + (cross >> s32) + hi_hi
    lower = (cross << s32) | (lo_lo & lo32)
    out: np.ndarray[Any, np.dtype[np.uint64]] = lower ^ upper
    return out


def block_digests_numpy(blocks: np.ndarray[Any, Any]) -> np.ndarray[Any, np.dtype[np.uint64]]:
    """XXH3-64 of each row of ``blocks`` (``(n, L)`` uint8 with ``L`` a multiple of 64, >= 256).

    Vectorised over the rows: the 8 accumulator lanes of all blocks advance together, stripe by
    stripe, exactly as the GPU kernel's 8 threads per block do (XXH3's long-input loop: 1 KiB
    blocks of 16 stripes with a scramble after each, the stripes left, then the last stripe).
    """
    raw = np.ascontiguousarray(blocks, dtype=np.uint8)
    n, length = raw.shape
    if length % 64 or length < 256:
        raise ValueError(f"rows of {length} bytes: give a multiple of 64, at least 256")
    words = raw.view("<u8").reshape(n, length // 64, 8).astype(_U64, copy=False)
    nk = (length - 1) // 1024
    ns = ((length - 1) - 1024 * nk) // 64
    acc = np.tile(np.array([P32_3, P64_1, P64_2, P64_3, P64_4, P32_2, P64_5, P32_1], dtype=_U64), (n, 1))
    swap = [1, 0, 3, 2, 5, 4, 7, 6]
    lo32 = _U64(0xFFFFFFFF)
    keys = [_secret_words(8 * s) for s in range(16)]
    scramble = _secret_words(128)
    with np.errstate(over="ignore"):
        def accumulate(data: np.ndarray[Any, np.dtype[np.uint64]], key: np.ndarray[Any, np.dtype[np.uint64]]) -> None:
            dk = data ^ key
            acc[:, swap] += data
            acc[:] += (dk & lo32) * (dk >> _U64(32))

        for b in range(nk + 1):  # nk full 1 KiB blocks (scrambled), then ns stripes
            for s in range(16 if b < nk else ns):
                accumulate(words[:, b * 16 + s], keys[s])
            if b < nk:
                acc ^= acc >> _U64(47)
                acc ^= scramble
                acc *= _U64(P32_1)
        accumulate(words[:, length // 64 - 1], _secret_words(192 - 64 - 7))  # the last stripe
        merge = _secret_words(11)
        r = np.full(n, (length * P64_1) & _MASK, dtype=_U64)
        for i in range(4):
            r += _mul128_fold64(acc[:, 2 * i] ^ merge[2 * i], acc[:, 2 * i + 1] ^ merge[2 * i + 1])
        r ^= r >> _U64(37)
        r *= _U64(0x165667919E3779F9)
        r ^= r >> _U64(32)
    return r
