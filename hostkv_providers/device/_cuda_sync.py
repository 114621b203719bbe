"""How the CUDA copy engine's transfers complete and order other streams: the transfer handle
(:class:`_CudaHandle`, events per transfer and per layer), the event reaper (events destroyed on a
worker, never in a finalizer on an engine's thread), stream marks (``save(after=)``) and gates (a
stream held back on a device-visible flag until the copies it waits for are issued, then behind
their events; only with ``CudaCopyEngine(stream_gates=True)``: see its caveat).  The issuing
side is :mod:`hostkv_providers.device._cuda_engine`."""

from __future__ import annotations

import collections
import contextlib
import ctypes
import functools
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from hostkv_providers._errors import CopyEngineError
from hostkv_providers.device import _cuda
from hostkv_providers.device._engine import _stream_handle
from hostkv_providers.device._order import Gate, StreamMark, _open_leaked
from hostkv_providers.device._transfer import TransferHandle, _GroupHandle, _JobHandle, _LayerHandle

if TYPE_CHECKING:
    from hostkv_providers.device._cuda_engine import CudaCopyEngine


class _CudaHandle(_JobHandle):
    """Completion is the CUDA event ``done_event``, recorded by the issuing worker; a layer-wise
    restore also records ``layer_events[i]`` behind the last scatter of layer ``i``."""

    def __init__(self, nbytes: int, engine: CudaCopyEngine, num_layers: int | None = None) -> None:
        super().__init__(nbytes)
        self._engine = engine
        self._dev = engine._dev
        self.num_layers = num_layers
        self.start_event: Any = None
        self.done_event: Any = None
        self.layer_events: list[Any] | None = None  # None: every layer completes with done_event
        # Set by the worker once layer i's event is recorded: an engine's layer 0 need not wait
        # for the worker to issue the copies of every later layer (~0.1 ms of Python per chunk).
        self._recorded: list[threading.Event] | None = None
        self._rec_lock = threading.Lock()
        self._rec_callbacks: dict[int, list[Callable[[], None]]] = {}
        self._finished = False
        self.keep: object = None  # host buffers and planes, released once finished
        self._reaper = engine._reaper
        self._finalizer: weakref.finalize[Any, Any] | None = None

    def _set_events(self, start: Any, done: Any, layers: list[Any] | None = None) -> None:
        self.start_event, self.done_event, self.layer_events = start, done, layers
        if self._finalizer is not None:
            self._finalizer()  # events of an issue begun before and given up (destroyed on a worker)
        # (the layer list is read when the handle goes: events added to it later go too)
        self._finalizer = weakref.finalize(self, _bury_events, self._reaper, start, done, layers)
        self._finalizer.atexit = False

    def _query(self, event: Any = None) -> bool:
        d = _cuda.driver()
        with self._dev.scope():
            (err,) = d.cuEventQuery(self.done_event if event is None else event)
        if int(err) == int(d.CUresult.CUDA_ERROR_NOT_READY):
            return False
        _cuda.check((err,), "transfer")
        return True

    def _layer_ev(self, layer: int) -> Any:
        # Only called once that layer is recorded (or everything is issued).
        evs = self.layer_events
        return self.done_event if evs is None else evs[layer]

    def _recorded_flag(self, layer: int) -> threading.Event:
        rec = self._recorded
        return self._issued if rec is None else rec[layer]

    def _fail(self, exc: BaseException) -> None:
        super()._fail(exc)
        for layer in range(len(self._recorded or ())):
            self._set_recorded(layer)  # layer waiters wake and see the error

    def _set_recorded(self, layer: int) -> None:
        """Worker side: layer ``layer``'s event is recorded; run what waited for that."""
        assert self._recorded is not None
        with self._rec_lock:
            self._recorded[layer].set()
            fns = self._rec_callbacks.pop(layer, [])
        for fn in fns:
            fn()

    def _when_recorded(self, layer: int, fn: Callable[[], None]) -> bool:
        """Run ``fn()`` on the worker once layer ``layer``'s event is recorded: ``False`` (and
        nothing registered) when it is recorded already."""
        if self._recorded is None:
            return False
        with self._rec_lock:
            if self._recorded[layer].is_set():
                return False
            self._rec_callbacks.setdefault(layer, []).append(fn)
            return True

    def layer_event(self, layer: int) -> Any:
        self._check_layer(layer)
        self._recorded_flag(layer).wait()
        self._raise()
        return self._layer_ev(layer)

    def layer_done(self, layer: int) -> bool:
        self._check_layer(layer)
        if not self._recorded_flag(layer).is_set():
            return False
        if self._error is not None:
            return True
        try:
            return self._query(self._layer_ev(layer))
        except CopyEngineError as exc:
            self._error = exc
            return True

    def wait_layer(self, layer: int, timeout: float | None = None) -> bool:
        self._check_layer(layer)
        if self._recorded is None and self._issued.is_set():
            return self.wait(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._recorded_flag(layer).wait(timeout):
            return False
        self._raise()
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        return self._wait_event(self._layer_ev(layer), left)

    def wait_layer_on(self, layer: int, stream: Any) -> None:
        self._check_layer(layer)
        s = _stream_handle(stream, "stream")
        if s is None:
            self.wait_layer(layer)
            return
        if self._recorded is not None and not self._recorded[layer].is_set() and self._engine.stream_gates:
            # Not recorded yet: gate the stream now, open it from the worker (no host blocking).
            self._engine.gate(stream).open_after([self.layer(layer)])
            return
        # (otherwise: wait until the worker recorded it, then an order CUDA sees)
        ev = self.layer_event(layer)
        with self._dev.scope():
            _cuda.check(_cuda.driver().cuStreamWaitEvent(s, ev, 0), "cuStreamWaitEvent")

    def _try_wait_layer_on(self, layer: int, stream: Any) -> bool:
        """:meth:`wait_layer_on` when layer ``layer`` is recorded already: one ``cuStreamWaitEvent``
        (``False`` and nothing done otherwise, or for a failed transfer)."""
        flag = self._recorded_flag(layer)
        if not flag.is_set() or self._error is not None:
            return False
        s = _stream_handle(stream, "stream")
        if s is None:
            return False
        with self._dev.scope():
            _cuda.check(_cuda.driver().cuStreamWaitEvent(s, self._layer_ev(layer), 0), "cuStreamWaitEvent")
        return True

    def _try_wait_on(self, stream: Any) -> bool:
        if not self._issued.is_set() or self._error is not None:
            return False
        s = _stream_handle(stream, "stream")
        if s is None:
            return False
        with self._dev.scope():
            _cuda.check(_cuda.driver().cuStreamWaitEvent(s, self.done_event, 0), "cuStreamWaitEvent")
        return True

    def layer_seconds(self, layer: int) -> float | None:
        self._check_layer(layer)
        if self.layer_events is None or not self.layer_done(layer) or self._error is not None:
            return None
        try:
            with self._dev.scope():
                ms = _cuda.check(_cuda.driver().cuEventElapsedTime(self.start_event, self.layer_events[layer]),
                                 "elapsed")
        except CopyEngineError:
            return None
        return float(ms) / 1e3

    def _wait_event(self, event: Any, timeout: float | None) -> bool:
        """Block until ``event`` (recorded) completes; ``False`` when ``timeout`` passed first."""
        if timeout is None:
            try:
                with self._dev.scope():
                    _cuda.check(_cuda.driver().cuEventSynchronize(event), "transfer")
            except CopyEngineError as exc:
                self._error = exc
                raise
            return True
        deadline = time.monotonic() + timeout
        pause = 5e-5
        while True:
            try:
                if self._query(event):
                    return True
            except CopyEngineError as exc:
                self._error = exc
                raise
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(pause, left))
            pause = min(pause * 2, 2e-3)

    def _finish(self) -> None:
        if not self._finished:
            self._finished = True
            self.keep = None
            try:
                with self._dev.scope():
                    ms = _cuda.check(_cuda.driver().cuEventElapsedTime(self.start_event, self.done_event),
                                     "elapsed")
                self._seconds = float(ms) / 1e3
            except CopyEngineError:
                self._seconds = None

    def done(self) -> bool:
        if not self._issued.is_set():
            return False
        if self._error is not None:
            return True
        try:
            if not self._query():
                return False
        except CopyEngineError as exc:
            self._error = exc
            return True
        self._finish()
        return True

    def wait(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._issued.wait(timeout):
            return False
        self._raise()
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not self._wait_event(self.done_event, left):
            return False
        self._finish()
        return True

    @property
    def seconds(self) -> float | None:
        return self._seconds if self._finished else None

    @property
    def event(self) -> Any:
        """The completion ``CUevent``; blocks until the worker has recorded it (enqueue only)."""
        self._issued.wait()
        self._raise()
        return self.done_event

    def wait_on(self, stream: Any) -> None:
        s = _stream_handle(stream, "stream")
        if s is None:
            self.wait()
            return
        ev = self.event
        with self._dev.scope():
            _cuda.check(_cuda.driver().cuStreamWaitEvent(s, ev, 0), "cuStreamWaitEvent")


def _bury_events(reaper: _Reaper, start: Any, done: Any, layers: list[Any] | None) -> None:
    reaper.bury([start, done, *(ev for ev in layers or () if ev is not None)])


def _destroy_events(dev: _cuda.Device, events: list[Any]) -> None:
    # Destroying an event whose record is still pending is allowed: the driver frees it later.
    try:
        d = _cuda.driver()
        with dev.scope():
            for ev in events:
                if ev is not None:
                    d.cuEventDestroy(ev)
    except Exception:  # finalizers must not raise
        pass


class _Reaper:
    """Events of collected handles and marks, destroyed on the engine's own worker threads.

    A handle's events live as long as the handle (a caller may still make a stream wait on
    ``handle.event``), so they go in its finalizer — which runs on whichever thread collects the
    handle: often the engine's decode thread, in a garbage-collection pass.  A driver call there
    (a context push and ``cuEventDestroy``, which can wait on the driver's lock while a worker
    issues copies) stalled decode steps: 2 of the 6 graph-mode steps over 8.5 ms during saves on
    the H200.  The finalizer only queues the events; a worker destroys them before its next job."""

    def __init__(self, dev: _cuda.Device) -> None:
        self._dev = dev
        self._dead: collections.deque[Any] = collections.deque()
        self._lock = threading.Lock()
        self._closed = False

    def bury(self, events: list[Any]) -> None:
        """Finalizer side (any thread): no driver call unless the engine is closed."""
        with self._lock:
            if not self._closed:
                self._dead.extend(events)
                return
        _destroy_events(self._dev, events)

    def reap(self) -> None:
        """Worker side (its context current): destroy what was buried."""
        d = _cuda.driver()
        dead = self._dead
        while dead:
            try:
                ev = dead.popleft()
            except IndexError:
                return
            if ev is not None:
                d.cuEventDestroy(ev)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            rest = list(self._dead)
            self._dead.clear()
        _destroy_events(self._dev, rest)


class _CudaMark(StreamMark):
    """An event recorded on the caller's stream at call time (destroyed with the mark)."""

    def __init__(self, reaper: _Reaper, event: Any) -> None:
        self.event = event
        self._finalizer = weakref.finalize(self, reaper.bury, [event])
        self._finalizer.atexit = False

    def wait_in(self, stream: Any) -> None:
        _cuda.check(_cuda.driver().cuStreamWaitEvent(stream, self.event, 0), "cuStreamWaitEvent(mark)")


_FLAG_SLOTS = 1024


class _FlagPool:
    """32-bit flags in mapped, page-locked host memory for :class:`_CudaGate`.

    A gated stream waits (``cuStreamWaitValue32``, GEQ 1) on its slot; the gate is opened by
    ``cuStreamWriteValue32`` on the gate stream behind the copies' completion events (a write
    with the default memory barrier: every copy before it is complete and visible), or by a plain
    host store when there is nothing to wait for.  Host memory, not device memory, so that the
    host can always open a gate (failure paths need no CUDA call) and see which ones are open.
    A slot is reused only once the waiting stream has passed its wait (an event recorded right
    behind the wait on that stream): resetting it earlier would hold that stream forever.

    Each opening gets a stream of its own (:meth:`opener`): its waits on copy events and its
    write, nothing else queued there.  On one shared stream a gate's opening waited behind every
    earlier opening's copies, and those copies may themselves wait for the later gate: a
    ``restore(before=s)`` still being issued, then ``save(after=s)`` (its copies behind the
    restore's gate on ``s``) and the save's ``wait_on(s)`` (a gate opened once the save is
    issued, queued first) held each other for ever (found in review, session 18).
    """

    def __init__(self, dev: _cuda.Device) -> None:
        self._dev = dev
        self._lock = threading.Lock()
        self._blocks: list[tuple[int, Any]] = []  # (host address, ctypes array)
        self._free: list[tuple[Any, int, int]] = []  # (array, slot, device address)
        self._busy: list[tuple[Any, int, int, Any]] = []  # (array, slot, device address, passed event)
        # the openers: streams (and an event recorded behind each one's last write) in use, idle
        self._openers_busy: list[tuple[Any, Any]] = []
        self._openers_idle: list[tuple[Any, Any]] = []
        # shared by openings only when no stream of their own can be made (see opener())
        self.stream = dev.stream(low_priority=False)  # (openers must not queue behind copies)
        self.closed = False  # then gates open by a host store (close() has set every busy flag)

    def opener(self) -> tuple[Any, Any]:
        """A stream for one gate's opening with nothing else of this pool queued on it (one whose
        last opening is complete, or a new one: as many as openings are pending at once), and
        its event; ``(self.stream, None)`` only when no stream can be made (openings queued
        there wait behind each other again, which can deadlock as the class docstring says;
        better than failing the gate).  The caller holds the lock and the device's scope, and
        hands the pair to :meth:`opened_on` once the opening is enqueued, or to
        :meth:`discard` when enqueueing it failed."""
        d = _cuda.driver()
        if self._openers_busy:
            keep: list[tuple[Any, Any]] = []
            for pair in self._openers_busy:
                (err,) = d.cuEventQuery(pair[1])
                (self._openers_idle if int(err) == int(d.CUresult.CUDA_SUCCESS) else keep).append(pair)
            self._openers_busy = keep
        if self._openers_idle:
            return self._openers_idle.pop()
        try:
            stream = self._dev.stream(low_priority=False)
        except CopyEngineError:
            return self.stream, None
        try:
            return stream, self._dev.event()
        except CopyEngineError:
            d.cuStreamDestroy(stream)
            return self.stream, None

    def opened_on(self, stream: Any, event: Any) -> None:
        """After an opening was enqueued on ``stream`` (from :meth:`opener`): track it until its
        write is done.  Never raises (the opening is enqueued; a failure here only retires the
        stream)."""
        if event is None:
            return
        try:
            _cuda.check(_cuda.driver().cuEventRecord(event, stream), "cuEventRecord(opened)")
        except Exception:
            self.discard(stream, event)
            return
        self._openers_busy.append((stream, event))

    def discard(self, stream: Any, event: Any) -> None:
        """Retire an opener (its work, if any, still runs: a stream destroyed with work pending
        is freed once that work is done).  Never raises."""
        if event is None:
            return
        d = _cuda.driver()
        with contextlib.suppress(Exception):
            d.cuEventDestroy(event)
        with contextlib.suppress(Exception):
            d.cuStreamDestroy(stream)

    def _grow(self) -> None:
        with self._dev.scope():
            host = _cuda.host_alloc(4 * _FLAG_SLOTS, mapped=True)
            dptr = _cuda.host_device_pointer(host)
        arr = (ctypes.c_uint32 * _FLAG_SLOTS).from_address(host)
        self._blocks.append((host, arr))
        self._free.extend((arr, i, dptr + 4 * i) for i in range(_FLAG_SLOTS))

    def _recycle(self) -> None:
        d = _cuda.driver()
        keep = []
        for item in self._busy:
            arr, slot, dptr, passed = item
            if arr[slot] == 0:
                keep.append(item)
                continue
            (err,) = d.cuEventQuery(passed)
            if int(err) == int(d.CUresult.CUDA_SUCCESS):
                d.cuEventDestroy(passed)
                self._free.append((arr, slot, dptr))
            else:
                keep.append(item)
        self._busy = keep

    def gate(self, stream: int) -> _CudaGate:
        d = _cuda.driver()
        with self._lock, self._dev.scope():
            if len(self._busy) >= 64:
                self._recycle()
            if not self._free:
                self._recycle()
                if not self._free:
                    self._grow()
            arr, slot, dptr = self._free.pop()
            arr[slot] = 0
            try:
                _cuda.check(d.cuStreamWaitValue32(stream, dptr, 1,
                                                  int(d.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ)),
                            "cuStreamWaitValue32")
            except CopyEngineError:
                self._free.append((arr, slot, dptr))
                raise
            passed = None
            try:
                passed = self._dev.event()
                _cuda.check(d.cuEventRecord(passed, stream), "cuEventRecord(gate)")
            except CopyEngineError:
                arr[slot] = 1  # the wait is enqueued already: never leave the stream held (slot not reused)
                if passed is not None:
                    d.cuEventDestroy(passed)
                raise
            self._busy.append((arr, slot, dptr, passed))
        return _CudaGate(self, arr, slot, dptr)

    def close(self, problems: list[str]) -> None:
        d = _cuda.driver()
        with self._lock:
            self.closed = True
            for arr, slot, _dptr, _passed in self._busy:
                arr[slot] = 1  # never leave a stream of the engine's held by a closed engine
            for st, ev in [*self._openers_busy, *self._openers_idle, (self.stream, None)]:
                (err,) = d.cuStreamSynchronize(st)
                if int(err):
                    problems.append(f"gate stream: {_cuda._error_text(err)}")
                if ev is not None:
                    d.cuEventDestroy(ev)
                d.cuStreamDestroy(st)
            self._openers_busy.clear()
            self._openers_idle.clear()
            for *_rest, passed in self._busy:
                d.cuEventDestroy(passed)
            self._busy.clear()
            # The flag memory stays mapped: a stream of the engine's may still read a slot.


def _set_flag(arr: Any, slot: int) -> None:
    arr[slot] = 1


class _CudaGate(Gate):
    def __init__(self, pool: _FlagPool, arr: Any, slot: int, dptr: int) -> None:
        super().__init__()
        self._pool = pool
        self._arr = arr
        self._slot = slot
        self._dptr = dptr
        # (the callback must not hold the gate: a bound method would keep it alive for ever, and
        # a gate dropped shut would never be opened; a host store needs no CUDA call, so it may
        # run on whichever thread collects the gate)
        self._finalizer = weakref.finalize(self, _open_leaked, functools.partial(_set_flag, arr, slot))
        self._finalizer.atexit = False

    def _open_now(self) -> None:
        self._finalizer.detach()
        _set_flag(self._arr, self._slot)

    def _open_after(self, handles: list[TransferHandle]) -> None:
        self._finalizer.detach()
        d = _cuda.driver()
        pool = self._pool
        flat: list[TransferHandle] = []
        for h in handles:
            flat.extend(h.handles if isinstance(h, _GroupHandle) else [h])
        for h in flat:
            if (isinstance(h, _LayerHandle) and isinstance(h.parent, _CudaHandle)
                    and h.parent._when_recorded(h.index, lambda: self._open_after(handles))):
                # That layer's event is not recorded yet: try again from the worker once it is,
                # rather than block this thread until the worker got that far.
                return
        written = False
        try:
            events = [h.event for h in flat]
            with pool._dev.scope(), pool._lock:
                if pool.closed:  # (no stream to open behind: the copies are over, close() synchronized)
                    _set_flag(self._arr, self._slot)
                    return
                stream, opened = pool.opener()  # (nothing else of the pool's queued there)
                try:
                    for ev in events:
                        if ev is not None:
                            _cuda.check(d.cuStreamWaitEvent(stream, ev, 0), "cuStreamWaitEvent(gate)")
                    _cuda.check(d.cuStreamWriteValue32(stream, self._dptr, 1,
                                                       int(d.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT)),
                                "cuStreamWriteValue32")
                    written = True
                except BaseException:
                    pool.discard(stream, opened)
                    raise
                pool.opened_on(stream, opened)  # (never raises)
        except Exception:
            # A failed copy (or a broken context): the engine's stream must not hang.  What was
            # copied is reported by the handles' errors.  Never once the write behind the copies
            # is enqueued: that would open the gate before them.
            if not written:
                _set_flag(self._arr, self._slot)
