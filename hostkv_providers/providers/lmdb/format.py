"""The ``lmdb://`` store's record format, public (documented in ``docs/providers/lmdb.md``).

For tools that read or build stores without the provider (the million-entry open benchmark
writes a store's LMDB databases directly): the store identity, the names of the databases and
the packed records of the ``entries`` and ``meta/counters`` keys.  Re-exported from the
provider's private modules, so a format change is a change of these documented names too.
"""

from __future__ import annotations

from hostkv_providers.providers.lmdb._format import _DB_NAMES, STORE_FORMAT, STORE_VERSION
from hostkv_providers.providers.lmdb._format import _Counters as Counters
from hostkv_providers.providers.lmdb._format import _Entry as Entry

__all__ = ["DB_NAMES", "STORE_FORMAT", "STORE_VERSION", "Counters", "Entry"]

#: The named LMDB databases of a store.
DB_NAMES = _DB_NAMES
