"""Transfer handles: what a copy engine returns at once for an asynchronous copy."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

from hostkv_providers._errors import (
    CopyEngineError,
)

# ============================================================================================
# Handles
# ============================================================================================


class TransferHandle:
    """An asynchronous page transfer.

    ``done()`` polls; ``wait(timeout)`` blocks (``True`` when finished, ``False`` when the
    timeout elapsed) and raises :class:`CopyEngineError` if the transfer failed.  ``nbytes`` is the
    page bytes moved; ``seconds`` the measured transfer time (device time for CUDA), available once
    done.  For CUDA transfers ``event`` is the completion event (a ``CUevent``) and
    ``wait_on(stream)`` makes a stream wait for it without blocking the host; for host transfers
    ``wait_on`` simply waits.
    """

    nbytes: int

    def done(self) -> bool:
        raise NotImplementedError

    def wait(self, timeout: float | None = None) -> bool:
        raise NotImplementedError

    @property
    def seconds(self) -> float | None:
        """Measured seconds of the transfer, ``None`` until it is done (or if it failed)."""
        raise NotImplementedError

    @property
    def event(self) -> Any:
        """The CUDA completion event, or ``None`` for host transfers."""
        return None

    def wait_on(self, stream: Any) -> None:
        """Order ``stream`` after this transfer (host transfers: block until done)."""
        self.wait()

    @property
    def gbps(self) -> float | None:
        """Achieved GB/s (10^9 bytes per second), once done."""
        s = self.seconds
        return None if not s else self.nbytes / s / 1e9


class _JobHandle(TransferHandle):
    """A handle whose work is carried out by an engine worker thread."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._issued = threading.Event()  # the worker finished its part (host: the copy itself)
        self._error: BaseException | None = None
        self._seconds: float | None = None

    def _fail(self, exc: BaseException) -> None:
        self._error = exc
        self._issued.set()

    def _raise(self) -> None:
        if self._error is not None:
            if isinstance(self._error, CopyEngineError):
                raise self._error
            raise CopyEngineError(f"transfer failed: {self._error!r}") from self._error


class _CpuHandle(_JobHandle):
    def done(self) -> bool:
        return self._issued.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        if not self._issued.wait(timeout):
            return False
        self._raise()
        return True

    @property
    def seconds(self) -> float | None:
        return self._seconds if self._issued.is_set() and self._error is None else None


class _GroupHandle(TransferHandle):
    """Several transfers seen as one (used by :class:`StagingPool`)."""

    def __init__(self, handles: Sequence[TransferHandle]) -> None:
        self.handles = list(handles)
        self.nbytes = sum(h.nbytes for h in self.handles)

    def done(self) -> bool:
        return all(h.done() for h in self.handles)

    def wait(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        for h in self.handles:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not h.wait(left):
                return False
        return True

    @property
    def seconds(self) -> float | None:
        secs = [h.seconds for h in self.handles]
        if any(s is None for s in secs):
            return None
        return sum(s for s in secs if s is not None)

    def wait_on(self, stream: Any) -> None:
        for h in self.handles:
            h.wait_on(stream)
