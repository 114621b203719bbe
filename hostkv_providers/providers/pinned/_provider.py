"""``pinned://`` — a budget-bounded arena of (page-locked, when CUDA is present) host memory.

The arena is cut into fixed-size *blocks*; an entry takes ``ceil(nbytes / block)`` blocks, a
contiguous run when one is free, else any free blocks (a scatter list).  So fragmentation can
never make a request that fits the budget unsatisfiable: any ``k`` free blocks will do.  Set
``block`` to the page size of the layout you store and every page is one contiguous region.

The arena is allocated in chunks; with ``background=true`` only the first chunk is allocated
before the constructor returns and the rest are pinned by a background thread, so start-up is not
blocked by pinning a large budget.  A reservation that needs memory not yet ready waits for the
next chunk before it evicts anything.

Ordinary (pageable) arena memory is faulted in by a background thread (``prefault=true``) with
``MADV_POPULATE_WRITE``, chunk after chunk in allocation order: a fresh anonymous mapping costs a
page fault per 4 KiB (or 2 MiB) page on first touch, which made the first ``put_many`` of a new
store run at a fraction of memcpy speed.  Page-locked memory is faulted in by its allocator.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from hostkv_providers._blockhash import TREE_ALGORITHM, tree_checksum_parts
from hostkv_providers._checks import check_flag, check_progress, check_retain_share, writable_buffer
from hostkv_providers._checksum import CHECKSUM_ALGORITHM, checksum_parts
from hostkv_providers._errors import InvalidArgumentError, UnknownKeyError
from hostkv_providers._keys import Key
from hostkv_providers._options import Option, OptionSet
from hostkv_providers._provider import Corrupt
from hostkv_providers._reports import EntryInfo, ProviderStats, VerifyReport
from hostkv_providers._span import ByteSpan
from hostkv_providers.device._hostmem import _MADV_POPULATE_WRITE, HostAllocator, OrdinaryAllocator, _madvise_fn
from hostkv_providers.providers._budget import physical_memory
from hostkv_providers.providers._counters import STORE_COUNTED
from hostkv_providers.providers.pinned._arena import _Arena, _gather, _PinnedIndex, _Token
from hostkv_providers.providers.pinned._batch import _Batches
from hostkv_providers.providers.pinned._run import _PinnedReservation

__all__ = ["PinnedProvider"]

_DEFAULT_BLOCK = 64 * 1024
_DEFAULT_CHUNK = 256 * 1024 * 1024
_PREFAULT_PIECE = 8 << 20  # one madvise call: close() waits at most this long for the prefaulter

class PinnedProvider(_Batches):
    """Budget-bounded host-memory provider (see the module docstring).

    Parameters
    ----------
    budget_bytes:
        The byte budget; the arena holds ``budget_bytes // block`` blocks.
    block:
        Block size in bytes (a multiple of 4 KiB).
    chunk:
        Allocation granularity of the arena (a multiple of ``block``).
    allocator:
        Where the memory comes from; default: page-locked CUDA memory when a GPU is usable,
        ordinary memory otherwise.
    background:
        Allocate all but the first chunk in a background thread.
    verify_reads:
        Check the seal-time checksum on every ``read`` (views are checked by their user: the
        cache verifies restores from views on the GPU).
    prefault:
        Fault ordinary (pageable) arena memory in on a background thread so that first writes
        run at memcpy speed (no effect on page-locked memory, which its allocator faults in).
    checksum:
        The entries' checksum algorithm: ``"xxh3-256k-tree"`` (default; a GPU computes it too, so
        a save from the GPU seals without hashing on the host) or ``"xxh3-64"`` (XXH3 of the
        whole entry; a little cheaper to compute on the host).
    """

    name = "pinned"
    #: The URL options (``docs/providers/pinned.md``'s table is checked against this).
    OPTIONS = OptionSet(
        "pinned",
        Option("budget", "size", 1 << 30, "1GiB"),
        Option("block", "size", _DEFAULT_BLOCK, "64KiB"),
        Option("chunk", "size", _DEFAULT_CHUNK, "256MiB"),
        Option("background", "bool", True, "true"),
        Option("verify", "choice", "never", "never", ("never", "read"), attr="_verify_mode"),
        # describe(): the memory in effect ("yes": page-locked), not the policy asked for
        Option("pin", "choice", "auto", "auto", ("auto", "yes", "no"), attr="_pin_effective"),
        Option("prefault", "bool", True, "true", attr="_prefault_on"),
        Option("mapped", "choice", "no", "no", ("no", "yes")),
        Option("device", "int", None, "0"),  # None: not given (only mapped=yes takes it)
        Option("retain_share", "number", 0.5, "0.5"),
        Option("checksum", "choice", TREE_ALGORITHM, TREE_ALGORITHM, (TREE_ALGORITHM, CHECKSUM_ALGORITHM),
               attr="checksum_algorithm"),
    )
    _reservation_type = _PinnedReservation

    def __init__(
        self,
        budget_bytes: int,
        *,
        block: int = _DEFAULT_BLOCK,
        chunk: int = _DEFAULT_CHUNK,
        allocator: HostAllocator | None = None,
        background: bool = False,
        verify_reads: bool = False,
        prefault: bool = True,
        retain_share: float = 0.5,
        checksum: str = TREE_ALGORITHM,
    ) -> None:
        super().__init__()
        self._retain_share = check_retain_share(retain_share)
        if checksum not in (TREE_ALGORITHM, CHECKSUM_ALGORITHM):
            raise InvalidArgumentError(f"checksum must be {TREE_ALGORITHM!r} or {CHECKSUM_ALGORITHM!r}, "
                                       f"got {checksum!r}")
        self.checksum_algorithm = checksum
        self._sum: Callable[[Iterable[object]], int] = (
            tree_checksum_parts if checksum == TREE_ALGORITHM else checksum_parts)
        if type(budget_bytes) is not int or budget_bytes <= 0:
            raise InvalidArgumentError(f"budget must be a positive int, got {budget_bytes!r}")
        if type(block) is not int or block <= 0 or block % 4096:
            raise InvalidArgumentError(f"block must be a positive multiple of 4096, got {block!r}")
        if type(chunk) is not int or chunk <= 0:
            raise InvalidArgumentError(f"chunk must be a positive int, got {chunk!r}")
        if budget_bytes < block:
            raise InvalidArgumentError(f"budget {budget_bytes} is smaller than one block ({block})")
        physical = physical_memory()
        if physical and budget_bytes > physical:
            # the arena is allocated as it fills: a budget beyond the machine's memory can only
            # end in an allocation failure (or the OOM killer) once the filler gets that far
            raise InvalidArgumentError(
                f"budget {budget_bytes} bytes exceeds this machine's memory ({physical} bytes)",
                hint="pinned:// holds its whole budget in host memory: lower the budget")
        chunk = max(block, min(chunk, budget_bytes) // block * block)
        self._budget = budget_bytes
        self._block = block
        self._chunk = chunk
        self._background = bool(background)
        self._verify_reads = verify_reads
        self._verify_mode = "read" if verify_reads else "never"
        self._mapped = "no"  # (the device option is described by MappedPinnedProvider only)
        if allocator is None:
            allocator = _default_allocator()
        self._allocator = allocator
        self._pin_effective = "yes" if allocator.pinned else "no"
        self._lock = threading.RLock()
        self._ready = threading.Condition(self._lock)
        self._arena = _Arena(block, chunk // block)
        self._index = _PinnedIndex(0)
        self._lease_tokens: dict[int, _Token] = {}  # live leases, by id of their token
        # Reads copying out of the arena without the lock (their rows held): close() waits for
        # them before it frees the chunks, or a read racing close indexes a cleared chunk list
        # (IndexError, caught by the hostile suite's close-while-writing race in CI) or copies
        # from freed pinned memory.  Counted under the lock the read takes anyway.
        self._copying = 0
        # dropped but still leased, by gen: (blocks, lease count)
        self._limbo: dict[int, tuple[list[tuple[int, int]], int]] = {}
        total_blocks = budget_bytes // block
        self._plan = [min(chunk // block, total_blocks - i) for i in range(0, total_blocks, chunk // block)]
        self._pinning_error: BaseException | None = None
        self._add_chunk(self._plan[0])
        self._pending = len(self._plan) - 1
        self._filler: threading.Thread | None = None
        if self._pending:
            if background:
                self._filler = threading.Thread(target=self._fill, name="hostkv-pinned-fill", daemon=True)
                self._filler.start()
            else:
                self._fill()
        self._prefaulter: threading.Thread | None = None
        self._prefaulted = threading.Event()
        self._prefault_on = bool(prefault)  # describe(): the option as given
        if prefault and not allocator.pinned:
            self._prefaulter = threading.Thread(target=self._prefault, name="hostkv-pinned-prefault", daemon=True)
            self._prefaulter.start()
        else:
            self._prefaulted.set()
        self._finalizer = weakref.finalize(self, _Arena.close, self._arena)

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def from_url(cls, location: str, options: Mapping[str, str]) -> PinnedProvider:
        o = cls.OPTIONS.parse(options)
        budget, block, chunk, background, verify, pin = (o["budget"], o["block"], o["chunk"], o["background"],
                                                         o["verify"], o["pin"])
        prefault = o["prefault"]
        mapped, device = o["mapped"], o["device"]  # device_mapped: providers/pinned/_mapped.py
        share = check_retain_share(o["retain_share"])
        if location not in ("", "/"):
            raise InvalidArgumentError(f"pinned:// takes no path, got {location!r}", hint="use pinned://?budget=8GiB")
        if mapped == "no" and device is not None:
            raise InvalidArgumentError("pinned:// takes device= only with mapped=yes")
        if mapped == "yes":
            device = 0 if device is None else device
            if pin == "no":
                raise InvalidArgumentError("mapped=yes needs page-locked memory; drop pin=no")
            from hostkv_providers.providers.pinned._mapped import MappedPinnedProvider

            return MappedPinnedProvider(budget, block=block, chunk=chunk, device=device, verify_reads=verify == "read",
                                        retain_share=share, checksum=o["checksum"])
        allocator: HostAllocator | None = OrdinaryAllocator() if pin == "no" else None
        if pin == "yes":
            allocator = _default_allocator(require_pinned=True)
        return cls(budget, block=block, chunk=chunk, allocator=allocator, background=background,
                   verify_reads=verify == "read", prefault=prefault, retain_share=share,
                   checksum=o["checksum"])

    def _add_chunk(self, nblocks: int) -> None:
        alloc = self._allocator.allocate(nblocks * self._block)
        with self._lock:
            if self._closed:
                alloc.close()
                return
            self._arena.add_chunk(alloc, nblocks)
            self._index.budget = self._arena.total * self._block
            self._ready.notify_all()

    def _fill(self) -> None:
        try:
            for nblocks in self._plan[1:]:
                if self._closed:
                    return
                self._add_chunk(nblocks)
                with self._lock:
                    self._pending -= 1
        except BaseException as exc:  # surfaced by reserve(); the ready part keeps serving
            with self._lock:
                self._pinning_error = exc
                self._pending = 0
                self._ready.notify_all()

    def _prefault(self) -> None:
        """Fault the arena's chunks in, in allocation order (the thread ``prefault`` starts).

        Only ``MADV_POPULATE_WRITE`` (Linux >= 5.14) is used: it maps pages without touching
        their bytes, so it may run while reservations write into the same chunk.  The ``memset``
        fallback of the pinned allocator cannot (it would clobber stored bytes), so a kernel
        without it just faults on first touch as before.  ``close`` joins this thread before
        the chunks are unmapped; each call covers at most ``_PREFAULT_PIECE`` bytes.
        """
        madvise = _madvise_fn()
        try:
            i = 0
            while True:
                with self._lock:
                    self._ready.wait_for(lambda i=i: self._closed or i < len(self._arena.chunks)  # type: ignore[misc]
                                         or not self._pending)
                    if self._closed or i >= len(self._arena.chunks):
                        return
                    chunk = self._arena.chunks[i]
                    address, nbytes = chunk.address, chunk.view.nbytes
                for lo in range(0, nbytes, _PREFAULT_PIECE):
                    if self._closed:
                        return
                    if madvise(address + lo, min(_PREFAULT_PIECE, nbytes - lo), _MADV_POPULATE_WRITE) != 0:
                        return  # unsupported (EINVAL), or out of memory: first touch faults instead
                i += 1
        finally:
            self._prefaulted.set()

    def wait_prefaulted(self, timeout: float | None = None) -> bool:
        """Wait until the background prefault (``prefault``) is over; ``True`` when it is."""
        return self._prefaulted.wait(timeout)

    @property
    def budget_bytes(self) -> int:
        return self._budget

    @property
    def block_nbytes(self) -> int:
        return self._block

    @property
    def views_pinned(self) -> bool:
        """Whether the arena (and so every view) is page-locked (``SupportsPinnedViews``)."""
        return self._allocator.pinned

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait until the whole arena is allocated; ``True`` when it is."""
        with self._lock:
            return self._ready.wait_for(lambda: self._pending == 0 or self._closed, timeout)

    # -- lookups -----------------------------------------------------------------------------
    # (the public verbs are the front's, in Provider; these are the drivers it calls)
    def _present(self, keys: Sequence[bytes]) -> list[bool]:
        with self._usable():
            return self._membership(keys, self._index.contains_fn)

    def _longest_prefix(self, keys: Sequence[bytes]) -> int:
        with self._usable():
            hits = self._membership(keys, self._index.contains_fn)
        return hits.index(False) if False in hits else len(hits)

    def _in_flight(self, k: Key) -> bool:
        with self._usable():
            return k in self._index.flights

    def _entry(self, k: Key) -> EntryInfo | None:
        with self._usable():
            row = self._index.row_of(k)
            return None if row < 0 else _info(self._index, row)

    def iter_entries(self) -> Iterator[EntryInfo]:
        with self._usable():
            idx = self._index
            infos = [_info(idx, int(r)) for r in idx.live_rows()]
        return iter(infos)

    # -- retained entries (SupportsRetain) ---------------------------------------------------
    def retain(self, keys: Sequence[bytes]) -> int:
        """Mark entries retained (see ``SupportsRetain``): never evicted for room."""
        ks = self._keys(keys)
        with self._usable():
            rows = self._index.rows_of(ks)
            _check_present(ks, rows)
            return self._index.retain_rows(rows, int(self._retain_share * self._budget))

    def unretain(self, keys: Sequence[bytes]) -> int:
        """Clear retain marks (keys not marked or not stored are ignored)."""
        ks = self._keys(keys)
        with self._usable():
            return self._index.unretain_rows(self._index.rows_of(ks))

    # -- reads -------------------------------------------------------------------------------
    def _read(self, k: Key, out: object, span: ByteSpan | None) -> int | Corrupt | None:
        idx = self._index
        with self._usable():
            row = idx.row_of(k)
            if row < 0:
                return None
            nbytes, gen, runs, digest = idx.m_nbytes[row], idx.m_gen[row], idx.runs(row), idx.checksum_of(row)
            span = ByteSpan.whole(nbytes) if span is None else span.validate(nbytes)
            dst = writable_buffer(out, span.nbytes)
            held = self._hold_rows([row])
            self._copying += 1
        # The copy runs without the lock (the hold stops eviction).  Only a checksum drop — by
        # another reader or verify(repair=True) — can free a held entry's blocks meanwhile, and
        # it removes the row first; so an entry still live after the copy had its bytes all along.
        try:
            regions = self._arena.regions(runs, nbytes, False)
            if not self._verify_reads:
                _gather(regions, span, dst)
                ok = True
            elif span.nbytes == nbytes:
                # Whole entry: checksum the copy itself, so the bytes handed out are exactly the
                # bytes verified (no window between checking the arena and copying from it).
                _gather(regions, span, dst)
                ok = self._sum((dst,)) == digest
            else:
                ok = self._sum(r.view for r in regions) == digest
                if ok:
                    _gather(regions, span, dst)
        except BaseException:
            with self._lock:
                idx.release_rows(*held)
                self._copied()
            raise
        with self._lock:
            idx.release_rows(*held)
            self._copied()
            if not idx.is_live(row, gen):
                return None  # dropped or evicted meanwhile: a miss
            return span.nbytes if ok else Corrupt((row, gen))

    def _drop_damaged(self, k: Key, token: object) -> bool:
        with self._lock:
            if self._closed or not isinstance(token, tuple) or not self._index.is_live(*token):
                return False  # another reader (or verify) dropped it first
            self._drop(token[0])
            return True

    # -- anchors -----------------------------------------------------------------------------
    def _put_anchor(self, k: Key, name: str, blob: bytes) -> None:
        with self._usable():
            idx = self._index
            row = idx.row_of(k)
            if row < 0:
                raise UnknownKeyError(f"entry {k.hex()[:16]} is not stored", hint="seal the page before its anchors")
            table = idx.anchors.get(row)
            old = table.get(name) if table else None
            delta = len(blob) - (len(old) if old is not None else 0)
            self._free_rows(idx.add_cost(row, delta, int(self._retain_share * self._budget)))
            idx.anchors.setdefault(row, {})[name] = blob

    def _get_anchor(self, k: Key, name: str) -> bytes | None:
        with self._usable():
            row = self._index.row_of(k)
            table = self._index.anchors.get(row) if row >= 0 else None
            blob = table.get(name) if table else None
            return None if blob is None else bytes(blob)

    def _list_anchors(self, k: Key) -> dict[str, int]:
        with self._usable():
            row = self._index.row_of(k)
            table = self._index.anchors.get(row) if row >= 0 else None
            return {n: len(b) for n, b in table.items()} if table else {}

    def _deepest_anchor(self, ks: list[Key], name: str) -> int:
        with self._usable():
            idx = self._index
            best = 0
            for i, row in enumerate(idx.rows_of(ks)):
                if row < 0:
                    break
                table = idx.anchors.get(row)
                if table and name in table:
                    best = i + 1
            return best

    # -- verification ------------------------------------------------------------------------
    def verify(self, *, repair: bool = False, progress: Any = None) -> VerifyReport:
        """Recompute every entry's checksum; ``repair`` drops corrupt ones with their subtrees."""
        check_flag(repair, "repair")
        check_progress(progress)
        report = VerifyReport()
        idx = self._index
        with self._usable():
            rows = idx.live_rows().tolist()
            gens = idx.gen[rows].tolist()
        for i, (row, gen) in enumerate(zip(rows, gens, strict=True)):
            with self._lock:
                if not idx.is_live(row, gen):
                    continue
                nbytes = int(idx.nbytes[row])
                regions = self._arena.regions(idx.runs(row), nbytes, False)
                ok = self._sum(r.view for r in regions) == idx.checksum_of(row)
                report.checked += 1
                if not ok:
                    report.corrupt.append(idx.key_of(row))
                    if repair:
                        report.dropped += len(self._drop(row))
            if progress is not None:
                progress(i + 1, len(rows))
        return report

    # -- the rest ----------------------------------------------------------------------------
    def stats(self) -> ProviderStats:
        with self._usable():
            idx = self._index
            return ProviderStats(
                name=self.name,
                budget_bytes=self._budget,
                **idx.stats_fields(),
                extra={"ready_bytes": self.ready_bytes, "block_nbytes": self._block, "limbo_entries": len(self._limbo),
                       "pinned": self._allocator.pinned, "free_blocks": self._arena.free},
                **self._tallies(),
            )

    def store_counters(self) -> dict[str, int]:
        """The store's counters (:class:`~hostkv_providers.providers.SupportsStoreCounters`).
        In-process only: a pinned arena lives in its process's memory, so the store *is* this
        instance and no other process can see it (``hostkv stats pinned://`` opens a new, empty
        arena; an engine's figures come from its Prometheus collector)."""
        st = self.stats()
        return {k: int(getattr(st, k)) for k in STORE_COUNTED}

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "pinned": self._allocator.pinned, "ready_bytes": self.ready_bytes}

    def close(self) -> None:
        self._check_not_forked()  # the child must not free the parent's arena
        if not self._closed:
            # Writes copy into the arena without the provider lock (a reservation's blocks are
            # its writer's): wait for the write-path calls under way before the arena is freed,
            # or a write racing close() indexes freed chunks (IndexError) or copies into memory
            # that is gone (the hostile suite's close-while-writing race caught it).
            self._quiesce()
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._ready.notify_all()
        if self._filler is not None and self._filler is not threading.current_thread():
            self._filler.join()
        if self._prefaulter is not None and self._prefaulter is not threading.current_thread():
            self._prefaulter.join()  # it must be out of madvise before the chunks are unmapped
        with self._lock:
            while self._copying:  # reads copying out of the arena (they finish; none can start)
                self._ready.wait()
            self._finalizer()

def _info(idx: _PinnedIndex, row: int) -> EntryInfo:
    table = idx.anchors.get(row)
    anchors = {n: len(b) for n, b in table.items()} if table else {}
    return EntryInfo(idx.key_of(row), idx.parent_key(row), int(idx.nbytes[row]), idx.tag_of(row),
                     idx.checksum_of(row), float(idx.created[row]), float(idx.used[row]), anchors,
                     bool(idx.retained[row]))

def _check_present(keys: Sequence[Key], rows: Sequence[int]) -> None:
    """``retain``'s all-or-nothing rule: every key must be sealed."""
    for k, r in zip(keys, rows, strict=True):
        if r < 0:
            raise UnknownKeyError(f"entry {k.hex()[:16]} is not stored; nothing was retained",
                                  hint="retain sealed entries only (save the prefix first)")

def _default_allocator(require_pinned: bool = False) -> HostAllocator:
    """Page-locked CUDA memory when a GPU is usable, else ordinary memory."""
    try:
        from hostkv_providers.device._hostmem import pinned_allocator
    except ImportError:  # the copy engine is optional at import time; ordinary memory still works
        pass
    else:
        alloc = pinned_allocator()
        if alloc is not None:
            return alloc
    if require_pinned:
        raise InvalidArgumentError("pin=yes but no CUDA device is usable", hint="use pin=auto or pin=no")
    return OrdinaryAllocator()
