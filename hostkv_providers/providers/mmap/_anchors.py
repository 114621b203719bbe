"""Anchors of an mmap store (per-entry named blobs of hybrid models' state): stored in slots like
pages, journaled, read whole or into buffers (a part of :class:`MmapProvider`)."""

from __future__ import annotations

from hostkv_providers._checksum import checksum_parts
from hostkv_providers._errors import (
    InvalidArgumentError,
    UnknownKeyError,
)
from hostkv_providers._keys import Key
from hostkv_providers.providers import _fsutil
from hostkv_providers.providers._slotfile import (
    FLAG_ANCHOR,
    ReadResult,
    run_nslots,
)

from ._format import (
    OP_ANCHOR,
)
from ._index import _Anchor
from ._maintenance import _Maintenance


class _Anchors(_Maintenance):
    """The anchor verbs (a part of :class:`MmapProvider`)."""

    # -- anchors ---------------------------------------------------------------------------------
    def _put_anchor(self, k: Key, name: str, blob: bytes) -> None:
        nbytes = len(blob)
        nslots = run_nslots(nbytes, self._slot)
        cost = nslots * self._slot
        with self._lock:
            self._check_usable()
            self._need_writer("put_anchor")
            self._check_failed()
            idx = self._idx
            row = idx.row_of(k)
            if row < 0:
                raise UnknownKeyError(f"entry {k.hex()[:16]} is not stored", hint="seal the page before its anchors")
            table = idx.anchors.get(row) or {}
            old = table.get(name)
            delta = cost - (old.cost if old is not None else 0)
            self._free_rows_storage(idx.add_cost(row, delta, int(self._retain_share * self._budget)), journal=True)
            try:
                idx._hold(row)
                try:
                    fid, slot = self._allocate(nslots, row)
                finally:
                    idx._unhold(row)
            except BaseException:
                idx.add_cost(row, -delta)
                raise
            gen = self._next_gen
            self._next_gen += 1
            sf = self._files[fid]
            sf.begin_write(slot, nslots)
            sf.write(slot, nbytes, 0, blob)
            digest = sf.checksum(slot, nbytes)
            sf.write_header(slot, key=k, parent=None, generation=gen, nbytes=nbytes, checksum=digest,
                            flags=FLAG_ANCHOR)
            _fsutil.crash_point("mmap.anchor.after_header")
            idx.clock += 1
            rec = self._encode(OP_ANCHOR, k, name=name.encode(), file=fid, slot=slot, nslots=nslots, nbytes=nbytes,
                               gen=gen, checksum=digest, seq=idx.clock)
            self._dirty_files.add(fid)
            self._unfinished += 1  # no snapshot until the table below holds the anchor
        try:
            self._commit(rec)
        except BaseException:
            with self._lock:
                self._unfinished -= 1
                idx.add_cost(row, -delta)
                sf.clear(slot, nslots)
                self._release_run(fid, slot, nslots)
            raise
        with self._lock:
            self._unfinished -= 1
            if not idx.alive[row] or idx.key_of(row) != k:  # evicted meanwhile
                return
            table = idx.anchors.setdefault(row, {})
            prev = table.pop(name, None)
            if prev is not None:
                psf = self._files.get(prev.file)
                if psf is not None:
                    psf.clear(prev.slot, prev.nslots)
                self._release_run(prev.file, prev.slot, prev.nslots)
            table[name] = _Anchor(fid, slot, nslots, nbytes, gen, digest, cost)

    def _get_anchor(self, k: Key, name: str) -> bytes | None:
        with self._lock:
            self._check_usable()
            a = self._anchor_of(k, name)
            if a is None:
                return None
            out = bytearray(a.nbytes)
            return bytes(out) if self._anchor_into(k, name, a, [memoryview(out)]) else None

    def _read_anchor(self, k: Key, name: str, bufs: list[memoryview]) -> int | None:
        with self._lock:
            self._check_usable()
            a = self._anchor_of(k, name)
            if a is None:
                return None
            room = sum(b.nbytes for b in bufs)
            if room < a.nbytes:
                raise InvalidArgumentError(f"the buffers hold {room} bytes, the anchor is {a.nbytes}",
                                           hint="size them with list_anchors(key)[name]")
            return a.nbytes if self._anchor_into(k, name, a, bufs) else None

    def _anchor_of(self, k: Key, name: str) -> _Anchor | None:
        row = self._idx.row_of(k)
        return None if row < 0 else (self._idx.anchors.get(row) or {}).get(name)

    def _anchor_into(self, k: Key, name: str, a: _Anchor, bufs: list[memoryview]) -> bool:
        """Copy anchor ``a`` from its slot file straight into ``bufs`` (in order), verified
        against its checksum (over the copied bytes); a corrupt one is dropped.  Under the lock."""
        sf = self._files[a.file]
        if len(bufs) == 1:
            res = sf.read_into(a.slot, bufs[0][: a.nbytes], key=k, generation=a.gen, nbytes=a.nbytes,
                               checksum=a.checksum, verify=True)
        else:
            res, pos, parts = ReadResult.OK, 0, []
            for b in bufs:
                n = min(b.nbytes, a.nbytes - pos)
                if n <= 0:
                    break
                res = sf.read_into(a.slot, b[:n], key=k, generation=a.gen, nbytes=a.nbytes,
                                   checksum=a.checksum, offset=pos, verify=False)
                if res is not ReadResult.OK:
                    break
                parts.append(b[:n])
                pos += n
            if res is ReadResult.OK and checksum_parts(parts) != a.checksum:
                res = ReadResult.CORRUPT
        if res is ReadResult.OK:
            return True
        self._tally("checksum_failures")
        row = self._idx.row_of(k)
        self._idx.anchors[row].pop(name, None)
        if not self._readonly:
            self._idx.add_cost(row, -a.cost)
            sf.clear(a.slot, a.nslots)
            self._release_run(a.file, a.slot, a.nslots)
        return False

    def _list_anchors(self, k: Key) -> dict[str, int]:
        with self._lock:
            self._check_usable()
            row = self._idx.row_of(k)
            if row < 0:
                return {}
            return {n: a.nbytes for n, a in (self._idx.anchors.get(row) or {}).items()}

    def _deepest_anchor(self, ks: list[Key], name: str) -> int:
        with self._lock:
            self._check_usable()
            best = 0
            for i, k in enumerate(ks):
                row = self._idx.row_of(k)
                if row < 0:
                    break
                if name in (self._idx.anchors.get(row) or {}):
                    best = i + 1
            return best
