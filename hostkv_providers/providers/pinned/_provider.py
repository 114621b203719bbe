"""``pinned://`` — a budget-bounded arena of (page-locked, when CUDA is present) host memory.

The arena is cut into fixed-size *blocks*; an entry takes ``ceil(nbytes / block)`` blocks, a
contiguous run when one is free, else any free blocks (a scatter list).  So fragmentation can
never make a request that fits the budget unsatisfiable: any ``k`` free blocks will do.  Set
``block`` to the page size of the layout you store and every page is one contiguous region.

The arena is allocated in chunks; with ``background=true`` only the first chunk is allocated
before the constructor returns and the rest are pinned by a background thread, so start-up is not
blocked by pinning a large budget.  A reservation that needs memory not yet ready waits for the
next chunk before it evicts anything.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from hostkv_providers._blockhash import TREE_ALGORITHM, tree_checksum_parts
from hostkv_providers._checksum import CHECKSUM_ALGORITHM, checksum_parts
from hostkv_providers._errors import (
    CapacityError,
    HostKVError,
    InFlightError,
    InvalidArgumentError,
    UnknownKeyError,
)
from hostkv_providers._keys import Key
from hostkv_providers._options import Option, OptionSet
from hostkv_providers._provider import (
    Corrupt,
    EntryInfo,
    EvictReport,
    HostRegion,
    Lease,
    Provider,
    ProviderStats,
    Reservation,
    ReservedChain,
    VerifyReport,
    _check_checksums,
    writable_buffer,
)
from hostkv_providers._region import HostPages
from hostkv_providers._span import ByteSpan
from hostkv_providers.device._hostmem import HostAllocation, HostAllocator, OrdinaryAllocator, copy_bytes
from hostkv_providers.providers._tree import Node, TreeIndex

__all__ = ["PinnedProvider"]

_DEFAULT_BLOCK = 64 * 1024
_DEFAULT_CHUNK = 256 * 1024 * 1024


class _Arena:
    """Blocks in chunks of host memory, with a coalescing free-run list."""

    def __init__(self, block: int, blocks_per_chunk: int) -> None:
        self.block = block
        self.bpc = blocks_per_chunk
        self.chunks: list[HostAllocation] = []
        self.total = 0  # blocks in ready chunks
        self.free = 0
        self._runs: dict[int, int] = {}  # start block -> length
        self._ends: dict[int, int] = {}  # end block (exclusive) -> start

    def add_chunk(self, alloc: HostAllocation, nblocks: int) -> None:
        start = len(self.chunks) * self.bpc
        self.chunks.append(alloc)
        self.total += nblocks
        self._release_run(start, nblocks)

    def _release_run(self, start: int, length: int) -> None:
        self.free += length
        end = start + length
        # coalesce with neighbours, but never across a chunk boundary (not contiguous memory)
        if start % self.bpc and start in self._ends:
            prev = self._ends.pop(start)
            length += self._runs.pop(prev)
            start = prev
        if end % self.bpc and end in self._runs:
            nxt_len = self._runs.pop(end)
            del self._ends[end + nxt_len]
            length += nxt_len
        self._runs[start] = length
        self._ends[start + length] = start

    def _take(self, start: int, length: int, want: int) -> tuple[int, int]:
        del self._runs[start]
        del self._ends[start + length]
        take = min(length, want)
        if take < length:
            self._runs[start + take] = length - take
            self._ends[start + length] = start + take
        self.free -= take
        return start, take

    def allocate(self, nblocks: int) -> list[tuple[int, int]]:
        """``nblocks`` blocks as ``[(start, length)]`` runs; caller checked ``free >= nblocks``."""
        best = None
        for start, length in self._runs.items():
            if length >= nblocks and (best is None or length < best[1]):
                best = (start, length)
                if length == nblocks:
                    break
        if best is not None:
            return [self._take(best[0], best[1], nblocks)]
        out: list[tuple[int, int]] = []
        need = nblocks
        for start, length in sorted(self._runs.items(), key=lambda r: -r[1]):
            out.append(self._take(start, length, need))
            need -= out[-1][1]
            if need == 0:
                break
        return out

    def release(self, runs: Sequence[tuple[int, int]]) -> None:
        for start, length in runs:
            self._release_run(start, length)

    def regions(self, runs: Sequence[tuple[int, int]], nbytes: int, pinned: bool, *,
                readonly: bool = False) -> list[HostRegion]:
        out: list[HostRegion] = []
        offset = 0
        for start, length in runs:
            chunk = self.chunks[start // self.bpc]
            lo = (start % self.bpc) * self.block
            size = min(length * self.block, nbytes - offset)
            if size <= 0:
                break
            view = chunk.view[lo : lo + size]
            out.append(HostRegion(offset, view.toreadonly() if readonly else view, chunk.address + lo, pinned))
            offset += size
        return out

    def close(self) -> None:
        for chunk in self.chunks:
            chunk.close()
        self.chunks.clear()


class _PinnedReservation(Reservation):
    # The regions (a list, a HostRegion and a memoryview per arena run) are built on first use:
    # a chain reservation that a copy engine fills through ``ReservedChain.pages`` and that is
    # sealed with checksums from the GPU never builds them (no per-page objects on that path).
    __slots__ = ("_regs", "runs")

    def __init__(self, provider: PinnedProvider, key: Key, parent: Key | None, nbytes: int, salt_tag: str,
                 runs: list[tuple[int, int]]) -> None:
        super().__init__(provider, key, parent, nbytes, salt_tag)
        self.runs = runs
        self._regs: list[HostRegion] | None = None

    @property
    def _regions(self) -> list[HostRegion]:
        regs = self._regs
        if regs is None:
            prov: PinnedProvider = self._provider  # type: ignore[assignment]
            regs = self._regs = prov._arena.regions(self.runs, self.nbytes, prov._allocator.pinned)
        return regs

    def regions(self) -> Sequence[HostRegion]:
        self.check_open(self._provider)
        return self._regions


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
        Option("verify", "choice", "never", "never", ("never", "read")),
        Option("pin", "choice", "auto", "auto", ("auto", "yes", "no")),
        Option("mapped", "choice", "no", "no", ("no", "yes")),
        Option("device", "int", None, "0"),  # None: not given (only mapped=yes takes it)
        Option("checksum", "choice", TREE_ALGORITHM, TREE_ALGORITHM, (TREE_ALGORITHM, CHECKSUM_ALGORITHM)),
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
        checksum: str = TREE_ALGORITHM,
    ) -> None:
        super().__init__()
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
        chunk = max(block, min(chunk, budget_bytes) // block * block)
        self._budget = budget_bytes
        self._block = block
        self._verify_reads = verify_reads
        if allocator is None:
            allocator = _default_allocator()
        self._allocator = allocator
        self._lock = threading.RLock()
        self._ready = threading.Condition(self._lock)
        self._arena = _Arena(block, chunk // block)
        self._index = TreeIndex(0)
        self._lease_tokens: dict[int, list[Node | None]] = {}  # live leases, by id of their token
        self._limbo: dict[int, tuple[Node, int]] = {}  # dropped but still leased: node, lease count
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
        self._finalizer = weakref.finalize(self, _Arena.close, self._arena)

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def from_url(cls, location: str, options: Mapping[str, str]) -> PinnedProvider:
        o = cls.OPTIONS.parse(options)
        budget, block, chunk, background, verify, pin = (o["budget"], o["block"], o["chunk"], o["background"],
                                                         o["verify"], o["pin"])
        mapped, device = o["mapped"], o["device"]  # device_mapped: providers/pinned/_mapped.py
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
                                        checksum=o["checksum"])
        allocator: HostAllocator | None = OrdinaryAllocator() if pin == "no" else None
        if pin == "yes":
            allocator = _default_allocator(require_pinned=True)
        return cls(budget, block=block, chunk=chunk, allocator=allocator, background=background,
                   verify_reads=verify == "read", checksum=o["checksum"])

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
            return self._membership(keys, self._index.nodes.__contains__)

    def _longest_prefix(self, keys: Sequence[bytes]) -> int:
        with self._usable():
            hits = self._membership(keys, self._index.nodes.__contains__)
        return hits.index(False) if False in hits else len(hits)

    def _in_flight(self, k: Key) -> bool:
        with self._usable():
            return k in self._index.flights

    def _entry(self, k: Key) -> EntryInfo | None:
        with self._usable():
            node = self._index.get(k)
            return None if node is None else _info(node)

    def iter_entries(self) -> Iterator[EntryInfo]:
        with self._usable():
            infos = [_info(n) for n in self._index]
        return iter(infos)

    # -- writes ------------------------------------------------------------------------------
    def _reserve(self, k: Key, p: Key | None, nbytes: int, salt_tag: str) -> Reservation | None:
        with self._usable():
            return self._reserve_locked(k, p, nbytes, salt_tag)

    def _reserve_locked(self, k: Key, p: Key | None, nbytes: int, salt_tag: str,
                        chained: bool = False) -> _PinnedReservation | None:
        """Reserve under the provider lock (``None``: already stored); ``chained``: the parent may
        be in flight (``reserve_many``)."""
        nblocks = -(-nbytes // self._block)
        cost = nblocks * self._block
        if cost > self._budget:
            raise CapacityError(f"{nbytes} bytes exceed the whole budget of {self._budget}")
        # Prefer memory still being pinned over evicting entries that could be hits.
        while (self._pending and self._index.used + cost > self._index.budget
               and k not in self._index.nodes):
            self._ready.wait(0.5)
            self._check_usable()
        try:
            ok, evicted = (self._index.begin_chained if chained else self._index.begin)(k, p, cost)
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
        self._free_nodes(evicted)
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

    def _commit_locked(self, res: _PinnedReservation, digest: int) -> Node:
        node = Node(res.key, res.parent, res.nbytes, 0, res.salt_tag, digest, res.runs, time.time())
        try:
            self._index.commit(res.key, node)
        except UnknownKeyError:
            self._arena.release(res.runs)
            res._finish("aborted")
            raise
        res._finish("sealed")
        return node

    # -- chain reservation -------------------------------------------------------------------
    def reserve_many(self, keys: Sequence[bytes], parents: Sequence[bytes | None], nbytes: int, *,
                     salt_tag: str = "") -> ReservedChain:
        """Arena reservations for a chain run in one lock round (see ``Provider.reserve_many``):
        a parent may be in flight (reserved earlier in this call or an earlier one), so a copy
        engine DMAs a whole chain straight into the arena before the first seal."""
        ks = self._keys(keys)
        if isinstance(parents, (bytes, bytearray, memoryview, str)) or len(parents) != len(ks):
            raise InvalidArgumentError(f"{len(parents)} parents for {len(ks)} keys; give one per key")
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
        own = [self._own_reservation(r, _PinnedReservation) for r in reservations]
        _check_checksums(checksums, algorithm, len(own))
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
                        self._commit_locked(r, digest)  # UnknownKeyError: its parent was not sealed
                        sealed += 1
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
        out: list[bool | HostKVError] = []
        failed: set[Key] = set()
        held: list[Node | None] = []
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
                        self._index.release_nodes(held)
                        held = self._index.hold_keys([k]) if res is None else []
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
                        held = self._index.hold_keys([k])
                    self._tally("seals")
                    self._tally("bytes_written", view.nbytes)
                    out.append(True)
                except (CapacityError, InFlightError, UnknownKeyError) as exc:
                    failed.add(k)
                    out.append(exc)
        finally:
            if held:
                with self._lock:
                    self._index.release_nodes(held)
        return out

    def read_many(self, keys: Sequence[bytes], outs: Sequence[object]) -> list[bool]:
        """Whole entries into ``outs[i]`` (:class:`~hostkv_providers.SupportsBatch`): one lock
        round to find and hold them all, the copies (and checksums, with ``verify_reads``)
        without the lock or the GIL, one lock round to release.  A miss leaves ``outs[i]``
        untouched; an ``outs[i]`` smaller than its entry raises ``InvalidArgumentError`` after
        the others were filled."""
        ks = self._keys(keys)
        if len(outs) != len(ks):
            raise InvalidArgumentError(f"{len(outs)} output buffers for {len(ks)} keys")
        with self._usable():
            nodes = [self._index.get(k) for k in ks]
            held = self._index.hold_keys([k for k, n in zip(ks, nodes, strict=True) if n is not None])
        # per key: None (miss or buffer too small), True (copied, checksum ok), False (bad copy)
        state: list[bool | None] = [None] * len(ks)
        short: InvalidArgumentError | None = None
        try:
            for i, node in enumerate(nodes):
                if node is None:
                    continue
                try:
                    dst = writable_buffer(outs[i], node.nbytes)
                except InvalidArgumentError as exc:
                    short = short or exc
                    continue
                _gather(self._arena.regions(node.loc, node.nbytes, False), ByteSpan.whole(node.nbytes), dst)
                state[i] = not self._verify_reads or self._sum((dst,)) == node.checksum
        finally:
            got = [False] * len(ks)
            hits = nbytes = failures = 0
            with self._lock:
                self._index.release_nodes(held)
                for i, (node, st) in enumerate(zip(nodes, state, strict=True)):
                    if node is not None and st is True and not node.dead:
                        got[i] = True
                        hits += 1
                        nbytes += node.nbytes
                        continue
                    if node is not None and st is False and not node.dead:
                        # first to see the corruption: drop the entry with its subtree
                        failures += 1
                        self._drop(node.key)
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
        with self._usable():
            node = self._index.get(k)
            if node is None:
                return None
            span = ByteSpan.whole(node.nbytes) if span is None else span.validate(node.nbytes)
            dst = writable_buffer(out, span.nbytes)
            held = self._index.hold_keys([k])
        # The copy runs without the lock (the hold stops eviction).  Only a checksum drop — by
        # another reader or verify(repair=True) — can free a held node's blocks meanwhile, and it
        # marks the node dead first; so a node still alive after the copy had its bytes all along.
        try:
            regions = self._arena.regions(node.loc, node.nbytes, False)
            if not self._verify_reads:
                _gather(regions, span, dst)
                ok = True
            elif span.nbytes == node.nbytes:
                # Whole entry: checksum the copy itself, so the bytes handed out are exactly the
                # bytes verified (no window between checking the arena and copying from it).
                _gather(regions, span, dst)
                ok = self._sum((dst,)) == node.checksum
            else:
                ok = self._sum(r.view for r in regions) == node.checksum
                if ok:
                    _gather(regions, span, dst)
        except BaseException:
            with self._lock:
                self._index.release_nodes(held)
            raise
        with self._lock:
            self._index.release_nodes(held)
            if node.dead:
                return None  # dropped or evicted meanwhile: a miss
            return span.nbytes if ok else Corrupt(node)

    def _drop_damaged(self, k: Key, token: object) -> bool:
        with self._lock:
            if self._closed or not isinstance(token, Node) or token.dead:
                return False  # another reader (or verify) dropped it first
            self._drop(k)
            return True

    def view(self, lease: Lease, key: bytes) -> Sequence[HostRegion] | None:
        """Read-only host regions of a leased entry (valid while the lease is held)."""
        return self.views(lease, [key])[0]

    def views(self, lease: Lease, keys: Sequence[bytes]) -> list[Sequence[HostRegion] | None]:
        """:meth:`view` of many keys under one lock round (``None`` for a key not leased)."""
        ks = self._keys(keys)
        if not isinstance(lease, Lease) or lease.released or lease.token is None or lease._provider is not self:
            raise InvalidArgumentError("view() needs an unreleased lease of this provider")
        leased = lease.keys if len(ks) == 1 else frozenset(lease.keys)
        out: list[Sequence[HostRegion] | None] = []
        pinned = self._allocator.pinned
        with self._usable():
            get, regions = self._index.get, self._arena.regions
            for k in ks:
                node = get(k)
                if node is None or k not in leased:
                    out.append(None)
                else:
                    out.append(regions(node.loc, node.nbytes, pinned, readonly=True))
        return out

    def view_pages(self, lease: Lease, keys: Sequence[bytes]) -> HostPages | None:
        """:meth:`views` as one :class:`HostPages` (an address per page, no per-page objects), or
        ``None`` unless every key is leased, of one size and in one contiguous run of the arena
        (always so when ``block`` is the page size)."""
        ks = self._keys(keys)
        if not isinstance(lease, Lease) or lease.released or lease.token is None or lease._provider is not self:
            raise InvalidArgumentError("view_pages() needs an unreleased lease of this provider")
        leased = lease.keys if len(ks) == 1 else frozenset(lease.keys)
        addrs = np.empty(len(ks), dtype=np.uint64)
        sums = np.empty(len(ks), dtype=np.uint64)  # for a verification of the copied bytes on the GPU
        nbytes = 0
        with self._usable():
            get, arena = self._index.get, self._arena
            bpc, block, chunks = arena.bpc, arena.block, arena.chunks
            for i, k in enumerate(ks):
                node = get(k)
                if node is None or k not in leased or len(node.loc) != 1 or (nbytes and node.nbytes != nbytes):
                    return None
                nbytes = node.nbytes
                start = node.loc[0][0]
                addrs[i] = chunks[start // bpc].address + (start % bpc) * block
                sums[i] = node.checksum or 0
        if not nbytes:
            return None
        # With verify=read the checksums go with the views: the cache checks the copied bytes
        # on the GPU (a view is never checked here: that would read every byte on the host).
        return HostPages(addrs, nbytes, pinned=self._allocator.pinned, readonly=True, keepalive=lease,
                         checksums=sums if self._verify_reads else None, algorithm=self.checksum_algorithm)

    # -- eviction ----------------------------------------------------------------------------
    def _evict(self, ks: list[Key] | None, nbytes: int) -> EvictReport:
        with self._usable():
            if ks is not None:
                removed, skipped = self._index.evict_keys(ks)
            else:
                removed, skipped = self._index.evict_cost(nbytes), 0
            self._free_nodes(removed)
            return EvictReport(len(removed), sum(n.nbytes for n in removed), skipped)

    def _free_nodes(self, nodes: Sequence[Node]) -> None:
        for node in nodes:
            self._arena.release(node.loc)

    def _drop(self, key: Key) -> list[Node]:
        """Force-remove a corrupt entry with its subtree (caller holds the lock).

        Leases are not honoured by a drop (the bytes are known bad), but a lease holder may be
        reading the entry's blocks zero-copy through :meth:`view` (a DMA in flight).  Reusing
        those blocks for another entry would hand that reader *another entry's* bytes, so the
        blocks of a leased dropped node stay allocated and accounted — in limbo — until the last
        lease on it is released.
        """
        dropped = self._index.drop(key)
        if not dropped:
            return dropped
        dead = {id(n) for n in dropped}
        pins: dict[int, int] = {}
        for token in self._lease_tokens.values():
            for n in token:
                if n is not None and id(n) in dead:
                    pins[id(n)] = pins.get(id(n), 0) + 1
        for n in dropped:
            count = pins.get(id(n), 0)
            if count:
                self._limbo[id(n)] = (n, count)
                self._index.used += self._blocks_cost(n)
            else:
                self._arena.release(n.loc)
        return dropped

    def _blocks_cost(self, node: Node) -> int:
        return self._block * sum(int(length) for _, length in node.loc)

    # -- anchors -----------------------------------------------------------------------------
    def _put_anchor(self, k: Key, name: str, blob: bytes) -> None:
        with self._usable():
            node = self._index.get(k)
            if node is None:
                raise UnknownKeyError(f"entry {k.hex()[:16]} is not stored", hint="seal the page before its anchors")
            old = node.anchors.get(name) if node.anchors else None
            delta = len(blob) - (len(old) if old is not None else 0)
            self._free_nodes(self._index.add_cost(node, delta))
            if node.anchors is None:
                node.anchors = {}
            node.anchors[name] = blob

    def _get_anchor(self, k: Key, name: str) -> bytes | None:
        with self._usable():
            node = self._index.get(k)
            if node is None or not node.anchors:
                return None
            blob = node.anchors.get(name)
            return None if blob is None else bytes(blob)

    def _list_anchors(self, k: Key) -> dict[str, int]:
        with self._usable():
            node = self._index.get(k)
            if node is None or not node.anchors:
                return {}
            return {n: len(b) for n, b in node.anchors.items()}

    def _deepest_anchor(self, ks: list[Key], name: str) -> int:
        with self._usable():
            best = 0
            for i, k in enumerate(ks):
                node = self._index.get(k)
                if node is None:
                    break
                if node.anchors and name in node.anchors:
                    best = i + 1
            return best

    # -- leases ------------------------------------------------------------------------------
    def _lease(self, ks: list[Key]) -> Lease:
        with self._usable():
            held = self._index.hold_keys(ks)
            self._lease_tokens[id(held)] = held
            return Lease(self, ks, [n is not None for n in held], token=held)

    def _release_lease(self, lease: Lease) -> None:
        with self._lock:
            if self._closed:
                return
            token: list[Node | None] = lease.token  # type: ignore[assignment]
            self._lease_tokens.pop(id(token), None)
            self._index.release_nodes(token)
            for n in token:
                held = self._limbo.get(id(n)) if n is not None and n.dead else None
                if held is None:
                    continue
                node, count = held
                if count > 1:
                    self._limbo[id(n)] = (node, count - 1)
                else:  # the last lease on a dropped entry let go: its blocks may be reused now
                    del self._limbo[id(n)]
                    self._index.used -= self._blocks_cost(node)
                    self._arena.release(node.loc)

    # -- verification ------------------------------------------------------------------------
    def verify(self, *, repair: bool = False, progress: Any = None) -> VerifyReport:
        """Recompute every entry's checksum; ``repair`` drops corrupt ones with their subtrees."""
        report = VerifyReport()
        with self._usable():
            nodes = list(self._index)
        for i, node in enumerate(nodes):
            with self._lock:
                if node.dead:
                    continue
                regions = self._arena.regions(node.loc, node.nbytes, False)
                ok = self._sum(r.view for r in regions) == node.checksum
                report.checked += 1
                if not ok:
                    report.corrupt.append(node.key)
                    if repair:
                        report.dropped += len(self._drop(node.key))
            if progress is not None:
                progress(i + 1, len(nodes))
        return report

    # -- the rest ----------------------------------------------------------------------------
    def stats(self) -> ProviderStats:
        with self._usable():
            idx = self._index
            return ProviderStats(
                name=self.name,
                entries=len(idx.nodes),
                used_bytes=idx.used,
                budget_bytes=self._budget,
                anchors=sum(len(n.anchors) for n in idx.nodes.values() if n.anchors),
                leased=sum(1 for n in idx.nodes.values() if n.hold),
                in_flight=len(idx.flights),
                evictions=idx.evictions,
                evicted_bytes=idx.evicted_cost,
                extra={"ready_bytes": self.ready_bytes, "block_nbytes": self._block, "limbo_entries": len(self._limbo),
                       "pinned": self._allocator.pinned, "free_blocks": self._arena.free},
                **self._tallies(),
            )

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "block_nbytes": self._block, "pinned": self._allocator.pinned,
                "verify_reads": self._verify_reads}

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._ready.notify_all()
        if self._filler is not None and self._filler is not threading.current_thread():
            self._filler.join()
        with self._lock:
            self._finalizer()


def _info(node: Node) -> EntryInfo:
    anchors = {n: len(b) for n, b in node.anchors.items()} if node.anchors else {}
    return EntryInfo(node.key, node.parent, node.nbytes, node.salt_tag, node.checksum,
                     node.created, node.last_used, anchors)


def _scatter(regions: Sequence[HostRegion], span: ByteSpan, src: memoryview) -> None:
    """Copy ``src`` into bytes ``span`` of an entry laid out over ``regions``."""
    for r in regions:
        lo = max(span.offset, r.offset)
        hi = min(span.end, r.offset + len(r.view))
        if lo < hi:
            copy_bytes(r.view[lo - r.offset : hi - r.offset], src[lo - span.offset : hi - span.offset])


def _gather(regions: Sequence[HostRegion], span: ByteSpan, dst: memoryview) -> None:
    """Copy bytes ``span`` of an entry laid out over ``regions`` into ``dst``."""
    for r in regions:
        lo = max(span.offset, r.offset)
        hi = min(span.end, r.offset + len(r.view))
        if lo < hi:
            copy_bytes(dst[lo - span.offset : hi - span.offset], r.view[lo - r.offset : hi - r.offset])


# Seal-time hashing of large batches (zero-copy saves): XXH3 releases the GIL, so a few threads
# scale it.  H200 host, 13.4 GB chain: 8 threads hash at 45 GB/s and the save seals in 474 ms
# (DMA done at 313 ms); 12 threads hash at 56 GB/s alone but slow the DMA they overlap (528 /
# 386 ms), so the count stays at 8.
_HASH_THREADS = max(2, min(8, (os.cpu_count() or 2) // 2))
_hash_pool: concurrent.futures.ThreadPoolExecutor | None = None
_hash_pool_lock = threading.Lock()


def _checksums(entries: Sequence[Sequence[HostRegion]],
               fn: Callable[[Iterable[object]], int] = tree_checksum_parts) -> list[int]:
    """Seal checksums of many entries; large batches are split over a few threads (one task per
    thread, not per page: no per-page futures)."""
    global _hash_pool
    total = sum(sum(r.view.nbytes for r in regs) for regs in entries)
    if len(entries) < 2 or total < (8 << 20):
        return [fn(r.view for r in regs) for regs in entries]
    with _hash_pool_lock:
        if _hash_pool is None:
            _hash_pool = concurrent.futures.ThreadPoolExecutor(_HASH_THREADS, thread_name_prefix="hostkv-hash")
        pool = _hash_pool
    step = -(-len(entries) // _HASH_THREADS)
    parts = [entries[i : i + step] for i in range(0, len(entries), step)]
    futures = [pool.submit(lambda part: [fn(r.view for r in regs) for regs in part], part)
               for part in parts]
    return [d for f in futures for d in f.result()]


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
