"""Index operations inside one LMDB write transaction (:class:`_Tx`): entries, tree links and
LRU ticks, slot allocation and release, reservations (flights)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from hostkv_providers._errors import (
    CapacityError,
    CorruptStoreError,
    RetainedError,
)
from hostkv_providers._keys import KEY_NBYTES, Key

from ._format import (
    _FILE,
    _LIMBO,
    _RETAIN_PREFIX,
    _BadRecord,
    _Counters,
    _crash,
    _Entry,
    _Flight,
    _free_key,
    _unpack_lease,
)
from ._maintenance import _repair_index

if TYPE_CHECKING:
    from ._env import _Shared


# --------------------------------------------------------------------------------------------
# Index operations inside one write transaction
# --------------------------------------------------------------------------------------------


class _Tx:
    """Typed helpers over one (nested) write transaction; ``save()`` writes the counters back."""

    def __init__(self, shared: _Shared, txn: Any) -> None:
        self.s = shared
        self.t = txn
        self.db = shared.dbs
        self.c = _Counters(txn.get(b"counters", db=shared.dbs["meta"]))
        self.needs_repair = False

    def save(self) -> None:
        if self.needs_repair:
            # A damaged record was removed without knowing its cost, slot or LRU tick: rebuild
            # the derived state (rare: only after corruption of the index itself).
            self.needs_repair = False
            _repair_index(self)
        self.t.put(b"counters", self.c.pack(), db=self.db["meta"])

    # -- entries ---------------------------------------------------------------------------------
    def get(self, key: Key) -> _Entry | None:
        raw = self.t.get(key, db=self.db["entries"])
        return None if raw is None else _Entry.unpack(key, raw)

    def get_or_drop(self, key: Key) -> _Entry | None:
        """The entry, or ``None``; an entry whose record is damaged is dropped with its subtree."""
        try:
            return self.get(key)
        except _BadRecord:
            self.drop(key)
            self.c.checksum_failures += 1
            return None

    def put(self, e: _Entry) -> None:
        self.t.put(e.key, e.pack(), db=self.db["entries"])

    def next_tick(self) -> int:
        self.c.tick += 1
        return self.c.tick

    def hold(self, e: _Entry) -> None:
        if e.evictable:
            self.t.delete(e.lru_key, db=self.db["lru"])
        e.hold += 1
        self.put(e)

    def unhold(self, e: _Entry) -> None:
        e.hold = max(0, e.hold - 1)
        if e.evictable:
            self.t.put(e.lru_key, b"", db=self.db["lru"])
        self.put(e)

    def touch(self, e: _Entry, when: float) -> None:
        was = e.evictable
        if was:
            self.t.delete(e.lru_key, db=self.db["lru"])
        e.tick = self.next_tick()
        e.last_used = when
        if was:
            self.t.put(e.lru_key, b"", db=self.db["lru"])
        self.put(e)

    def apply_touches(self, touches: Mapping[Key, float]) -> None:
        for key, when in sorted(touches.items(), key=lambda kv: kv[1]):
            try:
                e = self.get(key)
            except _BadRecord:
                continue
            if e is not None:
                self.touch(e, when)

    def insert(self, e: _Entry) -> None:
        """Add a new sealed leaf (the caller updated the parent)."""
        self.put(e)
        self.t.put(e.lru_key, b"", db=self.db["lru"])
        if e.parent is not None:
            self.t.put(e.parent + e.key, b"", db=self.db["children"])

    # -- retained entries ------------------------------------------------------------------------
    def set_retained(self, e: _Entry, on: bool) -> None:
        """Mark or unmark ``e``; a retained entry leaves the LRU list (it is never evicted for room)."""
        if e.retained == on:
            return
        if e.evictable:
            self.t.delete(e.lru_key, db=self.db["lru"])
        e.retained = on
        if e.evictable:
            self.t.put(e.lru_key, b"", db=self.db["lru"])
        self.put(e)
        if on:
            self.t.put(_RETAIN_PREFIX + e.key, b"", db=self.db["meta"])
        else:
            self.t.delete(_RETAIN_PREFIX + e.key, db=self.db["meta"])

    def remove(self, e: _Entry, *, evicted: bool) -> None:
        """Delete ``e`` (a leaf: its children are gone) with its bytes, anchors and links."""
        t, db = self.t, self.db
        if e.retained:  # only a drop (corruption) removes a retained entry
            t.delete(_RETAIN_PREFIX + e.key, db=db["meta"])
        t.delete(e.key, db=db["entries"])
        t.delete(e.lru_key, db=db["lru"])
        if e.parent is not None:
            t.delete(e.parent + e.key, db=db["children"])
            try:
                pe = self.get(e.parent)
            except _BadRecord:
                pe = None
            if pe is not None:
                was = pe.evictable
                pe.children = max(0, pe.children - 1)
                if pe.evictable and not was:
                    t.put(pe.lru_key, b"", db=db["lru"])
                self.put(pe)
        cur = t.cursor(db=db["anchors"])
        if cur.set_range(e.key):
            while cur.key()[:KEY_NBYTES] == e.key:
                if not cur.delete():
                    break
        if e.file_id == 0:
            t.delete(e.key, db=db["pages"])
        elif e.hold:
            # Dropped while leased (or under an in-flight child): a reader may hold a zero-copy
            # view of the slot, so it is only freed when the last holder lets go.
            t.put(e.key + e.gen.to_bytes(8, "big"), _LIMBO.pack(e.file_id, e.slot, e.hold), db=db["limbo"])
        else:
            self.free_slot(e.file_id, e.slot)
        self.c.used -= e.cost
        self.c.sealed -= e.cost
        self.c.removals += 1
        if evicted:
            self.c.evictions += 1
            self.c.evicted_bytes += e.cost

    def children_of(self, key: Key) -> list[Key]:
        out: list[Key] = []
        cur = self.t.cursor(db=self.db["children"])
        if cur.set_range(key):
            for k in cur.iternext(values=False):
                if k[:KEY_NBYTES] != key:
                    break
                out.append(Key(bytes(k[KEY_NBYTES:])))
        return out

    def subtree(self, roots: Sequence[Key]) -> list[Key]:
        """Keys of the subtrees under ``roots`` (present ones), every node after its descendants."""
        order: list[Key] = []
        seen: set[Key] = set()
        for root in roots:
            if root in seen or self.t.get(root, db=self.db["entries"]) is None:
                continue
            # iterative post-order: a node is emitted after all of its descendants, also when
            # one root lies inside another root's subtree
            stack: list[tuple[Key, bool]] = [(root, False)]
            while stack:
                k, expanded = stack.pop()
                if expanded:
                    order.append(k)
                    continue
                if k in seen:
                    continue
                seen.add(k)
                stack.append((k, True))
                stack.extend((c, False) for c in self.children_of(k) if c not in seen)
        return order

    def evict_keys(self, keys: Sequence[Key]) -> tuple[int, int, int]:
        removed = freed = skipped = 0
        order = self.subtree(keys)
        if retained_keys(self.t, self.db, limit=1):
            marked = [k for k in order if self.t.get(_RETAIN_PREFIX + k, db=self.db["meta"]) is not None]
            if marked:
                raise RetainedError(
                    f"{len(marked)} entries to evict are retained (e.g. {marked[0].hex()[:16]}) or have retained "
                    "descendants; nothing was evicted")
        for k in order:
            e = self.get_or_drop(k)
            if e is None:
                continue
            if e.hold or e.children or self.t.get(k, db=self.db["flights"]) is not None:
                skipped += 1
                continue
            self.remove(e, evicted=True)
            removed += 1
            freed += e.cost
        return removed, freed, skipped

    def evict_lru(self, need: int) -> tuple[int, int]:
        """Evict least-recently-used unheld leaves until ``need`` bytes are freed (or none left)."""
        removed = freed = 0
        cur = self.t.cursor(db=self.db["lru"])
        while freed < need and cur.first():
            k = Key(bytes(cur.key()[8:]))
            e = self.get_or_drop(k)
            if e is None or not e.evictable or e.lru_key != bytes(cur.key()):
                cur.delete()  # a stale LRU record (repaired here rather than trusted)
                continue
            self.remove(e, evicted=True)
            removed += 1
            freed += e.cost
        return removed, freed

    def make_room(self, cost: int) -> None:
        """Evict LRU leaves so that ``cost`` more bytes fit, or raise ``CapacityError`` having
        evicted nothing (the evictions run in a nested transaction that is rolled back)."""
        over = self.c.used + cost - self.c.budget
        if over <= 0:
            return
        if cost > self.c.budget:
            raise CapacityError(f"{cost} bytes exceed the whole budget of {self.c.budget}")
        self.save()  # the trial transaction starts from this one's current counters
        trial = self.s.env.begin(write=True, parent=self.t)
        inner = _Tx(self.s, trial)
        try:
            _, freed = inner.evict_lru(over)
            if freed < over:
                raise CapacityError(
                    f"{cost} bytes do not fit: budget {self.c.budget}, used {self.c.used}, "
                    f"evictable {freed}")
            inner.save()
        except BaseException:
            trial.abort()
            raise
        trial.commit()
        self.c = _Counters(self.t.get(b"counters", db=self.db["meta"]))

    def drop(self, key: Key) -> int:
        """Force-remove ``key`` and its subtree (a checksum failure), held or not."""
        n = 0
        for k in self.subtree([key]) or [key]:
            try:
                e = self.get(k)
            except _BadRecord:
                self._remove_damaged(k)
                n += 1
                continue
            if e is None:
                continue
            e.children = 0
            self.remove(e, evicted=False)
            n += 1
        return n

    def _remove_damaged(self, key: Key) -> None:
        """Remove an entry whose record cannot be decoded: its parent and location are unknown,
        so find the parent link by a scan (rare) and leave the slot to ``verify(repair=True)``."""
        t, db = self.t, self.db
        self.needs_repair = True
        self.c.removals += 1
        t.delete(key, db=db["entries"])
        t.delete(_RETAIN_PREFIX + key, db=db["meta"])
        t.delete(key, db=db["pages"])
        t.delete(key, db=db["flights"])
        cur = t.cursor(db=db["anchors"])
        if cur.set_range(key):
            while cur.key()[:KEY_NBYTES] == key:
                if not cur.delete():
                    break
        for link in [bytes(k) for k in t.cursor(db=db["children"]).iternext(values=False)]:
            if link[KEY_NBYTES:] == key:
                t.delete(link, db=db["children"])
                try:
                    pe = self.get(Key(link[:KEY_NBYTES]))
                except _BadRecord:
                    pe = None
                if pe is not None:
                    pe.children = max(0, pe.children - 1)
                    if pe.evictable:
                        t.put(pe.lru_key, b"", db=db["lru"])
                    self.put(pe)

    # -- slots -----------------------------------------------------------------------------------
    def file_record(self, file_id: int) -> tuple[int, int, int]:
        raw = self.t.get(file_id.to_bytes(8, "big"), db=self.db["files"])
        if raw is None or len(raw) != _FILE.size:
            raise CorruptStoreError(f"slot file {file_id} is not registered")
        sn, count, hw = _FILE.unpack(raw)
        return int(sn), int(count), int(hw)

    def alloc_slot(self, slot_nbytes: int) -> tuple[int, int]:
        prefix = slot_nbytes.to_bytes(8, "big")
        cur = self.t.cursor(db=self.db["free"])
        if cur.set_range(prefix):
            k = bytes(cur.key())
            if k[:8] == prefix:
                cur.delete()
                return int.from_bytes(k[8:16], "big"), int.from_bytes(k[16:24], "big")
        meta = self.db["meta"]
        raw = self.t.get(b"cur" + prefix, db=meta)
        if raw is not None:
            fid = int.from_bytes(raw, "big")
            sn, count, hw = self.file_record(fid)
            if hw < count:
                self.t.put(fid.to_bytes(8, "big"), _FILE.pack(sn, count, hw + 1), db=self.db["files"])
                return fid, hw
        # A new slot file, created and registered inside this transaction: if it never commits,
        # the file is an orphan that the next creator of this id (or recovery) removes.
        self.c.next_file += 1
        fid = self.c.next_file
        count = max(1, min(self.s.file_nbytes, max(self.c.budget, slot_nbytes)) // slot_nbytes)
        self.s.create_slot_file(fid, slot_nbytes, count)
        _crash("lmdb.slotfile.created")
        self.t.put(fid.to_bytes(8, "big"), _FILE.pack(slot_nbytes, count, 1), db=self.db["files"])
        self.t.put(b"cur" + prefix, fid.to_bytes(8, "big"), db=meta)
        return fid, 0

    def alloc_slots(self, slot_nbytes: int, n: int) -> tuple[list[int], list[int]]:
        """``n`` slots of ``slot_nbytes`` (file ids, slots), the ones :meth:`alloc_slot` called
        ``n`` times would hand out, in the same order: free slots first (one cursor walk), then
        the current file's next unused slots with one update of its high-water mark, then new
        files."""
        fids: list[int] = []
        slots: list[int] = []
        prefix = slot_nbytes.to_bytes(8, "big")
        cur = self.t.cursor(db=self.db["free"])
        if cur.set_range(prefix):
            taken: list[bytes] = []
            key, delete = cur.key, cur.delete
            while len(taken) < n:
                k = bytes(key())
                if k[:8] != prefix or len(k) != 24:
                    break
                taken.append(k)
                if not delete():  # (deletes, then stands on the next record)
                    break
            if taken:
                # the records' (slot size, file id, slot) columns, decoded for the whole chunk at once
                cols = np.frombuffer(b"".join(taken), dtype=">u8").reshape(-1, 3)
                fids += cols[:, 1].tolist()
                slots += cols[:, 2].tolist()
        meta = self.db["meta"]
        while len(fids) < n:
            raw = self.t.get(b"cur" + prefix, db=meta)
            if raw is not None:
                fid = int.from_bytes(raw, "big")
                sn, count, hw = self.file_record(fid)
                take = min(count - hw, n - len(fids))
                if take > 0:
                    self.t.put(fid.to_bytes(8, "big"), _FILE.pack(sn, count, hw + take), db=self.db["files"])
                    fids += [fid] * take
                    slots += range(hw, hw + take)
                    continue
            fid, slot = self.alloc_slot(slot_nbytes)  # a new slot file
            fids.append(fid)
            slots.append(slot)
        return fids, slots

    def free_slot(self, file_id: int, slot: int) -> None:
        try:
            sn = self.file_record(file_id)[0]
        except CorruptStoreError:
            return  # the file is gone (repair): nothing to free
        self.t.put(_free_key(sn, file_id, slot), b"", db=self.db["free"])

    # -- reservations ----------------------------------------------------------------------------
    def flight(self, key: Key) -> _Flight | None:
        raw = self.t.get(key, db=self.db["flights"])
        return None if raw is None else _Flight.unpack(raw)

    def drop_flight(self, key: Key, fl: _Flight) -> None:
        """Forget a reservation: its space, its slot and the hold on its parent."""
        self.t.delete(key, db=self.db["flights"])
        self.c.used -= fl.cost
        if fl.file_id:
            self.free_slot(fl.file_id, fl.slot)
        if fl.parent is not None:
            try:
                pe = self.get(fl.parent)
            except _BadRecord:
                pe = None
            if pe is not None and pe.gen == fl.parent_gen:
                self.unhold(pe)
            else:
                self.unhold_gone(fl.parent, fl.parent_gen)

    def unhold_gone(self, key: Key, gen: int) -> None:
        """A holder of an entry that was dropped lets go: free its slot after the last one."""
        lk = key + gen.to_bytes(8, "big")
        raw = self.t.get(lk, db=self.db["limbo"])
        if raw is None or len(raw) != _LIMBO.size:
            return
        fid, slot, left = _LIMBO.unpack(raw)
        if left <= 1:
            self.t.delete(lk, db=self.db["limbo"])
            self.free_slot(fid, slot)
        else:
            self.t.put(lk, _LIMBO.pack(fid, slot, left - 1), db=self.db["limbo"])

    def release_lease(self, lease_id: bytes) -> int:
        raw = self.t.get(lease_id, db=self.db["leases"])
        if raw is None:
            return 0
        self.t.delete(lease_id, db=self.db["leases"])
        try:
            _, _, held = _unpack_lease(raw)
        except _BadRecord:
            return 1
        for k, gen in held:
            try:
                e = self.get(k)
            except _BadRecord:
                continue
            if e is not None and e.gen == gen and e.hold > 0:
                self.unhold(e)
            else:
                self.unhold_gone(k, gen)
        return 1


def retained_keys(txn: Any, dbs: Mapping[str, Any], limit: int | None = None) -> list[Key]:
    """The retained entries' keys (the meta db's ``_RETAIN_PREFIX`` records), up to ``limit``."""
    out: list[Key] = []
    cur = txn.cursor(db=dbs["meta"])
    if cur.set_range(_RETAIN_PREFIX):
        for k in cur.iternext(values=False):
            if not bytes(k).startswith(_RETAIN_PREFIX):
                break
            out.append(Key(bytes(k[len(_RETAIN_PREFIX):])))
            if limit is not None and len(out) >= limit:
                break
    return out


def covered_cost(txn: Any, dbs: Mapping[str, Any], keys: Sequence[Key]) -> int:
    """Budget bytes of ``keys`` and all their ancestors, each counted once (the retained bytes)."""
    seen: set[Key] = set()
    total = 0
    for k in keys:
        cur: Key | None = k
        while cur is not None and cur not in seen:
            seen.add(cur)
            raw = txn.get(cur, db=dbs["entries"])
            if raw is None:
                break
            try:
                e = _Entry.unpack(cur, raw)
            except _BadRecord:
                break
            total += e.cost
            cur = e.parent
    return total

