"""``KVLayout``: how one page of KV cache is packed into bytes.

A page holds ``page_tokens`` consecutive tokens of every layer.  Its bytes are a sequence of
*plane slices*: for each layer, for each kind (``k``, ``v`` — or one ``kv`` plane for MLA-style
latent caches), the block of that layer's plane for those tokens, in the engine's own element
order ``[page_tokens, num_kv_heads, head_dim]``.  Quantized caches (int8/fp8 codes) add one
scale plane per layer and kind, ``[page_tokens, num_kv_heads]`` of ``scale_dtype``, placed right
after the codes of the same layer and kind.  Group-wise scales (``scale_group`` elements of
``head_dim`` share one scale, e.g. int8 with one scale per 64 elements; ``scale_block_tokens``
tokens share one, e.g. fp8 with one scale per (page, head)) make that plane
``[page_tokens // scale_block_tokens, num_kv_heads, head_dim // scale_group]``.  Every byte of a
page therefore has one owner, and a copy engine moves a page as a list of ``(plane, nbytes)`` slices.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

from hostkv_providers._errors import InvalidArgumentError

__all__ = ["DTYPE_ITEMSIZE", "KVLayout", "PlaneSpec"]

#: Element sizes of the KV dtypes this library knows by name.
DTYPE_ITEMSIZE: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int8": 1,
    "uint8": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}


@dataclass(frozen=True, slots=True)
class PlaneSpec:
    """One plane slice of a page: which layer/kind it is and where it sits in the page bytes."""

    index: int  # position in KVLayout.planes
    layer: int
    kind: str  # "k", "v", "kv", or "<kind>_scale"
    offset: int  # byte offset inside the packed page
    nbytes: int  # bytes of this plane for one page
    is_scale: bool


@dataclass(frozen=True)
class KVLayout:
    """Geometry of a model's KV cache pages.

    Parameters
    ----------
    num_layers, num_kv_heads, head_dim:
        The attention geometry (per layer, per kind).
    page_tokens:
        Tokens per page (the engine's block size).  Only full pages are stored.
    dtype:
        Element dtype of the KV codes, one of :data:`DTYPE_ITEMSIZE`.
    kinds:
        Planes per layer: ``("k", "v")`` for ordinary attention, ``("kv",)`` for latent caches.
    scale_dtype:
        For quantized caches, the dtype of the scales stored as extra planes (by default one per
        token and head).
    scale_group:
        Elements of ``head_dim`` that share one scale (a divisor of ``head_dim``); ``None`` (the
        default) is one scale per whole head, i.e. ``head_dim``.  Needs ``scale_dtype``.
    scale_block_tokens:
        Tokens that share one scale (a divisor of ``page_tokens``); ``None`` (the default) is one
        scale per token.  ``page_tokens`` gives one scale per page and head ("per-block").

    The two group fields are part of :meth:`describe` (hence of the salt) only when set, so the
    layouts that existed before them keep their keys and page sizes.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_tokens: int
    dtype: str = "bfloat16"
    kinds: tuple[str, ...] = ("k", "v")
    scale_dtype: str | None = None
    scale_group: int | None = None
    scale_block_tokens: int | None = None

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "page_tokens"):
            value = getattr(self, name)
            if type(value) is not int or value <= 0:
                raise InvalidArgumentError(f"KVLayout.{name} must be a positive int, got {value!r}")
        if self.dtype not in DTYPE_ITEMSIZE:
            raise InvalidArgumentError(
                f"unknown KV dtype {self.dtype!r}",
                hint=f"use one of {sorted(DTYPE_ITEMSIZE)}",
            )
        if self.scale_dtype is not None and self.scale_dtype not in DTYPE_ITEMSIZE:
            raise InvalidArgumentError(f"unknown scale dtype {self.scale_dtype!r}")
        for name, whole, what in (("scale_group", self.head_dim, "head_dim"),
                                  ("scale_block_tokens", self.page_tokens, "page_tokens")):
            value = getattr(self, name)
            if value is None:
                continue
            if self.scale_dtype is None:
                raise InvalidArgumentError(f"KVLayout.{name} needs scale_dtype", hint="set scale_dtype='float32'")
            if type(value) is not int or value <= 0 or whole % value:
                raise InvalidArgumentError(f"KVLayout.{name} must be a positive divisor of {what} ({whole}), "
                                           f"got {value!r}")
        if isinstance(self.kinds, str) or not all(isinstance(k, str) and k for k in self.kinds):
            # ("kv") is the string "kv": taken as ("k", "v") it turned an MLA layout into K/V
            raise InvalidArgumentError(f"KVLayout.kinds must be a tuple of names, got {self.kinds!r}",
                                       hint='a one-kind layout is kinds=("kv",)')
        if not self.kinds or len(set(self.kinds)) != len(self.kinds):
            raise InvalidArgumentError(f"KVLayout.kinds must be distinct names, got {self.kinds!r}")
        object.__setattr__(self, "kinds", tuple(self.kinds))

    @property
    def itemsize(self) -> int:
        return DTYPE_ITEMSIZE[self.dtype]

    @property
    def plane_nbytes(self) -> int:
        """Bytes of one code plane slice (one layer, one kind, one page)."""
        return self.page_tokens * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def scale_shape(self) -> tuple[int, int, int]:
        """Element shape of one scale plane slice: ``[token groups, num_kv_heads, dim groups]``
        (``(page_tokens, num_kv_heads, 1)`` for per-token, per-head scales)."""
        groups = self.head_dim // (self.scale_group or self.head_dim)
        return (self.page_tokens // (self.scale_block_tokens or 1), self.num_kv_heads, groups)

    @property
    def scale_nbytes(self) -> int:
        """Bytes of one scale plane slice, 0 without scales."""
        if self.scale_dtype is None:
            return 0
        t, h, g = self.scale_shape
        return t * h * g * DTYPE_ITEMSIZE[self.scale_dtype]

    @cached_property
    def planes(self) -> tuple[PlaneSpec, ...]:
        """Every plane slice of a page, in packing order."""
        out: list[PlaneSpec] = []
        offset = 0
        for layer in range(self.num_layers):
            for kind in self.kinds:
                out.append(PlaneSpec(len(out), layer, kind, offset, self.plane_nbytes, False))
                offset += self.plane_nbytes
                if self.scale_dtype is not None:
                    out.append(
                        PlaneSpec(len(out), layer, f"{kind}_scale", offset, self.scale_nbytes, True)
                    )
                    offset += self.scale_nbytes
        return tuple(out)

    @property
    def page_nbytes(self) -> int:
        """Bytes of one packed page."""
        per_layer = len(self.kinds) * (self.plane_nbytes + self.scale_nbytes)
        return self.num_layers * per_layer

    def describe(self) -> dict[str, Any]:
        """A canonical, JSON/msgpack-safe description; part of the salt."""
        out: dict[str, Any] = {
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "page_tokens": self.page_tokens,
            "dtype": self.dtype,
            "kinds": list(self.kinds),
            "scale_dtype": self.scale_dtype,
            "packing": "layer-major/kind/[tokens,heads,head_dim]+scale",
        }
        # Only when set: the layouts from before group-wise scales keep their salts (and keys).
        if self.scale_group is not None:
            out["scale_group"] = self.scale_group
        if self.scale_block_tokens is not None:
            out["scale_block_tokens"] = self.scale_block_tokens
        return out
