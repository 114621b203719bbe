"""``dict://`` — the smallest complete provider: page bytes in a Python dict (the template).

The front (:class:`hostkv_providers.providers.Provider`) validates arguments, checks close/fork,
counts stats and applies the checksum rule; the tree rules (prefix-closed, leaf-LRU eviction, the
budget guard, leases) live in :class:`~hostkv_providers.providers.TreeIndex`.  What is left is the
medium: the ``_driver`` methods below, each called with validated arguments.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator, Mapping, Sequence

import hostkv_providers as hk
from hostkv_providers import providers as hp

__all__ = ["DictProvider"]


class _DictReservation(hp.Reservation):
    __slots__ = ("buf",)
    buf: bytearray


class DictProvider(hp.Provider):
    """Entries in process memory; budget-bounded; not persistent."""

    name = "dict"
    _reservation_type = _DictReservation

    def __init__(self, budget_bytes: int) -> None:
        super().__init__()
        if type(budget_bytes) is not int or budget_bytes <= 0:
            raise hk.InvalidArgumentError(f"budget must be a positive int, got {budget_bytes!r}")
        self._budget = budget_bytes
        self._lock = threading.RLock()
        self._index = hp.TreeIndex(budget_bytes)
        self._data: dict[hk.Key, bytes] = {}  # the "medium"

    @classmethod
    def from_url(cls, location: str, options: Mapping[str, str]) -> DictProvider:
        opts = hp.Options("dict", options)
        budget = opts.size("budget", 64 << 20)
        opts.finish()
        if location not in ("", "/"):
            raise hk.InvalidArgumentError("dict:// takes no path")
        return cls(budget)

    @property
    def budget_bytes(self) -> int:
        return self._budget

    def _present(self, keys: Sequence[bytes]) -> list[bool]:
        with self._locked(self._lock):  # validates the keys that miss (a hit is a stored key)
            return self._membership(keys, self._index.nodes.__contains__)

    def _in_flight(self, key: hk.Key) -> bool:
        with self._locked(self._lock):
            return key in self._index.flights

    def _entry(self, key: hk.Key) -> hp.EntryInfo | None:
        with self._locked(self._lock):
            n = self._index.get(key)
            return None if n is None else hp.EntryInfo(key, n.parent, n.nbytes, n.salt_tag, n.checksum, n.created,
                                                    n.last_used, {a: len(b) for a, b in (n.anchors or {}).items()})

    def iter_entries(self) -> Iterator[hp.EntryInfo]:
        with self._locked(self._lock):
            keys = list(self._index.nodes)
        return (info for info in map(self.entry, keys) if info is not None)

    def _reserve(self, key: hk.Key, parent: hk.Key | None, nbytes: int, salt_tag: str) -> hp.Reservation | None:
        with self._locked(self._lock):
            fresh, evicted = self._index.begin(key, parent, nbytes)  # the tree rules' typed errors
            self._drop_data(evicted)
            res = _DictReservation(self, key, parent, nbytes, salt_tag) if fresh else None
        if res is not None:
            res.buf = bytearray(nbytes)
        return res

    def _write(self, res: _DictReservation, span: hp.ByteSpan, data: memoryview) -> None:
        res.buf[span.offset : span.end] = data  # private to its writer until the seal: no lock

    def _seal(self, res: _DictReservation) -> None:
        blob = bytes(res.buf)
        node = hp.Node(res.key, res.parent, res.nbytes, 0, res.salt_tag, hp.checksum(blob), None, time.time())
        with self._locked(self._lock):
            res.check_open(self)
            try:
                self._index.commit(res.key, node)  # raises if the parent was dropped meanwhile
            finally:
                res._finish("sealed" if res.key in self._index.nodes else "aborted")
            self._data[res.key] = blob

    def _abort(self, res: _DictReservation) -> bool:
        with self._locked(self._lock):
            if res.state != "open":
                return False
            self._index.cancel(res.key)
            res._finish("aborted")
            return True

    def _read(self, key: hk.Key, out: object, span: hp.ByteSpan | None) -> int | hp.Corrupt | None:
        with self._locked(self._lock):
            node = self._index.get(key)
            if node is None:
                return None
            span = hp.ByteSpan.whole(node.nbytes) if span is None else span.validate(node.nbytes)
            dst, blob = hp.writable_buffer(out, span.nbytes), self._data[key]
            if hp.checksum(blob) != node.checksum:
                return hp.Corrupt(node)  # the front drops it (_drop_damaged), counts it, reports a miss
            self._index.touch(node)
        dst[:] = memoryview(blob)[span.offset : span.end]  # bytes are immutable: no lock needed
        return span.nbytes

    def _drop_damaged(self, key: hk.Key, token: object) -> bool:
        with self._locked(self._lock):
            if self._index.get(key) is not token:
                return False  # another reader dropped it first
            self._drop_data(self._index.drop(key))
            return True

    def _evict(self, keys: list[hk.Key] | None, nbytes: int) -> hp.EvictReport:
        with self._locked(self._lock):
            removed, skipped = self._index.evict_keys(keys) if keys is not None else (self._index.evict_cost(nbytes), 0)
            self._drop_data(removed)
            return hp.EvictReport(len(removed), sum(n.nbytes for n in removed), skipped)

    def _drop_data(self, nodes: list[hp.Node]) -> None:
        for node in nodes:
            del self._data[node.key]

    def _put_anchor(self, key: hk.Key, name: str, blob: bytes) -> None:
        with self._locked(self._lock):
            node = self._index.get(key)
            if node is None:
                raise hk.errors.UnknownKeyError(f"entry {key.hex()[:16]} is not stored")
            anchors = node.anchors if node.anchors is not None else {}
            self._drop_data(self._index.add_cost(node, len(blob) - len(anchors.get(name, b""))))
            anchors[name], node.anchors = blob, anchors

    def _get_anchor(self, key: hk.Key, name: str) -> bytes | None:
        with self._locked(self._lock):
            node = self._index.get(key)
            return None if node is None or not node.anchors else node.anchors.get(name)

    def _list_anchors(self, key: hk.Key) -> dict[str, int]:
        with self._locked(self._lock):
            node = self._index.get(key)
            return {} if node is None else {n: len(b) for n, b in (node.anchors or {}).items()}

    def _lease(self, keys: list[hk.Key]) -> hp.Lease:
        with self._locked(self._lock):
            held = self._index.hold_keys(keys)
            return hp.Lease(self, keys, [n is not None for n in held], token=held)

    def _release_lease(self, lease: hp.Lease) -> None:
        if self._closed or os.getpid() != self._pid:
            return  # nothing to unpin after close; never touch a lock inherited through fork
        with self._lock:
            if not self._closed:
                self._index.release_nodes(lease.token)  # type: ignore[arg-type]

    def stats(self) -> hp.ProviderStats:
        with self._locked(self._lock):
            idx = self._index
            return hp.ProviderStats(
                name=self.name, entries=len(idx.nodes), used_bytes=idx.used, budget_bytes=self._budget,
                anchors=sum(len(n.anchors or ()) for n in idx), leased=sum(1 for n in idx if n.hold),
                in_flight=len(idx.flights), evictions=idx.evictions, evicted_bytes=idx.evicted_cost,
                **self._tallies())

    def close(self) -> None:
        self._check_not_forked()  # a forked child must not clear the parent's store
        with self._lock:
            self._closed = True
            self._data.clear()
