"""A real transformers model restored across a process restart (examples/transformers_restore).

Three separate processes share only an lmdb store: the first prefills a 4,100-token prompt and
saves its KV pages; the second restores them and continues; the third forks from the shared
prefix.  Checked: the restored K/V pages are byte-identical to the ones saved (hash per page,
both as restored into the model's cache and as read back from the store), the next-token
logits equal a cold prefill's within float tolerance, greedy generation is identical, and the
fork stores only its new pages.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "transformers_restore" / "restore_demo.py"


def _run(step: str, store: str, out: Path) -> dict[str, Any]:
    env = dict(os.environ, PYTHONHASHSEED="0", OMP_NUM_THREADS="2", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([sys.executable, str(SCRIPT), step, "--store", store, "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, f"{step} failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(out.read_text())  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    from hostkv_providers import available_providers

    if not any(p.name == "lmdb" and p.error is None for p in available_providers()):
        pytest.skip("the lmdb provider is not installed")
    tmp = tmp_path_factory.mktemp("example_model")
    store = f"lmdb://{tmp / 'store'}?budget=64MiB"
    return {step: _run(step, store, tmp / f"{step}.json") for step in ("prefill", "resume", "fork")}


def test_first_process_stores_every_full_page(reports: dict[str, dict[str, Any]]) -> None:
    p1 = reports["prefill"]
    assert p1["pages"] == 256  # 4,100 tokens, 16 per page
    assert (p1["stored"], p1["dedup"], p1["entries"]) == (256, 0, 256)
    assert p1["saved_nbytes"] == 256 * 8192


def test_restored_kv_is_byte_identical(reports: dict[str, dict[str, Any]]) -> None:
    p1, p2 = reports["prefill"], reports["resume"]
    assert p2["hit_pages"] == 256 and p2["restored_pages"] == 256 and p2["hit_tokens"] == 4096
    assert p2["stored_hashes"] == p1["page_hashes"]  # what the store holds is what was saved
    assert p2["page_hashes"] == p1["page_hashes"]  # what reached the model's cache too
    assert p2["bytes_in"] == 256 * 8192


def test_next_token_logits_match_cold_prefill(reports: dict[str, dict[str, Any]]) -> None:
    import torch

    p1, p2 = reports["prefill"], reports["resume"]
    warm = torch.tensor(p2["logits"])
    torch.testing.assert_close(warm, torch.tensor(p2["cold_logits"]), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(warm, torch.tensor(p1["logits"]), atol=1e-4, rtol=1e-4)
    assert p2["prefix_kv_max_diff"] <= 1e-5


def test_generation_is_identical(reports: dict[str, dict[str, Any]]) -> None:
    p2 = reports["resume"]
    assert len(p2["warm_tokens"]) == 16
    assert p2["warm_tokens"] == p2["cold_tokens"]


def test_fork_stores_only_its_new_pages(reports: dict[str, dict[str, Any]]) -> None:
    p3 = reports["fork"]
    assert p3["hit_pages"] == 128  # 2,048 shared tokens
    assert (p3["stored"], p3["seals"], p3["saved_nbytes"]) == (128, 128, 128 * 8192)
    assert (p3["again_stored"], p3["again_dedup"], p3["again_nbytes"]) == (0, 256, 0)
    assert p3["longest_prefix"] == 256 and p3["entries"] == 384
