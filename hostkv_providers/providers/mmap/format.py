"""The ``mmap://`` store's on-disk format, public (documented in ``docs/providers/mmap.md``).

For tools that read or build stores without the provider (benchmarks that write a synthetic
million-entry snapshot, an offline inspector): the 160-byte index record, its fold checksum, the
snapshot and journal magics, and the slot-file format the data files share with ``lmdb://``.
The provider itself imports these names from its private modules; this module only re-exports
them, so a change of format is a change of this module's documented names too.
"""

from __future__ import annotations

from typing import Any

import numpy.typing as npt

from hostkv_providers.providers._slotfile import (
    FILE_HEADER_NBYTES,
    FLAG_ANCHOR,
    FLAG_HAS_PARENT,
    SLOT_HEADER_DTYPE,
    SLOT_MAGIC,
    SlotFile,
)
from hostkv_providers.providers.mmap._format import (
    _JOURNAL_MAGIC,
    _SNAP_HEADER,
    _SNAP_MAGIC,
    MMAP_FORMAT,
    MMAP_FORMAT_VERSION,
    OP_ANCHOR,
    OP_DROP,
    OP_SEAL,
    REC_NBYTES,
    RECORD_DTYPE,
    RECORD_FOLD,
    _seal_folds,
    fold64,
)

__all__ = [
    "FILE_HEADER_NBYTES",
    "FLAG_ANCHOR",
    "FLAG_HAS_PARENT",
    "JOURNAL_MAGIC",
    "MMAP_FORMAT",
    "MMAP_FORMAT_VERSION",
    "OP_ANCHOR",
    "OP_DROP",
    "OP_SEAL",
    "RECORD_DTYPE",
    "RECORD_FOLD",
    "REC_NBYTES",
    "SLOT_HEADER_DTYPE",
    "SLOT_MAGIC",
    "SNAP_HEADER_NBYTES",
    "SNAP_MAGIC",
    "SlotFile",
    "fold64",
    "fold_records",
]

#: The first 8 bytes of an index journal (``index.<gen>.journal``).
JOURNAL_MAGIC = _JOURNAL_MAGIC
#: The first 8 bytes of an index snapshot (``index.<gen>.snap``).
SNAP_MAGIC = _SNAP_MAGIC
#: Bytes of a snapshot's header before its first record.
SNAP_HEADER_NBYTES = _SNAP_HEADER


def fold_records(records: npt.NDArray[Any]) -> None:
    """Set the ``fold`` checksum of every record of ``records`` (a ``RECORD_DTYPE`` array), in place."""
    _seal_folds(records)


