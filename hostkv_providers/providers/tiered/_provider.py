"""``tiered://`` — a fast provider (pinned RAM) over a slow, persistent one (lmdb, mmap).

Saves land in the fast tier, where the copy engine can DMA into pinned memory, and a background
thread writes them back to the slow tier, in seal order (so parent before child), through a
bounded queue: when ``queue`` pages are waiting, ``seal`` blocks until the writer catches up.
Reads and restores are served from the fast tier when it holds the page; pages found only in the
slow tier are read from there and *promoted* into the fast tier.  A restart keeps the slow tier:
the tiered index is rebuilt from it on open.

Membership, LRU order, leases, retained marks, in-flight reservations and the budget are kept by
the tiered provider itself (one ``TreeIndex``), so the composite behaves exactly like a single provider —
evictions are decided synchronously when space is reserved and then applied to both tiers.  The
tiers are storage: the slow tier must hold at least the tiered budget (it then never evicts on its
own), the fast tier may be smaller (it evicts promoted copies by its own LRU; pages still waiting
for write-back are pinned in it).  When the fast tier cannot take a new page, it is written
straight through to the slow tier.

Retained entries (``SupportsRetain``): the marks are kept in the tiered index (so the composite
never evicts them) and in the slow tier, which persists them (a reopen marks them again); the
fast tier is a cache and may drop its copies of retained pages, which then stay readable from
the slow tier (and are promoted again on read).

One process owns a tiered store (``multiprocess = False``): other processes must not write to
its slow tier while it is open.

URL: ``tiered://?fast=<url-encoded URL>&slow=<url-encoded URL>[&budget=..][&queue=1024][&promote=true]``,
e.g. ``tiered://?fast=pinned%3A%2F%2F%3Fbudget%3D64GiB&slow=lmdb%3A%2F%2F%2Fnvme%2Fkv%3Fbudget%3D1TiB``.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import os
import queue
import threading
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, cast

import numpy as np

from hostkv_providers._capabilities import (
    SupportsBatch,
    SupportsBatchViews,
    SupportsIterate,
    SupportsRetain,
    SupportsViews,
)
from hostkv_providers._checks import (
    check_retain_share,
    scatter_into,
    writable_buffer,
)
from hostkv_providers._errors import (
    CapacityError,
    HostKVError,
    InFlightError,
    InvalidArgumentError,
    ReservationError,
    UnknownKeyError,
)
from hostkv_providers._keys import Key
from hostkv_providers._options import Option, OptionSet
from hostkv_providers._provider import Corrupt, Provider
from hostkv_providers._region import HostPages, HostRegion
from hostkv_providers._reports import EntryInfo, EvictReport
from hostkv_providers._reservation import Lease, Reservation
from hostkv_providers._span import ByteSpan
from hostkv_providers.providers._tree import TreeIndex

from ._chain import _Chains
from ._counters import _EXTRA_COUNTERS
from ._entries import _Ent, _info, _LeaseToken, _read_batch, _TieredReservation

__all__ = ["TieredProvider"]

#: Longest chain run ``put_many`` reserves at once: what the fast tier cannot take waits in
#: ordinary buffers until the run's seal, so this bounds that transient memory (HostKVCache's
#: chunks are 256 pages by default).
_PUT_RUN = 256


class TieredProvider(_Chains):
    """A fast provider over a slow one (see the module docstring).

    Parameters
    ----------
    fast:
        The landing tier (normally ``pinned``); it should offer ``view``/``regions``.
    slow:
        The persistent tier (``lmdb``, ``mmap``); it must support ``iter_entries`` (the index
        is rebuilt from it on open) and hold at least ``budget_bytes``.
    budget_bytes:
        The tiered budget; default: the slow tier's budget.
    queue_pages:
        Bound of the write-back queue, in pages; ``seal`` blocks while it is full.
    promote:
        Copy pages read from the slow tier into the fast tier.
    own_tiers:
        Close the tiers when this provider closes (``from_url`` builds them, so it sets this).
    """

    name = "tiered"
    #: The URL options (``docs/providers/tiered.md``'s table is checked against this).
    OPTIONS = OptionSet(
        "tiered",
        Option("fast", "text", None, "required"),
        Option("slow", "text", None, "required"),
        Option("budget", "size", None, "the slow tier's budget"),
        Option("queue", "int", 1024, "1024", attr="_queue_pages"),
        Option("promote", "bool", True, "true"),
        Option("retain_share", "number", 0.5, "0.5"),
    )
    _reservation_type = _TieredReservation
    persistent = True  # the slow tier is

    def __init__(self, fast: Provider, slow: Provider, *, budget_bytes: int | None = None, queue_pages: int = 1024,
                 promote: bool = True, own_tiers: bool = True, retain_share: float = 0.5) -> None:
        super().__init__()
        self._retain_share = check_retain_share(retain_share)
        if not isinstance(fast, Provider) or not isinstance(slow, Provider):
            raise InvalidArgumentError("fast and slow must be Provider instances")
        if fast is slow:
            raise InvalidArgumentError("the fast and slow tiers must be different providers")
        if not isinstance(slow, SupportsIterate):
            raise InvalidArgumentError(f"the slow tier ({slow.name}) must support iter_entries()",
                                       hint="use lmdb:// or mmap:// as the slow tier")
        budget = slow.budget_bytes if budget_bytes is None else budget_bytes
        if type(budget) is not int or budget <= 0:
            raise InvalidArgumentError(f"budget must be a positive int, got {budget!r}")
        if budget > slow.budget_bytes:
            raise InvalidArgumentError(
                f"the tiered budget ({budget}) exceeds the slow tier's ({slow.budget_bytes})",
                hint="the slow tier must be able to hold every entry; raise its budget")
        if type(queue_pages) is not int or queue_pages < 1:
            raise InvalidArgumentError(f"queue must be a positive int, got {queue_pages!r}")
        self.fast = fast
        self.slow = slow
        # Seals hand given checksums on to the fast tier, which records them when they are in its
        # algorithm: so the store's algorithm is the fast tier's, and a cache hashes the pages it
        # saves here on the GPU as it does for the fast tier alone.  (With the base's "xxh3-64" a
        # tiered save over a pinned tier hashed every byte on the host: 13.4 GB sealed in 671-826
        # ms on the H200, 0.29-0.36x the bulk copy, against 261 ms for pinned:// alone.)
        self.checksum_algorithm = fast.checksum_algorithm
        # the tiers' bound on the salt tag: a tag the slow tier cannot store would fail the
        # write-back after put() returned, and the page would vanish (issue 16 item 14)
        bounds = [b for b in (fast._tag_max, slow._tag_max) if b is not None]
        self._tag_max = min(bounds) if bounds else None
        self._budget = budget
        self._promote = bool(promote)
        self._own = own_tiers
        self._lock = threading.RLock()
        self._index = TreeIndex(budget)
        # write-backs queued or running, by the entry's gen (rows are recycled, gens are not)
        self._pend = {}
        self._pend_runs = {}
        self._run_starts = []
        self._unsynced = {}  # gen -> anchors queued for the slow tier
        self._queue = queue.Queue()
        self._room = threading.Condition(threading.Lock())
        self._queued_pages = 0
        self._wb_rounds = 0
        self._queue_pages = queue_pages
        self._writer_error = None
        # Keys the tiered index has dropped that the slow tier may still hold: an eviction the
        # slow tier skipped (it never evicts the parent of a page in flight there, i.e. one the
        # writer is copying out right now), or a write-back that landed after its entry was
        # evicted.  The writer evicts them again after each write-back, and close() once the
        # writer has stopped, so a reopen (which rebuilds the index from the slow tier) never
        # brings an evicted entry back.  Guarded by ``_lock``.
        self._doomed = set()
        # Tail leases: the page a chain operation touched last stays held in that tier, so the
        # next page of the chain (whose parent it is) costs O(1) in a TreeIndex-based tier —
        # holding an unheld parent there walks every unheld ancestor.  Cheap for pinned/mmap,
        # skipped for tiers with their own index (lmdb leases are transactions).
        self._tails = {}
        self._slow_tree = isinstance(getattr(slow, "_index", None), TreeIndex)
        self._slow_retain = isinstance(slow, SupportsRetain)
        self._fast_views = isinstance(fast, SupportsViews)  # a Protocol check is slow: once
        # A fast tier that verifies reads: the writer stores its verified copies (a view is not
        # checked), so bytes damaged after their seal never reach the slow tier (_write_back)
        self._fast_verifies = bool(getattr(fast, "_verify_reads", False))
        self._fast_batch_views = isinstance(fast, SupportsBatchViews)
        self._fast_page_views = callable(getattr(fast, "view_pages", None))
        self._fast_batch = isinstance(fast, SupportsBatch)
        # the tiering's own counters (the contract's are the front's: _tally)
        self._counters = dict.fromkeys(_EXTRA_COUNTERS, 0)
        # store-wide counters: the figures already added to the slow tier's counters file
        self._published = {}
        self._publish_lock = threading.Lock()
        self._publish_at = 0.0
        self._wb_since = 0.0  # time.time() of the seal of the page being written back (0: none)
        # Sealed runs the full fast tier could not take wait for their write-back in ordinary
        # memory (_HeapRun), at most the fast tier's budget of them: an operator sized that much
        # host memory for pages not yet in the slow tier.
        self._heap_bytes = 0
        self._heap_limit = fast.budget_bytes
        self._heap_waiting = collections.deque()  # heap seals waiting for room, first come first served
        self._rebuild()
        self._writer = threading.Thread(target=self._write_back_loop, name="hostkv-tiered-writeback", daemon=True)
        self._writer.start()

    # -- construction ------------------------------------------------------------------
    @classmethod
    def from_url(cls, location: str, options: Mapping[str, str]) -> TieredProvider:
        from hostkv_providers._registry import open_provider

        o = cls.OPTIONS.parse(options)
        fast_url, slow_url, budget, queue_pages, promote = o["fast"], o["slow"], o["budget"], o["queue"], o["promote"]
        share = check_retain_share(o["retain_share"])
        if location not in ("", "/"):
            raise InvalidArgumentError(f"tiered:// takes no path, got {location!r}",
                                       hint="tiered://?fast=<url-encoded URL>&slow=<url-encoded URL>")
        if not fast_url or not slow_url:
            raise InvalidArgumentError("tiered:// needs both fast= and slow= provider URLs (URL-encoded)",
                                       hint="tiered://?fast=pinned%3A%2F%2F%3Fbudget%3D8GiB&slow=lmdb%3A%2F%2F%2Fvar%2Fkv")
        for url in (fast_url, slow_url):
            if url.split("://", 1)[0] == "tiered":
                raise InvalidArgumentError("a tier of tiered:// cannot itself be tiered://")
        fast = open_provider(fast_url)
        try:
            slow = open_provider(slow_url)
        except BaseException:
            fast.close()
            raise
        try:
            return cls(fast, slow, budget_bytes=budget,
                       queue_pages=queue_pages, promote=promote, own_tiers=True, retain_share=share)
        except BaseException:
            fast.close()
            slow.close()
            raise

    def _rebuild(self) -> None:
        """Index every entry of the slow tier (parents first, least recently used first)."""
        slow: SupportsIterate = self.slow  # type: ignore[assignment]  # checked by __init__
        infos = {i.key: i for i in slow.iter_entries()}
        order = sorted(infos.values(), key=lambda i: (i.last_used, i.created))
        done: set[Key] = set()
        dropped: list[Key] = []
        idx = self._index
        # The row added last stays held: a chain's next page then costs O(1) in the index.
        tail: list[int] = []
        tail_gen: list[int] = []

        def add(info: EntryInfo) -> None:
            chain = [info]
            while chain[-1].parent is not None and chain[-1].parent not in done:
                parent = infos.get(chain[-1].parent)
                if parent is None:  # an orphan cannot be: the slow tier is prefix-closed
                    return
                chain.append(parent)
            for i in reversed(chain):
                if i.key in done:
                    continue
                cost = i.nbytes + sum(i.anchors.values())
                try:
                    _, evicted, _ = idx.begin(i.key, i.parent, cost)
                except (CapacityError, UnknownKeyError):
                    dropped.append(i.key)
                    return
                dropped.extend(idx.key_of(r) for r in evicted)
                self._recycle(evicted)
                row = idx.commit(i.key, nbytes=i.nbytes, csum=i.checksum, tag=i.salt_tag, created=i.created)
                if i.anchors:
                    idx.anchors[row] = dict(i.anchors)
                idx.used[row] = i.last_used
                done.add(i.key)
                idx.hold_rows([row])
                idx.release_rows(tail, tail_gen)
                tail[:], tail_gen[:] = [row], [int(idx.gen[row])]

        for info in order:
            if info.key not in done:
                add(info)
        idx.release_rows(tail, tail_gen)
        marked = [r for r in idx.rows_of([i.key for i in infos.values() if i.retained]) if r >= 0]
        if marked:  # the slow tier keeps the marks: they hold again (its share was checked when set)
            idx.retain_rows(marked, 1 << 62)
        if dropped:  # the store held more than this budget: trim it now
            self.slow.evict(dropped)

    @property
    def budget_bytes(self) -> int:
        return self._budget

    @property
    def views_pinned(self) -> bool:
        """Views come from the fast tier: page-locked when its are (``SupportsPinnedViews``)."""
        return bool(getattr(self.fast, "views_pinned", False))

    # -- lookups -----------------------------------------------------------------------
    # (the public verbs are the front's, in Provider; these are the drivers it calls)
    def _present(self, keys: Sequence[bytes]) -> list[bool]:
        ks = self._keys(keys)
        self._check_usable()  # before the lock: a forked child must not wait on a copied lock
        with self._lock:
            self._check_usable()
            contains = self._index.contains_fn
            return [contains(k) for k in ks]

    def _longest_prefix(self, keys: Sequence[bytes]) -> int:
        ks = self._keys(keys)
        self._check_usable()  # before the lock: a forked child must not wait on a copied lock
        with self._lock:
            self._check_usable()
            contains = self._index.contains_fn
            n = 0
            for k in ks:
                if not contains(k):
                    break
                n += 1
            return n

    def _entry(self, k: Key) -> EntryInfo | None:
        self._check_usable()  # before the lock: a forked child must not wait on a copied lock
        with self._lock:
            self._check_usable()
            row = self._index.row_of(k)
            return None if row < 0 else _info(self._index, row)

    def iter_entries(self) -> Iterator[EntryInfo]:
        self._check_usable()  # before the lock: a forked child must not wait on a copied lock
        with self._lock:
            self._check_usable()
            idx = self._index
            infos = [_info(idx, int(r)) for r in idx.live_rows()]
        return iter(infos)

    # -- retained entries (SupportsRetain) ---------------------------------------------
    def retain(self, keys: Sequence[bytes]) -> int:
        """Mark entries retained (see ``SupportsRetain``) in the tiered index and, after the
        queued write-backs have landed, in the slow tier, which keeps the marks across restarts."""
        ks = self._keys(keys)
        self._check_usable()
        if not self._slow_retain:
            raise InvalidArgumentError(f"the slow tier ({self.slow.name}) cannot keep retain marks",
                                       hint="use lmdb:// or mmap:// as the slow tier")
        self.flush()  # a pending page is not in the slow tier yet: land it first
        with self._lock:
            self._check_usable()
            idx = self._index
            rows = idx.rows_of(ks)
            for k, r in zip(ks, rows, strict=True):
                if r < 0:
                    raise UnknownKeyError(f"entry {k.hex()[:16]} is not stored; nothing was retained",
                                          hint="retain sealed entries only (save the prefix first)")
            limit = int(self._retain_share * self._budget)
            if idx.retained_cost + idx.retain_cost([r for r in rows if not idx.retained[r]]) > limit:
                return idx.retain_rows(rows, limit)  # raises CapacityError, nothing marked
            self.slow.retain(ks)  # type: ignore[attr-defined]
            return idx.retain_rows(rows, limit)

    def unretain(self, keys: Sequence[bytes]) -> int:
        """Clear retain marks in the tiered index and the slow tier."""
        ks = self._keys(keys)
        self._check_usable()
        with self._lock:
            self._check_usable()
            if self._slow_retain:
                self.slow.unretain(ks)  # type: ignore[attr-defined]
            return self._index.unretain_rows(self._index.rows_of(ks))

    def _in_flight(self, k: Key) -> bool:
        self._check_usable()  # before the lock: a forked child must not wait on a copied lock
        with self._lock:
            self._check_usable()
            return k in self._index.flights

    # -- writes ------------------------------------------------------------------------
    def _reserve(self, k: Key, p: Key | None, nbytes: int, salt_tag: str) -> Reservation | None:
        self._check_usable()  # before the lock: a forked child must not wait on a copied lock
        with self._lock:
            self._check_usable()
            if nbytes > self._budget:
                raise CapacityError(f"{nbytes} bytes exceed the whole budget of {self._budget}")
            ok, evicted, _ = self._index.begin(k, p, nbytes)
            if not ok:
                return None
            self._drop_from_tiers(evicted)
        try:
            inner = self._reserve_inner(k, p, nbytes, salt_tag)
        except BaseException:
            with self._lock:
                self._index.cancel(k)
            raise
        return _TieredReservation(self, k, p, nbytes, salt_tag, inner)

    def _reserve_inner(self, k: Key, p: Key | None, nbytes: int, salt_tag: str) -> Reservation:
        """A reservation in the fast tier, else (fast tier full) straight in the slow tier."""
        for attempt in range(2):
            with contextlib.suppress(CapacityError, InFlightError, UnknownKeyError):
                # The fast tier is a byte cache under the tiered index (which keeps the real tree):
                # a page whose parent has left it lands there as a root.  Promoting the missing
                # ancestors instead cost a read of the chain above it per page (quadratic in the
                # depth once the working set outgrows the fast tier: 2,000 x 4 KiB pages over a
                # 2 MiB fast tier took 45 s against 1.5 s).
                fast_parent = p if p is not None and self.fast.present([p])[0] else None
                # A copy left in the fast tier by an entry evicted earlier must not dedup this one.
                if self.fast.present([k])[0]:
                    self.fast.evict([k])
                res = self.fast.reserve(k, fast_parent, nbytes, salt_tag=salt_tag)
                if res is not None:
                    return res
            if attempt == 0:
                self.flush()  # pages waiting for write-back pin fast memory: let them go
        # Write through: the parent must be in the slow tier, which flush() guarantees.
        self.flush()
        if self.slow.present([k])[0]:  # an orphan of a cancelled write-back: replace it
            self.slow.evict([k])
        res = self.slow.reserve(k, p, nbytes, salt_tag=salt_tag)
        if res is None:
            raise ReservationError(f"the slow tier already holds {k.hex()[:16]}, which the tiered index does not")
        with self._lock:
            self._counters["write_through"] += 1
        return res

    def _write(self, res: _TieredReservation, span: ByteSpan, view: memoryview) -> None:
        # (through the inner reservation's own verbs, here and in _seal/_abort: a fast tier
        # without a reserve_many of its own — mmap, lmdb — hands out the base class's deferred
        # reservations, which its write/seal/abort refuse as not theirs; they write, seal and
        # abort themselves)
        res.inner.write(span.offset, view)

    def _seal(self, res: _TieredReservation) -> None:
        inner = res.inner
        through = inner.provider is self.slow
        if through:
            inner.seal()
            self._commit_sealed(res, True)
            return
        self._wait_for_room()
        held: list[Lease] = []
        seal_held = getattr(self.fast, "_seal_held", None)
        if seal_held is None:
            inner.seal()
        else:
            seal_held([inner], held)  # (sealed and leased in one lock round of the fast tier)
        self._commit_sealed(res, False, held[0] if held else None)

    def _abort(self, reservation: _TieredReservation) -> bool:
        inner = reservation.inner
        with self._lock:
            if reservation.state != "open":
                return False
            self._index.cancel(reservation.key)
            reservation._finish("aborted")
            if inner.state == "sealed":
                # sealed in the fast tier, never published (a seal_many that failed at an earlier
                # page): that copy is nobody's; evicted under the lock, so a new save of the key
                # cannot slip in between
                with contextlib.suppress(HostKVError):
                    inner.provider.evict([reservation.key])
                return True
        with contextlib.suppress(HostKVError):
            inner.abort()
        return True

    # -- reads -------------------------------------------------------------------------
    def _read(self, k: Key, out: object, span: ByteSpan | None) -> int | Corrupt | None:
        self._check_usable()  # before the lock: a forked child must not wait on a copied lock
        idx = self._index
        with self._lock:
            self._check_usable()
            row = idx.row_of(k)
            if row < 0:
                return None
            node = _Ent(idx, row)
            span = ByteSpan.whole(node.nbytes) if span is None else span.validate(node.nbytes)
            dst = writable_buffer(out, span.nbytes)
            idx.hold_rows([row])
            in_slow = not self._pending(node.gen)
        which = "fast_hits"
        heap: tuple[memoryview, Any] | None = None
        try:
            got = self.fast.read(k, dst, span)
            if not got and not in_slow:
                # It waited for its write-back when looked up; the write-back may have landed
                # since and its fast copy been evicted: then the slow tier has it (not corrupt).
                # Or its only copy is a heap run's page.
                with self._lock:
                    in_slow = not self._pending(node.gen)
                    heap = None if in_slow else self._heap_page(node.gen)
            if got:
                which = "fast_hits"
            elif heap is not None:
                got = self._from_heap([heap], [dst], [span])[0]
            elif in_slow:
                got = self.slow.read(k, dst, span)
                which = "slow_hits"
                if got and self._slow_tree:
                    self._advance_tail("read", self.slow, k)
                if got and self._promote and span.nbytes == node.nbytes:
                    self._promote_one(node, dst)
            if not got:
                # the only copies failed their checksums (or vanished): the front drops the
                # entry (_drop_damaged) and reports a miss, never wrong bytes
                return Corrupt((row, node.gen))
        finally:
            with self._lock:
                idx.release_rows([row], [node.gen])
        with self._lock:
            self._counters[which] += 1
        return span.nbytes

    def _from_heap(self, pages: Sequence[tuple[memoryview, Any]], dsts: Sequence[memoryview],
                   spans: Sequence[ByteSpan]) -> list[bool]:
        """Copy heap runs' pages (``_heap_page``: views, seal checksums or ``None``) into ``dsts``
        (no lock held); a page whose checksum does not match is not copied (``False``): its only
        copy is bad, and the caller drops it as it does a fast-tier copy that fails."""
        out = []
        for (view, sums), dst, span in zip(pages, dsts, spans, strict=True):
            if sums is not None and self.fast._first_bad([view], sums) != 1:  # type: ignore[attr-defined]
                out.append(False)
                continue
            dst[: span.nbytes] = view[span.offset : span.end]
            out.append(True)
        return out

    def _drop_damaged(self, k: Key, token: object) -> bool:
        with self._lock:
            if self._closed or not isinstance(token, tuple) or not self._index.is_live(*token):
                return False  # another reader dropped it first (or the key was sealed again)
            self._drop_from_tiers(self._index.drop(token[0]))
            return True

    # -- batches -----------------------------------------------------------------------
    def put_many(self, items: Sequence[tuple[bytes, bytes | None, object]], *,
                 salt_tag: str = "") -> list[bool | HostKVError]:
        """Store many pages, root first (:class:`~hostkv_providers.SupportsBatch`); per item
        ``True``, ``False`` (dedup) or its error, and every item whose parent failed in this call
        gets ``UnknownKeyError``.  Each chain run of the items (each page's parent the item
        before it, one size) is stored as a chain reservation: ``reserve_many`` (fast-tier
        memory where it has room), one copy per page, ``seal_many`` (the overflow written
        through with one ``put_many`` of the slow tier) — not a reserve/write/seal per page,
        which waited for the whole write-back queue per page once the fast tier was full."""
        checked = self._put_many_args(items, salt_tag, tag_max=self._tag_max)
        out: list[bool | HostKVError] = []
        failed: set[Key] = set()
        i = 0
        while i < len(checked):
            k, p, view = checked[i]
            orphan = self._failed_parent(p, failed, k)
            if orphan is not None:
                out.append(orphan)
                i += 1
                continue
            j, seen = i + 1, {k}
            while (j < len(checked) and j - i < _PUT_RUN and checked[j][1] == checked[j - 1][0]
                   and checked[j][2].nbytes == view.nbytes and checked[j][0] not in seen):
                seen.add(checked[j][0])
                j += 1
            out.extend(self._put_run(checked[i:j], salt_tag, failed))
            i = j
        return out

    def prefetch(self, keys: Sequence[bytes]) -> None:
        """Forward the hint to the slow tier for the keys only it holds (after a restart: all)."""
        ks = self._keys(keys)
        self._check_usable()
        with self._lock:
            self._check_usable()
            idx = self._index
            slow = [k for k, r in zip(ks, idx.rows_of(ks), strict=True)
                    if r >= 0 and not self._pending(int(idx.gen[r]))]
        if slow:
            only_slow = [k for k, f in zip(slow, self.fast.present(slow), strict=True) if not f]
            if only_slow:
                self.slow.prefetch(only_slow)

    def read_many(self, keys: Sequence[bytes], outs: Sequence[object]) -> list[bool]:
        """Whole entries into ``outs[i]`` (:class:`~hostkv_providers.SupportsBatch`): one lock
        round for the lookups, one batch read from the fast tier, one from the slow tier for
        what only it holds (a restart's restore), and those pages promoted with one batch put
        into the fast tier, root first.  Copies that fail their checksums in every tier they
        were read from are dropped with their subtrees (a miss, never wrong bytes)."""
        ks, outs = self._read_many_args(keys, outs)
        self._check_usable()  # before the lock: a forked child must not wait on a copied lock
        n = len(ks)
        # (the rows' facts in arrays, not a record per page: a restart's restore reads thousands)
        with self._lock:
            self._check_usable()
            idx = self._index
            rows = np.asarray(idx.rows_of(ks), dtype=np.int64)
            found = rows >= 0
            live = rows[found]
            gens = np.full(n, -1, dtype=np.int64)
            gens[found] = idx.gen[live]
            sizes = np.zeros(n, dtype=np.int64)
            sizes[found] = idx.nbytes[live]
            idx.hold_rows(cast(Sequence[int], live))
            in_slow = found.tolist()
            if self._pend or self._pend_runs:
                for i in np.flatnonzero(found).tolist():
                    in_slow[i] = not self._pending(int(gens[i]))
        rows_l, gens_l, sizes_l = rows.tolist(), gens.tolist(), sizes.tolist()
        got = [False] * n
        which: dict[int, str] = {}
        dsts: dict[int, memoryview] = {}
        todo: list[int] = []
        short: InvalidArgumentError | None = None
        done = False  # (the reads ran to the end: only then is a page not got a failed copy)
        try:
            for i in np.flatnonzero(found).tolist():
                try:
                    dsts[i] = writable_buffer(outs[i], sizes_l[i])
                except InvalidArgumentError as exc:
                    short = short or exc
            todo = sorted(dsts)
            for i, ok in zip(todo, _read_batch(self.fast, [ks[i] for i in todo], [dsts[i] for i in todo]),
                             strict=True):
                if ok:
                    got[i], which[i] = True, "fast_hits"
            if any(not got[i] and not in_slow[i] for i in todo):
                heaps: dict[int, tuple[memoryview, Any]] = {}
                with self._lock:  # (as in _read: a write-back may have landed since the lookup)
                    for i in todo:
                        if not got[i] and not in_slow[i]:
                            in_slow[i] = not self._pending(gens_l[i])
                            page = None if in_slow[i] else self._heap_page(gens_l[i])
                            if page is not None:
                                heaps[i] = page
                if heaps:  # (pages whose only copy is a heap run's: copied out without the lock)
                    hs = sorted(heaps)
                    for i, ok in zip(hs, self._from_heap([heaps[i] for i in hs], [dsts[i] for i in hs],
                                                         [ByteSpan.whole(sizes_l[i]) for i in hs]), strict=True):
                        if ok:
                            got[i], which[i] = True, "fast_hits"
            slow = [i for i in todo if not got[i] and in_slow[i]]
            if slow:
                for i, ok in zip(slow, _read_batch(self.slow, [ks[i] for i in slow], [dsts[i] for i in slow]),
                                 strict=True):
                    if ok:
                        got[i], which[i] = True, "slow_hits"
                from_slow = [i for i in slow if got[i]]
                if from_slow and self._slow_tree:
                    self._advance_tail("read", self.slow, ks[from_slow[-1]])
                if from_slow and self._promote:
                    self._promote_many([ks[i] for i in from_slow], [rows_l[i] for i in from_slow],
                                       [gens_l[i] for i in from_slow], [dsts[i] for i in from_slow])
            done = True
        finally:
            with self._lock:
                idx.release_rows(cast(Sequence[int], live), cast(Sequence[int], gens[found]))
                hits = hit_bytes = 0
                for i in todo:
                    if got[i]:
                        hits += 1
                        hit_bytes += sizes_l[i]
                        self._counters[which[i]] += 1
                    elif done and idx.is_live(rows_l[i], gens_l[i]):
                        # the only copies failed their checksums (or vanished): a miss, never wrong
                        # bytes.  (Not when a tier's read raised — a closed tier, outputs it refused:
                        # those pages were not read at all, and dropping them lost good entries.)
                        self._tally("checksum_failures")
                        self._drop_from_tiers(idx.drop(rows_l[i]))
                self._tally_hit(hit_bytes, hits)
                self._tally("misses", sum(1 for g in got if not g))
        if short is not None:
            raise short
        return got

    def _promote_many(self, keys: Sequence[Key], rows: Sequence[int], gens: Sequence[int],
                      datas: Sequence[memoryview]) -> None:
        """Best-effort copies of slow-tier pages into the fast tier, root first; a page whose
        parent the fast tier lacks (and that is not promoted before it here) is left out.  The
        parents and salt tags come from the index's columns (a page's parent is the key before
        it when that is its parent row: a chain, as a restore reads it)."""
        with self._lock:
            idx = self._index
            alive = [idx.is_live(r, g) for r, g in zip(rows, gens, strict=True)]
            prow = idx.parent[list(rows)].tolist()
            parents: list[Key | None] = []
            for j, pr in enumerate(prow):
                parents.append(None if pr < 0 else keys[j - 1] if j and rows[j - 1] == pr else idx.key_of(pr))
            tag_ids = idx.m_tag_id
            tags = [idx.tags[tag_ids[r]] for r in rows]
        need = [p for p, ok in zip(parents, alive, strict=True) if ok and p is not None]
        have = set(p for p, ok in zip(need, self.fast.present(need), strict=True) if ok)
        items: list[tuple[Key, Key | None, memoryview]] = []
        item_tags: list[str] = []
        for k, p, d, tag, ok in zip(keys, parents, datas, tags, alive, strict=True):
            if ok and (p is None or p in have):
                items.append((k, p, d))
                item_tags.append(tag)
                have.add(k)
        if not items:
            return
        stored: list[Key] = []
        try:
            if self._fast_batch and len(set(item_tags)) == 1:
                for (k, _p, _d), r in zip(items, self.fast.put_many(items, salt_tag=item_tags[0]),  # type: ignore[attr-defined]
                                          strict=True):
                    if r is True:
                        stored.append(k)
            else:
                for (k, p, d), tag in zip(items, item_tags, strict=True):
                    with contextlib.suppress(CapacityError, InFlightError, UnknownKeyError):
                        if self.fast.put(k, p, d, salt_tag=tag):
                            stored.append(k)
        except (CapacityError, InFlightError, UnknownKeyError):
            pass  # best effort: the fast tier is full of pinned pages, or racing a writer
        if stored:
            self._advance_tail("promote", self.fast, stored[-1])
            with self._lock:
                self._counters["promotions"] += len(stored)

    def _promote_one(self, node: _Ent, data: memoryview) -> None:
        if node.parent is not None and not self.fast.present([node.parent])[0]:
            return  # the fast tier is prefix-closed too: promote chains root first (restores do)
        try:
            if self.fast.put(node.key, node.parent, data, salt_tag=node.tag):
                # Hold the promoted page in the fast tier until the next promotion: a restore
                # promotes a chain root first, and each page's parent being held keeps the fast
                # tier's reservation O(1) instead of a walk over the whole chain.
                self._advance_tail("promote", self.fast, node.key)
                with self._lock:
                    self._counters["promotions"] += 1
        except (CapacityError, InFlightError, UnknownKeyError):
            pass  # best effort: the fast tier is full of pinned pages, or racing a writer

    def view(self, lease: Lease, key: bytes) -> Sequence[HostRegion] | None:
        """Zero-copy regions of a leased entry held by the fast tier (``None`` if only the slow
        tier has it: read it instead, which promotes it)."""
        return self.views(lease, [key])[0]

    def views(self, lease: Lease, keys: Sequence[bytes]) -> list[Sequence[HostRegion] | None]:
        """:meth:`view` of many keys; one call into the fast tier when it batches views too."""
        ks = self._keys(keys)
        token = self._view_token(lease, "view")
        fast = token.fast
        if fast is None or not self._fast_views:
            return [None] * len(ks)
        held = token.keys
        mine = [k for k in ks if k in held]
        if self._fast_batch_views:
            got = iter(self.fast.views(fast, mine))  # type: ignore[attr-defined]
        else:
            got = iter([self._view_fast(fast, k) for k in mine])
        return [next(got) if k in held else None for k in ks]

    def view_pages(self, lease: Lease, keys: Sequence[bytes]) -> HostPages | None:
        """:meth:`views` as one :class:`HostPages` (an address per page, no object per page) from
        the fast tier, or ``None`` unless the fast tier holds every key under this lease as it
        gives them (``PinnedProvider.view_pages``: whole pages of one size, one piece each).  A
        restore then copies page by page, or reads the slow tier's pages (after a restart)."""
        token = self._view_token(lease, "view_pages")
        if token.fast is None or not self._fast_page_views:
            return None
        pages: HostPages | None = self.fast.view_pages(token.fast, keys)  # type: ignore[attr-defined]
        if pages is not None:
            # (the tiered lease too: dropped, it would release the fast lease under the pages)
            pages.keepalive = (lease, pages.keepalive)
        return pages

    def _view_token(self, lease: Lease, what: str) -> _LeaseToken:
        if (not isinstance(lease, Lease) or lease.released or lease.provider is not self
                or not isinstance(lease.token, _LeaseToken)):
            raise InvalidArgumentError(f"{what}() needs an unreleased lease of this provider")
        self._check_usable()
        return lease.token

    # -- eviction ----------------------------------------------------------------------
    def _evict(self, ks: list[Key] | None, nbytes: int) -> EvictReport:
        self._check_usable()  # before the lock: a forked child must not wait on a copied lock
        with self._lock:
            self._check_usable()
            removed, freed, skipped = self._index.evict_for(ks, nbytes)
            self._drop_from_tiers(removed)
            return EvictReport(len(removed), freed, skipped)

    # -- anchors -----------------------------------------------------------------------
    def _put_anchor(self, k: Key, name: str, blob: bytes) -> None:
        self._check_usable()  # before the lock: a forked child must not wait on a copied lock
        with self._lock:
            self._check_usable()
            idx = self._index
            row = idx.row_of(k)
            if row < 0:
                raise UnknownKeyError(f"entry {k.hex()[:16]} is not stored", hint="seal the page before its anchors")
            gen = int(idx.gen[row])
            old = idx.anchors.get(row, {}).get(name, 0)
            self._drop_from_tiers(idx.add_cost(row, len(blob) - old, int(self._retain_share * self._budget)))
            if self._pending(gen) or gen in self._unsynced:
                # Queued behind the page's own write-back (and any earlier anchor of it), so the
                # slow tier ends with the latest blob; reads see it here until then.
                self._unsynced.setdefault(gen, {})[name] = blob
                self._queue.put(("anchor", row, gen, name, blob))
            else:
                self.slow.put_anchor(k, name, blob)
            idx.anchors.setdefault(row, {})[name] = len(blob)

    def _get_anchor(self, k: Key, name: str) -> bytes | None:
        self._check_usable()  # before the lock: a forked child must not wait on a copied lock
        with self._lock:
            self._check_usable()
            idx = self._index
            row = idx.row_of(k)
            if row < 0 or name not in idx.anchors.get(row, {}):
                return None
            blob = self._unsynced.get(int(idx.gen[row]), {}).get(name)
            return blob if blob is not None else self.slow.get_anchor(k, name)

    def _read_anchor(self, k: Key, name: str, bufs: list[memoryview]) -> int | None:
        self._check_usable()  # before the lock: a forked child must not wait on a copied lock
        with self._lock:
            self._check_usable()
            idx = self._index
            row = idx.row_of(k)
            if row < 0 or name not in idx.anchors.get(row, {}):
                return None
            blob = self._unsynced.get(int(idx.gen[row]), {}).get(name)
            if blob is None:  # the slow tier copies it once, from its medium into bufs
                return self.slow.read_anchor(k, name, bufs)
            scatter_into(bufs, memoryview(blob).cast("B"))
            return len(blob)

    def _list_anchors(self, k: Key) -> dict[str, int]:
        self._check_usable()  # before the lock: a forked child must not wait on a copied lock
        with self._lock:
            self._check_usable()
            row = self._index.row_of(k)
            return {} if row < 0 else dict(self._index.anchors.get(row, {}))

    def _deepest_anchor(self, ks: list[Key], name: str) -> int:
        self._check_usable()  # before the lock: a forked child must not wait on a copied lock
        with self._lock:
            self._check_usable()
            idx = self._index
            best = 0
            for i, row in enumerate(idx.rows_of(ks)):
                if row < 0:
                    break
                if name in idx.anchors.get(row, {}):
                    best = i + 1
            return best

    # -- leases ------------------------------------------------------------------------
    def _lease(self, ks: list[Key]) -> Lease:
        self._check_usable()  # before the lock: a forked child must not wait on a copied lock
        with self._lock:
            self._check_usable()
            idx = self._index
            rows = idx.rows_of(ks)
            present = [r >= 0 for r in rows]
            # (rows and gens as arrays: a restore's lease lives as long as the restore, and 6,400
            # int objects each would outlive young collections and feed the full ones)
            live = np.asarray(rows, dtype=np.int64)
            live = live[live >= 0]
            idx.hold_rows(cast(Sequence[int], live))
            mine = ks if all(present) else list(itertools.compress(ks, present))
            try:
                fast = self.fast.lease(mine)
            except HostKVError:
                fast = None
            token = _LeaseToken(live, idx.gen[live].copy(), frozenset(mine), fast)
            return Lease(self, ks, present, token=token)

    def _release_lease(self, lease: Lease) -> None:
        token = lease.token
        if not isinstance(token, _LeaseToken) or os.getpid() != self._pid:
            return
        with self._lock:
            if token.fast is not None:
                with contextlib.suppress(HostKVError):
                    token.fast.release()
            if self._closed:
                return
            self._index.release_rows(cast(Sequence[int], token.rows), cast(Sequence[int], token.gens))

    # -- the rest ----------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        # (fast= and slow= are described by the tiers themselves)
        return {**super().describe(), "fast": self.fast.describe(), "slow": self.slow.describe()}

    def close(self) -> None:
        """Finish the queued write-backs (so a restart finds them), then close the tiers."""
        # a forked child: the locks, the writer and the tiers belong to the parent
        self._check_not_forked()
        with self._lock:
            if self._closed:
                return
        self._flush(None)
        with self._lock:
            self._closed = True
            tails, self._tails = [lease for _k, lease in self._tails.values()], {}
        for tail in tails:
            with contextlib.suppress(HostKVError):
                tail.release()
        self._queue.put(None)
        if self._writer is not threading.current_thread():
            self._writer.join()
            with self._lock:
                # The writer is gone: nothing is in flight in the slow tier any more, so what is
                # still doomed can go now; a page whose write-back never ran (only if the writer
                # died) gives its fast-tier lease back before the fast tier closes.
                for pend in list(self._pend.values()):
                    self._finish_pending(pend)
                for run in list(self._pend_runs.values()):
                    self._finish_run(run)
                try:
                    self._purge_doomed()
                except HostKVError as exc:
                    warnings.warn(f"evicting stale pages from the {self.slow.name} tier failed: {exc!r}",
                                  stacklevel=2)
        if self._writer is not threading.current_thread():
            self._publish_logged(final=True)  # the last figures, and the gauges back to 0
        if self._own:
            for tier in (self.fast, self.slow):
                try:
                    tier.close()
                except HostKVError as exc:
                    warnings.warn(f"closing the {tier.name} tier failed: {exc!r}", stacklevel=2)
