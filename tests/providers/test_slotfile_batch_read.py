"""The chunk-level read path of slot files (``SlotFile.read_batch``) and ``TreeIndex.touch_rows``.

``read_batch`` checks the slot headers of a whole batch over the header table before and after
the copies (the seqlock of the module docstring) and groups adjacent runs from the columns; the
per-entry ``read_into`` is the oracle: the same result for every entry (``OK``/``STALE``/
``CORRUPT``), the same bytes where ``OK``, in both I/O modes, with and without ``verify``.
"""

from __future__ import annotations

import os
import random
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash

import hostkv_providers.providers._slotfile as slotfile
import hostkv_providers.providers._slotread as slotread
from hostkv_providers import InvalidArgumentError, SpanError, StorageIOError
from hostkv_providers.providers import TreeIndex
from hostkv_providers.providers._slotfile import ReadResult, SlotFile
from hostkv_providers.testing import key_of

SN = 4096
COUNT = 96
STORE = bytes(range(16))

Rec = tuple[int, bytes, int, int, int]  # slot, key, generation, nbytes, checksum


def _bytes_of(key: bytes, gen: int, nbytes: int) -> bytes:
    seed = xxhash.xxh3_64_intdigest(key + gen.to_bytes(8, "little"))
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8).tobytes()


def _put(sf: SlotFile, slot: int, key: bytes, gen: int, nbytes: int) -> Rec:
    """An entry written with the protocol (headers zeroed, data, header)."""
    data = _bytes_of(key, gen, nbytes)
    sf.begin_write(slot, slotfile.run_nslots(nbytes, SN))
    sf.write(slot, nbytes, 0, data)
    csum = xxhash.xxh3_64_intdigest(data)
    sf.write_header(slot, key=key, parent=None, generation=gen, nbytes=nbytes, checksum=csum)
    return slot, key, gen, nbytes, csum


@pytest.fixture(params=["fast", "general"], autouse=True)
def read_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both paths of read_batch: the one for a back-to-back run of one-slot entries (taken
    where it applies) and the general one (forced)."""
    if request.param == "general":
        monkeypatch.setattr(slotread, "_FAST_MAX", 0)
    return str(request.param)


@pytest.fixture(params=["syscall", "mmap"])
def sf(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[SlotFile]:
    f = SlotFile.create(str(tmp_path / "f.slots"), slot_nbytes=SN, slot_count=COUNT, file_id=1, store_id=STORE,
                        durable=False)
    f.io = request.param
    yield f
    f.close()


def _layout(sf: SlotFile, rng: random.Random) -> list[Rec]:
    """Entries of 1-3 slots back to back; some fill their slots exactly, some do not, one is empty."""
    recs: list[Rec] = []
    slot = 0
    while True:
        nslots = rng.choice([1, 1, 1, 2, 3])
        if slot + nslots > COUNT:
            break
        nbytes = nslots * SN if rng.random() < 0.7 else nslots * SN - rng.randrange(1, SN)
        if rng.random() < 0.03:
            nbytes = 0
        recs.append(_put(sf, slot, key_of(f"e{slot}"), rng.randrange(1, 1 << 40), nbytes))
        slot += nslots
    return recs


def _batch(sf: SlotFile, asked: list[Rec], verify: bool) -> tuple[list[int], list[bytearray]]:
    outs = [bytearray(r[3]) for r in asked]
    codes = sf.read_batch([r[0] for r in asked], [r[2] for r in asked], [r[3] for r in asked],
                          [r[4] for r in asked], [r[1] for r in asked], [memoryview(o) for o in outs],
                          verify=verify)
    assert isinstance(codes, bytes) and len(codes) == len(asked)
    return list(codes), outs


def _oracle(sf: SlotFile, asked: list[Rec], verify: bool) -> tuple[list[int], list[bytearray]]:
    outs = [bytearray(r[3]) for r in asked]
    codes = [int(sf.read_into(s, memoryview(o), key=k, generation=g, nbytes=n, checksum=c, verify=verify))
             for (s, k, g, n, c), o in zip(asked, outs, strict=True)]
    return codes, outs


def _same(sf: SlotFile, asked: list[Rec], verify: bool) -> list[int]:
    codes, outs = _batch(sf, asked, verify)
    want, wouts = _oracle(sf, asked, verify)
    assert codes == want
    for c, o, w in zip(codes, outs, wouts, strict=True):
        if c == ReadResult.OK:
            assert o == w
    legacy = sf.read_runs_into([(s, memoryview(bytearray(n)), k, g, n, c) for s, k, g, n, c in asked],
                               verify=verify)
    assert [int(r) for r in legacy] == want
    return codes


@pytest.mark.parametrize("verify", [True, False])
def test_read_batch_matches_read_into_on_mixed_batches(sf: SlotFile, verify: bool) -> None:
    """Random batches (in slot order, shuffled, with gaps and repeats) with stale records (another
    generation, key, size or checksum than the header), corrupt bytes and empty entries: the
    result and the bytes of every entry are what ``read_into`` gives."""
    rng = random.Random(7)
    recs = _layout(sf, rng)
    # damage some data bytes under intact headers: CORRUPT with verify, OK (those bytes) without
    for s, _k, _g, n, _c in rng.sample([r for r in recs if r[3]], 4):
        sf.data(s, n)[rng.randrange(n)] ^= 0xFF
    seen: set[int] = set()
    for trial in range(40):
        picked = list(recs) if trial == 0 else rng.sample(recs, rng.randrange(1, len(recs)))
        if trial % 3 == 1:
            picked.sort()
        if trial % 5 == 2:
            picked += rng.sample(picked, min(3, len(picked)))  # an entry asked twice
        asked = []
        for s, k, g, n, c in picked:
            x = rng.random()
            if x < 0.08:
                g += 1
            elif x < 0.12:
                k = key_of(f"other{s}")
            elif x < 0.15:
                c ^= 1
            asked.append((s, k, g, n, c))
        seen.update(_same(sf, asked, verify))
    assert ReadResult.OK in seen and ReadResult.STALE in seen
    assert (ReadResult.CORRUPT in seen) == verify


def _groups_of(sf: SlotFile, runs: list[tuple[int, int]], max_nbytes: int) -> list[tuple[int, int, int]]:
    old = sf._groups(runs, max_nbytes)
    new = sf._batch_groups(np.array([r[0] for r in runs], np.int64), np.array([r[1] for r in runs], np.int64),
                           max_nbytes)
    assert [(lo, idx[0], idx[-1] + 1) for lo, idx in old] == new
    assert all(idx == list(range(idx[0], idx[-1] + 1)) for _, idx in old)
    return new


def test_groups_from_columns_equal_the_entry_loop(sf: SlotFile, monkeypatch: pytest.MonkeyPatch) -> None:
    """``_batch_groups`` cuts exactly where ``_groups`` does: offset runs (only an entry that
    fills its slots exactly is followed by the next run), ``_IOV_MAX`` buffers and the byte
    bound, for equal and for mixed sizes."""
    rng = random.Random(3)
    monkeypatch.setattr(slotfile, "_IOV_MAX", 5)
    for _ in range(300):
        n = rng.randrange(1, 40)
        nslots = rng.choice([1, 2])
        equal = rng.random() < 0.5
        nbytes0 = rng.choice([nslots * SN, nslots * SN - 100, 0]) if equal else 0
        runs = []
        slot = rng.randrange(4)
        for _ in range(n):
            nb = nbytes0 if equal else rng.choice([SN, 2 * SN, SN - 7, 3 * SN])
            runs.append((slot, nb))
            slot += rng.choice([slotfile.run_nslots(nb, SN)] * 4 + [0, 5])
        _groups_of(sf, runs, rng.choice([SN, 3 * SN, 8 * SN, 1 << 30]))
    # IOV_MAX: 12 contiguous one-slot entries, no byte bound, split 5 + 5 + 2
    assert [(a, b) for _, a, b in _groups_of(sf, [(s, SN) for s in range(12)], 1 << 30)] == [(0, 5), (5, 10), (10, 12)]


def test_iov_max_splits_the_preadv_calls(sf: SlotFile, monkeypatch: pytest.MonkeyPatch) -> None:
    """Contiguous entries go out in ``preadv`` calls of at most ``_IOV_MAX`` buffers; a gap in the
    slots, or an entry that does not fill its slot, starts a new call."""
    recs = [_put(sf, s, key_of(f"i{s}"), 5, SN) for s in range(10)]
    recs.append(_put(sf, 12, key_of("gap"), 5, SN - 10))  # after a gap, and not filling its slot
    recs.append(_put(sf, 13, key_of("next"), 5, SN))
    monkeypatch.setattr(slotfile, "_IOV_MAX", 4)
    calls: list[tuple[int, int]] = []
    real = os.preadv

    def preadv(fd: int, bufs: list[memoryview], offset: int) -> int:
        calls.append((len(bufs), offset))
        return real(fd, bufs, offset)

    monkeypatch.setattr(os, "preadv", preadv)
    codes, outs = _batch(sf, recs, True)
    assert codes == [ReadResult.OK] * len(recs)
    assert all(o == _bytes_of(k, g, n) for o, (_, k, g, n, _) in zip(outs, recs, strict=True))
    if sf.io == "syscall":
        base = sf.data_offset
        assert calls == [(4, base), (4, base + 4 * SN), (2, base + 8 * SN), (1, base + 12 * SN),
                         (1, base + 13 * SN)]
    else:
        assert calls == []


def _rewrite_before_the_copy(monkeypatch: pytest.MonkeyPatch, action: Any) -> None:
    """Run ``action()`` once, when ``read_batch`` starts its copies (its first ``preadv``, or its
    first use of the mapping with ``io == "mmap"``): after the first header check, as a writer
    reusing the slot while the reader copies."""
    state = {"armed": True}
    real_preadv, real_v = os.preadv, SlotFile._v

    def fire() -> None:
        if state["armed"]:
            state["armed"] = False
            action()

    def preadv(fd: int, bufs: list[memoryview], offset: int) -> int:
        fire()
        return real_preadv(fd, bufs, offset)

    def v(self: SlotFile) -> memoryview:
        fire()
        return real_v(self)

    monkeypatch.setattr(os, "preadv", preadv)
    monkeypatch.setattr(SlotFile, "_v", v)


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("how", ["zeroed", "reused"])
def test_a_header_changed_during_the_copy_is_stale(sf: SlotFile, monkeypatch: pytest.MonkeyPatch,
                                                   verify: bool, how: str) -> None:
    """The header matched before the copy, then a writer zeroed it (protocol step 1) or reused
    the slot for a new generation with other bytes: that entry is ``STALE``, never ``OK`` with
    the new bytes (with or without ``verify``); the others of the batch are ``OK``."""
    recs = [_put(sf, s, key_of(f"h{s}"), 9, SN) for s in range(6)]

    def writer() -> None:
        if how == "zeroed":
            sf.begin_write(2, 1)
        else:
            _put(sf, 2, recs[2][1], 10, SN)

    _rewrite_before_the_copy(monkeypatch, writer)
    codes, outs = _batch(sf, recs, verify)
    assert codes == [0, 0, ReadResult.STALE, 0, 0, 0]
    assert all(outs[j] == _bytes_of(recs[j][1], 9, SN) for j in (0, 1, 3, 4, 5))


def test_a_mismatch_before_the_copy_is_stale_and_a_bad_checksum_corrupt(sf: SlotFile) -> None:
    recs = [_put(sf, s, key_of(f"m{s}"), 3, SN) for s in range(4)]
    asked = list(recs)
    s, k, g, n, c = recs[1]
    asked[1] = (s, k, g + 1, n, c)  # a record of another generation: the slot was reused
    s, k, g, n, c = recs[3]
    asked[3] = (s, k, g, n - 1, c)  # another size
    codes, _ = _batch(sf, asked, True)
    assert codes == [0, ReadResult.STALE, 0, ReadResult.STALE]
    sf.data(0, SN)[17] ^= 1
    codes, _ = _batch(sf, recs, True)
    assert codes == [ReadResult.CORRUPT, 0, 0, 0]
    codes, outs = _batch(sf, recs, False)
    assert codes == [0, 0, 0, 0] and outs[0] == bytes(sf.data(0, SN))
    # a checksum mismatch whose header also changed meanwhile is a miss, not corruption
    _put(sf, 0, recs[0][1], 4, SN)
    codes, _ = _batch(sf, recs, True)
    assert codes[0] == ReadResult.STALE


def test_bad_arguments_raise_typed_errors(sf: SlotFile) -> None:
    rec = _put(sf, 0, key_of("a"), 1, SN)
    s, k, g, n, c = rec
    with pytest.raises(SpanError):
        sf.read_batch([s], [g], [n], [c], k, [memoryview(bytearray(n - 1))])
    with pytest.raises(InvalidArgumentError):
        sf.read_batch([COUNT - 1], [g], [2 * SN], [c], k, [memoryview(bytearray(2 * SN))])
    with pytest.raises(InvalidArgumentError):
        sf.read_batch([-1], [g], [n], [c], k, [memoryview(bytearray(n))])
    with pytest.raises(InvalidArgumentError):
        sf.read_batch([s, s], [g], [n], [c], k, [memoryview(bytearray(n))])
    with pytest.raises(InvalidArgumentError):
        sf.read_batch([s], [g], [n], [c], k[:31], [memoryview(bytearray(n))])
    with pytest.raises(InvalidArgumentError):
        sf.read_batch([s], [g], [n], [c], [k[:31]], [memoryview(bytearray(n))])
    assert sf.read_batch([], [], [], [], b"", []) == b""
    keys = np.frombuffer(k, "V32")  # a V32 key column works as well as the bytes
    assert sf.read_batch([s], [g], [n], [c], keys, [memoryview(bytearray(n))]) == b"\0"
    assert sf.read_batch([s], [g], [n], [c], k, [memoryview(bytearray(n))]) == b"\0"  # the keys joined
    assert sf.read_batch(np.array([s]), np.array([g], np.uint64), np.array([n]), np.array([c], np.uint64), [k],
                         [memoryview(bytearray(n))]) == b"\0"
    sf.close()
    with pytest.raises(StorageIOError):
        sf.read_batch([s], [g], [n], [c], k, [memoryview(bytearray(n))])


@pytest.mark.parametrize("threaded", [False, True])
def test_a_racing_writer_never_yields_wrong_bytes(sf: SlotFile, monkeypatch: pytest.MonkeyPatch,
                                                  threaded: bool) -> None:
    """A writer thread keeps reusing the slots of the batch (new generation, new bytes, the write
    protocol); the reader asks for the records it last saw.  Every ``OK`` holds exactly the
    bytes of the record asked for (also unverified), whatever the interleaving."""
    if threaded:  # the batch on the I/O threads
        monkeypatch.setattr(slotfile, "_PARALLEL_MIN_NBYTES", 1)
    nslot = 8
    current: dict[int, Rec] = {s: _put(sf, s, key_of(f"r{s}"), 1, SN) for s in range(nslot)}
    stop = threading.Event()

    def writer() -> None:
        gen = 2
        while not stop.is_set():
            for s in range(nslot):
                current[s] = _put(sf, s, key_of(f"r{s}"), gen, SN)
            gen += 1

    t = threading.Thread(target=writer)
    t.start()
    oks = 0
    try:
        for i in range(300):
            asked = [current[s] for s in range(nslot)]
            codes, outs = _batch(sf, asked, i % 2 == 0)
            for c, o, (_, k, g, n, _) in zip(codes, outs, asked, strict=True):
                assert c in (ReadResult.OK, ReadResult.STALE)  # the writer never corrupts
                if c == ReadResult.OK:
                    assert o == _bytes_of(k, g, n)
                    oks += 1
    finally:
        stop.set()
        t.join()
    assert oks > 0


# -- TreeIndex.touch_rows -------------------------------------------------------------------------

def _tree(n: int) -> tuple[TreeIndex, list[int]]:
    """Chains and single entries; some held, some retained (not evictable)."""
    idx = TreeIndex(budget=1 << 40)
    rows: list[int] = []
    parent = None
    for i in range(n):
        k = key_of(f"t{i}")
        p = parent if i % 4 else None
        ok, _, _ = idx.begin(k, p, 10)
        assert ok
        rows.append(idx.commit(k, nbytes=10))
        parent = k
    idx.hold_rows([rows[5], rows[9]])
    idx.retain_rows([rows[13]], 1 << 40)
    return idx, rows


@pytest.mark.parametrize("loop_max", [256, 0])
def test_touch_rows_equals_a_loop_of_touch(monkeypatch: pytest.MonkeyPatch, loop_max: int) -> None:
    """The same ticks, clock and ``used`` times as one ``touch`` per row in order (a row touched
    twice keeps its last tick), and the same LRU eviction order afterwards."""
    import hostkv_providers.providers._tree._columns as tree

    monkeypatch.setattr(tree, "_TOUCH_LOOP_MAX", loop_max)  # the loop and the column path
    rng = random.Random(5)
    for trial in range(20):
        a, rows = _tree(40)
        b, _ = _tree(40)
        order = [rng.choice(rows) for _ in range(rng.randrange(1, 60))]
        if trial == 0:
            order = [rows[0], rows[1]]  # short batches too
        for r in order:
            a.touch(r)
        before = b.used.copy()
        b.touch_rows(np.array(order, np.int64))
        assert a.clock == b.clock
        assert np.array_equal(a.tick, b.tick)
        touched = sorted(set(order))
        untouched = [r for r in rows if r not in touched]
        assert np.all(b.used[touched] >= before[touched]) and np.array_equal(b.used[untouched], before[untouched])
        a.release_rows([rows[5], rows[9]], [int(a.gen[rows[5]]), int(a.gen[rows[9]])])
        b.release_rows([rows[5], rows[9]], [int(b.gen[rows[5]]), int(b.gen[rows[9]])])
        assert a.evict_cost(250) == b.evict_cost(250)
        assert [a.pop_lru_leaf() for _ in range(3)] == [b.pop_lru_leaf() for _ in range(3)]


def test_rows_of_after_a_bulk_load_equals_row_of() -> None:
    """After a bulk load (the sorted key map, nothing in the dict yet) ``rows_of`` finds what
    ``row_of`` finds key by key: present keys, absent ones, a removed one, and keys sharing
    their first 8 bytes (the map's sort key)."""
    from hostkv_providers.providers._tree import key_u64

    def build() -> tuple[TreeIndex, list[bytes]]:
        idx = TreeIndex(budget=1 << 40)
        keys = [key_of(f"b{i}") for i in range(30)] + [b"S" * 8 + bytes([i]) * 24 for i in range(3)]
        for k in keys:
            ok, _, _ = idx.begin(k, None, 10)
            assert ok
            idx.commit(k, nbytes=10)
        rows = np.array([idx.row_of(k) for k in keys], np.int64)
        k64 = np.array([key_u64(k) for k in keys], np.uint64)
        order = np.argsort(k64, kind="stable")
        idx.set_key_map(k64[order], rows[order])
        idx._dict.clear()  # as a bulk load leaves it: every key only in the sorted map
        return idx, keys

    a, keys = build()
    b, _ = build()
    gone = keys[4]
    for idx in (a, b):
        idx._unmap(idx.row_of(gone))
        idx._dict.clear()
    asked = [*keys[:10], key_of("absent"), b"S" * 8 + bytes([7]) * 24, gone, *keys[30:], keys[3], *keys[10:]]
    assert a.rows_of(asked) == [b.row_of(k) for k in asked]
    assert a.rows_of(asked) == [b.row_of(k) for k in asked]  # now from the dict
    assert a.rows_of(asked[:2]) == [b.row_of(k) for k in asked[:2]]


def test_the_run_path_is_taken_where_it_applies(sf: SlotFile, monkeypatch: pytest.MonkeyPatch,
                                                read_path: str) -> None:
    """A back-to-back run of one-slot entries in slot order is read without the general path's
    header check (the run path's own checks apply); out of order, it takes the general one."""
    calls: list[int] = []
    real = SlotFile._idents_match

    def spy(self: SlotFile, slots: Any, want: Any) -> Any:
        calls.append(len(slots))
        return real(self, slots, want)

    monkeypatch.setattr(SlotFile, "_idents_match", spy)
    recs = [_put(sf, s, key_of(f"f{s}"), 2, SN) for s in range(8)]
    assert _same(sf, recs, True) == [0] * 8
    assert (calls == []) == (read_path == "fast")
    calls.clear()
    assert _same(sf, recs[::-1], True) == [0] * 8
    assert calls
