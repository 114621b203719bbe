"""Drives LMCache's real StorageManager on CPU with HostKVBackend loaded as a storage plugin.

``StorageManager(LMCacheEngineConfig, LMCacheMetadata, EventManager)`` creates LMCache's own
``LocalCPUBackend`` (the allocator) and, through ``storage_plugin_launcher``, our plugin from
``storage_plugins`` + ``extra_config`` exactly as an LMCache deployment does.  Chunks are LMCache
``MemoryObj``\\ s allocated by the manager (``allocate``), keyed by ``CacheEngineKey`` with chunk
hashes from LMCache's own ``TokenDatabase`` (``ChunkedTokenDatabase.process_tokens``).

With ``remote=True`` the same manager builds LMCache's ``RemoteBackend`` for
``remote_storage_plugins: ["hostkv"]``, which creates :class:`HostKVConnector` through LMCache's
``CreateConnector`` -> ``DynamicConnectorAdapter`` and runs it on the manager's event loop.

Script: ``python _lmcache_engine.py store|check URL SEED NCHUNKS [worker world [remote]]``.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import numpy as np
import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.event_manager import EventManager
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.storage_manager import StorageManager
from lmcache.v1.token_database import ChunkedTokenDatabase

CHUNK = 16
LAYERS, HEADS, DIM = 4, 4, 32
SHAPE = torch.Size([2, LAYERS, CHUNK, HEADS * DIM])  # MemoryFormat.KV_2LTD, one chunk
MODEL = "mistralai/Mistral-7B-Instruct-v0.3"


def make_manager(url: str | None, *, worker: int = 0, world: int = 1, model: str = MODEL, disk: str | None = None,
                 local_cpu: bool = False, cpu_gb: float = 0.25, remote: bool = False, **extra: Any) -> StorageManager:
    """LMCache's StorageManager with our storage plugin, or (``remote``) LMCache's RemoteBackend
    over our RemoteConnector (which needs LMCache's local CPU backend as its buffer)."""
    extra_config: dict[str, Any] = {}
    plugins: list[str] = []
    kw: dict[str, Any] = {}
    if url is not None and remote:
        local_cpu = True
        kw["remote_storage_plugins"] = ["hostkv"]
        extra_config = {"remote_storage_plugin.hostkv.module_path": "hostkv_providers.integrations.lmcache",
                        "remote_storage_plugin.hostkv.class_name": "HostKVConnector", "hostkv.url": url, **extra}
    elif url is not None:
        plugins = ["hostkv"]
        extra_config = {"storage_plugin.hostkv.module_path": "hostkv_providers.integrations.lmcache",
                        "storage_plugin.hostkv.class_name": "HostKVBackend", "hostkv.url": url, **extra}
    if disk is not None:
        kw.update({"local_disk": disk, "max_local_disk_size": 1.0})
    # sha256_cbor: chunk hashes reproducible across processes (LMCache's default, Python's
    # hash(), is only with a fixed PYTHONHASHSEED), so a restarted engine finds its chunks.
    config = LMCacheEngineConfig.from_defaults(chunk_size=CHUNK, local_cpu=local_cpu, max_local_cpu_size=cpu_gb,
                                               pre_caching_hash_algorithm="sha256_cbor",
                                               storage_plugins=plugins or None,
                                               extra_config=extra_config or None, **kw)
    metadata = LMCacheMetadata(model_name=model, world_size=world, local_world_size=world, worker_id=worker,
                               local_worker_id=worker, kv_dtype=torch.bfloat16,
                               kv_shape=(LAYERS, 2, CHUNK, HEADS, DIM), chunk_size=CHUNK)
    return StorageManager(config, metadata, EventManager())


def chunk_keys(manager: StorageManager, seed: int, n: int) -> list[CacheEngineKey]:
    """LMCache's own keys of a prompt of ``n`` full chunks (ChunkedTokenDatabase)."""
    tokens = torch.from_numpy(np.random.default_rng(seed).integers(0, 32_000, size=n * CHUNK))
    db = ChunkedTokenDatabase(manager.config, manager.metadata)
    keys = [k for _, _, k in db.process_tokens(tokens=tokens)]
    assert len(keys) == n and all(isinstance(k, CacheEngineKey) for k in keys)
    return keys  # type: ignore[return-value]


def chunk_tensor(key: CacheEngineKey) -> torch.Tensor:
    rng = np.random.default_rng([key.worker_id, int(key.chunk_hash) % (1 << 63)])
    raw = rng.integers(0, 256, size=SHAPE.numel() * 2, dtype=np.uint8)
    return torch.from_numpy(raw).view(torch.bfloat16).reshape(SHAPE)


def put(manager: StorageManager, keys: list[CacheEngineKey], *, per_call: int = 8) -> None:
    """The cache engine's store: allocate, fill (the GPU->CPU copy), batched_put."""
    for start in range(0, len(keys), per_call):
        part = keys[start:start + per_call]
        objs = []
        for k in part:
            obj = manager.allocate(SHAPE, torch.bfloat16)
            assert obj is not None and obj.tensor is not None
            obj.tensor.copy_(chunk_tensor(k))
            objs.append(obj)
        manager.batched_put(part, objs)


REMOTE = "RemoteBackend-hostkv"


def ours(manager: StorageManager) -> Any:
    """Our plugin, or the RemoteBackend that runs our connector."""
    return manager.storage_backends.get("hostkv") or manager.storage_backends[REMOTE]


def connector(manager: StorageManager) -> Any:
    """Our connector inside LMCache's RemoteBackend (unwrapped from its metrics wrapper)."""
    conn = manager.storage_backends[REMOTE].connection
    return getattr(conn, "_connector", conn)


def wait_stored(manager: StorageManager, keys: list[CacheEngineKey], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    backend = ours(manager)
    while time.monotonic() < deadline:
        if not any(backend.exists_in_put_tasks(k) for k in keys):
            return
        time.sleep(0.01)
    raise AssertionError("puts still in flight")


def retrieve(manager: StorageManager, keys: list[CacheEngineKey], *, pin: bool = True) -> tuple[int, list[bool]]:
    """The cache engine's retrieve: ``batched_contains`` (prefix hit and which backend holds
    which keys, pinned), then ``batched_get(keys, location=backend)`` per backend, as
    LMCacheEngine.retrieve does; the bytes compared; pins released (``batched_unpin``)."""
    n, mapping = manager.batched_contains(keys, pin=pin)
    got: dict[Any, Any] = {}
    for location, ks in mapping.items():
        for k, obj in zip(ks, manager.batched_get(ks, location=location), strict=True):
            got[k] = obj
    equal = []
    for k in keys[:n]:
        obj = got.get(k)
        equal.append(obj is not None and np.array_equal(obj.tensor.view(torch.uint8).numpy(),
                                                         chunk_tensor(k).view(torch.uint8).numpy()))
        if obj is not None:
            obj.ref_count_down()
    if pin and n:
        manager.batched_unpin(keys[:n])
    return n, equal


def main(argv: list[str]) -> int:
    op, url, seed, n = argv[0], argv[1], int(argv[2]), int(argv[3])
    worker, world = (int(argv[4]), int(argv[5])) if len(argv) > 5 else (0, 1)
    remote = len(argv) > 6 and argv[6] == "remote"
    manager = make_manager(url, worker=worker, world=world, remote=remote)
    keys = chunk_keys(manager, seed, n)
    try:
        if op == "store":
            put(manager, keys)
            wait_stored(manager, keys)
            b = ours(manager)
            stats = b.stats if hasattr(b, "stats") else connector(manager).stats
            print("stored", stats.stored_pages)
        else:
            hits, equal = retrieve(manager, keys)
            print("hits", hits, "equal", sum(equal))
    finally:
        manager.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
