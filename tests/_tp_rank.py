"""One tensor-parallel rank's process for tests/test_tensor_parallel.py (run as a script).

``python _tp_rank.py save STORE RANK``: key the prompt, print ``ready``, wait for ``go`` on
stdin (the parent starts both ranks' saves together), save this rank's slice of the heads.

``python _tp_rank.py restore STORE RANK OUT``: ``lookup_ranks`` (print ``common N``), restore
those pages, hold the hit until a line on stdin; then a plain ``lookup`` (print ``own N``), read
the agreed page count (the engine's all-reduce of the hits) and restore that many.  The restored
planes go to ``OUT/{ranks,allreduce}-RANK.npz``; the parent checks them byte for byte.
"""

from __future__ import annotations

import sys

import numpy as np

import hostkv_providers as hk
from hostkv_providers.cache import HostKVCache
from hostkv_providers.device import CpuCopyEngine

# The whole model: 4 KV heads; each of 2 ranks holds 2 (4 KiB pages per rank).
LAYOUT = hk.KVLayout(num_layers=2, num_kv_heads=4, head_dim=16, page_tokens=16, dtype="float16")
WORLD = 2
PAGES = 40
MODEL = "test/tp-model"
TOKENS = np.random.default_rng(11).integers(0, 100_000, size=PAGES * 16 + 5)


def salt(rank: int) -> hk.Salt:
    return hk.Salt(MODEL, LAYOUT, tp_rank=rank, tp_world_size=WORLD)


def full_model_planes() -> list[np.ndarray]:
    """Every head of every plane, block i = page i (what an unsharded engine would hold)."""
    rng = np.random.default_rng(5)
    shape = (PAGES, LAYOUT.page_tokens, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    return [rng.standard_normal(shape).astype(np.float16) for _ in LAYOUT.planes]


def rank_planes(rank: int) -> list[np.ndarray]:
    heads = salt(rank).kv_heads
    return [np.ascontiguousarray(p[:, :, heads.start : heads.stop, :]) for p in full_model_planes()]


def url(path: str) -> str:
    return f"lmdb://{path}?budget=64MiB&file_size=4MiB"


def _say(line: str) -> None:
    print(line, flush=True)


def save(path: str, rank: int) -> None:
    with hk.open(url(path)) as p, HostKVCache(p, salt(rank), CpuCopyEngine()) as cache:
        keys = cache.keys(TOKENS)
        planes = rank_planes(rank)
        _say("ready")
        sys.stdin.readline()
        res = cache.save(keys, planes, list(range(PAGES))).wait(60)
        if res.stored != PAGES:
            raise SystemExit(f"rank {rank} stored {res.stored} of {PAGES}")
        _say("saved")


def restore(path: str, rank: int, out: str) -> None:
    with hk.open(url(path)) as p, HostKVCache(p, salt(rank), CpuCopyEngine()) as cache:
        shape = (PAGES, LAYOUT.page_tokens, len(cache.salt.kv_heads), LAYOUT.head_dim)
        with cache.lookup_ranks(cache.rank_keys(TOKENS)) as hit:
            _say(f"common {hit.num_pages}")
            planes = [np.zeros(shape, np.float16) for _ in LAYOUT.planes]
            got = cache.restore(hit, planes, list(range(hit.num_pages)), release=False).wait(60)
            np.savez(f"{out}/ranks-{rank}.npz", *planes, pages=got.pages)
            sys.stdin.readline()  # hold the lease until the other rank has looked up too
        own = cache.lookup(cache.keys(TOKENS))
        _say(f"own {own.num_pages}")
        agreed = int(sys.stdin.readline())
        planes = [np.zeros(shape, np.float16) for _ in LAYOUT.planes]
        got = cache.restore(own, planes, list(range(agreed))).wait(60)
        np.savez(f"{out}/allreduce-{rank}.npz", *planes, pages=got.pages)
        _say("restored")


if __name__ == "__main__":
    if sys.argv[1] == "save":
        save(sys.argv[2], int(sys.argv[3]))
    else:
        restore(sys.argv[2], int(sys.argv[3]), sys.argv[4])
