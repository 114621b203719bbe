"""Drives SGLang's real HiCache L3 storage path on CPU.

The backend is built by SGLang's own ``StorageBackendFactory.create_backend("dynamic", ...)``
from a real ``HiCacheStorageConfig`` (with SGLang's failure-injector wrapper applied as in
production), page keys are SGLang's own ``get_hash_str`` chain over token pages, and calls are
the ones ``HiCacheController`` makes: ``batch_exists(keys, HiCacheStorageExtraInfo(prefix_keys))``
for the hit query, ``batch_set``/``batch_get`` of flat host pages (``_generic_page_set`` /
``_generic_page_get``) in ``STORAGE_BATCH_SIZE`` batches with ``prefix_keys`` advanced per batch.
SGLang's host memory pool itself cannot be imported on this machine (see docs/engines/sglang.md),
so the flat pages are torch tensors of the host pool's page shape.

Script: ``python _sglang_engine.py store|check URL SEED NPAGES [tp_rank tp_size]``.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import STORAGE_BATCH_SIZE, HiCacheStorageConfig, HiCacheStorageExtraInfo
from sglang.srt.mem_cache.storage import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_hash_str

PAGE = 16
LAYERS, HEADS, DIM = 4, 4, 32
PAGE_ELEMS = LAYERS * 2 * PAGE * HEADS * DIM  # a flat page of the host pool (bf16)


def make_backend(url: str, *, tp_rank: int = 0, tp_size: int = 1, mla: bool = False,
                 model: str = "Qwen/Qwen3-8B", **extra: Any) -> Any:
    config = HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=mla, enable_storage_metrics=False, is_page_first_layout=True, model_name=model,
        extra_config={"backend_name": "hostkv", "module_path": "hostkv_providers.integrations.sglang",
                      "class_name": "HostKVStorage", "url": url, "page_size": PAGE, "num_layers": LAYERS,
                      "head_num": HEADS, "head_dim": DIM, "kv_dtype": "bfloat16", **extra},
    )
    return StorageBackendFactory.create_backend("dynamic", config, None)


def page_hashes(seed: int, n_pages: int) -> list[str]:
    tokens = np.random.default_rng(seed).integers(0, 150_000, size=n_pages * PAGE).tolist()
    hashes = get_hash_str(tokens, None, page_size=PAGE)
    assert isinstance(hashes, list) and len(hashes) == n_pages
    return hashes


def page_tensor(key: str, rank: int = 0) -> torch.Tensor:
    rng = np.random.default_rng([rank, *bytes.fromhex(key[:32])])
    return torch.from_numpy(rng.integers(0, 256, size=PAGE_ELEMS * 2, dtype=np.uint8)).view(torch.bfloat16)


def backup(backend: Any, hashes: list[str], rank: int = 0) -> int:
    """HiCacheController._page_backup with the generic page set: batches, prefix advanced."""
    done = 0
    for i in range(0, len(hashes), STORAGE_BATCH_SIZE):
        batch = hashes[i:i + STORAGE_BATCH_SIZE]
        if not backend.batch_set(batch, [page_tensor(h, rank) for h in batch]):
            break
        done += len(batch)
    return done


def hit_query(backend: Any, hashes: list[str]) -> int:
    """HiCacheController._storage_hit_query: pages hit, batch by batch, prefix_keys advanced."""
    prefix: list[str] = []
    hit = 0
    for i in range(0, len(hashes), STORAGE_BATCH_SIZE):
        batch = hashes[i:i + STORAGE_BATCH_SIZE]
        n = backend.batch_exists(batch, HiCacheStorageExtraInfo(prefix_keys=list(prefix)))
        hit += n
        if n < len(batch):
            break
        prefix += batch
    return hit


def fetch(backend: Any, hashes: list[str], rank: int = 0) -> tuple[int, list[bool]]:
    """HiCacheController._generic_page_get: read into dummy flat pages, stop at the first miss;
    returns the loaded pages and, per loaded page, whether its bytes are the stored ones."""
    targets = [torch.empty(PAGE_ELEMS, dtype=torch.bfloat16) for _ in hashes]
    got = backend.batch_get(hashes, targets)
    equal: list[bool] = []
    for h, page in zip(hashes, got, strict=True):
        if page is None:
            break
        # numpy's compare (a memcmp); torch.equal on CPU runs ~0.3 GB/s and would time itself
        want = page_tensor(h, rank).view(torch.uint8).numpy()
        equal.append(bool(np.array_equal(page.view(torch.uint8).numpy(), want)))
    return len(equal), equal


def main(argv: list[str]) -> int:
    op, url, seed, n = argv[0], argv[1], int(argv[2]), int(argv[3])
    rank, size = (int(argv[4]), int(argv[5])) if len(argv) > 5 else (0, 1)
    backend = make_backend(url, tp_rank=rank, tp_size=size)
    hashes = page_hashes(seed, n)
    try:
        if op == "store":
            print("stored", backup(backend, hashes, rank))
        else:
            hits = hit_query(backend, hashes)
            loaded, equal = fetch(backend, hashes[:hits], rank)
            print("hits", hits, "loaded", loaded, "equal", sum(equal))
    finally:
        backend.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
