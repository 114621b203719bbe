"""A piece of host memory holding part of an entry: what providers hand out and copy engines DMA.

Its own module so the device layer and the providers share the type without importing each other.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from hostkv_providers._errors import InvalidArgumentError

__all__ = ["HostPages", "HostRegion"]


@dataclass(frozen=True, slots=True)
class HostRegion:
    """A piece of host memory holding bytes ``[offset, offset + len(view))`` of one entry.

    ``address`` is the virtual address of ``view[0]`` (for DMA); ``pinned`` says whether the
    memory is page-locked and registered with the GPU driver, so a copy engine may DMA to/from it
    without staging.
    """

    offset: int
    view: memoryview
    address: int
    pinned: bool


class HostPages:
    """Many whole pages, each one contiguous piece of host memory, as one chunk-level object.

    ``addresses[i]`` (a ``uint64`` numpy array) is where page ``i`` starts; every page is
    ``page_nbytes`` long.  Copy engines take it wherever they take per-page region lists, without
    a Python object per page on the hot path (per-page objects that live through a transfer end up
    in the collector's oldest generation and set off full collections in the engine's process).
    ``keepalive`` holds whatever keeps the memory valid (a lease) until the transfer is done.
    ``checksums`` (a ``uint64`` array, one per page, in ``algorithm``) are the pages' stored
    checksums when the provider hands them out with its views: a restore verifies the copied
    bytes against them on the GPU (``None``: not known).
    """

    __slots__ = ("addresses", "algorithm", "checksums", "keepalive", "page_nbytes", "pinned", "readonly")

    def __init__(self, addresses: Any, page_nbytes: int, *, pinned: bool, readonly: bool,
                 keepalive: object = None, checksums: Any = None, algorithm: str | None = None) -> None:
        import numpy as np

        arr = np.ascontiguousarray(addresses, dtype=np.uint64)
        if arr.ndim != 1:
            raise InvalidArgumentError("page addresses must be a one-dimensional array")
        if type(page_nbytes) is not int or page_nbytes <= 0:
            raise InvalidArgumentError(f"page_nbytes must be a positive int, got {page_nbytes!r}")
        if arr.size and int(arr.min()) <= 0:
            raise InvalidArgumentError("page addresses must be positive")
        self.addresses = arr
        self.page_nbytes = page_nbytes
        self.pinned = pinned
        self.readonly = readonly
        self.keepalive = keepalive
        self.checksums = None if checksums is None else np.ascontiguousarray(checksums, dtype=np.uint64)
        if self.checksums is not None and self.checksums.shape != arr.shape:
            raise InvalidArgumentError("give one checksum per page")
        self.algorithm = algorithm

    def __len__(self) -> int:
        return int(self.addresses.size)

    def __getitem__(self, index: slice) -> HostPages:
        if not isinstance(index, slice):
            raise InvalidArgumentError("HostPages is sliced by ranges of pages")
        return HostPages(self.addresses[index], self.page_nbytes, pinned=self.pinned, readonly=self.readonly,
                         keepalive=self.keepalive,
                         checksums=None if self.checksums is None else self.checksums[index], algorithm=self.algorithm)

    def __iter__(self) -> Iterator[tuple[tuple[int], tuple[int], tuple[int]]]:
        """Per-page ``((0,), (address,), (page_nbytes,))``: only for slow paths (one page at a time)."""
        n = self.page_nbytes
        for a in self.addresses.tolist():
            yield (0,), (a,), (n,)
