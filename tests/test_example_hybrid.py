"""Runs examples/hybrid_restore (a tiny Qwen3-Next saved in one process, restored in another)
and checks the traps of issue 17 end to end: generation identical to a cold prefill, the state
really matters (negative controls), plain lookups cut to anchored pages, a fork at an interval
anchor stores only its new pages."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
_tf = pytest.importorskip("transformers")
if int(_tf.__version__.split(".")[0]) < 5:
    pytest.skip("HybridCacheMap maps transformers 5.x hybrid cache layers", allow_module_level=True)

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "hybrid_restore" / "hybrid_demo.py"


def _run(step: str, store: str, out: Path) -> dict[str, Any]:
    env = dict(os.environ, PYTHONHASHSEED="0", OMP_NUM_THREADS="2", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([sys.executable, str(SCRIPT), step, "--store", store, "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, f"{step} failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(out.read_text())  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    try:
        from transformers import Qwen3NextConfig  # noqa: F401
    except ImportError:
        pytest.skip("this transformers has no Qwen3-Next")
    from hostkv_providers import available_providers

    if not any(p.name == "lmdb" and p.error is None for p in available_providers()):
        pytest.skip("the lmdb provider is not installed")
    tmp = tmp_path_factory.mktemp("example_hybrid")
    store = f"lmdb://{tmp / 'store'}?budget=64MiB"
    return {step: _run(step, store, tmp / f"{step}.json") for step in ("prefill", "resume", "fork")}


def test_prefill_stores_pages_and_interval_anchors(reports: dict[str, dict[str, Any]]) -> None:
    p1 = reports["prefill"]
    assert p1["stored"] == 8 and p1["stopped"] is None
    assert p1["anchored_pages"] == [1, 3, 5, 7] and p1["anchors"] == 4


def test_restore_in_another_process_generates_like_a_cold_prefill(reports: dict[str, dict[str, Any]]) -> None:
    p2 = reports["resume"]
    assert p2["pages"] == 8 and p2["anchor_page"] == 7  # capped: 4 tail tokens left to prefill
    assert p2["max_logit_diff"] < 1e-3
    assert len(p2["warm_tokens"]) == 16 and p2["warm_tokens"] == p2["cold_tokens"]


def test_negative_controls_the_state_matters(reports: dict[str, dict[str, Any]]) -> None:
    # the init is sensitive: the same KV pages with the recurrent state dropped, or with the
    # state of an earlier page, must give other tokens (else the example would prove nothing)
    p2 = reports["resume"]
    assert p2["dropped_state_tokens"] != p2["cold_tokens"]
    assert p2["stale_state_tokens"] != p2["cold_tokens"]
    assert p2["no_state_refused"] == "InvalidArgumentError"


def test_fork_at_an_interval_anchor_stores_only_new_pages(reports: dict[str, dict[str, Any]]) -> None:
    p3 = reports["fork"]
    assert p3["stored_before"] == [True] * 5 + [False] * 3
    assert p3["pages"] == 4  # page 4 is stored but carries no state: cut back to page 3's anchor
    assert (p3["stored"], p3["dedup"]) == (3, 1)
    assert p3["anchored_pages"] == [1, 3, 5, 7]
    assert p3["warm_tokens"] == p3["cold_tokens"] and p3["max_logit_diff"] < 1e-3
