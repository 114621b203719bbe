"""Tensor-parallel ranks over one shared store: each rank process saves and restores its slice of
the heads under its own salt, and a prompt is usable only where every rank has its pages.

The multi-process test runs real rank processes (spawned) against one ``lmdb://`` store: both
ranks save the same prompt's shards at the same time, exit (a restart), new rank processes
restore and the parent checks that the two slices put side by side are the whole model's KV,
byte for byte.  Then one rank's pages past a depth are evicted: neither rank reports a hit past
it, through :meth:`HostKVCache.lookup_ranks` and through the all-reduce path (per-rank
``lookup``, the minimum of the hits, restore that many pages).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import hostkv_providers as hk
from hostkv_providers.cache import HostKVCache
from hostkv_providers.device import CpuCopyEngine

# The rank processes run tests/_tp_rank.py as a script (no import of this test module in the
# child); its constants are the test's.
_CHILD = Path(__file__).with_name("_tp_rank.py")
_spec = importlib.util.spec_from_file_location("_hostkv_tp_rank", _CHILD)
assert _spec is not None and _spec.loader is not None
rank = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rank)

LAYOUT: hk.KVLayout = rank.LAYOUT
WORLD: int = rank.WORLD
PAGES: int = rank.PAGES
MODEL: str = rank.MODEL
TOKENS = rank.TOKENS
CUT = 25  # rank 1 keeps its first CUT pages in the eviction step
_salt = rank.salt
_rank_planes = rank.rank_planes
_url = rank.url


class _Rank:
    """A rank process speaking the line protocol of _tp_rank.py."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen([sys.executable, str(_CHILD), *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)

    def expect(self, word: str) -> int:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().split()
        assert line and line[0] == word, f"rank process said {line!r}, expected {word!r}"
        return int(line[1]) if len(line) > 1 else 0

    def send(self, text: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()

    def finish(self) -> None:
        assert self.proc.wait(60) == 0, f"rank process exited with {self.proc.returncode}"
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                f.close()


def _restored(out: Path, stem: str) -> tuple[list[np.ndarray], list[int]]:
    """The ranks' restored planes put side by side along the heads (the whole model's view)."""
    files = [np.load(out / f"{stem}-{r}.npz") for r in range(WORLD)]
    n = len(LAYOUT.planes)
    planes = [np.concatenate([f[f"arr_{i}"] for f in files], axis=2) for i in range(n)]
    return planes, [int(f["pages"]) for f in files]


def _restore_round(path: str, out: Path) -> tuple[list[int], list[int]]:
    ranks = [_Rank("restore", path, str(r), str(out)) for r in range(WORLD)]
    common = [r.expect("common") for r in ranks]
    for r in ranks:
        r.send("")
    own = [r.expect("own") for r in ranks]
    for r in ranks:
        r.send(str(min(own)))  # the engine's all-reduce(MIN) of the ranks' hits
    for r in ranks:
        r.expect("restored")
        r.finish()
    return common, own


def test_two_rank_processes_share_one_lmdb_store(tmp_path: Path) -> None:
    store = str(tmp_path / "kv")
    full = rank.full_model_planes()
    savers = [_Rank("save", store, str(r)) for r in range(WORLD)]
    for r in savers:
        r.expect("ready")
    for r in savers:  # both ranks save at the same time, into one store
        r.send("go")
    for r in savers:
        r.expect("saved")
        r.finish()

    # one store holds both ranks' pages, each under its own tag
    with hk.open(_url(store)) as p:
        assert isinstance(p, hk.providers.SupportsIterate)
        tags = sorted({e.salt_tag for e in p.iter_entries()})
        assert tags == sorted(_salt(r).tag for r in range(WORLD)) and p.stats().entries == WORLD * PAGES
        assert [hk.providers.parse_salt_tag(t) for t in tags] == [(_salt(0).config_tag, r, WORLD) for r in range(WORLD)]

    # a restart: new rank processes restore; the slices side by side are the whole KV, exactly
    common, own = _restore_round(store, tmp_path)
    assert common == [PAGES, PAGES] and own == [PAGES, PAGES]
    for stem in ("ranks", "allreduce"):
        planes, pages = _restored(tmp_path, stem)
        assert pages == [PAGES, PAGES]
        assert all(a.tobytes() == b.tobytes() for a, b in zip(planes, full, strict=True))

    # rank 1 loses its pages from depth CUT on (an eviction of its subtree)
    rank1 = hk.chain_keys(_salt(1), TOKENS)
    with hk.open(_url(store)) as p:
        assert p.evict(keys=[rank1[CUT]]).entries == PAGES - CUT
        assert p.longest_prefix(rank1) == CUT and p.longest_prefix(hk.chain_keys(_salt(0), TOKENS)) == PAGES
    common, own = _restore_round(store, tmp_path)
    assert common == [CUT, CUT]  # neither rank reports a hit past the depth rank 1 still has
    assert own == [PAGES, CUT]  # a rank's own lookup alone would: hence the all-reduce
    for stem in ("ranks", "allreduce"):
        planes, pages = _restored(tmp_path, stem)
        assert pages == [CUT, CUT]
        for got, want in zip(planes, full, strict=True):
            assert got[:CUT].tobytes() == want[:CUT].tobytes() and not got[CUT:].any()


# -- in one process: the rule's edges -----------------------------------------------------------

def _fill(cache: HostKVCache, planes: list[np.ndarray], pages: int, anchors: Any = None) -> list[hk.Key]:
    keys = cache.keys(TOKENS)[:pages]
    cache.save(keys, planes, list(range(pages)), anchors=anchors).wait(30)
    return keys


def test_lookup_ranks_leases_every_rank_and_checks_its_input() -> None:
    with hk.open("pinned://?budget=8MiB&block=4KiB") as p:
        caches = [HostKVCache(p, _salt(r), CpuCopyEngine()) for r in range(WORLD)]
        chains = caches[0].rank_keys(TOKENS)
        assert chains == [c.keys(TOKENS) for c in caches]
        assert caches[0].layout == hk.KVLayout(2, 2, 16, 16, dtype="float16")
        assert caches[0].page_nbytes == LAYOUT.page_nbytes // WORLD
        _fill(caches[0], _rank_planes(0), 30)
        _fill(caches[1], _rank_planes(1), 12)
        hit = caches[0].lookup_ranks(chains)
        assert hit.num_pages == 12 and list(hit.keys) == chains[0][:12] and hit.stored == 12
        # the hit pins both ranks' pages of the common prefix, and only those
        assert p.evict(keys=[chains[1][0]]).entries == 0
        assert p.evict(keys=[chains[0][12]]).entries == 18
        hit.release()
        assert p.evict(keys=[chains[1][6]]).entries == 6
        assert caches[1].lookup_ranks(chains).num_pages == 6
        # an unsharded cache: one chain, the same answer as lookup
        whole = HostKVCache(p, hk.Salt(MODEL, LAYOUT), CpuCopyEngine())
        assert whole.rank_keys(TOKENS) == [whole.keys(TOKENS)]
        assert whole.lookup_ranks(whole.rank_keys(TOKENS)).num_pages == 0
        with pytest.raises(hk.InvalidArgumentError, match="one chain per rank"):
            caches[0].lookup_ranks(chains[:1])
        with pytest.raises(hk.InvalidArgumentError, match="same number of pages"):
            caches[0].lookup_ranks([chains[0], chains[1][:3]])
        for c in [*caches, whole]:
            c.close()


def test_lookup_ranks_needs_the_anchor_on_every_rank() -> None:
    with hk.open("pinned://?budget=8MiB&block=4KiB") as p:
        caches = [HostKVCache(p, _salt(r), CpuCopyEngine()) for r in range(WORLD)]
        chains = caches[0].rank_keys(TOKENS)
        # rank 0 anchored at pages 9 and 19, rank 1 only at 9: the common anchored depth is 10
        _fill(caches[0], _rank_planes(0), 20, anchors={9: {"ssm": b"r0@9"}, 19: {"ssm": b"r0@19"}})
        _fill(caches[1], _rank_planes(1), 20, anchors={9: {"ssm": b"r1@9"}})
        with caches[0].lookup_ranks(chains, need_anchor="ssm") as hit:
            assert hit.num_pages == 10 and hit.anchor == b"r0@9" and hit.stored == 20
        with caches[1].lookup_ranks(chains, need_anchor="ssm") as hit:
            assert hit.num_pages == 10 and hit.anchor == b"r1@9"
        assert caches[0].lookup_ranks(chains, need_anchor="other").num_pages == 0
        for c in caches:
            c.close()


def test_explicit_slices_are_not_derivable_for_peers() -> None:
    salt = hk.Salt(MODEL, LAYOUT, tp_rank=0, tp_world_size=2, kv_head_start=0, kv_head_count=3)
    with pytest.raises(hk.InvalidArgumentError, match="explicit KV head slice"):
        salt.rank_salts()
    peers = _salt(1).rank_salts()
    assert [s.kv_heads for s in peers] == [range(0, 2), range(2, 4)]
    assert [s.digest for s in peers] == [_salt(0).digest, _salt(1).digest]
    assert peers == (_salt(0), _salt(1)) and hk.Salt(MODEL, LAYOUT).rank_salts() == (hk.Salt(MODEL, LAYOUT),)
