"""HostKVBackend loaded as a storage plugin by LMCache's own StorageManager."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lmcache.v1.storage_backend.storage_manager")

import _lmcache_engine as eng
import torch
from _engine_helpers import corrupt_page, run_engine
from lmcache.v1.memory_management import MemoryFormat

from hostkv_providers.integrations.lmcache import HEADER_NBYTES, HostKVBackend, HostKVConnector


def _url(tmp_path: Path, name: str = "kv") -> str:
    return f"mmap://{tmp_path / name}?budget=64MiB&slot=64KiB"


def _shared_url(tmp_path: Path) -> str:
    return f"lmdb://{tmp_path / 'shared'}?budget=64MiB"


def _plugin(manager: object) -> HostKVBackend:
    backend = manager.storage_backends["hostkv"]  # type: ignore[attr-defined]
    assert isinstance(backend, HostKVBackend)
    return backend


def test_store_restart_hit_bytes_equal(tmp_path: Path) -> None:
    url = _url(tmp_path)
    assert "stored 20" in run_engine("_lmcache_engine.py", "store", url, "1", "20")
    m = eng.make_manager(url)
    try:
        keys = eng.chunk_keys(m, 1, 20)
        assert eng.retrieve(m, keys) == (20, [True] * 20)
        p = _plugin(m)
        ours = [p._key(k) for k in keys]
        infos = [p.provider.entry(k) for k in ours]
        # hostkv.chain=call: the chunks of one put call (8 here) are linked, each call's first a root.
        assert [i.parent if i else "gone" for i in infos[:9]] == [None, *ours[:7], None]
        assert all(i is not None and i.nbytes == HEADER_NBYTES + eng.SHAPE.numel() * 2 for i in infos)
    finally:
        m.close()


def test_flat_mode_stores_roots(tmp_path: Path) -> None:
    m = eng.make_manager(_url(tmp_path), **{"hostkv.chain": "flat"})
    try:
        keys = eng.chunk_keys(m, 2, 6)
        eng.put(m, keys)
        eng.wait_stored(m, keys)
        p = _plugin(m)
        assert all(p.provider.entry(p._key(k)).parent is None for k in keys)  # type: ignore[union-attr]
        assert eng.retrieve(m, keys) == (6, [True] * 6)
    finally:
        m.close()


def test_tp_workers_are_isolated(tmp_path: Path) -> None:
    url = _shared_url(tmp_path)
    w0, w1 = eng.make_manager(url, worker=0, world=2), eng.make_manager(url, worker=1, world=2)
    try:
        k0, k1 = eng.chunk_keys(w0, 3, 8), eng.chunk_keys(w1, 3, 8)
        eng.put(w0, k0)
        eng.wait_stored(w0, k0)
        # Worker 1's plugin never reports worker 0's chunks, not even under worker 0's own keys.
        assert _plugin(w1).batched_contains(k0) == 0 and _plugin(w1).batched_contains(k1) == 0
        eng.put(w1, k1)
        eng.wait_stored(w1, k1)
        assert eng.retrieve(w0, k0) == (8, [True] * 8)
        assert eng.retrieve(w1, k1) == (8, [True] * 8)
        assert _plugin(w0).salt.tag != _plugin(w1).salt.tag
    finally:
        w0.close()
        w1.close()
    for kw in ({"model": "other/model"}, {"hostkv.namespace": "tenant-b"}):
        m = eng.make_manager(url, worker=0, world=2, **kw)  # type: ignore[arg-type]
        try:
            assert _plugin(m).batched_contains(k0) == 0, kw
        finally:
            m.close()


def test_corrupted_chunk_is_a_miss_never_wrong_bytes(tmp_path: Path) -> None:
    url = _url(tmp_path)
    m = eng.make_manager(url)
    try:
        keys = eng.chunk_keys(m, 4, 8)
        eng.put(m, keys)
        eng.wait_stored(m, keys)
    finally:
        m.close()
    needle = eng.chunk_tensor(keys[5]).view(torch.uint8).reshape(-1)[:256].numpy().tobytes()
    assert corrupt_page(tmp_path / "kv", needle) == 1
    m = eng.make_manager(url)
    try:
        n, equal = eng.retrieve(m, keys)
        assert n == 8 and equal == [True] * 5 + [False] * 3  # 5 is a miss, and with it its subtree
        p = _plugin(m)
        assert p.get_blocking(keys[5]) is None and p.stats.load_misses >= 1
        assert m.batched_contains(keys)[0] == 5
    finally:
        m.close()


def test_puts_are_asynchronous_with_callbacks_and_in_flight_state(tmp_path: Path) -> None:
    m = eng.make_manager(_url(tmp_path), **{"hostkv.io_threads": 1})
    release = threading.Event()
    try:
        p = _plugin(m)
        p._io.submit(release.wait)  # hold the only I/O thread
        keys = eng.chunk_keys(m, 5, 4)
        done: list[object] = []
        objs = []
        for k in keys:
            obj = m.allocate(eng.SHAPE, torch.bfloat16)
            obj.tensor.copy_(eng.chunk_tensor(k))
            objs.append(obj)
        futures = p.batched_submit_put_task(keys, objs, on_complete_callback=done.append)
        assert futures and not futures[0].done()  # returned at once; the copy waits its turn
        assert all(p.exists_in_put_tasks(k) for k in keys) and not p.contains(keys[0])
        assert p.batched_submit_put_task(keys, objs) is None  # already in flight: not queued twice
        release.set()
        futures[0].result(timeout=60)
        assert done == keys  # once per key, after its chunk is sealed
        assert not any(p.exists_in_put_tasks(k) for k in keys) and p.batched_contains(keys) == 4
        for obj in objs:
            obj.ref_count_down()
    finally:
        release.set()
        m.close()


def test_backpressure_skips_puts_and_releases_objects(tmp_path: Path) -> None:
    m = eng.make_manager(_url(tmp_path), **{"hostkv.io_threads": 1, "hostkv.max_pending_puts": 1})
    release = threading.Event()
    try:
        p = _plugin(m)
        p._io.submit(release.wait)
        keys = eng.chunk_keys(m, 6, 3)
        objs = [m.allocate(eng.SHAPE, torch.bfloat16) for _ in keys]
        refs = [o.get_ref_count() for o in objs]
        assert p.batched_submit_put_task(keys, objs) is None  # skipped at once, nothing blocks
        assert [o.get_ref_count() for o in objs] == refs and not any(p.exists_in_put_tasks(k) for k in keys)
        assert p.stats.store_failures == 3
        for obj in objs:
            obj.ref_count_down()
    finally:
        release.set()
        m.close()


def test_missing_url_is_not_loaded(tmp_path: Path) -> None:
    # LMCache's launcher logs a plugin that fails to build and goes on without it.
    m = eng.make_manager(None)
    try:
        assert "hostkv" not in m.storage_backends
    finally:
        m.close()
    from hostkv_providers.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError):
        HostKVBackend(config=m.config, metadata=m.metadata, local_cpu_backend=None)


def _put_layers(m: Any, chunk: Any) -> list[Any]:
    """LMCacheEngine.store_layer: one LayerCacheEngineKey per layer of a chunk (same chunk hash),
    one batched_put per layer; layer ``i`` is filled with ``i + 1``."""
    layer_keys = chunk.split_layers(eng.LAYERS)
    shape = torch.Size([eng.CHUNK, 2, eng.HEADS * eng.DIM])  # MemoryFormat.KV_T2D, one layer
    for layer, k in enumerate(layer_keys):
        obj = m.allocate(shape, torch.bfloat16, fmt=MemoryFormat.KV_T2D)
        obj.tensor.fill_(float(layer + 1))
        m.batched_put([k], [obj])  # drops the allocation's reference itself
        eng.wait_stored(m, [k])
    return layer_keys


def _layer_values(backend: Any, layer_keys: list[Any]) -> list[list[float]]:
    out = []
    for k in layer_keys:
        got = backend.get_blocking(k)
        assert got is not None
        out.append(torch.unique(got.tensor.float()).tolist())
        got.ref_count_down()
    return out


def test_layerwise_keys_of_one_chunk_are_kept_apart(tmp_path: Path) -> None:
    m = eng.make_manager(_url(tmp_path))
    try:
        p = _plugin(m)
        chunk = eng.chunk_keys(m, 11, 1)[0]
        layer_keys = _put_layers(m, chunk)
        assert _layer_values(p, layer_keys) == [[float(i + 1)] for i in range(eng.LAYERS)]
        assert p.stats.stored_pages == eng.LAYERS
        # A chunk key (no layer) still maps as it always did: stores written before stay readable.
        assert p._key(chunk) == p._keyer.key(f"{chunk.model_name}\x00{chunk.world_size}\x00{chunk.worker_id}"
                                             f"\x00{chunk.chunk_hash}\x00{chunk.dtype}\x00{()!r}")
        assert p._key(chunk) not in {p._key(k) for k in layer_keys}
    finally:
        m.close()
    # The remote connector maps keys with the same function: its layers are apart too.
    r = eng.make_manager(_url(tmp_path, "remote"), remote=True)
    try:
        layer_keys = _put_layers(r, eng.chunk_keys(r, 12, 1)[0])
        assert _layer_values(r.storage_backends[eng.REMOTE], layer_keys) == [[float(i + 1)] for i in range(eng.LAYERS)]
        assert _connector(r).stats.stored_pages == eng.LAYERS
    finally:
        r.close()


def test_async_prefetch_releases_every_pin_after_a_miss(tmp_path: Path) -> None:
    # StorageManager.async_lookup_and_prefetch: batched_async_contains(pin=True), then
    # batched_get_non_blocking on the same keys; nobody else unpins them.
    url = _url(tmp_path)
    m = eng.make_manager(url, **{"hostkv.chain": "flat"})
    try:
        keys = eng.chunk_keys(m, 21, 4)
        eng.put(m, keys)
        eng.wait_stored(m, keys)
    finally:
        m.close()
    needle = eng.chunk_tensor(keys[1]).view(torch.uint8).reshape(-1)[:256].numpy().tobytes()
    assert corrupt_page(tmp_path / "kv", needle) == 1  # chunk 1 fails its checksum on read
    m = eng.make_manager(url, **{"hostkv.chain": "flat"})
    try:
        p = _plugin(m)

        async def prefetch() -> list[Any]:
            n = await p.batched_async_contains("req", keys, pin=True)
            assert n == 4
            return await p.batched_get_non_blocking("req", keys[:n])

        objs = asyncio.run_coroutine_threadsafe(prefetch(), m.loop).result(60)
        assert len(objs) == 1  # the prefix of hits: chunk 0
        for o in objs:
            o.ref_count_down()
        # The request is over: chunks 2 and 3 (roots, chain=flat) are evictable again.
        assert p.provider.evict([p._key(keys[2]), p._key(keys[3])]).entries == 2
    finally:
        m.close()


def test_async_prefetch_does_not_wait_for_a_full_cpu_buffer(tmp_path: Path) -> None:
    # LMCache's own LocalDiskBackend allocates with busy_loop=False on this path and returns a
    # partial prefix; a full staging buffer (earlier retrieves not consumed yet) must not hang it.
    m = eng.make_manager(_url(tmp_path), cpu_gb=0.002)  # ~2 MB of LMCache CPU buffer
    held = []
    fut: concurrent.futures.Future[list[Any]] | None = None
    try:
        p = _plugin(m)
        keys = eng.chunk_keys(m, 22, 2)
        eng.put(m, keys, per_call=1)
        eng.wait_stored(m, keys)
        while (o := p.local_cpu_backend.allocate(eng.SHAPE, torch.bfloat16, eviction=False)) is not None:
            held.append(o)

        async def prefetch() -> list[Any]:
            n = await p.batched_async_contains("req", keys, pin=True)
            assert n == 2
            return await p.batched_get_non_blocking("req", keys)

        fut = asyncio.run_coroutine_threadsafe(prefetch(), m.loop)
        try:
            got = fut.result(timeout=3)
        except concurrent.futures.TimeoutError:
            pytest.fail("batched_get_non_blocking still waiting in allocate() after 3 s")
        assert got == [] and p.stats.load_misses >= 1
        assert p.provider.evict([p._key(k) for k in keys]).entries == 2  # both unpinned
    finally:
        for o in held:  # frees the buffer: a waiting allocate() (before the fix) then returns
            o.ref_count_down()
        if fut is not None:
            for o in fut.result(timeout=30):
                o.ref_count_down()
        m.close()


# -- the RemoteConnector, run by LMCache's own RemoteBackend --------------------------------

def _connector(manager: object) -> HostKVConnector:
    conn = eng.connector(manager)  # type: ignore[arg-type]
    assert isinstance(conn, HostKVConnector)
    return conn


def test_remote_connector_store_restart_hit_bytes_equal(tmp_path: Path) -> None:
    url = _url(tmp_path)
    assert "stored 12" in run_engine("_lmcache_engine.py", "store", url, "7", "12", "0", "1", "remote")
    m = eng.make_manager(url, remote=True)
    try:
        keys = eng.chunk_keys(m, 7, 12)
        n, mapping = m.batched_contains(keys)
        assert n == 12 and list(mapping) == [eng.REMOTE]  # the restarted engine's CPU tier is empty
        assert eng.retrieve(m, keys, pin=False) == (12, [True] * 12)
        conn = _connector(m)
        assert conn.stats.loaded_pages == 12
    finally:
        m.close()
    # The connector writes the plugin's entries under the plugin's keys: one store, either path.
    plugin = eng.make_manager(url)
    try:
        assert eng.retrieve(plugin, keys) == (12, [True] * 12)
    finally:
        plugin.close()


def test_remote_connector_workers_isolated_and_corruption_is_a_miss(tmp_path: Path) -> None:
    url = _shared_url(tmp_path)
    w0 = eng.make_manager(url, worker=0, world=2, remote=True)
    try:
        keys = eng.chunk_keys(w0, 8, 6)
        eng.put(w0, keys)
        eng.wait_stored(w0, keys)
        assert _connector(w0).stats.stored_pages == 6
    finally:
        w0.close()
    w1 = eng.make_manager(url, worker=1, world=2, remote=True)
    try:
        assert _connector(w1).batched_contains(keys) == 0  # another TP rank's chunks: never seen
        assert _connector(w1).batched_contains(eng.chunk_keys(w1, 8, 6)) == 0
    finally:
        w1.close()
    mm = _url(tmp_path, "mm")
    m = eng.make_manager(mm, remote=True)
    try:
        keys = eng.chunk_keys(m, 9, 6)
        eng.put(m, keys)
        eng.wait_stored(m, keys)
    finally:
        m.close()
    needle = eng.chunk_tensor(keys[3]).view(torch.uint8).reshape(-1)[:256].numpy().tobytes()
    assert corrupt_page(tmp_path / "mm", needle) == 1
    m = eng.make_manager(mm, remote=True)
    try:
        remote = m.storage_backends[eng.REMOTE]
        assert remote.get_blocking(keys[3]) is None  # its checksum fails: a miss, never wrong bytes
        got = remote.get_blocking(keys[2])
        assert got is not None and torch.equal(got.tensor.view(torch.uint8),
                                               eng.chunk_tensor(keys[2]).view(torch.uint8))
        got.ref_count_down()
        assert _connector(m).stats.load_misses >= 1
    finally:
        m.close()
