"""Issue 16 item 14: budgets the machine cannot hold, and salt tags a tier cannot store.

A persistent store's ``budget=`` beyond the free space of its filesystem warns
(:class:`~hostkv_providers.errors.BudgetWarning`); an in-memory budget beyond physical memory is
refused before anything is allocated; a tiered store refuses up front a salt tag its slow tier
could not record (it used to accept it, return ``True`` from ``put`` and lose the page at
write-back).  Each test failed on the code before the fix (no warning, accepted, lost)."""

from __future__ import annotations

import os
import urllib.parse
import warnings
from pathlib import Path

import pytest

import hostkv_providers as hk
from hostkv_providers.errors import BudgetWarning, InvalidArgumentError
from hostkv_providers.providers import PinnedProvider
from hostkv_providers.testing import key_of, page_bytes


def _free(path: Path) -> int:
    vfs = os.statvfs(path)
    return vfs.f_bavail * vfs.f_frsize


def _beyond(path: Path) -> str:
    """A budget (in MiB, as a URL size) well beyond the free space of ``path``'s filesystem."""
    return f"{(_free(path) * 4) // (1 << 20) + (1 << 20)}MiB"


def _small_files(scheme: str) -> str:
    return "slot=16KiB&file_size=1MiB" if scheme == "mmap" else "file_size=1MiB"


@pytest.mark.parametrize("scheme", ["mmap", "lmdb"])
def test_disk_budget_beyond_free_space_warns(tmp_path: Path, scheme: str) -> None:
    store = tmp_path / "s"
    with pytest.warns(BudgetWarning, match="exceeds what the filesystem"):
        p = hk.open(f"{scheme}://{store}?budget={_beyond(tmp_path)}&{_small_files(scheme)}")
    try:  # a warning, not a refusal: the store works (the disk may be freed later)
        key = key_of(f"budget/{scheme}")
        assert p.put(key, None, page_bytes(key, 16384))
        assert p.read_bytes(key) == page_bytes(key, 16384)
    finally:
        p.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error", BudgetWarning)
        # a budget that fits, and a read-only open (it sets no budget), do not warn
        hk.open(f"{scheme}://{store}?budget=8MiB").close()
        hk.open(f"{scheme}://{store}", readonly="true").close()


def test_tiered_budget_beyond_free_disk_warns_through_its_slow_tier(tmp_path: Path) -> None:
    slow = urllib.parse.quote(f"lmdb://{tmp_path / 's'}?budget={_beyond(tmp_path)}&file_size=1MiB", safe="")
    with pytest.warns(BudgetWarning):
        t = hk.open(f"tiered://?fast=pinned%3A%2F%2F%3Fbudget%3D4MiB%26pin%3Dno&slow={slow}")
    t.close()


def test_pinned_budget_beyond_physical_memory_is_refused() -> None:
    """``pinned://?budget=100TiB`` on a 24 GiB machine was accepted and its arena filler then
    allocated until it failed; now refused before any allocation."""
    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")

    class _NoAllocation:
        pinned = False
        calls = 0

        def allocate(self, nbytes: int) -> object:
            self.calls += 1
            raise AssertionError("allocated for a budget that was to be refused")

    alloc = _NoAllocation()
    with pytest.raises(InvalidArgumentError, match="exceeds this machine's memory"):
        PinnedProvider(physical + 64 * 1024, allocator=alloc, background=True)  # type: ignore[arg-type]
    assert alloc.calls == 0
    with pytest.raises(InvalidArgumentError):
        hk.open("pinned://?budget=100TiB&pin=no")


@pytest.mark.parametrize(("scheme", "bound"), [("mmap", 16), ("lmdb", 255)])
def test_salt_tag_the_slow_tier_cannot_store_is_refused_up_front(tmp_path: Path, scheme: str, bound: int) -> None:
    """Over mmap (a 16-byte tag field) a 17-byte or lone-surrogate tag was accepted by tiered,
    ``put()`` returned True, the write-back failed and the page vanished."""
    slow = urllib.parse.quote(f"{scheme}://{tmp_path / 's'}?budget=8MiB&{_small_files(scheme)}", safe="")
    t = hk.open(f"tiered://?fast=pinned%3A%2F%2F%3Fbudget%3D4MiB%26pin%3Dno&slow={slow}")
    try:
        key = key_of(f"tiered-long-tag/{scheme}")
        for tag in ("x" * (bound + 1), "\ud800", "\u00e9" * (bound // 2 + 1)):
            with pytest.raises(InvalidArgumentError):
                t.put(key, None, bytes(4096), salt_tag=tag)
            with pytest.raises(InvalidArgumentError):
                t.put_many([(key, None, bytes(4096))], salt_tag=tag)  # type: ignore[attr-defined]
            with pytest.raises(InvalidArgumentError):
                t.reserve(key, None, 4096, salt_tag=tag)
        assert t.present([key]) == [False] and t.stats().in_flight == 0
        assert t.put(key, None, page_bytes(key, 4096), salt_tag="x" * bound)
        assert t.flush(30)
        assert t.slow.read_bytes(key) == page_bytes(key, 4096)  # type: ignore[attr-defined]
    finally:
        t.close()
