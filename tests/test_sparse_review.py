"""Review mends of the host sparse helpers and the write-through mirror (reproduced, each failed
before): output arrays and table addresses checked like the CUDA classes check theirs (typed
errors, before any state changes), and a mirror's pool slots checked before anything is
reserved (a slot outside the pool sealed the block's old bytes under the new key; one that was
not an int leaked its reservation)."""

from __future__ import annotations

import numpy as np
import pytest

from hostkv_providers import KVLayout
from hostkv_providers.device import CpuPageMover, CpuSlotCache, KVPlanes, PageTable
from hostkv_providers.errors import CopyArgumentError, HostKVError
from hostkv_providers.providers import MappedPinnedProvider

LAY = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, page_tokens=4, dtype="float32")
LAY_F32 = KVLayout(num_layers=2, num_kv_heads=2, head_dim=128, page_tokens=4, dtype="float32")
FP8 = KVLayout(num_layers=3, num_kv_heads=2, head_dim=128, page_tokens=4, dtype="float8_e4m3fn",
               scale_dtype="float32", scale_group=64)


def key(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8


def test_slot_cache_output_of_wrong_size_is_a_typed_error() -> None:
    c = CpuSlotCache(10, 4, width=2)
    with pytest.raises(CopyArgumentError):  # ValueError from numpy today
        c.resolve(np.array([1, 2], np.int32), np.zeros(3, np.int32), np.zeros(2, np.int32), np.zeros(2, np.int32))


def test_slot_cache_output_that_cannot_be_written_is_refused_not_dropped() -> None:
    c = CpuSlotCache(10, 4, width=2)
    out, fids, fslots = [-7, -7], [-7, -7], [-7, -7]  # lists: numpy writes into a copy
    try:
        c.resolve(np.array([1, 2], np.int32), out, fids, fslots)
    except HostKVError:
        return  # refused: fine
    # accepted: the caller never learns which pages to fetch, yet the cache bound them to slots
    out2, f2, s2 = (np.zeros(2, np.int32) for _ in range(3))
    c.resolve(np.array([1, 2], np.int32), out2, f2, s2)
    assert out == [-7, -7] and f2.tolist() == [-1, -1], "(sanity)"
    pytest.fail(f"outputs silently dropped; the next step reads pages 1, 2 from slots {out2.tolist()} "
                "as hits although nothing was ever fetched into them")


def test_slot_cache_output_of_narrow_dtype_is_refused_before_any_change() -> None:
    c = CpuSlotCache(400, 300, width=300)
    out, fids, fslots = (np.zeros(300, np.int8) for _ in range(3))
    err: BaseException | None = None
    try:
        c.resolve(np.arange(300, dtype=np.int32), out, fids, fslots)
    except Exception as exc:
        err = exc
    bound = int((c.resident() >= 0).sum())
    # today: numpy's OverflowError at slot 128, after 128 pages were bound to slots nobody fetches
    assert isinstance(err, CopyArgumentError) and bound == 0, (type(err).__name__, f"{bound} pages bound")


def _mover() -> tuple[CpuPageMover, np.ndarray]:
    pool = KVPlanes.from_arrays(LAY, [np.zeros((4, s.nbytes), np.uint8) for s in LAY.planes])
    pages = np.zeros((3, LAY.page_nbytes), np.uint8)
    table = PageTable([pages.ctypes.data + i * LAY.page_nbytes for i in range(3)], -1)
    return CpuPageMover(LAY, pool, table, width=2), pages


@pytest.mark.parametrize("out", [np.zeros(2, np.int32), np.zeros(3, np.int64)], ids=["int32", "size3"])
def test_digest_out_of_wrong_shape_is_a_typed_error(out: np.ndarray) -> None:
    m, _pages = _mover()
    with pytest.raises(CopyArgumentError):  # ValueError from numpy today
        m.digest_pages(np.array([0, 1], np.int32), out)
    with pytest.raises(CopyArgumentError):
        m.digest_slots(np.array([0, 1], np.int32), out)


@pytest.mark.parametrize("addr", [-4096, "x"])
def test_page_table_bad_address_is_a_typed_error(addr: object) -> None:
    with pytest.raises(CopyArgumentError):  # OverflowError / ValueError today
        PageTable([addr], -1)


@pytest.mark.parametrize("bad_slot", [99, -1])
def test_mirror_from_a_bad_slot_stores_nothing(bad_slot: int) -> None:
    block = -(-FP8.page_nbytes // 4096) * 4096
    p = MappedPinnedProvider(1 * block, block=block, chunk=block, device=-1)  # one block
    try:
        stale = np.random.default_rng(1).integers(0, 256, FP8.page_nbytes, dtype=np.uint8).tobytes()
        res = p.reserve(key(1), None, FP8.page_nbytes)
        assert res is not None
        res.write(0, stale)
        p.seal(res)
        p.evict([key(1)])  # the block is free again, its bytes are still the old page's
        arrays = [np.full((4, s.nbytes), 0x5A, np.uint8) for s in FP8.planes]  # a 4-slot pool
        mover = CpuPageMover(FP8, KVPlanes.from_arrays(FP8, arrays), p.page_table(), width=2)
        try:
            h = p.mirror(mover, [(key(2), None)], [bad_slot])
            h.wait()
        except HostKVError:
            return  # refused with a typed error: fine
        out = bytearray(FP8.page_nbytes)
        stored = p.present([key(2)])[0]
        got = bytes(out) if stored and p.read(key(2), out) else None
        assert mover.errors() == 0 and not stored, (
            f"slot {bad_slot} was refused by the mover (errors={mover.errors()}) but key 2 was sealed "
            f"anyway; its bytes are the evicted page's: {got == stale}")
    finally:
        p.close()


@pytest.mark.parametrize("bad_slot", [None, 2**40], ids=["None", "2**40"])
def test_mirror_with_an_unconvertible_slot_is_typed_and_leaks_nothing(bad_slot: object) -> None:
    block = -(-LAY_F32.page_nbytes // 4096) * 4096
    p = MappedPinnedProvider(4 * block, block=block, chunk=block, device=-1)
    try:
        arrays = [np.zeros((4, s.nbytes), np.uint8) for s in LAY_F32.planes]
        mover = CpuPageMover(LAY_F32, KVPlanes.from_arrays(LAY_F32, arrays), p.page_table(), width=2)
        free_before = p.stats().extra["free_blocks"]
        err: BaseException | None = None
        try:
            p.mirror(mover, [(key(2), None)], [bad_slot])  # type: ignore[list-item]
        except Exception as exc:
            err = exc
        state = (type(err).__name__, p.in_flight(key(2)), p.stats().extra["free_blocks"], free_before)
        assert isinstance(err, HostKVError), f"untyped error: {state}"
        assert not p.in_flight(key(2)) and p.stats().extra["free_blocks"] == free_before, f"leaked: {state}"
    finally:
        p.close()
