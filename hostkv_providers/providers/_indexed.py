"""``IndexedProvider``: the driver base for a medium without an index of its own.

Every driver of :class:`~hostkv_providers.providers.Provider` is implemented here over one
:class:`~hostkv_providers.providers.TreeIndex` and one lock — the tree, LRU-leaf eviction, the
budget guard, leases, anchors (in memory), retained entries, the checksum of every entry — and a
subclass only moves bytes: :meth:`~IndexedProvider._store`, :meth:`~IndexedProvider._load` and
:meth:`~IndexedProvider._discard`.  Writes land in a private buffer until the seal (two-phase:
nothing is visible before it).  ``examples/custom_provider`` (``dict://``) is a complete provider
on it in a few dozen lines.
"""

from __future__ import annotations

import abc
import os
import threading
import warnings
from collections.abc import Iterator, Sequence

from hostkv_providers._checks import check_retain_share, writable_buffer
from hostkv_providers._checksum import checksum
from hostkv_providers._errors import InvalidArgumentError, UnknownKeyError
from hostkv_providers._keys import Key
from hostkv_providers._provider import Corrupt, Provider
from hostkv_providers._reports import EntryInfo, EvictReport, ProviderStats
from hostkv_providers._reservation import Lease, Reservation
from hostkv_providers._span import ByteSpan
from hostkv_providers.providers._tree import TreeIndex

__all__ = ["IndexedProvider"]


class _BufferedReservation(Reservation):
    __slots__ = ("buf",)
    buf: bytearray


class IndexedProvider(Provider):
    """A provider whose tree lives in an in-process :class:`TreeIndex`; subclasses store the
    sealed bytes (see the module docstring).  Not persistent: the index is in memory.

    Parameters
    ----------
    budget_bytes:
        The byte budget (entry bytes plus anchor bytes).
    retain_share:
        The fraction of the budget that retained entries (``SupportsRetain``) may hold.
    """

    _reservation_type = _BufferedReservation

    def __init__(self, budget_bytes: int, *, retain_share: float = 0.5) -> None:
        super().__init__()
        if type(budget_bytes) is not int or budget_bytes <= 0:
            raise InvalidArgumentError(f"budget must be a positive int, got {budget_bytes!r}")
        self._budget = budget_bytes
        self._retain_share = check_retain_share(retain_share)
        self._lock = threading.RLock()
        self._index = TreeIndex(budget_bytes)

    # -- the medium (a subclass implements these three) ------------------------------------------
    @abc.abstractmethod
    def _store(self, key: Key, data: bytes) -> None:
        """Keep the sealed bytes of ``key`` (called under the lock, once per seal)."""

    @abc.abstractmethod
    def _load(self, key: Key) -> bytes | memoryview | None:
        """The bytes stored for ``key`` (called under the lock; checked against the seal's
        checksum before anything is copied out)."""

    @abc.abstractmethod
    def _discard(self, keys: Sequence[Key]) -> None:
        """Forget the bytes of ``keys`` (evicted or dropped; called under the lock)."""

    # -- the drivers -----------------------------------------------------------------------------
    @property
    def budget_bytes(self) -> int:
        return self._budget

    def _present(self, keys: Sequence[bytes]) -> list[bool]:
        with self._locked(self._lock):  # validates the keys that miss (a hit is a stored key)
            return self._membership(keys, self._index.contains_fn)

    def _in_flight(self, key: Key) -> bool:
        with self._locked(self._lock):
            return key in self._index.flights

    def _info(self, row: int) -> EntryInfo:
        idx = self._index
        anchors = {n: len(b) for n, b in idx.anchors.get(row, {}).items()}
        return EntryInfo(idx.key_of(row), idx.parent_key(row), int(idx.nbytes[row]), idx.tag_of(row),
                         idx.checksum_of(row), float(idx.created[row]), float(idx.used[row]), anchors,
                         bool(idx.retained[row]))

    def _entry(self, key: Key) -> EntryInfo | None:
        with self._locked(self._lock):
            row = self._index.row_of(key)
            return None if row < 0 else self._info(row)

    def iter_entries(self) -> Iterator[EntryInfo]:
        """Every sealed entry (a snapshot taken under the lock)."""
        with self._locked(self._lock):
            return iter([self._info(int(r)) for r in self._index.live_rows()])

    def _reserve(self, key: Key, parent: Key | None, nbytes: int, salt_tag: str) -> Reservation | None:
        with self._locked(self._lock):
            fresh, evicted, _ = self._index.begin(key, parent, nbytes)  # the tree rules' typed errors
            self._remove_rows(evicted)
        if not fresh:
            return None
        res = _BufferedReservation(self, key, parent, nbytes, salt_tag)
        res.buf = bytearray(nbytes)
        return res

    def _write(self, res: _BufferedReservation, span: ByteSpan, data: memoryview) -> None:
        res.buf[span.offset : span.end] = data  # private to its writer until the seal: no lock

    def _seal(self, res: _BufferedReservation) -> None:
        blob = bytes(res.buf)
        digest = checksum(blob)
        with self._locked(self._lock):
            res.check_open(self)
            # The bytes first, then the index entry: a medium that fails (disk full, I/O error)
            # leaves nothing published — committed first, the entry was visible with no bytes
            # (present, chained under, then dropped with its subtree at the first read).
            try:
                self._store(res.key, blob)
            except BaseException:
                self._index.cancel(res.key)
                res._finish("aborted")
                raise
            try:  # raises UnknownKeyError if the parent was dropped meanwhile
                self._index.commit(res.key, nbytes=res.nbytes, csum=digest, tag=res.salt_tag)
            except UnknownKeyError:
                res._finish("aborted")
                self._forget_bytes([res.key])
                raise
            res._finish("sealed")

    def _abort(self, res: _BufferedReservation) -> bool:
        with self._locked(self._lock):
            if res.state != "open":
                return False
            self._index.cancel(res.key)
            res._finish("aborted")
            return True

    def _read(self, key: Key, out: object, span: ByteSpan | None) -> int | Corrupt | None:
        with self._locked(self._lock):
            idx = self._index
            row = idx.row_of(key)
            if row < 0:
                return None
            nbytes = int(idx.nbytes[row])
            span = ByteSpan.whole(nbytes) if span is None else span.validate(nbytes)
            dst, blob = writable_buffer(out, span.nbytes), self._load(key)
            if blob is None or checksum(blob) != idx.checksum_of(row):
                return Corrupt((row, int(idx.gen[row])))  # the front drops it, counts it, reports a miss
            dst[:] = memoryview(blob)[span.offset : span.end]
            idx.touch(row)
            return span.nbytes

    def _drop_damaged(self, key: Key, token: object) -> bool:
        with self._locked(self._lock):
            if not isinstance(token, tuple) or not self._index.is_live(*token):
                return False  # another reader dropped it first
            self._remove_rows(self._index.drop(token[0]))
            return True

    def _evict(self, keys: list[Key] | None, nbytes: int) -> EvictReport:
        with self._locked(self._lock):
            removed, freed, skipped = self._index.evict_for(keys, nbytes)
            self._remove_rows(removed)
            return EvictReport(len(removed), freed, skipped)

    def _remove_rows(self, rows: Sequence[int]) -> None:
        """Rows the index removed: let the rows be reused, forget their anchors and bytes.

        The index first: a ``_discard`` that raises (a failing medium) then leaks bytes no
        entry names (a later seal of the key writes over them) instead of leaving the rows, or a
        reservation begun in the same call, in the index for good."""
        if rows:
            keys = [self._index.key_of(r) for r in rows]
            anchors = self._index.anchors
            if anchors:
                for r in rows:
                    anchors.pop(r, None)
            self._index.recycle(rows)
            self._forget_bytes(keys)

    def _forget_bytes(self, keys: list[Key]) -> None:
        """``_discard`` whose failure is a warning: the index no longer names these bytes."""
        try:
            self._discard(keys)
        except Exception as exc:  # (a medium's own error, whatever its type)
            warnings.warn(f"{type(self).__name__}: discarding {len(keys)} entries' bytes failed ({exc!r}); "
                          "they stay on the medium, unreachable, until written over", ResourceWarning, stacklevel=3)

    def _put_anchor(self, key: Key, name: str, blob: bytes) -> None:
        with self._locked(self._lock):
            idx = self._index
            row = idx.row_of(key)
            if row < 0:
                raise UnknownKeyError(f"entry {key.hex()[:16]} is not stored", hint="seal the page before its anchors")
            old = idx.anchors.get(row, {}).get(name, b"")
            self._remove_rows(idx.add_cost(row, len(blob) - len(old), int(self._retain_share * self._budget)))
            idx.anchors.setdefault(row, {})[name] = blob

    def _get_anchor(self, key: Key, name: str) -> bytes | None:
        with self._locked(self._lock):
            blob: bytes | None = self._index.anchors.get(self._index.row_of(key), {}).get(name)
            return blob

    def _list_anchors(self, key: Key) -> dict[str, int]:
        with self._locked(self._lock):
            return {n: len(b) for n, b in self._index.anchors.get(self._index.row_of(key), {}).items()}

    def _lease(self, keys: list[Key]) -> Lease:
        with self._locked(self._lock):
            idx = self._index
            rows = idx.rows_of(keys)
            live = [r for r in rows if r >= 0]
            idx.hold_rows(live)
            return Lease(self, keys, [r >= 0 for r in rows], token=(live, [int(idx.gen[r]) for r in live]))

    def _release_lease(self, lease: Lease) -> None:
        if self._closed or os.getpid() != self._pid:
            return  # nothing to unpin after close; never touch a lock inherited through fork
        with self._lock:
            if not self._closed:
                token: tuple[list[int], list[int]] = lease.token  # type: ignore[assignment]  # ours
                self._index.release_rows(*token)

    # -- retained entries (SupportsRetain) -------------------------------------------------------
    def retain(self, keys: Sequence[bytes]) -> int:
        """Mark entries retained (see ``SupportsRetain``)."""
        ks = self._keys(keys)
        with self._locked(self._lock):
            rows = self._index.rows_of(ks)
            for k, r in zip(ks, rows, strict=True):
                if r < 0:
                    raise UnknownKeyError(f"entry {k.hex()[:16]} is not stored; nothing was retained")
            return self._index.retain_rows(rows, int(self._retain_share * self._budget))

    def unretain(self, keys: Sequence[bytes]) -> int:
        """Clear retain marks (keys not marked or not stored are ignored)."""
        ks = self._keys(keys)
        with self._locked(self._lock):
            return self._index.unretain_rows(self._index.rows_of(ks))

    # -- the rest --------------------------------------------------------------------------------
    def stats(self) -> ProviderStats:
        with self._locked(self._lock):
            return ProviderStats(name=self.name, budget_bytes=self._budget, **self._index.stats_fields(),
                                 **self._tallies())

    def close(self) -> None:
        self._check_not_forked()  # a forked child must not clear the parent's store
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._discard([self._index.key_of(int(r)) for r in self._index.live_rows()])
