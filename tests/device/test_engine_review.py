"""Review mends of the copy engines' argument checks, the host ordering primitives and the paged
plane helpers (reproduced, each failed before): block ids that are not ints (1.7, "2",
np.True_) picked a block, a set's order was taken for the caller's, a generator raised an
untyped error; object arrays were taken as KV memory; a host gate opened after its engine closed
never opened, and a save after a closed HostStream wedged the engine; grouped scales were shaped
per token by paged_planes and HFCacheMap; bad host pages raised TypeError."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from hostkv_providers import ClosedError, HostRegion, KVLayout
from hostkv_providers.device._copy import CopyArgumentError, CpuCopyEngine, HostStream, KVPlanes

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, page_tokens=2, dtype="uint8")


@pytest.fixture
def setup() -> Iterator[tuple[CpuCopyEngine, KVPlanes]]:
    arrays = [np.arange(4 * 8, dtype=np.uint8).reshape(4, 8) + 100 * i for i in range(2)]
    planes = KVPlanes.from_arrays(LAYOUT, arrays)
    eng = CpuCopyEngine()
    yield eng, planes
    eng.close()


def _pages(n: int) -> tuple[list[np.ndarray], list[list[HostRegion]]]:
    bufs = [np.zeros(LAYOUT.page_nbytes, np.uint8) for _ in range(n)]
    return bufs, [[HostRegion(0, memoryview(b), int(b.ctypes.data), False)] for b in bufs]


@pytest.mark.parametrize("ids", [
    [1.7],                       # float: int(1.7) -> block 1
    [np.float64(2.9)],           # numpy float -> block 2
    [np.True_],                  # numpy bool -> block 1 (Python True is refused)
    np.array([True]),            # bool array -> block 1
    ["2"],                       # str -> block 2
], ids=["float", "np.float64", "np.bool_", "bool-array", "str"])
def test_save_refuses_non_integer_block_ids(setup: Any, ids: Any) -> None:
    eng, planes = setup
    bufs, pages = _pages(1)
    with pytest.raises(CopyArgumentError):
        h = eng.save(planes, ids, pages)
        h.wait(10)
        pytest.fail(f"{ids!r} accepted; page 0 now holds block bytes {bufs[0][:8].tolist()}")


def test_restore_refuses_float_block_ids(setup: Any) -> None:
    """restore([0.5, 1.5]) -> writes blocks 0 and 1 (distinctness is checked after truncation)."""
    eng, planes = setup
    _bufs, pages = _pages(2)
    with pytest.raises(CopyArgumentError):
        eng.restore(pages, planes, [0.5, 1.5]).wait(10)


def test_save_refuses_unordered_block_ids(setup: Any) -> None:
    """A set has no order: page i gets whatever block iteration yields (block 1 for {3, 1})."""
    eng, planes = setup
    bufs, pages = _pages(2)
    with pytest.raises(CopyArgumentError):
        eng.save(planes, {3, 1}, pages).wait(10)
        pytest.fail(f"set accepted: page 0 holds block {bufs[0][0] // 8}, page 1 block {bufs[1][0] // 8}")


def test_generator_block_ids_raise_a_typed_error(setup: Any) -> None:
    """A one-shot iterable of valid ids dies in zip(strict=True) with a bare ValueError."""
    eng, planes = setup
    _bufs, pages = _pages(1)
    with pytest.raises(CopyArgumentError):
        eng.save(planes, (b for b in [1]), pages).wait(10)


@pytest.mark.parametrize("dst", [None, [None], [5]], ids=["None", "[None]", "[5]"])
def test_bad_host_pages_raise_copy_argument_error(dst: Any) -> None:
    planes = KVPlanes.from_arrays(LAYOUT, [np.ones((4, 8), np.uint8)] * 2)
    with CpuCopyEngine() as eng, pytest.raises(CopyArgumentError):
        eng.save(planes, [1], dst)


def test_gate_opened_with_no_transfers_after_close_still_opens() -> None:
    """_HostGate._open_after([]) queues its ev.set on the engine's restore worker.  After
    close() that worker has exited, so the job never runs; the leak finalizer was detached
    too, so the host stream is held forever.  (HostKVCache hands open_after an empty list
    when a gated restore copied nothing, e.g. its engine.restore raised ClosedError.)"""
    eng = CpuCopyEngine()
    stream = HostStream()
    gate = eng.gate(stream)
    eng.close()
    gate.open_after([])
    ran = threading.Event()
    stream.enqueue(ran.set)
    assert ran.wait(3), "host stream still held by a gate that was opened"


def test_save_after_a_closed_host_stream_is_refused_and_the_engine_goes_on() -> None:
    """A mark on a closed HostStream was dropped and the save job waited for it on the save
    worker for good (every later save too, and close() joining it)."""
    arrays = [np.ones((4, 8), np.uint8), np.ones((4, 8), np.uint8)]
    planes = KVPlanes.from_arrays(LAYOUT, arrays)
    stream = HostStream()
    stream.close()
    buf = np.zeros(LAYOUT.page_nbytes, np.uint8)
    page = [[HostRegion(0, memoryview(buf), int(buf.ctypes.data), False)]]
    with CpuCopyEngine() as eng:
        with pytest.raises(ClosedError):
            eng.save(planes, [0], page, after=stream)
        assert eng.save(planes, [1], page).wait(10)
    with pytest.raises(ClosedError):
        stream.enqueue(lambda: None)


def test_object_arrays_are_not_kv_memory() -> None:
    """An object array's bytes are pointers: a restore into it wrote page bytes over them (the
    process died on the next read), and a 1-D one raised AttributeError."""
    with pytest.raises(CopyArgumentError, match="objects"):
        KVPlanes.from_arrays(LAYOUT, [np.empty((4, 8), dtype=object)] * 2)
    with pytest.raises(CopyArgumentError):
        KVPlanes.from_arrays(LAYOUT, [np.empty(4, dtype=object)] * 2)
    with pytest.raises(CopyArgumentError):
        KVPlanes.from_arrays(LAYOUT, [np.zeros(32, np.uint8)] * 2)
