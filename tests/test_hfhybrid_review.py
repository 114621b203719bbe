"""Review mends of HybridCacheMap (reproduced, each failed before): load_state installed the state
of a model of another shape and raised untyped errors for a malformed descriptor; prefill took a
cache holding other than start_page pages (states labelled with the wrong depths); sliding-window
layers were paged as if they held the whole prompt."""

from __future__ import annotations

import json
import struct
import sys
from typing import Any

import pytest

torch = pytest.importorskip("torch")
sys.modules.setdefault("torchvision", None)  # type: ignore[arg-type]
from transformers import DynamicCache, Qwen3NextConfig, Qwen3NextForCausalLM  # noqa: E402

from hostkv_providers import InvalidArgumentError, KVLayout  # noqa: E402
from hostkv_providers.cache import HybridCacheMap  # noqa: E402

PT = 8
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, page_tokens=PT, dtype="float32")
TYPES = ["linear_attention", "full_attention", "linear_attention", "full_attention"]


def config(**kw: Any) -> Any:
    base = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2,
                linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=4,
                num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                layer_types=TYPES)
    base.update(kw)
    return Qwen3NextConfig(**base)


def test_load_state_refuses_the_state_of_another_model_shape() -> None:
    cfg_a, cfg_b = config(), config(linear_conv_kernel_dim=3, linear_num_value_heads=8)
    torch.manual_seed(0)
    mb = Qwen3NextForCausalLM(cfg_b).eval()
    with torch.no_grad():
        past_b = mb(input_ids=torch.randint(0, 256, (1, 16)), use_cache=True).past_key_values
    blob_b = HybridCacheMap(LAYOUT, cfg_b).state_bytes(past_b)
    hm_a = HybridCacheMap(LAYOUT, cfg_a)
    assert hm_a.state_format("float32") != HybridCacheMap(LAYOUT, cfg_b).state_format("float32")
    target = DynamicCache(config=cfg_a)
    with pytest.raises(InvalidArgumentError):
        hm_a.load_state(target, blob_b)  # accepted today: model B's state is now in model A's cache


def _blob(desc: object) -> bytes:
    head = json.dumps({"v": 1, "tensors": desc}).encode()
    return struct.pack("<4sI", b"HKS1", len(head)) + head


@pytest.mark.parametrize("desc", [[["0.0.conv", "float32"]], 5], ids=["two-field-entry", "tensors-not-a-list"])
def test_malformed_state_descriptor_is_a_typed_error(desc: object) -> None:
    cfg = config()
    with pytest.raises(InvalidArgumentError):  # ValueError / TypeError today
        HybridCacheMap(LAYOUT, cfg).load_state(DynamicCache(config=cfg), _blob(desc))


def test_prefill_refuses_a_cache_that_does_not_hold_start_page_pages() -> None:
    m = model(config())
    hm = HybridCacheMap(LAYOUT, m.config)
    ids = torch.randint(0, 256, (1, 8 * PT), generator=torch.Generator().manual_seed(4))
    _o, past, _s = hm.prefill(m, ids[:, : 2 * PT + 3], [], single_pass=False)  # 2 pages + 3 tokens
    assert int(past.layers[1].keys.shape[-2]) == 2 * PT + 3
    try:
        _o, _p, states = hm.prefill(m, ids[:, 2 * PT + 3: 6 * PT + 3], [3, 5], cache=past, start_page=2,
                                    single_pass=False)
    except InvalidArgumentError:
        return
    right = hm.prefill(m, ids[:, : 6 * PT], [3, 5], single_pass=False)[2]
    pytest.fail(f"accepted: states {sorted(states)} returned for pages 3, 5 but taken after 35 and 51 tokens; "
                f"same bytes as the true page-3 state: {states[3] == right[3]}")


def model(cfg: Any) -> Any:
    torch.manual_seed(0)
    return Qwen3NextForCausalLM(cfg).eval()


def test_a_state_blob_written_before_the_model_digest_still_loads() -> None:
    """Blobs stored before the descriptor carried the model's digest load as they did."""
    cfg = config()
    m = model(cfg)
    hm = HybridCacheMap(LAYOUT, cfg)
    with torch.no_grad():
        past = m(input_ids=torch.randint(0, 256, (1, 16)), use_cache=True).past_key_values
    blob = hm.state_bytes(past)
    (hlen,) = struct.unpack_from("<I", blob, 4)
    head = json.loads(blob[8: 8 + hlen])
    assert head.pop("model") == hm._model_digest()
    new_head = json.dumps(head, separators=(",", ":")).encode()
    old = struct.pack("<4sI", b"HKS1", len(new_head)) + new_head + blob[8 + hlen:]
    target = DynamicCache(config=cfg)
    hm.load_state(target, old)
    assert torch.equal(target.layers[0].recurrent_states[0], past.layers[0].recurrent_states[0])


@pytest.mark.parametrize("windowed", ["sliding_attention", "chunked_attention"])
def test_windowed_attention_layers_are_refused(windowed: str) -> None:
    """transformers keeps only the window's latest tokens in such a layer: its index 0 is not
    token 0, so packing it by position saved the prompt's tail under the first page's key."""
    cfg = config(num_hidden_layers=2, layer_types=["linear_attention", windowed])
    with pytest.raises(InvalidArgumentError, match="window"):
        HybridCacheMap(KVLayout(num_layers=1, num_kv_heads=2, head_dim=16, page_tokens=PT, dtype="float32"), cfg)
