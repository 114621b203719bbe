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

Stream order (R9): ``restore(before=stream)`` orders the stream behind every copy of the restore,
so each kernel enqueued on the stream after the call sees the restored bytes: with the CUDA engine
the call returns once the copies are issued and the stream waits on their event; an engine that
gates streams (a host engine, ``CudaCopyEngine(stream_gates=True)``:
:meth:`~hostkv_providers.device.CopyEngine.gate`) holds it at the call and opens it behind every
copy the restore thread issues later; ``save(after=stream)`` marks the stream's position at the call
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
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from hostkv_providers._capabilities import SupportsBatch, SupportsBatchViews, SupportsViews
from hostkv_providers._checks import check_anchor_name, check_timeout
from hostkv_providers._errors import (
    ClosedError,
    CopyArgumentError,
    HostKVError,
    InvalidArgumentError,
)
from hostkv_providers._keys import ZERO_KEY, Key, MediaItem, Salt, as_key, chain_keys
from hostkv_providers._layout import KVLayout
from hostkv_providers._provider import Provider
from hostkv_providers.cache import _gpusum, _restore, _save
from hostkv_providers.cache._admission import (
    AdmissionPolicy,
    AdmissionRequest,
    AdmitAll,
    AllOf,
    AnchorsOnly,
    MinDepth,
    SeenAtLeast,
)
from hostkv_providers.cache._common import (
    CopyEngineLike,
    _check_max_pages,
    _default_engine,
    _Staging,
    _staging_allocator,
)
from hostkv_providers.cache._handles import (
    CacheHandle,
    CacheHit,
    CacheStats,
    RestoreResult,
    SaveResult,
    _Latency,
    _SaveJob,
)
from hostkv_providers.cache._hybrid import HybridState, make_hybrid
from hostkv_providers.device._engine import BlockIds
from hostkv_providers.device._hostmem import HostAllocator
from hostkv_providers.metrics import ProviderCollector, _check_labels

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
    save_window_bytes:
        Bytes of a zero-copy save's copies (``pinned://``, a tiered fast tier) in flight at once,
        counted in chunks of ``chunk_pages`` (at least two); 0: no bound.  The default, 2 GiB, is
        ~40 ms of a 53 GB/s link: the save thread issues the next chunk when the oldest one's copy
        is done and sealed, so its host work comes in short pieces between waits that release the
        GIL, not in one burst at the save's start that an engine thread waits behind (at 2 MiB
        pages, four chunks; at 32 KiB pages a 25,000-page save is issued whole, as with 0).
        docs/benchmarks.md, "The save window".
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
        save_window_bytes: int = 2 << 30,
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
                                ("save_window_bytes", save_window_bytes, 0), ("seen_capacity", seen_capacity, 0)):
            if type(value) is not int or value < lo:
                raise InvalidArgumentError(f"{name} must be an int >= {lo}, got {value!r}")
        # objects without their methods would fail at the first save/restore, far from the cause
        for name, obj, methods in (("copy_engine", copy_engine, ("save", "restore")),
                                   ("admission", admission, ("admit",)),
                                   ("staging_allocator", staging_allocator, ("allocate",))):
            if obj is not None and not all(callable(getattr(obj, m, None)) for m in methods):
                raise InvalidArgumentError(f"{name} must have {'/'.join(methods)}(), got {type(obj).__name__}")
        wait_timeout = check_timeout(wait_timeout, "wait_timeout")
        lookup_wait_timeout = check_timeout(lookup_wait_timeout, "lookup_wait_timeout")
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
        self.save_window_bytes = save_window_bytes
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
        self._evictions_seen = 0
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
        # The GPU page hasher's one-time compile now, at the engine's start-up, not in its first save.
        _gpusum.prepare(provider, self.engine)

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
        if type(start_page) is not int or start_page < 0:
            raise InvalidArgumentError(f"start_page must be an int >= 0, got {start_page!r}")
        if isinstance(checkpoints, (str, bytes)) or not isinstance(checkpoints, Iterable):
            raise InvalidArgumentError(f"checkpoints must be page indices, got {type(checkpoints).__name__}")
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
        anchor: Key | None = None
        if hyb is not None and hyb.binding:  # hybrid hook: cut to the deepest fully anchored page
            n = hyb.deepest([ks], n, need_anchor)
            if need_anchor is not None and n:
                anchor = ks[n - 1]  # (hit.anchor opens its record)
        elif need_anchor is not None and n:
            # Only where the anchor is: its bytes are read when the engine asks (hit.anchor,
            # hit.read_anchor), off the admission path; the lease keeps the page and its anchor.
            n = self.provider.deepest_anchor(ks[:n], need_anchor)
            if n:
                anchor = ks[n - 1]
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
                       anchor_name=need_anchor, anchor_key=anchor if n else None)
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
        t_lookup = time.perf_counter()
        world = self.salt.tp_world_size
        if (isinstance(rank_keys, (bytes, bytearray, memoryview, str)) or not isinstance(rank_keys, Sequence)
                or len(rank_keys) != world):
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
        anchor: Key | None = None
        if hyb is not None and hyb.binding:  # hybrid hook: every rank's page carries every anchor
            n = hyb.deepest(chains, n, need_anchor)
            if need_anchor is not None and n:
                anchor = own[n - 1]  # (hit.anchor opens its record, as for lookup)
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
                anchor = own[n - 1]  # read when the engine asks (hit.anchor / hit.read_anchor)
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
                       anchor_name=need_anchor, anchor_key=anchor if n else None)
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
            self._lookup_lat.add(time.perf_counter() - t_lookup)
        return hit

    # -- restore (restore.py) -----------------------------------------------------
    restore = _restore.restore
    _run_restore = _restore._run_restore
    _restore_pages = _restore._restore_pages

    # -- save (save.py) -----------------------------------------------------------
    save = _save.save
    _anchor_blobs = _save._anchor_blobs
    _blob_map = staticmethod(_save._blob_map)
    _run_save = _save._run_save
    _save_pages = _save._save_pages
    _direct_run = staticmethod(_save._direct_run)
    _attach = _save._attach
    _save_direct = _save._save_direct
    _direct_chunks = _save._direct_chunks
    _store_run = _save._store_run
    _store_page = _save._store_page
    _get_staging = _save._get_staging
    _put_staging = _save._put_staging

    def _chain(self, keys: Sequence[bytes]) -> list[Key]:
        if isinstance(keys, (bytes, bytearray, memoryview, str)) or not isinstance(keys, Sequence):
            raise InvalidArgumentError("keys must be a sequence of 32-byte keys (a chain), not one key")
        return list(Provider._keys(keys))  # the common case (all 32-byte bytes) validated at C speed

    @staticmethod
    def _block_ids(block_ids: Sequence[int], limit: int, what: str, exact: bool = False) -> list[int]:
        return HostKVCache._block_table(block_ids, limit, what, exact)[0]

    @staticmethod
    def _block_table(block_ids: Sequence[int], limit: int, what: str,
                     exact: bool = False) -> tuple[list[int], npt.NDArray[np.integer[Any]]]:
        """``block_ids`` checked (ints >= 0, at most ``limit``): as a list of Python ints (the
        engine's) and as an integer array (for :meth:`_check_blocks`' bound and distinctness).

        C-speed passes only: this runs on the engine's thread on every call, for 6,400 ids,
        before a restore's first DMA (one type pass and one array conversion; the min, max and
        distinctness then cost microseconds on the array, not one Python pass each)."""
        if isinstance(block_ids, (bytes, str)) or not isinstance(block_ids, Sequence | np.ndarray):
            raise InvalidArgumentError("block_ids must be a sequence of ints")
        if isinstance(block_ids, np.ndarray):
            if block_ids.ndim != 1 or block_ids.dtype.kind not in "iu":
                raise InvalidArgumentError(f"block_ids must be a 1-D integer array, got {block_ids.dtype} "
                                           f"with {block_ids.ndim} dimensions")
            arr = block_ids  # (the engine gets the list: a copy the caller cannot change)
            out: list[int] = arr.tolist()  # Python ints (a comprehension over it cost 3x more)
        else:
            out = list(block_ids)
            if not set(map(type, out)) <= {int}:
                # int(1.7) would pick block 1, True block 1, "a" a ValueError: only integers
                if any(isinstance(b, bool) or not isinstance(b, int | np.integer) for b in out):
                    raise InvalidArgumentError("block ids must be ints")
                out = [int(b) for b in out]
            try:
                arr = np.fromiter(out, dtype=np.int64, count=len(out))
            except OverflowError:  # beyond int64: negative, or past any pool
                raise InvalidArgumentError("block ids must be >= 0" if min(out) < 0
                                           else f"block id {max(out)} is out of range") from None
        if arr.size and arr.min() < 0:
            raise InvalidArgumentError("block ids must be >= 0")
        if exact and len(out) != limit:
            raise InvalidArgumentError(f"{len(out)} block ids for {limit} {what}; give one per page")
        if len(out) > limit:
            raise InvalidArgumentError(f"{len(out)} block ids for {limit} {what}")
        return out, arr

    @staticmethod
    def _check_blocks(planes: Any, bids: list[int], arr: npt.NDArray[np.integer[Any]], *,
                      distinct: bool = False) -> BlockIds:
        """``bids`` (from :meth:`_block_table`, ``arr`` its array) within the planes' blocks: as
        :class:`BlockIds`, which the package's engines take without checking them again.
        ``distinct``: refuse a block that repeats (``CopyArgumentError``, as an engine does): the
        restore thread hands the engine one chunk at a time, so an engine's own check sees
        repeats within a chunk only, and a block given twice in different chunks got two pages,
        the later one winning, with the restore reported whole."""
        nb = int(getattr(planes, "num_blocks", 0))
        if bids and int(arr.max()) >= nb:
            bad = next(b for b in bids if b >= nb)
            raise InvalidArgumentError(f"block id {bad} outside the planes' {nb} blocks")
        unique = False
        if distinct and bids:
            if nb <= 64 * len(bids):  # a bitmap of the pool's blocks: O(n), no sort
                seen = np.zeros(nb, dtype=bool)
                seen[arr] = True
                unique = int(np.count_nonzero(seen)) == len(bids)
            else:
                srt = np.sort(arr)
                unique = not bool((srt[1:] == srt[:-1]).any())
            if not unique:
                vals, counts = np.unique(arr, return_counts=True)
                first = int(np.flatnonzero(counts > 1)[0])
                raise CopyArgumentError(f"block ids must be distinct: block {int(vals[first])} is given "
                                        f"{int(counts[first])} times",
                                        hint="each restored page needs a block of its own")
        return BlockIds(bids, nb, distinct=unique)

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("the HostKVCache is closed")

    def _provider_evictions(self) -> int:
        """The provider's evictions counter; the last one read while the provider cannot answer
        (closed): 0 there made the cache's evictions counter go backwards."""
        with contextlib.suppress(HostKVError):
            self._evictions_seen = int(self.provider.stats().evictions)
        return self._evictions_seen

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
        _check_labels(labels, ())
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
    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every save submitted so far has finished; ``False`` if ``timeout``
        seconds (``>= 0``; ``None``: no limit) passed first.  Raises ``ClosedError`` after
        :meth:`close` (which itself finishes every queued save)."""
        if timeout is not None:
            timeout = check_timeout(timeout)
        self._check_open()
        try:
            fut = self._save_pool.submit(lambda: None)
        except RuntimeError:  # shut down by a close() racing this call
            raise ClosedError("the HostKVCache is closed") from None
        try:
            fut.result(timeout)
        except concurrent.futures.TimeoutError:
            return False
        return True

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
