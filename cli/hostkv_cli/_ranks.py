"""Tensor-parallel ranks in listings: salt tags decoded, entries grouped by configuration and rank.

A sharded salt's tag is ``<config>r<rank>w<world>`` (see ``Salt.tag``); every rank of one
configuration shares ``<config>``.  A prompt is usable only where every rank has its pages, so
``info`` also says which ranks of a configuration hold nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import hostkv_providers as hk

__all__ = ["group_key", "is_rank_tag", "rank_label", "rank_of", "rank_summary", "tag_label", "tag_matches"]


def rank_of(tag: str) -> hk.providers.SaltTag | None:
    """The decoded tag, or ``None`` for a label in neither of ``Salt.tag``'s forms."""
    return hk.providers.parse_salt_tag(tag)


def is_rank_tag(tag: str) -> bool:
    st = rank_of(tag)
    return st is not None and st.config != tag


def tag_matches(tag: str, wanted: str) -> bool:
    """``--salt`` selects one tag exactly, or, given a configuration's 8 hex characters, every
    rank of that configuration."""
    if tag == wanted:
        return True
    st = rank_of(tag)
    return st is not None and st.config != tag and st.config == wanted


def rank_label(tag: str) -> str:
    """``1/2`` for a rank tag, ``-`` otherwise."""
    st = rank_of(tag)
    return f"{st.tp_rank}/{st.tp_world_size}" if st is not None and st.config != tag else "-"


def tag_label(tag: str) -> str:
    """A short label for a tree line: 8 characters of a plain tag, a rank tag whole (its rank
    is the point)."""
    return tag if is_rank_tag(tag) else (tag[:8] or "-")


def group_key(tag: str) -> tuple[str, int]:
    """Sort key that puts one configuration's ranks together, rank order."""
    st = rank_of(tag)
    if st is None or st.config == tag:
        return (tag, -1)
    return (st.config, st.tp_rank)


def rank_summary(tag_rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per sharded configuration: its world size, each present rank's pages and bytes, and the
    ranks with no pages at all (a prompt needs every rank's pages)."""
    by_config: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for row in tag_rows:
        st = rank_of(row["tag"])
        if st is None or st.config == row["tag"]:
            continue
        by_config.setdefault((st.config, st.tp_world_size), []).append(
            {"rank": st.tp_rank, "tag": row["tag"], "pages": row["pages"], "nbytes": row["nbytes"]})
    out = []
    for (config, world), ranks in sorted(by_config.items()):
        ranks.sort(key=lambda r: r["rank"])
        present = {r["rank"] for r in ranks}
        out.append({"config": config, "world_size": world, "ranks": ranks,
                    "missing_ranks": [r for r in range(world) if r not in present]})
    return out
