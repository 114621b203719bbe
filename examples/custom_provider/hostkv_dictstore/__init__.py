"""``dict://`` — the smallest complete provider: page bytes in a Python dict.

This is the template a provider author copies.  The medium here is trivial on purpose, so what
remains is exactly what every provider must do:

* validate inputs and raise the library's typed errors;
* keep the tree prefix-closed, the budget honest, leases and in-flight entries safe — delegated to
  :class:`hostkv_providers.TreeIndex`, the same bookkeeping the built-in providers use;
* record a checksum at seal and check it on read, dropping the subtree on a mismatch;
* take one lock around the index (``self._locked(lock)`` checks for close/fork first), and copy
  bytes outside it where the medium allows.

Its tests (``tests/test_dictstore.py``) subclass the shipped conformance suite, which is all it
takes to prove the contract.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import hostkv_providers as hk
from hostkv_providers.providers import (
    ByteSpan,
    EntryInfo,
    EvictReport,
    Lease,
    Provider,
    ProviderStats,
    Reservation,
    TreeIndex,
)

__all__ = ["DictProvider"]


class _DictReservation(Reservation):
    __slots__ = ("buf",)

    def __init__(self, provider: DictProvider, key: hk.Key, parent: hk.Key | None, nbytes: int, tag: str) -> None:
        super().__init__(provider, key, parent, nbytes, tag)
        self.buf = bytearray(nbytes)


class DictProvider(Provider):
    """Entries in process memory; budget-bounded; not persistent."""

    name = "dict"

    def __init__(self, budget_bytes: int) -> None:
        super().__init__()
        if type(budget_bytes) is not int or budget_bytes <= 0:
            raise hk.InvalidArgumentError(f"budget must be a positive int, got {budget_bytes!r}")
        self._budget = budget_bytes
        self._lock = threading.RLock()
        self._index = TreeIndex(budget_bytes)
        self._data: dict[hk.Key, bytes] = {}  # the "medium"
        self._n = {"hits": 0, "misses": 0, "seals": 0, "aborts": 0, "dedup": 0, "checksum_failures": 0}

    @classmethod
    def from_url(cls, location: str, options: Mapping[str, str]) -> DictProvider:
        opts = hk.providers.Options("dict", options)
        budget = opts.size("budget", 64 << 20)
        opts.finish()
        if location not in ("", "/"):
            raise hk.InvalidArgumentError("dict:// takes no path")
        return cls(budget)

    @property
    def budget_bytes(self) -> int:
        return self._budget

    # -- lookups -----------------------------------------------------------------------------
    def present(self, keys: Sequence[bytes]) -> list[bool]:
        ks = self._keys(keys)
        with self._locked(self._lock):
            return [k in self._index.nodes for k in ks]

    def in_flight(self, key: bytes) -> bool:
        k = self._key(key)
        with self._locked(self._lock):
            return k in self._index.flights

    def entry(self, key: bytes) -> EntryInfo | None:
        k = self._key(key)
        with self._locked(self._lock):
            node = self._index.get(k)
            if node is None:
                return None
            anchors = {n: len(b) for n, b in (node.anchors or {}).items()}
            return EntryInfo(k, node.parent, node.nbytes, node.salt_tag, node.checksum,
                             node.created, node.last_used, anchors)

    def iter_entries(self) -> Iterator[EntryInfo]:
        with self._locked(self._lock):
            keys = list(self._index.nodes)
        return (info for info in map(self.entry, keys) if info is not None)

    # -- writes ------------------------------------------------------------------------------
    def reserve(self, key: bytes, parent: bytes | None, nbytes: int, *, salt_tag: str = "") -> Reservation | None:
        k, p, nbytes = self._reserve_args(key, parent, nbytes, salt_tag)  # the contract's typed errors
        with self._locked(self._lock):
            fresh, evicted = self._index.begin(k, p, nbytes)  # may raise the contract's errors
            for node in evicted:
                del self._data[node.key]
            if not fresh:
                self._n["dedup"] += 1
                return None
            return _DictReservation(self, k, p, nbytes, salt_tag)

    def _own(self, res: Reservation) -> _DictReservation:
        return self._own_reservation(res, _DictReservation)  # other provider's / sealed: typed error

    def write(self, reservation: Reservation, offset: int, data: object) -> None:
        self._check_usable()
        res = self._own(reservation)
        view = hk.providers.readable_bytes(data)
        span = res.check_write(offset, view.nbytes)
        res.buf[span.offset : span.end] = view
        res.mark_written(span)

    def seal(self, reservation: Reservation) -> None:
        self._check_usable()
        res = self._own(reservation)
        res.check_complete()
        blob = bytes(res.buf)
        node = hk.providers.Node(res.key, res.parent, res.nbytes, 0, res.salt_tag, hk.providers.checksum(blob), None,
                                 time.time())
        with self._locked(self._lock):
            res.check_open(self)
            try:
                self._index.commit(res.key, node)
            finally:
                res._finish("sealed" if res.key in self._index.nodes else "aborted")
            self._data[res.key] = blob
            self._n["seals"] += 1

    def abort(self, reservation: Reservation) -> None:
        if not isinstance(reservation, _DictReservation) or reservation.provider is not self:
            raise hk.errors.ReservationError("not a reservation of this provider")
        with self._locked(self._lock):
            if reservation.state != "open":
                return  # aborting twice, or after seal, is a no-op
            self._index.cancel(reservation.key)
            self._n["aborts"] += 1
            reservation._finish("aborted")

    # -- reads -------------------------------------------------------------------------------
    def read(self, key: bytes, out: object, span: ByteSpan | None = None) -> bool:
        k = self._key(key)
        if span is not None and not isinstance(span, ByteSpan):
            raise hk.InvalidArgumentError("span must be a ByteSpan")
        with self._locked(self._lock):
            node = self._index.get(k)
            if node is None:
                self._n["misses"] += 1
                return False
            span = ByteSpan.whole(node.nbytes) if span is None else span.validate(node.nbytes)
            dst = hk.providers.writable_buffer(out, span.nbytes)
            blob = self._data[k]
            if hk.providers.checksum(blob) != node.checksum:  # never hand out wrong bytes
                for dropped in self._index.drop(k):
                    del self._data[dropped.key]
                self._n["checksum_failures"] += 1
                self._n["misses"] += 1
                return False
            self._index.touch(node)
            self._n["hits"] += 1
        dst[:] = memoryview(blob)[span.offset : span.end]  # bytes objects are immutable: no lock
        return True

    # -- eviction ----------------------------------------------------------------------------
    def evict(self, keys: Sequence[bytes] | None = None, *, nbytes: int = 0) -> EvictReport:
        if (keys is None) == (not nbytes):
            raise hk.InvalidArgumentError("give exactly one of keys or nbytes")
        if type(nbytes) is not int or nbytes < 0:
            raise hk.InvalidArgumentError(f"nbytes must be a non-negative int, got {nbytes!r}")
        ks = self._keys(keys) if keys is not None else None
        with self._locked(self._lock):
            if ks is not None:
                removed, skipped = self._index.evict_keys(ks)
            else:
                removed, skipped = self._index.evict_cost(nbytes), 0
            for node in removed:
                del self._data[node.key]
            return EvictReport(len(removed), sum(n.nbytes for n in removed), skipped)

    # -- anchors -----------------------------------------------------------------------------
    def put_anchor(self, key: bytes, name: str, data: object) -> None:
        k = self._key(key)
        hk.providers.check_anchor_name(name)
        blob = bytes(hk.providers.readable_bytes(data))
        with self._locked(self._lock):
            node = self._index.get(k)
            if node is None:
                raise hk.errors.UnknownKeyError(f"entry {k.hex()[:16]} is not stored")
            anchors = node.anchors if node.anchors is not None else {}
            old = anchors.get(name)
            for dropped in self._index.add_cost(node, len(blob) - (len(old) if old is not None else 0)):
                del self._data[dropped.key]
            anchors[name] = blob
            node.anchors = anchors

    def get_anchor(self, key: bytes, name: str) -> bytes | None:
        k = self._key(key)
        hk.providers.check_anchor_name(name)
        with self._locked(self._lock):
            node = self._index.get(k)
            return None if node is None or not node.anchors else node.anchors.get(name)

    def list_anchors(self, key: bytes) -> dict[str, int]:
        k = self._key(key)
        with self._locked(self._lock):
            node = self._index.get(k)
            return {n: len(b) for n, b in (node.anchors or {}).items()} if node is not None else {}

    # -- leases ------------------------------------------------------------------------------
    def lease(self, keys: Sequence[bytes]) -> Lease:
        ks = self._keys(keys)
        with self._locked(self._lock):
            held = self._index.hold_keys(ks)
            return Lease(self, ks, [n is not None for n in held], token=held)

    def _release_lease(self, lease: Lease) -> None:
        if self._closed or os.getpid() != self._pid:
            return  # nothing to unpin after close; never touch a lock inherited through fork
        with self._lock:
            if not self._closed:
                self._index.release_nodes(lease.token)  # type: ignore[arg-type]

    # -- the rest ----------------------------------------------------------------------------
    def stats(self) -> ProviderStats:
        with self._locked(self._lock):
            idx, n = self._index, self._n
            return ProviderStats(
                name=self.name, entries=len(idx.nodes), used_bytes=idx.used, budget_bytes=self._budget,
                anchors=sum(len(n.anchors or ()) for n in idx.nodes.values()),
                leased=sum(1 for n in idx.nodes.values() if n.hold), in_flight=len(idx.flights),
                evictions=idx.evictions, evicted_bytes=idx.evicted_cost, hits=n["hits"], misses=n["misses"],
                seals=n["seals"], aborts=n["aborts"], dedup=n["dedup"], checksum_failures=n["checksum_failures"],
            )

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "medium": "python dict"}

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._data.clear()
