"""Host memory seam: ordinary allocations and the transparent-huge-page advice."""

from __future__ import annotations

import mmap
import pathlib

import pytest

from hostkv_providers._errors import InvalidArgumentError
from hostkv_providers._hostmem import OrdinaryAllocation, OrdinaryAllocator, advise_huge_pages, buffer_address


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
