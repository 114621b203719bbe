"""Host memory seam: ordinary allocations and the transparent-huge-page advice."""

from __future__ import annotations

import mmap
import pathlib
import threading
import time

import pytest

from hostkv_providers._errors import InvalidArgumentError
from hostkv_providers.device._hostmem import (
    OrdinaryAllocation,
    OrdinaryAllocator,
    advise_huge_pages,
    buffer_address,
    copy_bytes,
)


def _thp_mode() -> str | None:
    try:
        text = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    return text[text.index("[") + 1 : text.index("]")] if "[" in text else None


def test_advice_taken_where_the_kernel_offers_thp() -> None:
    mm = mmap.mmap(-1, 4 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        took = advise_huge_pages(mm)
        if getattr(mmap, "MADV_HUGEPAGE", None) is not None and _thp_mode() in ("always", "madvise"):
            assert took is True
        else:
            assert took is False
        # advice never changes contents: fresh anonymous memory reads as zeros and keeps writes
        assert mm[: 1 << 20] == bytes(1 << 20)
        mm[5:9] = b"abcd"
        assert mm[5:9] == b"abcd"
    finally:
        mm.close()


@pytest.mark.parametrize("huge", [True, False])
def test_ordinary_allocation_round_trip(huge: bool) -> None:
    alloc = OrdinaryAllocator(huge_pages=huge).allocate(3 << 20)
    try:
        view = alloc.view
        assert len(view) == 3 << 20 and not alloc.pinned
        assert alloc.address == buffer_address(view)
        view[-4:] = b"tail"
        assert bytes(view[-4:]) == b"tail" and bytes(view[:8]) == bytes(8)
    finally:
        alloc.close()
    with pytest.raises(InvalidArgumentError):
        _ = alloc.view
    alloc.close()  # idempotent


def test_ordinary_allocation_refuses_bad_sizes() -> None:
    for bad in (0, -1):
        with pytest.raises(InvalidArgumentError):
            OrdinaryAllocation(bad)


@pytest.mark.parametrize("nbytes", [0, 1, 4096, (64 << 10) - 1, 64 << 10, (1 << 20) + 3])
def test_copy_bytes_copies_exactly(nbytes: int) -> None:
    src = memoryview(bytes((i * 7 + 3) % 251 for i in range(nbytes)))
    dst = bytearray(nbytes + 16)
    copy_bytes(memoryview(dst)[8 : 8 + nbytes], src)
    assert dst[:8] == bytes(8) and dst[8 + nbytes :] == bytes(8)
    assert dst[8 : 8 + nbytes] == src


def test_copy_bytes_lets_other_threads_run_during_a_big_copy() -> None:
    """A saver's page copy must not stall an engine's Python thread (the GIL is released)."""
    src = memoryview(bytearray(128 << 20))
    dst = memoryview(bytearray(128 << 20))
    for _attempt in range(3):  # a loaded machine may not schedule the other thread at once
        stop = threading.Event()
        stamps: list[float] = []

        def spin(stop: threading.Event = stop, stamps: list[float] = stamps) -> None:
            while not stop.is_set():
                stamps.append(time.perf_counter())

        t = threading.Thread(target=spin)
        t.start()
        time.sleep(0.02)
        t0 = time.perf_counter()
        copy_bytes(dst, src)
        t1 = time.perf_counter()
        stop.set()
        t.join()
        if any(t0 < s < t1 for s in stamps):
            return
    pytest.fail("no other thread ran during three 128 MiB copies: the GIL was held")
