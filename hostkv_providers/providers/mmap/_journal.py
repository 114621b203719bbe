"""The mmap store's index journal: append, buffered ``durability=none`` flushes and the group commit."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import xxhash

from hostkv_providers._errors import (
    StorageIOError,
)
from hostkv_providers.providers import _fsutil

from ._alloc import _Allocation
from ._base import _Pending
from ._format import (
    _JOURNAL_CHUNK,
    _JOURNAL_MAGIC,
    _MODE_CODE,
    _NONE_BATCH,
    _NONE_INTERVAL,
    _REC_STRUCT,
    REC_NBYTES,
    fold64_one,
)

if TYPE_CHECKING:
    pass


_log = logging.getLogger(__name__)


class _Journal(_Allocation):
    """The journal and the group commit (a part of :class:`MmapProvider`)."""

    # -- journal ---------------------------------------------------------------------------------
    def _journal_header(self) -> bytes:
        raw = bytearray(REC_NBYTES)
        raw[:8] = _JOURNAL_MAGIC
        raw[8:24] = self._store_id
        raw[24:32] = self._gen.to_bytes(8, "little")
        raw[32] = _MODE_CODE[self._durability]
        raw[152:160] = xxhash.xxh3_64_intdigest(bytes(raw[:152])).to_bytes(8, "little")
        return bytes(raw)

    def _open_journal_for_append(self) -> None:
        path = self._p(self._journal_name(self._gen))
        if not _fsutil.lexists(path, f"looking for {path}"):
            _fsutil.atomic_write(path, self._journal_header(), durable=self._durability != "none")
            self._jvalid_end = REC_NBYTES
        fd = _fsutil.open_private(path, os.O_RDWR)
        self._jfd = fd
        self._jend = self._jvalid_end
        size = _fsutil.check_private_fd(fd, path).st_size
        self._jalloc = size
        if size > self._jend:
            # zero a torn tail so that nothing past the last valid record can ever parse
            _fsutil.write_all(fd, bytes(size - self._jend), self._jend, "truncating the journal's torn tail")
        if self._jalloc < self._jend + _JOURNAL_CHUNK // 2:
            # room for the next records now, so a nearly full disk fails at open, not mid-seal
            new = -(-(self._jend + _JOURNAL_CHUNK) // _JOURNAL_CHUNK) * _JOURNAL_CHUNK
            _fsutil.fallocate(fd, self._jalloc, new - self._jalloc, "preallocating the index journal")
            self._jalloc = new

    def _encode(self, op: int, key: bytes, *, parent: bytes | None = None, tag: bytes = b"", name: bytes = b"",
                file: int = 0, slot: int = 0, nslots: int = 0, nbytes: int = 0, gen: int = 0, checksum: int = 0,
                created: float = 0.0, seq: int = 0, flags: int = 0) -> bytes:
        """One journal record (RECORD_DTYPE layout, packed with struct: no numpy per seal)."""
        if parent is not None:
            flags |= 1
        raw = bytearray(_REC_STRUCT.pack(op, flags, len(tag), len(name), nslots, key, parent or bytes(32),
                                         tag.ljust(16, b"\0"), 0, 0, file, slot, nbytes, gen, checksum, created,
                                         seq))
        if name:
            raw[40 : 40 + len(name)] = name
        return bytes(raw) + fold64_one(bytes(raw)).to_bytes(8, "little")

    def _append(self, records: Sequence[bytes]) -> None:
        """Write records at the journal's end (the page cache: survives kill -9).  Space ahead is
        ``posix_fallocate``-d in 256 KiB steps so a full disk fails *before* a record is torn."""
        if not records:
            return
        fd = self._jfd
        if fd is None:
            raise StorageIOError("the journal is not open for writing")
        blob = b"".join(records)
        need = self._jend + len(blob)
        if need > self._jalloc:
            new = -(-need // _JOURNAL_CHUNK) * _JOURNAL_CHUNK
            _fsutil.fallocate(fd, self._jalloc, new - self._jalloc, "growing the index journal")
            self._jalloc = new
        _fsutil.write_all(fd, blob, self._jend, "appending to the index journal")
        self._jend = need
        self._jrecords += len(blob) // REC_NBYTES  # (an item may be a batch's records joined)

    def _flush_none(self, force: bool = False) -> None:
        """``durability=none``: write buffered records in batches (caller holds the lock)."""
        if self._nbuf and (force or sum(map(len, self._nbuf)) >= _NONE_BATCH * REC_NBYTES
                           or time.monotonic() - self._nbuf_t > _NONE_INTERVAL):
            batch, self._nbuf = self._nbuf, []
            self._nbuf_t = time.monotonic()
            self._append(batch)

    def _journal(self, records: Sequence[bytes]) -> None:
        """Records that need no acknowledgement ordering (drops, anchors in none mode...)."""
        if self._durability == "none":
            self._nbuf.extend(records)
            self._flush_none()
        else:
            self._append(records)

    def _commit(self, record: bytes | Sequence[bytes]) -> None:
        """Make seal records durable per the mode; raise if they could not be (R7).  One
        ``bytes`` may hold many records joined (a ``put_many`` chunk's: one wait for all)."""
        records = [record] if isinstance(record, bytes) else list(record)
        if self._durability == "none":
            with self._lock:
                self._nbuf.extend(records)
                self._flush_none()
            return
        if self._durability == "process":
            with self._lock:
                self._check_failed()
                self._append(records)
            return
        # sync: group commit.  The first waiter leads: it syncs the data files, appends every
        # queued record with one write and syncs the journal once; everyone queued behind that
        # sync shares its outcome.  A failed sync fails them all and poisons the store (R7).
        mine = [_Pending(r) for r in records]
        with self._commit_cv:
            self._queue.extend(mine)
            # Wait until a leader's commit of them is *over* (a leader takes the whole queue at
            # once, so they go together), or until no leader runs and they are still queued:
            # then lead.  "Taken by a leader" is not enough: woken by the previous leader's
            # notify while a new leader was still syncing them, a seal returned before its
            # record was written -- acknowledged, and lost to a kill -9 right then (and not
            # failed by that leader's failed sync, R7).
            while not mine[0].done and (self._leader or mine[0] not in self._queue):
                self._commit_cv.wait()
            if mine[0].done:
                for p in mine:
                    if p.error is not None:
                        raise p.error
                return
            self._leader = True
        batch: list[_Pending] = []
        try:
            if self._commit_window > 0:
                time.sleep(self._commit_window)
            with self._commit_cv:
                batch, self._queue = self._queue, []
            err: BaseException | None = None
            try:
                with self._lock:
                    self._check_failed()
                    files = [self._files[f] for f in sorted(self._dirty_files) if f in self._files]
                    self._dirty_files.clear()
                for sf in files:
                    sf.sync()
                _fsutil.crash_point("mmap.commit.after_data_sync")
                with self._lock:
                    self._check_failed()
                    self._append([p.record for p in batch])
                    fd = self._jfd
                if fd is None:
                    raise StorageIOError("the journal is closed")
                _fsutil.sync_fd(fd, "syncing the index journal")
                with self._lock:
                    self._counters["syncs"] += 1
                    self._counters["group_commits"] += 1
            except BaseException as exc:
                err = exc
                with self._lock:
                    if isinstance(exc, StorageIOError) and self._failed is None:
                        self._failed = str(exc)
            for p in batch:
                p.error = err
        finally:
            with self._commit_cv:
                for p in batch:
                    p.done = True
                if not batch:  # interrupted before taking the queue: withdraw our own records
                    self._queue = [p for p in self._queue if p not in mine]
                self._leader = False
                self._commit_cv.notify_all()
        for p in mine:
            if p.error is not None:
                raise p.error

    def _check_failed(self) -> None:
        if self._failed is not None:
            raise StorageIOError(
                f"an earlier sync of this store failed ({self._failed}); no seal is acknowledged after it",
                hint="close and reopen the store: open re-validates every entry against its slot header")
