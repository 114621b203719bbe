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

A chunk of equal slot pages that fits without evicting (fresh space, slots freed earlier: the
common case) does all three steps inside ONE write transaction instead (:func:`_put_direct`):
while it holds LMDB's write lock no other writer, in this process or another, can take its keys
or slots, so it writes no flight records and commits once; with ``durability=sync`` that is one
slot-file sync, LMDB's commit (which syncs data.mdb's pages) and one index sync per call.  A
chunk that must evict takes the two transactions of steps 1-3, so that the victims' removal is
committed before their slots are overwritten.

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

import xxhash

from hostkv_providers._checks import overlapping, writable_buffer
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

from ._format import (
    _CRC,
    _ENTRY,
    _ENTRY_VERSION,
    _FLIGHT,
    _HAS_PARENT,
    _TAG_MAX,
    _ZERO32,
    _BadRecord,
    _crash,
    _crc32,
    _Entry,
    _Flight,
    _slot_nbytes,
)
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


class _NotPlain(Exception):
    """Raised inside a batch transaction that finds the chunk is not the plain case: the nested
    transaction rolls back (nothing changed) and the chunk goes page by page."""


def put_many(p: LmdbProvider, items: Sequence[tuple[bytes, bytes | None, object]],
             salt_tag: str) -> list[bool | HostKVError]:
    p._writable("put_many")
    keys, parents, views = p._put_many_columns(items, salt_tag, tag_max=_TAG_MAX)
    p._check_usable()
    out: list[bool | HostKVError] = []
    failed: set[Key] = set()  # keys that failed in this call: their children fail too
    # close() waits for the call (it must not release the environment under a chunk between its
    # reservation and its seal: the flights would outlive the handle, issue 16 item 7)
    # durability=sync: a one-transaction chunk that is not the call's last commits without the
    # index sync (LMDB's own commit still syncs its data pages, and the next commit's sync makes
    # this commit's meta page durable too); the call's last durable commit, or one index sync at
    # the end, makes every chunk durable before put_many returns.  Each chunk's slot bytes are
    # still synced before the commit that publishes them.
    deferred = False
    with p._write_call():
        try:
            for lo in range(0, len(keys), PUT_CHUNK):
                hi = lo + PUT_CHUNK
                ks, ps, vs = keys[lo:hi], parents[lo:hi], views[lo:hi]
                last = hi >= len(keys)
                got = None
                if _plain(p, ks, ps, views[lo:hi], failed):
                    got = _put_direct(p, ks, ps, vs, salt_tag, durable=last)
                    if got is not None:
                        deferred = not last  # the last chunk's commit synced the index
                    else:
                        got = _put_batch(p, ks, ps, vs, salt_tag, failed)
                if got is None:
                    got = _put_chunk(p, list(zip(keys[lo:hi], parents[lo:hi], views[lo:hi], strict=True)),
                                     salt_tag, failed)
                out += got
        except BaseException:
            if deferred:
                with contextlib.suppress(HostKVError):
                    p._s.sync_index()  # what was committed is durable even when the call fails
            raise
        if deferred:
            p._s.sync_index()  # (the last chunk took another path; its durable commit may not run)
    return out


def _plain(p: LmdbProvider, keys: list[Key], parents: list[Key | None], views: list[memoryview],
           failed: set[Key]) -> bool:
    """Whether a chunk may take a batch path (:func:`_put_direct`, :func:`_put_batch`): pages of
    one size stored in slots, no key twice, no parent that failed in this call or comes later in
    the chunk.  Otherwise :func:`_put_chunk` gives every page its exact outcome."""
    nb = views[0].nbytes
    if nb <= p._inline_max or any(v.nbytes != nb for v in views) or len(set(keys)) != len(keys):
        return False
    if failed and any(q in failed for q in parents if q is not None):
        return False
    at = {k: j for j, k in enumerate(keys)}
    return all(q is None or at.get(q, -1) < j for j, q in enumerate(parents))


def _put_direct(p: LmdbProvider, keys: list[Key], parents: list[Key | None], views: list[memoryview],
                salt_tag: str, *, durable: bool = True) -> list[bool | HostKVError] | None:
    """A plain chunk (see :func:`_plain`) that fits without evicting, in ONE write transaction:
    slots allocated (free ones first), headers zeroed, data written and hashed, headers written,
    with ``durability=sync`` the slot files synced, then the entries inserted and the
    transaction committed (with ``sync``: LMDB's commit sync, then the index sync).  The records
    are byte for byte those :func:`_put_batch` writes, less the flights: no other writer can
    take a slot or a key while this transaction holds LMDB's write lock, so the reservation
    needs no commit of its own (one commit and, with ``sync``, one ``fdatasync`` of data.mdb
    fewer per chunk).

    Crash safety: nothing is visible until the commit, and the commit comes after the data,
    the headers and (``sync``) their sync.  A crash or an error before it leaves only slots that
    are free in the committed index (the allocation rolls back with the transaction; a slot
    file created in it is an orphan recovery removes): no slot is leaked and no committed
    entry's bytes were touched, because only slots that were free before are written (a chunk
    that needs eviction, whose victims' slots a rolled-back transaction would leave indexed,
    goes the two-transaction way of :func:`_put_batch` instead).  The transaction function may
    run again after a map resize; it then rewrites the same free slots.

    ``durable=False`` (``durability=sync`` only): the commit is not followed by the index sync
    (the caller runs :meth:`_Shared.sync_index` before it returns).

    ``None`` (nothing changed) when the chunk is not this case: a key in flight, a parent not
    stored, not room without eviction."""
    nb = views[0].nbytes
    slot_nbytes = _slot_nbytes(nb)
    sync = p._s.durability == "sync"
    s = p._s
    tag = salt_tag.encode()
    pack_entry, pack_crc = _ENTRY.pack, _CRC.pack

    def op(tx: _Tx) -> list[int]:
        t, db = tx.t, tx.db
        entries, flights, lru, children = db["entries"], db["flights"], db["lru"], db["children"]
        get, delete = t.get, t.delete
        # (one stat instead of a lookup per key: there are no flights at all in the common case)
        if t.stat(flights)["entries"] and any(get(k, db=flights) is not None for k in keys):
            raise _NotPlain  # in flight (or a dead writer's flight to reclaim)
        # the stored keys (dedup) in one call: getmulti walks the keys in C
        found = t.cursor(db=entries).getmulti(keys)
        if found:
            have = {bytes(k) for k, _ in found}
            todo = [j for j, k in enumerate(keys) if k not in have]
            if not todo:
                return todo
        else:
            todo = list(range(len(keys)))
        n = len(todo)
        if tx.c.used + n * nb > tx.c.budget:
            raise _NotPlain  # needs eviction (or does not fit): two transactions
        tk = [keys[j] for j in todo] if n < len(keys) else keys
        tp = [parents[j] for j in todo] if n < len(keys) else parents
        tv = [views[j] for j in todo] if n < len(keys) else views
        pos = {k: i for i, k in enumerate(tk)}
        nchild = [0] * n
        ext: dict[Key, int] = {}  # stored parent -> how many pages of the chunk hang under it
        for q in tp:
            if q is None:
                continue
            i = pos.get(q, -1)
            if i >= 0:
                nchild[i] += 1
            else:
                ext[q] = ext.get(q, 0) + 1
        stored: list[tuple[_Entry, int]] = []
        for q, m in ext.items():
            pe = tx.get_or_drop(q)
            if pe is None:
                raise _NotPlain  # not stored (or damaged): page by page gives the exact errors
            stored.append((pe, m))
        fids, slots = tx.alloc_slots(slot_nbytes, n)
        gen0 = tx.c.gen + 1
        gens = range(gen0, gen0 + n)
        by_file, digests = _write_pages(p, fids, slots, tk, tp, gens, nb, tv)
        _crash("lmdb.seal.after_header")
        if sync:
            # the page bytes reach stable storage before the commit that points at them (R7: a
            # failed sync raises here and the whole chunk rolls back)
            for fid in by_file:
                s.slot_file(fid).sync()
        tx.c.gen += n
        tx.c.used += n * nb
        tx.c.sealed += n * nb
        tick0 = tx.c.tick + 1
        tx.c.tick += n
        now = time.time()
        xxh = xxhash.xxh3_64_intdigest  # _crc32, inline (once per page)
        recs: list[tuple[bytes, bytes]] = []
        leaves: list[tuple[bytes, bytes]] = []
        links: list[tuple[bytes, bytes]] = []
        for i, k in enumerate(tk):
            par = tp[i]
            body = pack_entry(_ENTRY_VERSION, 0 if par is None else _HAS_PARENT, par or _ZERO32, nb, nb, digests[i],
                              now, now, tick0 + i, nchild[i], 0, gen0 + i, fids[i], slots[i]) + tag
            recs.append((k, body + pack_crc(xxh(body) & 0xFFFFFFFF)))
            if not nchild[i]:
                leaves.append(((tick0 + i).to_bytes(8, "big") + k, b""))
            if par is not None:
                links.append((par + k, b""))
        # one putmulti per database: the puts run in C (the records are those of put() per key)
        t.cursor(db=entries).putmulti(recs)
        if leaves:
            t.cursor(db=lru).putmulti(leaves)
        if links:
            t.cursor(db=children).putmulti(links)
        for pe, m in stored:
            if pe.evictable:  # a leaf until now: it leaves the LRU list
                delete(pe.lru_key, db=lru)
            pe.children += m
            tx.put(pe)
        return todo

    try:
        todo = s.submit(op, durable=durable)
    except _NotPlain:
        return None
    total = len(keys)
    results: list[bool | HostKVError] = [False] * total
    if len(todo) < total:
        p._tally("dedup", total - len(todo))
    for j in todo:
        results[j] = True
    if todo:
        p._tally("seals", len(todo))
        p._tally("bytes_written", len(todo) * nb)
    return results


def _write_pages(p: LmdbProvider, fids: Sequence[int], slots: Sequence[int], keys: Sequence[Key],
                 parents: Sequence[Key | None], gens: Sequence[int], nb: int, views: Sequence[memoryview]
                 ) -> tuple[dict[int, list[int]], list[int]]:
    """Write a chunk's pages into their slots, per slot file: every slot's header invalidated
    before any byte of it changes (neither a stale record nor a reader in another process, which
    may still look at a slot freed under an older snapshot, can accept a half-overwritten slot),
    the bytes (hashed beside the writes), then the headers that vouch for them.  Returns the
    chunk's positions by slot file and the pages' XXH3-64 digests."""
    n = len(slots)
    by_file: dict[int, list[int]] = {}
    if fids.count(fids[0]) == n:  # the common case, one slot file: no per-page grouping
        by_file[fids[0]] = list(range(n))
    else:
        for i, fid in enumerate(fids):
            by_file.setdefault(fid, []).append(i)
    digests = [0] * n
    for fid, sel in by_file.items():
        sf = p._s.slot_file(fid)
        one = len(sel) == n
        fslots = slots if one else [slots[i] for i in sel]
        sf.begin_write_slots(fslots, 1)
        got: list[int] = []
        sf.write_slots(fslots, nb, views if one else [views[i] for i in sel], got)
        if one:
            digests = got
        else:
            for i, d in zip(sel, got, strict=True):
                digests[i] = d
        if one:
            sf.write_headers(fslots, keys, parents, gens, nb, digests)
        else:
            sf.write_headers(fslots, [keys[i] for i in sel], [parents[i] for i in sel], [gens[i] for i in sel], nb,
                             [digests[i] for i in sel])
    return by_file, digests


def _put_batch(p: LmdbProvider, keys: list[Key], parents: list[Key | None], views: list[memoryview],
               salt_tag: str, failed: set[Key]) -> list[bool | HostKVError] | None:
    """A chunk of equal slot pages as one batch: the records of :func:`_put_chunk`, byte for
    byte, written by two transactions that work on the chunk's columns (one budget check and
    one slot allocation for all of it, the flight and entry records packed directly, a parent
    from the chunk inserted with its child counted instead of inserted as a leaf and updated),
    slot headers zeroed, data written and headers written per file in one pass each.  For a
    chunk :func:`_plain` accepted that :func:`_put_direct` did not take (it needs eviction, or
    a key was in flight).  ``None`` (nothing changed) when the chunk is not the plain case (a
    key in flight, a parent not stored, not room for all of it, a flight reclaimed
    meanwhile): then :func:`_put_chunk`."""
    nb = views[0].nbytes
    owner, ttl = p._owner, p._lease_ttl
    slot_nbytes = _slot_nbytes(nb)
    pack_flight = _FLIGHT.pack

    def reserve(tx: _Tx) -> tuple[list[int], int, list[int], list[int], list[bytes], list[int]]:
        """The plain chunk's reservations: positions to store (the others are stored: dedup),
        first generation, file ids, slots, the flight records written, the parents' gens."""
        t, db = tx.t, tx.db
        entries, flights = db["entries"], db["flights"]
        get = t.get
        if any(get(k, db=flights) is not None for k in keys):
            raise _NotPlain  # in flight (or a dead writer's flight to reclaim): page by page
        todo = [j for j, k in enumerate(keys) if get(k, db=entries) is None]
        if not todo:
            return todo, 0, [], [], [], []
        n = len(todo)
        if n * nb > tx.c.budget:
            raise _NotPlain
        gen0 = tx.c.gen + 1
        gen_of = {keys[j]: gen0 + i for i, j in enumerate(todo)}
        held: dict[Key, _Entry] = {}
        pgens: list[int] = []
        for j in todo:
            q = parents[j]
            if q is None:
                pgens.append(0)
            elif q in gen_of:
                pgens.append(gen_of[q])
            else:  # a stored parent (possibly stored as dedup in this chunk): held per page
                pe = held.get(q) or tx.get_or_drop(q)
                if pe is None:
                    raise _NotPlain  # not stored: page by page gives the exact errors
                held[q] = pe
                tx.hold(pe)
                pgens.append(pe.gen)
        tx.make_room(n * nb)  # CapacityError: the nested transaction rolls back, page by page
        fids, slots = tx.alloc_slots(slot_nbytes, n)
        tx.c.gen += n
        tx.c.used += n * nb
        now = time.time()
        recs: list[bytes] = []
        put = t.put
        for i, j in enumerate(todo):
            q = parents[j]
            rec = pack_flight(owner, 0 if q is None else 1, q or _ZERO32, pgens[i], nb, nb, gen0 + i, fids[i],
                              slots[i], now, now + ttl)
            put(keys[j], rec, db=flights)
            recs.append(rec)
        return todo, gen0, fids, slots, recs, pgens

    try:
        todo, gen0, fids, slots, recs, pgens = p._s.submit(reserve)
    except (_NotPlain, CapacityError):
        return None
    _crash("lmdb.reserve.after_commit")
    total = len(keys)
    results: list[bool | HostKVError] = [False] * total
    if len(todo) < total:
        p._tally("dedup", total - len(todo))
    if not todo:
        return results
    n = len(todo)
    tkeys = [keys[j] for j in todo] if n < total else keys
    tparents = [parents[j] for j in todo] if n < total else parents
    tviews = [views[j] for j in todo] if n < total else views
    gens = range(gen0, gen0 + n)
    try:
        by_file, digests = _write_pages(p, fids, slots, tkeys, tparents, gens, nb, tviews)
        files: dict[int, SlotFile] = {fid: p._s.slot_file(fid) for fid in by_file}
        _crash("lmdb.seal.after_header")
    except BaseException:
        _abort_keys(p, tkeys, gens)
        raise
    tag = salt_tag.encode()
    pos = {k: i for i, k in enumerate(tkeys)}
    nchild = [0] * n
    ext: dict[Key, list[int]] = {}  # stored parent -> the pages under it
    for i, q in enumerate(tparents):
        if q is None:
            continue
        j = pos.get(q, -1)
        if j >= 0:
            nchild[j] += 1
        else:
            ext.setdefault(q, []).append(i)
    pack_entry, pack_crc = _ENTRY.pack, _CRC.pack

    def seal(tx: _Tx) -> None:
        t, db = tx.t, tx.db
        flights, entries, lru, children = db["flights"], db["entries"], db["lru"], db["children"]
        get, put, delete = t.get, t.put, t.delete
        for k, rec in zip(tkeys, recs, strict=True):
            raw = get(k, db=flights)
            if raw is None or bytes(raw) != rec:
                raise _NotPlain  # reclaimed or replaced meanwhile: page by page
        parents_now: list[tuple[_Entry, int]] = []
        for q, under in ext.items():
            pe = tx.get_or_drop(q)
            if pe is None or pe.gen != pgens[under[0]]:
                raise _NotPlain  # dropped (corrupt) meanwhile: page by page fails exactly those
            parents_now.append((pe, len(under)))
        for k in tkeys:
            delete(k, db=flights)
        tick0 = tx.c.tick + 1
        tx.c.tick += n
        now = time.time()
        for i, k in enumerate(tkeys):
            par = tparents[i]
            body = pack_entry(_ENTRY_VERSION, 0 if par is None else _HAS_PARENT, par or _ZERO32, nb, nb, digests[i],
                              now, now, tick0 + i, nchild[i], 0, gen0 + i, fids[i], slots[i]) + tag
            put(k, body + pack_crc(_crc32(body)), db=entries)
            if not nchild[i]:
                put((tick0 + i).to_bytes(8, "big") + k, b"", db=lru)
            if par is not None:
                put(par + k, b"", db=children)
        for pe, m in parents_now:
            was = pe.evictable
            pe.children += m
            pe.hold = max(0, pe.hold - m)  # each page's reservation held it once
            if was:
                delete(pe.lru_key, db=lru)
            tx.put(pe)
        tx.c.sealed += n * nb

    try:
        p._s.submit(seal, durable=True, sync_files=tuple(files.values()))
    except _NotPlain:
        # the flights changed under us (reclaimed, a parent dropped): the per-page seal gives
        # every page its exact outcome from the records as they are
        return _seal_pages(p, [(todo[i], tkeys[i], tparents[i], tviews[i], gen0 + i, fids[i], slots[i])
                               for i in range(n)], {todo[i]: digests[i] for i in range(n)}, {}, files, salt_tag,
                           failed, results)
    except BaseException:
        # R7: a failed sync or commit fails the chunk for good; give the space back
        _abort_keys(p, tkeys, gens)
        raise
    for j in todo:
        results[j] = True
    p._tally("seals", n)
    p._tally("bytes_written", n * nb)
    return results


def _abort_keys(p: LmdbProvider, keys: Sequence[Key], gens: Sequence[int]) -> None:
    """:func:`_abort_all` of a batch's reservations (keys and their generations)."""
    if not keys:
        return
    abort_ops = [p._abort_op(k, g) for k, g in zip(keys, gens, strict=True)]

    def op(tx: _Tx) -> None:
        for a in reversed(abort_ops):  # children first: each releases its hold on its parent
            a(tx)

    with contextlib.suppress(HostKVError):
        p._s.submit(op, frees=True)


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
    return _seal_pages(p, slots, digests, blobs, files, salt_tag, failed, results)


def _seal_pages(p: LmdbProvider, slots: Sequence[_Slot], digests: dict[int, int], blobs: dict[int, bytes],
                files: dict[int, SlotFile], salt_tag: str, failed: set[Key],
                results: list[bool | HostKVError]) -> list[bool | HostKVError]:
    """Step 3 of :func:`_put_chunk` page by page: one write transaction turns every flight of
    ``slots`` (written, hashed: ``digests`` by chunk position) into an entry, root first."""
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
    dsts: list[memoryview] = []  # (for the failure path's overlap check only)
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
            dsts.append(dst)
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
    if suspect and len(dsts) > 1 and overlapping(dsts):
        # a copy into an output buffer that aliases another overwrote that one's bytes before
        # their check: the stored entry is not corrupt (and is not dropped), the call is misuse,
        # as every batch provider answers it
        raise InvalidArgumentError("read_many's output buffers overlap: give each key a buffer of its own",
                                   hint="one writable buffer per key, not shared or overlapping")
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
