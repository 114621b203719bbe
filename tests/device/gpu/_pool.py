"""The GPU tests' engine-like pool: vLLM-style per-layer ``[2, blocks, 16, 8, 128]`` bf16 caches
on the device, filled, poisoned and compared by block (the comparisons are enqueued only)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

import hostkv_providers as hk
from hostkv_providers.cache import paged_planes
from hostkv_providers.device import CudaCopyEngine, KVPlanes, _direct

POISON = 0xEE


@contextlib.contextmanager
def engine_for(mode: str, *, stream_gates: bool = False) -> Iterator[CudaCopyEngine]:
    """``CudaCopyEngine(0, direct=mode)``; ``"batch-split"``: ``direct="batch"`` with *every* batch
    call split between the issuing thread and the direction's side thread and stream (the tests'
    transfers stay under the 4,096 copies from which the split starts); ``"shared-split"``:
    ``direct="shared"`` with every page-major restore shared between batch copies and the staging
    path (saves split between the two threads as ``"batch-split"`` does)."""
    direct, _, split = mode.partition("-")
    saved = _direct.BATCH_SPLIT_MIN
    try:
        if split:
            _direct.BATCH_SPLIT_MIN = 2
        e = CudaCopyEngine(0, direct=direct, stream_gates=stream_gates)
        try:
            if split:  # (a driver without the batch call would quietly run these as staged)
                assert e._sides, f"direct={direct!r} has no side thread on this driver"
            yield e
        finally:
            e.close()
    finally:
        _direct.BATCH_SPLIT_MIN = saved


class Pool:
    """``caches[l]`` is layer ``l``'s ``[2, nblocks, tokens, heads, dim]`` tensor; ``planes`` the
    engine planes over them (``tensors``: the per-plane views); ``bytes[l]`` its bytes."""

    def __init__(self, layout: hk.KVLayout, nblocks: int) -> None:
        self.caches = [torch.empty((2, nblocks, layout.page_tokens, layout.num_kv_heads, layout.head_dim),
                                   dtype=torch.bfloat16, device="cuda") for _ in range(layout.num_layers)]
        self.tensors = paged_planes(layout, self.caches)
        self.planes = KVPlanes.from_torch(layout, self.tensors)
        self.bytes = [c.view(torch.uint8) for c in self.caches]

    def fill_random(self, blocks: list[int], seed: int) -> None:
        g = torch.Generator(device="cuda").manual_seed(seed)
        idx = torch.tensor(blocks, device="cuda")
        for b in self.bytes:
            b[:, idx] = torch.randint(0, 256, (2, len(blocks), *b.shape[2:]), dtype=torch.uint8, device="cuda",
                                      generator=g)

    def poison(self, blocks: list[int]) -> None:
        idx = torch.tensor(blocks, device="cuda")
        for b in self.bytes:
            b[:, idx] = POISON

    def gather(self, blocks: list[int]) -> list[Any]:
        idx = torch.tensor(blocks, device="cuda")
        return [b[:, idx].clone() for b in self.bytes]

    def mismatches(self, blocks: list[int], expect: list[Any]) -> Any:
        """Bytes of ``blocks`` that differ from ``expect``, as a 0-d device tensor (enqueued only)."""
        idx = torch.tensor(blocks, device="cuda")
        return sum((b[:, idx] != e).sum() for b, e in zip(self.bytes, expect, strict=True))

    def layer_mismatches(self, idx: Any, expect: list[Any], layers: range) -> Any:
        """Bytes of layers ``layers`` of blocks ``idx`` that differ from ``expect`` (enqueued only)."""
        return sum((self.bytes[i][:, idx] != expect[i]).sum() for i in layers)
