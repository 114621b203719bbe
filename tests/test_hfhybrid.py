"""HybridCacheMap: a Qwen3-Next cache's attention KV as pages and its conv/recurrent state as an
anchor, both directions, through a real HostKVCache (trap 1 of issue 17), and the plain-lookup
trap end to end (trap 2: restoring pages without the state gave 0/32 correct tokens)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")
_tf = pytest.importorskip("transformers")
if int(_tf.__version__.split(".")[0]) < 5:
    pytest.skip("HybridCacheMap maps transformers 5.x hybrid cache layers", allow_module_level=True)
sys.modules.setdefault("torchvision", None)  # type: ignore[arg-type]  # see examples/hybrid_restore
try:
    from transformers import DynamicCache, Qwen3NextConfig, Qwen3NextForCausalLM
except ImportError:  # pragma: no cover - an older transformers
    pytest.skip("this transformers has no Qwen3-Next", allow_module_level=True)

from hostkv_providers import InvalidArgumentError, KVLayout, PinnedProvider, Salt  # noqa: E402
from hostkv_providers.cache import HFCacheMap, HostKVCache, HybridCacheMap, prefill_pages_cap  # noqa: E402
from hostkv_providers.device import CpuCopyEngine, OrdinaryAllocator  # noqa: E402

PT = 8
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, page_tokens=PT, dtype="float32")


@pytest.fixture(scope="module")
def model() -> Any:
    cfg = Qwen3NextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"])
    torch.manual_seed(0)
    m = Qwen3NextForCausalLM(cfg).eval()
    with torch.no_grad():  # sensitive to the state (see examples/hybrid_restore)
        for name, p in m.named_parameters():
            if "linear_attn.out_proj" in name or "linear_attn.in_proj" in name:
                p.mul_(4.0)
            if name.endswith("A_log"):
                p.fill_(-4.0)
            if name.startswith("lm_head"):
                p.mul_(8.0)
    return m


def run(m: Any, ids: Any, cache: Any) -> tuple[Any, Any]:
    with torch.no_grad():
        out = m(input_ids=ids, cache=cache, use_cache=True)
    return out.logits[0, -1], out.past_key_values


def greedy(m: Any, logits: Any, cache: Any, n: int = 8) -> list[int]:
    toks = []
    for _ in range(n):
        toks.append(int(logits.argmax()))
        logits, cache = run(m, torch.tensor([[toks[-1]]]), cache)
    return toks


@pytest.fixture
def cache() -> Iterator[HostKVCache]:
    p = PinnedProvider(1 << 22, block=LAYOUT.page_nbytes, allocator=OrdinaryAllocator())
    e = CpuCopyEngine()
    salt = Salt("test/qwen3next", LAYOUT, state_format="hf-linear-attn/v1:float32:test")
    c = HostKVCache(p, salt, e, required_anchors={"state"}, anchor_interval=2, staging_allocator=OrdinaryAllocator())
    yield c
    c.close()
    e.close()
    p.close()


def test_plain_map_refuses_hybrid_caches_with_a_hint(model: Any) -> None:
    _l, past = run(model, torch.randint(0, 256, (1, 16)), None)
    with pytest.raises(InvalidArgumentError, match=r"hybrid|non-attention"):
        HFCacheMap(LAYOUT).pack(past)
    with pytest.raises(InvalidArgumentError, match=r"hybrid|non-attention"):
        HFCacheMap(LAYOUT).to_dynamic_cache(HFCacheMap(LAYOUT).empty_planes(1), config=model.config)
    with pytest.raises(InvalidArgumentError, match="attention layers"):
        HybridCacheMap(KVLayout(num_layers=4, num_kv_heads=2, head_dim=16, page_tokens=PT, dtype="float32"),
                       model.config)


def test_state_round_trip_and_refusals(model: Any) -> None:
    hm = HybridCacheMap(LAYOUT, model.config)
    assert (hm.attention_layers, hm.linear_layers) == ([1, 3], [0, 2])
    _l, past = run(model, torch.randint(0, 256, (1, 24)), None)
    blob = hm.state_bytes(past)
    again = DynamicCache(config=model.config)
    hm.load_state(again, blob)
    for i in hm.linear_layers:
        assert torch.equal(again.layers[i].conv_states[0], past.layers[i].conv_states[0])
        assert torch.equal(again.layers[i].recurrent_states[0], past.layers[i].recurrent_states[0])
        assert again.layers[i].has_previous_state[0]
    assert len(hm.pack(past)) == 4 and hm.num_pages(past) == 3
    with pytest.raises(InvalidArgumentError, match="needs the state"):
        hm.to_dynamic_cache(hm.pack(past), None)
    for bad in (b"", b"HKS1" + b"\xff" * 8, blob[:-1], blob + b"x"):
        with pytest.raises(InvalidArgumentError):
            hm.load_state(DynamicCache(config=model.config), bad)
    with pytest.raises(InvalidArgumentError, match="not prefilled"):
        hm.state_bytes(DynamicCache(config=model.config))
    assert hm.state_format("float32") != hm.state_format("bfloat16")


def test_save_restore_generates_like_a_cold_prefill(model: Any, cache: HostKVCache) -> None:
    hm = HybridCacheMap(LAYOUT, model.config)
    ids = torch.randint(0, 256, (1, 8 * PT + 3), generator=torch.Generator().manual_seed(1))
    cold_logits, cold_past = run(model, ids, None)
    cold = greedy(model, cold_logits, cold_past)
    keys = cache.keys(ids[0].numpy())
    _out, past, states = hm.prefill(model, ids[:, : len(keys) * PT], [1, 3, 5, 7])
    assert sorted(states) == [1, 3, 5, 7]
    res = cache.save(keys, hm.pack(past), list(range(8)), anchors={d: {"state": s} for d, s in states.items()}).wait(30)
    assert (res.stored, res.anchors) == (8, 4)
    # trap 2: a plain lookup, no need_anchor; whatever depth it gives, the restore is exact
    for cap in (None, 6, 5):
        hit = cache.lookup(keys, max_pages=cap)
        planes = hm.empty_planes(hit.num_pages)
        rr = cache.restore(hit, planes, list(range(hit.num_pages))).wait(30)
        assert rr.pages == {None: 8, 6: 6, 5: 4}[cap]
        warm_cache = hm.to_dynamic_cache([p[: rr.pages] for p in planes], rr.anchors["state"])
        logits, wc = run(model, ids[:, rr.pages * PT:], warm_cache)
        assert greedy(model, logits, wc) == cold
    assert prefill_pages_cap(ids.shape[1], PT) == 8
    # the negative control: the same pages with no state give other tokens
    hit = cache.lookup(keys)
    planes = hm.empty_planes(8)
    cache.restore(hit, planes, list(range(8))).wait(30)
    dropped = DynamicCache(config=model.config)
    for li, (k, v) in zip(hm.attention_layers, hm.unpack(planes), strict=True):
        dropped.layers[li].update(k, v)
    logits, dc = run(model, ids[:, 8 * PT:], dropped)
    assert greedy(model, logits, dc) != cold


def test_prompt_of_exactly_full_pages_keeps_a_token(model: Any, cache: HostKVCache) -> None:
    # trap 5: a prompt of exactly N full pages hit in full left nothing to prefill (no logits)
    hm = HybridCacheMap(LAYOUT, model.config)
    ids = torch.randint(0, 256, (1, 8 * PT), generator=torch.Generator().manual_seed(2))
    keys = cache.keys(ids[0].numpy())
    _out, past, states = hm.prefill(model, ids, [1, 3, 5, 7])
    cache.save(keys, hm.pack(past), list(range(8)), anchors={d: {"state": s} for d, s in states.items()}).wait(30)
    hit = cache.lookup(keys, max_pages=prefill_pages_cap(ids.shape[1], PT))
    assert hit.num_pages == 6  # capped at 7, cut back to the anchor at page 5
    planes = hm.empty_planes(hit.num_pages)
    rr = cache.restore(hit, planes, list(range(hit.num_pages))).wait(30)
    logits, _c = run(model, ids[:, rr.pages * PT:], hm.to_dynamic_cache(planes, rr.anchors["state"]))
    cold, _p = run(model, ids, None)
    torch.testing.assert_close(logits, cold, atol=1e-4, rtol=1e-4)


def test_single_pass_prefill_captures_the_split_prefills_states(model: Any) -> None:
    # deliver 6: the interval-anchor states from one forward (the scan run segment by segment
    # inside it) equal those of one forward per segment, also continuing a restored cache; the
    # wrappers are gone afterwards and another thread's forward is untouched
    import threading

    import transformers.models.qwen3_next.modeling_qwen3_next as qmod

    hm = HybridCacheMap(LAYOUT, model.config)
    orig = (qmod.torch_chunk_gated_delta_rule, qmod.causal_conv1d_fn)
    ids = torch.randint(0, 256, (1, 7 * PT + 3), generator=torch.Generator().manual_seed(4))
    split = hm.prefill(model, ids, [1, 3, 5], single_pass=False)
    one = hm.prefill(model, ids, [1, 3, 5])  # the default where the model supports it
    assert (qmod.torch_chunk_gated_delta_rule, qmod.causal_conv1d_fn) == orig
    assert sorted(one[2]) == sorted(split[2]) == [1, 3, 5]
    # the split prefill returns the last segment's output; the single pass the whole prompt's
    torch.testing.assert_close(one[0].logits[:, -1], split[0].logits[:, -1], atol=1e-4, rtol=1e-4)

    def tensors(blob: bytes) -> list[Any]:
        return [torch.frombuffer(bytearray(raw), dtype=torch.float32) for *_n, raw in hm._parse_state(blob)]

    for d in (1, 3, 5):
        for a, b in zip(tensors(one[2][d]), tensors(split[2][d]), strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # the terminal page (a cut at the last token) and a continuation of a cache with 2 pages
    _o, past2, _s = hm.prefill(model, ids[:, : 2 * PT], [], single_pass=False)
    cont = hm.prefill(model, ids[:, 2 * PT: 6 * PT], [3, 5], cache=past2, start_page=2)
    full = hm.prefill(model, ids[:, : 6 * PT], [3, 5], single_pass=False)
    for d in (3, 5):
        for a, b in zip(tensors(cont[2][d]), tensors(full[2][d]), strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # a forward on another thread while a capture runs passes straight through the wrappers
    seen: list[Any] = []

    def other() -> None:
        seen.append(run(model, ids[:, :PT], None)[0])

    real_forward = model.forward

    def forward_with_a_twin(*a: Any, **kw: Any) -> Any:
        if threading.current_thread() is threading.main_thread() and not seen:
            t = threading.Thread(target=other)  # runs inside the capture, its forward passes through
            t.start()
            t.join()
        return real_forward(*a, **kw)

    model.forward = forward_with_a_twin
    try:
        hm.prefill(model, ids, [1, 3, 5])
    finally:
        del model.forward
    torch.testing.assert_close(seen[0], run(model, ids[:, :PT], None)[0])
