"""``info``/``ls``/``evict`` with tensor-parallel ranks: tags decoded, grouped by configuration
and rank, a configuration's missing ranks named."""

from __future__ import annotations

import json

import hostkv_providers as hk
import numpy as np
from click.testing import CliRunner

from hostkv_cli._synth import page_bytes

from .conftest import SALT_A, invoke

URL = "pinned://?budget=16MiB&block=16KiB"
TP_LAYOUT = hk.KVLayout(num_layers=2, num_kv_heads=4, head_dim=64, page_tokens=16)  # 16 KiB per rank
RANKS = [hk.Salt("test/model-tp", TP_LAYOUT, tp_rank=r, tp_world_size=2) for r in range(2)]
TOKENS = np.random.default_rng(3).integers(0, 50_000, size=6 * 16)


def _fill(p: hk.Provider, salts: list[hk.Salt], pages: int = 6) -> dict[str, list[hk.Key]]:
    out = {}
    for salt in salts:
        keys = hk.chain_keys(salt, TOKENS[: pages * 16])
        parent = None
        for k in keys:
            assert p.put(k, parent, page_bytes(k, salt.page_nbytes), salt_tag=salt.tag)
            parent = k
        out[salt.tag] = keys
    return out


def test_info_and_ls_group_by_rank(runner: CliRunner, stores) -> None:  # type: ignore[no-untyped-def]
    p = stores(URL)
    # rank 1 first and the unsharded salt in between: the listing still groups rank 0, rank 1
    chains = _fill(p, [RANKS[1], SALT_A, RANKS[0]])
    doc = json.loads(invoke(runner, "info", "--json", URL).stdout)
    rows = [(t["tag"], t["config"], t["tp_rank"], t["tp_world_size"]) for t in doc["salt_tags"]]
    cfg = RANKS[0].config_tag
    ranked = [r for r in rows if r[1] == cfg]
    assert ranked == [(RANKS[0].tag, cfg, 0, 2), (RANKS[1].tag, cfg, 1, 2)]
    assert rows.index(ranked[1]) == rows.index(ranked[0]) + 1
    assert (SALT_A.tag, SALT_A.tag, 0, 1) in rows
    (group,) = doc["tensor_parallel"]
    assert group["config"] == cfg and group["world_size"] == 2 and group["missing_ranks"] == []
    assert [r["pages"] for r in group["ranks"]] == [6, 6]
    human = invoke(runner, "info", URL).output
    assert "RANK" in human and "0/2" in human and "1/2" in human and "no pages of rank" not in human

    flat = json.loads(invoke(runner, "ls", "--json", URL).stdout)
    order = [e["salt_tag"] for e in flat["entries"]]
    # each rank's pages contiguous, rank 0 before rank 1, each rank's chain root first
    r0, r1 = order.index(RANKS[0].tag), order.index(RANKS[1].tag)
    assert order[r0 : r0 + 6] == [RANKS[0].tag] * 6 and r1 == r0 + 6 and order[r1 : r1 + 6] == [RANKS[1].tag] * 6
    assert [e["key"] for e in flat["entries"][r1 : r1 + 6]] == [k.hex() for k in chains[RANKS[1].tag]]
    assert {e["tp_rank"] for e in flat["entries"] if e["salt_tag"] == RANKS[1].tag} == {1}
    one = json.loads(invoke(runner, "ls", "--json", "--rank", "1", URL).stdout)
    assert {e["salt_tag"] for e in one["entries"]} == {RANKS[1].tag}
    both = json.loads(invoke(runner, "ls", "--json", "--salt", cfg, URL).stdout)
    assert {e["salt_tag"] for e in both["entries"]} == {RANKS[0].tag, RANKS[1].tag}
    assert "1/2" in invoke(runner, "ls", URL).output
    assert RANKS[1].tag in invoke(runner, "ls", "--tree", URL).output

    # one rank's pages gone: info names the rank the configuration lacks
    r = invoke(runner, "evict", "--salt", RANKS[1].tag, URL)
    assert r.exit_code == 0 and "evicted 6 entries" in r.output
    doc = json.loads(invoke(runner, "info", "--json", URL).stdout)
    assert doc["tensor_parallel"][0]["missing_ranks"] == [1]
    assert "no pages of rank(s) 1 of 2" in invoke(runner, "info", URL).output
    # the configuration's 8 hex evict every rank
    r = invoke(runner, "evict", "--salt", cfg, URL)
    assert r.exit_code == 0 and "evicted 6 entries" in r.output
    assert p.longest_prefix(chains[SALT_A.tag]) == 6 and p.stats().entries == 6
