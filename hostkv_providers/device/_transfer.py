"""Transfer handles: what a copy engine returns at once for an asynchronous copy."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from hostkv_providers._errors import (
    CopyArgumentError,
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

    Per-layer completion (a restore issued with ``layerwise=True``): :meth:`layer_event`,
    :meth:`layer_done`, :meth:`wait_layer` and :meth:`wait_layer_on` are the same four for the
    bytes of layer ``i`` of every page only (every plane slice whose ``PlaneSpec.layer`` is ``i``).
    A transfer that was not issued layer by layer completes every layer at once: the layer
    methods then mean the whole transfer, so an engine that waits per layer is always correct,
    only earlier where the engine could deliver earlier.  ``num_layers`` is the layout's layer
    count (``None`` where unknown); ``layers`` the layers the transfer moves (``None``: all of
    them; a restore with ``layers=``).  Asking for a layer outside ``[0, num_layers)`` or outside
    ``layers`` raises :class:`~hostkv_providers.errors.CopyArgumentError`: a transfer never
    reports a layer it does not write as complete.
    """

    nbytes: int
    num_layers: int | None = None
    layers: range | None = None

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

    def _try_wait_on(self, stream: Any) -> bool:
        """Order ``stream`` after this transfer if that needs neither the host to block nor a
        gate (its completion event is already recorded); ``False``: nothing was done."""
        return False

    @property
    def gbps(self) -> float | None:
        """Achieved GB/s (10^9 bytes per second), once done."""
        s = self.seconds
        return None if not s else self.nbytes / s / 1e9

    # -- per-layer completion (the whole transfer unless an engine knows better) -----------------
    def _check_layer(self, layer: int) -> int:
        if type(layer) is not int or layer < 0 or (self.num_layers is not None and layer >= self.num_layers):
            span = "a non-negative int" if self.num_layers is None else f"an int in [0, {self.num_layers})"
            raise CopyArgumentError(f"layer must be {span}, got {layer!r}")
        if self.layers is not None and layer not in self.layers:
            raise CopyArgumentError(f"this transfer moves layers [{self.layers.start}, {self.layers.stop}), "
                                    f"not layer {layer}")
        return layer

    def moves_layer(self, layer: int) -> bool:
        """Whether this transfer writes layer ``layer`` (every transfer does, unless ``layers=``)."""
        return self.layers is None or layer in self.layers

    def layer_event(self, layer: int) -> Any:
        """The CUDA event that completes layer ``layer`` (``None`` for host transfers)."""
        self._check_layer(layer)
        return self.event

    def layer_done(self, layer: int) -> bool:
        """Whether layer ``layer`` of every page is in place (or the transfer failed)."""
        self._check_layer(layer)
        return self.done()

    def wait_layer(self, layer: int, timeout: float | None = None) -> bool:
        """Block until layer ``layer`` of every page is in place (:meth:`wait`'s rules)."""
        self._check_layer(layer)
        return self.wait(timeout)

    def wait_layer_on(self, layer: int, stream: Any) -> None:
        """Order ``stream`` after layer ``layer`` of this transfer (host transfers: block)."""
        self._check_layer(layer)
        self.wait_on(stream)

    def layer_seconds(self, layer: int) -> float | None:
        """Device seconds from the transfer's start to layer ``layer`` in place (layer-wise CUDA
        restores, once that layer is done; else ``None``)."""
        self._check_layer(layer)
        return None

    def layer(self, layer: int) -> TransferHandle:
        """Layer ``layer`` of this transfer as a handle of its own (``done``/``wait``/``event``/
        ``wait_on`` mean that layer): what a stream gate opens behind."""
        return _LayerHandle(self, self._check_layer(layer))


class _LayerHandle(TransferHandle):
    """One layer of a transfer, seen as a transfer (:meth:`TransferHandle.layer`)."""

    def __init__(self, parent: TransferHandle, layer: int) -> None:
        self.parent = parent
        self.index = layer
        self.nbytes = parent.nbytes // parent.num_layers if parent.num_layers else parent.nbytes

    def done(self) -> bool:
        return self.parent.layer_done(self.index)

    def wait(self, timeout: float | None = None) -> bool:
        return self.parent.wait_layer(self.index, timeout)

    @property
    def seconds(self) -> float | None:
        return None

    @property
    def event(self) -> Any:
        return self.parent.layer_event(self.index)

    def wait_on(self, stream: Any) -> None:
        self.parent.wait_layer_on(self.index, stream)

    def _try_wait_on(self, stream: Any) -> bool:
        try_layer = getattr(self.parent, "_try_wait_layer_on", None)
        return bool(try_layer is not None and try_layer(self.index, stream))

    def layer(self, layer: int) -> TransferHandle:
        raise CopyArgumentError("a layer of a transfer has no layers of its own")

    def _on_done(self, fn: Callable[[], None]) -> None:
        on_done = getattr(self.parent, "_on_done", None)
        if on_done is None:
            raise AttributeError("_on_done")  # pragma: no cover - only host transfers have it
        on_done(fn, self.index)


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
    """A host copy; with ``layerwise`` each layer's flag is set once that layer of every page is
    copied (the copy then runs layer-major).  Callbacks (:meth:`_on_done`) let a host gate open
    behind a layer without waiting in the worker's queue behind the rest of the copy."""

    def __init__(self, nbytes: int, num_layers: int | None = None, layerwise: bool = False) -> None:
        super().__init__(nbytes)
        self.num_layers = num_layers
        n = num_layers if layerwise and num_layers else 0
        self._layers: list[threading.Event] | None = [threading.Event() for _ in range(n)] if n else None
        self._cb_lock = threading.Lock()
        self._callbacks: dict[int | None, list[Callable[[], None]]] = {}

    def _flag(self, layer: int | None) -> threading.Event:
        return self._issued if layer is None or self._layers is None else self._layers[layer]

    def _on_done(self, fn: Callable[[], None], layer: int | None = None) -> None:
        """Run ``fn()`` once the transfer (``layer`` of it) is complete or failed; now if it is."""
        flag = self._flag(layer)
        with self._cb_lock:
            if not flag.is_set():
                self._callbacks.setdefault(None if self._layers is None else layer, []).append(fn)
                return
        fn()

    def _set(self, layer: int | None) -> None:
        """Worker side: ``layer`` (``None``: the whole transfer, every layer) is complete."""
        with self._cb_lock:
            if layer is None:
                for ev in self._layers or ():
                    ev.set()
                self._issued.set()
                fns = [fn for group in self._callbacks.values() for fn in group]
                self._callbacks.clear()
            else:
                self._flag(layer).set()
                fns = self._callbacks.pop(layer, [])
        for fn in fns:
            fn()

    def _fail(self, exc: BaseException) -> None:
        self._error = exc
        self._set(None)

    def done(self) -> bool:
        return self._issued.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        if not self._issued.wait(timeout):
            return False
        self._raise()
        return True

    def layer_done(self, layer: int) -> bool:
        self._check_layer(layer)
        return self._flag(layer).is_set()

    def wait_layer(self, layer: int, timeout: float | None = None) -> bool:
        self._check_layer(layer)
        if not self._flag(layer).wait(timeout):
            return False
        self._raise()
        return True

    def wait_layer_on(self, layer: int, stream: Any) -> None:
        self.wait_layer(layer)

    @property
    def seconds(self) -> float | None:
        return self._seconds if self._issued.is_set() and self._error is None else None


class _GroupHandle(TransferHandle):
    """Several transfers seen as one (used by :class:`StagingPool`)."""

    def __init__(self, handles: Sequence[TransferHandle]) -> None:
        self.handles = list(handles)
        self.nbytes = sum(h.nbytes for h in self.handles)
        counts = {h.num_layers for h in self.handles}
        self.num_layers = counts.pop() if len(counts) == 1 else None
        spans = {h.layers for h in self.handles}
        self.layers = spans.pop() if len(spans) == 1 else None

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

    def _try_wait_on(self, stream: Any) -> bool:
        return all(h._try_wait_on(stream) for h in self.handles)

    def layer(self, layer: int) -> TransferHandle:
        return _GroupHandle([h.layer(layer) for h in self.handles])

    def layer_done(self, layer: int) -> bool:
        return all(h.layer_done(layer) for h in self.handles)

    def wait_layer(self, layer: int, timeout: float | None = None) -> bool:
        return self.layer(layer).wait(timeout)

    def wait_layer_on(self, layer: int, stream: Any) -> None:
        for h in self.handles:
            h.wait_layer_on(layer, stream)
