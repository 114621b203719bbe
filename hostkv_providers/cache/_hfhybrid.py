"""Hugging Face hybrid caches (Qwen3-Next and other linear-attention + full-attention models).

A transformers 5.x ``DynamicCache`` built with a hybrid config holds two kinds of layers: full
attention layers (``DynamicLayer``: per-layer key/value tensors, which become KV pages) and linear
attention layers (``LinearAttentionLayer``: a conv state and a recurrent state per layer, which
together are the *state* a hit must resume from).  :class:`HybridCacheMap` maps both:

* :meth:`HybridCacheMap.pack` / :meth:`unpack` move the full-attention layers' K/V (only those:
  the layout's ``num_layers`` is the number of attention layers) exactly like
  :class:`~hostkv_providers.cache.HFCacheMap`;
* :meth:`HybridCacheMap.state_bytes` / :meth:`load_state` serialize every linear layer's conv and
  recurrent state (one batch row) into one blob — the anchor — and back; the blob names the
  model shape it was written for (a digest of the layer types and the config fields that shape
  the state), and a blob of another is refused;
* :meth:`HybridCacheMap.to_dynamic_cache` rebuilds a cache the model accepts from restored planes
  *and* a state, and refuses to build one without the state;
* :meth:`HybridCacheMap.prefill` runs a prefill in segments that end at anchor pages and captures
  the state at each (the recipe for interval anchors; its cost is measured in
  ``examples/hybrid_restore``).

The state's format string (:meth:`HybridCacheMap.state_format`) goes into ``Salt(state_format=)``
so the anchor records a hybrid ``HostKVCache`` writes are bound to it.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import struct
import sys
import threading
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from hostkv_providers._errors import InvalidArgumentError
from hostkv_providers._layout import KVLayout
from hostkv_providers.cache._kvmap import HFCacheMap, plane_dtype_name

if TYPE_CHECKING:
    import torch

__all__ = ["HybridCacheMap"]

_STATE_MAGIC = b"HKS1"
_STATE_HEAD = struct.Struct("<4sI")  # magic, descriptor length (JSON follows, then raw tensors)

#: Layer types of ``config.layer_types`` whose cache holds key/value tensors of every token.
_ATTENTION_TYPES = ("full_attention",)
#: Attention layers whose cache keeps a window of the latest tokens only (transformers'
#: ``DynamicSlidingWindowLayer``): its first index is not token 0, so it cannot be paged by position.
_WINDOWED_TYPES = ("sliding_attention", "chunked_attention")
#: Layer types whose cache holds a conv + recurrent state.
_LINEAR_TYPES = ("linear_attention", "mamba", "mamba2", "gated_deltanet")


#: Config fields that decide the shape of the linear layers' state (``state_format``).
_STATE_FIELDS = (
    "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
    "linear_conv_kernel_dim", "hidden_size",
    "mamba_n_heads", "mamba_d_head", "mamba_n_groups", "mamba_d_state", "mamba_d_conv", "mamba_expand",
    "mamba_dt_rank", "mamba_d_ssm",
)


def _layer_types(config: Any) -> list[str]:
    cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    types = getattr(cfg, "layer_types", None)
    if not types:
        raise InvalidArgumentError("the config has no layer_types: not a hybrid model config",
                                   hint="a plain transformer's cache maps with HFCacheMap")
    return [str(t) for t in types]


class HybridCacheMap:
    """Pages and state of a hybrid transformers cache.

    Parameters
    ----------
    layout:
        The page layout of the *attention* layers: ``num_layers`` must equal the number of full
        attention layers of the model (the linear layers have no KV), kinds ``("k", "v")``.
    config:
        The model's config (``model.config``): its ``layer_types`` say which layers are which,
        and it is what :meth:`to_dynamic_cache` builds the cache from.
    """

    def __init__(self, layout: KVLayout, config: Any) -> None:
        types = _layer_types(config)
        windowed = sorted({t for t in types if t in _WINDOWED_TYPES})
        if windowed:
            raise InvalidArgumentError(
                f"layer types {windowed} keep only a window of the latest tokens: their cache cannot be "
                "cut into pages by token position", hint="HybridCacheMap maps full-attention + linear layers")
        unknown = sorted({t for t in types if t not in _ATTENTION_TYPES + _LINEAR_TYPES})
        if unknown:
            raise InvalidArgumentError(f"layer types {unknown} are neither attention nor linear attention")
        self.config = config
        self.layer_types = types
        self.attention_layers = [i for i, t in enumerate(types) if t in _ATTENTION_TYPES]
        self.linear_layers = [i for i, t in enumerate(types) if t in _LINEAR_TYPES]
        if not self.linear_layers:
            raise InvalidArgumentError("the config has no linear-attention layers",
                                       hint="a plain transformer's cache maps with HFCacheMap")
        if layout.num_layers != len(self.attention_layers):
            raise InvalidArgumentError(
                f"the layout has {layout.num_layers} layers, the model {len(self.attention_layers)} attention layers",
                hint="KVLayout(num_layers=<number of full-attention layers>, ...)")
        self.kv = HFCacheMap(layout)
        self.layout = layout

    # -- KV pages ---------------------------------------------------------------------------------
    def _kv_pairs(self, cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
        layers = getattr(cache, "layers", None)
        if layers is None or len(layers) != len(self.layer_types):
            raise InvalidArgumentError(
                f"expected a transformers Cache with {len(self.layer_types)} layers, got {type(cache).__name__}")
        out = []
        for i in self.attention_layers:
            k, v = getattr(layers[i], "keys", None), getattr(layers[i], "values", None)
            if k is None or v is None or not hasattr(k, "shape") or k.dim() != 4:
                raise InvalidArgumentError(f"attention layer {i} holds no key/value tensors (not prefilled?)")
            out.append((k, v))
        return out

    def _cache_tokens(self, cache: Any) -> int:
        """Tokens held by the cache's attention layers (0 for a cache not prefilled yet)."""
        layers = getattr(cache, "layers", None)
        if layers is None or len(layers) != len(self.layer_types):
            raise InvalidArgumentError(
                f"expected a transformers Cache with {len(self.layer_types)} layers, got {type(cache).__name__}")
        k: Any = getattr(layers[self.attention_layers[0]], "keys", None)
        return int(k.shape[-2]) if k is not None and hasattr(k, "shape") and k.dim() == 4 else 0

    def num_pages(self, cache: Any) -> int:
        """Full pages held by the cache's attention layers."""
        return int(self._kv_pairs(cache)[0][0].shape[-2]) // self.layout.page_tokens

    def pack(self, cache: Any, *, start_page: int = 0, num_pages: int | None = None,
             batch_index: int = 0) -> list[torch.Tensor]:
        """Staging planes of the attention layers' pages (see :meth:`HFCacheMap.pack`)."""
        return self.kv.pack(self._kv_pairs(cache), start_page=start_page, num_pages=num_pages,
                            batch_index=batch_index)

    def empty_planes(self, num_pages: int, device: object = "cpu") -> list[torch.Tensor]:
        """Zeroed staging planes to restore ``num_pages`` pages into."""
        return self.kv.empty_planes(num_pages, device)

    def unpack(self, planes: Sequence[torch.Tensor], *,
               dtype: torch.dtype | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per attention layer ``(key, value)`` from restored planes."""
        return self.kv.unpack(planes, dtype=dtype)

    # -- state --------------------------------------------------------------------------------------
    def _state_tensors(self, cache: Any, batch_index: int) -> list[tuple[str, torch.Tensor]]:
        layers = getattr(cache, "layers", None)
        if layers is None or len(layers) != len(self.layer_types):
            raise InvalidArgumentError("expected a transformers Cache built from this model's config")
        out: list[tuple[str, torch.Tensor]] = []
        for i in self.linear_layers:
            layer = layers[i]
            convs, recs = getattr(layer, "conv_states", None), getattr(layer, "recurrent_states", None)
            if not isinstance(convs, dict) or not isinstance(recs, dict):
                raise InvalidArgumentError(f"layer {i} is not a linear-attention cache layer")
            for s in sorted(convs):
                for kind, t in (("conv", convs[s]), ("recurrent", recs.get(s))):
                    if t is None:
                        raise InvalidArgumentError(f"layer {i} has no {kind} state {s} (not prefilled?)",
                                                   hint="prefill the prompt before capturing its state")
                    if not 0 <= batch_index < int(t.shape[0]):
                        raise InvalidArgumentError(f"batch_index {batch_index} outside batch of {int(t.shape[0])}")
                    out.append((f"{i}.{s}.{kind}", t[batch_index: batch_index + 1]))
        return out

    def state_bytes(self, cache: Any, *, batch_index: int = 0) -> bytes:
        """Every linear layer's conv and recurrent state of one batch row, as one blob (the
        anchor).  Call it right after the forward that ended at the anchor page."""
        return _serialize_state(self._state_tensors(cache, batch_index), self._model_digest())

    def _model_digest(self) -> str:
        """What shapes the state: the layer types and the config's state fields (no dtype)."""
        cfg = self.config.get_text_config(decoder=True) if hasattr(self.config, "get_text_config") else self.config
        # the fields that shape the state: Gated DeltaNet (Qwen3-Next) and Mamba/Mamba2 (Bamba,
        # Jamba, GraniteMoeHybrid) spell them differently; a field the config lacks is left out
        fields = {k: v for k in _STATE_FIELDS if (v := getattr(cfg, k, None)) is not None}
        return hashlib.blake2b(json.dumps([self.layer_types, fields], sort_keys=True).encode(),
                               digest_size=8).hexdigest()

    def state_format(self, dtype: str) -> str:
        """A format string for ``Salt(state_format=)``: the state's layout and dtype, so an anchor
        of another model shape or dtype can never be taken for this one."""
        return f"hf-linear-attn/v1:{dtype}:{self._model_digest()}"

    def _parse_state(self, blob: object) -> list[tuple[str, str, list[int], memoryview]]:
        mv = memoryview(blob).cast("B")  # type: ignore[arg-type]
        if mv.nbytes < _STATE_HEAD.size:
            raise InvalidArgumentError("not a hybrid state blob (too short)")
        magic, hlen = _STATE_HEAD.unpack_from(mv)
        if magic != _STATE_MAGIC or _STATE_HEAD.size + hlen > mv.nbytes:
            raise InvalidArgumentError("not a hybrid state blob (bad header)",
                                       hint="pass the anchor written by HybridCacheMap.state_bytes")
        from hostkv_providers._layout import DTYPE_ITEMSIZE

        try:
            head = json.loads(bytes(mv[_STATE_HEAD.size: _STATE_HEAD.size + hlen]))
            desc = head["tensors"]
            model = head.get("model")  # (blobs written before it was recorded have none)
            entries = [(str(name), str(dtype), [int(d) for d in shape]) for name, dtype, shape in desc]
            for name, _dtype, _shape in entries:
                li_s, s_s, kind = name.split(".")
                if kind not in ("conv", "recurrent") or int(li_s) < 0 or int(s_s) < 0:
                    raise ValueError(f"tensor name {name!r}")
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise InvalidArgumentError(f"hybrid state blob: unreadable descriptor ({exc})") from exc
        if model is not None and model != self._model_digest():
            # the state of another model shape: lazy_initialization would take any tensor
            raise InvalidArgumentError("the state blob was written for a model of another shape",
                                       hint="the anchor belongs to another model (check Salt.state_format)")
        pos = _STATE_HEAD.size + hlen
        out = []
        for name, dtype, shape in entries:
            n = DTYPE_ITEMSIZE.get(dtype, 0) * int(_prod(shape))
            if not n or min(shape) < 0 or pos + n > mv.nbytes:
                raise InvalidArgumentError(f"hybrid state blob: tensor {name} ({dtype}{shape}) is truncated")
            out.append((name, dtype, shape, mv[pos: pos + n]))
            pos += n
        if pos != mv.nbytes:
            raise InvalidArgumentError("hybrid state blob: trailing bytes")
        expect = {f"{i}.0.{k}" for i in self.linear_layers for k in ("conv", "recurrent")}
        if not expect <= {name for name, *_ in out}:
            raise InvalidArgumentError("the state blob does not hold every linear layer of this model",
                                       hint="the anchor belongs to another model (check Salt.state_format)")
        return out

    def load_state(self, cache: Any, blob: object, *, device: object = "cpu") -> None:
        """Install a state blob (from :meth:`state_bytes`) into ``cache``'s linear layers, marking
        them as holding a previous state (so the next forward continues it, not restarts)."""
        import torch

        from hostkv_providers.cache._kvmap import _torch_dtype

        layers = getattr(cache, "layers", None)
        if layers is None or len(layers) != len(self.layer_types):
            raise InvalidArgumentError("expected a transformers Cache built from this model's config")
        for name, dtype, shape, raw in self._parse_state(blob):
            li_s, s_s, kind = name.split(".")
            li, s = int(li_s), int(s_s)
            if li not in self.linear_layers:
                raise InvalidArgumentError(f"state for layer {li}, which is not a linear layer of this model")
            t = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(_torch_dtype(dtype)).reshape(shape)
            t = t.to(device)  # type: ignore[call-overload]
            layer = layers[li]
            if kind == "conv":
                layer.lazy_initialization(conv_states=t, state_idx=s, conv_kernel_size=int(shape[-1]))
                layer.conv_states[s].copy_(t)
                layer.has_previous_state[s] = True
            else:
                layer.lazy_initialization(recurrent_states=t, state_idx=s)
                layer.recurrent_states[s].copy_(t)

    def to_dynamic_cache(self, planes: Sequence[torch.Tensor], state: object, *,
                         dtype: torch.dtype | None = None, device: object = "cpu") -> Any:
        """A ``DynamicCache`` for this model holding the restored pages and the state after the
        last of them.  ``state`` is required: KV pages without their state would make the model
        continue from a zero state (wrong tokens, silently)."""
        from transformers import DynamicCache

        if state is None:
            raise InvalidArgumentError("a hybrid cache needs the state of its last restored page",
                                       hint="use RestoreResult.anchors from a cache with required_anchors=")
        cache: Any = DynamicCache(config=self.config)
        pairs = self.unpack(planes, dtype=dtype)
        for li, (k, v) in zip(self.attention_layers, pairs, strict=True):
            cache.layers[li].update(k.to(device), v.to(device))  # type: ignore[call-overload]
        self.load_state(cache, state, device=device)
        return cache

    # -- prefill with interval anchors -------------------------------------------------------------
    def prefill(self, model: Any, input_ids: torch.Tensor, anchor_pages: Iterable[int], *,
                cache: Any = None, start_page: int = 0, single_pass: bool | None = None,
                **forward_kw: Any) -> tuple[Any, Any, dict[int, bytes]]:
        """Prefill ``input_ids`` (continuing ``cache``, which holds ``start_page`` pages, or from
        scratch), capturing the state after each of ``anchor_pages`` (absolute depths, e.g. from
        ``anchor_depths``).

        Returns ``(output, cache, {depth: state blob})``: pass the blobs to
        ``HostKVCache.save(..., anchors={depth - start_page: {"state": blob}})``.  ``output`` is
        the model's output over all of ``input_ids`` in a single pass, over the last segment
        when split (its last position's logits are the same either way).

        ``single_pass`` (default: where the model supports it) runs *one* forward over all the
        tokens and takes the states at the anchor pages from inside it: the linear layers' scan
        (``torch_chunk_gated_delta_rule``) is run segment by segment with its state carried —
        the same calls a split prefill makes — and the conv state at a cut is a slice of the conv
        input; attention, MLP/MoE and the head run once.  Otherwise (``single_pass=False``, or a
        model module without those functions) the prefill is split into one forward per segment,
        which costs one forward's fixed overhead per anchor (docs/benchmarks.md, "hybrid").
        """
        from transformers import DynamicCache

        pt = self.layout.page_tokens
        total = int(input_ids.shape[-1])
        cuts = sorted({(p + 1 - start_page) * pt for p in anchor_pages})
        if any(c <= 0 or c > total for c in cuts):
            raise InvalidArgumentError(f"anchor pages {sorted(anchor_pages)} outside the tokens given "
                                       f"(pages {start_page}..{start_page + total // pt - 1})")
        if cache is None:
            if start_page:
                raise InvalidArgumentError("start_page > 0 needs the cache holding those pages")
            cache = DynamicCache(config=self.config)
        else:
            # the states are labelled by depth from start_page: a cache holding any other number
            # of tokens would have them saved (and later restored) at the wrong token count
            tokens = self._cache_tokens(cache)
            if tokens != start_page * pt:
                raise InvalidArgumentError(f"the cache holds {tokens} tokens, start_page {start_page} says "
                                           f"{start_page * pt}", hint="continue from a cache of whole pages")
        module = sys.modules.get(type(model).__module__)
        if single_pass is None:
            single_pass = _ScanCapture.supports(module)
        elif single_pass and not _ScanCapture.supports(module):
            raise InvalidArgumentError(f"{type(model).__name__}'s module has no torch_chunk_gated_delta_rule / "
                                       "causal_conv1d_fn to capture states from", hint="single_pass=False")
        import torch

        if single_pass and cuts:
            assert module is not None
            # an inference prefill: no autograd graph (the states are copied out anyway)
            with _ScanCapture(module, [c for c in cuts if c < total], total) as cap, torch.no_grad():
                out = model(input_ids=input_ids, cache=cache, use_cache=True, **forward_kw)
            cache = out.past_key_values
            states = {start_page + c // pt - 1: self._captured_blob(cap, c) for c in cuts if c < total}
            if total in cuts:
                states[start_page + total // pt - 1] = self.state_bytes(cache)
            return out, cache, states
        bounds = [0, *[c for c in cuts if c < total], total]
        states = {}
        out = None
        for lo, hi in itertools.pairwise(bounds):
            if hi <= lo:
                continue
            with torch.no_grad():
                out = model(input_ids=input_ids[:, lo:hi], cache=cache, use_cache=True, **forward_kw)
            cache = out.past_key_values
            if hi in cuts:
                states[start_page + hi // pt - 1] = self.state_bytes(cache)
        return out, cache, states

    def _captured_blob(self, cap: _ScanCapture, cut: int) -> bytes:
        if len(cap.conv) != len(self.linear_layers) or len(cap.rec) != len(self.linear_layers):
            raise InvalidArgumentError(
                f"captured {len(cap.conv)} conv / {len(cap.rec)} scan calls for "
                f"{len(self.linear_layers)} linear layers",
                hint="this model's linear layers call the scan differently: prefill(..., single_pass=False)")
        parts: list[tuple[str, torch.Tensor]] = []
        for li, conv, rec in zip(self.linear_layers, cap.conv, cap.rec, strict=True):
            parts.append((f"{li}.0.conv", conv[cut][0:1]))
            parts.append((f"{li}.0.recurrent", rec[cut][0:1]))
        return _serialize_state(parts, self._model_digest())


def _serialize_state(parts: Sequence[tuple[str, torch.Tensor]], model: str) -> bytes:
    import torch

    desc = [[name, plane_dtype_name(t), list(t.shape)] for name, t in parts]
    head = json.dumps({"v": 1, "model": model, "tensors": desc}, separators=(",", ":")).encode()
    raw = [t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy() for _n, t in parts]
    out = bytearray(_STATE_HEAD.size + len(head) + sum(r.nbytes for r in raw))
    _STATE_HEAD.pack_into(out, 0, _STATE_MAGIC, len(head))
    pos = _STATE_HEAD.size
    out[pos: pos + len(head)] = head
    pos += len(head)
    for r in raw:
        out[pos: pos + r.nbytes] = r.data  # one copy of each tensor into the blob
        pos += r.nbytes
    return bytes(out)


_capture_lock = threading.Lock()
_capture_installs: dict[str, tuple[Any, int]] = {}  # module name -> (its originals, users)
_capture_local = threading.local()


class _ScanCapture:
    """During one forward on this thread: run each linear layer's chunked scan segment by
    segment (ending at ``cuts``) with its state carried, and record the recurrent state and the
    conv state at each cut.  The module's functions are wrapped while any capture is active;
    the wrappers pass every other call (other threads, decode steps) straight through."""

    _NAMES = ("torch_chunk_gated_delta_rule", "causal_conv1d_fn")

    @classmethod
    def supports(cls, module: Any) -> bool:
        return module is not None and all(callable(getattr(module, n, None)) for n in cls._NAMES)

    def __init__(self, module: Any, cuts: list[int], total: int) -> None:
        self.module, self.cuts, self.total = module, cuts, total
        self.conv: list[dict[int, torch.Tensor]] = []
        self.rec: list[dict[int, torch.Tensor]] = []

    def __enter__(self) -> _ScanCapture:
        if getattr(_capture_local, "active", None) is not None:
            raise InvalidArgumentError("a state-capturing prefill is already running on this thread")
        name = self.module.__name__
        with _capture_lock:
            got = _capture_installs.get(name)
            if got is None:
                orig = {n: getattr(self.module, n) for n in self._NAMES}
                self.module.torch_chunk_gated_delta_rule = _wrap_scan(orig["torch_chunk_gated_delta_rule"])
                self.module.causal_conv1d_fn = _wrap_conv(orig["causal_conv1d_fn"])
                _capture_installs[name] = (orig, 1)
            else:
                _capture_installs[name] = (got[0], got[1] + 1)
        _capture_local.active = self
        return self

    def __exit__(self, *exc: object) -> None:
        _capture_local.active = None
        name = self.module.__name__
        with _capture_lock:
            orig, users = _capture_installs[name]
            if users == 1:
                for n, f in orig.items():
                    setattr(self.module, n, f)
                del _capture_installs[name]
            else:
                _capture_installs[name] = (orig, users - 1)


def _wrap_scan(orig: Any) -> Any:
    def scan(query: Any, key: Any, value: Any, *args: Any, **kw: Any) -> Any:
        cap = getattr(_capture_local, "active", None)
        if cap is None or args or int(query.shape[1]) != cap.total:
            return orig(query, key, value, *args, **kw)
        import torch

        g, beta = kw.pop("g"), kw.pop("beta")
        state = kw.pop("initial_state", None)
        want_final = kw.pop("output_final_state", False)
        outs, states = [], {}
        for lo, hi in itertools.pairwise([0, *cap.cuts, cap.total]):
            o, state = orig(query[:, lo:hi], key[:, lo:hi], value[:, lo:hi], g=g[:, lo:hi], beta=beta[:, lo:hi],
                            initial_state=state, output_final_state=True, **kw)
            outs.append(o)
            if hi < cap.total:
                states[hi] = state.clone()
        cap.rec.append(states)
        return torch.cat(outs, dim=1), (state if want_final else None)

    return scan


def _wrap_conv(orig: Any) -> Any:
    def conv(hidden_states: Any, *args: Any, **kw: Any) -> Any:
        cap = getattr(_capture_local, "active", None)
        if cap is not None and int(hidden_states.shape[-1]) >= cap.total:
            import torch

            k = int(args[0].shape[-1]) if args else int(kw["weight"].shape[-1])
            prev = int(hidden_states.shape[-1]) - cap.total  # the conv state prepended (or padding)
            states = {}
            for c in cap.cuts:
                end = prev + c
                window = hidden_states[..., max(0, end - k): end]
                if window.shape[-1] < k:
                    window = torch.nn.functional.pad(window, (k - int(window.shape[-1]), 0))
                states[c] = window.clone()
            cap.conv.append(states)
        return orig(hidden_states, *args, **kw)

    return conv


def _prod(shape: Iterable[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
