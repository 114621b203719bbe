"""The error hierarchy.

Every error the library raises on purpose derives from :class:`HostKVError` and also from the
builtin exception it most resembles, so callers that already catch ``KeyError`` or ``OSError``
keep working.  Each class carries a one-line ``hint`` that the CLI prints under the message.

A *miss* is never an exception: ``present``/``read``/``get_anchor`` report it as a value.
Exceptions are for misuse, capacity, corruption of a whole store, identity mismatches and I/O
faults.
"""

from __future__ import annotations

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


class HostKVError(Exception):
    """Root of every error raised by hostkv-providers.

    Parameters
    ----------
    message:
        What went wrong, in one sentence.
    hint:
        What the caller can do about it; defaults to the class's ``default_hint``.
    """

    default_hint = "see the hostkv-providers documentation"

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint if hint is not None else self.default_hint

    def __str__(self) -> str:
        return self.message

    def __reduce__(self) -> tuple[object, ...]:  # keep errors picklable across processes
        return (_rebuild, (type(self), self.message, self.hint))


def _rebuild(cls: type[HostKVError], message: str, hint: str) -> HostKVError:
    return cls(message, hint=hint)


class InvalidArgumentError(HostKVError, ValueError):
    """A value passed to the API is malformed (wrong key length, negative size, bad option)."""

    default_hint = "check the argument against the method's documented contract"


class SpanError(InvalidArgumentError):
    """A :class:`ByteSpan` is malformed or does not fit the entry it addresses."""

    default_hint = "spans are half-open [offset, offset+nbytes) and must lie inside the entry"


class RetainedError(InvalidArgumentError):
    """An explicit ``evict`` named a retained entry, or an ancestor of one (``SupportsRetain``)."""

    default_hint = "unretain the entries first (Provider.unretain, or hostkv unretain)"


class UnknownKeyError(HostKVError, KeyError):
    """An operation needs an entry that is not stored (e.g. a parent for ``reserve``)."""

    default_hint = "store the parent page first; chains are saved root first"

    def __str__(self) -> str:  # KeyError quotes its argument; keep the plain message
        return self.message


class CapacityError(HostKVError):
    """A reservation cannot be satisfied even by evicting every evictable entry.

    Nothing was evicted when this is raised.
    """

    default_hint = "raise the budget, release leases, or save fewer pages at once"


class InFlightError(HostKVError):
    """The key is reserved by another writer and not sealed yet.

    The caller may wait for it (``Provider.wait_sealed``) instead of writing it twice.
    """

    default_hint = "wait for the other writer's seal instead of writing the page again"

    def __init__(self, message: str, *, key: bytes, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.key = key

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild_inflight, (self.message, self.key, self.hint))


def _rebuild_inflight(message: str, key: bytes, hint: str) -> InFlightError:
    return InFlightError(message, key=key, hint=hint)


class ReservationError(HostKVError, RuntimeError):
    """A reservation was misused: written past its end, used after seal/abort, or foreign."""

    default_hint = "a reservation is written, then sealed or aborted exactly once"


class IncompleteWriteError(ReservationError):
    """``seal`` was called before every byte of the reservation was written."""

    default_hint = "write every byte of the entry before sealing, or abort it"


class ClosedError(HostKVError, RuntimeError):
    """The provider (or copy engine) was closed."""

    default_hint = "open the provider again"


class UsedAfterForkError(HostKVError, RuntimeError):
    """The object was created in a parent process and used in a forked child."""

    default_hint = "open a new provider in the child process after fork()"


class StorageIOError(HostKVError, OSError):
    """The storage medium failed (EIO, a failed fsync, a vanished file)."""

    default_hint = "check the device and the filesystem; stored pages stay intact"


class NoSpaceError(StorageIOError):
    """The filesystem is full (ENOSPC)."""

    default_hint = "free disk space or lower the budget; writes resume once space is free"


class LockedError(HostKVError, BlockingIOError):
    """Another process holds the store's writer lock."""

    default_hint = "only one writer process may open this store; open it read-only or stop the other"


class IncompatibleStoreError(HostKVError, ValueError):
    """The store's format version, key algorithm or geometry does not match this build/config."""

    default_hint = "open it with the matching version/options, or copy it with `hostkv copy`"


class StoreNotFoundError(IncompatibleStoreError):
    """The location holds no store of this provider (a read-only open, or an open that must not
    create one: an empty or unrelated directory)."""

    default_hint = "check the path; only `hostkv copy` (its destination), `bench` and `demo` create stores"


class CorruptStoreError(HostKVError, OSError):
    """Store metadata (manifest, index) is damaged beyond automatic recovery."""

    # (not "run verify --repair": most of these refuse the open, and repair opens the store the
    # same way, so it failed the same way; issue 16 item 15)
    default_hint = ("nothing was changed; `hostkv verify --repair` fixes damaged entries of a store that opens, "
                    "not a damaged file that refuses the open: restore that file from a backup, or remove the store")


class UnsafeStoreError(HostKVError, PermissionError):
    """The store is not safe to open: foreign owner, loose permissions, or a symlink inside."""

    default_hint = "fix ownership/permissions (dirs 0700, files 0600) or use another path"


class UnknownProviderError(HostKVError, LookupError):
    """No installed provider handles the URL's scheme."""

    default_hint = "run `hostkv providers` to list the installed providers"


class CopyEngineError(HostKVError, RuntimeError):
    """A device copy failed (a CUDA error, a bad pointer, a size mismatch)."""

    default_hint = "check device pointers, sizes and that the engine is open"


class CopyArgumentError(CopyEngineError, InvalidArgumentError):
    """A copy request is malformed: bad pointers, sizes, block ids or host-region coverage.

    It is both a :class:`CopyEngineError` and an :class:`InvalidArgumentError` (``ValueError``),
    so callers may catch either.
    """

    default_hint = "check the KV planes, block ids and that the host regions cover each page exactly"


class BudgetWarning(UserWarning):
    """A budget that the medium cannot hold today: a persistent store's ``budget=`` beyond the
    free space of its filesystem (writes will fail with :class:`NoSpaceError` once the disk is
    full, long before the budget is reached).  A warning, not an error: the disk may be freed
    later, and a store reopened with its old budget must still open.  (A budget beyond the
    machine's physical memory for an in-memory provider is refused with
    :class:`InvalidArgumentError` instead: that memory can never exist.)"""
