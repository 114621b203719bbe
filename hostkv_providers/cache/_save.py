"""The save half of :class:`~hostkv_providers.cache.HostKVCache`: admission, dedup and coalescing,
direct saves into a provider's chain reservation and staged saves through bounce buffers, anchors
attached to pages.  Functions of the cache (``self`` is the cache); ``HostKVCache`` binds them as
methods."""

from __future__ import annotations

import bisect
import collections
import contextlib
import itertools
import operator
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from hostkv_providers._blockhash import TREE_ALGORITHM
from hostkv_providers._chain import ReservedChain
from hostkv_providers._checks import check_anchor_name, readable_bytes
from hostkv_providers._errors import (
    CapacityError,
    ClosedError,
    HostKVError,
    InFlightError,
    InvalidArgumentError,
    UnknownKeyError,
)
from hostkv_providers._keys import Key, as_key
from hostkv_providers._region import HostRegion
from hostkv_providers._reservation import Lease
from hostkv_providers.cache._admission import (
    AdmissionRequest,
)
from hostkv_providers.cache._common import (
    AnchorBlobs,
    AnchorSource,
    _as_planes,
    _Staging,
)
from hostkv_providers.cache._gpusum import save_sums
from hostkv_providers.cache._handles import (
    CacheHandle,
    SaveResult,
    _SaveJob,
)
from hostkv_providers.device import CopyEngine

if TYPE_CHECKING:
    from hostkv_providers.cache._cache import HostKVCache


def save(
    self: HostKVCache,
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
    bids_l, arr = self._block_table(block_ids, len(ks), "keys", exact=True)
    planes = _as_planes(self.layout, from_)
    bids = self._check_blocks(planes, bids_l, arr)
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
            claims = self._claims
            mine = list(map(ks.__getitem__, job.claimed))  # (C speed)
            if all(map(operator.is_, map(claims.get, mine), itertools.repeat(job))):  # (C speed)
                list(map(claims.__delitem__, mine))
            else:
                for k in mine:
                    if claims.get(k) is job:
                        del claims[k]
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

    handle._on_finish(finish)
    refused = False
    with self._lock:
        present = self.provider.present(ks[:admitted]) if admitted else []  # (list[bool]: list.index below)
        claims = self._claims
        if not any(map(claims.__contains__, ks[:admitted])):
            # the common cases (a new chain, or a chain whose prefix is stored; no other save of
            # it in flight here) at C speed: this call holds the GIL on the engine's thread (H200:
            # decode steps beside saves that ran > 1.2x overlapped it 10-25x more often than
            # chance), and a Python loop per page was the part of it that grows with the chain
            keys_in: Iterable[Key] = ks[:admitted]
            todo: Iterable[int] = range(admitted)
            if any(present):
                new = list(map(operator.not_, present))
                keys_in, todo = itertools.compress(ks, new), itertools.compress(todo, new)
            claims.update(zip(keys_in, itertools.repeat(job)))
            job.claimed.extend(todo)
        else:
            for i in range(admitted):
                if present[i]:
                    continue
                owner = claims.get(ks[i])
                if owner is not None:
                    job.deps[i] = owner
                else:
                    claims[ks[i]] = job
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


def _anchor_blobs(self: HostKVCache, anchors: AnchorSource | None, n: int, checkpoints: Iterable[int],
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


def _blob_map(blobs: AnchorBlobs, i: int) -> dict[str, bytes]:
    if not isinstance(blobs, Mapping):
        raise InvalidArgumentError(f"anchors for page {i} must be a {{name: bytes}} mapping")
    # Copied now: the engine may overwrite its state buffers before the save thread runs.
    return {check_anchor_name(name): bytes(readable_bytes(b)) for name, b in blobs.items()}


def _run_save(self: HostKVCache, job: _SaveJob, planes: Any, bids: Sequence[int], parent: Key | None,
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


def _save_pages(self: HostKVCache, job: _SaveJob, result: SaveResult, planes: Any, bids: Sequence[int],
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
    anchored = sorted(blobs)  # (pages with anchors: a stored run ends at the first of them)

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
                # a stored run at once: one lease, no Python step per page (a chain saved again,
                # a fork's shared prefix: 6,400 per-page leases and GIL hand-overs took ~2 s of
                # the save thread for a stored 100k-token chain on the CPU machine)
                end = _stored_run_end(present, anchored, i)
                nl, got = _lease_run(prov, ks, i, end)
                if nl is None:
                    stop = f"page {i} was evicted before its children could be saved"
                else:
                    if held is not None:
                        held.release()
                    held = nl
                    result.dedup += got
                    i += got - 1
                    k = ks[i]
                    if i + 1 < end:
                        stop = f"page {i + 1} was evicted before its children could be saved"
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


def _stored_run_end(present: Sequence[bool], anchored: Sequence[int], i: int, limit: int | None = None) -> int:
    """Where the run of stored pages from ``i`` (stored itself) ends: at the first page not
    stored, after the first page with anchors to attach (``anchored``: those pages, sorted;
    only a run's last page may have them), at ``limit`` at the latest.  C-speed searches: no
    Python step per page."""
    stop = len(present) if limit is None else limit
    at = bisect.bisect_left(anchored, i)
    if at < len(anchored):
        stop = min(stop, anchored[at] + 1)
    with contextlib.suppress(ValueError):  # (every page to ``stop`` stored; searched up to it only)
        stop = present.index(False, i, stop)
    return stop


def _lease_run(prov: Any, ks: Sequence[Key], lo: int, hi: int) -> tuple[Lease | None, int]:
    """One lease on pages ``[lo, hi)`` of the chain and how many of them it holds from ``lo``
    on (a page evicted since ``present()`` ends the run there); ``(None, 0)`` when page ``lo``
    itself is gone."""
    nl = prov.lease(ks[lo:hi])
    got = int(nl.prefix_len)
    if not got:
        nl.release()
        return None, 0
    return nl, got


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


def _attach(self: HostKVCache, k: Key, i: int, blobs: Mapping[int, Mapping[str, bytes]],
            result: SaveResult) -> str | None:
    for name, blob in blobs.get(i, {}).items():
        try:
            self.provider.put_anchor(k, name, blob)
        except (UnknownKeyError, CapacityError) as exc:
            return f"anchor {name!r} of page {i}: {exc}"
        result.anchors += 1
    return None


def _save_direct(self: HostKVCache, job: _SaveJob, result: SaveResult, planes: Any, bids: Sequence[int],
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
    anchored = sorted(blobs)  # (pages with anchors: a stored run ends at the first of them)
    try:
        i = 0
        while i < s:  # the prefix: stored already, or by an earlier save of this cache
            # a stored run at once (one lease); a page another save is storing, one by one
            end = _stored_run_end(present, anchored, i, s) if present[i] else i + 1
            dep = job.deps.get(i)
            if dep is not None:
                dep.done.wait(self.wait_timeout)
            nl, got = _lease_run(prov, ks, i, end)
            if nl is None:
                stop = f"page {i} was not stored when its children were to be saved"
                break
            if held is not None:
                held.release()
            held = nl
            if present[i]:
                result.dedup += got
            else:
                result.coalesced += got
            i += got - 1
            if i + 1 < end:
                stop = f"page {i + 1} was not stored when its children were to be saved"
                break
            k = ks[i]
            stop = self._attach(k, i, blobs, result)
            if stop is not None:
                break
            prev = k
            i += 1
        if stop is None:
            stop = self._direct_chunks(job, result, planes, bids, s, prev, blobs, after)
    finally:
        if held is not None:
            held.release()
        job.handle._all_issued()
        job.handle._copied.set()
    result.stopped = stop


def _direct_chunks(self: HostKVCache, job: _SaveJob, result: SaveResult, planes: Any, bids: Sequence[int], s: int,
                   prev: Key | None, blobs: Mapping[int, Mapping[str, bytes]], after: Any) -> str | None:
    ks = job.keys
    n = len(ks)
    prov = self.provider
    P = self.page_nbytes
    tag = self.salt.tag
    inflight: collections.deque[tuple[int, ReservedChain, Any]] = collections.deque()
    pos = s
    # Checksums from the GPU (xxh3-256k-tree stores, pages in CUDA memory): each chunk is hashed
    # in HBM behind the save's `after` mark and its copy is ordered behind the hash, so the
    # seals below record them and hash nothing on the host.  `digests[lo]`: chunk at `lo`.
    sums = save_sums(prov, self.engine, planes, after)
    # chunks in flight at most (0: all at once); two at least, so a copy always overlaps the
    # host's sealing of the one before
    wb = self.save_window_bytes
    window = max(2, wb // (self.chunk_pages * P)) if wb else 0
    digests: dict[int, Any] = {}

    def seal_oldest() -> str | None:
        # Chain-level: a chunk-level run (pinned) is sealed with no Python object per page.
        lo, rc, h = inflight.popleft()
        if h is not None:
            h.wait()
        rc.mark_written()
        failure: HostKVError | None = None
        dg = digests.pop(lo, None)
        reserved = rc.positions()
        nres = len(reserved)
        if nres:
            try:
                if dg is not None:
                    rc.seal(checksums=dg.roots(), algorithm=TREE_ALGORITHM)
                else:
                    rc.seal()
            except HostKVError as exc:  # a prefix is sealed, the rest aborted
                failure = exc
        sealed = rc.sealed
        if sealed == nres:
            result.stored += sealed
            result.nbytes += sealed * P
            result.dedup += len(rc) - nres
            for i in sorted(b for b in blobs if lo <= b < lo + len(rc)):
                why = self._attach(ks[i], i, blobs, result)
                if why is not None:
                    return why
            return None
        # a failure part-way: count up to the first page that was not sealed, as the pages go
        new = set(reserved)
        done = 0
        for m in range(len(rc)):
            i = lo + m
            if m not in new:
                result.dedup += 1
            elif done < sealed:
                done += 1
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
            got = len(rc)
            if got:
                idx = [pos + m for m in rc.positions()]
                h = None
                if idx:
                    try:
                        chunk_bids = [bids[i] for i in idx]
                        order = after
                        if sums is not None:
                            digests[pos], order = sums.enqueue(chunk_bids)
                        # one HostPages for the chunk when the provider has it: no per-page regions
                        # (the package's engines take it; another CopyEngineLike gets region lists)
                        if rc.pages is not None and isinstance(self.engine, CopyEngine):
                            h = self.engine.save(planes, chunk_bids, rc.pages, after=order)
                        else:
                            h = self.engine.save(planes, chunk_bids,
                                                 [r.regions() for r in rc.reservations if r is not None], after=order)
                    except BaseException:
                        rc.abort()
                        raise
                    job.handle._add_transfer(h)
                inflight.append((pos, rc, h))
                prev = chunk_keys[got - 1]
                pos += got
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
            # Seal what the DMA has finished (root first) without waiting, so the link never
            # idles behind the host's sealing of earlier chunks; a full save window waits here
            # for its oldest chunk (the GIL released in the wait), which spreads the issue loop's
            # host work over the save instead of one burst at its start.
            while stop is None and inflight and (inflight[0][2] is None or inflight[0][2].done()
                                                 or 0 < window <= len(inflight)):
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
        for dg in digests.values():
            with contextlib.suppress(Exception):
                dg.close()
        if sums is not None:
            with contextlib.suppress(Exception):
                sums.close()
        for _lo, rc, h in inflight:
            if h is not None:
                with contextlib.suppress(Exception):
                    h.wait()
            rc.abort()
    return stop


def _store_run(self: HostKVCache, ks: Sequence[Key], run: Sequence[int], parent: Key | None, st: _Staging,
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


def _store_page(self: HostKVCache, key: Key, parent: Key | None, data: np.ndarray[Any, np.dtype[np.uint8]],
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


def _get_staging(self: HostKVCache) -> _Staging:
    with self._staging_lock:
        if self._staging_free:
            return self._staging_free.pop()
    return _Staging(self._alloc, self.page_nbytes, self.chunk_pages)


def _put_staging(self: HostKVCache, st: _Staging) -> None:
    with self._staging_lock:
        if len(self._staging_free) < 4 and not self._closed:
            self._staging_free.append(st)
            return
    st.close()
