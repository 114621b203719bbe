"""Layout mapping: vLLM-style paged caches and transformers caches to page planes and back,
including int8/fp8 codes with scale planes."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from hostkv_providers import InvalidArgumentError, KVLayout, PinnedProvider, Salt
from hostkv_providers.cache._cache import HostKVCache
from hostkv_providers.cache._kvmap import HFCacheMap, cache_layers, dequantize, paged_planes, plane_dtype_name, quantize
from hostkv_providers.device._copy import CpuCopyEngine, KVPlanes
from hostkv_providers.device._hostmem import OrdinaryAllocator

torch = pytest.importorskip("torch")

L, H, D, T, NB = 3, 2, 16, 8, 12


def _layout(dtype: str = "bfloat16", scale: str | None = None, kinds: tuple[str, ...] = ("k", "v")) -> KVLayout:
    return KVLayout(num_layers=L, num_kv_heads=H, head_dim=D, page_tokens=T, dtype=dtype, kinds=kinds,
                    scale_dtype=scale)


def _page(planes: list[Any], block: int) -> bytes:
    return b"".join(p[block].contiguous().view(torch.uint8).numpy().tobytes() for p in planes)


# ------------------------------------------------------------------------------------------
# paged (vLLM-style)
# ------------------------------------------------------------------------------------------


def test_paged_separate_k_v_order_and_zero_copy() -> None:
    lay = _layout()
    ks = [torch.randn(NB, T, H, D).to(torch.bfloat16) for _ in range(L)]
    vs = [torch.randn(NB, T, H, D).to(torch.bfloat16) for _ in range(L)]
    planes = paged_planes(lay, ks, vs)
    assert [p.data_ptr() for p in planes] == [t.data_ptr() for pair in zip(ks, vs, strict=True) for t in pair]
    assert [(s.layer, s.kind) for s in lay.planes] == [(i // 2, "kv"[i % 2]) for i in range(2 * L)]
    kv = KVPlanes.from_torch(lay, planes)
    assert kv.num_blocks == NB


def test_paged_stacked_kv_tensor_with_interleaved_blocks() -> None:
    lay = _layout()
    # vLLM's flash layout: one [2, num_blocks, block, heads, dim] tensor per layer
    stacked = [torch.randn(2, NB, T, H, D).to(torch.bfloat16) for _ in range(L)]
    planes = paged_planes(lay, stacked)
    assert planes[0].data_ptr() == stacked[0][0].data_ptr() and planes[1].data_ptr() == stacked[0][1].data_ptr()
    # blocks interleaved with another tensor's (stride > block bytes) are fine
    inter = [torch.randn(NB, 2, T, H, D).to(torch.bfloat16)[:, 0] for _ in range(2 * L)]
    planes2 = paged_planes(lay, inter[0::2], inter[1::2])
    kv = KVPlanes.from_torch(lay, planes2)
    assert kv.block_strides[0] == 2 * T * H * D * 2


def test_paged_int8_with_scales_through_the_cache() -> None:
    lay = _layout("int8", "float32")
    assert [s.kind for s in lay.planes[:4]] == ["k", "k_scale", "v", "v_scale"]
    g = torch.Generator().manual_seed(0)
    codes = [torch.randint(-127, 128, (NB, T, H, D), dtype=torch.int8, generator=g) for _ in range(2 * L)]
    scales = [torch.rand(NB, T, H, generator=g) for _ in range(2 * L)]
    planes = paged_planes(lay, codes[0::2], codes[1::2], key_scales=scales[0::2], value_scales=scales[1::2])
    assert planes[1] is scales[0] and planes[3] is scales[1]
    dst_codes = [torch.zeros_like(c) for c in codes]
    dst_scales = [torch.zeros_like(s) for s in scales]
    dst = paged_planes(lay, dst_codes[0::2], dst_codes[1::2], key_scales=dst_scales[0::2],
                       value_scales=dst_scales[1::2])
    prov = PinnedProvider(64 * lay.page_nbytes + 4096 * 64, block=4096 * ((lay.page_nbytes + 4095) // 4096),
                          allocator=OrdinaryAllocator())
    engine = CpuCopyEngine()
    try:
        with HostKVCache(prov, Salt("m", lay, quantization="int8-per-token-head"), engine,
                         staging_allocator=OrdinaryAllocator()) as cache:
            keys = cache.keys(np.arange(T * 5))
            assert cache.save(keys, planes, [3, 1, 4, 0, 5]).wait(30).stored == 5
            assert prov.read_bytes(keys[0]) == _page(planes, 3)
            assert cache.restore(cache.lookup(keys), dst, [7, 8, 9, 10, 11]).wait(30).pages == 5
        for src_b, dst_b in zip([3, 1, 4, 0, 5], [7, 8, 9, 10, 11], strict=True):
            assert _page(dst, dst_b) == _page(planes, src_b)
    finally:
        engine.close()
        prov.close()


def test_paged_latent_kind() -> None:
    lay = _layout("float16", kinds=("kv",))
    caches = [torch.zeros(NB, T, H, D, dtype=torch.float16) for _ in range(L)]
    assert len(paged_planes(lay, caches)) == L
    with pytest.raises(InvalidArgumentError):
        paged_planes(lay, caches, caches)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda ks, vs: (ks[:-1], vs), "layers"),
        (lambda ks, vs: ([k.float() for k in ks], vs), "dtype"),
        (lambda ks, vs: ([k[:, :, :, :8] for k in ks], vs), "shape"),
        (lambda ks, vs: ([k.transpose(1, 2).contiguous().transpose(1, 2) for k in ks], vs), "contiguous"),
        (lambda ks, vs: (ks, [v[:5] for v in vs]), "blocks"),
    ],
)
def test_paged_rejects_bad_tensors(mutate, match) -> None:  # type: ignore[no-untyped-def]
    lay = _layout()
    ks = [torch.zeros(NB, T, H, D, dtype=torch.bfloat16) for _ in range(L)]
    vs = [torch.zeros(NB, T, H, D, dtype=torch.bfloat16) for _ in range(L)]
    a, b = mutate(ks, vs)
    with pytest.raises(InvalidArgumentError, match=match):
        paged_planes(lay, a, b)


def test_paged_scale_rules_and_numpy() -> None:
    q = _layout("int8", "float32")
    codes = [np.zeros((NB, T, H, D), np.int8) for _ in range(L)]
    with pytest.raises(InvalidArgumentError, match="scale"):
        paged_planes(q, codes, codes)
    sc = [np.zeros((NB, T, H), np.float32) for _ in range(L)]
    planes = paged_planes(q, codes, codes, key_scales=sc, value_scales=sc)
    assert KVPlanes.from_arrays(q, planes).num_blocks == NB
    with pytest.raises(InvalidArgumentError):
        paged_planes(_layout("int8"), codes, codes, key_scales=sc, value_scales=sc)
    with pytest.raises(InvalidArgumentError):
        paged_planes(_layout("int8"), [np.zeros((NB, T, H, D), np.int8)] * L)  # not stacked [2, ...]
    assert plane_dtype_name(np.zeros(1, np.float16)) == "float16"
    with pytest.raises(InvalidArgumentError):
        plane_dtype_name(3)


# ------------------------------------------------------------------------------------------
# transformers caches
# ------------------------------------------------------------------------------------------


def _hf_cache(seq: int, dtype: Any = None, batch: int = 1) -> list[tuple[Any, Any]]:
    dtype = torch.float32 if dtype is None else dtype
    g = torch.Generator().manual_seed(seq)
    return [(torch.randn(batch, H, seq, D, generator=g).to(dtype), torch.randn(batch, H, seq, D, generator=g).to(dtype))
            for _ in range(L)]


def test_hf_pack_unpack_is_exact_and_token_major() -> None:
    lay = _layout("float32")
    m = HFCacheMap(lay)
    cache = _hf_cache(T * 4 + 3)
    assert m.num_pages(cache) == 4
    planes = m.pack(cache)
    assert planes[0].shape == (4, T, H, D)
    # page 1 of layer 0's K holds tokens 8..15, token-major [tokens, heads, dim]
    assert torch.equal(planes[0][1], cache[0][0][0, :, T : 2 * T, :].transpose(0, 1))
    back = m.unpack(planes)
    for (k, v), (k2, v2) in zip(cache, back, strict=True):
        assert torch.equal(k[:, :, : 4 * T], k2) and torch.equal(v[:, :, : 4 * T], v2)
    part = m.pack(cache, start_page=1, num_pages=2)
    assert torch.equal(part[3], planes[3][1:3])


def test_hf_dynamic_cache_round_trip_and_batch_row() -> None:
    from transformers import DynamicCache

    lay = _layout("bfloat16")
    m = HFCacheMap(lay)
    layers = _hf_cache(T * 3, torch.bfloat16, batch=2)
    dc = DynamicCache()
    for i, (k, v) in enumerate(layers):
        dc.update(k, v, i)
    assert len(cache_layers(dc)) == L
    planes = m.pack(dc, batch_index=1)
    restored = m.to_dynamic_cache(planes)
    for (k, v), (k2, v2) in zip(layers, cache_layers(restored), strict=True):
        assert torch.equal(k[1:2], k2) and torch.equal(v[1:2], v2)
    empty = m.empty_planes(3)
    assert [tuple(p.shape) for p in empty[:2]] == [(3, T, H, D)] * 2 and empty[0].dtype == torch.bfloat16


@pytest.mark.parametrize("code, tol", [("int8", 0.02), ("float8_e4m3fn", 0.1)])
def test_hf_quantized_pages(code: str, tol: float) -> None:
    lay = _layout(code, "float32")
    m = HFCacheMap(lay)
    cache = _hf_cache(T * 2)
    planes = m.pack(cache)
    assert len(planes) == 4 * L and planes[0].dtype == getattr(torch, code) and planes[1].shape == (2, T, H)
    for (k, _v), (k2, _v2) in zip(cache, m.unpack(planes), strict=True):
        err = (k - k2).abs().max() / k.abs().max()
        assert err < tol
    codes, scales = quantize(cache[0][0], code)
    assert torch.allclose(dequantize(codes, scales, torch.float32), cache[0][0], atol=tol * 4)


def test_hf_rejects_mismatches() -> None:
    m = HFCacheMap(_layout("float32"))
    with pytest.raises(InvalidArgumentError):
        m.pack(_hf_cache(T, torch.float16))  # dtype differs from the layout's
    with pytest.raises(InvalidArgumentError):
        m.pack(_hf_cache(T)[:-1])
    with pytest.raises(InvalidArgumentError):
        m.pack(_hf_cache(T * 2), start_page=1, num_pages=2)
    with pytest.raises(InvalidArgumentError):
        m.pack(_hf_cache(T), batch_index=1)
    with pytest.raises(InvalidArgumentError):
        m.pack(object())
    with pytest.raises(InvalidArgumentError):
        HFCacheMap(_layout(kinds=("kv",)))
    with pytest.raises(InvalidArgumentError):
        HFCacheMap(_layout("bfloat16", "float32"))  # scales need 8-bit codes
    with pytest.raises(InvalidArgumentError):
        quantize(torch.zeros(2, 2), "int4")
    with pytest.raises(InvalidArgumentError):
        m.unpack(m.pack(_hf_cache(T))[:-1])
