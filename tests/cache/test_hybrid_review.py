"""Review mends of the hybrid cache (reproduced, each failed before): a restore coalesced into an
identical one in flight left its own anchors_into unwritten; lookup(need_anchor=) on a hybrid
cache never delivered the anchor it cut the hit to; prefill_pages_cap took any page_tokens."""

from __future__ import annotations

import pytest

from hostkv_providers import InvalidArgumentError, Salt
from hostkv_providers.cache import HostKVCache, prefill_pages_cap
from hostkv_providers.device import CpuCopyEngine
from hostkv_providers.device._hostmem import OrdinaryAllocator

from . import _cache_common as tc


def test_coalesced_restore_fills_each_callers_anchor_buffer() -> None:
    p = tc.GatedReads(tc._pinned())
    e = CpuCopyEngine()
    salt = Salt("review/hybrid", tc.LAYOUT, state_format="s/v1")
    c = HostKVCache(p, salt, e, required_anchors={"ssm"}, staging_allocator=OrdinaryAllocator())
    try:
        ks = c.keys(tc.tokens(3 * 4, seed=1))
        c.save(ks, tc.make_planes(1), [0, 1, 2], anchors={2: {"ssm": b"STATE@2!"}}).wait(30)
        planes = tc.make_planes()
        hit_a, hit_b = c.lookup(ks), c.lookup(ks)
        assert hit_a.num_pages == hit_b.num_pages == 3
        buf_a, buf_b = bytearray(8), bytearray(8)
        p.gate.clear()
        h_a = c.restore(hit_a, planes, [0, 1, 2], anchors_into={"ssm": buf_a})
        h_b = c.restore(hit_b, planes, [0, 1, 2], anchors_into={"ssm": buf_b})  # coalesced into h_a
        p.gate.set()
        res_a, res_b = h_a.wait(30), h_b.wait(30)
        assert res_a.pages == res_b.pages == 3
        assert bytes(buf_a) == b"STATE@2!"
        # the second caller's own state buffer must hold the state it restores from
        assert bytes(buf_b) == b"STATE@2!", f"caller B's anchors_into left untouched: {bytes(buf_b)!r}"
    finally:
        p.gate.set()
        c.close()
        e.close()
        p.close()


def test_need_anchor_hit_on_a_hybrid_cache_delivers_the_anchor() -> None:
    p, e = tc._pinned(), CpuCopyEngine()
    c = HostKVCache(p, Salt("review/h", tc.LAYOUT, state_format="s"), e, required_anchors={"ssm"},
                    staging_allocator=OrdinaryAllocator())
    try:
        ks = c.keys(tc.tokens(4 * 4, seed=2))
        c.save(ks, tc.make_planes(2), [0, 1, 2, 3],
               anchors={1: {"ssm": b"s1", "extra": b"E1"}, 3: {"ssm": b"s3"}}).wait(30)
        with c.lookup(ks, need_anchor="extra") as hit:
            assert hit.num_pages == 2  # cut to the page carrying "extra"
            res = c.restore(hit, tc.make_planes(), [0, 1], release=False).wait(30)
            got = {"hit.anchor": hit.anchor, "restore": bytes(res.anchors["extra"]) if "extra" in res.anchors else None}
            buf = bytearray(2)
            try:
                n = hit.read_anchor(buf)
                got["read_anchor"] = bytes(buf[:n])
            except Exception as exc:
                got["read_anchor"] = f"{type(exc).__name__}: {exc}"
        assert b"E1" in (got["hit.anchor"] or b"") or got["restore"] == b"E1" or got["read_anchor"] == b"E1", got
    finally:
        c.close()
        e.close()
        p.close()


@pytest.mark.parametrize("page_tokens", [0, -4, "4", True])
def test_bad_page_tokens_is_a_typed_error(page_tokens: object) -> None:
    with pytest.raises(InvalidArgumentError):
        prefill_pages_cap(10, page_tokens)  # type: ignore[arg-type]
