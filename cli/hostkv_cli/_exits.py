"""Exit codes and the mapping from the library's typed errors to them.

The codes are part of the CLI's public contract (docs/cli.md, RELIABILITY.md S5): scripts and
cron jobs branch on them, so a code never changes meaning.
"""

from __future__ import annotations

import enum

import hostkv_providers as hk

__all__ = ["CLIError", "ExitCode", "exit_code_for"]


class ExitCode(enum.IntEnum):
    """Process exit statuses of ``hostkv``."""

    OK = 0
    #: verify (or copy/demo) found corrupt entries or wrong bytes; CorruptStoreError.
    INTEGRITY = 1
    #: bad arguments, bad URL, unknown provider, unsupported operation, missing store.
    USAGE = 2
    #: another process holds the store (writer lock) or the key is in flight.
    BUSY = 3
    #: refused: loose permissions, foreign owner, symlinks, foreign format/version.
    REFUSED = 4
    #: anything else: an I/O fault, a bug. The message is printed, never a traceback
    #: (set HOSTKV_DEBUG=1 to get one).
    INTERNAL = 5


class CLIError(Exception):
    """An error detected by the CLI itself, with its exit code and an optional hint."""

    def __init__(self, message: str, code: ExitCode = ExitCode.USAGE, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.hint = hint


# Order matters: the first matching class wins, so subclasses come before their bases.
_MAPPING: tuple[tuple[type[BaseException], ExitCode], ...] = (
    (hk.errors.LockedError, ExitCode.BUSY),
    (hk.errors.InFlightError, ExitCode.BUSY),
    (hk.errors.StoreNotFoundError, ExitCode.USAGE),  # a missing store (before its base class)
    (hk.errors.UnsafeStoreError, ExitCode.REFUSED),
    (hk.errors.IncompatibleStoreError, ExitCode.REFUSED),
    (hk.CorruptStoreError, ExitCode.INTEGRITY),
    (hk.errors.UnknownProviderError, ExitCode.USAGE),
    (hk.InvalidArgumentError, ExitCode.USAGE),  # SpanError included
    (hk.errors.UnknownKeyError, ExitCode.USAGE),
    (hk.CapacityError, ExitCode.USAGE),
    (hk.errors.NoSpaceError, ExitCode.INTERNAL),
    (hk.errors.StorageIOError, ExitCode.INTERNAL),
)


def exit_code_for(exc: BaseException) -> ExitCode:
    """The exit status for an exception raised while running a command."""
    if isinstance(exc, CLIError):
        return exc.code
    for cls, code in _MAPPING:
        if isinstance(exc, cls):
            return code
    return ExitCode.INTERNAL
