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

import contextlib
import logging
import os
import queue
import threading
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from hostkv_providers._capabilities import (
    SupportsBatch,
    SupportsBatchViews,
    SupportsIterate,
    SupportsRetain,
    SupportsStoreCounters,
    SupportsViews,
)
from hostkv_providers._chain import _DEFERRED, ReservedChain, _check_checksums, _DeferredReservation
from hostkv_providers._checks import (
    check_retain_share,
    check_timeout,
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
from hostkv_providers._region import HostRegion
from hostkv_providers._reports import EntryInfo, EvictReport, ProviderStats
from hostkv_providers._reservation import Lease, Reservation
from hostkv_providers._span import ByteSpan
from hostkv_providers.providers._counters import STORE_COUNTED
from hostkv_providers.providers._tree import TreeIndex

__all__ = ["TieredProvider"]


def _read_batch(tier: Provider, keys: Sequence[Key], outs: Sequence[memoryview]) -> list[bool]:
    """``read_many`` where the tier batches reads, else one ``read`` per key."""
    if not keys:
        return []
    if isinstance(tier, SupportsBatch):
        return tier.read_many(keys, outs)
    return [tier.read(k, o) for k, o in zip(keys, outs, strict=True)]

_log = logging.getLogger(__name__)  # the writer thread logs; warnings could be turned into errors

_EXTRA_COUNTERS = frozenset(("promotions", "write_backs", "write_back_failures", "write_through", "fast_hits",
                             "slow_hits"))
#: Gauges of the write-back pipeline in ``store_counters()``: pages queued, and the age in ms of
#: the oldest page not yet in the slow tier (the write-back lag).
_GAUGES = ("write_back_queue", "write_back_lag_ms")
#: How often (seconds) the write-back thread publishes this instance's tiered figures into the
#: slow tier's store-wide counters (also on flush(), store_counters() and close()).
_PUBLISH_EVERY = 0.25
_WRITE_BACK_BATCH = 256  # queued pages the writer stores with one put_many of the slow tier


class _Ent:
    """A transient snapshot of one index row (taken under the lock, for work done without it)."""

    __slots__ = ("gen", "key", "nbytes", "parent", "row", "tag")

    def __init__(self, idx: TreeIndex, row: int) -> None:
        self.row = row
        self.gen = int(idx.gen[row])
        self.key = idx.key_of(row)
        self.parent = idx.parent_key(row)
        self.nbytes = int(idx.nbytes[row])
        self.tag = idx.tag_of(row)


class _Pending(_Ent):
    """A page sealed in the fast tier whose write-back is queued (only these have an object:
    at most ``queue`` pages plus those written through; every other entry is columns only)."""

    __slots__ = ("cancelled", "created", "fast_lease", "writing")

    def __init__(self, idx: TreeIndex, row: int, fast_lease: Lease | None) -> None:
        super().__init__(idx, row)
        self.created = float(idx.created[row])  # the seal's time.time(): the write-back lag gauge
        self.fast_lease = fast_lease  # pins the only copy until it is written back
        self.cancelled = False  # evicted before its write-back ran
        self.writing = False  # the writer is copying it out of the fast tier right now


class _TieredReservation(Reservation):
    __slots__ = ("inner",)

    def __init__(self, provider: TieredProvider, key: Key, parent: Key | None, nbytes: int, salt_tag: str,
                 inner: Reservation) -> None:
        super().__init__(provider, key, parent, nbytes, salt_tag)
        self.inner = inner

    def regions(self) -> Sequence[HostRegion]:
        self.check_open(self._provider)
        return self.inner.regions()

    def mark_written(self, span: ByteSpan | None = None) -> None:
        super().mark_written(span)
        self.inner.mark_written(span)


class _LeaseToken:
    __slots__ = ("fast", "gens", "keys", "rows")

    def __init__(self, rows: list[int], gens: list[int], keys: frozenset[Key], fast: Lease | None) -> None:
        self.rows = rows
        self.gens = gens
        self.fast = fast
        self.keys = keys  # O(1) membership for view()


class TieredProvider(Provider):
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
        self._pend: dict[int, _Pending] = {}
        self._unsynced: dict[int, dict[str, bytes]] = {}  # gen -> anchors queued for the slow tier
        self._queue: queue.Queue[tuple[Any, ...] | None] = queue.Queue()
        self._room = threading.Condition(threading.Lock())
        self._queued_pages = 0
        self._queue_pages = queue_pages
        self._writer_error: BaseException | None = None
        # Keys the tiered index has dropped that the slow tier may still hold: an eviction the
        # slow tier skipped (it never evicts the parent of a page in flight there, i.e. one the
        # writer is copying out right now), or a write-back that landed after its entry was
        # evicted.  The writer evicts them again after each write-back, and close() once the
        # writer has stopped, so a reopen (which rebuilds the index from the slow tier) never
        # brings an evicted entry back.  Guarded by ``_lock``.
        self._doomed: set[Key] = set()
        # Tail leases: the page a chain operation touched last stays held in that tier, so the
        # next page of the chain (whose parent it is) costs O(1) in a TreeIndex-based tier —
        # holding an unheld parent there walks every unheld ancestor.  Cheap for pinned/mmap,
        # skipped for tiers with their own index (lmdb leases are transactions).
        self._tails: dict[str, tuple[Key, Lease]] = {}
        self._slow_tree = isinstance(getattr(slow, "_index", None), TreeIndex)
        self._slow_retain = isinstance(slow, SupportsRetain)
        self._fast_views = isinstance(fast, SupportsViews)  # a Protocol check is slow: once
        self._fast_batch_views = isinstance(fast, SupportsBatchViews)
        self._fast_batch = isinstance(fast, SupportsBatch)
        # the tiering's own counters (the contract's are the front's: _tally)
        self._counters: dict[str, int] = dict.fromkeys(_EXTRA_COUNTERS, 0)
        # store-wide counters: the figures already added to the slow tier's counters file
        self._published: dict[str, int] = {}
        self._publish_lock = threading.Lock()
        self._publish_at = 0.0
        self._wb_since = 0.0  # time.time() of the seal of the page being written back (0: none)
        self._rebuild()
        self._writer = threading.Thread(target=self._write_back_loop, name="hostkv-tiered-writeback", daemon=True)
        self._writer.start()

    # -- construction ------------------------------------------------------------------------
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
        infos = {i.key: i for i in self.slow.iter_entries()}
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

    # -- lookups -----------------------------------------------------------------------------
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

    # -- retained entries (SupportsRetain) ---------------------------------------------------
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

    # -- writes ------------------------------------------------------------------------------
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
        res.inner.provider.write(res.inner, span.offset, view)

    def _seal(self, res: _TieredReservation) -> None:
        inner = res.inner
        through = inner.provider is self.slow
        if not through:
            self._wait_for_room()
        inner.provider.seal(inner)
        self._commit_sealed(res, through)

    def _wait_for_room(self) -> None:
        """Back-pressure: wait (without any lock held) while the write-back queue is full."""
        with self._room:
            while self._queued_pages >= self._queue_pages and self._writer.is_alive():
                self._room.wait(0.5)

    def _commit_sealed(self, res: _TieredReservation, through: bool) -> None:
        """Publish a reservation whose inner one is sealed: the tiered row, and (fast tier) the
        lease that pins the only copy until the write-back has run (a ``_Pending``)."""
        inner = res.inner
        fast_lease = None if through else self.fast.lease([res.key])
        with self._lock:
            if self._closed:
                if fast_lease is not None:
                    fast_lease.release()
                res._finish("aborted")
                return
            try:
                row = self._index.commit(res.key, nbytes=res.nbytes, tag=res.salt_tag)
            except UnknownKeyError:
                res._finish("aborted")
                if fast_lease is not None:
                    fast_lease.release()
                with contextlib.suppress(HostKVError):
                    inner.provider.evict([res.key])
                raise
            res._finish("sealed")
            if not through:
                pend = _Pending(self._index, row, fast_lease)
                self._pend[pend.gen] = pend
                with self._room:
                    self._queued_pages += 1
                self._queue.put(("page", pend))

    # -- chain reservation -------------------------------------------------------------------
    def reserve_many(self, keys: Sequence[bytes], parents: Sequence[bytes | None], nbytes: int, *,
                     salt_tag: str = "") -> ReservedChain:
        """Reserve a chain run straight in the fast tier (see ``Provider.reserve_many``), so a
        copy engine DMAs into its (pinned) memory before the first seal.

        The tiered index takes the run in one lock round (a parent may be in flight: an earlier
        key of this call or of an earlier ``reserve_many``), then the fast tier reserves the run
        with its own ``reserve_many``, the run's first page as a root there (the fast tier is a
        byte cache under the tiered index; runs rooted apart stay evictable run by run).  Pages
        the fast tier cannot take even after a ``flush`` (pending write-backs pin its memory)
        are not refused: they get ordinary
        buffers and are stored when sealed, by the per-page path (fast tier or written
        through), like the base class's default; so are the pages after a parent of that kind.
        """
        ks = self._keys(keys)
        if isinstance(parents, (bytes, bytearray, memoryview, str)) or len(parents) != len(ks):
            raise InvalidArgumentError(f"{len(parents)} parents for {len(ks)} keys; give one per key")
        checked = [self._reserve_args(k, p, nbytes, salt_tag) for k, p in zip(ks, parents, strict=True)]
        self._check_usable()
        out: list[Reservation | None] = []
        error: HostKVError | None = None
        flown: list[tuple[int, Key, Key | None]] = []  # (position in out, key, parent) in the index
        deferred_from = len(checked)  # from here on: deferred pages (their parent is one)
        with self._lock:
            self._check_usable()
            for i, (k, p, n) in enumerate(checked):
                if p is not None and (id(self), p) in _DEFERRED:
                    deferred_from = i
                    break
                if n > self._budget:
                    error = CapacityError(f"{n} bytes exceed the whole budget of {self._budget}")
                    break
                try:
                    ok, evicted, _ = self._index.begin_chained(k, p, n)
                except (CapacityError, InFlightError, UnknownKeyError) as exc:
                    error = exc
                    break
                self._drop_from_tiers(evicted)
                if ok:
                    flown.append((len(out), k, p))
                out.append(None)
        if error is not None:
            deferred_from = len(out)
        inners: list[Reservation] = []
        try:
            inners = self._reserve_fast_run([(k, p) for _, k, p in flown], nbytes, salt_tag)
        except BaseException:
            with self._lock:
                for _, k, _ in flown:
                    self._index.cancel(k)
            raise
        for (j, k, p), inner in zip(flown, inners, strict=False):
            out[j] = _TieredReservation(self, k, p, nbytes, salt_tag, inner)
        if len(inners) < len(flown):
            # the fast tier is full: the rest of the run is stored page by page at seal
            with self._lock:
                for _, k, _ in flown[len(inners):]:
                    self._index.cancel(k)
            for j, k, p in flown[len(inners):]:
                out[j] = self._deferred(k, p, nbytes, salt_tag)
        if error is None:
            for k, p, n in checked[deferred_from:]:
                if self.present([k])[0]:
                    out.append(None)
                    continue
                if self.in_flight(k):
                    error = InFlightError(f"key {k.hex()[:16]} is being written by another writer", key=k)
                    break
                out.append(self._deferred(k, p, n, salt_tag))
        return ReservedChain(out, error)

    def _deferred(self, k: Key, p: Key | None, nbytes: int, salt_tag: str) -> Reservation:
        res = _DeferredReservation(self, k, p, nbytes, salt_tag)
        _DEFERRED[(id(self), k)] = res
        return res

    def _reserve_fast_run(self, run: Sequence[tuple[Key, Key | None]], nbytes: int,
                          salt_tag: str) -> list[Reservation]:
        """Fast-tier reservations for a prefix of ``run`` (all of it unless the fast tier is full
        even after a flush); no lock held (flush waits for the writer)."""
        got: list[Reservation] = []
        for attempt in range(4):
            rest = run[len(got):]
            if not rest:
                break
            ks = [k for k, _ in rest]
            # A copy left in the fast tier by an entry evicted earlier must not dedup this one.
            stale = [k for k, here in zip(ks, self.fast.present(ks), strict=True) if here]
            if stale:
                self.fast.evict(stale)
            # Each run is a tree of its own in the fast tier: its first page lands there as a root
            # (the tiered index keeps the real tree).  Chained onto the previous run instead, the
            # fast tier would hold one long chain whose only leaf is the parent of the page being
            # reserved (held): nothing evictable, so once full it could never take another page
            # (2,000 x 4 KiB over a 2 MiB fast tier: 1,485 pages fell back to per-page stores).
            mine = set(ks)
            fast_parents = [None] + [p if p in mine else None for _, p in rest[1:]]
            rc = self.fast.reserve_many(ks, fast_parents, nbytes, salt_tag=salt_tag)
            raced = None in rc.reservations  # stored in the fast tier since the eviction above
            for r in rc.reservations:
                if r is None:
                    break
                got.append(r)
            if raced:
                # not ours to seal: give back what follows it; the rest is stored at seal
                for r in rc.reservations[len(got) - (len(run) - len(rest)) + 1:]:
                    if r is not None:
                        with contextlib.suppress(HostKVError):
                            self.fast.abort(r)
                break
            if len(got) == len(run):
                break
            # Pages waiting for write-back pin fast memory: wait until as many as this run still
            # needs have gone (the writer stores them batch by batch, so the save and the
            # write-back keep running side by side), the last time for all of them.
            if attempt < 2:
                self._wait_write_back_below(self._queued_pages - (len(run) - len(got)))
            elif attempt == 2:
                self.flush()
        return got

    def _wait_write_back_below(self, pages: int) -> None:
        """Wait (no lock held) until at most ``pages`` write-backs are queued or in progress."""
        with self._room:
            while self._queued_pages > max(0, pages) and self._writer.is_alive():
                self._room.wait(0.5)

    def seal_many(self, reservations: Sequence[Reservation], *, checksums: Sequence[int] | None = None,
                  algorithm: str | None = None) -> None:
        """Seal root first (see ``Provider.seal_many``): each run of fast-tier reservations with
        one ``seal_many`` of the fast tier (for ``pinned``: checksums on a few threads, commits
        in one lock round; given ``checksums`` in the fast tier's algorithm are passed on to it),
        then their tiered rows and write-backs; deferred pages are stored and written-through
        reservations sealed one by one.  On failure the sealed ones are a prefix and every other
        one is aborted."""
        _check_checksums(checksums, algorithm, len(reservations))
        for res in reservations:
            if not isinstance(res, Reservation) or res.provider is not self:
                raise InvalidArgumentError("seal_many() takes reservations of this provider")
        self._check_usable()
        i = 0
        try:
            while i < len(reservations):
                res = reservations[i]
                if isinstance(res, _TieredReservation) and res.inner.provider is self.fast:
                    j = i
                    while (j < len(reservations) and isinstance(reservations[j], _TieredReservation)
                           and reservations[j].inner.provider is self.fast):  # type: ignore[attr-defined]
                        j += 1
                    run: list[_TieredReservation] = [self._own_reservation(r, _TieredReservation)
                                                     for r in reservations[i:j]]
                    for r in run:
                        r.check_complete()
                    self._wait_for_room()
                    try:
                        if checksums is not None:
                            self.fast.seal_many([r.inner for r in run], checksums=checksums[i:j], algorithm=algorithm)
                        else:
                            self.fast.seal_many([r.inner for r in run])
                    finally:
                        for m, r in enumerate(run):  # a prefix is sealed in the fast tier
                            if r.inner.state != "sealed":
                                break
                            try:
                                self._commit_sealed(r, False)
                            except BaseException:
                                i += m
                                raise
                            self._tally("seals")
                    i = j
                elif isinstance(res, _DeferredReservation):
                    res._store()
                    i += 1
                else:
                    self.seal(res)
                    i += 1
        except BaseException:
            for rest in reservations[i:]:
                if rest.state == "open":
                    with contextlib.suppress(HostKVError):
                        rest.abort()
            raise

    def _abort(self, reservation: _TieredReservation) -> bool:
        with self._lock:
            if reservation.state != "open":
                return False
            self._index.cancel(reservation.key)
            reservation._finish("aborted")
        with contextlib.suppress(HostKVError):
            reservation.inner.provider.abort(reservation.inner)
        return True

    # -- the write-back thread ---------------------------------------------------------------
    def _write_back_loop(self) -> None:
        ahead: list[tuple[Any, ...] | None] = []  # taken off the queue while collecting pages
        while True:
            if time.monotonic() >= self._publish_at:
                self._publish_logged()
            if ahead:
                item = ahead.pop()
            else:
                try:
                    item = self._queue.get(timeout=_PUBLISH_EVERY)
                except queue.Empty:
                    continue
            items: list[tuple[Any, ...] | None] = [item]
            try:
                if item is None:
                    return
                kind = item[0]
                if kind == "page":
                    self._wb_since = item[1].created
                    # The pages queued behind this one go out with it, in queue (= seal) order:
                    # one put_many of the slow tier instead of a reserve/write/seal each.
                    pages: list[_Pending] = [item[1]]
                    while len(pages) < _WRITE_BACK_BATCH:
                        try:
                            nxt = self._queue.get_nowait()
                        except queue.Empty:
                            break
                        items.append(nxt)
                        if nxt is None or nxt[0] != "page":
                            items.pop()
                            ahead.append(nxt)  # an anchor or the stop: after this batch
                            break
                        pages.append(nxt[1])
                    if len(pages) == 1 or not isinstance(self.slow, SupportsBatch):
                        for node in pages:
                            self._write_back_one(node)
                    else:
                        self._write_back_many(pages)
                elif kind == "anchor":
                    try:
                        self._write_anchor(item[1], item[2], item[3], item[4])
                    except BaseException as exc:  # keep the writer alive
                        self._writer_error = exc
                        _log.error("tiered write-back of an anchor failed: %r", exc)
            finally:
                npages = sum(1 for it in items if it is not None and it[0] == "page")
                if npages:
                    self._wb_since = 0.0
                    self._purge_doomed_logged()
                    with self._room:
                        self._queued_pages -= npages
                        self._room.notify_all()
                for _ in items:
                    self._queue.task_done()

    def _write_back_one(self, node: _Pending) -> None:
        try:
            self._write_back(node)
        except BaseException as exc:  # keep the writer alive; the entry is dropped
            self._writer_failed(node, exc)

    def _writer_failed(self, node: _Pending, exc: BaseException) -> None:
        self._writer_error = exc
        _log.error("tiered write-back failed: %r", exc)
        with self._lock:
            if self._index.is_live(node.row, node.gen):
                self._drop_from_tiers(self._index.drop(node.row))
            self._finish_pending(node)

    def _write_back_many(self, nodes: Sequence[_Pending]) -> None:
        """:meth:`_write_back` for a run of queued pages with one ``put_many`` of the slow tier.

        The per-page rules hold: a page evicted before its turn is skipped; one evicted while
        the batch is being stored is made doomed afterwards (evicted from the slow tier again,
        as a per-page write-back evicted between its last check and its seal is); a stale copy
        of an earlier, evicted entry is replaced.  Pages that are not one contiguous region of
        the fast tier go page by page."""
        idx = self._index
        todo: list[tuple[_Pending, Lease]] = []
        stale: list[Key] = []
        single: list[_Pending] = []
        with self._lock:
            for node in nodes:
                if node.cancelled or not idx.is_live(node.row, node.gen):
                    self._finish_pending(node)
                    continue
                lease = node.fast_lease
                if lease is None or lease.released or not self._fast_views:
                    single.append(node)
                    continue
                node.writing = True
                if node.key in self._doomed:
                    self._doomed.discard(node.key)
                    stale.append(node.key)
                todo.append((node, lease))
        items: list[tuple[bytes, bytes | None, object]] = []
        took: list[_Pending] = []
        try:
            if stale:
                with contextlib.suppress(HostKVError):
                    self.slow.evict(stale)
            for node, lease in todo:
                regions = self._view_fast(lease, node.key)
                if regions is None:
                    raise UnknownKeyError(f"{node.key.hex()[:16]} vanished from the fast tier")
                data: object = regions[0].view if len(regions) == 1 else b"".join(bytes(r.view) for r in regions)
                items.append((node.key, node.parent, data))
                took.append(node)
            slow = self.slow
            assert isinstance(slow, SupportsBatch)
            if took and len({n.tag for n in took}) == 1:
                got: list[bool | HostKVError] = slow.put_many(items, salt_tag=took[0].tag)
            else:  # several salt tags in one batch (rare): one call per page
                got = [self.slow.put(k, p, d, salt_tag=n.tag) for (k, p, d), n in zip(items, took, strict=True)]
        except BaseException as exc:
            # the whole call failed: every page of it is treated as a failed write-back
            _log.warning("tiered write-back of %d pages failed: %s", len(todo), exc)
            got = [exc if isinstance(exc, HostKVError) else HostKVError(str(exc))] * len(took)
            took_set = {id(n) for n in took}
            with self._lock:  # pages not reached before the failure
                for node, _ in todo:
                    if id(node) not in took_set:
                        node.writing = False
                        single.append(node)
        with self._lock:
            for node, r in zip(took, got, strict=True):
                ok = r is True or r is False  # False: already there (a cancelled write-back left it)
                if not ok:
                    _log.warning("tiered write-back of %s failed: %s", node.key.hex()[:16], r)
                self._written_back(node, ok)
        for node in single:
            self._write_back_one(node)

    def _written_back(self, node: _Pending, ok: bool) -> None:
        """The end of a page's write-back (lock held): publish it as in the slow tier, or undo."""
        idx = self._index
        node.writing = False
        live = idx.is_live(node.row, node.gen)
        if node.cancelled or not live:
            # Evicted while it was being written: take it out of both tiers again.  Its
            # parent may have been doomed too (the slow tier skipped it while this page was
            # in flight under it); _write_back_loop purges both now that the flight is over.
            self._finish_pending(node)
            with contextlib.suppress(HostKVError):
                self.fast.evict([node.key])
            if ok:
                self._doomed.add(node.key)
        elif ok:
            self._counters["write_backs"] += 1
            if self._slow_tree:
                self._advance_tail("write", self.slow, node.key)
        else:
            self._counters["write_back_failures"] += 1
            self._drop_from_tiers(idx.drop(node.row))
        self._finish_pending(node)

    def _write_back(self, node: _Pending) -> None:
        idx = self._index
        with self._lock:
            if node.cancelled or not idx.is_live(node.row, node.gen):
                self._finish_pending(node)
                return
            # While this is set, an eviction only marks the entry cancelled: the fast-tier lease
            # (and so the memory being copied from) stays ours until the copy is over.
            node.writing = True
            lease = node.fast_lease
            if lease is not None and lease.released:  # never view() through a released lease
                lease = None
            # The key was evicted before and saved again; a stale copy of the evicted entry (with
            # its anchors) may still be in the slow tier: replace it rather than adopt it.
            stale = node.key in self._doomed
            self._doomed.discard(node.key)
        if stale:
            with contextlib.suppress(HostKVError):
                self.slow.evict([node.key])
        ok = False
        try:
            res = self.slow.reserve(node.key, node.parent, node.nbytes, salt_tag=node.tag)
            if res is None:
                ok = True  # already there (an earlier, cancelled write-back left it): same key, same bytes
            else:
                try:
                    regions = self._view_fast(lease, node.key) if lease is not None else None
                    if regions is None:
                        data = self.fast.read_bytes(node.key)
                        if data is None:
                            raise UnknownKeyError(f"{node.key.hex()[:16]} vanished from the fast tier")
                        res.write(0, data)
                    else:
                        for r in regions:
                            res.write(r.offset, r.view)
                    with self._lock:
                        lost = node.cancelled or not idx.is_live(node.row, node.gen)
                    if lost:  # evicted while being copied: do not make it durable at all
                        res.abort()
                    else:
                        # An eviction may still come between this check and the seal: the
                        # re-check below then evicts it from the slow tier again.
                        res.seal()
                        ok = True
                except BaseException:
                    if res.state == "open":
                        res.abort()
                    raise
        except (CapacityError, UnknownKeyError, InFlightError, HostKVError) as exc:
            _log.warning("tiered write-back of %s failed: %s", node.key.hex()[:16], exc)
        with self._lock:
            self._written_back(node, ok)

    def _purge_doomed(self) -> None:
        """Evict from the slow tier the doomed keys the index has not taken back (lock held).

        A doomed key saved again (in the index, or in flight) is left alone here: its own
        write-back replaces the stale copy (``_write_back``), a write-through evicts it first
        (``_reserve_inner``).  A key stays doomed while the slow tier still holds it (evicting it
        was skipped again: a child still in flight there), and is retried after the next write-back."""
        if not self._doomed:
            return
        contains, flights = self._index.contains_fn, self._index.flights
        gone = [k for k in self._doomed if not contains(k) and k not in flights]
        if not gone:
            return
        self.slow.evict(gone)  # subtrees, deepest first: a doomed child goes before its parent
        for k, there in zip(gone, self.slow.present(gone), strict=True):
            if not there:
                self._doomed.discard(k)

    def _purge_doomed_logged(self) -> None:
        try:
            with self._lock:
                self._purge_doomed()
        except HostKVError as exc:  # the writer must live on; close() retries
            _log.warning("tiered: evicting stale pages from the slow tier failed: %s", exc)

    def _advance_tail(self, which: str, tier: Provider, key: Key) -> None:
        try:
            lease = tier.lease([key])
        except HostKVError:
            return
        with self._lock:
            prior = self._tails.get(which)
            old = prior[1] if prior is not None else None
            if self._closed:
                old = lease
            else:
                self._tails[which] = (key, lease)
        if old is not None:
            with contextlib.suppress(HostKVError):
                old.release()

    def _finish_pending(self, node: _Pending) -> None:
        """The write-back is over (done, cancelled or failed): the entry is in the slow tier (or
        gone) and its fast-tier copy need not stay pinned (lock held)."""
        if node.fast_lease is not None:
            node.fast_lease.release()
            node.fast_lease = None
        self._pend.pop(node.gen, None)

    def _write_anchor(self, row: int, gen: int, name: str, blob: bytes) -> None:
        idx = self._index
        try:
            with self._lock:
                if not idx.is_live(row, gen) or gen in self._pend:
                    return  # evicted (or its page's write-back failed and dropped it)
                key = idx.key_of(row)
            self.slow.put_anchor(key, name, blob)
        finally:
            with self._lock:
                table = self._unsynced.get(gen)
                if table is not None and table.get(name) is blob:
                    del table[name]
                    if not table:
                        del self._unsynced[gen]

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write-back has reached the slow tier; ``False`` on timeout.

        ``timeout`` is seconds ``>= 0`` or ``None`` (no limit).  Raises ``ClosedError`` after
        ``close`` (nothing is queued then, but a ``True`` would claim a write-back happened).
        Then publishes this instance's figures to the store-wide counters."""
        deadline = None if timeout is None else time.monotonic() + check_timeout(timeout)
        self._check_usable()
        done = self._flush(deadline)
        self._publish_logged()
        return done

    def _flush(self, deadline: float | None) -> bool:
        if self._writer is threading.current_thread():
            return False
        with self._queue.all_tasks_done:
            while self._queue.unfinished_tasks:
                if not self._writer.is_alive():
                    return False  # cannot happen short of interpreter shutdown; never hang on it
                wait = 0.1 if deadline is None else min(0.1, deadline - time.monotonic())
                if wait <= 0:
                    return False
                self._queue.all_tasks_done.wait(wait)
        return True

    # -- reads -------------------------------------------------------------------------------
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
            in_slow = node.gen not in self._pend
        which = "fast_hits"
        try:
            got = self.fast.read(k, dst, span)
            if got:
                which = "fast_hits"
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

    def _drop_damaged(self, k: Key, token: object) -> bool:
        with self._lock:
            if self._closed or not isinstance(token, tuple) or not self._index.is_live(*token):
                return False  # another reader dropped it first (or the key was sealed again)
            self._drop_from_tiers(self._index.drop(token[0]))
            return True

    # -- batches -----------------------------------------------------------------------------
    def put_many(self, items: Sequence[tuple[bytes, bytes | None, object]], *,
                 salt_tag: str = "") -> list[bool | HostKVError]:
        """Store many pages, root first (:class:`~hostkv_providers.SupportsBatch`).  Each page
        takes the per-page path (fast-tier reservation, write-back queued in seal order), so this
        saves the caller's per-call overhead only; per item ``True``, ``False`` (dedup) or its
        error, and every item whose parent failed in this call gets ``UnknownKeyError``."""
        checked = self._put_many_args(items, salt_tag, tag_max=self._tag_max)
        out: list[bool | HostKVError] = []
        failed: set[Key] = set()
        for k, p, view in checked:
            orphan = self._failed_parent(p, failed, k)
            if orphan is not None:
                out.append(orphan)
                continue
            try:
                out.append(self.put(k, p, view, salt_tag=salt_tag))
            except (CapacityError, InFlightError, UnknownKeyError) as exc:
                failed.add(k)
                out.append(exc)
        return out

    def prefetch(self, keys: Sequence[bytes]) -> None:
        """Forward the hint to the slow tier for the keys only it holds (after a restart: all)."""
        ks = self._keys(keys)
        self._check_usable()
        with self._lock:
            self._check_usable()
            idx = self._index
            slow = [k for k, r in zip(ks, idx.rows_of(ks), strict=True)
                    if r >= 0 and int(idx.gen[r]) not in self._pend]
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
        with self._lock:
            self._check_usable()
            idx = self._index
            nodes = [None if r < 0 else _Ent(idx, r) for r in idx.rows_of(ks)]
            held = [n for n in nodes if n is not None]
            idx.hold_rows([n.row for n in held])
            in_slow = [n is not None and n.gen not in self._pend for n in nodes]
        got = [False] * len(ks)
        which: dict[int, str] = {}
        dsts: dict[int, memoryview] = {}
        todo: list[int] = []
        short: InvalidArgumentError | None = None
        try:
            for i, node in enumerate(nodes):
                if node is not None:
                    try:
                        dsts[i] = writable_buffer(outs[i], node.nbytes)
                    except InvalidArgumentError as exc:
                        short = short or exc
            todo = sorted(dsts)
            for i, ok in zip(todo, _read_batch(self.fast, [ks[i] for i in todo], [dsts[i] for i in todo]),
                             strict=True):
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
                    self._promote_many([n for i in from_slow if (n := nodes[i]) is not None],
                                       [dsts[i] for i in from_slow])
        finally:
            with self._lock:
                idx.release_rows([n.row for n in held], [n.gen for n in held])
                for i in todo:
                    node = nodes[i]
                    assert node is not None
                    if got[i]:
                        self._tally_hit(node.nbytes)
                        self._counters[which[i]] += 1
                    elif idx.is_live(node.row, node.gen):
                        # the only copies failed their checksums (or vanished): a miss, never wrong bytes
                        self._tally("checksum_failures")
                        self._drop_from_tiers(idx.drop(node.row))
                self._tally("misses", sum(1 for g in got if not g))
        if short is not None:
            raise short
        return got

    def _promote_many(self, nodes: Sequence[_Ent], datas: Sequence[memoryview]) -> None:
        """Best-effort copies of slow-tier pages into the fast tier, root first; a page whose
        parent the fast tier lacks (and that is not promoted before it here) is left out."""
        parents = [n.parent for n in nodes if n.parent is not None]
        have = set(p for p, ok in zip(parents, self.fast.present(parents), strict=True) if ok)
        items: list[tuple[Key, Key | None, memoryview]] = []
        tags: list[str] = []
        for n, d in zip(nodes, datas, strict=True):
            if n.parent is None or n.parent in have:
                items.append((n.key, n.parent, d))
                tags.append(n.tag)
                have.add(n.key)
        if not items:
            return
        stored: list[Key] = []
        try:
            if self._fast_batch and len(set(tags)) == 1:
                for (k, _p, _d), r in zip(items, self.fast.put_many(items, salt_tag=tags[0]),  # type: ignore[attr-defined]
                                          strict=True):
                    if r is True:
                        stored.append(k)
            else:
                for (k, p, d), tag in zip(items, tags, strict=True):
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
        if (not isinstance(lease, Lease) or lease.released or lease.provider is not self
                or not isinstance(lease.token, _LeaseToken)):
            raise InvalidArgumentError("view() needs an unreleased lease of this provider")
        self._check_usable()
        token: _LeaseToken = lease.token
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


    def _view_fast(self, lease: Lease, key: Key) -> Sequence[HostRegion] | None:
        if not self._fast_views:
            return None
        regions: Sequence[HostRegion] | None = self.fast.view(lease, key)  # type: ignore[attr-defined]
        return regions

    # -- eviction ----------------------------------------------------------------------------
    def _evict(self, ks: list[Key] | None, nbytes: int) -> EvictReport:
        self._check_usable()  # before the lock: a forked child must not wait on a copied lock
        with self._lock:
            self._check_usable()
            idx = self._index
            if ks is not None:
                removed, skipped = idx.evict_rows(idx.rows_of(ks))
            else:
                removed, skipped = idx.evict_cost(nbytes), 0
            freed = int(idx.nbytes[removed].sum()) if removed else 0
            self._drop_from_tiers(removed)
            return EvictReport(len(removed), freed, skipped)

    def _recycle(self, rows: Sequence[int]) -> None:
        for r in rows:
            self._index.anchors.pop(r, None)
        self._index.recycle(rows)

    def _drop_from_tiers(self, rows: Sequence[int]) -> None:
        """Apply the index's removals to the tiers and recycle the rows (called with the lock held)."""
        if not rows:
            return
        idx = self._index
        keys = [idx.key_of(r) for r in rows]
        gens = [int(g) for g in idx.gen[list(rows)].tolist()]
        self._recycle(rows)
        gone = set(keys)
        for which, (k, lease) in list(self._tails.items()):
            if k in gone:  # a tail lease must not keep an evicted page alive in a tier
                del self._tails[which]
                with contextlib.suppress(HostKVError):
                    lease.release()
        slow_keys = []
        for k, g in zip(keys, gens, strict=True):
            self._unsynced.pop(g, None)
            pend = self._pend.get(g)
            if pend is not None:
                pend.cancelled = True  # the writer skips it (or undoes it if it is mid-write)
                if pend.fast_lease is not None and not pend.writing:
                    pend.fast_lease.release()
                    pend.fast_lease = None
            else:
                slow_keys.append(k)
        with contextlib.suppress(HostKVError):
            self.fast.evict(keys)
        if slow_keys:
            report = self.slow.evict(slow_keys)
            if report.skipped or report.entries < len(slow_keys):
                # The slow tier kept some (a parent of a page the writer has in flight there):
                # doomed, evicted again once that write-back is over (else a reopen revives them).
                still = self.slow.present(slow_keys)
                self._doomed.update(k for k, there in zip(slow_keys, still, strict=True) if there)

    # -- anchors -----------------------------------------------------------------------------
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
            self._drop_from_tiers(idx.add_cost(row, len(blob) - old))
            if gen in self._pend or gen in self._unsynced:
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

    # -- leases ------------------------------------------------------------------------------
    def _lease(self, ks: list[Key]) -> Lease:
        self._check_usable()  # before the lock: a forked child must not wait on a copied lock
        with self._lock:
            self._check_usable()
            idx = self._index
            rows = idx.rows_of(ks)
            live = [r for r in rows if r >= 0]
            idx.hold_rows(live)
            held = frozenset(k for k, r in zip(ks, rows, strict=True) if r >= 0)
            try:
                fast = self.fast.lease([k for k, r in zip(ks, rows, strict=True) if r >= 0])
            except HostKVError:
                fast = None
            token = _LeaseToken(live, [int(g) for g in idx.gen[live].tolist()], held, fast)
            return Lease(self, ks, [r >= 0 for r in rows], token=token)

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
            self._index.release_rows(token.rows, token.gens)

    # -- the rest ----------------------------------------------------------------------------
    def stats(self) -> ProviderStats:
        self._check_usable()  # before the lock: a forked child must not wait on a copied lock
        with self._lock:
            self._check_usable()
            idx = self._index
            n = idx.n
            pending = sum(1 for p in self._pend.values() if idx.is_live(p.row, p.gen))
            return ProviderStats(
                name=self.name,
                entries=idx.count,
                used_bytes=idx.used_cost,
                budget_bytes=self._budget,
                anchors=sum(len(t) for t in idx.anchors.values()),
                leased=int(((idx.hold[:n] > 0) & idx.alive[:n]).sum()),
                in_flight=len(idx.flights),
                evictions=idx.evictions,
                evicted_bytes=idx.evicted_cost,
                retained=idx.retained_count,
                retained_bytes=idx.retained_cost,
                extra={"pending_write_back": pending, "fast": self.fast.name, "slow": self.slow.name,
                       **self._counters},
                **self._tallies(),
            )

    # -- store-wide counters -------------------------------------------------------------------
    def _figures(self) -> dict[str, int]:
        """This instance's cumulative figures, under the names they have in the slow tier's
        counters file: ``tiered.<counter>`` (the composite's own), ``fast.<counter>`` (the fast
        tier's: in-process memory), ``tiered.<pipeline counter>``."""
        fst = self.fast.stats()
        with self._lock:
            idx = self._index
            out = {f"tiered.{k}": v for k, v in self._tallies().items() if k in STORE_COUNTED}
            out["tiered.evictions"], out["tiered.evicted_bytes"] = idx.evictions, idx.evicted_cost
            out.update({f"tiered.{k}": v for k, v in self._counters.items()})
        out.update({f"fast.{k}": int(getattr(fst, k)) for k in STORE_COUNTED})
        return out

    def _gauges(self) -> dict[str, int]:
        with self._queue.mutex:
            head = self._queue.queue[0] if self._queue.queue else None
        since = [t for t in (self._wb_since, head[1].created if head and head[0] == "page" else 0.0) if t]
        lag = int(max(0.0, time.time() - min(since)) * 1000) if since else 0
        return {"tiered.write_back_queue": max(0, self._queued_pages), "tiered.write_back_lag_ms": lag}

    def _publish(self, *, final: bool = False) -> dict[str, int]:
        """Add what changed since the last call to the slow tier's store-wide counters (when it
        keeps them in its store: mmap, lmdb) and set the pipeline gauges; returns the figures."""
        with self._publish_lock:
            self._publish_at = time.monotonic() + _PUBLISH_EVERY
            figures = self._figures()
            gauges = dict.fromkeys(self._gauges_names(), 0) if final else self._gauges()
            sink = getattr(self.slow, "_store_sink", None)
            if sink is not None and hasattr(sink, "set_gauge"):
                sink.columns(figures)
                sink.columns(gauges, gauge=True)
                sink.add_many({k: v - self._published.get(k, 0) for k, v in figures.items()})
                for k, v in gauges.items():
                    sink.set_gauge(k, v)
                self._published = figures
            return {**figures, **gauges}

    @staticmethod
    def _gauges_names() -> tuple[str, ...]:
        return tuple(f"tiered.{g}" for g in _GAUGES)

    def _publish_logged(self, *, final: bool = False) -> dict[str, int]:
        if self._pid != os.getpid():
            return {}
        try:
            return self._publish(final=final)
        except (HostKVError, OSError, ValueError) as exc:  # figures for operators: never fail the store
            _log.warning("tiered: publishing store-wide counters failed: %r", exc)
            return {}

    def store_counters(self) -> dict[str, int]:
        """Store-wide counters (:class:`~hostkv_providers.providers.SupportsStoreCounters`), per
        tier: the composite's own (``hits`` ... ``checksum_failures``: what the engine saw),
        ``fast.*`` (the fast tier), ``slow.*`` (the slow tier, every process that used it), and
        the pipeline (``promotions``, ``write_backs``, ``write_back_failures``,
        ``write_through``, ``fast_hits``, ``slow_hits``, gauges ``write_back_queue`` and
        ``write_back_lag_ms``).  The composite's and the fast tier's figures reach the slow
        tier's counters file (so ``hostkv stats`` of the slow store shows them) within
        ``0.25`` s, on :meth:`flush` and on close; a slow tier without store-wide counters gets
        this instance's figures instead."""
        self._check_usable()
        local = self._publish()
        if isinstance(self.slow, SupportsStoreCounters):
            slow = self.slow.store_counters()
        else:
            st = self.slow.stats()
            slow = {k: int(getattr(st, k)) for k in STORE_COUNTED}
        if getattr(self.slow, "_store_sink", None) is None:
            slow = {**slow, **local}
        return self.counters_view(slow)

    @staticmethod
    def counters_view(slow_counters: Mapping[str, int]) -> dict[str, int]:
        """:meth:`store_counters` of a tiered store from its slow tier's ``store_counters()``
        (what ``hostkv stats tiered://...`` shows: it opens only the slow tier, read-only)."""
        c = slow_counters
        out = {k: int(c.get(f"tiered.{k}", 0)) for k in STORE_COUNTED}
        out.update({f"fast.{k}": int(c.get(f"fast.{k}", 0)) for k in STORE_COUNTED})
        out.update({f"slow.{k}": int(c.get(k, 0)) for k in STORE_COUNTED})
        for k in (*sorted(_EXTRA_COUNTERS), *_GAUGES):
            out[k] = int(c.get(f"tiered.{k}", 0))
        return out

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


def _info(idx: TreeIndex, row: int) -> EntryInfo:
    return EntryInfo(idx.key_of(row), idx.parent_key(row), int(idx.nbytes[row]), idx.tag_of(row),
                     idx.checksum_of(row), float(idx.created[row]), float(idx.used[row]),
                     dict(idx.anchors.get(row, {})), bool(idx.retained[row]))
