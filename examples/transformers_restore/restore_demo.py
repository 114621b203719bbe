"""A real transformers model whose prompt KV survives a process restart.

Three steps, each its own process (run them in order; the store is the only thing they share):

    python restore_demo.py prefill --store lmdb:///tmp/kvdemo --out p1.json
        builds a small randomly initialised Llama (fixed seed, no downloads), prefills a
        4,100-token prompt, saves its 256 full KV pages through HostKVCache and exits.
    python restore_demo.py resume --store lmdb:///tmp/kvdemo --out p2.json
        rebuilds the same model, looks the prompt up, restores the 256 pages into a
        DynamicCache, prefills only the 4-token tail and generates; then does a cold prefill of
        the whole prompt for comparison (logits, generated tokens, time).
    python restore_demo.py fork --store lmdb:///tmp/kvdemo --out p3.json
        a second prompt sharing the first 2,048 tokens: restores the shared pages, prefills the
        rest and saves; only the new pages are stored.

Each step writes a JSON report (times, hashes of the pages, logits, tokens) to ``--out``;
``tests/test_example_model.py`` runs the three processes and checks them against each other.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import sys
import time
from typing import Any

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hostkv_providers as hk
from hostkv_providers.cache import HFCacheMap, HostKVCache, cache_layers
from hostkv_providers.device import default_copy_engine

PAGE_TOKENS = 16
PROMPT_TOKENS = 4100  # 256 full pages + a 4-token tail
FORK_SHARED = 2048  # tokens the fork prompt shares with the first one (128 pages)
GEN_TOKENS = 16
SEED = 0


def build_model(hidden: int, layers: int) -> LlamaForCausalLM:
    """A small Llama with random weights; the same seed gives the same weights in every process."""
    cfg = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1000,
        max_position_embeddings=8192,
        attn_implementation="sdpa",
    )  # type: ignore[call-arg]
    torch.manual_seed(SEED)
    model: LlamaForCausalLM = LlamaForCausalLM(cfg)
    model.eval()  # type: ignore[no-untyped-call]
    # One short pass first, so one-time costs (kernel selection, lazy init) are not timed below.
    forward(model, torch.arange(PAGE_TOKENS), None)
    return model


def weights_digest(model: torch.nn.Module) -> str:
    """A digest of the weights: part of the salt, so a different model never hits these pages."""
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:32]


def prompt(seed: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 1000, (n,), generator=g)


def fork_prompt() -> torch.Tensor:
    base = prompt(1, PROMPT_TOKENS)
    return torch.cat([base[:FORK_SHARED], prompt(2, PROMPT_TOKENS - FORK_SHARED)])


def layout_of(model: LlamaForCausalLM) -> hk.KVLayout:
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    return hk.KVLayout(num_layers=cfg.num_hidden_layers, num_kv_heads=int(cfg.num_key_value_heads or 0),
                       head_dim=head_dim, page_tokens=PAGE_TOKENS, dtype="float32")


def open_cache(model: LlamaForCausalLM, store: str) -> tuple[hk.Provider, HostKVCache]:
    provider = hk.open(store)
    salt = hk.Salt("examples/tiny-llama-random", layout_of(model), model_revision=weights_digest(model))
    return provider, HostKVCache(provider, salt, default_copy_engine())


_CACHE_KW = "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"


def forward(model: LlamaForCausalLM, ids: torch.Tensor, cache: Any) -> tuple[torch.Tensor, Any]:
    """One forward pass over ``ids`` (1-D) continuing ``cache``; returns last logits and the cache."""
    kwargs: dict[str, Any] = {"input_ids": ids[None], "use_cache": True}
    if cache is not None:
        kwargs[_CACHE_KW] = cache
    with torch.no_grad():
        out = model(**kwargs)
    new_cache = getattr(out, "cache", None)
    if new_cache is None:
        new_cache = out.past_key_values
    return out.logits[0, -1].float(), new_cache


def greedy(model: LlamaForCausalLM, logits: torch.Tensor, cache: Any, n: int) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        nxt = int(torch.argmax(logits))
        out.append(nxt)
        logits, cache = forward(model, torch.tensor([nxt]), cache)
    return out


def page_hashes(planes: list[torch.Tensor], n: int) -> list[str]:
    """SHA-256 of each packed page (its plane slices in layout order) — the stored bytes."""
    return [hashlib.sha256(b"".join(p[i].contiguous().numpy().tobytes() for p in planes)).hexdigest()
            for i in range(n)]


def cmd_prefill(args: argparse.Namespace) -> dict[str, Any]:
    model = build_model(args.hidden, args.layers)
    ids = prompt(1, PROMPT_TOKENS)
    t0 = time.perf_counter()
    logits, kv = forward(model, ids, None)
    prefill_s = time.perf_counter() - t0
    provider, cache = open_cache(model, args.store)
    with provider, cache:
        kvmap = HFCacheMap(cache.layout)
        keys = cache.keys(ids.numpy())
        planes = kvmap.pack(kv, num_pages=len(keys))
        t0 = time.perf_counter()
        res = cache.save(keys, planes, list(range(len(keys)))).wait(600)
        save_s = time.perf_counter() - t0
        stats = provider.stats()
    return {"pages": len(keys), "prefill_s": prefill_s, "save_s": save_s, "stored": res.stored,
            "dedup": res.dedup, "saved_nbytes": res.nbytes, "page_hashes": page_hashes(planes, len(keys)),
            "logits": logits.tolist(), "entries": stats.entries}


def cmd_resume(args: argparse.Namespace) -> dict[str, Any]:
    model = build_model(args.hidden, args.layers)
    ids = prompt(1, PROMPT_TOKENS)
    provider, cache = open_cache(model, args.store)
    with provider, cache:
        kvmap = HFCacheMap(cache.layout)
        keys = cache.keys(ids.numpy())
        t0 = time.perf_counter()
        hit = cache.lookup(keys)
        lookup_s = time.perf_counter() - t0
        planes = kvmap.empty_planes(hit.num_pages)
        t1 = time.perf_counter()
        res = cache.restore(hit, planes, list(range(hit.num_pages))).wait(600)
        restore_s = time.perf_counter() - t1
        restored = kvmap.to_dynamic_cache(planes, config=model.config)
        stored_hashes = [hashlib.sha256(provider.read_bytes(k) or b"").hexdigest() for k in keys[: hit.num_pages]]
        t2 = time.perf_counter()
        logits, kv = forward(model, ids[hit.num_tokens :], restored)
        tail_s = time.perf_counter() - t2
        warm_total_s = time.perf_counter() - t0
        warm_tokens = greedy(model, logits, kv, GEN_TOKENS)
        cache_stats = cache.stats()
    t3 = time.perf_counter()
    cold_logits, cold_kv = forward(model, ids, None)
    cold_s = time.perf_counter() - t3
    cold_tokens = greedy(model, cold_logits, cold_kv, GEN_TOKENS)
    # the restored K/V against the cold prefill's K/V of the same prefix
    n_tok = hit.num_tokens
    kv_diff = max(float((a[0][:, :, :n_tok] - b[0][:, :, :n_tok]).abs().max()) for a, b in
                  zip(cache_layers(restored), cache_layers(cold_kv), strict=True))
    return {"hit_pages": hit.num_pages, "hit_tokens": hit.num_tokens, "restored_pages": res.pages,
            "restored_nbytes": res.nbytes, "viewed": res.viewed, "staged": res.staged,
            "page_hashes": page_hashes(planes, hit.num_pages), "stored_hashes": stored_hashes,
            "lookup_s": lookup_s, "restore_s": restore_s, "tail_prefill_s": tail_s, "warm_total_s": warm_total_s,
            "cold_prefill_s": cold_s, "logits": logits.tolist(), "cold_logits": cold_logits.tolist(),
            "max_logit_diff": float((logits - cold_logits).abs().max()), "prefix_kv_max_diff": kv_diff,
            "warm_tokens": warm_tokens, "cold_tokens": cold_tokens, "bytes_in": cache_stats.bytes_in}


def cmd_fork(args: argparse.Namespace) -> dict[str, Any]:
    model = build_model(args.hidden, args.layers)
    ids = fork_prompt()
    provider, cache = open_cache(model, args.store)
    with provider, cache:
        kvmap = HFCacheMap(cache.layout)
        keys = cache.keys(ids.numpy())
        seals0 = provider.stats().seals
        hit = cache.lookup(keys)
        planes = kvmap.empty_planes(hit.num_pages)
        cache.restore(hit, planes, list(range(hit.num_pages))).wait(600)
        restored = kvmap.to_dynamic_cache(planes, config=model.config)
        _logits, kv = forward(model, ids[hit.num_tokens :], restored)
        # save only the new pages: a continuation of the restored chain
        new = keys[hit.num_pages :]
        new_planes = kvmap.pack(kv, start_page=hit.num_pages, num_pages=len(new))
        res = cache.save(new, new_planes, list(range(len(new))), parent=keys[hit.num_pages - 1],
                         start_page=hit.num_pages).wait(600)
        # saving the whole chain again is a no-op: every page is deduplicated, nothing is copied
        full = kvmap.pack(kv, num_pages=len(keys))
        again = cache.save(keys, full, list(range(len(keys)))).wait(600)
        stats = provider.stats()
        seals = stats.seals - seals0
        present = provider.longest_prefix(keys)
    return {"pages": len(keys), "hit_pages": hit.num_pages, "stored": res.stored, "dedup": res.dedup,
            "saved_nbytes": res.nbytes, "again_stored": again.stored, "again_dedup": again.dedup,
            "again_nbytes": again.nbytes, "seals": seals, "longest_prefix": present, "entries": stats.entries}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("step", choices=("prefill", "resume", "fork"))
    ap.add_argument("--store", required=True, help="provider URL, e.g. lmdb:///tmp/kvdemo")
    ap.add_argument("--out", help="write the JSON report here (default: stdout)")
    ap.add_argument("--hidden", type=int, default=64, help="hidden size (head_dim = hidden / 4)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    np.random.seed(SEED)
    report = {"prefill": cmd_prefill, "resume": cmd_resume, "fork": cmd_fork}[args.step](args)
    text = json.dumps(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    else:
        print(text)
    summary = {k: v for k, v in report.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    print(f"{args.step}: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                      for k, v in summary.items()), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
