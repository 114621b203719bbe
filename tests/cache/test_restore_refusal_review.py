"""A restore coalesced into an identical one in flight registered the release of the caller's hit
before ordering the caller's stream; a stream it then could not order (a closed HostStream)
refused the call and still released the hit behind its caller's back, where the uncoalesced path
leaves the hit to its caller (a review helper's finding; fails before)."""

from __future__ import annotations

import pytest

from hostkv_providers import ClosedError
from hostkv_providers.cache import HostKVCache
from hostkv_providers.device import CpuCopyEngine, HostStream
from hostkv_providers.device._hostmem import OrdinaryAllocator

from . import _cache_common as tc


@pytest.mark.parametrize("coalesced", [False, True])
def test_a_refused_restore_leaves_the_hit_to_its_caller(coalesced: bool) -> None:
    p = tc.GatedReads(tc._pinned())
    e = CpuCopyEngine()
    c = HostKVCache(p, tc.SALT, e, staging_allocator=OrdinaryAllocator())
    closed = HostStream()
    closed.close()
    try:
        ks = c.keys(tc.tokens(3 * 4, seed=1))
        c.save(ks, tc.make_planes(1), [0, 1, 2]).wait(30)
        planes = tc.make_planes()
        first, hit = c.lookup(ks), c.lookup(ks)
        p.gate.clear()
        h = c.restore(first, planes, [0, 1, 2]) if coalesced else None  # in flight: reads gated
        with pytest.raises(ClosedError):
            c.restore(hit, planes, [0, 1, 2], before=closed)
        p.gate.set()
        if h is not None:
            assert h.wait(30).pages == 3
        assert not hit.released
        assert c.stats().coalesced_restores == 0
        hit.release()
    finally:
        p.gate.set()
        c.close()
        e.close()
        p.close()
