"""``tiered://`` — a fast provider (pinned RAM) over a slow, persistent one (lmdb, mmap).

Saves land in the fast tier, where the copy engine can DMA into pinned memory, and a background
thread writes them back to the slow tier, in seal order (so parent before child), through a
bounded queue: when ``queue`` pages are waiting, ``seal`` blocks until the writer catches up.
Reads and restores are served from the fast tier when it holds the page; pages found only in the
slow tier are read from there and *promoted* into the fast tier.  A restart keeps the slow tier:
the tiered index is rebuilt from it on open.

Membership, LRU order, leases, in-flight reservations and the budget are kept by the tiered
provider itself (one ``TreeIndex``), so the composite behaves exactly like a single provider —
evictions are decided synchronously when space is reserved and then applied to both tiers.  The
tiers are storage: the slow tier must hold at least the tiered budget (it then never evicts on its
own), the fast tier may be smaller (it evicts promoted copies by its own LRU; pages still waiting
for write-back are pinned in it).  When the fast tier cannot take a new page, it is written
straight through to the slow tier.

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
from hostkv_providers._provider import (
    Corrupt,
    EntryInfo,
    EvictReport,
    HostRegion,
    Lease,
    Provider,
    ProviderStats,
    Reservation,
    SupportsBatch,
    SupportsBatchViews,
    SupportsIterate,
    SupportsViews,
    check_timeout,
    writable_buffer,
)
from hostkv_providers._span import ByteSpan
from hostkv_providers.providers._tree import Node, TreeIndex

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
_PENDING = "pending"  # sealed in the fast tier, write-back queued
_SLOW = "slow"  # in the slow tier (maybe also cached in the fast tier)


class _Loc:
    """Where a tiered entry's bytes are; ``Node.loc`` of the tiered index."""

    __slots__ = ("anchors", "cancelled", "fast_lease", "state", "unsynced", "writing")

    def __init__(self, state: str, fast_lease: Lease | None = None) -> None:
        self.state = state
        self.fast_lease = fast_lease  # pins the only copy until it is written back
        self.cancelled = False  # evicted before its write-back ran
        self.writing = False  # the writer is copying it out of the fast tier right now
        self.anchors: dict[str, int] = {}  # name -> nbytes (the bytes live in the slow tier)
        self.unsynced: dict[str, bytes] = {}  # anchors queued for the slow tier, not written yet


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
    __slots__ = ("fast", "keys", "nodes")

    def __init__(self, nodes: list[Node | None], fast: Lease | None) -> None:
        self.nodes = nodes
        self.fast = fast
        self.keys = frozenset(n.key for n in nodes if n is not None)  # O(1) membership for view()


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
        Option("queue", "int", 1024, "1024"),
        Option("promote", "bool", True, "true"),
    )
    _reservation_type = _TieredReservation
    persistent = True  # the slow tier is

    def __init__(self, fast: Provider, slow: Provider, *, budget_bytes: int | None = None, queue_pages: int = 1024,
                 promote: bool = True, own_tiers: bool = True) -> None:
        super().__init__()
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
        self._fast_views = isinstance(fast, SupportsViews)  # a Protocol check is slow: once
        self._fast_batch_views = isinstance(fast, SupportsBatchViews)
        self._fast_batch = isinstance(fast, SupportsBatch)
        # the tiering's own counters (the contract's are the front's: _tally)
        self._counters: dict[str, int] = dict.fromkeys(_EXTRA_COUNTERS, 0)
        self._rebuild()
        self._writer = threading.Thread(target=self._write_back_loop, name="hostkv-tiered-writeback", daemon=True)
        self._writer.start()

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def from_url(cls, location: str, options: Mapping[str, str]) -> TieredProvider:
        from hostkv_providers._registry import open_provider

        o = cls.OPTIONS.parse(options)
        fast_url, slow_url, budget, queue_pages, promote = o["fast"], o["slow"], o["budget"], o["queue"], o["promote"]
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
                       queue_pages=queue_pages, promote=promote, own_tiers=True)
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
        # The node added last stays held: a chain's next page then costs O(1) in the index
        # (holding an unheld parent walks up every unheld ancestor).
        tail: list[Node | None] = []

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
                    _, evicted = self._index.begin(i.key, i.parent, cost)
                except (CapacityError, UnknownKeyError):
                    dropped.append(i.key)
                    return
                for n in evicted:
                    dropped.append(n.key)
                node = Node(i.key, i.parent, i.nbytes, 0, i.salt_tag, i.checksum, _Loc(_SLOW), i.created)
                node.loc.anchors = dict(i.anchors)
                self._index.commit(i.key, node)
                node.last_used = i.last_used
                done.add(i.key)
                held = self._index.hold_keys([i.key])
                self._index.release_nodes(tail)
                tail[:] = held

        for info in order:
            if info.key not in done:
                add(info)
        self._index.release_nodes(tail)
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
            nodes = self._index.nodes
            return [k in nodes for k in ks]

    def _longest_prefix(self, keys: Sequence[bytes]) -> int:
        ks = self._keys(keys)
        self._check_usable()  # before the lock: a forked child must not wait on a copied lock
        with self._lock:
            self._check_usable()
            nodes = self._index.nodes
            n = 0
            for k in ks:
                if k not in nodes:
                    break
                n += 1
            return n

    def _entry(self, k: Key) -> EntryInfo | None:
        self._check_usable()  # before the lock: a forked child must not wait on a copied lock
        with self._lock:
            self._check_usable()
            node = self._index.get(k)
            return None if node is None else _info(node)

    def iter_entries(self) -> Iterator[EntryInfo]:
        self._check_usable()  # before the lock: a forked child must not wait on a copied lock
        with self._lock:
            self._check_usable()
            infos = [_info(n) for n in self._index]
        return iter(infos)

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
            ok, evicted = self._index.begin(k, p, nbytes)
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
        # Back-pressure: wait (without any lock held) while the write-back queue is full.
        if not through:
            with self._room:
                while self._queued_pages >= self._queue_pages and self._writer.is_alive():
                    self._room.wait(0.5)
        inner.provider.seal(inner)
        fast_lease = None if through else self.fast.lease([res.key])
        with self._lock:
            if self._closed:
                if fast_lease is not None:
                    fast_lease.release()
                res._finish("aborted")
                return
            node = Node(res.key, res.parent, res.nbytes, 0, res.salt_tag, None,
                        _Loc(_SLOW if through else _PENDING, fast_lease), time.time())
            try:
                self._index.commit(res.key, node)
            except UnknownKeyError:
                res._finish("aborted")
                if fast_lease is not None:
                    fast_lease.release()
                with contextlib.suppress(HostKVError):
                    inner.provider.evict([res.key])
                raise
            res._finish("sealed")
            if not through:
                with self._room:
                    self._queued_pages += 1
                self._queue.put(("page", node))

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
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                kind = item[0]
                if kind == "page":
                    self._write_back(item[1])
                elif kind == "anchor":
                    self._write_anchor(item[1], item[2], item[3])
            except BaseException as exc:  # keep the writer alive; the entry is dropped
                self._writer_error = exc
                _log.error("tiered write-back failed: %r", exc)
                if item is not None and item[0] == "page":
                    with self._lock:
                        if not item[1].dead:
                            self._drop_from_tiers(self._index.drop(item[1].key))
                        self._finish_pending(item[1])
            finally:
                if item is not None and item[0] == "page":
                    self._purge_doomed_logged()
                    with self._room:
                        self._queued_pages -= 1
                        self._room.notify_all()
                self._queue.task_done()

    def _write_back(self, node: Node) -> None:
        loc: _Loc = node.loc
        with self._lock:
            if loc.cancelled or node.dead:
                self._finish_pending(node)
                return
            # While this is set, an eviction only marks the node cancelled: the fast-tier lease
            # (and so the memory being copied from) stays ours until the copy is over.
            loc.writing = True
            lease = loc.fast_lease
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
            res = self.slow.reserve(node.key, node.parent, node.nbytes, salt_tag=node.salt_tag)
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
                        lost = loc.cancelled or node.dead
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
            loc.writing = False
            if loc.cancelled or node.dead:
                # Evicted while it was being written: take it out of both tiers again.  Its
                # parent may have been doomed too (the slow tier skipped it while this page was
                # in flight under it); _write_back_loop purges both now that the flight is over.
                self._finish_pending(node)
                with contextlib.suppress(HostKVError):
                    self.fast.evict([node.key])
                if ok:
                    self._doomed.add(node.key)
            elif ok:
                loc.state = _SLOW
                self._counters["write_backs"] += 1
                if self._slow_tree:
                    self._advance_tail("write", self.slow, node.key)
            elif not node.dead:
                self._counters["write_back_failures"] += 1
                self._drop_from_tiers(self._index.drop(node.key))
            self._finish_pending(node)

    def _purge_doomed(self) -> None:
        """Evict from the slow tier the doomed keys the index has not taken back (lock held).

        A doomed key saved again (in the index, or in flight) is left alone here: its own
        write-back replaces the stale copy (``_write_back``), a write-through evicts it first
        (``_reserve_inner``).  A key stays doomed while the slow tier still holds it (evicting it
        was skipped again: a child still in flight there), and is retried after the next write-back."""
        if not self._doomed:
            return
        nodes, flights = self._index.nodes, self._index.flights
        gone = [k for k in self._doomed if k not in nodes and k not in flights]
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

    def _finish_pending(self, node: Node) -> None:
        loc: _Loc = node.loc
        if loc.fast_lease is not None:
            loc.fast_lease.release()
            loc.fast_lease = None

    def _write_anchor(self, node: Node, name: str, blob: bytes) -> None:
        loc: _Loc = node.loc
        try:
            with self._lock:
                if node.dead or loc.cancelled or loc.state != _SLOW:
                    return
            self.slow.put_anchor(node.key, name, blob)
        finally:
            with self._lock:
                if loc.unsynced.get(name) is blob:
                    del loc.unsynced[name]

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write-back has reached the slow tier; ``False`` on timeout.

        ``timeout`` is seconds ``>= 0`` or ``None`` (no limit).  Raises ``ClosedError`` after
        ``close`` (nothing is queued then, but a ``True`` would claim a write-back happened)."""
        deadline = None if timeout is None else time.monotonic() + check_timeout(timeout)
        self._check_usable()
        return self._flush(deadline)

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
        with self._lock:
            self._check_usable()
            node = self._index.get(k)
            if node is None:
                return None
            span = ByteSpan.whole(node.nbytes) if span is None else span.validate(node.nbytes)
            dst = writable_buffer(out, span.nbytes)
            held = self._index.hold_keys([k])
            state = node.loc.state
        which = "fast_hits"
        try:
            got = self.fast.read(k, dst, span)
            if got:
                which = "fast_hits"
            elif state == _SLOW:
                got = self.slow.read(k, dst, span)
                which = "slow_hits"
                if got and self._slow_tree:
                    self._advance_tail("read", self.slow, k)
                if got and self._promote and span.nbytes == node.nbytes:
                    self._promote_one(node, dst)
            if not got:
                # the only copies failed their checksums (or vanished): the front drops the
                # entry (_drop_damaged) and reports a miss, never wrong bytes
                return Corrupt(node)
        finally:
            if held:
                with self._lock:
                    self._index.release_nodes(held)
        with self._lock:
            self._counters[which] += 1
        return span.nbytes

    def _drop_damaged(self, k: Key, token: object) -> bool:
        with self._lock:
            if self._closed or self._index.get(k) is not token:
                return False  # another reader dropped it first (or the key was sealed again)
            self._drop_from_tiers(self._index.drop(k))
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
            slow = [k for k in ks if (n := self._index.get(k)) is not None and n.loc.state == _SLOW]
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
            nodes = [self._index.get(k) for k in ks]
            held = self._index.hold_keys([k for k, n in zip(ks, nodes, strict=True) if n is not None])
            states = [None if n is None else n.loc.state for n in nodes]
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
            slow = [i for i in todo if not got[i] and states[i] == _SLOW]
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
                self._index.release_nodes(held)
                for i in todo:
                    node = nodes[i]
                    assert node is not None
                    if got[i]:
                        self._tally_hit(node.nbytes)
                        self._counters[which[i]] += 1
                    elif not node.dead:
                        # the only copies failed their checksums (or vanished): a miss, never wrong bytes
                        self._tally("checksum_failures")
                        self._drop_from_tiers(self._index.drop(node.key))
                self._tally("misses", sum(1 for g in got if not g))
        if short is not None:
            raise short
        return got

    def _promote_many(self, nodes: Sequence[Node], datas: Sequence[memoryview]) -> None:
        """Best-effort copies of slow-tier pages into the fast tier, root first; a page whose
        parent the fast tier lacks (and that is not promoted before it here) is left out."""
        parents = [n.parent for n in nodes if n.parent is not None]
        have = set(p for p, ok in zip(parents, self.fast.present(parents), strict=True) if ok)
        items: list[tuple[Key, Key | None, memoryview]] = []
        tags: list[str] = []
        for n, d in zip(nodes, datas, strict=True):
            if n.parent is None or n.parent in have:
                items.append((n.key, n.parent, d))
                tags.append(n.salt_tag)
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

    def _promote_one(self, node: Node, data: memoryview) -> None:
        if node.parent is not None and not self.fast.present([node.parent])[0]:
            return  # the fast tier is prefix-closed too: promote chains root first (restores do)
        try:
            if self.fast.put(node.key, node.parent, data, salt_tag=node.salt_tag):
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
            if ks is not None:
                removed, skipped = self._index.evict_keys(ks)
            else:
                removed, skipped = self._index.evict_cost(nbytes), 0
            self._drop_from_tiers(removed)
            return EvictReport(len(removed), sum(n.nbytes for n in removed), skipped)

    def _drop_from_tiers(self, nodes: Sequence[Node]) -> None:
        """Apply the index's removals to the tiers (called with the lock held)."""
        if not nodes:
            return
        gone = {n.key for n in nodes}
        for which, (k, lease) in list(self._tails.items()):
            if k in gone:  # a tail lease must not keep an evicted page alive in a tier
                del self._tails[which]
                with contextlib.suppress(HostKVError):
                    lease.release()
        slow_keys = []
        for n in nodes:
            loc: _Loc = n.loc
            if loc.state == _PENDING:
                loc.cancelled = True  # the writer skips it (or undoes it if it is mid-write)
                if loc.fast_lease is not None and not loc.writing:
                    loc.fast_lease.release()
                    loc.fast_lease = None
            else:
                slow_keys.append(n.key)
        with contextlib.suppress(HostKVError):
            self.fast.evict([n.key for n in nodes])
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
            node = self._index.get(k)
            if node is None:
                raise UnknownKeyError(f"entry {k.hex()[:16]} is not stored", hint="seal the page before its anchors")
            loc: _Loc = node.loc
            delta = len(blob) - loc.anchors.get(name, 0)
            self._drop_from_tiers(self._index.add_cost(node, delta))
            if loc.state == _PENDING or loc.unsynced:
                # Queued behind the page's own write-back (and any earlier anchor of it), so the
                # slow tier ends with the latest blob; reads see it here until then.
                loc.unsynced[name] = blob
                self._queue.put(("anchor", node, name, blob))
            else:
                self.slow.put_anchor(k, name, blob)
            loc.anchors[name] = len(blob)

    def _get_anchor(self, k: Key, name: str) -> bytes | None:
        self._check_usable()  # before the lock: a forked child must not wait on a copied lock
        with self._lock:
            self._check_usable()
            node = self._index.get(k)
            if node is None or name not in node.loc.anchors:
                return None
            blob = node.loc.unsynced.get(name)
            return blob if blob is not None else self.slow.get_anchor(k, name)

    def _list_anchors(self, k: Key) -> dict[str, int]:
        self._check_usable()  # before the lock: a forked child must not wait on a copied lock
        with self._lock:
            self._check_usable()
            node = self._index.get(k)
            return {} if node is None else dict(node.loc.anchors)

    def _deepest_anchor(self, ks: list[Key], name: str) -> int:
        self._check_usable()  # before the lock: a forked child must not wait on a copied lock
        with self._lock:
            self._check_usable()
            best = 0
            for i, k in enumerate(ks):
                node = self._index.get(k)
                if node is None:
                    break
                if name in node.loc.anchors:
                    best = i + 1
            return best

    # -- leases ------------------------------------------------------------------------------
    def _lease(self, ks: list[Key]) -> Lease:
        self._check_usable()  # before the lock: a forked child must not wait on a copied lock
        with self._lock:
            self._check_usable()
            held = self._index.hold_keys(ks)
            try:
                fast = self.fast.lease([k for k, n in zip(ks, held, strict=True) if n is not None])
            except HostKVError:
                fast = None
            return Lease(self, ks, [n is not None for n in held], token=_LeaseToken(held, fast))

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
            self._index.release_nodes(token.nodes)

    # -- the rest ----------------------------------------------------------------------------
    def stats(self) -> ProviderStats:
        self._check_usable()  # before the lock: a forked child must not wait on a copied lock
        with self._lock:
            self._check_usable()
            idx = self._index
            pending = sum(1 for n in idx.nodes.values() if n.loc.state == _PENDING)
            return ProviderStats(
                name=self.name,
                entries=len(idx.nodes),
                used_bytes=idx.used,
                budget_bytes=self._budget,
                anchors=sum(len(n.loc.anchors) for n in idx.nodes.values()),
                leased=sum(1 for n in idx.nodes.values() if n.hold),
                in_flight=len(idx.flights),
                evictions=idx.evictions,
                evicted_bytes=idx.evicted_cost,
                extra={"pending_write_back": pending, "fast": self.fast.name, "slow": self.slow.name,
                       **self._counters},
                **self._tallies(),
            )

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "fast": self.fast.describe(), "slow": self.slow.describe(),
                "queue_pages": self._queue_pages, "promote": self._promote}

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
                for node in self._index.nodes.values():
                    if node.loc.state == _PENDING:
                        self._finish_pending(node)
                try:
                    self._purge_doomed()
                except HostKVError as exc:
                    warnings.warn(f"evicting stale pages from the {self.slow.name} tier failed: {exc!r}",
                                  stacklevel=2)
        if self._own:
            for tier in (self.fast, self.slow):
                try:
                    tier.close()
                except HostKVError as exc:
                    warnings.warn(f"closing the {tier.name} tier failed: {exc!r}", stacklevel=2)


def _info(node: Node) -> EntryInfo:
    return EntryInfo(node.key, node.parent, node.nbytes, node.salt_tag, node.checksum,
                     node.created, node.last_used, dict(node.loc.anchors))
