"""Audit and repair of an lmdb store's index (``verify``) and its crash-safe compaction."""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import lmdb

from hostkv_providers._errors import CorruptStoreError
from hostkv_providers._keys import Key
from hostkv_providers._reports import Progress
from hostkv_providers.providers import _fsutil
from hostkv_providers.providers._slotfile import (
    ReadResult,
    SlotFile,
)

from ._format import _FILE, _LIMBO, _BadRecord, _Counters, _crash, _Entry, _Flight, _free_key, _slot_path
from ._gate import _lmdb_error

if TYPE_CHECKING:
    from ._env import _Shared
    from ._txn import _Tx


# --------------------------------------------------------------------------------------------
# Audit and repair of the index (verify)
# --------------------------------------------------------------------------------------------



def _pending_slots(txn: Any, dbs: Mapping[str, Any], slots: set[tuple[int, int]]) -> int:
    """Add the slots held by reservations in flight and by limbo entries to ``slots``; return
    the cost the reservations account for."""
    flight_cost = 0
    for _, v in txn.cursor(db=dbs["flights"]):
        with contextlib.suppress(_BadRecord):
            fl = _Flight.unpack(v)
            flight_cost += fl.cost
            if fl.file_id:
                slots.add((fl.file_id, fl.slot))
    for _, v in txn.cursor(db=dbs["limbo"]):
        if len(v) == _LIMBO.size:
            fid, slot, _ = _LIMBO.unpack(v)
            slots.add((fid, slot))
    return flight_cost

def _audit(txn: Any, dbs: Mapping[str, Any]) -> list[str]:
    problems: list[str] = []
    c = _Counters(txn.get(b"counters", db=dbs["meta"]))
    sealed = 0
    children: dict[bytes, int] = {}
    slots: set[tuple[int, int]] = set()
    n_lru_expected = 0
    for k, v in txn.cursor(db=dbs["entries"]):
        try:
            e = _Entry.unpack(k, v)
        except _BadRecord:
            continue  # reported as corrupt by the entry pass
        sealed += e.cost
        if e.parent is not None:
            children[e.parent] = children.get(e.parent, 0) + 1
            if txn.get(e.parent, db=dbs["entries"]) is None:
                problems.append(f"entry {e.key.hex()[:16]} has no parent {e.parent.hex()[:16]}")
        if e.file_id:
            slots.add((e.file_id, e.slot))
        n_lru_expected += e.evictable
    flight_cost = _pending_slots(txn, dbs, slots)
    if sealed != c.sealed or sealed + flight_cost != c.used:
        problems.append(f"accounting: counters say sealed {c.sealed}/used {c.used}, "
                        f"entries sum to {sealed}/{sealed + flight_cost}")
    for k, v in txn.cursor(db=dbs["entries"]):
        with contextlib.suppress(_BadRecord):
            e = _Entry.unpack(k, v)
            if e.children != children.get(bytes(k), 0):
                problems.append(f"entry {e.key.hex()[:16]} counts {e.children} children, has "
                                f"{children.get(bytes(k), 0)}")
    if txn.stat(dbs["lru"])["entries"] != n_lru_expected:
        problems.append(f"LRU list has {txn.stat(dbs['lru'])['entries']} records, {n_lru_expected} evictable leaves")
    free: set[tuple[int, int]] = set()
    for k in txn.cursor(db=dbs["free"]).iternext(values=False):
        free.add((int.from_bytes(k[8:16], "big"), int.from_bytes(k[16:24], "big")))
    both = free & slots
    if both:
        problems.append(f"{len(both)} slots are both free and in use")
    for k, v in txn.cursor(db=dbs["files"]):
        fid = int.from_bytes(k, "big")
        if len(v) != _FILE.size:
            problems.append(f"slot file {fid}: its files record is {len(v)} bytes, not {_FILE.size} (damaged)")
            continue
        _, _, hw = _FILE.unpack(v)
        lost = sum(1 for s in range(hw) if (fid, s) not in slots and (fid, s) not in free)
        if lost:
            problems.append(f"slot file {fid}: {lost} slots neither used nor free")
    return problems


def _free_limbo(tx: _Tx) -> None:
    for k, v in list(tx.t.cursor(db=tx.db["limbo"])):
        tx.t.delete(k, db=tx.db["limbo"])
        if len(v) == _LIMBO.size:
            fid, slot, _ = _LIMBO.unpack(v)
            tx.free_slot(fid, slot)


def _repair_index(tx: _Tx) -> None:
    """Rebuild counters, child counts, the LRU list and the free list from the entries."""
    t, db = tx.t, tx.db
    entries: list[_Entry] = []
    for k, v in t.cursor(db=db["entries"]):
        with contextlib.suppress(_BadRecord):
            entries.append(_Entry.unpack(k, v))
    present = {e.key for e in entries}
    # entries whose parent is gone cannot stay (prefix closure): drop them with their subtrees
    for e in entries:
        if e.parent is not None and e.parent not in present:
            tx.drop(e.key)
    entries = []
    for k, v in t.cursor(db=db["entries"]):
        with contextlib.suppress(_BadRecord):
            entries.append(_Entry.unpack(k, v))
    counts: dict[bytes, int] = {}
    for e in entries:
        if e.parent is not None:
            counts[e.parent] = counts.get(e.parent, 0) + 1
    t.drop(db["lru"], delete=False)
    t.drop(db["children"], delete=False)
    used_slots: set[tuple[int, int]] = set()
    flight_cost = _pending_slots(t, db, used_slots)
    sealed = 0
    for e in entries:
        e.children = counts.get(e.key, 0)
        tx.put(e)
        if e.evictable:
            t.put(e.lru_key, b"", db=db["lru"])
        if e.parent is not None:
            t.put(e.parent + e.key, b"", db=db["children"])
        if e.file_id:
            used_slots.add((e.file_id, e.slot))
        sealed += e.cost
    t.drop(db["free"], delete=False)
    for k, v in t.cursor(db=db["files"]):
        fid = int.from_bytes(k, "big")
        if len(v) != _FILE.size:
            raise CorruptStoreError(f"slot file {fid}: its files record is {len(v)} bytes, not {_FILE.size}",
                                    hint="the store's index is damaged beyond what repair rebuilds: restore it "
                                         "from a copy (hostkv export/import)")
        sn, _, hw = _FILE.unpack(v)
        for s in range(hw):
            if (fid, s) not in used_slots:
                t.put(_free_key(sn, fid, s), b"", db=db["free"])
    tx.c.sealed = sealed
    tx.c.used = sealed + flight_cost


# --------------------------------------------------------------------------------------------
# Compaction
# --------------------------------------------------------------------------------------------


def _store_nbytes(s: _Shared) -> int:
    """Bytes the store occupies: LMDB pages in use (data.mdb is preallocated to the map size)
    plus the slot files."""
    info = s.env.info()
    total = (int(info["last_pgno"]) + 1) * int(s.env.stat()["psize"])
    with contextlib.suppress(OSError):
        for name in os.listdir(s.slot_dir):
            with contextlib.suppress(OSError):
                st = os.lstat(os.path.join(s.slot_dir, name))
                if stat.S_ISREG(st.st_mode):
                    total += st.st_size
    return total


def _compact_slots(s: _Shared, progress: Progress | None) -> int:
    """Move every slot entry into the lowest-numbered files of its size class and delete the
    files left empty.  One move = copy, sync the destination, commit the new location."""
    with s.read() as txn:
        files = {}
        for k, v in txn.cursor(db=s.dbs["files"]):
            if len(v) != _FILE.size:
                raise CorruptStoreError(f"slot file {int.from_bytes(k, 'big')}: its files record is {len(v)} "
                                        f"bytes, not {_FILE.size}", hint="run hostkv verify")
            files[int.from_bytes(k, "big")] = _FILE.unpack(v)
        located: list[tuple[int, int, Key]] = []
        n_entries = txn.stat(s.dbs["entries"])["entries"]
        for k, v in txn.cursor(db=s.dbs["entries"]):
            with contextlib.suppress(_BadRecord):
                e = _Entry.unpack(k, v)
                if e.file_id:
                    located.append((e.file_id, e.slot, e.key))
    by_class: dict[int, list[int]] = {}
    for fid, (sn, _, _) in sorted(files.items()):
        by_class.setdefault(sn, []).append(fid)
    live: dict[int, list[tuple[int, int, Key]]] = {}
    for fid, slot, key in located:
        live.setdefault(files[fid][0], []).append((fid, slot, key))
    done = 0
    total = len(located)
    keep_files: set[int] = set()
    for sn, fids in by_class.items():
        items = live.get(sn, [])
        # the smallest prefix of files (by id) that can hold every live entry of this class
        need, cap, keep = len(items), 0, []
        for fid in fids:
            if cap >= need:
                break
            keep.append(fid)
            cap += files[fid][1]
        keep_files.update(keep)
        targets = [(fid, slot) for fid in keep for slot in range(files[fid][1])]
        occupied = {(fid, slot) for fid, slot, _ in items}
        free_targets = [t for t in targets if t not in occupied]
        movers = [it for it in items if it[0] not in keep]
        pairs = list(zip(movers, free_targets, strict=False))  # targets >= movers by construction
        for lo in range(0, len(pairs), 256):
            chunk = pairs[lo : lo + 256]
            _move_slots(s, chunk)
            done += len(chunk)
            if progress is not None:
                progress(done, total)
        # the kept files: high-water marks at capacity, every unoccupied slot free
        def finish(tx: _Tx, sn: int = sn, keep: list[int] = keep, fids: list[int] = fids) -> None:
            t, db = tx.t, tx.db
            prefix = sn.to_bytes(8, "big")
            cur = t.cursor(db=db["free"])
            while cur.set_range(prefix) and bytes(cur.key())[:8] == prefix:
                cur.delete()
            used: set[tuple[int, int]] = set()
            for k, v in t.cursor(db=db["entries"]):
                with contextlib.suppress(_BadRecord):
                    e = _Entry.unpack(k, v)
                    if e.file_id in keep:
                        used.add((e.file_id, e.slot))
            for fid in keep:
                _, count, _ = files[fid]
                t.put(fid.to_bytes(8, "big"), _FILE.pack(sn, count, count), db=db["files"])
                for slot in range(count):
                    if (fid, slot) not in used:
                        t.put(_free_key(sn, fid, slot), b"", db=db["free"])
            for fid in fids:
                if fid not in keep:
                    t.delete(fid.to_bytes(8, "big"), db=db["files"])
            if keep:
                t.put(b"cur" + prefix, keep[-1].to_bytes(8, "big"), db=db["meta"])
            else:
                t.delete(b"cur" + prefix, db=db["meta"])

        s.submit(finish, durable=True)
        if s.durability != "sync":
            s.env.sync(True)  # the files are about to be deleted: their unregistration must last
        for fid in fids:
            if fid not in keep:
                with s.files_lock:
                    old = s.files.pop(fid, None)
                    if old is not None:
                        old.close()
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(_slot_path(s.slot_dir, fid))
    if progress is not None:
        progress(total, total)  # entries already in place count as done
    return int(n_entries)


def _move_slots(s: _Shared, moves: Sequence[tuple[tuple[int, int, Key], tuple[int, int]]]) -> None:
    """Copy entries to their new slots, sync the destinations, then commit the new locations in
    one transaction (a crash before the commit leaves the old copies authoritative)."""
    with s.read() as txn:
        current: dict[Key, _Entry] = {}
        for (_, _, key), _dst in moves:
            raw = txn.get(key, db=s.dbs["entries"])
            if raw is not None:
                with contextlib.suppress(_BadRecord):
                    current[key] = _Entry.unpack(key, raw)
    touched: dict[int, SlotFile] = {}
    done: list[tuple[Key, int, int, int, int]] = []
    for (fid, slot, key), (dfid, dslot) in moves:
        e = current.get(key)
        if e is None or (e.file_id, e.slot) != (fid, slot):
            continue
        src, dst = s.slot_file(fid), s.slot_file(dfid)
        if src.check(slot, key=key, generation=e.gen, nbytes=e.nbytes, checksum=e.checksum) != ReadResult.OK:
            continue  # damaged: left where it is, for verify to report
        dst.begin_write(dslot, 1)
        dst.write(dslot, e.nbytes, 0, src.data(slot, e.nbytes))
        dst.write_header(dslot, key=key, parent=e.parent, generation=e.gen, nbytes=e.nbytes, checksum=e.checksum)
        touched[dfid] = dst
        done.append((key, fid, slot, dfid, dslot))
    for dst in touched.values():
        dst.sync()  # the copies are durable before the index points at them

    def op(tx: _Tx) -> None:
        for key, fid, slot, dfid, dslot in done:
            cur = tx.get(key)
            if cur is None or (cur.file_id, cur.slot) != (fid, slot):
                continue
            cur.file_id, cur.slot = dfid, dslot
            tx.put(cur)

    s.submit(op, durable=True)


def _compact_env(s: _Shared) -> None:
    """``env.copy(compact=True)`` into a temp directory, then rename its ``data.mdb`` over ours."""
    tmp = os.path.join(s.path, f"{_fsutil.TEMP_MARK}compact-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.mkdir(tmp, 0o700)
    try:
        with s.gate.exclusive():
            try:
                s.env.sync(True)
                s.env.copy(tmp, compact=True)
            except lmdb.Error as exc:
                raise _lmdb_error(exc, "copying the index") from exc
            copied = os.path.join(tmp, "data.mdb")
            os.chmod(copied, 0o600)
            fd = _fsutil.open_private(copied, os.O_RDONLY)
            try:
                _fsutil.sync_fd(fd, "syncing the compacted index", data_only=False)
            finally:
                os.close(fd)
            _crash("lmdb.compact.after_copy")
            map_size = int(s.env.info()["map_size"])
            s.env.close()
            try:
                os.rename(copied, os.path.join(s.path, "data.mdb"))
                _fsutil.fsync_dir(s.path)
                _crash("lmdb.compact.after_swap")
            finally:
                s.env = s._open_env(map_size)
                s.dbs = s._open_dbs()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
