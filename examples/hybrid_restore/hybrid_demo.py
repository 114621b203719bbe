"""A hybrid model (Qwen3-Next: Gated DeltaNet + full attention) whose prompt survives a restart.

Three steps, each its own process (the store is the only thing they share):

    python hybrid_demo.py prefill --store lmdb:///tmp/hydemo --out p1.json
        builds a tiny randomly initialised Qwen3-Next (4 layers: linear, full, linear, full; fixed
        seed, no downloads), prefills a 132-token prompt capturing the state at the interval
        anchor pages (every 2 pages) in one forward, saves its 8 full KV pages with the recurrent
        state at pages 1, 3, 5, 7, and times that prefill (and the older split one, a forward per
        segment) against a plain forward.
    python hybrid_demo.py resume --store lmdb:///tmp/hydemo --out p2.json
        rebuilds the model, looks the prompt up (capped so >= 1 token is left to prefill),
        restores pages + state, prefills the tail and generates 16 tokens; then a cold prefill of
        the whole prompt for comparison, and two negative controls: the same pages with the state
        dropped, and with the state of an earlier page — both must change the output.
    python hybrid_demo.py fork --store lmdb:///tmp/hydemo --out p3.json
        a prompt sharing the first 5 pages: the hit is cut back to the interval anchor at page 3
        (page 4 is stored but has no state), the rest is prefilled and only new pages are stored.

``tests/test_example_hybrid.py`` runs the three processes and checks them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from typing import Any

# This example needs no vision code; a torchvision wheel built for another torch breaks
# ``import transformers``' model classes, so keep it out (before transformers is imported).
sys.modules.setdefault("torchvision", None)  # type: ignore[arg-type]

import torch  # noqa: E402
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM  # noqa: E402

import hostkv_providers as hk  # noqa: E402
from hostkv_providers.cache import HostKVCache, HybridCacheMap, anchor_depths, prefill_pages_cap  # noqa: E402
from hostkv_providers.device import default_copy_engine  # noqa: E402

PAGE_TOKENS = 16
PROMPT_TOKENS = 132  # 8 full pages + a 4-token tail
FORK_SHARED_PAGES = 5  # the fork shares pages 0..4; the deepest anchor among them is page 3
ANCHOR_INTERVAL = 2
GEN_TOKENS = 16
VOCAB = 512
SEED = 0


def build_model() -> Qwen3NextForCausalLM:
    """The tiny model; the same seed gives the same weights in every process.

    Made *sensitive* to the recurrent state: with the stock init a restore that dropped the
    state still produced the same tokens (the linear layers barely mattered), so the linear
    attention projections are scaled up, the state decays slowly (it remembers the prompt) and
    the logits are sharpened.  ``resume`` asserts that a dropped or stale state changes output.
    """
    cfg = Qwen3NextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, max_position_embeddings=4096,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    )
    torch.manual_seed(SEED)
    model = Qwen3NextForCausalLM(cfg)
    model.eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "linear_attn.out_proj" in name or "linear_attn.in_proj" in name:
                p.mul_(4.0)
            if name.endswith("A_log"):
                p.fill_(-4.0)
            if name.startswith("lm_head"):
                p.mul_(8.0)
    forward(model, torch.arange(PAGE_TOKENS), None)  # one-time costs are not timed below
    return model


def weights_digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:32]


def prompt(seed: int, n: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def fork_prompt() -> torch.Tensor:
    shared = FORK_SHARED_PAGES * PAGE_TOKENS
    return torch.cat([prompt(1, PROMPT_TOKENS)[:shared], prompt(2, PROMPT_TOKENS - shared)])


def forward(model: Any, ids: torch.Tensor, cache: Any) -> tuple[torch.Tensor, Any]:
    with torch.no_grad():
        out = model(input_ids=ids[None], cache=cache, use_cache=True)
    return out.logits[0, -1].float(), out.past_key_values


def greedy(model: Any, logits: torch.Tensor, cache: Any, n: int = GEN_TOKENS) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        out.append(int(torch.argmax(logits)))
        logits, cache = forward(model, torch.tensor([out[-1]]), cache)
    return out


# -- the integrator's glue: everything a hybrid engine needs from hostkv-providers -------------
def open_cache(model: Any, store: str) -> tuple[hk.Provider, HostKVCache, HybridCacheMap]:
    layout = hk.KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, page_tokens=PAGE_TOKENS, dtype="float32")
    hmap = HybridCacheMap(layout, model.config)
    salt = hk.Salt("examples/tiny-qwen3-next", layout, model_revision=weights_digest(model),
                   state_format=hmap.state_format("float32"))
    provider = hk.open(store)
    cache = HostKVCache(provider, salt, default_copy_engine(), anchor_interval=ANCHOR_INTERVAL,
                        required_anchors={"state"})
    return provider, cache, hmap


def save_prompt(model: Any, cache: HostKVCache, hmap: HybridCacheMap, ids: torch.Tensor, *,
                past: Any = None, start_page: int = 0) -> tuple[torch.Tensor, Any, Any]:
    """Prefill ``ids`` (after ``start_page`` restored pages in ``past``) capturing the state at
    the anchor pages, and save the new pages with their anchors."""
    keys = cache.keys(ids.numpy())
    depths = anchor_depths(cache, len(keys) - start_page, start_page=start_page)
    out, past, states = hmap.prefill(model, ids[None, start_page * PAGE_TOKENS:], depths, cache=past,
                                     start_page=start_page)
    planes = hmap.pack(past, start_page=start_page, num_pages=len(keys) - start_page)
    parent = {"parent": keys[start_page - 1], "start_page": start_page} if start_page else {}
    res = cache.save(keys[start_page:], planes, list(range(len(keys) - start_page)),
                     anchors={d - start_page: {"state": s} for d, s in states.items()}, **parent).wait(60)
    return out.logits[0, -1].float(), past, res


def restore_prompt(model: Any, cache: HostKVCache, hmap: HybridCacheMap, ids: torch.Tensor) -> tuple[int, Any]:
    """Restore the longest usable prefix of ``ids``: ``(pages, a cache the model continues)``."""
    keys = cache.keys(ids.numpy())
    hit = cache.lookup(keys, max_pages=prefill_pages_cap(len(ids), PAGE_TOKENS))
    if not hit:
        return 0, None
    planes = hmap.empty_planes(hit.num_pages)
    res = cache.restore(hit, planes, list(range(hit.num_pages))).wait(60)
    if not res.pages:
        return 0, None
    return res.pages, hmap.to_dynamic_cache([p[: res.pages] for p in planes], res.anchors["state"])
# -- end of glue ---------------------------------------------------------------------------------


def cmd_prefill(args: argparse.Namespace) -> dict[str, Any]:
    model = build_model()
    ids = prompt(1, PROMPT_TOKENS)
    provider, cache, hmap = open_cache(model, args.store)
    with provider, cache:
        # the cost of capturing interval anchors: one forward without states, the split prefill
        # (one forward per segment) and the default single pass (one forward, the states taken
        # from inside it), side by side, alternating, best of 5 (the first calls of a shape pay
        # one-time costs); benchmarks/bench_hybrid_prefill.py measures more rounds and sizes
        depths = anchor_depths(cache, PROMPT_TOKENS // PAGE_TOKENS)
        single, split, onepass = [], [], []
        for _ in range(5):
            t0 = time.perf_counter()
            forward(model, ids, None)
            single.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            hmap.prefill(model, ids[None], depths, single_pass=False)
            split.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            hmap.prefill(model, ids[None], depths)
            onepass.append(time.perf_counter() - t0)
        single_s, split_s, onepass_s = min(single), min(split), min(onepass)
        t0 = time.perf_counter()
        logits, _past, res = save_prompt(model, cache, hmap, ids)
        anchored_s = time.perf_counter() - t0
        keys = cache.keys(ids.numpy())
        anchored = [i for i, k in enumerate(keys) if "state" in provider.list_anchors(k)]
        state_nbytes = provider.list_anchors(keys[-1])["state"]
    return {"stored": res.stored, "anchors": res.anchors, "anchored_pages": anchored, "stopped": res.stopped,
            "state_nbytes": state_nbytes, "single_prefill_s": single_s, "split_prefill_s": split_s,
            "split_over_single": split_s / single_s, "onepass_prefill_s": onepass_s,
            "onepass_over_single": onepass_s / single_s, "prefill_and_save_s": anchored_s,
            "logits": logits.tolist()}


def cmd_resume(args: argparse.Namespace) -> dict[str, Any]:
    model = build_model()
    ids = prompt(1, PROMPT_TOKENS)
    provider, cache, hmap = open_cache(model, args.store)
    with provider, cache:
        keys = cache.keys(ids.numpy())
        plain = cache.lookup(keys)  # no need_anchor, no cap: still cut to an anchored page
        plain_pages = plain.num_pages
        plain.release()
        t0 = time.perf_counter()
        pages, restored = restore_prompt(model, cache, hmap, ids)
        restore_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        logits, past = forward(model, ids[pages * PAGE_TOKENS:], restored)
        tail_s = time.perf_counter() - t0
        warm = greedy(model, logits, past)
        # negative controls: the same pages without the state, and with an earlier page's state
        hit = cache.lookup(keys, max_pages=pages)
        planes = hmap.empty_planes(hit.num_pages)
        res = cache.restore(hit, planes, list(range(hit.num_pages))).wait(60)
        from transformers import DynamicCache

        dropped_cache = DynamicCache(config=model.config)
        for li, (k, v) in zip(hmap.attention_layers, hmap.unpack(planes), strict=True):
            dropped_cache.layers[li].update(k, v)
        dropped = greedy(model, *forward(model, ids[pages * PAGE_TOKENS:], dropped_cache))
        stale_blob = provider.get_anchor(keys[pages - 3], "state")  # page pages-3: an earlier anchor
        assert stale_blob is not None
        from hostkv_providers.cache import ANCHOR_HEADER_NBYTES

        stale_cache = hmap.to_dynamic_cache(planes, stale_blob[ANCHOR_HEADER_NBYTES:])
        stale = greedy(model, *forward(model, ids[pages * PAGE_TOKENS:], stale_cache))
        refused = ""
        try:
            hmap.to_dynamic_cache(planes, None)
        except hk.InvalidArgumentError as exc:
            refused = type(exc).__name__
    t0 = time.perf_counter()
    cold_logits, cold_past = forward(model, ids, None)
    cold_s = time.perf_counter() - t0
    cold = greedy(model, cold_logits, cold_past)
    return {"plain_lookup_pages": plain_pages, "pages": pages, "anchor_page": res.anchor_page,
            "restore_s": restore_s, "tail_prefill_s": tail_s, "cold_prefill_s": cold_s,
            "max_logit_diff": float((logits - cold_logits).abs().max()),
            "warm_tokens": warm, "cold_tokens": cold, "dropped_state_tokens": dropped,
            "stale_state_tokens": stale, "no_state_refused": refused}


def cmd_fork(args: argparse.Namespace) -> dict[str, Any]:
    model = build_model()
    ids = fork_prompt()
    provider, cache, hmap = open_cache(model, args.store)
    with provider, cache:
        keys = cache.keys(ids.numpy())
        stored_before = provider.present(keys)
        pages, restored = restore_prompt(model, cache, hmap, ids)
        logits, _past, res = save_prompt(model, cache, hmap, ids, past=restored, start_page=pages)
        warm = greedy(model, logits, _past)
        anchored = [i for i, k in enumerate(keys) if "state" in provider.list_anchors(k)]
    cold_logits, cold_past = forward(model, ids, None)
    return {"stored_before": stored_before, "pages": pages, "stored": res.stored, "dedup": res.dedup,
            "anchored_pages": anchored, "warm_tokens": warm, "cold_tokens": greedy(model, cold_logits, cold_past),
            "max_logit_diff": float((logits - cold_logits).abs().max())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("step", choices=["prefill", "resume", "fork"])
    ap.add_argument("--store", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    report = {"prefill": cmd_prefill, "resume": cmd_resume, "fork": cmd_fork}[args.step](args)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps({k: v for k, v in report.items() if not isinstance(v, list)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
