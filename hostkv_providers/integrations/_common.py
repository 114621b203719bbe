"""What the three engine adapters share: engine hashes to keys under a salt, chain writes that
tolerate a missing parent, batched reads that report misses, and the adapters' I/O threads.

Nothing here imports an engine.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from hostkv_providers._capabilities import SupportsBatch
from hostkv_providers._errors import HostKVError, InvalidArgumentError
from hostkv_providers._keys import Key, Salt
from hostkv_providers._layout import KVLayout
from hostkv_providers._provider import Provider
from hostkv_providers._registry import open_provider

__all__ = [
    "ENGINE_KEY_PERSON",
    "AdapterStats",
    "EngineKeyer",
    "IOPool",
    "engine_salt",
    "open_store",
    "read_pages",
    "store_pages",
]

#: BLAKE2b personalization of engine-hash keys (distinct from ``chain_keys``' page keys, so an
#: engine key can never collide with a key that ``HostKVCache`` computed from tokens).
ENGINE_KEY_PERSON = b"hostkv-engine"

_T = TypeVar("_T")


class EngineKeyer:
    """Maps an engine's block/chunk hashes to 32-byte keys under a salt.

    ``key = BLAKE2b-256(key=salt.digest, person="hostkv-engine"; engine || 0x00 || hash)``.
    The engine's hash already certifies the page's prefix (vLLM's block hashes, SGLang's page
    hashes and LMCache's chunk hashes are all chained over the prompt), so the mapping only has
    to make it cryptographically keyed by everything the salt holds: two configurations (another
    model, revision, KV dtype, layout, page size, tensor-parallel rank or world size, namespace)
    never share a key, whatever the engine hashed.
    """

    __slots__ = ("_base", "engine", "salt")

    def __init__(self, salt: Salt, engine: str) -> None:
        if not isinstance(salt, Salt):
            raise InvalidArgumentError("EngineKeyer needs a Salt")
        if not engine or not engine.isascii():
            raise InvalidArgumentError(f"engine name must be a non-empty ASCII string, got {engine!r}")
        self.salt = salt
        self.engine = engine
        base = hashlib.blake2b(digest_size=32, key=salt.digest, person=ENGINE_KEY_PERSON)
        base.update(engine.encode() + b"\x00")
        self._base = base

    def key(self, engine_hash: bytes | str) -> Key:
        """The key of one engine hash (``str`` hashes are hashed as their UTF-8 bytes)."""
        raw = engine_hash.encode() if isinstance(engine_hash, str) else bytes(engine_hash)
        h = self._base.copy()
        h.update(raw)
        return Key(h.digest())

    def keys(self, engine_hashes: Sequence[bytes | str]) -> list[Key]:
        """:meth:`key` of each hash, in order."""
        base = self._base
        out: list[Key] = []
        for raw in engine_hashes:
            h = base.copy()
            h.update(raw.encode() if isinstance(raw, str) else bytes(raw))
            out.append(Key(h.digest()))
        return out


def engine_salt(
    *,
    engine: str,
    model_id: str,
    layout: KVLayout,
    model_revision: str = "",
    quantization: str = "none",
    namespace: str = "",
    tp_rank: int = 0,
    tp_world_size: int = 1,
    kv_head_start: int | None = None,
    kv_head_count: int | None = None,
    extra: dict[str, object] | None = None,
) -> Salt:
    """A :class:`Salt` for an engine adapter; ``extra`` holds the engine-specific geometry.

    The engine's name is part of the salt: the same model stored by two engines has two page
    formats, so their pages never meet.
    """
    fields = {"engine": engine}
    for k, v in (extra or {}).items():
        fields[str(k)] = str(v)
    return Salt(
        model_id=model_id or "unknown-model",
        layout=layout,
        model_revision=model_revision,
        quantization=quantization,
        namespace=namespace,
        extra=tuple(sorted(fields.items())),
        tp_rank=tp_rank,
        tp_world_size=tp_world_size,
        kv_head_start=kv_head_start,
        kv_head_count=kv_head_count,
    )


def open_store(url: str | Provider) -> Provider:
    """A provider from a URL (``mmap://``, ``lmdb://``, ``tiered://``, ``redis://`` ...) or as is."""
    if isinstance(url, Provider):
        return url
    if not isinstance(url, str) or "://" not in url:
        raise InvalidArgumentError(
            f"a hostkv store URL is needed, got {url!r}",
            hint="e.g. url='mmap:///var/cache/hostkv?budget=64GiB'",
        )
    return open_provider(url)


@dataclass
class AdapterStats:
    """Counters an adapter keeps (thread-safe through its lock)."""

    stored_pages: int = 0
    deduped_pages: int = 0
    orphan_roots: int = 0
    store_failures: int = 0
    loaded_pages: int = 0
    load_misses: int = 0
    stored_bytes: int = 0
    loaded_bytes: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **counts: int) -> None:
        with self.lock:
            for name, value in counts.items():
                setattr(self, name, getattr(self, name) + value)

    def as_dict(self) -> dict[str, int]:
        with self.lock:
            return {k: v for k, v in vars(self).items() if isinstance(v, int)}


def store_pages(
    provider: Provider,
    items: Sequence[tuple[Key, Key | None, object]],
    *,
    salt_tag: str,
    stats: AdapterStats | None = None,
) -> list[bool]:
    """Store ``(key, parent, data)`` items (a chain root first); per item whether it is stored.

    A parent that is neither stored nor an earlier item of the call (the engine dropped or
    evicted it, or never stored it here) makes the page an *orphan root*: it is stored with no
    parent.  The page stays correct -- the engine's hash certifies its whole prefix -- and is
    still useful, because engines look up from their first page *not* already cached above this
    tier; what it costs is the tree link (it is evicted as a leaf of its own).  Already stored
    keys count as stored (dedup).  Errors of single items (capacity, a key in flight in another
    writer) are ``False``; whole-call I/O errors propagate.
    """
    if not items:
        return []
    batch = list(items)
    in_call = {k for k, _, _ in batch}
    parents = [p for _, p, _ in batch if p is not None and p not in in_call]
    absent: set[Key] = set()
    if parents:
        uniq = list(dict.fromkeys(parents))
        absent = {p for p, hit in zip(uniq, provider.present(uniq), strict=True) if not hit}
    fixed: list[tuple[bytes, bytes | None, object]] = []
    orphans = 0
    for key, parent, data in batch:
        if parent is not None and parent in absent:
            orphans += 1
            fixed.append((key, None, data))
        else:
            fixed.append((key, parent, data))
    results: list[bool | HostKVError]
    if isinstance(provider, SupportsBatch):
        results = provider.put_many(fixed, salt_tag=salt_tag)
    else:
        results = []
        for raw_key, raw_parent, data in fixed:
            try:
                results.append(provider.put(raw_key, raw_parent, data, salt_tag=salt_tag))
            except HostKVError as exc:
                results.append(exc)
    ok = [r is True or r is False for r in results]
    if stats is not None:
        nbytes = 0
        for (_, _, data), r in zip(fixed, results, strict=True):
            if r is True:
                nbytes += memoryview(data).nbytes  # type: ignore[arg-type]
        stats.add(
            stored_pages=sum(1 for r in results if r is True),
            deduped_pages=sum(1 for r in results if r is False),
            store_failures=sum(1 for r in ok if not r),
            orphan_roots=orphans,
            stored_bytes=nbytes,
        )
    return ok


def read_pages(
    provider: Provider,
    keys: Sequence[Key],
    outs: Sequence[object],
    *,
    stats: AdapterStats | None = None,
) -> list[bool]:
    """Read whole entries into ``outs``; per key ``True`` or ``False`` (a miss, including a page
    whose checksum failed: the provider drops it and its subtree).  Where ``False``, ``outs[i]``
    may hold garbage; the adapters never report such a slot as loaded."""
    if not keys:
        return []
    if isinstance(provider, SupportsBatch):
        hits = provider.read_many(list(keys), list(outs))
    else:
        hits = [provider.read(k, o) for k, o in zip(keys, outs, strict=True)]
    if stats is not None:
        n = sum(hits)
        nbytes = 0
        for o, h in zip(outs, hits, strict=True):
            if h:
                nbytes += memoryview(o).nbytes  # type: ignore[arg-type]
        stats.add(loaded_pages=n, load_misses=len(hits) - n, loaded_bytes=nbytes)
    return hits


class IOPool:
    """The adapter's I/O threads: the engine's thread only enqueues, never copies a page.

    ``max_pending`` bounds the queued jobs; :meth:`try_submit` returns ``None`` past it (the
    backpressure signal an adapter turns into the engine's own: a dropped store, a failed job).
    """

    def __init__(self, name: str, *, threads: int = 2, max_pending: int = 1024) -> None:
        if threads < 1 or max_pending < 1:
            raise InvalidArgumentError("IOPool needs threads >= 1 and max_pending >= 1")
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=f"hostkv-{name}")
        self._max_pending = max_pending
        self._pending = 0
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._closed = False

    @property
    def pending(self) -> int:
        with self._lock:
            return self._pending

    def try_submit(self, fn: Callable[..., _T], *args: Any) -> Future[_T] | None:
        """Queue ``fn(*args)``; ``None`` when ``max_pending`` jobs are already queued."""
        with self._lock:
            if self._closed:
                raise InvalidArgumentError("IOPool is closed")
            if self._pending >= self._max_pending:
                return None
            self._pending += 1
        try:
            fut = self._pool.submit(fn, *args)
        except BaseException:
            self._done()
            raise
        fut.add_done_callback(lambda _f: self._done())
        return fut

    def submit(self, fn: Callable[..., _T], *args: Any) -> Future[_T]:
        """Queue ``fn(*args)`` whatever is pending (jobs the engine must see completed)."""
        with self._lock:
            if self._closed:
                raise InvalidArgumentError("IOPool is closed")
            self._pending += 1
        try:
            fut = self._pool.submit(fn, *args)
        except BaseException:
            self._done()
            raise
        fut.add_done_callback(lambda _f: self._done())
        return fut

    def _done(self) -> None:
        with self._lock:
            self._pending -= 1
            if self._pending == 0:
                self._idle.notify_all()

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until no job is pending; ``False`` on timeout."""
        with self._lock:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)

    def close(self) -> None:
        """Finish the queued jobs and stop the threads."""
        with self._lock:
            self._closed = True
        self._pool.shutdown(wait=True)
