"""``HostKVCache``: what an inference engine calls.

The engine computes keys for a prompt's pages (:meth:`HostKVCache.keys`), asks how much of the
prompt is stored (:meth:`HostKVCache.lookup`, which returns a *leased* hit so nothing it covers
can be evicted before it is restored), restores the hit into its own KV blocks
(:meth:`HostKVCache.restore`) and saves the pages it computed (:meth:`HostKVCache.save`).  Both
transfers run on the copy engine off the caller's thread and return handles with ``done()`` /
``wait()``; the caller's thread only validates arguments, takes locks briefly and queues work,
so a decode loop is never blocked by a save.

Saves:

* are filtered by an admission policy (:class:`AdmitAll`, :class:`MinDepth`,
  :class:`SeenAtLeast`, :class:`AnchorsOnly`, or all of several with :class:`AllOf`);
* skip pages already stored (dedup) and pages another save of this cache is writing (coalescing:
  the later save waits for the earlier one instead of copying the page twice; a page being written
  by another process is waited for through ``Provider.wait_sealed``);
* copy the remaining pages device → host straight into the provider's own reservations where it
  has a chain reservation (``reserve_many``/``seal_many``: ``pinned``), chunk by chunk, each
  chunk sealed root first once its DMA is done; otherwise into bounce buffers (double-buffered
  chunks), then store each run with ``put_many`` (or reserve, fill and seal page by page);
* attach anchors (named blobs: recurrent state, boundary hidden state) to the pages the engine
  gives them for: the terminal page, checkpoint pages and every ``anchor_interval`` pages
  (:meth:`HostKVCache.anchor_positions`).

Restores read pinned host memory in place where the provider offers zero-copy views
(``view_pages``: one address array per chunk; ``SupportsViews``) and otherwise stage pages through
bounce buffers, reading the next chunk while the previous one is copied.

Stream order (R9): ``restore(before=stream)`` gates the stream on the caller's thread (the copy
engine's :meth:`~hostkv_providers.device.CopyEngine.gate`) and opens it behind every copy the
restore thread issues later, so each kernel enqueued on the stream after the call sees the
restored bytes; ``save(after=stream)`` marks the stream's position at the call
(:meth:`~hostkv_providers.device.CopyEngine.mark`).

A hit for a hybrid model (``need_anchor``) is cut back to the deepest page carrying that anchor:
KV beyond it cannot be used without the recurrent state at that point.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from hostkv_providers._errors import (
    CapacityError,
    ClosedError,
    HostKVError,
    InFlightError,
    InvalidArgumentError,
    UnknownKeyError,
)
from hostkv_providers._keys import ZERO_KEY, Key, MediaItem, Salt, as_key, chain_keys
from hostkv_providers._layout import KVLayout
from hostkv_providers._provider import (
    HostRegion,
    Lease,
    Provider,
    Reservation,
    SupportsBatch,
    SupportsBatchViews,
    SupportsViews,
    check_anchor_name,
    readable_bytes,
)
from hostkv_providers._region import HostPages
from hostkv_providers.cache._hybrid import HybridState, make_hybrid
from hostkv_providers.device._hostmem import HostAllocation, HostAllocator, OrdinaryAllocator
from hostkv_providers.metrics import LatencyHistogram, ProviderCollector

__all__ = [
    "AdmissionPolicy",
    "AdmissionRequest",
    "AdmitAll",
    "AllOf",
    "AnchorsOnly",
    "CacheHandle",
    "CacheHit",
    "CacheStats",
    "HostKVCache",
    "MinDepth",
    "RestoreResult",
    "SaveResult",
    "SeenAtLeast",
]

AnchorBlobs = Mapping[str, object]
_VIEW_LEASE_PAGES = 32
AnchorSource = Mapping[int, AnchorBlobs] | Callable[[int], AnchorBlobs | None]


# --------------------------------------------------------------------------------------------
# The copy engine as seen from here (hostkv_providers.device._copy implements it)
# --------------------------------------------------------------------------------------------


class _Transfer(Protocol):
    def done(self) -> bool: ...

    def wait(self) -> object: ...


class CopyEngineLike(Protocol):
    """What the cache needs of a copy engine (``CpuCopyEngine``, the CUDA engine)."""

    def save(self, planes: Any, block_ids: Sequence[int], dst: Sequence[Sequence[HostRegion]], *,
             after: Any = None) -> Any: ...

    def restore(self, src: Sequence[Sequence[HostRegion]] | HostPages, planes: Any, block_ids: Sequence[int], *,
                before: Any = None) -> Any: ...


def _check_max_pages(max_pages: object) -> int:
    """Validate ``lookup(max_pages=)`` (hybrid hook, cache/_hybrid.py)."""
    if type(max_pages) is not int or max_pages < 0:
        raise InvalidArgumentError(f"max_pages must be an int >= 0, got {max_pages!r}",
                                   hint="prefill_pages_cap(num_tokens, page_tokens) keeps >= 1 token to prefill")
    return max_pages


def _default_engine() -> CopyEngineLike:
    from hostkv_providers.device import _copy  # lazily: it may import CUDA

    return _copy.default_copy_engine()


def _as_planes(layout: KVLayout, planes: Any) -> Any:
    """Accept a ``KVPlanes`` or a list of per-plane tensors/arrays (ordered as ``layout.planes``)."""
    if hasattr(planes, "ptrs") and hasattr(planes, "num_blocks"):
        if getattr(planes, "layout", layout) != layout:
            raise InvalidArgumentError("the KVPlanes were built for another layout")
        return planes
    if isinstance(planes, (list, tuple)):
        from hostkv_providers.device import _copy
        if len(planes) != len(layout.planes):
            raise InvalidArgumentError(f"{len(planes)} plane tensors given, the layout has {len(layout.planes)}")
        if planes and isinstance(planes[0], np.ndarray):
            return _copy.KVPlanes.from_arrays(layout, list(planes))
        return _copy.KVPlanes.from_torch(layout, list(planes))
    raise InvalidArgumentError(
        f"expected KVPlanes or a list of plane tensors, got {type(planes).__name__}",
        hint="build planes with paged_planes(...) or HFCacheMap.pack(...)",
    )


def _staging_allocator() -> HostAllocator:
    """Page-locked bounce buffers when CUDA is usable (DMA at full rate), else ordinary memory."""
    try:
        from hostkv_providers.device._hostmem import pinned_allocator
    except ImportError:
        return OrdinaryAllocator()
    alloc = pinned_allocator()
    return alloc if alloc is not None else OrdinaryAllocator()


class _Staging:
    """``pages`` page-sized bounce slots in one host allocation."""

    def __init__(self, allocator: HostAllocator, page_nbytes: int, pages: int) -> None:
        self.page_nbytes = page_nbytes
        self.pages = pages
        self.alloc: HostAllocation = allocator.allocate(page_nbytes * pages)
        self.array = np.frombuffer(self.alloc.view, dtype=np.uint8, count=page_nbytes * pages)

    def region(self, i: int) -> list[HostRegion]:
        lo = i * self.page_nbytes
        view = self.alloc.view[lo : lo + self.page_nbytes]
        return [HostRegion(0, view, self.alloc.address + lo, self.alloc.pinned)]

    def page(self, i: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
        lo = i * self.page_nbytes
        return self.array[lo : lo + self.page_nbytes]

    def close(self) -> None:
        del self.array
        self.alloc.close()


# --------------------------------------------------------------------------------------------
# Admission
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AdmissionRequest:
    """What a policy sees of one save: the chain, its depth, anchors and how often pages were seen."""

    keys: Sequence[Key]
    start_page: int  # depth of keys[0] in its chain (0 for a root)
    anchored: frozenset[int]  # indices into keys of pages the save attaches anchors to
    seen: Callable[[Key], int]  # how many lookups included this key (bounded memory)


class AdmissionPolicy(Protocol):
    """Decides how many leading pages of a save are stored (a prefix, so chains stay closed)."""

    def admit(self, request: AdmissionRequest) -> int: ...


@dataclass(frozen=True)
class AdmitAll:
    """Store every page."""

    def admit(self, request: AdmissionRequest) -> int:
        return len(request.keys)


@dataclass(frozen=True)
class MinDepth:
    """Store a chain only when it is at least ``pages`` pages deep (short prompts are cheap to
    recompute and not worth budget)."""

    pages: int

    def __post_init__(self) -> None:
        if type(self.pages) is not int or self.pages < 0:
            raise InvalidArgumentError(f"MinDepth.pages must be an int >= 0, got {self.pages!r}")

    def admit(self, request: AdmissionRequest) -> int:
        depth = request.start_page + len(request.keys)
        return len(request.keys) if depth >= self.pages else 0


@dataclass(frozen=True)
class SeenAtLeast:
    """Store the longest prefix whose pages were looked up at least ``times`` times, so a one-shot
    long prompt does not push reusable roots out of the budget."""

    times: int

    def __post_init__(self) -> None:
        if type(self.times) is not int or self.times < 1:
            raise InvalidArgumentError(f"SeenAtLeast.times must be an int >= 1, got {self.times!r}")

    def admit(self, request: AdmissionRequest) -> int:
        n = 0
        for k in request.keys:
            if request.seen(k) < self.times:
                break
            n += 1
        return n


@dataclass(frozen=True)
class AnchorsOnly:
    """Store the chain only up to its deepest page that carries an anchor in this save (for
    hybrid models, KV beyond the last anchor is unusable)."""

    def admit(self, request: AdmissionRequest) -> int:
        return max(request.anchored) + 1 if request.anchored else 0


@dataclass(frozen=True)
class AllOf:
    """Every policy must agree: the shortest admitted prefix wins."""

    policies: tuple[AdmissionPolicy, ...]

    def __init__(self, *policies: AdmissionPolicy) -> None:
        object.__setattr__(self, "policies", tuple(policies))

    def admit(self, request: AdmissionRequest) -> int:
        return min((p.admit(request) for p in self.policies), default=len(request.keys))


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


class CacheHandle:
    """An asynchronous save or restore.  ``done()`` polls, ``wait()`` blocks and returns the
    :class:`SaveResult` / :class:`RestoreResult` (or raises the error the transfer hit).

    Stream order without blocking the host: :meth:`wait_on` makes a stream wait for the
    transfer's device copies (a restore: every kernel enqueued on that stream afterwards sees
    the restored bytes; a save: the blocks may be overwritten by kernels enqueued afterwards),
    also when the copies have not been issued yet.  :attr:`event` is the completion event of the
    copies (a ``CUevent``; ``None`` for host copies), available once they are issued.
    """

    def __init__(self, kind: str, engine: Any = None) -> None:
        self.kind = kind
        self._engine = engine
        self._done = threading.Event()
        self._copied = threading.Event()
        self._result: Any = None
        self._error: BaseException | None = None
        self._t0 = time.perf_counter()
        self._t1: float | None = None
        self._callbacks: list[Callable[[CacheHandle], None]] = []
        self._lock = threading.Lock()
        # device-copy ordering: transfers issued so far, gates waiting for the last of them
        self._transfers: list[Any] = []
        self._issued_evt = threading.Event()
        self._gates: list[Any] = []

    def done(self) -> bool:
        """Whether the transfer has finished (successfully or not)."""
        return self._done.is_set()

    def copied(self) -> bool:
        """For a save: whether the device blocks have been copied out (the engine may reuse them)."""
        return self._copied.is_set()

    def wait_copied(self, timeout: float | None = None) -> bool:
        """Block until the device blocks have been copied out; ``False`` on timeout."""
        return self._copied.wait(timeout)

    def wait(self, timeout: float | None = None) -> Any:
        """Block until done; return the result or raise the transfer's error.

        Raises ``TimeoutError`` if ``timeout`` passes first."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"{self.kind} still running after {timeout} s")
        if self._error is not None:
            raise self._error
        return self._result

    def wait_on(self, stream: Any) -> None:
        """Order ``stream`` after this transfer's device copies, without blocking the host.

        Work enqueued on ``stream`` after this call runs only once the copies are complete,
        whether or not they have been issued yet (the stream is gated until they are).  With a
        copy engine that cannot gate streams, this waits until the copies are issued.
        ``stream=None`` waits for the whole transfer (:meth:`wait`)."""
        if stream is None:
            self.wait()
            return
        gate_fn = getattr(self._engine, "gate", None)
        with self._lock:
            if not self._issued_evt.is_set() and gate_fn is not None:
                self._gates.append(gate_fn(stream))
                return
        self._issued_evt.wait()
        if gate_fn is not None:
            gate_fn(stream).open_after(list(self._transfers))
        else:
            for t in list(self._transfers):
                t.wait_on(stream)

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

    def _all_issued(self) -> None:
        """Every copy of this transfer is issued (or none will be): open the gates behind them."""
        with self._lock:
            if self._issued_evt.is_set():
                return
            self._issued_evt.set()
            gates, self._gates = self._gates, []
        transfers = list(self._transfers)
        for g in gates:
            g.open_after(transfers)

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

    def _finish(self, result: Any, error: BaseException | None = None) -> None:
        self._all_issued()
        self._result = result
        self._error = error
        self._t1 = time.perf_counter()
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

    ``keys`` are the usable pages (root first).  With ``need_anchor``, ``anchor`` holds that
    anchor's bytes at the last usable page (the state the engine resumes from), and the hit never
    extends past the deepest page carrying it.  Use as a context manager or call
    :meth:`release`; a restore started with ``release=True`` releases it when the copy completes.
    """

    def __init__(self, cache: HostKVCache, keys: Sequence[Key], lease: Lease | None, *, requested: int,
                 stored: int, anchor_name: str | None, anchor: bytes | None) -> None:
        self._cache = cache
        self.keys: tuple[Key, ...] = tuple(keys)
        self.lease = lease
        self.requested = requested
        self.stored = stored  # stored prefix before cutting back to the anchor
        self.anchor_name = anchor_name
        self.anchor = anchor
        self._released = lease is None
        self.hybrid: Any = None  # hybrid hook (cache/_hybrid.py): the prefill this miss produces

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
        """Unpin the pages (idempotent)."""
        if self._released:
            return
        self._released = True
        if self.lease is not None:
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


# --------------------------------------------------------------------------------------------
# The cache
# --------------------------------------------------------------------------------------------


class HostKVCache:
    """The engine-facing cache over one provider.

    Parameters
    ----------
    provider:
        Where pages live (``hostkv_providers.open(url)``).
    salt:
        The configuration (model, layout, quantization ...) whose pages this cache stores.  A bare
        :class:`KVLayout` is accepted together with ``model_id``.  Under tensor parallelism, the
        rank's salt (``Salt(..., tp_rank=r, tp_world_size=w)``): the cache's :attr:`layout` is
        then ``salt.local_layout``, the rank's slice of the heads.
    copy_engine:
        Moves bytes between the engine's planes and host memory; default
        ``default_copy_engine()`` (CUDA when usable, else the CPU engine).
    admission:
        Which pages of a save are stored (default :class:`AdmitAll`).
    anchor_interval:
        Offer an anchor position every this many pages (0: terminal and checkpoints only).
    chunk_pages:
        Pages per bounce buffer / per copy-engine call; two buffers are used for double buffering.
    seen_capacity:
        How many keys the seen-count table of :class:`SeenAtLeast` remembers (LRU).
    wait_timeout:
        Seconds a save waits for a page another writer has in flight.
    lookup_wait_timeout:
        Seconds a ``lookup`` waits for the next pages of its prefix that are being saved right
        now (it then reports what is stored; a scheduler should not stall longer).
    model_id:
        Only with a bare layout: the model id for the salt.
    required_anchors, anchor_groups, coalesce_prefills:
        Hybrid models (``cache/_hybrid.py``, docs/integration.md "Hybrid models"): the anchor
        names every hit must carry at its last page (each lookup is cut back, anchors become
        checked records bound to depth and ``salt.state_format``, restores hand them out);
        optional groups restored whole or reported in ``RestoreResult.invalidated`` (drafter
        state); identical cold lookups waiting for one request's prefill.
    """

    def __init__(
        self,
        provider: Provider,
        salt: Salt | KVLayout,
        copy_engine: CopyEngineLike | None = None,
        *,
        admission: AdmissionPolicy | None = None,
        anchor_interval: int = 0,
        chunk_pages: int = 256,
        seen_capacity: int = 1 << 18,
        wait_timeout: float = 60.0,
        lookup_wait_timeout: float = 5.0,
        model_id: str | None = None,
        staging_allocator: HostAllocator | None = None,
        required_anchors: Iterable[str] | None = None,
        anchor_groups: Mapping[str, Iterable[str]] | None = None,
        coalesce_prefills: bool = False,
    ) -> None:
        if not isinstance(provider, Provider):
            raise InvalidArgumentError(f"provider must be a Provider, got {type(provider).__name__}")
        if isinstance(salt, KVLayout):
            if not model_id:
                raise InvalidArgumentError("a bare KVLayout needs model_id= to build the salt",
                                           hint="pass a Salt(model_id, layout, ...) instead")
            salt = Salt(model_id, salt)
        elif not isinstance(salt, Salt):
            raise InvalidArgumentError(f"salt must be a Salt or KVLayout, got {type(salt).__name__}")
        for name, value, lo in (("anchor_interval", anchor_interval, 0), ("chunk_pages", chunk_pages, 1),
                                ("seen_capacity", seen_capacity, 0)):
            if type(value) is not int or value < lo:
                raise InvalidArgumentError(f"{name} must be an int >= {lo}, got {value!r}")
        self.provider = provider
        self.salt = salt
        # A tensor-parallel rank packs only its slice of the KV heads (``salt.local_layout``;
        # the whole layout when the salt is unsharded).
        self.layout = salt.local_layout
        self.page_nbytes = self.layout.page_nbytes
        self._rank_salts: tuple[Salt, ...] | None = None  # built on first use (rank_keys)
        self.engine: CopyEngineLike = copy_engine if copy_engine is not None else _default_engine()
        self.admission: AdmissionPolicy = admission if admission is not None else AdmitAll()
        self.anchor_interval = anchor_interval
        self.chunk_pages = chunk_pages
        self.wait_timeout = float(wait_timeout)
        self.lookup_wait_timeout = float(lookup_wait_timeout)
        self._views = isinstance(provider, SupportsViews)
        self._batch_views = isinstance(provider, SupportsBatchViews)
        self._page_views = callable(getattr(provider, "view_pages", None))
        self._batch = isinstance(provider, SupportsBatch)
        # Providers with their own chain reservation take saves straight into their memory.
        self._direct_saves = type(provider).reserve_many is not Provider.reserve_many
        self._lock = threading.Lock()
        self._claims: dict[Key, _SaveJob] = {}
        self._restores: dict[tuple[Any, ...], CacheHandle] = {}
        self._seen: collections.OrderedDict[Key, int] = collections.OrderedDict()
        self._seen_capacity = seen_capacity
        self._stats = CacheStats()
        self._save_lat = _Latency()
        self._restore_lat = _Latency()
        self._lookup_lat = _Latency()
        self._evictions0 = self._provider_evictions()
        self._alloc = staging_allocator if staging_allocator is not None else _staging_allocator()
        self._staging_free: list[_Staging] = []
        self._staging_lock = threading.Lock()
        # One save thread: saves are sealed in submission order, so a save that coalesces onto an
        # earlier one always finds it finished, and parent-before-child holds across saves.
        self._save_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hostkv-save")
        self._restore_pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="hostkv-restore")
        self._closed = False
        self._finalizer = weakref.finalize(self, _shutdown_pools, self._save_pool, self._restore_pool)
        # hybrid hook (cache/_hybrid.py): required anchors, anchor records, coalesced prefills
        self._hybrid: HybridState | None = make_hybrid(self, required_anchors, anchor_groups, coalesce_prefills)

    # -- keys ---------------------------------------------------------------------------------
    def keys(
        self,
        tokens: Sequence[int] | Any,
        *,
        token_types: Sequence[int] | Any | None = None,
        positions: Sequence[Sequence[int]] | Any | None = None,
        media: Sequence[MediaItem] = (),
        parent: bytes = ZERO_KEY,
        start_token: int = 0,
    ) -> list[Key]:
        """Keys of every full page of ``tokens`` under this cache's salt (see ``chain_keys``)."""
        return chain_keys(self.salt, tokens, token_types=token_types, positions=positions, media=media,
                          parent=parent, start_token=start_token)

    def anchor_positions(self, num_pages: int, checkpoints: Iterable[int] = (), *, start_page: int = 0) -> list[int]:
        """Page indices (into a chain of ``num_pages`` pages starting at depth ``start_page``) where
        the engine should capture anchors: the terminal page, every checkpoint page and, with
        ``anchor_interval = K``, every page whose depth + 1 is a multiple of K."""
        if type(num_pages) is not int or num_pages < 0:
            raise InvalidArgumentError(f"num_pages must be an int >= 0, got {num_pages!r}")
        out: set[int] = set()
        if num_pages:
            out.add(num_pages - 1)
        for c in checkpoints:
            if type(c) is not int or not 0 <= c < num_pages:
                raise InvalidArgumentError(f"checkpoint page {c!r} outside the chain of {num_pages} pages")
            out.add(c)
        k = self.anchor_interval
        if k:
            first = (-(start_page + 1)) % k
            out.update(range(first, num_pages, k))
        return sorted(out)

    # -- lookup -------------------------------------------------------------------------------
    def _note_seen(self, keys: Sequence[Key]) -> None:
        if not self._seen_capacity:
            return
        seen = self._seen
        for k in keys:
            seen[k] = seen.get(k, 0) + 1
            seen.move_to_end(k)
        while len(seen) > self._seen_capacity:
            seen.popitem(last=False)

    def seen(self, key: bytes) -> int:
        """How many lookups included ``key`` (within the bounded memory of the table)."""
        with self._lock:
            return self._seen.get(as_key(key), 0)

    def lookup(self, keys: Sequence[bytes], need_anchor: str | None = None, *, wait: bool = True,
               max_pages: int | None = None) -> CacheHit:
        """Lease the longest stored prefix of ``keys``.

        Parameters
        ----------
        keys:
            A chain, root first (from :meth:`keys`).
        need_anchor:
            For hybrid models: the anchor name the engine needs to resume (its recurrent state).
            The hit is cut back to the deepest stored page carrying it; ``hit.anchor`` holds its
            bytes.  Without such a page the hit is empty.
        wait:
            When the next page of the prefix is being saved right now (by this cache or, through
            the provider, by another writer), wait for that save (at most
            ``lookup_wait_timeout`` seconds) instead of reporting a shorter hit.  With
            ``coalesce_prefills``, also when another request that missed is prefilling it.
        max_pages:
            Never hit more than this many pages (``prefill_pages_cap(num_tokens, page_tokens)``
            keeps at least one token for the engine to prefill).

        Returns
        -------
        CacheHit
            Always a hit object; an empty one (``num_pages == 0``, falsy) is a miss.  Release it
            (or restore it with ``release=True``).
        """
        self._check_open()
        t_lookup = time.perf_counter()
        ks = self._chain(keys)
        if need_anchor is not None:
            check_anchor_name(need_anchor)
        hyb = self._hybrid
        if max_pages is not None:  # hybrid hook: a capped hit (cache/_hybrid.py)
            ks = ks[: _check_max_pages(max_pages)]
        with self._lock:
            self._note_seen(ks)
        deadline = time.monotonic() + self.lookup_wait_timeout
        lease = self.provider.lease(ks)
        n = lease.prefix_len
        while True:
            n = lease.prefix_len
            if not wait or n == len(ks) or time.monotonic() >= deadline:
                break
            nxt = ks[n]
            with self._lock:
                job = self._claims.get(nxt)
            if job is not None:
                lease.release()
                job.done.wait(max(0.0, deadline - time.monotonic()))
                lease = self.provider.lease(ks)
                n = lease.prefix_len
                continue
            if self.provider.in_flight(nxt):
                lease.release()
                self.provider.wait_sealed(nxt, max(0.0, deadline - time.monotonic()))
                lease = self.provider.lease(ks)
                n = lease.prefix_len
                continue
            if hyb is not None and hyb.wait_for_prefill(ks, n, deadline):  # hybrid hook: a twin prefills it
                lease.release()
                lease = self.provider.lease(ks)
                n = lease.prefix_len
                continue
            break
        stored = n
        anchor: bytes | None = None
        if hyb is not None and hyb.binding:  # hybrid hook: cut to the deepest fully anchored page
            n = hyb.deepest([ks], n, need_anchor)
        elif need_anchor is not None and n:
            usable = self.provider.deepest_anchor(ks[:n], need_anchor)
            if usable:
                anchor = self.provider.get_anchor(ks[usable - 1], need_anchor)
                if anchor is None:  # evicted between the two calls is impossible (leased); be safe
                    usable = 0
            n = usable
        elif need_anchor is not None:
            n = 0
        if n < len(lease.keys):
            # Re-lease only the usable prefix so the rest stays evictable.
            old = lease
            lease = self.provider.lease(ks[:n]) if n else None  # type: ignore[assignment]
            old.release()
            if lease is not None and lease.prefix_len < n:  # cannot shrink while pinned; be exact
                n = lease.prefix_len
        hit = CacheHit(self, ks[:n], lease if n else None, requested=len(ks), stored=stored,
                       anchor_name=need_anchor, anchor=anchor if n else None)
        if not n and lease is not None:
            lease.release()
        if hyb is not None:  # hybrid hook: this request now produces the missing pages
            hyb.note_miss(hit, ks)
        with self._lock:
            st = self._stats
            st.lookups += 1
            st.lookup_pages += len(ks)
            if n:
                st.hits += 1
                st.hit_pages += n
                st.hit_tokens += n * self.layout.page_tokens
            else:
                st.misses += 1
            st.anchor_cut_pages += stored - n
            self._lookup_lat.add(time.perf_counter() - t_lookup)
        return hit

    # -- tensor parallelism: a prompt is usable only where every rank has its pages ---------------
    def rank_keys(
        self,
        tokens: Sequence[int] | Any,
        *,
        token_types: Sequence[int] | Any | None = None,
        positions: Sequence[Sequence[int]] | Any | None = None,
        media: Sequence[MediaItem] = (),
    ) -> list[list[Key]]:
        """Every tensor-parallel rank's chain of ``tokens``, index = rank (see :meth:`keys`).

        The ranks' salts are ``salt.rank_salts()``; an unsharded cache returns one chain.  What
        :meth:`lookup_ranks` takes.
        """
        if self._rank_salts is None:
            self._rank_salts = self.salt.rank_salts() if self.salt.tp_world_size > 1 else (self.salt,)
        return [chain_keys(s, tokens, token_types=token_types, positions=positions, media=media)
                for s in self._rank_salts]

    def lookup_ranks(self, rank_keys: Sequence[Sequence[bytes]], need_anchor: str | None = None) -> CacheHit:
        """Lease the longest prefix that *every* tensor-parallel rank has stored.

        Under tensor parallelism each rank stores its slice of the heads under its own salt, and
        a prefix is usable only when all ranks can restore it: one rank's evicted page makes the
        page (and all after it) a miss for every rank.  This is where that rule lives.  The
        pages of *all* ranks up to the common depth are pinned by the returned hit's lease until
        it is released, so the answer stays true while the ranks restore: a scheduler process
        (or rank 0) calls this once per request, hands the hit's ``num_pages`` to the ranks, and
        each rank restores that many pages with its own :meth:`lookup` hit (its pages cannot
        have gone) before the scheduler releases.  Engines in which each rank looks up for
        itself instead all-reduce the minimum of their hits' ``num_pages`` (this method's or
        plain :meth:`lookup`'s) and restore that many pages; ranks never decide alone, since the
        store can change between two ranks' calls.

        Parameters
        ----------
        rank_keys:
            One chain per rank, index = rank, all of one length (from :meth:`rank_keys`).
        need_anchor:
            As in :meth:`lookup`, per rank (each rank's anchors hold its own slice of the
            state): the hit is cut back to the deepest page that carries the anchor on every
            rank; ``hit.anchor`` is this rank's.

        Returns
        -------
        CacheHit
            This rank's keys of the common prefix (``hit.keys``); its lease pins every rank's
            pages of that prefix.  It does not wait for pages being saved right now.
        """
        self._check_open()
        world = self.salt.tp_world_size
        if isinstance(rank_keys, (bytes, bytearray, memoryview)) or len(rank_keys) != world:
            raise InvalidArgumentError(f"rank_keys must hold one chain per rank ({world})",
                                       hint="build them with HostKVCache.rank_keys(tokens)")
        chains = [self._chain(c) for c in rank_keys]
        pages = len(chains[0])
        if any(len(c) != pages for c in chains):
            raise InvalidArgumentError("every rank's chain must have the same number of pages",
                                       hint="key the same tokens under each rank's salt")
        if need_anchor is not None:
            check_anchor_name(need_anchor)
        own = chains[self.salt.tp_rank]
        hyb = self._hybrid
        with self._lock:
            self._note_seen(own)
        # One lease over all ranks' chains: per rank, the pinned prefix; the common depth is the
        # smallest.  Pinning first and measuring after means no rank's page can go in between.
        lease = self.provider.lease([k for c in chains for k in c])
        n = pages
        for r in range(world):
            present = lease.present[r * pages : (r + 1) * pages]
            n = min(n, present.index(False) if False in present else pages)
        stored = n
        anchor: bytes | None = None
        if hyb is not None and hyb.binding:  # hybrid hook: every rank's page carries every anchor
            n = hyb.deepest(chains, n, need_anchor)
        elif need_anchor is not None:
            # the deepest depth anchored on every rank: cut to the shallowest rank's deepest
            # anchor until all ranks agree (anchors are placed at the same depths on every rank,
            # so this usually settles at once)
            while n:
                depths = [self.provider.deepest_anchor(c[:n], need_anchor) for c in chains]
                if min(depths) == n:
                    break
                n = min(depths)
            if n:
                anchor = self.provider.get_anchor(own[n - 1], need_anchor)
                if anchor is None:  # leased, so impossible; never hand out a hit without it
                    n = 0
        if not n:
            lease.release()
        elif sum(lease.present) != world * n:  # else it pins exactly the common prefix already
            # Re-lease only the common prefix so the rest stays evictable.
            old = lease
            lease = self.provider.lease([k for c in chains for k in c[:n]])
            old.release()
            if not all(lease.present):  # cannot shrink while pinned; be exact anyway
                lease.release()
                n = 0
        hit = CacheHit(self, own[:n], lease if n else None, requested=pages, stored=stored,
                       anchor_name=need_anchor, anchor=anchor if n else None)
        with self._lock:
            st = self._stats
            st.lookups += 1
            st.lookup_pages += pages
            if n:
                st.hits += 1
                st.hit_pages += n
                st.hit_tokens += n * self.layout.page_tokens
            else:
                st.misses += 1
            st.anchor_cut_pages += stored - n
        return hit

    # -- restore ------------------------------------------------------------------------------
    def restore(self, hit: CacheHit, into: Any, block_ids: Sequence[int], *, before: Any = None,
                release: bool = True, first_page: int = 0,
                anchors_into: Mapping[str, Any] | None = None) -> CacheHandle:
        """Copy the hit's pages into the engine's KV blocks, asynchronously.

        Parameters
        ----------
        hit:
            From :meth:`lookup` (unreleased).
        into:
            The engine's planes: a ``KVPlanes`` or a list of per-plane tensors in
            ``layout.planes`` order (see :func:`paged_planes`, :meth:`HFCacheMap.empty_planes`).
        block_ids:
            ``block_ids[i]`` receives page ``first_page + i`` of the hit; at most
            ``hit.num_pages - first_page`` of them.
        before:
            The engine's compute stream (``torch.cuda.Stream``, a raw ``CUstream``, a
            :class:`~hostkv_providers.device.HostStream` for the CPU engine, or ``None``): every
            kernel enqueued on it after this call returns runs only once the restored bytes are
            in the blocks — on every path (zero-copy views and bounce buffers), although the
            copies are issued later on the cache's own thread.  The host is not blocked: the
            stream waits on a device-visible flag that the restore sets behind its copies.
            (:meth:`CacheHandle.wait_on` orders further streams the same way.)
        release:
            Release the hit's lease when the restore finishes.
        first_page:
            A ranged restore: start at page ``first_page`` of the hit (pages
            ``[first_page, first_page + len(block_ids))``).
        anchors_into:
            Hybrid caches: ``{name: writable buffer}`` the anchors are copied into (once, on the
            restore thread); ``result.anchors[name]`` then views that buffer.

        Returns
        -------
        CacheHandle
            ``wait()`` returns a :class:`RestoreResult`; ``result.pages`` leading pages were
            restored — fewer than asked only if a page failed its checksum, in which case the
            engine recomputes from there.  An identical restore already in flight (same keys,
            same planes object, same blocks) returns that request's handle.
        """
        self._check_open()
        if not isinstance(hit, CacheHit) or hit._cache is not self:
            raise InvalidArgumentError("restore() needs a CacheHit from this cache's lookup()")
        if type(first_page) is not int or not 0 <= first_page <= hit.num_pages:
            raise InvalidArgumentError(f"first_page must be an int in [0, {hit.num_pages}], got {first_page!r}")
        if first_page and self._hybrid is not None:
            # the anchors that make a hybrid hit usable belong to the hit's last page; a range that
            # starts inside the hit gives the engine no state to continue from
            raise InvalidArgumentError("ranged restores (first_page > 0) are not supported on hybrid caches",
                                       hint="restore the whole hit (first_page=0)")
        if not hit.num_pages or first_page == hit.num_pages:
            # nothing to restore; a finished handle keeps callers uniform
            self._block_ids(block_ids, 0, "hit pages")
            done = CacheHandle("restore", self.engine)
            done._finish(RestoreResult())
            return done
        if hit.released:
            raise InvalidArgumentError("the hit was released; look it up again")
        bids = self._block_ids(block_ids, hit.num_pages - first_page, "hit pages")
        planes = _as_planes(self.layout, into)
        self._check_blocks(planes, bids)
        keys = hit.keys[first_page : first_page + len(bids)]
        ident = (keys, planes.ptrs, planes.block_strides, tuple(bids))
        with self._lock:
            prior = self._restores.get(ident)
            if prior is not None and not prior.done():
                self._stats.coalesced_restores += 1
                if release:
                    prior.add_done_callback(lambda _h: hit.release())
                if before is not None:  # the caller's stream is ordered behind the shared copies
                    prior.wait_on(before)
                return prior
            handle = CacheHandle("restore", self.engine)
            self._restores[ident] = handle
            if before is not None:
                try:
                    # Gated now, on the caller's thread: kernels the caller enqueues from here on
                    # wait for the copies the restore thread issues later.
                    handle.wait_on(before)
                except BaseException:
                    del self._restores[ident]
                    raise
        if self._hybrid is not None:  # hybrid hook: where the anchors go
            self._hybrid.note_restore(handle, anchors_into)

        def finish(h: CacheHandle) -> None:
            with self._lock:
                if self._restores.get(ident) is h:
                    del self._restores[ident]
                if h.error is None:
                    res: RestoreResult = h._result
                    self._stats.restores += 1
                    self._stats.restored_pages += res.pages
                    self._stats.bytes_in += res.nbytes
                    self._restore_lat.add(h.seconds)
            if release:
                hit.release()

        handle.add_done_callback(finish)
        self._restore_pool.submit(self._run_restore, handle, hit, keys, planes, bids)
        return handle

    def _run_restore(self, handle: CacheHandle, hit: CacheHit, keys: Sequence[Key], planes: Any,
                     bids: Sequence[int]) -> None:
        result = RestoreResult()
        handle._result = result
        try:
            self._restore_pages(handle, result, hit, keys, planes, bids)
            if self._hybrid is not None:  # hybrid hook: anchors read with the restore, cut back
                self._hybrid.finish_restore(handle, result, keys)
        except BaseException as exc:
            handle._finish(result, exc)
            return
        handle._finish(result)

    def _restore_pages(self, handle: CacheHandle, result: RestoreResult, hit: CacheHit, keys: Sequence[Key],
                       planes: Any, bids: Sequence[int]) -> None:
        chunk = self.chunk_pages
        P = self.page_nbytes
        # in-flight engine transfers with what they read from: a bounce buffer or view leases
        pending: list[tuple[Any, _Staging | None, list[Lease]]] = []

        def retire() -> None:
            h, st, leases = pending.pop(0)
            try:
                h.wait()
            finally:
                if st is not None:
                    self._put_staging(st)
                for lease in leases:
                    lease.release()

        try:
            i = 0
            while i < len(keys):
                part = keys[i : i + chunk]
                srcs: list[Sequence[HostRegion]] | HostPages | None = None
                if self._views and hit.lease is not None:
                    # Small leases for the views (the hit's lease already pins the pages):
                    # providers may search the lease's keys on every view() call.
                    vleases: list[Lease] = []
                    srcs = []
                    # A provider that batches views takes the whole chunk in one call.
                    step = len(part) if self._batch_views or self._page_views else _VIEW_LEASE_PAGES
                    for lo in range(0, len(part), step):
                        sub = part[lo : lo + step]
                        vlease = self.provider.lease(sub)
                        vleases.append(vlease)
                        if self._page_views:
                            # One address array for the chunk: no Python object per page.
                            pages = self.provider.view_pages(vlease, sub)  # type: ignore[attr-defined]
                            if pages is None:
                                srcs = None
                                break
                            srcs = pages
                            continue
                        if self._batch_views:
                            got = self.provider.views(vlease, sub)  # type: ignore[attr-defined]
                        else:
                            got = [self.provider.view(vlease, k) for k in sub]  # type: ignore[attr-defined]
                        if any(regs is None for regs in got):
                            srcs = None
                            break
                        srcs.extend(got)  # type: ignore[union-attr]
                    if srcs is None:
                        for vlease in vleases:
                            vlease.release()
                    else:
                        try:
                            h = self.engine.restore(srcs, planes, bids[i : i + len(part)])
                        except BaseException:
                            for vlease in vleases:
                                vlease.release()
                            raise
                        handle._add_transfer(h)
                        pending.append((h, None, vleases))
                        result.viewed += len(part)
                        ok = len(part)
                if srcs is None:
                    # Bounce through host buffers; at most two in flight, so the read of this chunk
                    # overlaps the copy of the previous one.  The provider is told of the next
                    # chunk first: a disk-backed one reads it in while this one is read, checked
                    # and handed to the engine.
                    nxt = keys[i + len(part) : i + len(part) + chunk]
                    if nxt:
                        self.provider.prefetch(nxt)
                    while sum(1 for _h, st, _l in pending if st is not None) >= 2:
                        retire()
                    st = self._get_staging()
                    ok = 0
                    if self._batch:
                        got = self.provider.read_many(  # type: ignore[attr-defined]
                            part, [st.page(j) for j in range(len(part))])
                        ok = got.index(False) if False in got else len(got)
                    else:
                        for j, k in enumerate(part):
                            if not self.provider.read(k, st.page(j)):
                                break  # a checksum failure dropped it: restore the valid prefix only
                            ok += 1
                    if ok:
                        regs = [st.region(j) for j in range(ok)]
                        try:
                            h = self.engine.restore(regs, planes, bids[i : i + ok])
                        except BaseException:
                            self._put_staging(st)
                            raise
                        handle._add_transfer(h)
                        pending.append((h, st, []))
                        result.staged += ok
                    else:
                        self._put_staging(st)
                result.pages += ok
                result.nbytes += ok * P
                if ok < len(part):
                    result.stopped = f"page {i + ok} failed verification and was dropped"
                    break
                i += len(part)
                time.sleep(0)  # let a waiting engine thread take the GIL between chunks
        finally:
            # Open the gated streams behind every copy issued (also after a failure: the copies
            # issued must be complete before the engine touches those blocks again), then wait
            # for the copies to release bounce buffers and leases.
            handle._all_issued()
            while pending:
                retire()

    # -- save ---------------------------------------------------------------------------------
    def save(
        self,
        keys: Sequence[bytes],
        from_: Any,
        block_ids: Sequence[int],
        *,
        parent: bytes | None = None,
        start_page: int = 0,
        anchors: AnchorSource | None = None,
        checkpoints: Iterable[int] = (),
        after: Any = None,
    ) -> CacheHandle:
        """Store the pages of a chain that are not stored yet, asynchronously.

        Parameters
        ----------
        keys:
            The chain (root first), or its continuation after ``parent``.
        from_:
            The engine's planes (``KVPlanes`` or per-plane tensors, see :meth:`restore`).
        block_ids:
            ``block_ids[i]`` holds page ``i``; one per key.  The blocks must keep their contents
            until ``handle.copied()`` (or ``done()``).
        parent, start_page:
            For a continuation: the key of the page before ``keys[0]`` (it must be stored) and
            its depth + 1 (used by depth-based admission and interval anchors).
        anchors:
            Named blobs to attach: ``{page_index: {name: bytes}}``, or a callable
            ``page_index -> {name: bytes} | None`` that the cache calls for each position of
            :meth:`anchor_positions` (terminal, ``checkpoints``, every ``anchor_interval`` pages).
            Anchors are attached even to pages that were already stored.
        after:
            The engine's compute stream (or ``None``): the save reads the blocks as they are once
            every kernel enqueued on it *before this call* has run — the stream's position is
            captured now, on the caller's thread (an event), however late the copies are issued;
            kernels enqueued after the call are not waited for.

        Returns
        -------
        CacheHandle
            ``wait()`` returns a :class:`SaveResult`.  Capacity shortfalls end a save early
            (``result.stopped``); they are not errors, the cache is best effort.
        """
        self._check_open()
        ks = self._chain(keys)
        bids = self._block_ids(block_ids, len(ks), "keys", exact=True)
        planes = _as_planes(self.layout, from_)
        self._check_blocks(planes, bids)
        par = None if parent is None else as_key(parent, "parent")
        if type(start_page) is not int or start_page < 0:
            raise InvalidArgumentError(f"start_page must be an int >= 0, got {start_page!r}")
        if (par is None) != (start_page == 0):
            raise InvalidArgumentError("give parent= and start_page= together (a continuation), or neither")
        blobs = self._anchor_blobs(anchors, len(ks), checkpoints, start_page)
        if self._hybrid is not None:  # hybrid hook: anchor records bound to depth and format
            blobs = self._hybrid.seal_blobs(blobs, start_page)
        mark_fn = getattr(self.engine, "mark", None)
        mark = mark_fn(after) if mark_fn is not None and after is not None else after
        handle = CacheHandle("save", self.engine)
        result = SaveResult(requested=len(ks))
        handle._result = result
        with self._lock:
            admitted = self.admission.admit(
                AdmissionRequest(ks, start_page, frozenset(blobs), lambda k: self._seen.get(k, 0))
            )
        admitted = max(0, min(int(admitted), len(ks)))
        result.admitted = admitted
        job = _SaveJob(ks[:admitted], handle)

        def finish(h: CacheHandle) -> None:
            with self._lock:
                for i in job.claimed:
                    if self._claims.get(ks[i]) is job:
                        del self._claims[ks[i]]
                res: SaveResult = h._result
                st = self._stats
                st.saved_pages += res.stored
                st.dedup_pages += res.dedup
                st.coalesced_pages += res.coalesced
                st.anchors_saved += res.anchors
                st.bytes_out += res.nbytes
                st.failed_pages += res.admitted - res.stored - res.dedup - res.coalesced
                self._save_lat.add(h.seconds)
            job.done.set()
            if self._hybrid is not None:  # hybrid hook: wake the twins of this prefill
                self._hybrid.saved(ks)

        handle.add_done_callback(finish)
        refused = False
        with self._lock:
            present = self.provider.present(ks[:admitted]) if admitted else []
            for i in range(admitted):
                if present[i]:
                    continue
                owner = self._claims.get(ks[i])
                if owner is not None:
                    job.deps[i] = owner
                else:
                    self._claims[ks[i]] = job
                    job.claimed.append(i)
            self._stats.saves += 1
            self._stats.rejected_pages += len(ks) - admitted
            # Queued under the same lock as the claims: a save that depends on an earlier one's
            # claims is then always behind it on the (single, FIFO) save thread.
            try:
                self._save_pool.submit(self._run_save, job, planes, bids, par, present, blobs, mark)
            except RuntimeError:  # pool shut down by close() racing this call
                refused = True
        if refused:
            handle._finish(result, ClosedError("the cache is closed"))
        return handle

    def _anchor_blobs(self, anchors: AnchorSource | None, n: int, checkpoints: Iterable[int],
                      start_page: int) -> dict[int, dict[str, bytes]]:
        out: dict[int, dict[str, bytes]] = {}
        if anchors is None:
            return out
        if callable(anchors):
            for i in self.anchor_positions(n, checkpoints, start_page=start_page):
                got = anchors(i)
                if got:
                    out[i] = self._blob_map(got, i)
            return out
        if not isinstance(anchors, Mapping):
            raise InvalidArgumentError("anchors must be a {page_index: {name: bytes}} mapping or a callable")
        for i, blobs in anchors.items():
            if type(i) is not int or not 0 <= i < n:
                raise InvalidArgumentError(f"anchor page index {i!r} outside the chain of {n} pages")
            out[i] = self._blob_map(blobs, i)
        return out

    @staticmethod
    def _blob_map(blobs: AnchorBlobs, i: int) -> dict[str, bytes]:
        if not isinstance(blobs, Mapping):
            raise InvalidArgumentError(f"anchors for page {i} must be a {{name: bytes}} mapping")
        # Copied now: the engine may overwrite its state buffers before the save thread runs.
        return {check_anchor_name(name): bytes(readable_bytes(b)) for name, b in blobs.items()}

    def _run_save(self, job: _SaveJob, planes: Any, bids: Sequence[int], parent: Key | None,
                  present: Sequence[bool], blobs: Mapping[int, Mapping[str, bytes]], after: Any) -> None:
        result: SaveResult = job.handle._result
        try:
            if self._direct_saves and self._direct_run(job, present) is not None:
                self._save_direct(job, result, planes, bids, parent, present, blobs, after)
            else:
                self._save_pages(job, result, planes, bids, parent, present, blobs, after)
            if self._hybrid is not None:  # hybrid hook: roll back pages a failed anchor strands
                self._hybrid.after_save(job.keys, job.claimed, result)
        except BaseException as exc:
            job.handle._finish(result, exc)
            return
        job.handle._finish(result)

    def _save_pages(self, job: _SaveJob, result: SaveResult, planes: Any, bids: Sequence[int],
                    parent: Key | None, present: Sequence[bool], blobs: Mapping[int, Mapping[str, bytes]],
                    after: Any) -> None:
        ks = job.keys
        prov = self.provider
        P = self.page_nbytes
        chunks = [job.claimed[c : c + self.chunk_pages] for c in range(0, len(job.claimed), self.chunk_pages)]
        where = {idx: (ci, j) for ci, part in enumerate(chunks) for j, idx in enumerate(part)}
        # Device -> host copies go chunk by chunk into two bounce buffers: chunk c+1 is being
        # copied while the pages of chunk c are sealed, parent before child.
        issued: collections.deque[tuple[int, Any, _Staging]] = collections.deque()
        next_chunk = 0

        def issue_next() -> None:
            nonlocal next_chunk
            if next_chunk >= len(chunks):
                return
            part = chunks[next_chunk]
            st = self._get_staging()
            try:
                h = self.engine.save(planes, [bids[i] for i in part], [st.region(j) for j in range(len(part))],
                                     after=after)
            except BaseException:
                self._put_staging(st)
                raise
            issued.append((next_chunk, h, st))
            job.handle._add_transfer(h)
            next_chunk += 1
            if next_chunk == len(chunks):
                job.handle._all_issued()

        current: tuple[int, _Staging] | None = None
        stop: str | None = None
        prev = parent
        # A rolling lease on the deepest page of the chain saved so far: it keeps the chain from
        # being evicted under the save, and with the tail pinned, each reservation and seal below
        # it costs O(1) in a tree index instead of a walk over every unpinned ancestor.
        held: Lease | None = prov.lease([parent]) if parent is not None else None

        def advance(k: Key) -> bool:
            nonlocal held
            nl = prov.lease([k])
            if not nl.prefix_len:
                nl.release()
                return False
            if held is not None:
                held.release()
            held = nl
            return True

        try:
            issue_next()
            issue_next()
            if not chunks:
                job.handle._copied.set()
            i = 0
            while i < len(ks):
                k = ks[i]
                loc = where.get(i)
                if loc is not None:
                    ci, j = loc
                    if current is None or current[0] != ci:
                        if current is not None:
                            self._put_staging(current[1])
                            current = None
                        c, h, st = issued.popleft()
                        current = (c, st)
                        h.wait()
                        result.nbytes += len(chunks[c]) * P
                        issue_next()
                        if c == len(chunks) - 1:
                            job.handle._copied.set()  # the engine may reuse its blocks now
                    if self._batch:
                        # The claimed pages that follow in this bounce buffer go in one
                        # put_many; anchors are attached only after a run's last page.
                        run = [i]
                        while run[-1] + 1 < len(ks) and run[-1] not in blobs:
                            nxt = where.get(run[-1] + 1)
                            if nxt is None or nxt[0] != ci:
                                break
                            run.append(run[-1] + 1)
                        stop, done = self._store_run(ks, run, prev, current[1], [where[x][1] for x in run],
                                                     result)
                        if done:
                            i = run[done - 1]
                            k = ks[i]
                        if done and stop is None and not advance(k):
                            stop = f"page {i} was evicted right after its seal"
                    else:
                        stop = self._store_page(k, prev, current[1].page(j), result)
                        if stop is None and not advance(k):
                            stop = f"page {i} was evicted right after its seal"
                elif present[i]:
                    if advance(k):
                        result.dedup += 1
                    else:
                        stop = f"page {i} was evicted before its children could be saved"
                else:
                    dep = job.deps.get(i)
                    if dep is not None:
                        dep.done.wait(self.wait_timeout)
                    if advance(k):
                        result.coalesced += 1
                    else:
                        stop = f"page {i} was not stored by the concurrent save it waited for"
                if stop is None and i in blobs:
                    for name, blob in blobs[i].items():
                        try:
                            prov.put_anchor(k, name, blob)
                        except (UnknownKeyError, CapacityError) as exc:
                            stop = f"anchor {name!r} of page {i}: {exc}"
                            break
                        result.anchors += 1
                if stop is not None:
                    break
                prev = k
                i += 1
                # Hand the GIL over between pages: an engine thread waiting for it (a decode step)
                # gets it now rather than after the interpreter's 5 ms switch interval.
                time.sleep(0)
        finally:
            if held is not None:
                held.release()
            if current is not None:
                self._put_staging(current[1])
            while issued:
                _c, h, st = issued.popleft()
                try:
                    h.wait()
                finally:
                    self._put_staging(st)
            job.handle._copied.set()
        result.stopped = stop

    # -- zero-copy saves (providers with their own chain reservation) --------------------------
    @staticmethod
    def _direct_run(job: _SaveJob, present: Sequence[bool]) -> int | None:
        """Where the run of pages this save writes itself starts, when it is one run to the end
        of the chain with nothing of another save's after it (the common case: a stored or
        in-flight prefix, then new pages); ``None`` sends the save down the bounce path."""
        c = job.claimed
        if not c or c[-1] != len(job.keys) - 1 or c[-1] - c[0] + 1 != len(c):
            return None
        s = c[0]
        if any(i >= s for i in job.deps):
            return None
        return s

    def _attach(self, k: Key, i: int, blobs: Mapping[int, Mapping[str, bytes]], result: SaveResult) -> str | None:
        for name, blob in blobs.get(i, {}).items():
            try:
                self.provider.put_anchor(k, name, blob)
            except (UnknownKeyError, CapacityError) as exc:
                return f"anchor {name!r} of page {i}: {exc}"
            result.anchors += 1
        return None

    def _save_direct(self, job: _SaveJob, result: SaveResult, planes: Any, bids: Sequence[int],
                     parent: Key | None, present: Sequence[bool], blobs: Mapping[int, Mapping[str, bytes]],
                     after: Any) -> None:
        """A save whose device→host copies land in the provider's own reservations.

        The run of new pages is reserved chunk by chunk with ``reserve_many`` (a chunk's first
        parent is the previous chunk's last page, still in flight), the copy engine DMAs each
        chunk straight into its reservations, and ``seal_many`` publishes a chunk root first once
        its DMA is done — while the next chunk is being copied.  No bounce buffer, no host copy."""
        ks = job.keys
        prov = self.provider
        s = self._direct_run(job, present)
        assert s is not None
        stop: str | None = None
        prev = parent
        held: Lease | None = prov.lease([parent]) if parent is not None else None
        try:
            for i in range(s):  # the prefix: stored already, or by an earlier save of this cache
                k = ks[i]
                dep = job.deps.get(i)
                if dep is not None:
                    dep.done.wait(self.wait_timeout)
                nl = prov.lease([k])
                if not nl.prefix_len:
                    nl.release()
                    stop = f"page {i} was not stored when its children were to be saved"
                    break
                if held is not None:
                    held.release()
                held = nl
                if present[i]:
                    result.dedup += 1
                else:
                    result.coalesced += 1
                stop = self._attach(k, i, blobs, result)
                if stop is not None:
                    break
                prev = k
            if stop is None:
                stop = self._direct_chunks(job, result, planes, bids, s, prev, blobs, after)
        finally:
            if held is not None:
                held.release()
            job.handle._all_issued()
            job.handle._copied.set()
        result.stopped = stop

    def _direct_chunks(self, job: _SaveJob, result: SaveResult, planes: Any, bids: Sequence[int], s: int,
                       prev: Key | None, blobs: Mapping[int, Mapping[str, bytes]], after: Any) -> str | None:
        ks = job.keys
        n = len(ks)
        prov = self.provider
        P = self.page_nbytes
        tag = self.salt.tag
        inflight: collections.deque[tuple[int, list[Reservation | None], Any]] = collections.deque()
        pos = s

        def seal_oldest() -> str | None:
            lo, ress, h = inflight.popleft()
            if h is not None:
                h.wait()
            real = [r for r in ress if r is not None]
            for res in real:
                res.mark_written()
            failure: HostKVError | None = None
            if real:
                try:
                    prov.seal_many(real)
                except HostKVError as exc:  # a prefix is sealed, the rest aborted
                    failure = exc
            for m, r in enumerate(ress):
                i = lo + m
                if r is None:
                    result.dedup += 1
                elif r.state == "sealed":
                    result.stored += 1
                    result.nbytes += P
                else:
                    return f"capacity: {failure}" if isinstance(failure, CapacityError) else f"page {i}: {failure}"
                if i in blobs:
                    why = self._attach(ks[i], i, blobs, result)
                    if why is not None:
                        return why
            return None

        stop: str | None = None
        try:
            while pos < n and stop is None:
                hi = min(n, pos + self.chunk_pages)
                chunk_keys = ks[pos:hi]
                rc = prov.reserve_many(chunk_keys, [prev, *chunk_keys[:-1]], P, salt_tag=tag)
                ress = rc.reservations
                if ress:
                    idx = [pos + m for m, r in enumerate(ress) if r is not None]
                    h = None
                    if idx:
                        try:
                            h = self.engine.save(planes, [bids[i] for i in idx],
                                                 [r.regions() for r in ress if r is not None], after=after)
                        except BaseException:
                            for r in ress:
                                if r is not None:
                                    with contextlib.suppress(HostKVError):
                                        prov.abort(r)
                            raise
                        job.handle._add_transfer(h)
                    inflight.append((pos, ress, h))
                    prev = chunk_keys[len(ress) - 1]
                    pos += len(ress)
                if pos >= n:
                    job.handle._all_issued()
                err = rc.error
                if err is not None:
                    while inflight and stop is None:
                        stop = seal_oldest()
                    if stop is not None:
                        break
                    if isinstance(err, InFlightError):
                        # another writer is storing this page: wait for its seal, then go on
                        k = ks[pos]
                        if not prov.wait_sealed(k, self.wait_timeout):
                            stop = f"page {k.hex()[:16]} stayed in flight at another writer"
                            break
                        result.coalesced += 1
                        stop = self._attach(k, pos, blobs, result)
                        prev = k
                        pos += 1
                        continue
                    stop = f"capacity: {err}" if isinstance(err, CapacityError) else f"page {pos}: {err}"
                    break
                # Seal what the DMA has finished (root first) without waiting: the copies of the
                # whole run are queued as fast as they can be reserved, so the link never idles
                # behind the host's sealing (hashing) of earlier chunks.
                while stop is None and inflight and (inflight[0][2] is None or inflight[0][2].done()):
                    stop = seal_oldest()
            if stop is None and pos >= n:
                # Copies of one direction complete in order: the last chunk's done means every
                # block is copied out, and the engine may reuse them while the seals finish.  A
                # waiter (the wait releases the GIL) reports it, so the seals below overlap the
                # copies still running instead of starting behind the last of them.
                last = next((h for _lo, _r, h in reversed(inflight) if h is not None), None)
                if last is None:
                    job.handle._copied.set()
                else:
                    copied = job.handle._copied

                    def report(h: Any = last) -> None:
                        with contextlib.suppress(Exception):
                            h.wait()
                        copied.set()

                    threading.Thread(target=report, name="hostkv-save-copied", daemon=True).start()
            while inflight and stop is None:
                stop = seal_oldest()
        finally:
            # What was reserved but not sealed (after a stop or an error) is aborted once its DMA
            # is over: freeing arena blocks a copy still writes into would corrupt their next user.
            for _lo, ress, h in inflight:
                if h is not None:
                    with contextlib.suppress(Exception):
                        h.wait()
                for r in ress:
                    if r is not None and r.state == "open":
                        with contextlib.suppress(HostKVError):
                            prov.abort(r)
        return stop

    def _store_run(self, ks: Sequence[Key], run: Sequence[int], parent: Key | None, st: _Staging,
                   slots: Sequence[int], result: SaveResult) -> tuple[str | None, int]:
        """Store pages ``ks[run[0]] .. ks[run[-1]]`` (consecutive, ``ks[run[0]]`` under ``parent``)
        from bounce-buffer slots ``slots`` with one ``put_many``.  Returns why the chain must stop
        (or ``None``) and how many pages of the run are now stored."""
        items = [(ks[x], parent if m == 0 else ks[x - 1], st.page(slot))
                 for m, (x, slot) in enumerate(zip(run, slots, strict=True))]
        got = self.provider.put_many(items, salt_tag=self.salt.tag)  # type: ignore[attr-defined]
        for m, g in enumerate(got):
            if g is True:
                result.stored += 1
            elif g is False:
                result.dedup += 1
            elif isinstance(g, InFlightError):
                # Another writer is storing this page: the per-page path waits for its seal, and
                # stores the rest of the run (which failed here behind it) after it.
                for n in range(m, len(run)):
                    stop = self._store_page(ks[run[n]], items[n][1], items[n][2], result)
                    if stop is not None:
                        return stop, n
                return None, len(run)
            elif isinstance(g, CapacityError):
                return f"capacity: {g}", m
            else:
                return f"page {ks[run[m]].hex()[:16]}: {g}", m
        return None, len(run)

    def _store_page(self, key: Key, parent: Key | None, data: np.ndarray[Any, np.dtype[np.uint8]],
                    result: SaveResult) -> str | None:
        """Reserve, fill and seal one page; return why the chain must stop, or ``None``."""
        prov = self.provider
        deadline = time.monotonic() + self.wait_timeout
        while True:
            try:
                res = prov.reserve(key, parent, self.page_nbytes, salt_tag=self.salt.tag)
            except InFlightError:
                # Another writer (thread or process) is storing this very page: wait for its seal.
                if prov.wait_sealed(key, max(0.0, deadline - time.monotonic())):
                    result.coalesced += 1
                    return None
                if time.monotonic() >= deadline:
                    return f"page {key.hex()[:16]} stayed in flight at another writer"
                continue
            except UnknownKeyError:
                return f"the parent of page {key.hex()[:16]} was evicted; the chain ends there"
            except CapacityError as exc:
                return f"capacity: {exc}"
            break
        if res is None:
            result.dedup += 1
            return None
        try:
            regions: Sequence[HostRegion] | None
            try:
                regions = res.regions()
            except HostKVError:
                regions = None
            if regions is not None:
                # numpy copies release the GIL, so the engine's thread keeps running meanwhile.
                for r in regions:
                    dst = np.frombuffer(r.view, dtype=np.uint8)
                    np.copyto(dst, data[r.offset : r.offset + dst.nbytes])
                res.mark_written()
            else:
                prov.write(res, 0, data)
            prov.seal(res)
        except BaseException:
            with contextlib.suppress(HostKVError):
                prov.abort(res)
            raise
        result.stored += 1
        return None

    # -- helpers ------------------------------------------------------------------------------
    def _get_staging(self) -> _Staging:
        with self._staging_lock:
            if self._staging_free:
                return self._staging_free.pop()
        return _Staging(self._alloc, self.page_nbytes, self.chunk_pages)

    def _put_staging(self, st: _Staging) -> None:
        with self._staging_lock:
            if len(self._staging_free) < 4 and not self._closed:
                self._staging_free.append(st)
                return
        st.close()

    def _chain(self, keys: Sequence[bytes]) -> list[Key]:
        if isinstance(keys, (bytes, bytearray, memoryview, str)) or not isinstance(keys, Sequence):
            raise InvalidArgumentError("keys must be a sequence of 32-byte keys (a chain), not one key")
        return list(Provider._keys(keys))  # the common case (all 32-byte bytes) validated at C speed

    @staticmethod
    def _block_ids(block_ids: Sequence[int], limit: int, what: str, exact: bool = False) -> list[int]:
        if isinstance(block_ids, (bytes, str)) or not isinstance(block_ids, Sequence | np.ndarray):
            raise InvalidArgumentError("block_ids must be a sequence of ints")
        out = [int(b) for b in block_ids]
        if any(b < 0 for b in out):
            raise InvalidArgumentError("block ids must be >= 0")
        if exact and len(out) != limit:
            raise InvalidArgumentError(f"{len(out)} block ids for {limit} {what}; give one per page")
        if len(out) > limit:
            raise InvalidArgumentError(f"{len(out)} block ids for {limit} {what}")
        return out

    @staticmethod
    def _check_blocks(planes: Any, bids: Sequence[int]) -> None:
        nb = int(getattr(planes, "num_blocks", 0))
        bad = [b for b in bids if b >= nb]
        if bad:
            raise InvalidArgumentError(f"block id {bad[0]} outside the planes' {nb} blocks")

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("the HostKVCache is closed")

    def _provider_evictions(self) -> int:
        try:
            return int(self.provider.stats().evictions)
        except HostKVError:
            return 0

    # -- stats --------------------------------------------------------------------------------
    def stats(self) -> CacheStats:
        """A snapshot of the cache's counters and latency summaries."""
        evictions = self._provider_evictions() - self._evictions0
        with self._lock:
            st = CacheStats(**{k: v for k, v in self._stats.__dict__.items() if k != "extra"})
            st.evictions = max(0, evictions)
            for prefix, lat in (("save", self._save_lat), ("restore", self._restore_lat)):
                setattr(st, f"{prefix}_seconds_count", lat.count)
                setattr(st, f"{prefix}_seconds_sum", lat.total)
                setattr(st, f"{prefix}_seconds_p50", lat.quantile(0.5))
                setattr(st, f"{prefix}_seconds_p99", lat.quantile(0.99))
            st.extra = {"in_flight_save_pages": len(self._claims), "in_flight_restores": len(self._restores)}
        return st

    def prometheus_collector(self, prefix: str = "hostkv_cache", labels: Mapping[str, str] | None = None,
                             *, provider: bool = True) -> Any:
        """A ``prometheus_client`` collector exporting :meth:`stats`, latency histograms of
        lookups, saves and restores (``{prefix}_{op}_seconds``), and, with ``provider``, the
        provider's and its tiers' metrics (:class:`hostkv_providers.metrics.ProviderCollector`,
        prefix ``hostkv``).  Register it yourself, or use :meth:`register_prometheus`.  Needs the
        ``prometheus`` extra."""
        try:
            from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise InvalidArgumentError("prometheus_client is not installed",
                                       hint="pip install 'hostkv-providers[prometheus]'") from exc
        cache = self
        names = sorted((labels or {}).keys())
        values = [str((labels or {})[n]) for n in names]
        counters = ("lookups", "hits", "misses", "lookup_pages", "hit_pages", "hit_tokens", "saves", "saved_pages",
                    "dedup_pages", "coalesced_pages", "rejected_pages", "failed_pages", "anchors_saved", "restores",
                    "restored_pages", "coalesced_restores", "bytes_out", "bytes_in", "evictions")
        inner = ProviderCollector(self.provider, labels=labels) if provider else None

        class _Collector:
            def collect(self) -> Iterator[Any]:
                st = cache.stats()
                for name in counters:
                    fam = CounterMetricFamily(f"{prefix}_{name}", f"HostKVCache {name.replace('_', ' ')}",
                                              labels=names)
                    fam.add_metric(values, getattr(st, name))
                    yield fam
                for op, lat in (("lookup", cache._lookup_lat), ("save", cache._save_lat),
                                ("restore", cache._restore_lat)):
                    hist = HistogramMetricFamily(f"{prefix}_{op}_seconds", f"HostKVCache {op} latency",
                                                 labels=names)
                    h = lat.histogram
                    hist.add_metric(values, h.buckets(), h.total)
                    yield hist
                for op in ("save", "restore"):
                    for q in ("p50", "p99"):
                        g = GaugeMetricFamily(f"{prefix}_{op}_seconds_{q}", f"HostKVCache {op} latency {q}",
                                              labels=names)
                        g.add_metric(values, getattr(st, f"{op}_seconds_{q}"))
                        yield g
                g = GaugeMetricFamily(f"{prefix}_in_flight_save_pages", "pages being saved", labels=names)
                g.add_metric(values, st.extra["in_flight_save_pages"])
                yield g
                if inner is not None:
                    yield from inner.collect()

            def describe(self) -> Iterator[Any]:
                return iter(())

        return _Collector()

    def register_prometheus(self, registry: Any = None, **kwargs: Any) -> Any:
        """Register :meth:`prometheus_collector` with ``registry`` (default: the global one)."""
        collector = self.prometheus_collector(**kwargs)
        if registry is None:
            from prometheus_client import REGISTRY

            registry = REGISTRY
        registry.register(collector)
        return collector

    # -- lifecycle ----------------------------------------------------------------------------
    def flush(self, timeout: float | None = None) -> None:
        """Wait until every save submitted so far has finished."""
        fut = self._save_pool.submit(lambda: None)
        fut.result(timeout)

    def close(self) -> None:
        """Finish queued saves and restores, free bounce buffers; idempotent.  The provider stays
        open (it belongs to the caller)."""
        if self._closed:
            return
        self._closed = True
        self._save_pool.shutdown(wait=True)
        self._restore_pool.shutdown(wait=True)
        with self._staging_lock:
            free, self._staging_free = self._staging_free, []
        for st in free:
            st.close()

    def __enter__(self) -> HostKVCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _shutdown_pools(*pools: concurrent.futures.ThreadPoolExecutor) -> None:
    for pool in pools:
        pool.shutdown(wait=False)
