"""Every error the library raises, rooted at :class:`HostKVError`.

Each class also inherits the matching builtin (``KeyError``, ``ValueError``, ``OSError`` ...) and
carries a one-line ``hint`` the CLI prints.
"""

from __future__ import annotations

from hostkv_providers._errors import (
    BudgetWarning,
    CapacityError,
    ClosedError,
    CopyArgumentError,
    CopyEngineError,
    CorruptStoreError,
    HostKVError,
    IncompatibleStoreError,
    IncompleteWriteError,
    InFlightError,
    InvalidArgumentError,
    LockedError,
    NoSpaceError,
    ReservationError,
    RetainedError,
    SpanError,
    StorageIOError,
    StoreNotFoundError,
    UnknownKeyError,
    UnknownProviderError,
    UnsafeStoreError,
    UsedAfterForkError,
)

__all__ = [
    "BudgetWarning",
    "CapacityError",
    "ClosedError",
    "CopyArgumentError",
    "CopyEngineError",
    "CorruptStoreError",
    "HostKVError",
    "InFlightError",
    "IncompatibleStoreError",
    "IncompleteWriteError",
    "InvalidArgumentError",
    "LockedError",
    "NoSpaceError",
    "ReservationError",
    "RetainedError",
    "SpanError",
    "StorageIOError",
    "StoreNotFoundError",
    "UnknownKeyError",
    "UnknownProviderError",
    "UnsafeStoreError",
    "UsedAfterForkError",
]
