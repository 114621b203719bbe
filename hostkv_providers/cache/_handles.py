"""What the cache hands back: save/restore results, the asynchronous :class:`CacheHandle`, the
leased :class:`CacheHit`, and the cache's counters."""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hostkv_providers._checks import _scatter_buffers, check_timeout, scatter_into
from hostkv_providers._errors import CopyEngineError, InvalidArgumentError, UnknownKeyError
from hostkv_providers._keys import Key
from hostkv_providers._reservation import Lease
from hostkv_providers.metrics import LatencyHistogram

if TYPE_CHECKING:
    from hostkv_providers.cache._cache import HostKVCache


# --------------------------------------------------------------------------------------------
# Results, handles, hits, stats
# --------------------------------------------------------------------------------------------


@dataclass
class SaveResult:
    """What one save did.  ``stored + dedup + coalesced`` is the stored prefix it now certifies."""

    requested: int = 0  # pages passed in
    admitted: int = 0  # pages the admission policy let through
    stored: int = 0  # pages this save copied and sealed
    dedup: int = 0  # pages already stored
    coalesced: int = 0  # pages written by another in-flight save (waited for)
    anchors: int = 0  # anchors attached
    nbytes: int = 0  # bytes copied device -> host
    stopped: str | None = None  # why the save ended early (capacity, a parent evicted ...)


@dataclass
class RestoreResult:
    """What one restore did: ``pages`` leading pages of the hit are in the engine's blocks."""

    pages: int = 0
    nbytes: int = 0
    viewed: int = 0  # pages copied straight from provider memory (zero-copy views)
    staged: int = 0  # pages read through bounce buffers
    stopped: str | None = None  # set when fewer pages than asked were restored
    # hybrid caches (required_anchors=, cache/_hybrid.py): the anchors of page anchor_page, the
    # last usable one; anchor groups not restorable there (the engine resets that state)
    anchors: dict[str, memoryview] = field(default_factory=dict)
    anchor_page: int | None = None
    invalidated: tuple[str, ...] = ()


def _no_wait(_stream: Any) -> bool:
    return False  # a CopyEngineLike's transfer without _try_wait_on: gate it


def engine_gates(engine: Any) -> bool:
    """Whether ``engine`` holds a stream back at once (a host engine, a CUDA engine with
    ``stream_gates=True``) rather than ordering it by events once the copies are issued."""
    return getattr(engine, "gate", None) is not None and bool(getattr(engine, "stream_gates", True))


class CacheHandle:
    """An asynchronous save or restore.  ``done()`` polls, ``wait()`` blocks and returns the
    :class:`SaveResult` / :class:`RestoreResult` (or raises the error the transfer hit).

    Stream order without waiting for the copies: :meth:`wait_on` makes a stream wait for the
    transfer's device copies (a restore: every kernel enqueued on that stream afterwards sees
    the restored bytes; a save: the blocks may be overwritten by kernels enqueued afterwards),
    also when the copies have not been issued yet (the CUDA engine: this thread waits until
    they are issued, then the stream waits on their event; see ``stream_gates``).
    :attr:`event` is the completion event of the copies (a ``CUevent``; ``None`` for host
    copies), available once they are issued.

    Per-layer completion (a restore started with ``layerwise=True``): :meth:`wait_layer_on`,
    :meth:`wait_layer`, :meth:`layer_done` and :meth:`layer_event` are the same for layer ``i``
    of every restored page only, so an engine's layer ``i`` prefill waits for layer ``i``'s bytes
    and no more.  An engine that uses them passes no ``before=`` to the restore (that orders the
    stream behind the whole restore) and calls ``wait_layer_on(i, stream)`` before it enqueues
    layer ``i``'s kernels.  They never report a layer early: where a path cannot complete layers
    one by one (bounce buffers, several copies per hit, a restore without ``layerwise``) a layer
    completes with the whole restore.  Like :meth:`wait_on` they say that the bytes were
    copied; how many pages are valid (a checksum failure truncates the hit) is
    ``wait().pages``, which the engine checks before it keeps what it computed from them.
    """

    def __init__(self, kind: str, engine: Any = None, num_layers: int | None = None) -> None:
        self.kind = kind
        self._engine = engine
        self.num_layers = num_layers
        self._done = threading.Event()
        self._copied = threading.Event()
        self._result: Any = None
        self._error: BaseException | None = None
        self._t0 = time.perf_counter()
        self._t1: float | None = None
        self._callbacks: list[Callable[[CacheHandle], None]] = []
        # The cache's own bookkeeping (claims, counters, lease release, waking coalesced twins):
        # run *before* the handle reads as done, so a caller whose wait() returned sees it all.
        self._finishers: list[Callable[[CacheHandle], None]] = []
        self._lock = threading.Lock()
        # device-copy ordering: transfers issued so far, gates waiting for the last of them
        self._transfers: list[Any] = []
        self._issued_evt = threading.Event()
        self._gates: list[tuple[Any, int | None]] = []  # (gate, layer or None for the whole)
        # layers whose copies are all issued before the rest of the restore's (layer-wise restores)
        self._ready: list[threading.Event] = [threading.Event() for _ in range(num_layers or 0)]

    def done(self) -> bool:
        """Whether the transfer has finished (successfully or not)."""
        return self._done.is_set()

    def copied(self) -> bool:
        """For a save: whether the device blocks have been copied out (the engine may reuse them)."""
        return self._copied.is_set()

    def wait_copied(self, timeout: float | None = None) -> bool:
        """Block until the device blocks have been copied out; ``False`` on timeout."""
        return self._copied.wait(None if timeout is None else check_timeout(timeout))

    def wait(self, timeout: float | None = None) -> Any:
        """Block until done; return the result or raise the transfer's error.

        Raises ``TimeoutError`` if ``timeout`` passes first."""
        if not self._done.wait(None if timeout is None else check_timeout(timeout)):
            raise TimeoutError(f"{self.kind} still running after {timeout} s")
        if self._error is not None:
            raise self._error
        return self._result

    def wait_on(self, stream: Any) -> None:
        """Order ``stream`` after this transfer's device copies, without waiting for them.

        Work enqueued on ``stream`` after this call runs only once the copies are complete,
        whether or not they have been issued yet.  An engine that gates streams (a host engine,
        ``CudaCopyEngine(stream_gates=True)``) holds the stream at once; any other (the CUDA
        engine's default) makes this thread wait until the copies are issued, then the stream
        waits on their event.
        ``stream=None`` waits for the whole transfer (:meth:`wait`)."""
        if stream is None:
            self.wait()
            return
        self._order(stream, None)

    def _issued_flag(self, layer: int | None) -> threading.Event:
        """Set once every copy that writes ``layer`` (``None``: any) is issued."""
        return self._issued_evt if layer is None or not self._ready else self._ready[layer]

    def _order(self, stream: Any, layer: int | None) -> None:
        # A CUDA engine gates a stream (a wait on a device-visible flag) only when asked to
        # (CudaCopyEngine(stream_gates=True)): that order is invisible to CUDA and can hold a
        # stream for good where it shares a hardware queue with the copies.  Otherwise this
        # thread waits until the copies are issued, then the stream waits on their events.
        gate_fn = self._engine.gate if engine_gates(self._engine) else None
        flag = self._issued_flag(layer)
        with self._lock:
            if not flag.is_set() and gate_fn is not None:
                self._gates.append((gate_fn(stream), layer))
                return
        flag.wait()
        transfers = self._layer_transfers(layer)
        if gate_fn is not None:
            # Copies whose events are recorded already need no gate: the stream waits on them
            # (one cuStreamWaitEvent each; a layer-wise restore's layer 0 is recorded at the call).
            if transfers and all(getattr(t, "_try_wait_on", _no_wait)(stream) for t in transfers):
                return
            gate_fn(stream).open_after(transfers)
        else:
            for t in transfers:
                try:
                    t.wait_on(stream)
                except CopyEngineError:
                    # a failed transfer: its error is the restore's (nothing more of it to wait
                    # for); anything else (a stream the engine cannot order) is the caller's
                    if getattr(getattr(t, "parent", t), "_error", None) is None:
                        raise

    def _layer_transfers(self, layer: int | None) -> list[Any]:
        """The transfers a wait for ``layer`` (``None``: everything) waits on: every transfer's
        part of that layer (a transfer that cannot tell its layers apart: all of it)."""
        transfers = list(self._transfers)
        if layer is None:
            return transfers
        out = []
        for t in transfers:
            moves = getattr(t, "moves_layer", None)
            if moves is None:
                out.append(t)  # an engine without per-layer completion: the whole transfer
            elif moves(layer):
                out.append(t.layer(layer))
        return out

    def _check_layer(self, layer: int) -> int:
        n = self.num_layers
        if type(layer) is not int or layer < 0 or (n is not None and layer >= n):
            span = "a non-negative int" if n is None else f"an int in [0, {n})"
            raise InvalidArgumentError(f"layer must be {span}, got {layer!r}")
        return layer

    def wait_layer_on(self, layer: int, stream: Any) -> None:
        """Order ``stream`` after layer ``layer`` of this restore's copies, without waiting for them.

        Work enqueued on ``stream`` after this call runs only once layer ``layer`` of every
        restored page is in the blocks, whether or not the copies have been issued yet (as
        :meth:`wait_on`: with the CUDA engine's default this thread waits until that layer's
        copies are issued).  Layer ``i`` completing implies every layer before it.
        ``stream=None`` blocks until then (:meth:`wait_layer`)."""
        self._check_layer(layer)
        if stream is None:
            self.wait_layer(layer)
            return
        self._order(stream, layer)

    def wait_layer(self, layer: int, timeout: float | None = None) -> bool:
        """Block until layer ``layer`` of every restored page is in the blocks; ``False`` on
        timeout.  Raises the transfer's error if the copies failed."""
        self._check_layer(layer)
        deadline = None if timeout is None else time.monotonic() + check_timeout(timeout)
        if not self._issued_flag(layer).wait(None if deadline is None else max(0.0, deadline - time.monotonic())):
            return False
        for t in self._layer_transfers(layer):
            if not t.wait(None if deadline is None else max(0.0, deadline - time.monotonic())):
                return False
        return True

    def layer_done(self, layer: int) -> bool:
        """Whether layer ``layer`` of every restored page is in the blocks (polls)."""
        self._check_layer(layer)
        if self._done.is_set():
            return True
        return self._issued_flag(layer).is_set() and all(t.done() for t in self._layer_transfers(layer))

    def layer_event(self, layer: int) -> Any:
        """The ``CUevent`` that completes layer ``layer`` (blocks until the copies are issued);
        ``None`` for host copies or when nothing was copied.  One event stands for every copy of
        the restore only because one engine completes its restores in order; prefer
        :meth:`wait_layer_on`, which needs no such reasoning."""
        self._check_layer(layer)
        self._issued_flag(layer).wait()
        for t in reversed(self._layer_transfers(layer)):
            ev = getattr(t, "event", None)
            if ev is not None:
                return ev
        return None

    @property
    def event(self) -> Any:
        """The completion event of the device copies (blocks until they are issued, not until
        they are done); ``None`` for host copies or when nothing was copied."""
        self._issued_evt.wait()
        for t in reversed(self._transfers):
            ev = getattr(t, "event", None)
            if ev is not None:
                return ev  # copies of one direction complete in order: the last one's is enough
        return None

    def _add_transfer(self, transfer: Any) -> None:
        self._transfers.append(transfer)

    def _layers_issued(self, layers: range) -> None:
        """Every copy that writes one of ``layers`` is issued (more copies of other layers may
        follow): open the gates waiting for those layers now."""
        with self._lock:
            for layer in layers:
                self._ready[layer].set()
            gates = [(g, lay) for g, lay in self._gates if lay is not None and lay in layers]
            self._gates = [(g, lay) for g, lay in self._gates if lay is None or lay not in layers]
        for g, layer in gates:
            g.open_after(self._layer_transfers(layer))

    def _all_issued(self) -> None:
        """Every copy of this transfer is issued (or none will be): open the gates behind them."""
        with self._lock:
            if self._issued_evt.is_set():
                return
            self._issued_evt.set()
            for flag in self._ready:
                flag.set()
            gates, self._gates = self._gates, []
        for g, layer in gates:
            g.open_after(self._layer_transfers(layer))

    @property
    def error(self) -> BaseException | None:
        return self._error

    @property
    def nbytes(self) -> int:
        """Bytes moved between device and host (so far)."""
        res = self._result
        return int(res.nbytes) if res is not None else 0

    @property
    def seconds(self) -> float:
        """Wall time from submission to completion (to now while running)."""
        end = self._t1 if self._t1 is not None else time.perf_counter()
        return end - self._t0

    def add_done_callback(self, fn: Callable[[CacheHandle], None]) -> None:
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    def _on_finish(self, fn: Callable[[CacheHandle], None]) -> None:
        """Run ``fn(handle)`` when the transfer finishes, before ``done()``/``wait()`` see it
        (registered by the cache before the transfer is submitted)."""
        self._finishers.append(fn)

    def _finish(self, result: Any, error: BaseException | None = None) -> None:
        self._all_issued()
        self._result = result
        self._error = error
        self._t1 = time.perf_counter()
        # (dropped once run: a finisher's closure holds the save's job, which holds this handle —
        # a reference cycle that only a full collection of the engine's process would free)
        finishers, self._finishers = self._finishers, []
        for fin in finishers:
            try:
                fin(self)
            except BaseException as exc:  # bookkeeping must not leave the handle unfinished
                if self._error is None:
                    self._error = exc
        self._copied.set()
        with self._lock:
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn(self)

    def __repr__(self) -> str:
        state = "done" if self.done() else "running"
        return f"<CacheHandle {self.kind} {state}>"


class CacheHit:
    """A leased prefix of a chain: ``num_pages`` pages that stay stored until :meth:`release`.

    ``keys`` are the usable pages (root first).  With ``need_anchor`` the hit never extends past
    the deepest page carrying that anchor, and :attr:`anchor` gives its bytes there (the state
    the engine resumes from).  The lookup only checks that the anchor is there (the hit's lease
    keeps it): the bytes are read when the engine asks for them, off the admission path —
    :meth:`read_anchor` copies them once, verified, straight into the engine's own buffer.  Use
    as a context manager or call :meth:`release`; a restore started with ``release=True``
    releases it when the copy completes.
    """

    def __init__(self, cache: HostKVCache, keys: Sequence[Key], lease: Lease | None, *, requested: int,
                 stored: int, anchor_name: str | None, anchor_key: Key | None) -> None:
        self._cache = cache
        self.keys: tuple[Key, ...] = tuple(keys)
        self.lease = lease
        self.requested = requested
        self.stored = stored  # stored prefix before cutting back to the anchor
        self.anchor_name = anchor_name
        self._anchor_key = anchor_key  # the page whose anchor the hit resumes from (need_anchor)
        self._anchor_depth = len(self.keys) - 1  # its depth from the root (a lookup's keys start there)
        self._anchor: bytes | None = None
        self._released = lease is None
        # restores that read the pages through this hit's own lease (layer-wise restores): the
        # lease is let go only once the last of them is done, whenever release() is called
        self._readers = 0
        self._hold_lock = threading.Lock()
        self.hybrid: Any = None  # hybrid hook (cache/_hybrid.py): the prefill this miss produces

    @property
    def anchor(self) -> bytes | None:
        """The needed anchor's bytes at the last usable page (``None`` without ``need_anchor`` or
        for a miss); read from the provider on first access, then kept."""
        if self._anchor is None and self._anchor_key is not None and self.anchor_name is not None:
            blob = self._cache.provider.get_anchor(self._anchor_key, self.anchor_name)
            hyb = self._cache._hybrid
            if blob is not None and hyb is not None and hyb.binding:
                # a hybrid cache stores every anchor in its record (depth and format bound):
                # the engine gets the payload, or a miss for a record of another page or format
                payload = hyb.open_record(self.anchor_name, self._anchor_depth, blob)
                blob = None if payload is None else bytes(payload)
            self._anchor = blob
            if self._anchor is None:
                raise UnknownKeyError(
                    f"anchor {self.anchor_name!r} of the hit's last page is gone",
                    hint="read it before releasing the hit (the hit's lease keeps it)")
        return self._anchor

    def read_anchor(self, into: object) -> int:
        """Copy the needed anchor once, checksum-verified, into ``into`` (one writable buffer or a
        list of them, filled in order; ``Provider.read_anchor``) and return its size.  Raises
        ``InvalidArgumentError`` without ``need_anchor`` or for a miss, ``UnknownKeyError`` when
        the anchor is gone (the hit was released)."""
        if self._anchor_key is None or self.anchor_name is None:
            raise InvalidArgumentError("this hit carries no anchor (look it up with need_anchor=)")
        hyb = self._cache._hybrid
        if hyb is not None and hyb.binding:  # the record's payload (see anchor)
            bufs = _scatter_buffers(into)
            payload = self.anchor
            assert payload is not None
            scatter_into(bufs, memoryview(payload))
            return len(payload)
        got = self._cache.provider.read_anchor(self._anchor_key, self.anchor_name, into)
        if got is None:
            raise UnknownKeyError(f"anchor {self.anchor_name!r} of the hit's last page is gone",
                                  hint="read it before releasing the hit (the hit's lease keeps it)")
        return got

    @property
    def num_pages(self) -> int:
        return len(self.keys)

    @property
    def num_tokens(self) -> int:
        return len(self.keys) * self._cache.layout.page_tokens

    def __bool__(self) -> bool:
        return bool(self.keys)

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> None:
        """Unpin the pages (idempotent).  While a restore reads them through this hit's lease
        (``restore(layerwise=True)`` from views), the pages stay pinned until it is done."""
        with self._hold_lock:
            if self._released:
                return
            self._released = True
            if self._readers:
                return  # the last reader lets the lease go
        if self.lease is not None:
            self.lease.release()

    def _hold(self) -> None:
        """A restore reads the pages through this hit's lease from now on (the hit is unreleased)."""
        with self._hold_lock:
            self._readers += 1

    def _unhold(self) -> None:
        with self._hold_lock:
            self._readers -= 1
            go = self._readers == 0 and self._released
        if go and self.lease is not None:
            self.lease.release()

    def __enter__(self) -> CacheHit:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"<CacheHit {self.num_pages}/{self.requested} pages ({self.num_tokens} tokens)>"


class _Latency:
    """Count, sum and a bounded window of recent samples (for quantiles)."""

    def __init__(self, window: int = 2048) -> None:
        self.count = 0
        self.total = 0.0
        self.recent: collections.deque[float] = collections.deque(maxlen=window)
        self.histogram = LatencyHistogram()  # all samples, in buckets (for Prometheus)

    def add(self, seconds: float) -> None:
        self.count += 1
        self.total += seconds
        self.recent.append(seconds)
        self.histogram.observe(seconds)

    def quantile(self, q: float) -> float:
        if not self.recent:
            return 0.0
        data = sorted(self.recent)
        return data[min(len(data) - 1, int(q * len(data)))]


@dataclass
class CacheStats:
    """Counters of one :class:`HostKVCache` (``evictions`` is the provider's, since the cache opened)."""

    lookups: int = 0
    hits: int = 0  # lookups that returned at least one page
    misses: int = 0  # lookups that returned none
    lookup_pages: int = 0
    hit_pages: int = 0
    hit_tokens: int = 0
    anchor_cut_pages: int = 0  # stored pages dropped from hits for lack of the needed anchor
    saves: int = 0
    saved_pages: int = 0
    dedup_pages: int = 0
    coalesced_pages: int = 0
    rejected_pages: int = 0  # refused by the admission policy
    failed_pages: int = 0  # admitted but not stored (capacity, parent evicted meanwhile)
    anchors_saved: int = 0
    restores: int = 0
    restored_pages: int = 0
    coalesced_restores: int = 0
    bytes_out: int = 0  # device -> host (saves)
    bytes_in: int = 0  # host -> device (restores)
    evictions: int = 0
    save_seconds_count: int = 0
    save_seconds_sum: float = 0.0
    save_seconds_p50: float = 0.0
    save_seconds_p99: float = 0.0
    restore_seconds_count: int = 0
    restore_seconds_sum: float = 0.0
    restore_seconds_p50: float = 0.0
    restore_seconds_p99: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k != "extra"}
        out.update(self.extra)
        return out


class _SaveJob:
    __slots__ = ("claimed", "deps", "done", "handle", "keys")

    def __init__(self, keys: Sequence[Key], handle: CacheHandle) -> None:
        self.keys = keys
        self.handle = handle
        self.claimed: list[int] = []
        self.deps: dict[int, _SaveJob] = {}
        self.done = threading.Event()
