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

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, cast

import numpy as np
import numpy.typing as npt

from hostkv_providers._blockhash import TREE_ALGORITHM, tree_checksum_parts
from hostkv_providers._chain import ReservedChain, _check_checksums
from hostkv_providers._checks import check_flag, check_progress, check_retain_share, writable_buffer
from hostkv_providers._checksum import CHECKSUM_ALGORITHM, checksum_parts
from hostkv_providers._errors import (
    CapacityError,
    ClosedError,
    HostKVError,
    InFlightError,
    InvalidArgumentError,
    UnknownKeyError,
)
from hostkv_providers._keys import Key
from hostkv_providers._options import Option, OptionSet
from hostkv_providers._provider import Corrupt, Provider
from hostkv_providers._region import HostPages, HostRegion
from hostkv_providers._reports import EntryInfo, EvictReport, ProviderStats, VerifyReport
from hostkv_providers._reservation import Lease, Reservation
from hostkv_providers._span import ByteSpan
from hostkv_providers.device._hostmem import (
    _MADV_POPULATE_WRITE,
    HostAllocator,
    OrdinaryAllocator,
    _madvise_fn,
    copy_bytes,
)
from hostkv_providers.providers._budget import physical_memory
from hostkv_providers.providers._counters import STORE_COUNTED
from hostkv_providers.providers.pinned._arena import (
    _Arena,
    _blocks_cost,
    _checksums,
    _gather,
    _PinnedIndex,
    _scatter,
    _Token,
)
from hostkv_providers.providers.pinned._run import _PinnedReservation, _PinnedRun

_NO_GEN = np.uint64(2**64 - 1)  # a lease token's gen for a page let go early (_release_part)

__all__ = ["PinnedProvider"]

_DEFAULT_BLOCK = 64 * 1024
_DEFAULT_CHUNK = 256 * 1024 * 1024
_PREFAULT_PIECE = 8 << 20  # one madvise call: close() waits at most this long for the prefaulter


class PinnedProvider(Provider):
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

    @property
    def ready_bytes(self) -> int:
        """Bytes of the arena allocated (and pinned) so far."""
        return self._arena.total * self._block

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait until the whole arena is allocated; ``True`` when it is."""
        with self._lock:
            return self._ready.wait_for(lambda: self._pending == 0 or self._closed, timeout)

    @contextlib.contextmanager
    def _usable(self) -> Iterator[None]:
        """Hold the provider lock after checking the provider is open and not inherited by fork.

        The check runs *before* taking the lock as well: in a forked child the lock may have been
        copied while another thread of the parent held it, and waiting on it would hang forever.
        """
        self._check_usable()
        with self._lock:
            self._check_usable()
            yield

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

    # -- writes ------------------------------------------------------------------------------
    def _reserve(self, k: Key, p: Key | None, nbytes: int, salt_tag: str) -> Reservation | None:
        with self._usable():
            return self._reserve_locked(k, p, nbytes, salt_tag)

    def _wait_for_memory(self, cost: int) -> None:
        """(Lock held.)  Prefer memory still being pinned over evicting entries that could be
        hits: wait while the arena is still filling and ``cost`` more does not fit."""
        while self._pending and self._index.used_cost + cost > self._index.budget:
            self._ready.wait(0.5)
            self._check_usable()
            if self._closing:  # (close() waits for this call: do not wait for memory meanwhile)
                raise ClosedError(f"{type(self).__name__} is closing")

    def _reserve_locked(self, k: Key, p: Key | None, nbytes: int, salt_tag: str,
                        chained: bool = False) -> _PinnedReservation | None:
        """Reserve under the provider lock (``None``: already stored); ``chained``: the parent may
        be in flight (``reserve_many``)."""
        nblocks = -(-nbytes // self._block)
        cost = nblocks * self._block
        if cost > self._budget:
            raise CapacityError(f"{nbytes} bytes exceed the whole budget of {self._budget}")
        if not self._index.contains(k):
            self._wait_for_memory(cost)
        try:
            ok, evicted, _ = (self._index.begin_chained if chained else self._index.begin)(k, p, cost)
        except CapacityError as exc:
            if self._pinning_error is None:
                raise
            # part of the arena could not be allocated: say so instead of a bare budget error
            raise CapacityError(
                f"{exc.message}; only {self.ready_bytes} of {self._budget} bytes could be allocated "
                f"({self._pinning_error!r})",
                hint="lower the budget or free host memory (pinned memory is limited by ulimit -l)",
            ) from self._pinning_error
        if not ok:
            return None  # dedup (counted by the caller)
        self._free_rows(evicted)
        runs = self._arena.allocate(nblocks)
        return _PinnedReservation(self, k, p, nbytes, salt_tag, runs)

    def _write(self, res: _PinnedReservation, span: ByteSpan, view: memoryview) -> None:
        # No provider lock: the reservation's blocks are private to its writer until seal.
        _scatter(res._regions, span, view)

    def _seal(self, res: _PinnedReservation) -> None:
        digest = self._sum(r.view for r in res._regions)
        with self._usable():
            res.check_open(self)
            self._commit_locked(res, digest)

    def _commit_locked(self, res: _PinnedReservation, digest: int) -> int:
        idx = self._index
        try:
            row = idx.commit(res.key, nbytes=res.nbytes, csum=digest, tag=res.salt_tag,
                             run_start=res.runs[0][0], run_len=res.runs[0][1])
        except UnknownKeyError:
            self._arena.release(res.runs)
            res._finish("aborted")
            raise
        if len(res.runs) > 1:
            idx.scatter[row] = res.runs
        res._finish("sealed")
        return row

    # -- chain reservation -------------------------------------------------------------------
    def reserve_many(self, keys: Sequence[bytes], parents: Sequence[bytes | None], nbytes: int, *,
                     salt_tag: str = "") -> ReservedChain:
        """Arena reservations for a chain run in one lock round (see ``Provider.reserve_many``):
        a parent may be in flight (reserved earlier in this call or an earlier one), so a copy
        engine DMAs a whole chain straight into the arena before the first seal."""
        ks = self._keys(keys)
        if isinstance(parents, (bytes, bytearray, memoryview, str)) or len(parents) != len(ks):
            raise InvalidArgumentError(f"{len(parents)} parents for {len(ks)} keys; give one per key")
        if len(ks) > 1 and list(parents[1:]) == ks[:-1]:
            # a chain run (each page's parent the page before): try it as one run, no per-page objects
            _k0, p0, n = self._reserve_args(ks[0], parents[0], nbytes, salt_tag)
            chain = self._reserve_run(ks, p0, n, salt_tag)
            if chain is not None:
                return chain
        checked = [self._reserve_args(k, p, nbytes, salt_tag) for k, p in zip(ks, parents, strict=True)]
        out: list[Reservation | None] = []
        error: HostKVError | None = None
        with self._usable():
            for k, p, n in checked:
                try:
                    out.append(self._reserve_locked(k, p, n, salt_tag, chained=True))
                except (CapacityError, InFlightError, UnknownKeyError) as exc:
                    error = exc
                    break
        return ReservedChain(out, error, self._chain_pages(out, nbytes))

    def _reserve_run(self, ks: list[Key], parent: Key | None, nbytes: int, salt_tag: str) -> ReservedChain | None:
        """The chain run ``ks`` (all new) as one :class:`_PinnedRun`, or ``None`` when it is not
        the plain case (see ``TreeIndex.begin_run``) or the arena is too fragmented: the caller
        then reserves page by page.  ``ks[0]`` and ``parent`` were validated; the other keys are
        validated ``Key``s (``_keys``) and so are their parents (the keys before them)."""
        nblocks = -(-nbytes // self._block)
        cost = nblocks * self._block
        if cost * len(ks) > self._budget or len(set(ks)) != len(ks) or parent in ks:
            return None
        with self._usable():
            idx = self._index
            self._wait_for_memory(cost * len(ks))
            begun = idx.begin_run(ks, parent, cost)
            if begun is None:
                return None
            run, evicted = begun
            self._free_rows(evicted)
            starts = self._arena.allocate_pages(len(ks), nblocks)
            if starts is None:
                idx.cancel_run(run)
                return None
        pr = _PinnedRun(self, run, ks, parent, nbytes, salt_tag, starts, nblocks)
        return ReservedChain(error=None, pages=self._pages_at(starts, nbytes), run=pr)

    def _pages_at(self, starts: npt.NDArray[np.int64], nbytes: int) -> HostPages:
        """The pages starting at arena blocks ``starts`` as one :class:`HostPages`."""
        arena = self._arena
        bases = np.array([c.address for c in arena.chunks], dtype=np.uint64)
        addrs = bases[starts // arena.bpc] + (starts % arena.bpc).astype(np.uint64) * np.uint64(arena.block)
        return HostPages(addrs, nbytes, pinned=self._allocator.pinned, readonly=False)

    def _chain_pages(self, out: Sequence[Reservation | None], nbytes: int) -> HostPages | None:
        """The reserved pages as one :class:`HostPages` (addresses in a numpy array) when each is
        one contiguous run of the arena: what a copy engine DMAs a chunk into."""
        starts = []
        arena = self._arena
        for r in out:
            if r is None:
                continue
            runs = r.runs  # type: ignore[attr-defined]
            if len(runs) != 1:
                return None
            starts.append(runs[0][0])
        if not starts:
            return None
        st = np.array(starts, dtype=np.int64)
        bases = np.array([c.address for c in arena.chunks], dtype=np.uint64)
        addrs = bases[st // arena.bpc] + (st % arena.bpc).astype(np.uint64) * np.uint64(arena.block)
        return HostPages(addrs, nbytes, pinned=self._allocator.pinned, readonly=False)

    def seal_many(self, reservations: Sequence[Reservation], *, checksums: Sequence[int] | None = None,
                  algorithm: str | None = None) -> None:
        """Seal arena reservations root first (see ``Provider.seal_many``): the checksums run on
        a few threads without the lock (XXH3 releases the GIL), the commits in one lock round.
        Given ``checksums`` in this store's algorithm (a GPU's, over the pages before their copy)
        are recorded as they are: no host hashing at all."""
        self._seal_own([self._own_reservation(r, _PinnedReservation) for r in reservations], checksums, algorithm)

    def _seal_held(self, reservations: Sequence[Reservation], held: list[Lease], *,
                   checksums: Sequence[int] | None = None, algorithm: str | None = None) -> None:
        """``seal_many`` that also leases each page in its commit's lock round, appending the
        leases to ``held`` (a sealed prefix's, also when it raises).  The tiered provider pins
        its fast copies this way until their write-back: a lease taken after the seal left a
        window in which another save's reservation could evict the just-sealed page."""
        self._seal_own([self._own_reservation(r, _PinnedReservation) for r in reservations], checksums, algorithm,
                       held)

    def _seal_own(self, own: list[_PinnedReservation], checksums: Sequence[int] | None, algorithm: str | None,
                  held: list[Lease] | None = None) -> None:
        _check_checksums(checksums, algorithm, len(own))
        self._check_usable()
        with self._write_call():  # (a close waits for it: the hashing below reads the arena unlocked)
            self._seal_counted(own, checksums, algorithm, held)

    def _seal_counted(self, own: list[_PinnedReservation], checksums: Sequence[int] | None, algorithm: str | None,
                      held: list[Lease] | None) -> None:
        try:
            for r in own:
                r.check_complete()
            if checksums is not None and algorithm == self.checksum_algorithm:
                digests = [int(c) for c in checksums]
            else:
                digests = _checksums([r._regions for r in own], self._sum)
            sealed = 0
            try:
                with self._usable():
                    for r, digest in zip(own, digests, strict=True):
                        r.check_open(self)
                        row = self._commit_locked(r, digest)  # UnknownKeyError: its parent was not sealed
                        sealed += 1
                        if held is not None:
                            held += self._leases_at([r.key], [row])
            finally:
                # (bytes are counted where they are written: write(), or not at all for a DMA
                # straight into the arena; seals are counted as the front's seal does, once a batch)
                if sealed:
                    self._tally("seals", sealed)
        except BaseException:
            for r in own:  # the sealed ones are a prefix; the rest go
                if r.state == "open":
                    with contextlib.suppress(HostKVError):
                        self.abort(r)
            raise

    # -- batches -----------------------------------------------------------------------------
    def put_many(self, items: Sequence[tuple[bytes, bytes | None, object]], *,
                 salt_tag: str = "") -> list[bool | HostKVError]:
        """Store many pages, root first (:class:`~hostkv_providers.SupportsBatch`).

        Per item ``True`` (stored), ``False`` (already stored) or that item's error
        (``InFlightError``, ``CapacityError``, ``UnknownKeyError`` — also for every item whose
        parent failed in this call).  Each page costs two lock rounds (reserve, commit) and a
        copy and a checksum that run without the GIL; the page just stored stays held until
        the next one is reserved under it, so a chain's tail cannot be evicted mid-call and
        each reservation is O(1) in the tree index.
        """
        checked = self._put_many_args(items, salt_tag)
        self._check_usable()
        with self._write_call():  # (a close waits for it: the copies and hashes use the arena unlocked)
            stored = self._put_run(checked, salt_tag)
            return stored if stored is not None else self._put_pages(checked, salt_tag)

    def _put_pages(self, checked: list[tuple[Key, Key | None, memoryview]],
                   salt_tag: str) -> list[bool | HostKVError]:
        """``put_many`` page by page: two lock rounds a page (reserve, commit)."""
        out: list[bool | HostKVError] = []
        failed: set[Key] = set()
        held: _Token = ([], [])
        try:
            for k, p, view in checked:
                orphan = self._failed_parent(p, failed, k)
                if orphan is not None:
                    out.append(orphan)
                    continue
                try:
                    with self._usable():
                        res = self._reserve_locked(k, p, view.nbytes, salt_tag)
                        # the reservation now holds its parent: the previous hold can go
                        self._index.release_rows(*held)
                        held = self._hold_keys([k]) if res is None else ([], [])
                    if res is None:
                        self._tally("dedup")
                        out.append(False)
                        continue
                    try:
                        _scatter(res._regions, ByteSpan.whole(view.nbytes), view)
                        digest = self._sum(r.view for r in res._regions)
                    except BaseException:
                        self.abort(res)
                        raise
                    with self._usable():
                        res.check_open(self)
                        self._commit_locked(res, digest)
                        held = self._hold_keys([k])
                    self._tally("seals")
                    self._tally("bytes_written", view.nbytes)
                    out.append(True)
                except (CapacityError, InFlightError, UnknownKeyError) as exc:
                    failed.add(k)
                    out.append(exc)
        finally:
            if held[0]:
                with self._lock:
                    self._index.release_rows(*held)
        return out

    def _put_run(self, checked: list[tuple[Key, Key | None, memoryview]],
                 salt_tag: str) -> list[bool | HostKVError] | None:
        """``put_many`` of a chain run of new pages of one size under a sealed parent (or none)
        as one run (``_reserve_run``): one lock round to reserve, the copies, the checksums on a
        few threads and one commit — not two lock rounds and a hash call per page (a tiered
        store promoting a restart's restore into its fast tier spent 80% of the restore here at
        4 KiB pages).  ``None``, with nothing stored, when it is not that case or the run cannot
        be had as one: the caller then stores page by page, which gives each item its exact
        outcome (dedup, ``InFlightError``, a prefix on ``CapacityError``)."""
        n = len(checked)
        if n < 2:
            return None
        ks = [c[0] for c in checked]
        parent, nbytes = checked[0][1], checked[0][2].nbytes
        if (ks[:-1] != [c[1] for c in checked[1:]] or any(c[2].nbytes != nbytes for c in checked)
                or not nbytes):
            return None
        with self._usable():
            if parent is not None and self._index.row_of(parent) < 0:
                return None  # (not sealed: put_many stores under sealed parents only)
        rc = self._reserve_run(ks, parent, nbytes, salt_tag)
        if rc is None:
            return None
        run = rc.run
        assert isinstance(run, _PinnedRun)
        try:
            chunks, bpc, block = self._arena.chunks, self._arena.bpc, self._arena.block
            for (_k, _p, view), st in zip(checked, run.starts.tolist(), strict=True):
                lo = (st % bpc) * block
                copy_bytes(chunks[st // bpc].view[lo : lo + nbytes], view)
            run.written = True
            run.seal(None, None)
        except UnknownKeyError:
            return None  # the parent dropped meanwhile (the run cancelled itself): page by page
        except BaseException:
            with contextlib.suppress(HostKVError):
                run.abort()
            raise
        self._tally("bytes_written", n * nbytes)
        return [True] * n

    def read_many(self, keys: Sequence[bytes], outs: Sequence[object]) -> list[bool]:
        """Whole entries into ``outs[i]`` (:class:`~hostkv_providers.SupportsBatch`): one lock
        round to find and hold them all, the copies (and checksums, with ``verify_reads``)
        without the lock or the GIL, one lock round to release.  A miss leaves ``outs[i]``
        untouched; an ``outs[i]`` smaller than its entry raises ``InvalidArgumentError`` after
        the others were filled."""
        ks, outs = self._read_many_args(keys, outs)
        idx = self._index
        with self._usable():
            rows = idx.rows_of(ks)
            held = self._hold_rows(rows)
            # what the copies need, read under the lock (a row may be recycled once released)
            found = [(r, int(idx.gen[r]), int(idx.nbytes[r]), idx.runs(r), idx.checksum_of(r)) if r >= 0 else None
                     for r in rows]
            self._copying += 1
        # per key: None (miss or buffer too small), True (copied, checksum ok), False (bad copy)
        state: list[bool | None] = [None] * len(ks)
        short: InvalidArgumentError | None = None
        try:
            for i, f in enumerate(found):
                if f is None:
                    continue
                _, _, nbytes, runs, digest = f
                try:
                    dst = writable_buffer(outs[i], nbytes)
                except InvalidArgumentError as exc:
                    short = short or exc
                    continue
                _gather(self._arena.regions(runs, nbytes, False), ByteSpan.whole(nbytes), dst)
                state[i] = not self._verify_reads or self._sum((dst,)) == digest
        finally:
            got = [False] * len(ks)
            hits = nbytes = failures = 0
            with self._lock:
                idx.release_rows(*held)
                self._copied()
                for i, (f, st) in enumerate(zip(found, state, strict=True)):
                    if f is None or not idx.is_live(f[0], f[1]):
                        continue
                    if st is True:
                        got[i] = True
                        hits += 1
                        nbytes += f[2]
                    elif st is False:
                        # first to see the corruption: drop the entry with its subtree
                        failures += 1
                        self._drop(f[0])
            self._tally("hits", hits)
            self._tally("bytes_read", nbytes)
            self._tally("checksum_failures", failures)
            self._tally("misses", len(ks) - hits)
        if short is not None:
            raise short
        return got

    def _abort(self, reservation: _PinnedReservation) -> bool:
        with self._usable():
            if reservation.state != "open":
                return False  # a racing seal or abort finished it
            self._index.cancel(reservation.key)
            self._arena.release(reservation.runs)
            reservation._finish("aborted")
            return True

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

    def view(self, lease: Lease, key: bytes) -> Sequence[HostRegion] | None:
        """Read-only host regions of a leased entry (valid while the lease is held)."""
        return self.views(lease, [key])[0]

    def views(self, lease: Lease, keys: Sequence[bytes]) -> list[Sequence[HostRegion] | None]:
        """:meth:`view` of many keys under one lock round (``None`` for a key not leased)."""
        ks = self._keys(keys)
        if not isinstance(lease, Lease) or lease.released or lease.token is None or lease._provider is not self:
            raise InvalidArgumentError("view() needs an unreleased lease of this provider")
        held = self._held(lease)
        out: list[Sequence[HostRegion] | None] = []
        pinned = self._allocator.pinned
        with self._usable():
            idx, regions = self._index, self._arena.regions
            gen = idx.m_gen
            for row in idx.rows_of(ks):
                if row < 0 or held.get(row, -1) != gen[row]:
                    out.append(None)
                else:
                    out.append(regions(idx.runs(row), int(idx.nbytes[row]), pinned, readonly=True))
        return out

    @staticmethod
    def _held(lease: Lease) -> dict[int, int]:
        """The rows ``lease`` holds, with their gens.  What a lease holds is its token's (row,
        gen) pairs, not its keys: an entry dropped and saved again under the same key, or a page
        let go early (``_release_part``), is not held by it any more."""
        t_rows, t_gens = cast(_Token, lease.token)
        return dict(zip(t_rows.tolist() if isinstance(t_rows, np.ndarray) else t_rows,
                        t_gens.tolist() if isinstance(t_gens, np.ndarray) else t_gens, strict=True))

    def view_pages(self, lease: Lease, keys: Sequence[bytes]) -> HostPages | None:
        """:meth:`views` as one :class:`HostPages` (an address per page, no per-page objects), or
        ``None`` unless every key is leased, of one size and in one contiguous run of the arena
        (always so when ``block`` is the page size)."""
        if not isinstance(lease, Lease) or lease.released or lease.token is None or lease._provider is not self:
            raise InvalidArgumentError("view_pages() needs an unreleased lease of this provider")
        # The common case, a run of the lease's own keys (a restore of a hit, whole or part by
        # part): the lease's token already names their rows, so the keys are matched by one
        # C-speed slice comparison (equal to the lease's keys: valid keys, no further check) and
        # the rows checked by generation, not looked up one by one.
        known = self._leased_rows(lease, keys) if isinstance(keys, list | tuple) and keys else None
        ks: list[Key] = cast(list[Key], list(keys)) if known is not None else self._keys(keys)
        held = self._held(lease) if known is None else None
        with self._usable():
            idx, arena = self._index, self._arena
            if known is not None:
                rows, gens = known
                if not len(rows) or (rows < 0).any() or not (idx.alive[rows].all() and (idx.gen[rows] == gens).all()):
                    return None  # an entry of the lease was dropped (corrupt) meanwhile
            else:
                assert held is not None
                rows = np.asarray(idx.rows_of(ks), dtype=np.int64)
                gen = idx.m_gen
                # (what the lease holds, as views(): not its keys)
                if not len(rows) or (rows < 0).any() or any(held.get(r, -1) != gen[r] for r in rows.tolist()):
                    return None
            if idx.scatter and any(r in idx.scatter for r in rows.tolist()):
                return None  # a scattered entry is not one run
            sizes = idx.nbytes[rows]
            nbytes = int(sizes[0])
            if not nbytes or (sizes != nbytes).any():
                return None
            starts = idx.run_start[rows]
            bases = np.array([c.address for c in arena.chunks], dtype=np.uint64)
            addrs = bases[starts // arena.bpc] + ((starts % arena.bpc) * arena.block).astype(np.uint64)
            # for a verification of the copied bytes on the GPU (with verify=read)
            sums = idx.csum[rows].copy() if self._verify_reads else None
        # With verify=read the checksums go with the views: the cache checks the copied bytes
        # on the GPU (a view is never checked here: that would read every byte on the host).
        return HostPages(addrs, nbytes, pinned=self._allocator.pinned, readonly=True, keepalive=lease,
                         checksums=sums, algorithm=self.checksum_algorithm)

    @staticmethod
    def _leased_rows(lease: Lease, ks: Sequence[bytes]) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.uint64]] | None:
        """The ``(rows, gens)`` of ``ks`` from ``lease``'s token when ``ks`` is a run of the
        lease's keys (``lease.keys[j]`` is ``token[0][j]``), else ``None``."""
        lk = lease.keys
        n = len(ks)
        if not n or n > len(lk):
            return None
        j = 0
        if lk[0] != ks[0]:
            try:
                j = lk.index(ks[0])
            except ValueError:
                return None
        if lk[j : j + n] != tuple(ks):
            return None
        token: _Token = lease.token  # type: ignore[assignment]
        token_rows, token_gens = token
        return (np.asarray(token_rows[j : j + n], dtype=np.int64),
                np.asarray(token_gens[j : j + n], dtype=np.uint64))

    # -- eviction ----------------------------------------------------------------------------
    def _evict(self, ks: list[Key] | None, nbytes: int) -> EvictReport:
        with self._usable():
            idx = self._index
            if ks is not None:
                removed, skipped = idx.evict_rows(idx.rows_of(ks))
            else:
                removed, skipped = idx.evict_cost(nbytes), 0
            freed = int(idx.nbytes[removed].sum()) if removed else 0
            self._free_rows(removed)
            return EvictReport(len(removed), freed, skipped)

    def _entry_regions(self, key: bytes) -> list[HostRegion] | None:
        """The arena regions of a sealed entry, or ``None`` (the tests' backdoor into the memory)."""
        with self._lock:
            row = self._index.row_of(key)
            if row < 0:
                return None
            return self._arena.regions(self._index.runs(row), int(self._index.nbytes[row]), False)

    def _free_rows(self, rows: Sequence[int]) -> None:
        """Give removed rows' blocks back to the arena and the rows to the index."""
        idx = self._index
        if len(rows) > 8 and not idx.scatter:
            # (a chain evicted for room: its pages' blocks go back as runs, not page by page)
            arr = np.asarray(rows, dtype=np.int64)
            lens = idx.run_len[arr]
            if int(lens.min()) == int(lens.max()):
                self._arena.release_pages(idx.run_start[arr], int(lens[0]))
                self._recycle(rows)
                return
        for row in rows:
            self._arena.release(idx.runs(row))
        self._recycle(rows)

    def _recycle(self, rows: Sequence[int]) -> None:
        idx = self._index
        if idx.scatter or idx.anchors:
            for row in rows:
                idx.scatter.pop(row, None)
                idx.anchors.pop(row, None)
        idx.recycle(rows)

    def _drop(self, row: int) -> list[int]:
        """Force-remove a corrupt entry with its subtree (caller holds the lock).

        Leases are not honoured by a drop (the bytes are known bad), but a lease holder may be
        reading the entry's blocks zero-copy through :meth:`view` (a DMA in flight).  Reusing
        those blocks for another entry would hand that reader *another entry's* bytes, so the
        blocks of a leased dropped entry stay allocated and accounted — in limbo — until the last
        lease on it is released.
        """
        idx = self._index
        gens = {r: int(idx.gen[r]) for r in idx.subtree([row])}
        dropped = idx.drop(row)
        if not dropped:
            return dropped
        dead = set(gens.values())
        pins: dict[int, int] = {}
        for _rows, token_gens in self._lease_tokens.values():
            for g in token_gens.tolist() if isinstance(token_gens, np.ndarray) else token_gens:
                if g in dead:
                    pins[g] = pins.get(g, 0) + 1
        for r in dropped:
            count = pins.get(gens[r], 0)
            runs = idx.runs(r)
            if count:
                self._limbo[gens[r]] = (runs, count)
                idx.used_cost += _blocks_cost(runs, self._block)
            else:
                self._arena.release(runs)
        self._recycle(dropped)
        return dropped

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
            self._free_rows(idx.add_cost(row, delta))
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

    # -- leases ------------------------------------------------------------------------------
    def _hold_rows(self, rows: Sequence[int]) -> _Token:
        """Hold the present ``rows`` (lock held); the ``(rows, gens)`` token releases them."""
        idx = self._index
        if len(rows) > 8:
            # arrays (a chain's lease): view_pages slices them for a restore with no conversion
            arr = np.asarray(rows, dtype=np.int64)
            arr = arr[arr >= 0]
            idx.hold_rows(cast(Sequence[int], arr))  # (numpy rows: it takes them by slices)
            return arr, idx.gen[arr]
        live = [r for r in rows if r >= 0]
        idx.hold_rows(live)
        gen = idx.m_gen
        return live, [gen[r] for r in live]

    def _copied(self) -> None:
        """A read's copy out of the arena is over (lock held): wake a close waiting for it."""
        self._copying -= 1
        if not self._copying and self._closed:
            self._ready.notify_all()

    def _hold_keys(self, ks: Sequence[Key]) -> _Token:
        return self._hold_rows(self._index.rows_of(ks))

    def _lease(self, ks: list[Key]) -> Lease:
        with self._usable():
            rows = self._index.rows_of(ks)
            token = self._hold_rows(rows)
            self._lease_tokens[id(token)] = token
            return Lease(self, ks, [r >= 0 for r in rows], token=token)

    def _leases_at(self, ks: Sequence[Key], rows: Sequence[int]) -> list[Lease]:
        """One lease per key on its row (``-1``: absent), each released on its own (lock held)."""
        idx = self._index
        idx.hold_rows([r for r in rows if r >= 0])
        gen, tokens = idx.m_gen, self._lease_tokens
        out = []
        for k, r in zip(ks, rows, strict=True):
            token: _Token = ([r], [gen[r]]) if r >= 0 else ([], [])
            tokens[id(token)] = token
            out.append(Lease(self, [k], [r >= 0], token=token))
        return out

    def _lease_run(self, ks: list[Key], rows: npt.NDArray[np.int64]) -> Lease:
        """One lease over the sealed ``rows`` of ``ks`` (lock held), its token ``(rows, gens)``
        arrays in key order, so that :meth:`_release_part` can let go of some pages."""
        idx = self._index
        idx.hold_rows(cast(Sequence[int], rows))
        token: _Token = (rows.copy(), idx.gen[rows].copy())
        self._lease_tokens[id(token)] = token
        return Lease(self, ks, [True] * len(ks), token=token)

    def _release_part(self, lease: Lease, positions: npt.NDArray[np.int64]) -> None:
        """Let go of the pages at ``positions`` of a :meth:`_lease_run` lease (each once; the
        rest stays held until they or the whole lease are released): the tiered provider frees
        a page's fast copy as soon as it is written back or dropped, not at the run's end."""
        with self._lock:
            if self._closed or lease.released or not len(positions):
                return
            rows, gens = cast(tuple[npt.NDArray[np.int64], npt.NDArray[np.uint64]], lease.token)
            pos = positions[rows[positions] >= 0]
            self._index.release_rows(cast(Sequence[int], rows[pos]), cast(Sequence[int], gens[pos]))
            self._leave_limbo(gens[pos].tolist())
            rows[pos] = -1
            gens[pos] = _NO_GEN  # (never a live gen: not counted as a pin when an entry drops)

    def _split_lease(self, lease: Lease, positions: npt.NDArray[np.int64]) -> list[Lease]:
        """The pages at ``positions`` of a :meth:`_lease_run` lease, each under a lease of its
        own (released on its own): the hold moves over in one lock round, never let go between."""
        with self._usable():
            if lease.released:
                raise InvalidArgumentError("_split_lease() needs an unreleased lease")
            rows, gens = cast(tuple[npt.NDArray[np.int64], npt.NDArray[np.uint64]], lease.token)
            keys, tokens = lease.keys, self._lease_tokens
            out = []
            for p, r, g in zip(positions.tolist(), rows[positions].tolist(), gens[positions].tolist(), strict=True):
                token: _Token = ([r], [g]) if r >= 0 else ([], [])
                tokens[id(token)] = token
                out.append(Lease(self, [keys[p]], [r >= 0], token=token))
            rows[positions] = -1
            gens[positions] = _NO_GEN
            return out

    def _run_views(self, lease: Lease, positions: npt.NDArray[np.int64]) -> list[memoryview | None]:
        """Read-only views of the pages at ``positions`` of a :meth:`_lease_run` lease (valid
        while held); ``None`` for one let go or dropped (its bytes failed ``verify``): what the
        tiered writer stores in the slow tier with one ``put_many``."""
        with self._usable():
            rows, gens = cast(tuple[npt.NDArray[np.int64], npt.NDArray[np.uint64]], lease.token)
            r = rows[positions]
            idx, arena = self._index, self._arena
            live = r >= 0
            if lease.released:
                live[:] = False
            live[live] = idx.alive[r[live]] & (idx.gen[r[live]] == gens[positions][live])
            chunks, bpc, block, scatter = arena.chunks, arena.bpc, arena.block, idx.scatter
            out: list[memoryview | None] = []
            for ok, row, st, nb in zip(live.tolist(), r.tolist(), idx.run_start[r].tolist(),
                                       idx.nbytes[r].tolist(), strict=True):
                if not ok:
                    out.append(None)
                elif scatter and row in scatter:  # (a run's pages are one piece each; not so here)
                    regions = arena.regions(idx.runs(row), nb, False, readonly=True)
                    out.append(memoryview(b"".join(bytes(x.view) for x in regions)))
                else:
                    lo = (st % bpc) * block
                    out.append(chunks[st // bpc].view[lo : lo + nb].toreadonly())
            return out

    def _release_lease(self, lease: Lease) -> None:
        with self._lock:
            if self._closed:
                return
            token: _Token = lease.token  # type: ignore[assignment]
            self._lease_tokens.pop(id(token), None)
            self._index.release_rows(*token)
            # (limbo: dropped entries still leased; rare)
            self._leave_limbo((token[1].tolist() if isinstance(token[1], np.ndarray) else token[1])
                              if self._limbo else ())

    def _leave_limbo(self, gens: Iterable[int]) -> None:
        """Leases on the entries ``gens`` let go (lock held): a dropped entry's blocks are reused
        once its last lease is gone."""
        if self._limbo:
            for g in gens:
                held = self._limbo.get(g)
                if held is None:
                    continue
                runs, count = held
                if count > 1:
                    self._limbo[g] = (runs, count - 1)
                else:  # the last lease on a dropped entry let go: its blocks may be reused now
                    del self._limbo[g]
                    self._index.used_cost -= _blocks_cost(runs, self._block)
                    self._arena.release(runs)

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
