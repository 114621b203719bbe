"""Drives SGLang's real HiCache L3 path on CPU: its device KV pool, host pool and cache controller.

One "engine" (one TP rank) is what SGLang's scheduler builds for ``--enable-hierarchical-cache``:
an ``MHATokenToKVPool`` (or ``MLATokenToKVPool``) on ``device="cpu"``, its
``PagedTokenToKVPoolAllocator``, the ``MHATokenToKVPoolHost``/``MLATokenToKVPoolHost`` mirror
(``page_first`` by default, as ``--hicache-mem-layout``), and a ``HiCacheController`` with
``storage_backend="dynamic"`` whose ``attach_storage_backend`` builds our backend through SGLang's
``StorageBackendFactory``, registers the host pool and starts its prefetch / prefetch-I/O /
prefetch-sync / backup threads.  What the scheduler's radix tree would do around the controller
is done here with the controller's own queues: ``write_storage`` (a host-pool backup) and the
ack; ``prefetch`` -> hit query on the prefetch thread -> ``alloc_prefetch_host_buffers`` ->
``prefetch_buffer`` -> the I/O thread's ``_page_transfer`` (``batch_get_v1`` with
``interface_v1``, else the generic ``batch_get``) -> ``ack_prefetch_queue``.  Page keys are
SGLang's own ``get_storage_hash_str`` chain.  The one thing not SGLang's is the GPU: the bytes a
device->host backup would put into a host page are written with the host pool's own
``set_from_flat_data_page`` (a PRNG seeded by the page hash and TP rank).

The tensor-parallel rank and size come from SGLang's ``get_parallel().override_permanently``
(its documented test injection) over a one-process gloo group.  See ``_sglang_cpu`` for why the
import needs ``./.engine-site``.

Script: ``python _sglang_engine.py store|check URL SEED NPAGES [tp_rank tp_size]``.
"""

from __future__ import annotations

import sys
import threading
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _sglang_cpu

if not _sglang_cpu.prepare():
    raise ImportError("SGLang's host pool needs ./.engine-site (scripts/dev-install.sh)")

import numpy as np
import torch
import torch.distributed as dist
from sglang.srt.managers.cache_controller import HiCacheController
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.utils import get_storage_hash_str
from sglang.srt.runtime_context import get_parallel

PAGE = 16
LAYERS, HEADS, DIM = 4, 4, 32
KV_LORA, ROPE = 64, 16  # MLA geometry
DEVICE_TOKENS = 2048
TIMEOUT = 120.0


def _process_group() -> Any:
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    return dist.group.WORLD


def make_pools(*, mla: bool = False, layout: str = "page_first", host_ratio: float = 4.0) -> tuple[Any, Any]:
    """A device KV pool on ``cpu`` and its host mirror, built as SGLang's pool assembler does."""
    kv: Any
    host: Any
    if mla:
        kv = MLATokenToKVPool(DEVICE_TOKENS, PAGE, torch.bfloat16, KV_LORA, ROPE, LAYERS, "cpu", False,
                              start_layer=0, end_layer=LAYERS - 1)
        host = MLATokenToKVPoolHost(kv.get_device_pool_infos()[0].buffer_info, host_ratio, 0, PAGE, layout,
                                    pin_memory=False, device_capacity_tokens=kv.size,
                                    start_layer=kv.start_layer, end_layer=kv.end_layer, target_layer_num=LAYERS)
    else:
        kv = MHATokenToKVPool(DEVICE_TOKENS, PAGE, torch.bfloat16, HEADS, DIM, LAYERS, "cpu", False,
                              start_layer=0, end_layer=LAYERS - 1)
        host = MHATokenToKVPoolHost(kv.get_device_pool_infos()[0].buffer_info, host_ratio, 0, PAGE, layout,
                                    pin_memory=False, device_capacity_tokens=kv.size,
                                    start_layer=kv.start_layer, end_layer=kv.end_layer,
                                    write_back_staging=kv.hicache_write_back_staging)
    return kv, host


def make_engine(url: str | None, *, tp_rank: int = 0, tp_size: int = 1, mla: bool = False,
                layout: str = "page_first", interface_v1: bool = True, model: str = "Qwen/Qwen3-8B",
                backend: str = "dynamic", extra: dict[str, Any] | None = None,
                host_ratio: float = 4.0) -> HiCacheController:
    """One TP rank's HiCache stack with our backend (``backend="dynamic"``) or SGLang's own."""
    group = _process_group()
    get_parallel().override_permanently(
        tp_size=tp_size, tp_rank=tp_rank, attn_tp_size=tp_size, attn_tp_rank=tp_rank, attn_dp_rank=0,
        pp_size=1, pp_rank=0, attn_cp_size=1, attn_cp_rank=0, attn_dcp_size=1, attn_dcp_rank=0)
    kv, host = make_pools(mla=mla, layout=layout, host_ratio=host_ratio)
    alloc = PagedTokenToKVPoolAllocator(DEVICE_TOKENS, PAGE, torch.bfloat16, "cpu", kv, False)
    config: dict[str, Any] = dict(extra or {})
    if backend == "dynamic":
        config = {"backend_name": "hostkv", "module_path": "hostkv_providers.integrations.sglang",
                  "class_name": "HostKVStorage", "url": url, "interface_v1": int(interface_v1), **config}
    return HiCacheController(alloc, host, PAGE, group, threading.Event(), io_backend="direct",
                             storage_backend=backend, model_name=model, storage_backend_extra_config=config)


def close(cc: HiCacheController) -> None:
    """The scheduler's shutdown: detach stops the storage threads and closes the backend."""
    cc.detach_storage_backend()


def backend_of(cc: HiCacheController) -> Any:
    b = cc.storage_backend
    return getattr(b, "_backend", b)  # SGLang's failure-injector proxy, when its env asks for it


def prompt(seed: int, n_pages: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 150_000, size=n_pages * PAGE)]


def page_hashes(tokens: list[int]) -> list[str]:
    hashes = get_storage_hash_str(tokens, None, page_size=PAGE)
    assert isinstance(hashes, list)
    return hashes


def page_bytes(host: Any, key: str, rank: int = 0) -> np.ndarray:
    """The bytes of one page of host pool ``host`` (its flat data page), recomputable anywhere."""
    nbytes = host.get_dummy_flat_data_page().view(torch.uint8).numel()
    return np.random.default_rng([rank, *bytes.fromhex(key[:32])]).integers(0, 256, size=nbytes, dtype=np.uint8)


def stage(cc: HiCacheController, tokens: list[int], rank: int = 0) -> Any:
    """Host pages holding the prompt's KV, as a device->host backup leaves them; their indices."""
    host = cc.mem_pool_host
    idx = host.alloc(len(tokens))
    assert idx is not None, "host pool full"
    for i, h in enumerate(page_hashes(tokens)):
        page = torch.from_numpy(page_bytes(host, h, rank)).view(host.dtype)
        host.set_from_flat_data_page(int(idx[i * PAGE]), page)
    return idx


def write_back(cc: HiCacheController, idx: Any, tokens: list[int]) -> int:
    """``write_storage`` of staged host pages and the backup thread's ack: tokens stored."""
    op_id = cc.write_storage(idx, tokens, hash_value=page_hashes(tokens), prefix_keys=[])
    op = cc.ack_backup_queue.get(timeout=TIMEOUT)
    assert op.id == op_id
    return int(op.completed_tokens)


def backup(cc: HiCacheController, tokens: list[int], rank: int = 0) -> int:
    """Stage the prompt's pages in the host pool, back them up, free them: tokens stored."""
    idx = stage(cc, tokens, rank)
    try:
        return write_back(cc, idx, tokens)
    finally:
        cc.mem_pool_host.free(idx)


def prefetch(cc: HiCacheController, tokens: list[int]) -> tuple[Any, Any, int, int]:
    """A storage prefetch as the radix tree runs it: the prefetch thread's hit query, host
    buffers for the hit, the I/O thread's transfer; (operation, host indices, hit tokens,
    loaded tokens).  The caller frees the indices."""
    op = cc.prefetch(f"req-{uuid.uuid4().hex[:8]}", tokens, None, [])
    hit = cc.prefetch_hit_queue.get(timeout=TIMEOUT)
    assert hit is op
    n = int(op.storage_hit_count)
    if n == 0:
        return op, None, 0, 0
    idx = cc.alloc_prefetch_host_buffers(op, n)
    assert idx is not None, "host pool full"
    op.host_indices = idx
    cc.prefetch_buffer.put(op)
    loaded = 0
    while True:
        ack = cc.ack_prefetch_queue.get(timeout=TIMEOUT)
        if ack.operation is not op:
            continue
        if ack.completed_tokens is not None:
            loaded = int(ack.completed_tokens)
        if ack.completed_req:
            return op, idx, n, loaded


def verify(cc: HiCacheController, op: Any, idx: Any, loaded: int, rank: int = 0) -> list[bool]:
    """Per loaded page, whether the host pool now holds exactly the stored bytes."""
    host = cc.mem_pool_host
    equal = []
    for i, h in enumerate(op.hash_value[: loaded // PAGE]):
        got = host.get_data_page(int(idx[i * PAGE]), flat=True).view(torch.uint8).numpy()
        equal.append(bool(np.array_equal(got, page_bytes(host, h, rank))))
    return equal


def fetch(cc: HiCacheController, tokens: list[int], rank: int = 0) -> tuple[int, int, list[bool]]:
    """(hit tokens, loaded tokens, per loaded page whether its bytes are the stored ones)."""
    op, idx, hits, loaded = prefetch(cc, tokens)
    if idx is None:
        return 0, 0, []
    try:
        return hits, loaded, verify(cc, op, idx, loaded, rank)
    finally:
        cc.mem_pool_host.free(idx)


def main(argv: list[str]) -> int:
    op, url, seed, n = argv[0], argv[1], int(argv[2]), int(argv[3])
    rank, size = (int(argv[4]), int(argv[5])) if len(argv) > 5 else (0, 1)
    cc = make_engine(url, tp_rank=rank, tp_size=size)
    tokens = prompt(seed, n)
    try:
        if op == "store":
            print("stored", backup(cc, tokens, rank) // PAGE)
        else:
            hits, loaded, equal = fetch(cc, tokens, rank)
            print("hits", hits // PAGE, "loaded", loaded // PAGE, "equal", sum(equal))
    finally:
        close(cc)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
