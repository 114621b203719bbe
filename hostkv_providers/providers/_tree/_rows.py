"""The tree index's rows and flights: the row handle's bit layout in the LRU heap, the key map's
sort key, and the few Python objects of in-flight reservations (one per page, run or batch)."""

from __future__ import annotations

from typing import TypedDict

import numpy as np
import numpy.typing as npt

from hostkv_providers._keys import Key

_ROW_BITS = 32
_ROW_MASK = (1 << _ROW_BITS) - 1


def key_u64(key: bytes) -> int:
    """The key's first 8 bytes as an int: the sort key of the bulk-loaded key map."""
    return int.from_bytes(key[:8], "little")


class IndexStats(TypedDict):
    """:meth:`TreeIndex.stats_fields`: keyword arguments of :class:`~hostkv_providers.ProviderStats`."""

    entries: int
    used_bytes: int
    anchors: int
    leased: int
    in_flight: int
    evictions: int
    evicted_bytes: int
    retained: int
    retained_bytes: int

class _Flight:
    # The parent's generation too: if the parent row is dropped (corrupt) and recycled for another
    # entry, commit/cancel must not touch that other entry's pins.  A *chained* flight names a
    # parent that was itself in flight (``pkey``): ``parent`` stays -1 until the parent's commit
    # hands it the parent's row (with a hold); a parent cancelled first leaves it orphaned.
    __slots__ = ("chained", "cost", "parent", "parent_gen", "pkey")

    def __init__(self, parent: int, cost: int, parent_gen: int, pkey: Key | None = None,
                 chained: bool = False) -> None:
        self.parent = parent
        self.cost = cost
        self.parent_gen = parent_gen
        self.pkey = pkey
        self.chained = chained


class _Run:
    """A chain run reserved in one go (:meth:`TreeIndex.begin_run`): ``keys[i]``'s parent is
    ``keys[i - 1]``, ``keys[0]``'s the run's parent.  Every key maps to this one object in
    ``flights``, and its attributes are a ``_Flight``'s *for the run's root*, so the rules that
    look a flight up by key (in flight?, chained children adopted at the parent's commit, the
    in-flight cost summed over ``flights.values()``: ``cost`` is per page) hold unchanged.  One
    object per run instead of one per page: no per-page Python objects on a save's hot path."""

    __slots__ = ("chained", "cost", "keys", "open", "parent", "parent_gen", "pkey")

    def __init__(self, keys: list[Key], parent: int, cost: int, parent_gen: int, pkey: Key | None,
                 chained: bool) -> None:
        self.keys = keys
        self.parent = parent
        self.cost = cost
        self.parent_gen = parent_gen
        self.pkey = pkey
        self.chained = chained
        self.open = True


class _Batch(_Run):
    """A batch of pages reserved in one go (:meth:`TreeIndex.begin_batch`): a forest, not only a
    chain.  ``ppos[i]`` is the position of ``keys[i]``'s parent in the batch (always ``< i``) or
    -1; ``prow[i]``/``pgen[i]`` name a parent that was already sealed (a row held by the batch,
    once per page under it) or -1.  Like a :class:`_Run`, every key maps to this one object in
    ``flights`` with ``cost`` per page; its root attributes (``parent``, ``chained`` ...) are
    those of a flight without a parent, so the rules that look a flight up by key hold
    unchanged.  What ``put_many`` of a file store reserves per chunk: no object per page."""

    __slots__ = ("ninner", "nparents", "pgen", "ppos", "prow")

    def __init__(self, keys: list[Key], cost: int, ppos: npt.NDArray[np.int64], prow: npt.NDArray[np.int64],
                 pgen: npt.NDArray[np.uint64], nparents: int, ninner: int) -> None:
        super().__init__(keys, -1, cost, 0, None, False)
        self.ppos = ppos
        self.prow = prow
        self.pgen = pgen
        self.nparents = nparents  # pages under a sealed parent
        self.ninner = ninner  # pages under a parent in the batch
