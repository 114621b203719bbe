"""HybridCacheMap on a Mamba2 hybrid (Bamba: Mamba2 mixers beside full attention), not only on
Qwen3-Next's Gated DeltaNet: a tiny random-init Bamba saved through HostKVCache to lmdb://, restored
in a fresh process, generation identical to a cold prefill; negative controls (the same pages with
the state dropped, or with an earlier page's state) change the output, so the state is what made
the restore right.

Run as a script (``python test_hfhybrid_mamba.py resume STORE OUT``) it is that fresh process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

if __name__ != "__main__":
    import pytest

    pytest.importorskip("torch")
    _tf = pytest.importorskip("transformers")
    if int(_tf.__version__.split(".")[0]) < 5:
        pytest.skip("HybridCacheMap maps transformers 5.x hybrid cache layers", allow_module_level=True)
sys.modules.setdefault("torchvision", None)  # type: ignore[arg-type]  # see examples/hybrid_restore

import torch  # noqa: E402

try:
    from transformers import BambaConfig, BambaForCausalLM, DynamicCache
except ImportError:  # pragma: no cover - a transformers without Bamba
    if __name__ == "__main__":
        raise
    pytest.skip("this transformers has no Bamba (Mamba2 hybrid)", allow_module_level=True)

import hostkv_providers as hk  # noqa: E402
from hostkv_providers.cache import (  # noqa: E402
    ANCHOR_HEADER_NBYTES,
    HostKVCache,
    HybridCacheMap,
    anchor_depths,
    prefill_pages_cap,
)
from hostkv_providers.device import CpuCopyEngine  # noqa: E402

PT = 16
PROMPT = 6 * PT + 5  # 6 full pages and a 5-token tail
GEN = 8
LAYOUT = hk.KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, page_tokens=PT, dtype="float32")


def build_model() -> Any:
    """A tiny Bamba (Mamba2, attention, Mamba2, attention); the same weights in every process.
    Made sensitive to the state: the mixer projections scaled up, a slow decay, sharp logits."""
    cfg = BambaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=16,
        mamba_d_conv=4, mamba_expand=1, mamba_chunk_size=16, attn_layer_indices=[1, 3],
        max_position_embeddings=1024)
    torch.manual_seed(0)
    m = BambaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "mamba.in_proj" in name or "mamba.out_proj" in name:
                p.mul_(16.0)  # 4.0 (as for Qwen3-Next) left a dropped state's tokens unchanged
            if name.endswith("A_log"):
                p.fill_(-4.0)
            if name.startswith("lm_head"):
                p.mul_(8.0)
    return m


def prompt() -> torch.Tensor:
    return torch.randint(0, 256, (PROMPT,), generator=torch.Generator().manual_seed(5))


def forward(m: Any, ids: torch.Tensor, cache: Any) -> tuple[torch.Tensor, Any]:
    with torch.no_grad():
        out = m(input_ids=ids[None], cache=cache, use_cache=True)
    return out.logits[0, -1].float(), out.past_key_values


def greedy(m: Any, logits: torch.Tensor, cache: Any) -> list[int]:
    toks: list[int] = []
    for _ in range(GEN):
        toks.append(int(logits.argmax()))
        logits, cache = forward(m, torch.tensor([toks[-1]]), cache)
    return toks


def open_cache(m: Any, store: str) -> tuple[hk.Provider, HostKVCache, HybridCacheMap]:
    hmap = HybridCacheMap(LAYOUT, m.config)
    salt = hk.Salt("test/tiny-bamba", LAYOUT, state_format=hmap.state_format("float32"))
    provider = hk.open(store)
    return provider, HostKVCache(provider, salt, CpuCopyEngine(), anchor_interval=2,
                                 required_anchors={"state"}), hmap


def resume(store: str) -> dict[str, Any]:
    """The fresh process: restore the prompt's pages and state, generate; the negative controls."""
    m = build_model()
    ids = prompt()
    provider, cache, hmap = open_cache(m, store)
    with provider, cache:
        keys = cache.keys(ids.numpy())
        hit = cache.lookup(keys, max_pages=prefill_pages_cap(len(ids), PT))
        n = hit.num_pages
        planes = hmap.empty_planes(n)
        res = cache.restore(hit, planes, list(range(n))).wait(60)
        restored = hmap.to_dynamic_cache(planes, res.anchors["state"])
        logits, past = forward(m, ids[n * PT:], restored)
        warm = greedy(m, logits, past)
        dropped_cache = DynamicCache(config=m.config)  # the same pages, no state
        for li, (k, v) in zip(hmap.attention_layers, hmap.unpack(planes), strict=True):
            dropped_cache.layers[li].update(k, v)
        dropped = greedy(m, *forward(m, ids[n * PT:], dropped_cache))
        stale_blob = provider.get_anchor(keys[n - 3], "state")  # an earlier interval anchor
        assert stale_blob is not None
        stale_cache = hmap.to_dynamic_cache(planes, stale_blob[ANCHOR_HEADER_NBYTES:])
        stale = greedy(m, *forward(m, ids[n * PT:], stale_cache))
    return {"pages": res.pages, "anchor_page": res.anchor_page, "warm": warm, "dropped": dropped,
            "stale": stale, "logits": logits.tolist()}


def test_mamba2_hybrid_restores_in_a_fresh_process(tmp_path: Path) -> None:
    from hostkv_providers import available_providers

    if not any(p.name == "lmdb" and p.error is None for p in available_providers()):
        pytest.skip("the lmdb provider is not installed")
    torch.set_num_threads(2)
    m = build_model()
    ids = prompt()
    store = f"lmdb://{tmp_path / 'store'}?budget=64MiB"
    provider, cache, hmap = open_cache(m, store)
    with provider, cache:
        keys = cache.keys(ids.numpy())
        assert len(keys) == 6
        depths = anchor_depths(cache, len(keys))
        assert depths == [1, 3, 5]
        _out, past, states = hmap.prefill(m, ids[None, : len(keys) * PT], depths)  # split: no scan hook
        res = cache.save(keys, hmap.pack(past), list(range(len(keys))),
                         anchors={d: {"state": s} for d, s in states.items()}).wait(60)
        assert (res.stored, res.anchors, res.stopped) == (6, 3, None)
    cold_logits, cold_past = forward(m, ids, None)
    cold = greedy(m, cold_logits, cold_past)

    out = tmp_path / "resume.json"
    env = dict(os.environ, OMP_NUM_THREADS="2", PYTHONHASHSEED="0")
    proc = subprocess.run([sys.executable, __file__, "resume", store, str(out)], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(out.read_text())
    assert (got["pages"], got["anchor_page"]) == (6, 5)
    assert float((torch.tensor(got["logits"]) - cold_logits).abs().max()) < 1e-2
    assert got["warm"] == cold
    # negative controls: the restore was right because of the state
    assert got["dropped"] != cold, got
    assert got["stale"] != cold, got


if __name__ == "__main__":
    torch.set_num_threads(2)
    _step, _store, _out = sys.argv[1:4]
    Path(_out).write_text(json.dumps(resume(_store)))
