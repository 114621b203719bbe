"""A piece of host memory holding part of an entry: what providers hand out and copy engines DMA.

Its own module so the device layer and the providers share the type without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["HostRegion"]


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
