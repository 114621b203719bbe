"""The mmap store's in-memory index: the shared :class:`~hostkv_providers.providers.TreeIndex`
(numpy columns, leaf-LRU eviction, holds, retained entries, the budget guard) plus the columns
that place an entry in the slot files, and the bulk load from the journal/snapshot records."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from hostkv_providers.providers._tree import TreeIndex

from ._format import _TAG_MAX


@dataclass(slots=True)
class _Anchor:
    file: int
    slot: int
    nslots: int
    nbytes: int
    gen: int
    checksum: int
    cost: int


class _Index(TreeIndex):
    """The tree index with the mmap placement columns (file, slot, nslots) and the salt tag in
    the record's fixed 16-byte field.  Reopening a million-entry store fills the columns from
    the records in one vectorised pass (:meth:`load_columns`): no Python object per entry."""

    COLS = (
        *TreeIndex.COLS, ("file", np.int64, 0), ("slot", np.int64, 0), ("nslots", np.int64, 0),
        ("tag", "V16", None), ("tag_len", np.uint8, 0),
    )
    file: npt.NDArray[np.int64]
    slot: npt.NDArray[np.int64]
    nslots: npt.NDArray[np.int64]
    tag: npt.NDArray[Any]
    tag_len: npt.NDArray[np.uint8]
    # memoryviews of the placement columns (TreeIndex._views makes one per numeric column)
    m_file: Any
    m_slot: Any

    def tag_of(self, row: int) -> str:
        n = int(self.tag_len[row])
        raw: bytes = self.tag[row].tobytes()
        return raw[:n].decode("utf-8", "replace")

    def _set_tag(self, row: int, tag: str | bytes) -> None:
        raw = tag.encode("utf-8") if isinstance(tag, str) else tag
        self.tag[row] = raw.ljust(_TAG_MAX, b"\0")
        self.tag_len[row] = len(raw)

    def _set_tags(self, rows: npt.NDArray[np.int64] | slice, tag: str | bytes) -> None:
        raw = tag.encode("utf-8") if isinstance(tag, str) else tag
        self.tag[rows] = np.void(raw.ljust(_TAG_MAX, b"\0"))
        self.tag_len[rows] = len(raw)

    # -- bulk load -------------------------------------------------------------------------------
    def load_columns(self, L: npt.NDArray[np.uint64], parent_rows: npt.NDArray[np.int64],
                     costs: npt.NDArray[np.int64], base_k64: npt.NDArray[np.uint64],
                     base_row: npt.NDArray[np.int64],
                     retained: npt.NDArray[np.bool_] | None = None) -> None:
        """Replace the contents by the live records ``L`` (uint64 columns, keys unique, parents
        resolved to column positions, prefix-closed); ``base_k64``/``base_row`` is the key map
        (first 8 key bytes, sorted, and the row of each); ``retained``: the rows' marks."""
        n = L.shape[1]
        self.reset(n)
        if n:
            self.key[:n] = np.ascontiguousarray(L[1:5].T).view("V32").reshape(n)
            self.tag[:n] = np.ascontiguousarray(L[9:11].T).view("V16").reshape(n)
        self.parent[:n] = parent_rows
        self.nslots[:n] = (L[0] >> np.uint64(32)).astype(np.int64)
        self.tag_len[:n] = np.minimum((L[0] >> np.uint64(16)) & np.uint64(0xFF), _TAG_MAX).astype(np.uint8)
        self.file[:n] = (L[13] & np.uint64(0xFFFFFFFF)).astype(np.int64)
        self.slot[:n] = (L[13] >> np.uint64(32)).astype(np.int64)
        self.nbytes[:n] = L[14].astype(np.int64)
        self.gen[:n] = L[15]
        self.csum[:n] = L[16]
        self.has_csum[:n] = True
        self.created[:n] = L[17].view(np.float64)
        self.used[:n] = self.created[:n]
        self.tick[:n] = L[18].astype(np.int64)
        self.cost[:n] = costs
        self.alive[:n] = True
        if retained is not None:
            self.retained[:n] = retained
        self.set_key_map(base_k64, base_row)
        self._next_gen = max(self._next_gen, int(self.gen[:n].max()) + 1 if n else 1)
        self.finish_load()
