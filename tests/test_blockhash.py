"""The ``xxh3-256k-tree`` checksum: the numpy transcription of the GPU kernel's algorithm equals
the ``xxhash`` library block by block, the host's streaming implementation is independent of how
an entry is cut into regions, and a pinned store seals given checksums without hashing."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash

import hostkv_providers as hk
from hostkv_providers import _blockhash as bh
from hostkv_providers.errors import InvalidArgumentError
from hostkv_providers.providers import PinnedProvider

RNG = np.random.default_rng(14)


def _padded_digests(data: bytes) -> np.ndarray:
    """The format written out: 256 KiB blocks, the last one zero-padded to padded_len."""
    out = []
    for lo in range(0, len(data), bh.BLOCK):
        block = data[lo : lo + bh.BLOCK]
        block += bytes(bh.padded_len(len(block)) - len(block))
        out.append(xxhash.xxh3_64_intdigest(block))
    return np.array(out, dtype=np.uint64)


@pytest.mark.parametrize("length", [256, 320, 1024, 1088, 4096 + 64, 65536, bh.BLOCK])
def test_numpy_xxh3_equals_xxhash(length: int) -> None:
    blocks = RNG.integers(0, 256, size=(4, length), dtype=np.uint8)
    blocks[1] = 0
    blocks[2] = 0xFF
    got = bh.block_digests_numpy(blocks)
    assert [int(v) for v in got] == [xxhash.xxh3_64_intdigest(b.tobytes()) for b in blocks]
    with pytest.raises(ValueError):
        bh.block_digests_numpy(np.zeros((1, 200), np.uint8))


def test_padded_len() -> None:
    assert [bh.padded_len(n) for n in (1, 64, 65, 255, 256, 257, 4096, bh.BLOCK)] == \
        [256, 256, 256, 256, 256, 320, 4096, bh.BLOCK]


@pytest.mark.parametrize("n", [0, 1, 63, 64, 300, 4096, bh.BLOCK - 8, bh.BLOCK, bh.BLOCK + 64, 3 * bh.BLOCK + 100])
def test_tree_checksum_is_the_fold_of_the_block_digests(n: int) -> None:
    data = RNG.integers(0, 256, size=n, dtype=np.uint8).tobytes()
    want = bh.roots_from_digests(_padded_digests(data).reshape(1, -1), n)[0]
    assert bh.tree_checksum(data) == want
    # any cut into parts gives the same value (regions of an arena entry, plane slices)
    cuts = sorted(set(int(c) for c in RNG.integers(0, n + 1, size=5))) if n else []
    parts = [data[a:b] for a, b in zip([0, *cuts], [*cuts, n], strict=True)]
    assert bh.tree_checksum_parts(parts) == want
    # the flat form for entries of mixed sizes
    other = RNG.integers(0, 256, size=bh.BLOCK + 1, dtype=np.uint8).tobytes()
    flat = np.concatenate([_padded_digests(data), _padded_digests(other)])
    assert bh.roots_from_digests(flat, [n, len(other)]) == [want, bh.tree_checksum(other)]


def test_tree_checksum_sees_every_byte_and_the_length() -> None:
    data = bytearray(RNG.integers(0, 256, size=2 * bh.BLOCK + 10, dtype=np.uint8).tobytes())
    base = bh.tree_checksum(data)
    for pos in (0, 7, bh.BLOCK - 1, bh.BLOCK, 2 * bh.BLOCK + 9):
        flipped = bytearray(data)
        flipped[pos] ^= 0x10
        assert bh.tree_checksum(flipped) != base
    assert bh.tree_checksum(data + b"\0") != base  # zero padding is not the same entry
    swapped = data[bh.BLOCK : 2 * bh.BLOCK] + data[: bh.BLOCK] + data[2 * bh.BLOCK :]
    assert bh.tree_checksum(swapped) != base  # block order counts


def test_roots_from_digests_checks_shapes() -> None:
    with pytest.raises(ValueError):
        bh.roots_from_digests(np.zeros(3, np.uint64), [bh.BLOCK])
    with pytest.raises(ValueError):
        bh.roots_from_digests(np.zeros((1, 2), np.uint64), bh.BLOCK)
    assert bh.roots_from_digests(np.zeros((2, 0), np.uint64), 0) == [bh.tree_checksum(b"")] * 2


@pytest.mark.parametrize("algorithm", [bh.TREE_ALGORITHM, "xxh3-64"])
def test_pinned_store_checksum_algorithms(algorithm: str) -> None:
    p = PinnedProvider(1 << 20, block=4096, checksum=algorithm, allocator=hk.device.OrdinaryAllocator(),
                       verify_reads=True)
    try:
        assert p.checksum_algorithm == algorithm
        data = RNG.integers(0, 256, size=9000, dtype=np.uint8).tobytes()
        k = b"k" * 32
        assert p.put(k, None, data)
        info = next(iter(p.iter_entries()))
        want = bh.tree_checksum(data) if algorithm == bh.TREE_ALGORITHM else xxhash.xxh3_64_intdigest(data)
        assert info.checksum == want
        out = bytearray(9000)
        assert p.read(k, out) is True and bytes(out) == data
    finally:
        p.close()


def test_pinned_seal_many_records_given_checksums_in_its_algorithm() -> None:
    p = PinnedProvider(1 << 20, block=4096, allocator=hk.device.OrdinaryAllocator(), verify_reads=True)
    try:
        keys = [bytes([i]) * 32 for i in range(3)]
        datas = [RNG.integers(0, 256, size=4096, dtype=np.uint8).tobytes() for _ in keys]
        chain = p.reserve_many(keys, [None, keys[0], keys[1]], 4096)
        ress = [r for r in chain.reservations if r is not None]
        for r, d in zip(ress, datas, strict=True):
            r.write(0, d)
        with pytest.raises(InvalidArgumentError):
            p.seal_many(ress, checksums=[1, 2, 3])  # no algorithm named
        with pytest.raises(InvalidArgumentError):
            p.seal_many(ress, checksums=[1], algorithm=bh.TREE_ALGORITHM)
        for r in ress:  # a refused call changed nothing: the reservations are still open
            assert r.state == "open"
            p.abort(r)
        chain = p.reserve_many(keys, [None, keys[0], keys[1]], 4096)
        ress = [r for r in chain.reservations if r is not None]
        for r, d in zip(ress, datas, strict=True):
            r.write(0, d)
        given = [bh.tree_checksum(datas[0]), bh.tree_checksum(datas[1]), 12345]  # the last one is wrong
        p.seal_many(ress, checksums=given, algorithm=bh.TREE_ALGORITHM)
        assert [e.checksum for e in sorted(p.iter_entries(), key=lambda e: e.key)] == given
        out = bytearray(4096)
        assert p.read(keys[0], out) is True and bytes(out) == datas[0]
        # a wrong given checksum is a flipped bit: the verified read misses and drops the entry
        assert p.read(keys[2], out) is False
        assert p.present([keys[2]]) == [False]
        # checksums in another algorithm are not used: the store hashes the bytes itself
        k4 = b"\x09" * 32
        chain = p.reserve_many([k4], [keys[1]], 4096)
        (r4,) = chain.reservations
        assert r4 is not None
        r4.write(0, datas[2])
        p.seal_many([r4], checksums=[777], algorithm="xxh3-64")
        assert p.read(k4, out) is True and bytes(out) == datas[2]
    finally:
        p.close()


# -- the cache's paths on the CPU copy engine ------------------------------------------------
LAYOUT = hk.KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, page_tokens=16, dtype="float16")  # 16 KiB pages
NPAGES = 24


def _host_planes(fill: int | None = None) -> list[np.ndarray]:
    shape = (2 * NPAGES, LAYOUT.page_tokens, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    if fill is None:
        return [RNG.standard_normal(shape).astype(np.float16) for _ in LAYOUT.planes]
    return [np.full(shape, fill, np.float16) for _ in LAYOUT.planes]


def test_reserve_many_hands_out_the_chunk_as_host_pages() -> None:
    P = LAYOUT.page_nbytes
    p = PinnedProvider(64 * P, block=P, allocator=hk.device.OrdinaryAllocator())
    try:
        keys = [bytes([i + 1]) * 32 for i in range(5)]
        assert p.put(keys[0], None, bytes(P))
        chain = p.reserve_many(keys, [None, *keys[:-1]], P)
        assert chain.reservations[0] is None and chain.pages is not None  # dedup first, four reserved
        real = [r for r in chain.reservations if r is not None]
        assert len(chain.pages) == 4 and chain.pages.page_nbytes == P and not chain.pages.readonly
        assert [int(a) for a in chain.pages.addresses] == [r.regions()[0].address for r in real]
        for r in real:
            p.abort(r)
    finally:
        p.close()


def test_cpu_engine_save_and_verified_restore_truncate_at_a_flipped_byte() -> None:
    import ctypes

    from hostkv_providers.cache import HostKVCache
    from hostkv_providers.device import CpuCopyEngine

    P = LAYOUT.page_nbytes
    prov = PinnedProvider(64 * P, block=P, allocator=hk.device.OrdinaryAllocator(), verify_reads=True)
    engine = CpuCopyEngine()
    try:
        with HostKVCache(prov, hk.Salt("t/verify", LAYOUT), engine, chunk_pages=5) as cache:
            src = _host_planes()
            keys = cache.keys(list(range(NPAGES * LAYOUT.page_tokens)))
            assert cache.save(keys, src, list(range(NPAGES))).wait().stored == NPAGES
            report = prov.verify()
            assert report.checked == NPAGES and not report.corrupt
            dst = _host_planes(fill=0)
            ok = cache.restore(cache.lookup(keys), dst, list(range(NPAGES))).wait()
            assert ok.pages == NPAGES and ok.viewed == NPAGES
            assert all(np.array_equal(a[:NPAGES], b[:NPAGES]) for a, b in zip(src, dst, strict=True))
            for bad in (NPAGES - 1, 11, 0):
                with prov.lease([keys[bad]]) as lease:
                    (reg,) = prov.view(lease, keys[bad])
                    byte = ctypes.c_uint8.from_address(reg.address + P // 2 + 3)
                    byte.value ^= 0x04  # a flipped bit in the store's RAM
                r = cache.restore(cache.lookup(keys), dst, list(range(NPAGES))).wait()
                assert r.pages == bad and r.nbytes == bad * P, (bad, r.pages, r.stopped)
                assert r.stopped is not None and "checksum" in r.stopped
                byte.value ^= 0x04
            assert cache.restore(cache.lookup(keys), dst, list(range(NPAGES))).wait().pages == NPAGES
    finally:
        engine.close()
        prov.close()


@pytest.mark.parametrize("n", [256, 320, 4096, 4100, 65536, 1 << 18, (1 << 18) + 64, 1 << 20, 100])
def test_one_buffer_fast_path_equals_the_block_walk(n: int) -> None:
    data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8).tobytes()
    digests, total = bh._digests_of((data,))
    want = bh._root_int(digests, total)
    assert bh.tree_checksum(data) == want
    assert bh.tree_checksum_parts([data]) == want
    assert bh.tree_checksum_parts([data[: n // 3], data[n // 3 :]]) == want
