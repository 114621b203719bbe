"""Hybrid models (linear attention / Gated DeltaNet / Mamba beside full attention) in the cache.

A hybrid model's KV pages alone cannot rebuild its state: a hit is usable only up to a page that
carries the recurrent state at that point (an *anchor*).  This module holds what
:class:`~hostkv_providers.HostKVCache` does for such models when it is built with
``required_anchors=`` (and optionally ``anchor_groups=`` / ``coalesce_prefills=``):

* **Required anchors.**  Every hit (``lookup``, ``lookup_ranks``, with or without
  ``need_anchor``) is cut back to the deepest page that carries *every* required anchor; a restore
  that ends early (a page failed its checksum) is cut back again to the deepest such page within
  what was restored, and its result carries the anchors of exactly that page.
* **Anchor records.**  Each anchor a hybrid cache writes is a record: a 48-byte header (magic,
  page depth, a format tag derived from the salt's digest, its ``state_format`` and the anchor's
  name, payload length, XXH3-64 of the payload) followed by the payload.  A record offered for
  another depth or format is refused on put (:class:`AnchorMismatchError`); one that does not
  match where it is read (another depth, format, a torn or corrupt blob) reads as a miss.
* **Anchor reads off the admission path.**  ``lookup`` only lists which pages carry anchors (no
  blob is copied); the anchors are read by the restore, on the restore thread, and copied once
  into the caller's buffers when ``restore(..., anchors_into=...)`` gives them.
* **Anchor groups with restore-or-invalidate semantics** (the drafter state of speculative
  decoding): a group is restored only whole, valid and from the same page as the required state;
  otherwise its name is in ``RestoreResult.invalidated`` and the engine must reset that state.
  A save that gives only part of a group (or of the required set) at a page is refused.
* **Rollback.**  When an anchor write fails, the pages that save sealed beyond the deepest page
  carrying every required anchor could never be hit: they are evicted.
* **Prefill coalescing.**  A lookup that misses registers the missing pages as being produced by
  its request; identical lookups arriving meanwhile wait (``lookup_wait_timeout``) for that
  request's save — pages and anchors — and then take the restore path: N identical cold requests
  cost one prefill.
"""

from __future__ import annotations

import hashlib
import struct
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hostkv_providers._checks import check_anchor_name, readable_bytes
from hostkv_providers._checksum import checksum
from hostkv_providers._errors import InvalidArgumentError
from hostkv_providers._keys import Key

if TYPE_CHECKING:
    from hostkv_providers.cache._cache import CacheHandle, CacheHit, HostKVCache, RestoreResult, SaveResult

__all__ = [
    "ANCHOR_HEADER_NBYTES",
    "AnchorMismatchError",
    "abandon_prefill",
    "anchor_depths",
    "open_anchor_record",
    "prefill_pages_cap",
    "prefill_pending",
    "put_anchor",
    "seal_anchor_record",
]

_MAGIC = b"HKA1"
# magic, version, reserved, depth, payload length, xxh3-64 of the payload, format tag (16 bytes)
_HEADER = struct.Struct("<4sHHQQQ16s")
#: Bytes an anchor record adds in front of its payload.
ANCHOR_HEADER_NBYTES = _HEADER.size


class AnchorMismatchError(InvalidArgumentError):
    """An anchor record was offered for a page depth or state format other than its own."""


def anchor_format_tag(salt_digest: bytes, state_format: str, name: str) -> bytes:
    """The 16-byte tag binding an anchor to its configuration, state format and name."""
    h = hashlib.blake2b(digest_size=16, person=b"hostkv-anchor")
    for part in (salt_digest, state_format.encode(), name.encode()):
        h.update(len(part).to_bytes(4, "little"))
        h.update(part)
    return h.digest()


def seal_anchor_record(payload: object, *, depth: int, tag: bytes) -> bytes:
    """``header + payload`` for an anchor at page ``depth`` (0-based) with format ``tag``."""
    mv = readable_bytes(payload)
    head = _HEADER.pack(_MAGIC, 1, 0, depth, mv.nbytes, checksum(mv), tag)
    return b"".join((head, mv))  # one copy of the payload


def _parse(blob: object) -> tuple[int, bytes, memoryview] | None:
    mv = memoryview(blob).cast("B") if not isinstance(blob, memoryview) else blob.cast("B")  # type: ignore[arg-type]
    if mv.nbytes < _HEADER.size:
        return None
    magic, version, _r, depth, length, digest, tag = _HEADER.unpack_from(mv)
    if magic != _MAGIC or version != 1 or mv.nbytes != _HEADER.size + length:
        return None
    payload = mv[_HEADER.size:]
    if checksum(payload) != digest:
        return None
    return int(depth), bytes(tag), payload


def open_anchor_record(blob: object, *, depth: int, tag: bytes) -> memoryview | None:
    """The payload of a record written for page ``depth`` with format ``tag``; ``None`` (a miss)
    for anything else: another depth or format, a torn, foreign or corrupt blob."""
    got = _parse(blob)
    if got is None or got[0] != depth or got[1] != tag:
        return None
    return got[2]


def prefill_pages_cap(num_tokens: int, page_tokens: int) -> int:
    """The most pages a hit may cover so that at least one token of a ``num_tokens`` prompt is
    left to prefill (the engine needs its logits): ``(num_tokens - 1) // page_tokens``."""
    if type(num_tokens) is not int or num_tokens < 1:
        raise InvalidArgumentError(f"num_tokens must be an int >= 1, got {num_tokens!r}")
    if type(page_tokens) is not int or page_tokens < 1:
        raise InvalidArgumentError(f"page_tokens must be an int >= 1, got {page_tokens!r}")
    return (num_tokens - 1) // page_tokens


def anchor_depths(cache: HostKVCache, num_pages: int, checkpoints: Iterable[int] = (), *,
                  start_page: int = 0) -> list[int]:
    """Absolute page depths (0-based, from the root) where anchors go for pages
    ``start_page .. start_page + num_pages`` — :meth:`HostKVCache.anchor_positions` returns
    indices relative to ``start_page``; this is the same set as depths."""
    return [start_page + i for i in cache.anchor_positions(num_pages, checkpoints, start_page=start_page)]


@dataclass
class _Intent:
    """Pages one request's prefill is producing (prefill coalescing)."""

    keys: tuple[Key, ...]
    expires: float
    owner: int  # the thread of the lookup that claimed them (a lookup runs on one thread)
    attached: bool = False  # handed to that lookup's hit (CacheHit.hybrid)
    hit_id: int = 0  # id() of the producer's hit
    done: threading.Event = field(default_factory=threading.Event)


class HybridState:
    """The hybrid-model policy of one :class:`HostKVCache` (built by its constructor)."""

    def __init__(self, cache: HostKVCache, required: Iterable[str], groups: Mapping[str, Iterable[str]] | None,
                 coalesce: bool) -> None:
        if isinstance(required, str):
            raise InvalidArgumentError("required_anchors must be a set of names, not one str",
                                       hint="required_anchors={'state'}")
        self.cache = cache
        self.required: frozenset[str] = frozenset(check_anchor_name(n) for n in required)
        self.groups: dict[str, frozenset[str]] = {}
        for g, names in (groups or {}).items():
            if isinstance(names, str):
                raise InvalidArgumentError(f"anchor group {g!r} must be a set of names, not one str")
            members = frozenset(check_anchor_name(n) for n in names)
            if not members:
                raise InvalidArgumentError(f"anchor group {g!r} is empty")
            if members & self.required:
                raise InvalidArgumentError(f"anchor group {g!r} overlaps required_anchors",
                                           hint="a group is optional state; required anchors are in every hit")
            self.groups[str(g)] = members
        if self.groups and not self.required:
            raise InvalidArgumentError("anchor_groups need required_anchors (the state they belong with)")
        self.binding = bool(self.required)
        self.coalesce = bool(coalesce)
        salt = cache.salt
        self._tags: dict[str, bytes] = {}
        self._digest = salt.digest
        self._state_format = salt.state_format
        self._lock = threading.Lock()
        self._intents: dict[Key, _Intent] = {}
        self._anchors_into: dict[int, Mapping[str, Any]] = {}
        self._first_page: dict[int, int] = {}  # ranged restores in flight: id(handle) -> first_page

    def tag(self, name: str) -> bytes:
        t = self._tags.get(name)
        if t is None:
            t = self._tags[name] = anchor_format_tag(self._digest, self._state_format, name)
        return t

    # -- save side ----------------------------------------------------------------------------
    def seal_blobs(self, blobs: dict[int, dict[str, bytes]], start_page: int) -> dict[int, dict[str, bytes]]:
        """Wrap every blob of a save in its record; refuse partial groups and mismatched records."""
        if not self.binding:
            return blobs
        sets = [("required anchors", self.required), *((f"anchor group {g!r}", m) for g, m in self.groups.items())]
        out: dict[int, dict[str, bytes]] = {}
        for i, named in blobs.items():
            depth = start_page + i
            names = frozenset(named)
            for what, members in sets:
                if names & members and not members <= names:
                    raise InvalidArgumentError(
                        f"page {i}: {what} {sorted(members)} given only in part ({sorted(names & members)})",
                        hint="a state split over several blobs is stored whole at a page or not at all")
            out[i] = {name: self._seal(blob, depth, name) for name, blob in named.items()}
        return out

    def _seal(self, blob: bytes, depth: int, name: str) -> bytes:
        tag = self.tag(name)
        got = _parse(blob)
        if got is not None:  # already a record (copied from a store): it must be this one's
            if got[0] != depth or got[1] != tag:
                raise AnchorMismatchError(
                    f"anchor {name!r}: the record was written for page depth {got[0]}"
                    f"{'' if got[1] == tag else ' and another state format'}, not depth {depth}",
                    hint="an anchor is the state after its own page; capture it there")
            return blob
        return seal_anchor_record(blob, depth=depth, tag=tag)

    def open_record(self, name: str, depth: int, blob: object) -> memoryview | None:
        """The payload of anchor ``name``'s record at page ``depth`` (``None``: another page's or
        format's record, or a damaged one)."""
        return open_anchor_record(blob, depth=depth, tag=self.tag(name))

    def put_anchor(self, keys: Sequence[bytes], page: int, name: str, data: object) -> None:
        """Attach one anchor to stored page ``keys[page]`` (depth ``page``) of a chain."""
        ks = self.cache._chain(keys)
        if type(page) is not int or not 0 <= page < len(ks):
            raise InvalidArgumentError(f"page {page!r} outside the chain of {len(ks)} pages")
        check_anchor_name(name)
        if not self.binding:
            self.cache.provider.put_anchor(ks[page], name, data)
            return
        self.cache.provider.put_anchor(ks[page], name, self._seal(bytes(readable_bytes(data)), page, name))

    def after_save(self, keys: Sequence[Key], claimed: Sequence[int], result: SaveResult) -> None:
        """After a save: when an anchor write failed, evict the pages it sealed that no required
        anchor covers (they could never be hit)."""
        if not self.binding or result.stopped is None or not result.stopped.startswith("anchor "):
            return
        prov = self.cache.provider
        stored = prov.longest_prefix(keys)
        usable = self.deepest([list(keys)], stored)
        mine = [i for i in claimed if usable <= i < stored]
        if mine:
            prov.evict([keys[min(mine)]])
            result.stopped += f"; rolled back the {stored - min(mine)} pages no complete anchor covers"

    # -- lookup side ----------------------------------------------------------------------------
    def _carries(self, key: Key, names: frozenset[str]) -> bool:
        got = self.cache.provider.list_anchors(key)
        return all(got.get(n, 0) >= _HEADER.size for n in names)

    def deepest(self, chains: Sequence[Sequence[Key]], n: int, extra: str | None = None) -> int:
        """The deepest ``j <= n`` whose page ``j - 1`` carries every required anchor on every
        chain (0 if none).  Lists anchors only; no blob is read."""
        names = self.required | ({extra} if extra is not None else set())
        if not names:
            return n
        for j in range(n, 0, -1):
            if all(self._carries(c[j - 1], names) for c in chains):
                return j
        return 0

    # -- restore side ---------------------------------------------------------------------------
    def note_restore(self, handle: CacheHandle, anchors_into: Mapping[str, Any] | None,
                     first_page: int = 0) -> None:
        if first_page:
            with self._lock:
                self._first_page[id(handle)] = first_page
            handle.add_done_callback(lambda h: self._forget(h))
        if anchors_into is None:
            return
        if not isinstance(anchors_into, Mapping):
            raise InvalidArgumentError("anchors_into must be a {name: writable buffer} mapping")
        for name, buf in anchors_into.items():
            try:
                mv = memoryview(buf)
            except TypeError as exc:
                raise InvalidArgumentError(f"anchors_into[{name!r}] is not a buffer") from exc
            if mv.readonly:
                raise InvalidArgumentError(f"anchors_into[{name!r}] is read-only")
        with self._lock:
            self._anchors_into[id(handle)] = anchors_into
        handle.add_done_callback(lambda h: self._forget(h))

    def _forget(self, handle: CacheHandle) -> None:
        with self._lock:
            self._anchors_into.pop(id(handle), None)
            self._first_page.pop(id(handle), None)

    def _read_record(self, key: Key, depth: int, name: str, sizes: Mapping[str, int],
                     into: Mapping[str, Any] | None) -> memoryview | None:
        """The payload of anchor ``name`` of the page at ``depth``, copied once from the
        provider's medium (``read_anchor``) into the caller's buffer (``anchors_into[name]``) or
        a fresh one; ``None`` (a miss) for a record of another depth or format, torn or corrupt."""
        size = sizes.get(name, 0)
        plen = size - _HEADER.size
        if plen < 0:
            return None
        buf = None if into is None else into.get(name)
        if buf is not None:
            dst = memoryview(buf).cast("B")
            if dst.nbytes < plen:
                raise InvalidArgumentError(f"anchors_into[{name!r}] holds {dst.nbytes} bytes, the anchor is {plen}",
                                           hint="size it with list_anchors(key)[name] - ANCHOR_HEADER_NBYTES")
            dst = dst[:plen]
        else:
            dst = memoryview(bytearray(plen))
        head = bytearray(_HEADER.size)
        try:
            got = self.cache.provider.read_anchor(key, name, [head, dst])
        except InvalidArgumentError:  # replaced by a larger one since it was listed: a miss
            return None
        if got != size:
            return None
        magic, version, _r, d, length, digest, tag = _HEADER.unpack_from(head)
        if (magic != _MAGIC or version != 1 or length != plen or d != depth or bytes(tag) != self.tag(name)
                or checksum(dst) != digest):
            return None
        return dst

    def finish_restore(self, handle: CacheHandle, result: RestoreResult, keys: Sequence[Key],
                       hit_keys: Sequence[Key] | None = None) -> None:
        """Cut ``result`` back to the deepest restored page whose required anchors all read back
        valid, and hand out those anchors (and the groups that are whole at that page).

        ``keys`` are the pages the restore covered; for a ranged restore (``first_page > 0``)
        they start at ``hit_keys[first_page]`` and ``result.pages`` counts from there: the cut is
        to the deepest anchored page within what was restored, and ``result.anchor_page`` is its
        depth in the hit (anchor records are bound to that depth)."""
        with self._lock:
            into = self._anchors_into.pop(id(handle), None)
            first_page = self._first_page.pop(id(handle), 0)
        if first_page:
            assert hit_keys is not None
            keys = list(hit_keys[: first_page + len(keys)])
        if not self.binding:
            return
        got_pages = result.pages
        end = first_page + got_pages  # absolute: pages [first_page, end) were restored
        # A hit ends at a page carrying every required anchor (lookup made sure), so a full
        # restore reads them straight away; a short or ranged one walks back to an anchored page
        # within what it restored (never below first_page: the pages before it are not this
        # restore's, their anchors would not be the state after what it wrote).
        j = end if end == len(keys) else self._deepest_from(keys, end, first_page)
        anchors: dict[str, memoryview] = {}
        sizes: dict[str, int] = {}
        while j > first_page:
            sizes = self.cache.provider.list_anchors(keys[j - 1])
            anchors = {}
            for name in sorted(self.required):
                payload = self._read_record(keys[j - 1], j - 1, name, sizes, into)
                if payload is None:
                    break
                anchors[name] = payload
            if len(anchors) == len(self.required):
                break
            j = self._deepest_from(keys, j - 1, first_page)
        if j <= first_page:
            j, anchors = first_page, {}
        invalidated: list[str] = []
        for g, members in sorted(self.groups.items()):
            part: dict[str, memoryview] = {}
            if j > first_page:
                for name in sorted(members):
                    payload = self._read_record(keys[j - 1], j - 1, name, sizes, into)
                    if payload is None:
                        break
                    part[name] = payload
            if len(part) == len(members):
                anchors.update(part)
            else:
                invalidated.append(g)
        if j < end:
            why = (f"cut back to {j - first_page} pages: the deepest restored page carrying every required anchor"
                   if j > first_page else "no restored page carries every required anchor")
            result.stopped = why if result.stopped is None else f"{result.stopped}; {why}"
        result.pages = j - first_page
        result.nbytes = result.pages * self.cache.page_nbytes
        result.anchor_page = j - 1 if j > first_page else None
        result.anchors = anchors
        result.invalidated = tuple(invalidated)

    def _deepest_from(self, keys: Sequence[Key], n: int, lo: int) -> int:
        """The deepest ``j`` in ``(lo, n]`` whose page ``j - 1`` carries every required anchor;
        ``lo`` if none does."""
        names = self.required
        for j in range(n, lo, -1):
            if self._carries(keys[j - 1], names):
                return j
        return lo

    # -- prefill coalescing -----------------------------------------------------------------------
    def wait_for_prefill(self, keys: Sequence[Key], n: int, deadline: float) -> bool:
        """If another request is producing ``keys[n]``, wait for its save (until ``deadline``) and
        return True.  Otherwise claim ``keys[n:]`` for this lookup's request *now*, under the
        lock (so of N identical lookups arriving together exactly one becomes the producer),
        and return False."""
        if not self.coalesce:
            return False
        key = keys[n]
        me = threading.get_ident()
        with self._lock:
            intent = self._intents.get(key)
            if intent is not None and intent.expires <= time.monotonic():
                self._drop(intent)
                intent = None
            if intent is None or (intent.owner == me and not intent.attached):
                if intent is None:
                    self._register(tuple(keys[n:]), me)
                return False
        intent.done.wait(max(0.0, min(deadline, intent.expires) - time.monotonic()))
        with self._lock:
            if not intent.done.is_set() and intent.expires <= time.monotonic():
                self._drop(intent)
        return True

    def _register(self, rest: tuple[Key, ...], owner: int) -> _Intent:
        intent = _Intent(rest, time.monotonic() + self.cache.lookup_wait_timeout, owner)
        for k in rest:
            self._intents.setdefault(k, intent)
        return intent

    def note_miss(self, hit: CacheHit, keys: Sequence[Key]) -> None:
        """Give the request whose lookup did not cover ``keys`` the claim on the missing pages
        (made by :meth:`wait_for_prefill`, or now), unless a twin already holds it."""
        if not self.coalesce:
            return
        me = threading.get_ident()
        with self._lock:
            if hit.stored >= len(keys):
                return
            intent = self._intents.get(keys[hit.stored])
            if intent is None:
                intent = self._register(tuple(keys[hit.stored:]), me)
            elif intent.owner != me or intent.attached:
                # a twin produces them (we did not wait, or timed out): do not steal its claim;
                # the hit tells the scheduler so (prefill_pending)
                hit.hybrid = intent
                return
            intent.attached = True
            intent.hit_id = id(hit)
        hit.hybrid = intent

    def abandon(self, hit: CacheHit) -> None:
        """The request that missed will not save (it failed or was cancelled): wake its twins."""
        intent = hit.hybrid
        if isinstance(intent, _Intent) and intent.hit_id == id(hit):
            with self._lock:
                self._drop(intent)

    def saved(self, keys: Sequence[Key]) -> None:
        """A save of ``keys`` finished: wake the twins waiting for any of them."""
        if not self.coalesce:
            return
        with self._lock:
            for k in keys:
                intent = self._intents.get(k)
                if intent is not None:
                    self._drop(intent)

    def _drop(self, intent: _Intent) -> None:
        for k in intent.keys:
            if self._intents.get(k) is intent:
                del self._intents[k]
        intent.done.set()


def put_anchor(cache: HostKVCache, keys: Sequence[bytes], page: int, name: str, data: object) -> None:
    """Attach anchor ``name`` to stored page ``keys[page]`` of a chain (depth ``page``) through the
    cache: a hybrid cache wraps it in its record, and refuses a record of another page or format
    (:class:`AnchorMismatchError`).  Prefer ``save(..., anchors=)``, which places them itself."""
    if cache._hybrid is None:
        ks = cache._chain(keys)
        if type(page) is not int or not 0 <= page < len(ks):
            raise InvalidArgumentError(f"page {page!r} outside the chain of {len(ks)} pages")
        cache.provider.put_anchor(ks[page], check_anchor_name(name), data)
        return
    cache._hybrid.put_anchor(keys, page, name, data)


def abandon_prefill(hit: CacheHit) -> None:
    """Tell a ``coalesce_prefills`` cache that the request whose lookup missed will not save (it
    failed or was cancelled): the identical requests waiting for its prefill stop waiting now."""
    hyb = hit._cache._hybrid
    if hyb is not None:
        hyb.abandon(hit)


def prefill_pending(hit: CacheHit) -> threading.Event | None:
    """For a ``coalesce_prefills`` cache: when the pages ``hit`` lacks are being produced by
    another request's prefill, the event set when that request's save (pages and anchors) is
    done or abandoned; ``None`` otherwise (this request is the producer, or nobody is).

    A scheduler that must not block (one thread for all requests) looks up with
    ``wait=False``, defers a request whose hit has a pending prefill, and looks it up again once
    the event is set: the twin then restores instead of prefilling the same tokens."""
    intent = hit.hybrid
    if isinstance(intent, _Intent) and intent.hit_id != id(hit) and not intent.done.is_set():
        return intent.done
    return None


def make_hybrid(cache: HostKVCache, required_anchors: Iterable[str] | None,
                anchor_groups: Mapping[str, Iterable[str]] | None, coalesce_prefills: bool) -> HybridState | None:
    """The cache's hybrid policy, or ``None`` when none of its options is set (the cache then
    behaves exactly as before)."""
    if type(coalesce_prefills) is not bool:
        raise InvalidArgumentError(f"coalesce_prefills must be a bool, got {coalesce_prefills!r}")
    if required_anchors is None and not anchor_groups and not coalesce_prefills:
        return None
    return HybridState(cache, required_anchors or (), anchor_groups, coalesce_prefills)

