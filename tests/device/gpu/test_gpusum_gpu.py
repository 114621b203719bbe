"""GPU checksums through ``HostKVCache`` (issue 14 items 2-3): a save from CUDA planes into an
``xxh3-256k-tree`` pinned store seals with checksums hashed on the GPU (the host's verify agrees
with every one), and a restore from the store's views with ``verify=read`` is verified on the GPU
after its copy: a bit flipped in host RAM truncates the hit exactly at its page.  Skipped
without CUDA and torch."""

from __future__ import annotations

import ctypes
from typing import Any

import pytest

import hostkv_providers as hk
from hostkv_providers.cache import HostKVCache, paged_planes
from hostkv_providers.device._copy import CudaCopyEngine, KVPlanes, cuda_available
from hostkv_providers.providers import tree_checksum_parts

torch = pytest.importorskip("torch")
if not cuda_available() or not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

pytestmark = pytest.mark.gpu

from ._pool import engine_for  # noqa: E402  (after the skips: it imports torch)

LAYOUT = hk.KVLayout(num_layers=2, num_kv_heads=8, head_dim=128, page_tokens=16, dtype="bfloat16")
P = LAYOUT.page_nbytes
N = 40


def _pool(nblocks: int) -> tuple[list[Any], KVPlanes]:
    caches = [torch.empty((2, nblocks, 16, 8, 128), dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    for c in caches:
        c.view(torch.uint8).random_(0, 256)
    return caches, KVPlanes.from_torch(LAYOUT, paged_planes(LAYOUT, caches))


def _page(caches: list[Any], b: int) -> list[bytes]:
    return [c.view(torch.uint8)[k, b].cpu().numpy().tobytes() for c in caches for k in range(2)]


@pytest.fixture(scope="module")
def engine() -> Any:
    e = CudaCopyEngine(0)
    yield e
    e.close()


@pytest.mark.parametrize("checksum", ["xxh3-256k-tree", "xxh3-64"])
def test_save_seals_with_gpu_checksums(engine: Any, checksum: str) -> None:
    caches, planes = _pool(2 * N)
    prov = hk.open(f"pinned://?budget={(N + 4) * P}&block={P}&background=false&checksum={checksum}")
    try:
        with HostKVCache(prov, hk.Salt("t/gpusum", LAYOUT), engine, chunk_pages=8) as cache:
            keys = cache.keys(list(range(N * 16)))
            s = torch.cuda.Stream()
            with torch.cuda.stream(s):
                torch.cuda._sleep(20_000_000)
                caches[1].view(torch.uint8)[:, 5].fill_(3)  # before the save call: must be saved
                r = cache.save(keys, planes, list(range(N)), after=s).wait()
            assert r.stored == N
            report = prov.verify()
            assert report.checked == N and not report.corrupt
            info = {e.key: e.checksum for e in prov.iter_entries()}
            if checksum == "xxh3-256k-tree":
                for i in (0, 5, N - 1):
                    assert info[keys[i]] == tree_checksum_parts(_page(caches, i))
            hit = cache.lookup(keys)
            got = cache.restore(hit, planes, list(range(N, 2 * N))).wait()
            assert got.pages == N
            u = [c.view(torch.uint8) for c in caches]
            assert all(torch.equal(x[:, :N], x[:, N : 2 * N]) for x in u)
    finally:
        prov.close()


@pytest.mark.parametrize("mode", ["default", "shared-split"])
def test_verified_restore_from_views_truncates_at_a_flipped_bit(engine: Any, mode: str) -> None:
    """The default engine's chunks are checked behind each transfer's event; a sharing engine's
    (every restore shared, ``shares_restores``) behind the restore's gate on the check stream."""
    if mode == "default":
        _verified_restore_truncates(engine)
        return
    with engine_for(mode) as shared:
        assert shared.shares_restores
        _verified_restore_truncates(shared)
        assert sum(shared.shared_pages) > 0  # its restores went the shared way (_issue_shared)


def _verified_restore_truncates(engine: Any) -> None:
    _caches, planes = _pool(2 * N)
    prov = hk.open(f"pinned://?budget={(N + 4) * P}&block={P}&background=false&verify=read")
    try:
        with HostKVCache(prov, hk.Salt("t/gpusum", LAYOUT), engine, chunk_pages=8) as cache:
            keys = cache.keys(list(range(N * 16)))
            assert cache.save(keys, planes, list(range(N))).wait().stored == N
            hit = cache.lookup(keys)
            ok = cache.restore(hit, planes, list(range(N, 2 * N))).wait()
            assert ok.pages == N and ok.viewed == N
            for bad in (N - 1, 19, 0):
                with prov.lease([keys[bad]]) as lease:
                    (reg,) = prov.view(lease, keys[bad])
                    byte = ctypes.c_uint8.from_address(reg.address + P // 2 + 7)
                    byte.value ^= 0x01
                hit = cache.lookup(keys)
                r = cache.restore(hit, planes, list(range(N, 2 * N))).wait()
                assert r.pages == bad, (bad, r.pages, r.stopped)
                assert r.stopped and "checksum" in r.stopped
                byte.value ^= 0x01
            hit = cache.lookup(keys)
            assert cache.restore(hit, planes, list(range(N, 2 * N))).wait().pages == N
    finally:
        prov.close()


@pytest.mark.parametrize("checksum", ["xxh3-256k-tree", "xxh3-64"])
def test_the_hasher_is_built_when_the_cache_is_made(engine: Any, checksum: str) -> None:
    """The GPU hasher's one-time NVRTC compile runs at start-up (the cache's construction), not
    inside the engine's first save; a store whose checksums the GPU does not compute builds none."""
    from hostkv_providers.device._hash import PageHasher

    prov = hk.open(f"pinned://?budget={4 * P}&block={P}&background=false&checksum={checksum}")
    kept = PageHasher._instances.pop(0, None)
    try:
        with HostKVCache(prov, hk.Salt("t/gpusum-prepare", LAYOUT), engine):
            assert (0 in PageHasher._instances) == (checksum == "xxh3-256k-tree")
    finally:
        prov.close()
        if kept is not None:
            PageHasher._instances[0] = kept
