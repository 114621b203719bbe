"""Drives vLLM's real offloading stack the way its scheduler does, on CPU.

``TieringOffloadingSpec(OffloadingConfig).get_manager()`` builds vLLM's own
``TieringOffloadingManager`` over a ``CPUPrimaryTierOffloadingManager`` (a real
``SharedOffloadRegion``) and loads the secondary tier by module path through
``SecondaryTierFactory`` -- exactly as ``vllm serve --kv-transfer-config ...`` does in the
scheduler process.  Block hashes are vLLM's own (``hash_block_tokens`` with sha256_cbor), keyed
into the request context with end-token positions as ``RequestOffloadState`` does.  The one
thing not vLLM's is the GPU: the bytes a GPU->CPU copy would put into a primary row are
written into that row here (a PRNG seeded by the block hash), and what a CPU->GPU copy would read
is read back from the row.

Run as a script it stores or checks one prompt, so a test can restart the "engine" in a new
process: ``python -m tests.integrations._vllm_engine store|check URL SEED NBLOCKS [tp_size]``.
"""

from __future__ import annotations

import sys
import time
import uuid
from typing import Any

import numpy as np
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import hash_block_tokens, init_none_hash
from vllm.v1.kv_offload.base import LookupResult, OffloadKey, ReqContext, ScheduleEndContext, make_offload_key
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

BLOCK_TOKENS = 16
LAYERS = 4
# One worker's KV bytes per block (4 layers x K/V x 16 tokens x 8 heads x 16 dims x bf16 = 64 KiB).
WORKER_BLOCK_BYTES = LAYERS * 2 * BLOCK_TOKENS * 8 * 16 * 2

_HASH = get_hash_fn_by_name("sha256_cbor")
init_none_hash(_HASH)


def make_config(tier: dict[str, Any] | None, *, tp_size: int = 1, model: str = "meta-llama/Llama-3.1-8B",
                dtype: str = "bfloat16", cpu_chunks: int = 64, tiers: list[dict[str, Any]] | None = None,
                engine_id: str | None = None, worker_block_bytes: int = WORKER_BLOCK_BYTES) -> OffloadingConfig:
    extra: dict[str, Any] = {"cpu_bytes_to_use": cpu_chunks * worker_block_bytes * tp_size,
                             "secondary_tiers": tiers if tiers is not None else ([tier] if tier else [])}
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=BLOCK_TOKENS,
                                      layer_names=tuple(f"model.layers.{i}.self_attn" for i in range(LAYERS)),
                                      group_id=0),),
        worker_kv_bytes_per_block=worker_block_bytes,
        enable_kv_cache_events=False,
        extra_config=extra,
        # The primary tier's shared region is named after the engine id: one per manager.
        engine_id=engine_id or f"hostkv-test-{uuid.uuid4().hex[:12]}",
        model=OffloadingModelConfig(name=model, dtype=dtype),
        cache=OffloadingCacheConfig(tokens_per_hash=BLOCK_TOKENS, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(rank=0, world_size=tp_size, tp_size=tp_size, pp_size=1, pcp_size=1,
                                          dcp_size=1, data_parallel_index=0, data_parallel_size=1,
                                          data_parallel_rank_local=None, is_parallelism_agnostic=False),
    )


def hostkv_tier(url: str, **kw: Any) -> dict[str, Any]:
    return {"type": "HostKVTier", "module_path": "hostkv_providers.integrations.vllm", "url": url, **kw}


def make_manager(config: OffloadingConfig) -> TieringOffloadingManager:
    manager = TieringOffloadingSpec(config).get_manager()
    assert isinstance(manager, TieringOffloadingManager)
    return manager


def prompt_keys(seed: int, n_blocks: int) -> list[OffloadKey]:
    """vLLM's chained block hashes of a prompt of ``n_blocks`` full blocks, as offload keys."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 128_000, size=n_blocks * BLOCK_TOKENS).tolist()
    keys: list[OffloadKey] = []
    parent = None
    for i in range(n_blocks):
        parent = hash_block_tokens(_HASH, parent, tokens[i * BLOCK_TOKENS:(i + 1) * BLOCK_TOKENS])
        keys.append(make_offload_key(parent, 0))
    return keys


def row_bytes(key: OffloadKey, nbytes: int) -> np.ndarray:
    """The bytes a GPU->CPU copy would put into the chunk's row (recomputable from the key)."""
    return np.random.default_rng(list(key[:16])).integers(0, 256, size=nbytes, dtype=np.uint8)


def new_request(manager: TieringOffloadingManager, req_id: str, keys: list[OffloadKey]) -> ReqContext:
    ctx = ReqContext(req_id=req_id)
    for i, key in enumerate(keys):  # RequestOffloadState.update_offload_keys
        ctx.set_offload_key_position(key, (i + 1) * BLOCK_TOKENS)
    manager.on_new_request(ctx)
    return ctx


def end_step(manager: TieringOffloadingManager, new_req_ids: tuple[str, ...] = ()) -> None:
    manager.on_schedule_end(ScheduleEndContext(new_req_ids=new_req_ids, preempted_req_ids=()))
    list(manager.take_events())


def settle(manager: TieringOffloadingManager, timeout: float = 300.0) -> None:
    """Step the engine until no tier has pending work (the engine keeps stepping while it has)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        end_step(manager)
        if not manager.has_pending_work():
            end_step(manager)
            return
        time.sleep(0.005)
    raise AssertionError("tiers still have pending work")


def primary_rows(manager: TieringOffloadingManager) -> np.ndarray:
    return np.asarray(manager.primary_tier.get_kv_memoryview()).view(np.uint8)


def store(manager: TieringOffloadingManager, req_id: str, keys: list[OffloadKey], *, per_step: int = 4) -> None:
    """The scheduler's store path: prepare_store, the worker fills the rows, complete_store."""
    ctx = new_request(manager, req_id, keys)
    rows = primary_rows(manager)
    for start in range(0, len(keys), per_step):
        part = keys[start:start + per_step]
        out = manager.prepare_store(part, ctx)
        assert out is not None, "primary tier could not take the store"
        chunk_ids = np.asarray(out.store_spec.chunk_ids)
        for key, chunk in zip(out.keys_to_store, chunk_ids, strict=True):
            rows[int(chunk)] = row_bytes(key, rows.shape[1])
        manager.complete_store(part, ctx, success=True)
        end_step(manager, (req_id,) if start == 0 else ())
    manager.on_request_finished(ctx)
    settle(manager)


def load(manager: TieringOffloadingManager, req_id: str, keys: list[OffloadKey],
         *, max_steps: int = 200) -> tuple[int, list[bool]]:
    """The scheduler's load path: lookups (promotions from the secondary tier), steps until the
    promotions finish, then prepare_load of the hit prefix and the rows a CPU->GPU copy would
    read.  Returns the hit prefix length and, per hit block, whether its bytes are the stored ones."""
    ctx = new_request(manager, req_id, keys)
    for _ in range(max_steps):
        results = [manager.lookup(k, ctx) for k in keys]
        end_step(manager, (req_id,))
        if not any(r in (LookupResult.HIT_PENDING, LookupResult.RETRY) for r in results):
            break
        time.sleep(0.005)
    hits = 0
    for r in results:
        if r is not LookupResult.HIT:
            break
        hits += 1
    equal: list[bool] = []
    if hits:
        spec = manager.prepare_load(keys[:hits], ctx)
        rows = primary_rows(manager)
        for key, chunk in zip(keys[:hits], np.asarray(spec.chunk_ids), strict=True):
            equal.append(bool(np.array_equal(rows[int(chunk)], row_bytes(key, rows.shape[1]))))
        manager.complete_load(keys[:hits], ctx)
    manager.on_request_finished(ctx)
    end_step(manager)
    return hits, equal


def main(argv: list[str]) -> int:
    op, url, seed, n = argv[0], argv[1], int(argv[2]), int(argv[3])
    tp = int(argv[4]) if len(argv) > 4 else 1
    manager = make_manager(make_config(hostkv_tier(url), tp_size=tp))
    keys = prompt_keys(seed, n)
    try:
        if op == "store":
            store(manager, "r-store", keys)
            print("stored", n)
        else:
            hits, equal = load(manager, "r-check", keys)
            print("hits", hits, "equal", sum(equal))
    finally:
        manager.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
