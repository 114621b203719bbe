"""The chunk-level read path of slot files (:meth:`SlotFile.read_batch`): the slot headers of a
whole batch checked before and after the copies (one ``struct`` call for a back-to-back run of
one-slot entries, numpy over the header table otherwise), the copies grouped from the columns.
Split out of :mod:`hostkv_providers.providers._slotfile` by role; the tunables (``_IOV_MAX``,
``_IO_THREADS``, ``_GROUP_NBYTES``) and the I/O pool stay there and are read from it at call time."""

from __future__ import annotations

import itertools
import operator
import os
import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import xxhash

from hostkv_providers._errors import InvalidArgumentError, SpanError, StorageIOError
from hostkv_providers._keys import KEY_NBYTES
from hostkv_providers.providers import _fsutil
from hostkv_providers.providers import _slotfile as _sf
from hostkv_providers.providers._slotfile import (
    FILE_HEADER_NBYTES,
    SLOT_HEADER_NBYTES,
    SLOT_MAGIC,
    ReadResult,
    run_nslots,
)

if TYPE_CHECKING:
    from hostkv_providers.providers._slotfile import SlotFile

#: The 8-byte words of a slot header a read compares (magic, key, generation, nbytes, checksum):
#: words 0-4 are bytes [0, 40), words 9-11 bytes [72, 96) -- what :meth:`SlotFile._ident_is` checks.
_IDENT_WORDS = np.array([0, 1, 2, 3, 4, 9, 10, 11], dtype=np.intp)
_HEADER_WORDS = SLOT_HEADER_NBYTES // 8
#: A header row (16 words) with ones where ``_IDENT_WORDS`` are: ``row & mask`` keeps what a read compares.
_IDENT_MASK = np.zeros(_HEADER_WORDS, np.uint64)
_IDENT_MASK[_IDENT_WORDS] = np.uint64(0xFFFFFFFFFFFFFFFF)
_U64 = np.dtype("<u8")
_NBYTES_OF = operator.attrgetter("nbytes")
#: The compared fields of a slot header, as ``struct`` reads them (magic, key, generation, nbytes,
#: checksum: ``_IDENT_NFIELDS`` values; the parent and the tail skipped): ``_ident_struct(n)``
#: unpacks ``n`` headers in a row.
_IDENT_FORMAT = "Q32s32xQQQ32x"
_IDENT_NFIELDS = 5
assert struct.calcsize("<" + _IDENT_FORMAT) == SLOT_HEADER_NBYTES
#: Batches of at most this many entries may take ``SlotFile._read_run_fast``.
_FAST_MAX = 1024
_ident_structs: dict[int, struct.Struct] = {}


def _ident_struct(n: int) -> struct.Struct:
    st = _ident_structs.get(n)
    if st is None:
        st = _ident_structs[n] = struct.Struct("<" + _IDENT_FORMAT * n)
    return st


def read_batch(sf: SlotFile, slots: Sequence[int] | npt.NDArray[np.int64],
               generations: Sequence[int] | npt.NDArray[Any],
               nbytes: Sequence[int] | npt.NDArray[np.int64], checksums: Sequence[int] | npt.NDArray[Any],
               keys: object, outs: Sequence[memoryview], *, verify: bool = True) -> bytes:
    """Whole-entry reads of a batch given as columns: entry ``j`` at ``slots[j]`` (record
    ``generations[j]``, ``nbytes[j]``, ``checksums[j]``, key ``j`` of ``keys``) into ``outs[j]``
    (a flat byte view of exactly ``nbytes[j]`` bytes).  The chunk path of the providers'
    ``read_many``: the checks and the grouping run over the batch (numpy over the header
    table; a back-to-back run of one-slot entries, the common case, through
    :meth:`_read_run_fast`), per entry only the copy (and with ``verify`` the XXH3 call).

    Parameters
    ----------
    slots, generations, nbytes, checksums
        One value per entry (integer arrays, or sequences, of ``len(outs)``).
    keys
        The 32-byte keys: a list of them, a ``V32`` array, or a bytes-like object of
        ``32 * len(outs)`` bytes (the keys back to back).
    outs
        Writable, flat, C-contiguous byte views, ``outs[j].nbytes == nbytes[j]``.
    verify
        Compare the XXH3-64 of every ``outs[j]`` with ``checksums[j]``.

    Returns
    -------
    bytes
        One ``ReadResult`` code per entry (``bytes(n)``: all ``OK``).  Each entry keeps the seqlock protocol of
        :meth:`read_into`: its header must name the record (magic, key, generation, size,
        checksum) before the copies, checked for the whole batch at once over the header
        table, and again after them; ``OK`` only if both matched (and, with ``verify``, the
        checksum of the bytes in ``outs[j]``), ``CORRUPT`` for a checksum mismatch under a
        header that still names the record after the copy, else ``STALE``.  Runs that lie
        back to back in the file (an entry filling its slots exactly, then the next) are
        copied with one ``preadv`` of at most ``_sf._IOV_MAX`` buffers (``io == "syscall"``), a
        large batch on the I/O threads (:func:`_sf._spread`); ``io == "mmap"`` copies from the
        mapping.  Where the result is not ``OK``, ``outs[j]`` is garbage.

    Raises
    ------
    SpanError
        An ``outs[j]`` of another size than its entry.
    InvalidArgumentError
        A run outside the file, columns of different lengths, keys not 32 bytes each.
    StorageIOError
        The file is closed (also by a close racing the read) or a read failed.
    """
    n = len(outs)
    if (isinstance(keys, list) and 0 < n <= _FAST_MAX and not isinstance(slots, np.ndarray)
            and len(slots) == len(nbytes) == len(generations) == len(checksums) == len(keys) == n
            and set(map(len, keys)) == {KEY_NBYTES}):
        fast = read_run_fast(sf, list(slots), list(generations), list(nbytes), list(checksums), keys,
                                   outs, verify)
        if fast is not None:
            return fast
    if isinstance(keys, list):
        kw = np.frombuffer(b"".join(keys), np.uint8) if set(map(len, keys)) <= {KEY_NBYTES} \
            else np.zeros(1, np.uint8)  # (a wrong length: refused below)
    elif isinstance(keys, np.ndarray):
        kw = np.ascontiguousarray(keys).view(np.uint8).reshape(-1)
    else:
        kw = np.frombuffer(keys, np.uint8)  # type: ignore[call-overload]
    sl = np.asarray(slots, dtype=np.int64)
    nb = np.asarray(nbytes, dtype=np.int64)
    gens = np.asarray(generations, dtype=np.uint64)
    sums = np.asarray(checksums, dtype=np.uint64)
    if not (sl.shape == nb.shape == gens.shape == sums.shape == (n,)):
        raise InvalidArgumentError("read_batch: columns of different lengths")
    if kw.nbytes != n * KEY_NBYTES:
        raise InvalidArgumentError(f"read_batch: {kw.nbytes} key bytes for {n} keys of {KEY_NBYTES}")
    if not n:
        return b""
    # (the argument checks on lists: builtins over a list beat numpy calls on small batches)
    nb_l = nb.tolist()
    sizes = list(map(_NBYTES_OF, outs))
    if sizes != nb_l:
        j = next(j for j in range(n) if sizes[j] != nb_l[j])
        raise SpanError(f"a whole-entry read into {sizes[j]} bytes of an entry of {nb_l[j]}")
    sn = sf.slot_nbytes
    sl_l = sl.tolist()
    # (sizes are >= 0 here: a run is max(1, ceil(nbytes / sn)) slots; the widest bounds all)
    if min(sl_l) < 0 or max(sl_l) + max(1, -(-max(nb_l) // sn)) > sf.slot_count:
        for slot, size in zip(sl_l, nb_l, strict=True):
            if slot < 0 or slot + max(1, -(-size // sn)) > sf.slot_count:
                sf._check_run(slot, run_nslots(size, sn))  # raises with the full message
    # the header rows this batch expects, zero outside the compared words (see _idents_match)
    want = np.zeros((n, _HEADER_WORDS), np.uint64)
    want[:, 0] = SLOT_MAGIC
    want[:, 1:5] = kw.view(_U64).reshape(n, 4)
    want[:, 9] = gens
    want[:, 10] = nb
    want[:, 11] = sums
    pre = sf._idents_match(sl, want)
    if pre is None:
        live = None  # every header matched (the common case)
        m = n
        lsl, lnb, lsums, lwant, bufs = sl, nb, sums, want, list(outs)
    else:
        live = np.flatnonzero(pre)
        m = len(live)
        if not m:
            return bytes([ReadResult.STALE]) * n
        lsl, lnb, lsums, lwant = sl[live], nb[live], sums[live], want[live]
        bufs = [outs[j] for j in live.tolist()]
    digest = xxhash.xxh3_64_intdigest
    digests = [0] * m
    base = sf.data_offset
    if sf.io != "syscall":
        v = sf._v()
        for t, (lo, size) in enumerate(zip((base + lsl * sn).tolist(), lnb.tolist(), strict=True)):
            out = bufs[t]
            out[:] = v[lo : lo + size]
            if verify:
                digests[t] = digest(out)
    else:
        fd = sf.fd
        total = sum(nb_l) if live is None else int(lnb.sum())
        max_nbytes = _sf._GROUP_NBYTES
        if not verify:
            # Unverified reads have no hash pass that wants its group still in the CPU caches:
            # as few preadv calls as the threads allow (one per thread, or one for the call).
            parts = _sf._IO_THREADS if _sf._use_pool(total, m) else 1
            max_nbytes = max(_sf._GROUP_NBYTES, -(-total // parts))
        groups = batch_groups(sf, lsl, lnb, max_nbytes)
        path = sf.path
        pread_into = sf._pread_into

        def work(part: Sequence[tuple[int, int, int]]) -> None:
            for start, a, b in part:
                if b - a == 1:
                    out = bufs[a]
                    if out.nbytes:
                        pread_into(out, start)
                else:
                    chunk = bufs[a:b]
                    try:
                        got = os.preadv(fd, chunk, start)
                    except OSError as exc:
                        raise _fsutil.io_error(exc, f"reading {path}") from exc
                    if got < sum(map(_NBYTES_OF, chunk)):  # short: page by page from the start
                        pos = start
                        for x in chunk:
                            pread_into(x, pos)
                            pos += x.nbytes
                if verify:
                    # right after each group's copy, while its bytes are still in the CPU caches
                    for t in range(a, b):
                        digests[t] = digest(bufs[t])

        _sf._spread(groups, total, work)
    # the second header check of the seqlock, after every copy of the batch
    post = sf._idents_match(lsl, lwant)
    bad = None
    if verify:
        got_sums = np.array(digests, dtype=np.uint64)
        if got_sums.tobytes() != lsums.tobytes():
            bad = got_sums != lsums
    if post is None and bad is None and live is None:
        return bytes(n)  # all OK
    res = np.zeros(m, np.uint8)
    if post is not None:
        res[~post] = ReadResult.STALE
    if bad is not None:
        res[bad if post is None else bad & post] = ReadResult.CORRUPT
    if live is None:
        return res.tobytes()
    codes = np.full(n, ReadResult.STALE, np.uint8)
    codes[live] = res
    return codes.tobytes()


def read_run_fast(sf: SlotFile, sl: list[int], gens: list[int], nb: list[int], sums: list[int], keys: list[bytes],
                   outs: Sequence[memoryview], verify: bool) -> bytes | None:
    """:meth:`read_batch` of a batch of one-slot entries that fill their slots and lie back to
    back from ``sl[0]`` in order (what ``put_many`` lays out and ``read_many`` reads back),
    or ``None`` when the batch is not one (then the general path reads it, from scratch).

    The same protocol with a small footprint: the slot headers of the batch are one range
    of the header table, unpacked with one ``struct`` call (the compared fields only, the
    others skipped) and compared with the expected records as one tuple, before the copies
    and again after them.  Measured on a 2-core VM (256 KiB pages, 16 per call): a read
    call begins with the CPU caches emptied by the previous call's 4 MiB copy, where each
    numpy call cost 5-15 us against ~1 us warm; this path makes no numpy call."""
    n = len(outs)
    sn = sf.slot_nbytes
    s0 = sl[0]
    if sl != list(range(s0, s0 + n)) or nb != [sn] * n or s0 < 0 or s0 + n > sf.slot_count:
        return None
    if list(map(_NBYTES_OF, outs)) != nb:
        return None  # (the general path raises the SpanError)
    m = sf._map
    if m is None:
        raise StorageIOError(f"slot file {sf.path} is closed")
    want = tuple(itertools.chain.from_iterable(zip(itertools.repeat(SLOT_MAGIC, n), keys, gens, nb, sums,
                                                   strict=True)))
    unpack = _ident_struct(n).unpack
    h0 = FILE_HEADER_NBYTES + s0 * SLOT_HEADER_NBYTES
    h1 = h0 + n * SLOT_HEADER_NBYTES
    try:
        if unpack(m[h0:h1]) != want:
            return None  # some header does not match: the general path sorts them out
    except ValueError:  # closed by another thread meanwhile
        raise StorageIOError(f"slot file {sf.path} is closed") from None
    digest = xxhash.xxh3_64_intdigest
    bufs = list(outs)
    got: list[int] = []
    if sf.io != "syscall":
        v = sf._v()
        lo = sf.data_offset + s0 * sn
        for out in bufs:
            out[:] = v[lo : lo + sn]
            lo += sn
            if verify:
                got.append(digest(out))
    else:
        fd = sf.fd
        total = n * sn
        if verify:
            k = max(1, min(_sf._IOV_MAX, _sf._GROUP_NBYTES // sn))
        else:
            parts = _sf._IO_THREADS if _sf._use_pool(total, n) else 1
            k = max(1, min(_sf._IOV_MAX, max(_sf._GROUP_NBYTES, -(-total // parts)) // sn))
        base = sf.data_offset + s0 * sn
        groups = [(base + a * sn, a, min(a + k, n)) for a in range(0, n, k)]
        digests = [0] * n
        path = sf.path
        pread_into = sf._pread_into

        def work(part: Sequence[tuple[int, int, int]]) -> None:
            for start, a, b in part:
                chunk = bufs[a:b]
                try:
                    done = os.preadv(fd, chunk, start)
                except OSError as exc:
                    raise _fsutil.io_error(exc, f"reading {path}") from exc
                if done < (b - a) * sn:  # short: page by page from the start
                    pos = start
                    for x in chunk:
                        pread_into(x, pos)
                        pos += sn
                if verify:
                    # right after each group's copy, while its bytes are still in the CPU caches
                    for t in range(a, b):
                        digests[t] = digest(bufs[t])

        _sf._spread(groups, total, work)
        if verify:
            got = digests
    # the second header check of the seqlock, after every copy of the batch
    try:
        after = unpack(m[h0:h1])
    except ValueError:
        raise StorageIOError(f"slot file {sf.path} is closed") from None
    if after == want and (not verify or got == sums):
        return bytes(n)
    codes = bytearray(n)
    w = _IDENT_NFIELDS
    for j in range(n):
        if after[j * w : j * w + w] != want[j * w : j * w + w]:
            codes[j] = ReadResult.STALE
        elif verify and got[j] != sums[j]:
            codes[j] = ReadResult.CORRUPT
    return bytes(codes)


def idents_match(sf: SlotFile, slots: npt.NDArray[np.int64], want: npt.NDArray[np.uint64]
                  ) -> npt.NDArray[np.bool_] | None:
    """The seqlock check of :meth:`read_batch` over the whole batch: whether the header of
    each run names exactly its record (its words ``_IDENT_WORDS`` -- magic, key, generation,
    size, checksum -- equal ``want``'s row, compared as integers, i.e. byte for byte).
    ``None`` when every one does (the common case, one comparison of the whole batch), else
    one flag per run."""
    h = sf._headers
    if h is None:
        raise StorageIOError(f"slot file {sf.path} is closed")
    got = h.view(_U64).reshape(sf.slot_count, _HEADER_WORDS).take(slots, axis=0)
    got &= _IDENT_MASK
    if got.tobytes() == want.tobytes():
        return None
    ok: npt.NDArray[np.bool_] = (got == want).all(axis=1)
    return ok


def batch_groups(sf: SlotFile, slots: npt.NDArray[np.int64], nbytes: npt.NDArray[np.int64], max_nbytes: int
                  ) -> list[tuple[int, int, int]]:
    """:meth:`_groups` over columns: ``(file offset, a, b)`` per group of positions ``[a, b)``
    whose bytes lie back to back in the file (only an entry that fills its slots exactly is
    followed by the next run's first byte), at most ``_sf._IOV_MAX`` buffers and ``max_nbytes``
    bytes each (a group holds at least one entry), in order."""
    m = len(slots)
    sn = sf.slot_nbytes
    base = sf.data_offset
    nb0 = int(nbytes[0])
    if m == 1:
        return [(base + int(slots[0]) * sn, 0, 1)]
    step = nb0 // sn
    if nb0 and not nb0 % sn:
        s = slots.tolist()
        if s == list(range(s[0], s[0] + m * step, step)) and nbytes.tolist() == [nb0] * m:
            # one run of equal entries filling their slots (the common case): cut every k
            k = min(_sf._IOV_MAX, max(1, max_nbytes // nb0))
            return [(base + (s[0] + g * step) * sn, g, min(g + k, m)) for g in range(0, m, k)]
    lo = base + slots * sn
    if int(nbytes.min()) == int(nbytes.max()):
        # equal sizes (the common case): runs split every k entries
        if not nb0 or nb0 % sn:
            return list(zip(lo.tolist(), range(m), range(1, m + 1), strict=True))
        k = min(_sf._IOV_MAX, max(1, max_nbytes // nb0))
        first = (np.flatnonzero(lo[1:] != lo[:-1] + nb0) + 1).tolist()
        los = lo.tolist()
        out: list[tuple[int, int, int]] = []
        for a, b in zip([0, *first], [*first, m], strict=True):
            out.extend((los[g], g, min(g + k, b)) for g in range(a, b, k))
        return out
    # sizes differ: the greedy split of _groups, entry by entry
    end = -1
    size = count = 0
    flags = []
    for x, y in zip(lo.tolist(), nbytes.tolist(), strict=True):
        if x != end or count >= _sf._IOV_MAX or size + y > max_nbytes:
            flags.append(True)
            size, count = y, 1
        else:
            flags.append(False)
            size += y
            count += 1
        end = x + y if y % sn == 0 and y else -1
    starts = np.flatnonzero(flags)
    return list(zip(lo[starts].tolist(), starts.tolist(), [*starts[1:].tolist(), m], strict=True))
