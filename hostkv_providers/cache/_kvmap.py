"""Layout mapping: from an engine's KV tensors to the planes a copy engine moves.

A packed page (see :class:`~hostkv_providers.KVLayout`) is the concatenation of one slice per
plane of ``layout.planes``: for each layer and kind the ``[page_tokens, num_kv_heads, head_dim]``
codes, followed, in quantized layouts, by the ``[page_tokens, num_kv_heads]`` scales.  The copy
engine wants one tensor per plane whose first dimension is the engine's block id, so that block
``b`` of plane ``p`` is ``plane_nbytes`` contiguous bytes at ``ptr[p] + b * block_stride[p]``.

Two engine layouts are mapped here:

* :func:`paged_planes` — a vLLM-style paged cache: per layer, a K and a V tensor indexed by block
  id, ``[num_blocks, block_size, num_kv_heads, head_dim]`` (or one stacked
  ``[2, num_blocks, ...]`` tensor per layer), plus optional scale tensors for int8/fp8 codes.  The
  tensors are used in place: no copy, the copy engine gathers straight from them.
* :class:`HFCacheMap` — a Hugging Face ``transformers`` cache, per-layer key/value tensors
  ``[batch, num_kv_heads, seq, head_dim]``.  Their element order is head-major, so a page is not
  a contiguous slice: :meth:`HFCacheMap.pack` builds token-major staging planes (one transpose
  per layer; with a quantized layout it also quantizes to int8/fp8 codes plus float scales) and
  :meth:`HFCacheMap.unpack` turns restored planes back into per-layer key/value tensors.

Torch is optional: :func:`paged_planes` also accepts NumPy arrays; :class:`HFCacheMap` needs torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from hostkv_providers._errors import InvalidArgumentError
from hostkv_providers._layout import DTYPE_ITEMSIZE, KVLayout

if TYPE_CHECKING:
    import torch

__all__ = [
    "HFCacheMap",
    "dequantize",
    "paged_planes",
    "plane_dtype_name",
    "quantize",
]

#: Largest finite magnitude of each 8-bit code dtype (the quantization target range).
_CODE_MAX = {"int8": 127.0, "float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}


def plane_dtype_name(t: object) -> str:
    """The layout dtype name of a torch tensor or NumPy array (``"bfloat16"``, ``"int8"`` ...)."""
    dtype = getattr(t, "dtype", None)
    if dtype is None:
        raise InvalidArgumentError(f"expected a tensor or array, got {type(t).__name__}")
    name = str(dtype)
    return name[len("torch."):] if name.startswith("torch.") else name


def _shape(t: object) -> tuple[int, ...]:
    return tuple(int(d) for d in t.shape)  # type: ignore[attr-defined]


def _strides_bytes(t: object) -> tuple[int, ...]:
    if isinstance(t, np.ndarray):
        return tuple(int(s) for s in t.strides)
    stride = t.stride()  # type: ignore[attr-defined]
    item = int(t.element_size())  # type: ignore[attr-defined]
    return tuple(int(s) * item for s in stride)


def _check_plane(t: object, what: str, dtype: str, inner: tuple[int, ...], num_blocks: int | None) -> int:
    """Validate one per-plane tensor ``[num_blocks, *inner]``; return its block count."""
    name = plane_dtype_name(t)
    if name != dtype:
        raise InvalidArgumentError(f"{what} has dtype {name}, the layout needs {dtype}")
    shape = _shape(t)
    if len(shape) != 1 + len(inner) or shape[1:] != inner:
        raise InvalidArgumentError(
            f"{what} has shape {shape}, expected (num_blocks, {', '.join(map(str, inner))})",
            hint="per-layer paged tensors are [num_blocks, block_size, num_kv_heads, head_dim]",
        )
    if num_blocks is not None and shape[0] != num_blocks:
        raise InvalidArgumentError(f"{what} has {shape[0]} blocks, the other planes have {num_blocks}")
    # One block of a plane must be one contiguous run of bytes (what the copy engine moves);
    # the block stride itself may be larger (interleaved K/V allocations are fine).
    strides = _strides_bytes(t)
    expect = DTYPE_ITEMSIZE[dtype]
    for dim in range(len(shape) - 1, 0, -1):
        if shape[dim] != 1 and strides[dim] != expect:
            raise InvalidArgumentError(
                f"{what}: one block is not contiguous (strides {strides} bytes)",
                hint="each block's [block_size, heads, head_dim] slice must be C-contiguous",
            )
        expect *= shape[dim]
    if shape[0] > 1 and strides[0] < expect:
        raise InvalidArgumentError(f"{what}: blocks overlap (block stride {strides[0]} < {expect} bytes)")
    return shape[0]


def paged_planes(
    layout: KVLayout,
    key_caches: Sequence[Any],
    value_caches: Sequence[Any] | None = None,
    *,
    key_scales: Sequence[Any] | None = None,
    value_scales: Sequence[Any] | None = None,
) -> list[Any]:
    """Order a vLLM-style paged cache's tensors as ``layout.planes`` (no copy).

    Parameters
    ----------
    layout:
        The page layout; ``layout.page_tokens`` must equal the engine's block size.
    key_caches:
        Per layer, the K cache ``[num_blocks, block_size, num_kv_heads, head_dim]``.  If
        ``value_caches`` is ``None`` and the layout has kinds ``("k", "v")``, each element may
        instead be the stacked ``[2, num_blocks, ...]`` K/V tensor of that layer.  For a latent
        (``kinds=("kv",)``) layout, the one cache per layer.
    value_caches:
        Per layer, the V cache (same shape as K).
    key_scales, value_scales:
        For quantized layouts (``layout.scale_dtype`` set): per layer
        ``[num_blocks, block_size, num_kv_heads]`` scales of ``scale_dtype``.

    Returns
    -------
    list
        One tensor/array per entry of ``layout.planes``, first dimension the block id; pass it
        to ``KVPlanes.from_torch`` / ``KVPlanes.from_arrays``.
    """
    n_layers = layout.num_layers
    kinds = layout.kinds
    if isinstance(key_caches, (str, bytes)) or not isinstance(key_caches, Sequence):
        raise InvalidArgumentError("key_caches must be a sequence with one tensor per layer")
    if len(key_caches) != n_layers:
        raise InvalidArgumentError(f"key_caches has {len(key_caches)} layers, the layout {n_layers}")
    per_kind: dict[str, Sequence[Any]] = {}
    if kinds == ("k", "v"):
        if value_caches is None:
            ks, vs = [], []
            for i, kv in enumerate(key_caches):
                shape = _shape(kv)
                if len(shape) != 5 or shape[0] != 2:
                    raise InvalidArgumentError(
                        f"layer {i}: without value_caches each layer must be a stacked [2, num_blocks, ...] "
                        f"tensor, got shape {shape}"
                    )
                ks.append(kv[0])
                vs.append(kv[1])
            per_kind = {"k": ks, "v": vs}
        else:
            if len(value_caches) != n_layers:
                raise InvalidArgumentError(f"value_caches has {len(value_caches)} layers, the layout {n_layers}")
            per_kind = {"k": key_caches, "v": value_caches}
    elif len(kinds) == 1:
        if value_caches is not None:
            raise InvalidArgumentError(f"layout kinds {kinds} take one cache per layer; value_caches must be None")
        per_kind = {kinds[0]: key_caches}
    else:
        raise InvalidArgumentError(f"paged_planes maps kinds ('k', 'v') or one latent kind, not {kinds}")
    scales: dict[str, Sequence[Any]] = {}
    if layout.scale_dtype is not None:
        given = {"k": key_scales, "v": value_scales} if kinds == ("k", "v") else {kinds[0]: key_scales}
        for kind, sc in given.items():
            if sc is None or len(sc) != n_layers:
                raise InvalidArgumentError(
                    f"the layout is quantized ({layout.dtype} + {layout.scale_dtype} scales): "
                    f"give one {kind} scale tensor per layer",
                )
            scales[kind] = sc
    elif key_scales is not None or value_scales is not None:
        raise InvalidArgumentError("scales given but the layout has no scale_dtype")
    inner = (layout.page_tokens, layout.num_kv_heads, layout.head_dim)
    # per-token, per-head scales are [blocks, page_tokens, heads]; a grouped layout's (scale_group,
    # scale_block_tokens) are its documented scale_shape: per-token scales of as many bytes would
    # pass a byte count, and be stored under a salt that says groups
    grouped = layout.scale_group is not None or layout.scale_block_tokens is not None
    inner_scale = layout.scale_shape if grouped else (layout.page_tokens, layout.num_kv_heads)
    out: list[Any] = []
    num_blocks: int | None = None
    for plane in layout.planes:
        if plane.is_scale:
            kind = plane.kind[: -len("_scale")]
            t = scales[kind][plane.layer]
            assert layout.scale_dtype is not None
            num_blocks = _check_plane(t, f"layer {plane.layer} {plane.kind}", layout.scale_dtype, inner_scale,
                                      num_blocks)
        else:
            t = per_kind[plane.kind][plane.layer]
            num_blocks = _check_plane(t, f"layer {plane.layer} {plane.kind}", layout.dtype, inner, num_blocks)
        out.append(t)
    return out


# --------------------------------------------------------------------------------------------
# Quantization helpers (per token and head, symmetric)
# --------------------------------------------------------------------------------------------


def quantize(x: torch.Tensor, code_dtype: str, scale_dtype: str = "float32") -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-(token, head) quantization of ``x[..., head_dim]``.

    Returns ``(codes, scales)`` with ``x ≈ codes * scales[..., None]``; ``codes`` of
    ``code_dtype`` (``int8``, ``float8_e4m3fn`` or ``float8_e5m2``), ``scales`` of ``scale_dtype``.
    """
    import torch

    if code_dtype not in _CODE_MAX:
        raise InvalidArgumentError(f"cannot quantize to {code_dtype!r}", hint=f"use one of {sorted(_CODE_MAX)}")
    sdt = getattr(torch, scale_dtype, None)
    if not isinstance(sdt, torch.dtype):
        raise InvalidArgumentError(f"unknown scale dtype {scale_dtype!r}")
    xf = x.float()
    amax = xf.abs().amax(dim=-1)
    scale = (amax / _CODE_MAX[code_dtype]).clamp_min(1e-12).to(sdt)
    # Divide by the scale as stored, so dequantize(codes, scales) is the exact inverse map.
    scaled = xf / scale.float().unsqueeze(-1)
    if code_dtype == "int8":
        codes = scaled.round().clamp(-127, 127).to(torch.int8)
    else:
        codes = scaled.clamp(-_CODE_MAX[code_dtype], _CODE_MAX[code_dtype]).to(getattr(torch, code_dtype))
    return codes, scale


def dequantize(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`quantize`: ``codes * scales[..., None]`` in ``dtype``."""
    return (codes.float() * scales.float().unsqueeze(-1)).to(dtype)


# --------------------------------------------------------------------------------------------
# Hugging Face transformers caches
# --------------------------------------------------------------------------------------------


def _torch_dtype(name: str) -> torch.dtype:
    import torch

    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise InvalidArgumentError(f"torch has no dtype {name!r}")
    return dt


def cache_layers(cache: object) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer ``(key, value)`` tensors of a transformers cache.

    Accepts a ``DynamicCache`` (transformers 4.5x ``key_cache``/``value_cache`` lists or 5.x
    ``layers[i].keys``/``.values``) or a legacy tuple of ``(key, value)`` pairs.
    """
    layers = getattr(cache, "layers", None)
    if layers is not None:
        out = []
        for i, layer in enumerate(layers):
            k, v = getattr(layer, "keys", None), getattr(layer, "values", None)
            if (k is None or not hasattr(k, "shape")) and hasattr(layer, "recurrent_states"):
                raise InvalidArgumentError(
                    f"cache layer {i} is a linear-attention layer (a hybrid model): its state is not KV",
                    hint="map hybrid caches with HybridCacheMap(layout, model.config)")
            if k is None or v is None or not hasattr(k, "shape"):
                raise InvalidArgumentError(f"cache layer {i} holds no key/value tensors (not initialised?)")
            out.append((k, v))
        return out
    kc, vc = getattr(cache, "key_cache", None), getattr(cache, "value_cache", None)
    if kc is not None and vc is not None:
        return list(zip(kc, vc, strict=True))
    if isinstance(cache, (tuple, list)) and all(isinstance(p, (tuple, list)) and len(p) >= 2 for p in cache):
        return [(p[0], p[1]) for p in cache]
    raise InvalidArgumentError(f"not a transformers KV cache: {type(cache).__name__}")


class HFCacheMap:
    """Packs a transformers cache's per-layer K/V into page planes and back.

    Parameters
    ----------
    layout:
        The page layout; ``kinds`` must be ``("k", "v")``.  When ``layout.dtype`` is an 8-bit code
        dtype with ``scale_dtype`` set, :meth:`pack` quantizes per token and head and
        :meth:`unpack` dequantizes (lossy, by design of the layout); otherwise the element dtype
        of the model's cache must equal ``layout.dtype`` and the round trip is bit-exact.
    """

    def __init__(self, layout: KVLayout) -> None:
        if not isinstance(layout, KVLayout):
            raise InvalidArgumentError("HFCacheMap needs a KVLayout")
        if layout.kinds != ("k", "v"):
            raise InvalidArgumentError(f"transformers caches have K and V planes, the layout has {layout.kinds}")
        quantized = layout.scale_dtype is not None
        if quantized and layout.dtype not in _CODE_MAX:
            raise InvalidArgumentError(f"a layout with scales needs 8-bit codes, got {layout.dtype}")
        if layout.scale_group is not None or layout.scale_block_tokens is not None:
            raise InvalidArgumentError("HFCacheMap quantizes per token and head: a layout with scale_group or "
                                       "scale_block_tokens is not one it can pack",
                                       hint="use a layout with per-token scales (no scale_group / scale_block_tokens)")
        self.layout = layout
        self.quantized = quantized

    def num_pages(self, cache: object, batch_index: int = 0) -> int:
        """Full pages held by row ``batch_index`` of ``cache``."""
        layers = cache_layers(cache)
        if not layers:
            return 0
        return int(layers[0][0].shape[-2]) // self.layout.page_tokens

    def pack(
        self,
        cache: object,
        *,
        start_page: int = 0,
        num_pages: int | None = None,
        batch_index: int = 0,
    ) -> list[torch.Tensor]:
        """Staging planes ``[num_pages, page_tokens, heads, head_dim]`` (and scale planes) for
        pages ``start_page .. start_page + num_pages`` of one batch row, in ``layout.planes``
        order.  Block id ``i`` of the result is page ``start_page + i``."""
        lay = self.layout
        layers = cache_layers(cache)
        if len(layers) != lay.num_layers:
            raise InvalidArgumentError(f"the cache has {len(layers)} layers, the layout {lay.num_layers}")
        k0 = layers[0][0]
        if k0.dim() != 4:
            raise InvalidArgumentError(f"expected [batch, heads, seq, head_dim] tensors, got shape {tuple(k0.shape)}")
        batch, heads, seq, hd = (int(d) for d in k0.shape)
        if heads != lay.num_kv_heads or hd != lay.head_dim:
            raise InvalidArgumentError(
                f"cache heads/head_dim {heads}/{hd} do not match the layout's {lay.num_kv_heads}/{lay.head_dim}"
            )
        if not 0 <= batch_index < batch:
            raise InvalidArgumentError(f"batch_index {batch_index} outside batch of {batch}")
        total = seq // lay.page_tokens
        if num_pages is None:
            num_pages = total - start_page
        if start_page < 0 or num_pages < 0 or start_page + num_pages > total:
            raise InvalidArgumentError(f"pages [{start_page}, {start_page + num_pages}) outside the {total} full pages")
        t0, t1 = start_page * lay.page_tokens, (start_page + num_pages) * lay.page_tokens
        want = lay.dtype if not self.quantized else None
        out: list[torch.Tensor] = []
        for li, (k, v) in enumerate(layers):
            for kind, t in (("k", k), ("v", v)):
                if tuple(t.shape) != (batch, heads, seq, hd):
                    raise InvalidArgumentError(
                        f"layer {li} {kind} has shape {tuple(t.shape)}, expected {(batch, heads, seq, hd)}")
                tok = t[batch_index, :, t0:t1, :].transpose(0, 1)  # [tokens, heads, head_dim]
                if want is not None:
                    if plane_dtype_name(t) != want:
                        raise InvalidArgumentError(
                            f"layer {li} {kind} is {plane_dtype_name(t)}, the layout stores {want}")
                    out.append(tok.reshape(num_pages, lay.page_tokens, heads, hd).contiguous())
                else:
                    assert lay.scale_dtype is not None
                    codes, scales = quantize(tok, lay.dtype, lay.scale_dtype)
                    out.append(codes.reshape(num_pages, lay.page_tokens, heads, hd).contiguous())
                    out.append(scales.reshape(num_pages, lay.page_tokens, heads).contiguous())
        return out

    def empty_planes(self, num_pages: int, device: object = "cpu") -> list[torch.Tensor]:
        """Zeroed staging planes for ``num_pages`` pages, to restore into."""
        import torch

        lay = self.layout
        out: list[torch.Tensor] = []
        for plane in lay.planes:
            if plane.is_scale:
                assert lay.scale_dtype is not None
                out.append(torch.zeros((num_pages, lay.page_tokens, lay.num_kv_heads),
                                       dtype=_torch_dtype(lay.scale_dtype), device=device))  # type: ignore[call-overload]
            else:
                out.append(torch.zeros((num_pages, lay.page_tokens, lay.num_kv_heads, lay.head_dim),
                                       dtype=_torch_dtype(lay.dtype), device=device))  # type: ignore[call-overload]
        return out

    def unpack(self, planes: Sequence[torch.Tensor], *,
               dtype: torch.dtype | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer ``(key, value)`` tensors ``[1, heads, pages*page_tokens, head_dim]`` from
        staging planes (the inverse of :meth:`pack`).  ``dtype`` is the dequantized dtype for a
        quantized layout (default ``float32``)."""
        import torch

        lay = self.layout
        if len(planes) != len(lay.planes):
            raise InvalidArgumentError(f"{len(planes)} planes given, the layout has {len(lay.planes)}")
        out: list[tuple[torch.Tensor, torch.Tensor]] = []
        pair: list[torch.Tensor] = []
        i = 0
        while i < len(planes):
            spec = lay.planes[i]
            codes = planes[i]
            n = int(codes.shape[0])
            if self.quantized:
                scales = planes[i + 1]
                x = dequantize(codes, scales, dtype or torch.float32)
                i += 2
            else:
                x = codes
                i += 1
            tok = x.reshape(n * lay.page_tokens, lay.num_kv_heads, lay.head_dim)
            pair.append(tok.transpose(0, 1).unsqueeze(0).contiguous())
            if spec.kind == "v":
                out.append((pair[0], pair[1]))
                pair = []
        return out

    def to_dynamic_cache(self, planes: Sequence[torch.Tensor], *, dtype: torch.dtype | None = None,
                         config: Any = None) -> Any:
        """A ``transformers.DynamicCache`` holding the restored pages (prefix of a prompt)."""
        from transformers import DynamicCache

        types = getattr(config, "layer_types", None) or ()
        if any(t not in ("full_attention", "sliding_attention", "chunked_attention") for t in types):
            raise InvalidArgumentError(
                f"the model has non-attention layers ({sorted(set(types))}): KV pages alone cannot rebuild its cache",
                hint="map hybrid caches with HybridCacheMap(layout, model.config), which restores the state too")
        try:
            cache = DynamicCache(config=config) if config is not None else DynamicCache()
        except TypeError:  # transformers before 4.56 takes no config (and needs none here)
            cache = DynamicCache()
        for li, (k, v) in enumerate(self.unpack(planes, dtype=dtype)):
            cache.update(k, v, li)
        return cache
