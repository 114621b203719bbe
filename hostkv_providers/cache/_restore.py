"""The restore half of :class:`~hostkv_providers.cache.HostKVCache`: a hit's pages into the engine's
blocks (zero-copy views or staged bounce buffers), the stream gate, anchors handed out with the
restore.  Functions of the cache (``self`` is the cache); ``HostKVCache`` binds them as methods."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from hostkv_providers._blockhash import TREE_ALGORITHM
from hostkv_providers._errors import (
    ClosedError,
    InvalidArgumentError,
)
from hostkv_providers._keys import Key
from hostkv_providers._region import HostPages, HostRegion
from hostkv_providers._reservation import Lease
from hostkv_providers.cache._common import (
    _VIEW_LEASE_PAGES,
    _as_planes,
    _Staging,
)
from hostkv_providers.cache._gpusum import RestoreCheck, restore_check
from hostkv_providers.cache._handles import (
    CacheHandle,
    CacheHit,
    RestoreResult,
    engine_gates,
)
from hostkv_providers.device import CopyEngine

if TYPE_CHECKING:
    from hostkv_providers.cache._cache import HostKVCache


def restore(self: HostKVCache, hit: CacheHit, into: Any, block_ids: Sequence[int], *, before: Any = None,
            release: bool = True, first_page: int = 0,
            anchors_into: Mapping[str, Any] | None = None, layerwise: bool = False) -> CacheHandle:
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
        copies are issued later on the cache's own thread (a restore of at most
        ``chunk_pages`` pages from page-locked views issues its one transfer on the caller's
        thread, before this call returns).  With the CUDA engine this call returns once the
        copies are *issued* (not done) and the stream waits on their event: an order CUDA
        sees (``CudaCopyEngine(stream_gates=True)`` instead holds the stream on a
        device-visible flag at once, without waiting; see its caveat).  A host engine's
        stream is gated at once.  (:meth:`CacheHandle.wait_on` orders further streams the
        same way.)
    release:
        Release the hit's lease when the restore finishes.
    first_page:
        A ranged restore: start at page ``first_page`` of the hit (pages
        ``[first_page, first_page + len(block_ids))``).  On a hybrid cache the result is cut
        back to the deepest page within that range carrying every required anchor
        (``result.anchor_page`` is its depth in the hit, ``result.pages`` counts from
        ``first_page``); a range holding no such page restores 0 usable pages.
    anchors_into:
        Hybrid caches: ``{name: writable buffer}`` the anchors are copied into (once, on the
        restore thread); ``result.anchors[name]`` then views that buffer.
    layerwise:
        Complete the restore layer by layer: the handle's :meth:`CacheHandle.wait_layer_on`
        ``(i, stream)`` orders ``stream`` behind layer ``i`` of every page only, so the
        engine's layer ``i`` prefill overlaps the copy of the later layers (pass no
        ``before=`` then: it orders the stream behind the whole restore).  Delivered layer by
        layer where the hit's pages are zero-copy views of pinned memory in one run
        (``pinned://``, the fast tier of ``tiered://``): the whole range goes to the copy
        engine as one layer-major transfer.  Through bounce buffers (``mmap://``, ``lmdb://``,
        ``tiered://``'s slow tier) and per-page views, every layer completes with the whole
        restore (the per-layer calls stay correct, they are just not earlier).

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
    if not hit.num_pages or first_page == hit.num_pages:
        # nothing to restore; a finished handle keeps callers uniform.  release= still holds: a
        # caller's last ranged restore may be the empty one, and its hit stayed leased for good
        self._block_ids(block_ids, 0, "hit pages")
        if release:
            hit.release()
        done = CacheHandle("restore", self.engine, self.layout.num_layers)
        done._finish(RestoreResult())
        return done
    if hit.released:
        raise InvalidArgumentError("the hit was released; look it up again")
    if not isinstance(layerwise, bool):
        raise InvalidArgumentError(f"layerwise must be a bool, got {layerwise!r}")
    # A restore of at most one chunk (a ranged restore, a short prompt's hit) goes the layer-wise
    # way: its views and its one transfer are started here, on the caller's thread, rather than
    # after the hand-off to the restore thread.  H200, 200 pages of 2 MiB (.devcarry/rgprobe.py,
    # session 22): 9.10 ms best / 9.29 median this way against 10.04 / 10.61 ms page-major
    # through the restore thread (the copy engine alone, page-major batch copies: 10.23 ms; a
    # bulk H2D of the same bytes 7.61 ms).  Every layer completes with the transfer; the
    # caller's thread holds the GIL for the views of at most chunk_pages pages.  Not from
    # pageable views into the CUDA engine: those copies would run synchronously on this thread.
    try:
        small = (min(len(block_ids), hit.num_pages - first_page) <= self.chunk_pages
                 and (bool(getattr(self.provider, "views_pinned", False)) or not hasattr(self.engine, "prestage")))
    except TypeError:
        small = False  # (the checks below say what is wrong with block_ids)
    layer_major = layerwise or small
    pre = _prestage(self, hit, first_page, block_ids) if layer_major else None
    try:
        handle = _restore_checked(self, hit, into, block_ids, before, release, first_page, anchors_into,
                                  layer_major, pre)
    finally:
        if pre is not None:
            pre.release()  # (a no-op once the engine took it)
    return handle


def _prestage(self: HostKVCache, hit: CacheHit, first_page: int, block_ids: Sequence[int]) -> Any:
    """A layer-wise restore's first staged copies, begun before its block ids and views are
    checked (:meth:`CudaCopyEngine.prestage`: they write the engine's staging buffers only).
    Checking 6,400 block ids and viewing the hit's pages cost ~1 ms of Python on the H200 host;
    layer 0 no longer waits for it.  ``None`` where it does not apply."""
    engine: Any = self.engine  # (only the CUDA engine has these verbs)
    fn = getattr(engine, "prestage", None)
    if fn is None or not (self._views and self._page_views and hit.lease is not None and self.layout.num_layers > 1):
        return None
    try:
        count = min(len(block_ids), hit.num_pages - first_page)
    except TypeError:
        return None  # (the checks say what is wrong with it)
    if count < 1:
        return None
    try:  # a head start only: whatever fails here, the restore's own checks and calls report
        k = min(count, engine.prestage_pages(self.layout))
        head = self.provider.view_pages(hit.lease, hit.keys[first_page : first_page + k])  # type: ignore[attr-defined]
    except Exception:
        return None
    return None if head is None else fn(head, self.layout, count)


def _restore_checked(self: HostKVCache, hit: CacheHit, into: Any, block_ids: Sequence[int], before: Any,
                     release: bool, first_page: int, anchors_into: Mapping[str, Any] | None, layerwise: bool,
                     pre: Any) -> CacheHandle:
    """:func:`restore` after its first checks (``pre``: from :func:`_prestage`, or ``None``)."""
    bids_l, arr = self._block_table(block_ids, hit.num_pages - first_page, "hit pages")
    planes = _as_planes(self.layout, into)
    bids = self._check_blocks(planes, bids_l, arr, distinct=True)
    keys = hit.keys[first_page : first_page + len(bids)]
    # A hybrid restore also fills the caller's anchor buffers and reports views of them: two
    # callers with different buffers share nothing (the second one's would never be written).
    sink = None if anchors_into is None else tuple(sorted((str(n), id(b)) for n, b in anchors_into.items()))
    ident = (keys, planes.ptrs, planes.block_strides, tuple(bids), sink)
    # An engine that gates streams (a host gate, or CudaCopyEngine(stream_gates=True)) holds the
    # caller's stream back right here; any other is ordered once the restore thread has issued
    # the copies (this thread waits for that below, without the cache's lock: an order on
    # copies not issued yet is not one CUDA can see, see CudaCopyEngine's stream_gates).
    gates = engine_gates(self.engine)
    if before is not None and not gates and callable(check := getattr(self.engine, "check_stream", None)):
        check(before)  # (ordered only after the submit below: a stream it cannot order is refused now)
    with self._lock:
        prior = self._restores.get(ident)
        if prior is None or prior.done():
            prior = None
            handle = CacheHandle("restore", self.engine, self.layout.num_layers)
            self._restores[ident] = handle
            if before is not None and gates:
                try:
                    # Gated now, on the caller's thread: kernels the caller enqueues from here on
                    # wait for the copies the restore thread issues later.
                    handle.wait_on(before)
                except BaseException:
                    del self._restores[ident]
                    raise
    if prior is not None:
        if pre is not None:
            # before any wait (the issue lock is the prior's too), and not under the cache's lock:
            # an unused prestage first waits for its own copies
            pre.release()
        if before is not None:  # the caller's stream is ordered behind the shared copies
            prior.wait_on(before)  # (raises for a stream it cannot order: the hit stays the caller's)
        with self._lock:
            self._stats.coalesced_restores += 1
        if release:
            prior.add_done_callback(lambda _h: hit.release())  # (at once if it finished meanwhile)
        return prior
    # From here on the handle is registered and the caller's stream may be gated: a failure
    # before the restore thread has it must finish the handle (opening the gate behind any copy
    # already issued), or the stream stays gated and the same restore asked again coalesces into
    # a handle nobody finishes.
    layered = False
    refused = False

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
        if release and not refused:  # (a refused call leaves the hit to its caller, as it was)
            hit.release()
        if layered:
            hit._unhold()

    handle._on_finish(finish)
    begun: tuple[Any, HostPages] | BaseException | None = None
    try:
        if self._hybrid is not None:  # hybrid hook: where the anchors go
            self._hybrid.note_restore(handle, anchors_into, first_page)
        # A layer-wise restore from views reads through the hit's own lease (see
        # _start_layer_major): the hit holds its pages until the restore is done, whenever it is
        # released.
        layered = (layerwise and self._views and self._page_views and hit.lease is not None
                   and isinstance(self.engine, CopyEngine) and self.layout.num_layers > 1)
        if layered:
            hit._hold()
            try:
                begun = _start_layer_major(self, handle, hit, keys, planes, bids, pre)
            except BaseException as exc:  # reported through the handle, as on the restore thread
                begun = exc
        try:
            self._restore_pool.submit(self._run_restore, handle, hit, keys, planes, bids, begun)
        except RuntimeError:  # shut down by a close() racing this call (as save() reports it)
            raise ClosedError("the HostKVCache is closed") from None
    except BaseException as exc:
        refused = True
        if isinstance(begun, tuple):
            begun[0].wait()  # a copy issued on this thread: done before its blocks are given back
        handle._finish(RestoreResult(), exc)
        raise
    if before is not None and not gates:
        if pre is not None:
            pre.release()  # (a no-op once the engine took it; else the issue lock the wait needs)
        handle.wait_on(before)  # once the restore thread has issued every copy (or failed)
    return handle


def _run_restore(self: HostKVCache, handle: CacheHandle, hit: CacheHit, keys: Sequence[Key], planes: Any,
                 bids: Sequence[int], pre: tuple[Any, HostPages] | BaseException | None = None) -> None:
    result = RestoreResult()
    handle._result = result
    try:
        self._restore_pages(handle, result, hit, keys, planes, bids, pre)
        if self._hybrid is not None:  # hybrid hook: anchors read with the restore, cut back
            self._hybrid.finish_restore(handle, result, keys, hit.keys)
    except BaseException as exc:
        handle._finish(result, exc)
        return
    handle._finish(result)


def _restore_pages(self: HostKVCache, handle: CacheHandle, result: RestoreResult, hit: CacheHit, keys: Sequence[Key],
                   planes: Any, bids: Sequence[int],
                   pre: tuple[Any, HostPages] | BaseException | None = None) -> None:
    # ``pre``: a layer-wise restore from chunk-level views (restore() decided it and holds the
    # hit): the whole hit's views, then one layer-major transfer with an event per layer, both
    # started on the caller's thread (_start_layer_major; its error, if it failed), so layer 0 of the last
    # page lands at about 1/num_layers of the restore, not behind every earlier chunk and the
    # hand-off to this thread; here it is verified and waited for.  On every other
    # path the pages go chunk by chunk, page-major (the fastest), and every layer completes with
    # the whole restore.  (The library's engines take ``layers=``; a CopyEngineLike may not.)
    chunk = self.chunk_pages
    P = self.page_nbytes
    # in-flight engine transfers with what they read from: a bounce buffer or view leases, and
    # for a verified view chunk (its first page, the GPU's digests of the blocks, the checksums)
    pending: list[tuple[Any, _Staging | None, list[Lease], tuple[int, Any, Any] | None]] = []
    check: RestoreCheck | None = None
    bad = False

    def retire() -> None:
        nonlocal bad
        h, st, leases, verify = pending.pop(0)
        try:
            h.wait()
            if verify is not None:
                start, dg, expected = verify
                good = RestoreCheck.good_prefix(dg, expected)
                if good < len(expected) and start + good < result.pages:
                    # A page differs from its stored checksum after the copy (host memory or
                    # the copy corrupted it): the hit ends before it, as after a host-side
                    # checksum failure, and no later chunk counts.
                    result.pages = start + good
                    result.nbytes = result.pages * P
                    result.stopped = f"page {start + good} failed its checksum after its copy"
                    bad = True
        finally:
            if verify is not None:
                verify[1].close()
            if st is not None:
                self._put_staging(st)
            for lease in leases:
                lease.release()

    prefetched = 0  # keys[:prefetched] were hinted to the provider (prefetch)
    try:
        if keys and not (self._views and hit.lease is not None):
            # Bounce path from the first chunk on: a disk-backed provider starts reading it in now,
            # while the bounce buffers are set up (after a restart the first use allocates and
            # pins them: ~0.1 s per 512 MiB with the disk idle otherwise).
            self.provider.prefetch(keys[:chunk])
            prefetched = min(chunk, len(keys))
        i = 0
        if isinstance(pre, BaseException):
            raise pre
        if pre is not None:
            i, check = _finish_layer_major(self, result, pre, planes, bids, pending)
        while i < len(keys) and not bad:
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
                    verify = None
                    try:
                        sums = getattr(srcs, "checksums", None)
                        checked = sums is not None and getattr(srcs, "algorithm", None) == TREE_ALGORITHM
                        if checked and check is None:
                            # views of a store that verifies reads: check the blocks on the GPU
                            check = restore_check(planes)
                        checker = check if checked else None
                        # The hash behind the transfer's event (wait_on: this thread waits until
                        # the engine has issued the chunk), except on an engine that shares
                        # restores with its staging path (CudaCopyEngine.shares_restores) and
                        # gates streams (stream_gates=True, opt-in): that issue lasts as long as
                        # the copies, so the check's stream is held back by the restore's gate
                        # instead and enqueuing waits for nothing.  Not
                        # always gated: on the H200 verified restores ran at 0.848x of a bulk copy
                        # gated, 0.952x behind the event, 0.953x unverified (session 18,
                        # docs/benchmarks.md; why was not separated: the gated stream polls a flag
                        # in mapped host memory across the bus the copies use, and this thread,
                        # no longer waiting, competes for the GIL with the issuing threads).
                        gated = (checker.gate_stream() if checker is not None
                                 and getattr(self.engine, "shares_restores", False)
                                 and engine_gates(self.engine) else None)
                        h = self.engine.restore(srcs, planes, bids[i : i + len(part)], before=gated)
                        if checker is not None:
                            verify = (i, checker.enqueue(h, bids[i : i + len(part)], gated=gated is not None), sums)
                    except BaseException:
                        for vlease in vleases:
                            vlease.release()
                        raise
                    handle._add_transfer(h)
                    pending.append((h, None, vleases, verify))
                    result.viewed += len(part)
                    ok = len(part)
            if srcs is None:
                # Bounce through host buffers; at most two in flight, so the read of this chunk
                # overlaps the copy of the previous one.  The provider is told of the next
                # chunk first: a disk-backed one reads it in while this one is read, checked
                # and handed to the engine.
                if prefetched < i + len(part):
                    # A store with views that does not hold this chunk in view-able memory (the
                    # slow tier of tiered:// after a restart): hint the chunk itself before its
                    # read.  Without it the first chunk was read cold by bare 2 MiB preads
                    # (CPU machine, 512 MiB chunks: 0.41-1.31 s against 0.19-0.25 s hinted).
                    self.provider.prefetch(part)
                nxt = keys[i + len(part) : i + len(part) + chunk]
                if nxt:
                    self.provider.prefetch(nxt)
                prefetched = i + len(part) + len(nxt)
                while sum(1 for _h, st, _l, _v in pending if st is not None) >= 2:
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
                    pending.append((h, st, [], None))
                    result.staged += ok
                else:
                    self._put_staging(st)
            if bad:  # a verification found while waiting for a bounce buffer: the hit ends there
                break
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
        if check is not None:
            check.close()


def _start_layer_major(self: HostKVCache, handle: CacheHandle, hit: CacheHit, keys: Sequence[Key], planes: Any,
                       bids: Sequence[int], pre: Any = None) -> tuple[Any, HostPages] | None:
    """The layer-wise path of :func:`_restore_pages`, started on the caller's thread: the whole
    hit's views, then ONE layer-major transfer with an event per layer.  ``None``: the hit's pages
    have no chunk-level views (the restore thread restores them page-major)."""
    engine: Any = self.engine  # a CopyEngine (restore() checked): it takes layerwise=
    # The views of the whole hit in one call, through the hit's own lease (which restore() holds
    # until the restore is done; pinned finds them through the lease's rows, ~0.1 us a page).
    # All of it goes to the engine at once: where every page goes by direct DMA the engine
    # enqueues layer 0's copies right here, before this call returns; otherwise its worker
    # issues every layer long before layer 0's copies are done.  (Issuing layers 1.. as a second
    # transfer once layer 0 was recorded put ~200 copies' worth of Python on the worker right when
    # layer 0 completed, and the engine's thread then waited for the GIL: layer 0 usable at
    # 11.8 ms against 9.4 ms for the engine alone, H200.)
    every = self.provider.view_pages(hit.lease, keys)  # type: ignore[attr-defined]
    if every is None:
        return None
    h = (engine.restore(every, planes, bids, layerwise=True) if pre is None
         else engine.restore(every, planes, bids, layerwise=True, prestaged=pre))
    handle._add_transfer(h)
    if len(every) >= len(keys) and not engine_gates(engine):
        # The hit's only transfer: no other will be added, so a wait on the whole restore
        # (before= included) waits for this one's issue, not for the restore thread to get to
        # it (behind other restores).  (With gates, marking it now would open them on this
        # thread, behind the worker's issue.)
        handle._all_issued()
    else:
        handle._layers_issued(range(self.layout.num_layers))  # nothing else writes these blocks: waiters may go
    return h, every


def _finish_layer_major(self: HostKVCache, result: RestoreResult, pre: tuple[Any, HostPages], planes: Any,
                        bids: Sequence[int], pending: list[Any]) -> tuple[int, RestoreCheck | None]:
    """The restore thread's part of a layer-wise restore begun by :func:`_start_layer_major`: the
    GPU verification behind it, and its place among the transfers waited for.  Returns how many
    leading pages it took and the verification it set up."""
    h, every = pre
    i = len(every)
    # Waited for first: whatever fails below, the copy issued on the caller's thread is done
    # before the restore reports (and gives the hit's pages and the engine's blocks back; told
    # the restore failed, the engine recomputes into those blocks).
    pending.append((h, None, [], None))
    sums = every.checksums
    check: RestoreCheck | None = None
    if sums is not None and every.algorithm == TREE_ALGORITHM:
        # views of a store that verifies reads: the blocks are checked on the GPU behind the last
        # transfer (every layer of every page is in place once it is done)
        check = restore_check(planes)
        if check is not None:
            try:
                pending[-1] = (h, None, [], (0, check.enqueue(h, bids[:i]), sums))
            except BaseException:
                check.close()
                raise
    result.viewed += i
    result.pages += i
    result.nbytes += i * self.page_nbytes
    return i, check
