"""Stream order: marks (a stream's position, captured at call time) and gates (a stream held back
until the copies behind it are done), for CUDA streams' host twin and the no-op."""

from __future__ import annotations

import contextlib
import queue
import threading
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from hostkv_providers._errors import ClosedError, CopyArgumentError
from hostkv_providers.device._transfer import TransferHandle, _LayerHandle

# ============================================================================================
# Stream order: marks (a stream's position, captured now) and gates (a stream held back)
# ============================================================================================


class StreamMark:
    """A position in a stream's work, captured on the caller's thread at call time.

    A save handed ``after=mark`` reads the blocks as every kernel queued on that stream before
    the mark left them, however late the save's copies are issued.  Built by
    :meth:`CopyEngine.mark`.
    """

    def wait_in(self, stream: Any) -> None:  # pragma: no cover - abstract
        """Engine side: make the engine's own ``stream`` (or worker) wait for the mark."""
        raise NotImplementedError


class Gate:
    """Holds a stream back: work enqueued on it after :meth:`CopyEngine.gate` returned runs only
    once the gate is opened.  The caller's thread never blocks on it.

    The side that issues the copies calls :meth:`open_after` with their handles (the stream then
    waits for those copies to be complete) or, when there is nothing to wait for,
    :meth:`open_now`.  Every gate must be opened exactly once: a gate that is garbage-collected
    shut is opened with a warning (a stream held forever would hang the engine).
    """

    def __init__(self) -> None:
        self._opened = False
        self._lock = threading.Lock()

    @property
    def opened(self) -> bool:
        return self._opened

    def _claim(self) -> bool:
        with self._lock:
            if self._opened:
                return False
            self._opened = True
            return True

    def open_after(self, handles: Sequence[TransferHandle] | TransferHandle) -> None:
        """Open once every transfer in ``handles`` (one handle, or a sequence of them) is
        complete (non-blocking).  The argument is checked before the gate counts as opened: a
        bad one must not leave the stream held for good."""
        if isinstance(handles, TransferHandle):
            got = [handles]
        elif isinstance(handles, Sequence) and all(callable(getattr(h, "wait", None)) for h in handles):
            got = list(handles)
        else:
            raise CopyArgumentError(f"open_after takes transfer handles, got {type(handles).__name__}")
        if self._claim():
            self._open_after(got)

    def open_now(self) -> None:
        """Open at once (nothing to wait for, or the transfers could not be issued)."""
        if self._claim():
            self._open_now()

    def _open_after(self, handles: list[TransferHandle]) -> None:
        raise NotImplementedError

    def _open_now(self) -> None:
        raise NotImplementedError


class _NoGate(Gate):
    """The gate of ``stream=None``: there is nothing to hold back."""

    def __init__(self) -> None:
        super().__init__()
        self._opened = True

    def _open_after(self, handles: list[TransferHandle]) -> None:
        pass

    def _open_now(self) -> None:
        pass


class _Worker:
    """One FIFO worker thread: runs submitted jobs in order."""

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            job()

    def submit(self, job: Callable[[], None]) -> bool:
        """Queue ``job``; ``False`` (and nothing queued) once the worker is stopped: a job put
        behind the stop would never run, and whoever waits for it would wait for good."""
        with self._lock:
            if self._stopped:
                return False
            self._queue.put(job)
            return True

    def stop(self) -> None:
        with self._lock:
            if not self._stopped:
                self._stopped = True
                self._queue.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join()



class HostStream:
    """A FIFO of host jobs run in order on one thread: the CPU copy engine's stand-in for a CUDA
    stream, so the cache's ordering logic (``restore(before=)``, ``save(after=)``) runs and is
    tested without a GPU.  ``enqueue(fn)`` queues a job (a "kernel"); ``synchronize()`` waits
    for everything queued so far.  A job that raises is recorded in ``errors``."""

    def __init__(self, name: str = "hostkv-host-stream") -> None:
        self._worker = _Worker(name)
        self.errors: list[BaseException] = []

    def enqueue(self, fn: Callable[[], object]) -> None:
        """Queue ``fn``; :class:`ClosedError` on a closed stream (a job dropped there would leave
        whatever waits for it — a save's ``after=`` mark — waiting for good)."""
        def job() -> None:
            try:
                fn()
            except BaseException as exc:  # a failed job must not stop the stream
                self.errors.append(exc)

        if not self._worker.submit(job):
            raise ClosedError("this HostStream is closed")

    def synchronize(self, timeout: float | None = None) -> bool:
        done = threading.Event()
        if not self._worker.submit(done.set):
            return True  # closed: everything queued before has run
        return done.wait(timeout)

    def close(self) -> None:
        self._worker.stop()


class _HostMark(StreamMark):
    def __init__(self, stream: HostStream) -> None:
        self.reached = threading.Event()
        stream.enqueue(self.reached.set)

    def wait_in(self, stream: Any) -> None:
        self.reached.wait()


class _HostGate(Gate):
    def __init__(self, stream: HostStream, worker: _Worker) -> None:
        super().__init__()
        self._event = threading.Event()
        self._worker = worker
        ev = self._event
        stream.enqueue(ev.wait)
        self._finalizer = weakref.finalize(self, _open_leaked, ev.set)

    def _open_after(self, handles: list[TransferHandle]) -> None:
        self._finalizer.detach()
        ev = self._event
        hooks = [getattr(h, "_on_done", None) for h in handles]
        if handles and all(callable(hook) for hook in hooks) and all(
                not isinstance(h, _LayerHandle) or callable(getattr(h.parent, "_on_done", None)) for h in handles):
            # Host transfers say when they (or one layer of them) are done: the stream opens then,
            # not behind the rest of a layer-wise copy in the worker's queue.
            left = [len(handles)]
            lock = threading.Lock()

            def one() -> None:
                with lock:
                    left[0] -= 1
                    last = left[0] == 0
                if last:
                    ev.set()

            for hook in hooks:
                hook(one)  # type: ignore[misc]
            return

        def job() -> None:
            for h in handles:
                with contextlib.suppress(Exception):  # a failed copy still opens the stream
                    h.wait()
            ev.set()

        if not self._worker.submit(job):  # behind the copies on the same FIFO worker
            # the engine is closed (its worker gone): wait for the transfers off it instead
            threading.Thread(target=job, name="hostkv-gate-open", daemon=True).start()

    def _open_now(self) -> None:
        self._finalizer.detach()
        self._event.set()


def _open_leaked(open_fn: Callable[[], None]) -> None:
    warnings.warn("a stream gate was dropped without being opened; opened now", RuntimeWarning, stacklevel=2)
    open_fn()
