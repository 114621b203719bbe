"""The lmdb provider's batch path (``put_many``/``read_many``, :class:`~hostkv_providers.SupportsBatch`).

``put_many`` stores a chunk of pages with the per-page protocol of ``reserve``/``write``/``seal``
(see the provider's module docstring) but pays the per-call costs once per chunk:

1. one write transaction reserves every page of the chunk (dedup, in-flight and parent checks,
   eviction, slot allocation, a flight record per page); a parent may be an earlier page of the
   same chunk (reserved in the same transaction: a flight, not yet an entry);
2. every slot's header is zeroed before any of its bytes change, then the pages go out with one
   ``pwritev`` per run of adjacent slots, each hashed (XXH3-64) from the caller's buffer right
   before it is written, then each slot header (data first, then the header that vouches for it);
3. with ``durability=sync`` one ``fdatasync`` per slot file touched, then one write transaction
   turns every flight into an entry, root first (with ``sync``: one index sync).

Crash safety is the single path's: a crash before step 3 commits leaves flights of a dead owner
(reclaimed on open or when in the way) and slots whose headers were zeroed or describe bytes no
entry points at; the commit of step 3 is atomic, so a chunk's pages appear together, root first
within the transaction.  Pages held by a reservation of this chunk: a stored parent is held (as
``reserve`` holds it) from step 1 until its child's seal in step 3; a parent from the chunk is a
flight until then, which eviction never touches.

``read_many`` looks every key up in one read transaction, then reads slot entries with
:meth:`SlotFile.read_runs_into` (header, ``preadv`` per run of adjacent slots, XXH3 of the output,
header again) and inline entries from the same snapshot; a checksum mismatch is confirmed in a
write transaction and drops the entry with its subtree, as ``read`` does.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from hostkv_providers._checks import writable_buffer
from hostkv_providers._checksum import checksum
from hostkv_providers._errors import (
    CapacityError,
    HostKVError,
    InFlightError,
    InvalidArgumentError,
    ReservationError,
    StorageIOError,
    UnknownKeyError,
)
from hostkv_providers._keys import Key
from hostkv_providers.providers._slotfile import ReadResult, SlotFile

from ._format import _TAG_MAX, _BadRecord, _crash, _Entry, _Flight, _slot_nbytes
from ._gate import _alive
from ._txn import _Tx

if TYPE_CHECKING:
    from ._provider import LmdbProvider

#: pages per reservation/seal transaction pair: large enough that the two commits (and, with
#: ``durability=sync``, the syncs) are paid rarely, small enough that a chunk's flights do not
#: pin much of the budget at once
PUT_CHUNK = 64

# one reserved page of a chunk: (position in the chunk, key, parent, data, generation, file id, slot)
_Slot = tuple[int, Key, "Key | None", memoryview, int, int, int]


def put_many(p: LmdbProvider, items: Sequence[tuple[bytes, bytes | None, object]],
             salt_tag: str) -> list[bool | HostKVError]:
    p._writable("put_many")
    checked = p._put_many_args(items, salt_tag, tag_max=_TAG_MAX)
    p._check_usable()
    out: list[bool | HostKVError] = []
    failed: set[Key] = set()  # keys that failed in this call: their children fail too
    for lo in range(0, len(checked), PUT_CHUNK):
        out += _put_chunk(p, checked[lo : lo + PUT_CHUNK], salt_tag, failed)
    return out


def _reserve_op(p: LmdbProvider, items: Sequence[tuple[Key, Key | None, memoryview]],
                failed: set[Key]) -> Callable[[_Tx], list[tuple[int, int, int] | HostKVError | None]]:
    """Step 1 as a transaction function: per item ``None`` (dedup), ``(gen, fid, slot)`` or an
    error.  Pure over its transaction (it may be re-run after a map resize): all state is local;
    ``failed`` is only read here."""
    owner, ttl, inline_max = p._owner, p._lease_ttl, p._inline_max

    def op(tx: _Tx) -> list[tuple[int, int, int] | HostKVError | None]:
        got: list[tuple[int, int, int] | HostKVError | None] = []
        mine: dict[Key, int] = {}  # reserved in this transaction: key -> generation
        bad: set[Key] = set(failed)
        entries, flights = tx.db["entries"], tx.db["flights"]
        for k, parent, view in items:
            nbytes = view.nbytes
            if parent is not None and parent in bad:
                bad.add(k)
                got.append(UnknownKeyError(f"parent {parent.hex()[:16]} failed earlier in this put_many"))
                continue
            if k in mine:
                bad.add(k)
                got.append(InFlightError(f"key {k.hex()[:16]} appears twice in this put_many", key=k))
                continue
            if tx.t.get(k, db=entries) is not None:
                got.append(None)
                continue
            fl = tx.flight(k)
            if fl is not None:
                if _alive(fl.owner):
                    bad.add(k)
                    got.append(InFlightError(f"key {k.hex()[:16]} is being written by another writer", key=k))
                    continue
                tx.drop_flight(k, fl)  # its writer died: the key is free again
            pe: _Entry | None = None
            pgen = 0
            if parent is not None:
                if parent in mine:
                    pgen = mine[parent]
                else:
                    pe = tx.get_or_drop(parent)
                    if pe is None:
                        bad.add(k)
                        got.append(UnknownKeyError(f"parent {parent.hex()[:16]} is not stored"))
                        continue
                    pgen = pe.gen
            if nbytes > tx.c.budget:
                bad.add(k)
                got.append(CapacityError(f"{nbytes} bytes exceed the whole budget of {tx.c.budget}"))
                continue
            if pe is not None:
                tx.hold(pe)  # first, so that making room cannot evict the parent
            try:
                tx.make_room(nbytes)
            except CapacityError as exc:
                if pe is not None:
                    tx.unhold(pe)  # make_room evicted nothing: pe is still the record we held
                bad.add(k)
                got.append(exc)
                continue
            fid, slot = (0, 0) if nbytes <= inline_max else tx.alloc_slot(_slot_nbytes(nbytes))
            tx.c.gen += 1
            now = time.time()
            tx.t.put(k, _Flight(owner, parent, pgen, nbytes, nbytes, tx.c.gen, fid, slot, now, now + ttl).pack(),
                     db=flights)
            tx.c.used += nbytes
            mine[k] = tx.c.gen
            got.append((tx.c.gen, fid, slot))
        return got

    return op


def _abort_all(p: LmdbProvider, slots: Sequence[_Slot]) -> None:
    """Drop the flights of a chunk's reservations (best effort: a failure leaves them to the
    dead-owner reclaim of a later open)."""
    if not slots:
        return
    abort_ops = [p._abort_op(s[1], s[4]) for s in slots]

    def op(tx: _Tx) -> None:
        for a in reversed(abort_ops):  # children first: each releases its hold on its parent
            a(tx)

    with contextlib.suppress(HostKVError):
        p._s.submit(op, frees=True)


def _put_chunk(p: LmdbProvider, items: Sequence[tuple[Key, Key | None, memoryview]], salt_tag: str,
               failed: set[Key]) -> list[bool | HostKVError]:
    results: list[bool | HostKVError] = [False] * len(items)
    got = p._s.submit(_reserve_op(p, items, failed))
    if any(isinstance(g, CapacityError) for g in got) and p._s.reclaim_dead():
        # a dead process's leases or reservations were in the way: give this chunk's
        # reservations back and try once more with them reclaimed
        _abort_all(p, [(i, items[i][0], None, items[i][2], g[0], g[1], g[2])
                       for i, g in enumerate(got) if isinstance(g, tuple)])
        got = p._s.submit(_reserve_op(p, items, failed))
    _crash("lmdb.reserve.after_commit")
    slots: list[_Slot] = []
    dedup = 0
    for i, g in enumerate(got):
        k, parent, view = items[i]
        if g is None:
            dedup += 1
        elif isinstance(g, HostKVError):
            failed.add(k)
            results[i] = g
        else:
            slots.append((i, k, parent, view, g[0], g[1], g[2]))
    if dedup:
        p._tally("dedup", dedup)
    if not slots:
        return results
    blobs: dict[int, bytes] = {}  # inline pages: position -> bytes
    digests: dict[int, int] = {}
    files: dict[int, SlotFile] = {}
    try:
        by_file: dict[int, list[_Slot]] = {}
        for s in slots:
            if s[5]:
                by_file.setdefault(s[5], []).append(s)
            else:
                blob = bytes(s[3])
                blobs[s[0]] = blob
                digests[s[0]] = checksum(blob)
        for fid, group in by_file.items():
            sf = files[fid] = p._s.slot_file(fid)
            # Invalidate every slot's header before any byte of it changes, so neither a stale
            # record nor a reader in another process can accept a half-overwritten slot.
            sf.begin_write_runs([(s[6], 1) for s in group])
            got_d: list[int] = []
            sf.write_runs([(s[6], s[3].nbytes, s[3]) for s in group], got_d)
            for s, d in zip(group, got_d, strict=True):
                digests[s[0]] = d
            # data first, then the header that vouches for it
            for s in group:
                sf.write_header_of(s[6], s[1], s[2], s[4], s[3].nbytes, digests[s[0]])
        _crash("lmdb.seal.after_header")
    except BaseException:
        _abort_all(p, slots)
        raise
    seals = [(s[0], s[1], s[4], s[5], s[6], s[3].nbytes, digests[s[0]], blobs.get(s[0])) for s in slots]
    chunk_keys = {s[1] for s in slots}

    def op(tx: _Tx) -> list[HostKVError | None]:
        out: list[HostKVError | None] = []
        sealed: set[Key] = set()
        for _, k, gen, fid, slot, nbytes, digest, blob in seals:
            fl = tx.flight(k)
            if fl is None or fl.gen != gen:
                out.append(ReservationError(f"the reservation for {k.hex()[:16]} no longer exists",
                                            hint="it was reclaimed; store the page again"))
                continue
            tx.t.delete(k, db=tx.db["flights"])
            if fl.parent is not None:
                pe = tx.get_or_drop(fl.parent)
                if pe is None or pe.gen != fl.parent_gen:
                    tx.c.used -= fl.cost
                    if fl.parent not in chunk_keys:  # only a stored parent was held
                        tx.unhold_gone(fl.parent, fl.parent_gen)
                    if fid:
                        tx.free_slot(fid, slot)
                    out.append(UnknownKeyError(f"parent {fl.parent.hex()[:16]} was dropped before the seal",
                                               hint="save the chain again from its first missing page"))
                    continue
                was = pe.evictable
                pe.children += 1
                if fl.parent not in sealed:  # a stored parent: its reservation's hold ends here
                    pe.hold = max(0, pe.hold - 1)
                if was:  # a parent sealed just before in this transaction was a leaf
                    tx.t.delete(pe.lru_key, db=tx.db["lru"])
                tx.put(pe)  # not a leaf any more: it stays out of the LRU list
            e = _Entry(k, fl.parent, nbytes, fl.cost, digest, time.time(), tx.next_tick(), gen, fid, slot, salt_tag)
            tx.insert(e)
            if blob is not None:
                tx.t.put(k, blob, db=tx.db["pages"])
            tx.c.sealed += fl.cost
            sealed.add(k)
            out.append(None)
        return out

    try:
        errs = p._s.submit(op, durable=True, sync_files=tuple(files.values()))
    except BaseException:
        # R7: a failed sync or commit fails the chunk for good; give the space back
        _abort_all(p, slots)
        raise
    nbytes_written = 0
    nseals = 0
    for s, err in zip(slots, errs, strict=True):
        if err is None:
            results[s[0]] = True
            nbytes_written += s[3].nbytes
            nseals += 1
        else:
            failed.add(s[1])
            results[s[0]] = err
    p._tally("seals", nseals)
    p._tally("bytes_written", nbytes_written)
    return results


def read_many(p: LmdbProvider, keys: Sequence[bytes], outs: Sequence[object]) -> list[bool]:
    ks = p._keys(keys)
    try:
        n_outs = -1 if isinstance(outs, (bytes, bytearray, memoryview)) else len(outs)
    except TypeError:
        n_outs = -1
    if n_outs != len(ks):
        raise InvalidArgumentError(f"{len(ks)} keys need a sequence of as many output buffers")
    p._check_usable()
    results = [False] * len(ks)
    bad: InvalidArgumentError | None = None
    # per slot file: (slot, out, key, generation, nbytes, checksum) and the key's position
    reads: dict[int, list[tuple[int, memoryview, bytes, int, int, int]]] = {}
    where: dict[int, list[int]] = {}
    suspect: list[tuple[int, Key, int | None]] = []  # position, key, generation of a failed read
    nread = 0
    s = p._s
    with s.read(buffers=True) as txn:
        entries, pages = s.dbs["entries"], s.dbs["pages"]
        for i, k in enumerate(ks):
            raw = txn.get(k, db=entries)
            if raw is None:
                continue
            try:
                e = _Entry.unpack(k, raw)
            except _BadRecord:
                suspect.append((i, k, None))
                continue
            try:
                dst = writable_buffer(outs[i], e.nbytes)
            except InvalidArgumentError as exc:
                bad = bad or exc
                continue
            if e.file_id == 0:
                blob = txn.get(k, db=pages)
                if blob is not None and len(blob) == e.nbytes and checksum(blob) == e.checksum:
                    dst[:] = blob
                    results[i] = True
                    nread += e.nbytes
                else:
                    suspect.append((i, k, e.gen))
                continue
            if e.file_id not in reads:
                reads[e.file_id], where[e.file_id] = [], []
            reads[e.file_id].append((e.slot, dst, k, e.gen, e.nbytes, e.checksum))
            where[e.file_id].append(i)
    for fid, batch in reads.items():
        try:
            got = s.slot_file(fid).read_runs_into(batch, verify=True)
        except (StorageIOError, HostKVError):
            got = [ReadResult.STALE] * len(batch)  # a file compacted away meanwhile, or damaged
        for i, r, rd in zip(where[fid], got, batch, strict=True):
            if r is ReadResult.OK:
                results[i] = True
                nread += rd[4]
            else:
                suspect.append((i, ks[i], rd[3]))
    failures = 0
    for _, k, gen in suspect:
        # confirmed in a write transaction (a slot another process freed and reused is a plain
        # miss there, never a false corruption)
        if p._drop_damaged(k, gen):
            failures += 1
    if not p._readonly:
        for i, ok in enumerate(results):
            if ok:
                s.touch(ks[i])
    hits = sum(results)
    p._tally("hits", hits)
    p._tally("misses", len(ks) - hits)
    p._tally("bytes_read", nread)
    p._tally("checksum_failures", failures)
    if bad is not None:
        raise bad
    return results
