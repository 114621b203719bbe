"""The GPU page hasher computes the host's ``xxh3-256k-tree`` checksum of every page, for pages
of 32 KiB plane slices, of many small slices, of slices that straddle 256 KiB blocks, of pages
shorter than a block and of pages whose last block is partial (its hashed length padded).
Skipped without CUDA and torch."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from hostkv_providers import KVLayout
from hostkv_providers._blockhash import BLOCK, block_digests_numpy, nblocks, padded_len, tree_checksum_parts
from hostkv_providers.device._copy import KVPlanes, cuda_available

torch = pytest.importorskip("torch")
if not cuda_available() or not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from hostkv_providers.device._hash import PageHasher  # noqa: E402

pytestmark = pytest.mark.gpu

LAYOUTS = {
    "64k-slices": KVLayout(num_layers=2, num_kv_heads=8, head_dim=128, page_tokens=16, dtype="bfloat16"),
    "2mib-pages": KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, page_tokens=16, dtype="bfloat16"),
    "partial-last": KVLayout(num_layers=5, num_kv_heads=8, head_dim=128, page_tokens=16, dtype="bfloat16"),
    "tiny": KVLayout(num_layers=1, num_kv_heads=1, head_dim=32, page_tokens=2, dtype="bfloat16"),
    "small-slices": KVLayout(num_layers=5, num_kv_heads=2, head_dim=64, page_tokens=16, dtype="bfloat16"),
    "straddling": KVLayout(num_layers=3, num_kv_heads=3, head_dim=128, page_tokens=16, dtype="bfloat16"),
    "latent": KVLayout(num_layers=4, num_kv_heads=1, head_dim=576, page_tokens=32, dtype="bfloat16",
                       kinds=("kv",)),
}


def _planes(layout: KVLayout, nblocks_: int, seed: int) -> tuple[KVPlanes, list[Any]]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    tensors = []
    for spec in layout.planes:
        t = torch.randint(0, 256, (nblocks_, spec.nbytes), generator=g, device="cuda", dtype=torch.uint8)
        tensors.append(t)
    return KVPlanes.from_torch(layout, tensors), tensors


def _page_bytes(layout: KVLayout, tensors: list[Any], bid: int) -> list[bytes]:
    order = sorted(range(len(layout.planes)), key=lambda p: layout.planes[p].offset)
    return [tensors[p][bid].cpu().numpy().tobytes() for p in order]


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_gpu_roots_equal_the_host_tree_checksum(name: str) -> None:
    layout = LAYOUTS[name]
    planes, tensors = _planes(layout, 12, seed=len(name))
    assert PageHasher.supports(planes)
    hasher = PageHasher.get(0)
    bids = [11, 0, 5, 5, 3]
    stream = torch.cuda.current_stream().cuda_stream
    got = hasher.enqueue(planes, bids, stream)
    digests = got.digests().copy()
    roots = got.roots()
    for i, b in enumerate(bids):
        parts = _page_bytes(layout, tensors, b)
        assert roots[i] == tree_checksum_parts(parts), (name, i)
        whole = b"".join(parts)
        want = []
        for lo in range(0, len(whole), BLOCK):
            block = whole[lo : lo + BLOCK]
            block += bytes(padded_len(len(block)) - len(block))
            want.append(int(block_digests_numpy(np.frombuffer(block, np.uint8).reshape(1, -1))[0]))
        assert len(want) == nblocks(len(whole))
        assert [int(v) for v in digests[i]] == want


def test_gpu_digests_follow_stream_order() -> None:
    layout = LAYOUTS["64k-slices"]
    planes, tensors = _planes(layout, 4, seed=3)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(50_000_000)  # the hash must see the write below, enqueued before it
        tensors[0][2].fill_(7)
        got = PageHasher.get(0).enqueue(planes, [2], stream.cuda_stream)
    assert got.roots()[0] == tree_checksum_parts(_page_bytes(layout, tensors, 2))


def test_unsupported_planes_are_refused() -> None:
    odd = KVLayout(num_layers=1, num_kv_heads=1, head_dim=3, page_tokens=3, dtype="int8")  # 9-byte slices
    planes, _ = _planes(odd, 2, seed=1)
    assert not PageHasher.supports(planes)
