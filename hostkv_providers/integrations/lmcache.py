"""LMCache: any hostkv store as an LMCache storage plugin (``StoragePluginInterface``).

LMCache config (YAML, or the ``LMCACHE_*`` environment)::

    chunk_size: 256
    local_cpu: true
    max_local_cpu_size: 8
    storage_plugins: ["hostkv"]
    extra_config:
      storage_plugin.hostkv.module_path: hostkv_providers.integrations.lmcache
      storage_plugin.hostkv.class_name: HostKVBackend
      hostkv.url: "mmap:///nvme/hostkv?budget=256GiB"

LMCache's ``StorageManager`` creates :class:`HostKVBackend` through ``storage_plugin_launcher``
and writes through it (``batched_put`` -> ``batched_submit_put_task``, asynchronous: the copy
runs on the adapter's I/O threads and ``on_complete_callback`` fires per key once the chunk is
sealed) and reads through it (``contains``/``batched_contains``, ``get_blocking``,
``batched_get_blocking``, the async ``batched_async_contains``/``batched_get_non_blocking``).

Keys: LMCache's ``CacheEngineKey`` (model, world size, worker id, the chunk hash -- chained over
the prompt's tokens -- dtype, request tags, and the layer of a layer-wise key) mapped under a
salt of the ``LMCacheMetadata`` (model, KV dtype and shape, chunk size, MLA, worker id and world
size: a TP rank never reads another's chunks) and ``hostkv.namespace``/``hostkv.model_revision``.
``put(key, obj)`` gives no parent: by default (``hostkv.chain: call``) the chunks of one put call
-- consecutive chunks of one request, in order -- are linked, the first one a root; ``flat``
stores every chunk as a root.  ``docs/engines/lmcache.md`` says what each costs.

The same store also serves as an LMCache *remote* backend: :class:`HostKVConnector`, a
``RemoteConnector`` for ``remote_storage_plugins`` (LMCache's ``RemoteBackend`` runs it on its
event loop, behind its local CPU backend)::

    remote_storage_plugins: ["hostkv"]
    extra_config:
      remote_storage_plugin.hostkv.module_path: hostkv_providers.integrations.lmcache
      remote_storage_plugin.hostkv.class_name: HostKVConnector
      hostkv.url: "lmdb:///nvme/hostkv?budget=256GiB"

Both write the same entries under the same keys, so a store written through one reads through
the other.

Each entry holds a 64-byte header (magic, shape, dtype, memory format) before the chunk's
bytes, all covered by the entry's checksum, so a chunk is rebuilt exactly after a restart.
"""

from __future__ import annotations

import asyncio
import logging
import struct
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np
import torch
from lmcache.utils import CacheEngineKey, LayerCacheEngineKey
from lmcache.v1.memory_management import MemoryFormat, MemoryObj
from lmcache.v1.storage_backend.abstract_backend import StoragePluginInterface
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

from hostkv_providers._errors import HostKVError, InvalidArgumentError
from hostkv_providers._keys import Key, Salt
from hostkv_providers._layout import DTYPE_ITEMSIZE, KVLayout
from hostkv_providers._provider import Provider
from hostkv_providers._reservation import Lease
from hostkv_providers.integrations._common import (
    AdapterStats,
    EngineKeyer,
    IOPool,
    engine_salt,
    open_store,
    store_pages,
)

__all__ = ["HEADER_NBYTES", "HostKVBackend", "HostKVConnector", "salt_from_metadata"]

logger = logging.getLogger(__name__)

HEADER_NBYTES = 64
_MAGIC = b"HKVLMC01"
# magic | dtype code | format | ndim | pad | 6 dims (int64)
_HEADER = struct.Struct("<8sHHB3x6q")
_DTYPES: list[torch.dtype] = [torch.bfloat16, torch.float16, torch.float32, torch.uint8, torch.int8,
                              torch.float8_e4m3fn, torch.float8_e5m2, torch.float64, torch.int32, torch.int64]
_DTYPE_CODE = {d: i for i, d in enumerate(_DTYPES)}


def _pack_header(shape: Sequence[int], dtype: torch.dtype, fmt: MemoryFormat) -> bytes:
    if dtype not in _DTYPE_CODE or len(shape) > 6:
        raise InvalidArgumentError(f"HostKVBackend cannot store a chunk of dtype {dtype} and shape {tuple(shape)}")
    dims = [int(x) for x in shape] + [0] * (6 - len(shape))
    return _HEADER.pack(_MAGIC, _DTYPE_CODE[dtype], int(fmt.value), len(shape), *dims).ljust(HEADER_NBYTES, b"\0")


def _unpack_header(raw: bytes) -> tuple[torch.Size, torch.dtype, MemoryFormat] | None:
    """The chunk's shape, dtype and format, or ``None`` for a header this adapter did not write."""
    magic, code, fmt, ndim, *dims = _HEADER.unpack_from(raw)
    if magic != _MAGIC or code >= len(_DTYPES) or ndim > 6:
        return None
    try:
        return torch.Size(dims[:ndim]), _DTYPES[code], MemoryFormat(fmt)
    except ValueError:
        return None


def salt_from_metadata(metadata: Any, extra_config: dict[str, Any] | None = None) -> Salt:
    """The salt of one LMCache worker (``LMCacheMetadata``) and the plugin's extra config."""
    extra_cfg = extra_config or {}
    shape = tuple(int(x) for x in metadata.kv_shape)  # (layers, 2 or 1, chunk tokens, heads, head size)
    layers, kv, chunk, heads, head = (*shape, 1, 1, 1, 1, 1)[:5]
    dtype = str(metadata.kv_dtype).replace("torch.", "")
    mla = bool(getattr(metadata, "use_mla", False))
    world, rank = int(metadata.world_size), int(metadata.worker_id)
    layout = KVLayout(num_layers=max(layers, 1), num_kv_heads=max(heads, 1) * (1 if mla else world),
                      head_dim=max(head, 1), page_tokens=int(getattr(metadata, "chunk_size", chunk) or chunk),
                      dtype=dtype if dtype in DTYPE_ITEMSIZE else "uint8",
                      kinds=("kv",) if mla or kv == 1 else ("k", "v"))
    return engine_salt(
        engine="lmcache",
        model_id=str(metadata.model_name),
        layout=layout,
        model_revision=str(extra_cfg.get("hostkv.model_revision", "")),
        quantization=str(extra_cfg.get("hostkv.quantization", "none")),
        namespace=str(extra_cfg.get("hostkv.namespace", "")),
        tp_rank=0 if mla else rank,
        tp_world_size=1 if mla else world,
        extra={"lmcache.kv_shape": "x".join(map(str, shape)), "lmcache.kv_dtype": dtype, "lmcache.mla": mla,
               "lmcache.world_size": world},
    )


class HostKVBackend(StoragePluginInterface):
    """An LMCache storage plugin over any hostkv provider.

    Extra config keys: ``hostkv.url`` (required), ``hostkv.namespace``, ``hostkv.model_revision``,
    ``hostkv.quantization``, ``hostkv.chain`` (``call`` or ``flat``), ``hostkv.io_threads`` (2),
    ``hostkv.max_pending_puts`` (1024 put calls: past it a put is skipped, as LMCache's own
    backends skip a put they cannot admit).
    """

    def __init__(self, dst_device: str = "cpu", config: Any = None, metadata: Any = None,
                 local_cpu_backend: Any = None, loop: asyncio.AbstractEventLoop | None = None) -> None:
        super().__init__(dst_device="cpu", config=config, metadata=metadata,
                         local_cpu_backend=local_cpu_backend, loop=loop)
        extra = dict(getattr(config, "extra_config", None) or {})
        url = extra.get("hostkv.url")
        if not url:
            raise InvalidArgumentError("HostKVBackend needs 'hostkv.url' in LMCache's extra_config",
                                       hint="hostkv.url: mmap:///nvme/hostkv?budget=256GiB")
        if metadata is None:
            raise InvalidArgumentError("HostKVBackend needs LMCache's metadata (model, KV shape, worker)")
        if local_cpu_backend is None:
            raise InvalidArgumentError("HostKVBackend allocates through LMCache's LocalCPUBackend",
                                       hint="keep local_cpu's allocator enabled (LMCache creates it by default)")
        chain = str(extra.get("hostkv.chain", "call"))
        if chain not in ("call", "flat"):
            raise InvalidArgumentError(f"hostkv.chain must be 'call' or 'flat', got {chain!r}")
        self._chain = chain
        self._owns_provider = not isinstance(url, Provider)
        self.provider = open_store(url)
        self.salt = salt_from_metadata(metadata, extra)
        self._keyer = EngineKeyer(self.salt, "lmcache")
        self._io = IOPool("lmcache", threads=int(extra.get("hostkv.io_threads", 2)),
                          max_pending=int(extra.get("hostkv.max_pending_puts", 1024)))
        self._inflight: set[Key] = set()
        self._pins: dict[Key, Lease] = {}
        self._lock = threading.Lock()
        self.stats = AdapterStats()

    def __str__(self) -> str:
        return "HostKVBackend"

    def _key(self, key: CacheEngineKey) -> Key:
        # Everything of LMCache's key that names the chunk's bytes: its own model/world/worker
        # (a worker may hold keys of several), the chained chunk hash, dtype and request tags.
        return _lmcache_key(self._keyer, key)

    # -- lookups -----------------------------------------------------------------------------
    def contains(self, key: CacheEngineKey, pin: bool = False) -> bool:
        ours = self._key(key)
        if not self.provider.present([ours])[0]:
            return False
        if pin:
            self.pin(key)
        return True

    def batched_contains(self, keys: list[CacheEngineKey], pin: bool = False) -> int:
        ours = [self._key(k) for k in keys]
        n = self.provider.longest_prefix(ours)
        if pin:
            for k in keys[:n]:
                self.pin(k)
        return n

    async def batched_async_contains(self, lookup_id: str, keys: list[CacheEngineKey], pin: bool = False) -> int:
        return self.batched_contains(keys, pin)

    def exists_in_put_tasks(self, key: CacheEngineKey) -> bool:
        with self._lock:
            return self._key(key) in self._inflight

    # -- puts (asynchronous) -----------------------------------------------------------------
    def batched_submit_put_task(
        self, keys: Sequence[CacheEngineKey], objs: list[MemoryObj], transfer_spec: Any = None,
        on_complete_callback: Callable[[CacheEngineKey], None] | None = None,
    ) -> list[Future[Any]] | None:
        if len(keys) != len(objs):
            raise InvalidArgumentError(f"{len(keys)} keys but {len(objs)} memory objects")
        ours = [self._key(k) for k in keys]
        with self._lock:
            todo = [i for i, k in enumerate(ours) if k not in self._inflight]
            if not todo:
                return None
            for i in todo:
                self._inflight.add(ours[i])
        for i in todo:
            objs[i].ref_count_up()  # LMCache frees the object when the manager drops its ref
        fut = self._io.try_submit(self._run_put, [keys[i] for i in todo], [ours[i] for i in todo],
                                  [objs[i] for i in todo], on_complete_callback)
        if fut is None:  # backpressure: skip the put, as LMCache's backends skip what they cannot admit
            self._release([ours[i] for i in todo], [objs[i] for i in todo])
            self.stats.add(store_failures=len(todo))
            return None
        return [fut]

    def _release(self, ours: Sequence[Key], objs: Sequence[MemoryObj]) -> None:
        with self._lock:
            for k in ours:
                self._inflight.discard(k)
        for obj in objs:
            obj.ref_count_down()

    def _run_put(self, keys: Sequence[CacheEngineKey], ours: Sequence[Key], objs: Sequence[MemoryObj],
                 callback: Callable[[CacheEngineKey], None] | None) -> None:
        try:
            items: list[tuple[Key, Key | None, object]] = []
            parent: Key | None = None
            for k, obj in zip(ours, objs, strict=True):
                items.append((k, parent if self._chain == "call" else None, _encode(obj)))
                parent = k
            ok = store_pages(self.provider, items, salt_tag=self.salt.tag, stats=self.stats)
        except Exception:
            logger.exception("hostkv: put of %d chunks failed", len(ours))
            ok = [False] * len(ours)
        finally:
            self._release(ours, objs)
        if callback is not None:
            for key, stored in zip(keys, ok, strict=True):
                if stored:
                    try:
                        callback(key)
                    except Exception:  # LMCache's contract: callback errors are logged
                        logger.exception("hostkv: on_complete_callback failed for %s", key)

    # -- gets --------------------------------------------------------------------------------
    def get_blocking(self, key: CacheEngineKey) -> MemoryObj | None:
        return self._load(self._key(key))

    def batched_get_blocking(self, keys: list[CacheEngineKey]) -> list[MemoryObj | None]:
        return [self._load(self._key(k)) for k in keys]

    def get_non_blocking(self, key: CacheEngineKey, location: str | None = None) -> Future[Any] | None:
        ours = self._key(key)
        if not self.provider.present([ours])[0]:
            return None
        # On the I/O threads the puts run on: waiting there for CPU buffer that only a finished
        # put frees could wait forever, so a full buffer is a miss.
        return self._io.submit(self._load, ours, False)

    async def batched_get_non_blocking(self, lookup_id: str, keys: list[CacheEngineKey],
                                       transfer_spec: Any = None) -> list[MemoryObj]:
        # LMCache's prefetch (StorageManager.async_lookup_and_prefetch) pins the keys in
        # batched_async_contains(pin=True) and hands them here; nobody else unpins them, so every
        # key is unpinned once this returns, loaded or not (a miss ends the prefix early).
        loop = asyncio.get_running_loop()
        out: list[MemoryObj] = []
        try:
            for k in keys:
                # busy_loop=False, as LMCache's LocalDiskBackend on this path: a full CPU staging
                # buffer (earlier retrieves not consumed yet) ends the prefix instead of spinning.
                obj = await loop.run_in_executor(None, self._load, self._key(k), False)
                if obj is None:
                    break  # a prefix of hits, as LMCache's retrievers expect
                out.append(obj)
        finally:
            for k in keys:
                self.unpin(k)
        return out

    def _load(self, ours: Key, busy_loop: bool = True) -> MemoryObj | None:
        t0 = time.monotonic()
        obj = _load_entry(self.provider, self.stats, self.local_cpu_backend, ours, busy_loop=busy_loop)
        if obj is not None:
            logger.debug("hostkv: loaded %s in %.3f ms", ours.hex()[:16], (time.monotonic() - t0) * 1e3)
        return obj

    # -- pins, removal, lifecycle ------------------------------------------------------------
    def pin(self, key: CacheEngineKey) -> bool:
        ours = self._key(key)
        with self._lock:
            if ours in self._pins:
                return True
        try:
            lease = self.provider.lease([ours])
        except HostKVError:
            return False
        with self._lock:
            if ours in self._pins:
                lease.release()
            else:
                self._pins[ours] = lease
        return True

    def unpin(self, key: CacheEngineKey) -> bool:
        with self._lock:
            lease = self._pins.pop(self._key(key), None)
        if lease is None:
            return False
        lease.release()
        return True

    def remove(self, key: CacheEngineKey, force: bool = True) -> bool:
        ours = self._key(key)
        if not force and ours in self._pins:
            return False
        self.unpin(key)
        return self.provider.evict([ours]).entries > 0

    def touch_cache(self) -> None:
        return None

    def get_allocator_backend(self) -> Any:
        return self.local_cpu_backend

    def close(self) -> None:
        self._io.close()
        with self._lock:
            leases, self._pins = list(self._pins.values()), {}
        for lease in leases:
            lease.release()
        if self._owns_provider and not self.provider.closed:
            self.provider.close()


def _encode(obj: MemoryObj) -> np.ndarray:
    """One chunk as an entry: the 64-byte header, then the chunk's bytes."""
    tensor = obj.tensor
    if tensor is None:
        raise InvalidArgumentError("a memory object without a tensor cannot be stored")
    body = tensor.contiguous().view(torch.uint8).reshape(-1).numpy()
    data = np.empty(HEADER_NBYTES + body.nbytes, dtype=np.uint8)
    data[:HEADER_NBYTES] = np.frombuffer(_pack_header(obj.get_shape(), tensor.dtype, obj.get_memory_format()),
                                         dtype=np.uint8)
    data[HEADER_NBYTES:] = body
    return data


def _lmcache_key(keyer: EngineKeyer, key: CacheEngineKey) -> Key:
    tags = getattr(key, "tags", None) or ()
    name = (f"{key.model_name}\x00{key.world_size}\x00{key.worker_id}\x00{key.chunk_hash}"
            f"\x00{key.dtype}\x00{tags!r}")
    # Layer-wise mode (LMCacheEngine.store_layer) stores one key per layer of a chunk, the same
    # but for its layer_id.  Appended only for those keys, so a chunk key hashes as it always did
    # (stores written before keep their keys); ``repr`` of the tags never holds a NUL, so the two
    # forms cannot meet.
    if isinstance(key, LayerCacheEngineKey):
        name += f"\x00layer={int(key.layer_id)}"
    return keyer.key(name)


class HostKVConnector(RemoteConnector):
    """An LMCache remote connector (``remote_storage_plugins``) over any hostkv provider.

    LMCache's ``RemoteBackend`` builds it through its ``DynamicConnectorAdapter`` (``loop``,
    ``local_cpu_backend``, ``config``) and awaits its coroutines on its own event loop; the
    provider calls run on the connector's I/O threads, so the loop never blocks on a copy or a
    sync.  Extra config: ``remote_storage_plugin.<name>.url`` or ``hostkv.url`` (required),
    ``hostkv.namespace``/``hostkv.model_revision``/``hostkv.quantization``, ``hostkv.io_threads``.
    A put gives no parent (LMCache's connector API is one chunk per call): every chunk is a
    root.  A chunk whose checksum fails reads as ``None`` (a miss), never as wrong bytes.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, local_cpu_backend: Any, config: Any,
                 plugin_name: str | None = None) -> None:
        if local_cpu_backend is None:
            raise InvalidArgumentError("HostKVConnector allocates through LMCache's LocalCPUBackend")
        super().__init__(local_cpu_backend.config, local_cpu_backend.metadata)
        extra = dict(getattr(config, "extra_config", None) or {})
        url = extra.get(f"remote_storage_plugin.{plugin_name or 'hostkv'}.url") or extra.get("hostkv.url")
        if not url:
            raise InvalidArgumentError("HostKVConnector needs 'hostkv.url' in LMCache's extra_config",
                                       hint="hostkv.url: lmdb:///nvme/hostkv?budget=256GiB")
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        self._owns_provider = not isinstance(url, Provider)
        self.provider = open_store(url)
        self.salt = salt_from_metadata(local_cpu_backend.metadata, extra)
        self._keyer = EngineKeyer(self.salt, "lmcache")
        self._io = IOPool("lmcache-remote", threads=int(extra.get("hostkv.io_threads", 2)), max_pending=1 << 30)
        self.stats = AdapterStats()

    def __repr__(self) -> str:
        return f"HostKVConnector({self.salt.tag})"

    def _key(self, key: CacheEngineKey) -> Key:
        return _lmcache_key(self._keyer, key)

    async def _off_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.wrap_future(self._io.submit(fn, *args))

    async def exists(self, key: CacheEngineKey) -> bool:
        return bool(await self._off_loop(self.exists_sync, key))

    def exists_sync(self, key: CacheEngineKey) -> bool:
        return bool(self.provider.present([self._key(key)])[0])

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: list[CacheEngineKey]) -> int:
        return int(self.provider.longest_prefix([self._key(k) for k in keys]))

    async def get(self, key: CacheEngineKey) -> MemoryObj | None:
        obj: MemoryObj | None = await self._off_loop(self._load, self._key(key))
        return obj

    def _load(self, ours: Key) -> MemoryObj | None:
        return _load_entry(self.provider, self.stats, self.local_cpu_backend, ours)

    async def put(self, key: CacheEngineKey, memory_obj: MemoryObj) -> None:
        # Held until the copy is done: RemoteBackend drops its own reference right after
        # submitting this coroutine.
        memory_obj.ref_count_up()
        try:
            ok = await self._off_loop(self._store, self._key(key), memory_obj)
        finally:
            memory_obj.ref_count_down()
        if not ok:  # RemoteBackend counts a raised put as a failed one
            raise HostKVError("hostkv: the chunk was not stored (capacity or I/O); see the log")

    def _store(self, ours: Key, obj: MemoryObj) -> bool:
        return bool(store_pages(self.provider, [(ours, None, _encode(obj))], salt_tag=self.salt.tag,
                                stats=self.stats)[0])

    def remove_sync(self, key: CacheEngineKey) -> bool:
        return self.provider.evict([self._key(key)]).entries > 0

    async def list(self) -> list[str]:
        """This configuration's keys, as hex (LMCache's keys are hashed into ours)."""
        def mine() -> list[str]:
            entries = getattr(self.provider, "iter_entries", None)
            if entries is None:
                return []
            return [e.key.hex() for e in entries() if e.salt_tag == self.salt.tag]
        out: list[str] = await self._off_loop(mine)
        return out

    async def close(self) -> None:
        self._io.close()
        if self._owns_provider and not self.provider.closed:
            self.provider.close()


def _load_entry(provider: Provider, stats: AdapterStats, local_cpu_backend: Any, ours: Key, *,
                busy_loop: bool = True) -> MemoryObj | None:
    """One stored entry (header + bytes) into a fresh ``MemoryObj`` of LMCache's CPU backend:
    ``None`` (a miss, counted) when it is absent, fails its checksum, or does not match its
    header.  Shared by the storage plugin and the remote connector.  ``busy_loop``: LMCache's
    allocator waits for buffer to free up (its blocking retrieves); ``False`` (its async and
    non-blocking loads) makes a full buffer a miss at once."""
    info = provider.entry(ours)
    if info is None or info.nbytes < HEADER_NBYTES:
        stats.add(load_misses=1)
        return None
    buf = np.empty(info.nbytes, dtype=np.uint8)
    try:
        hit = provider.read(ours, buf)
    except HostKVError:
        logger.exception("hostkv: read failed")
        hit = False
    meta = _unpack_header(buf[:HEADER_NBYTES].tobytes()) if hit else None
    if meta is None:
        stats.add(load_misses=1)
        return None
    shape, dtype, fmt = meta
    obj = local_cpu_backend.allocate(shape, dtype, fmt, busy_loop=busy_loop)
    if obj is None or obj.tensor is None:
        if obj is not None:
            obj.ref_count_down()
        stats.add(load_misses=1)
        return None
    dst = obj.tensor.view(torch.uint8).reshape(-1)
    if dst.numel() != info.nbytes - HEADER_NBYTES:
        obj.ref_count_down()
        stats.add(load_misses=1)
        return None
    dst.copy_(torch.from_numpy(buf[HEADER_NBYTES:]))
    stats.add(loaded_pages=1, loaded_bytes=dst.numel())
    return obj
