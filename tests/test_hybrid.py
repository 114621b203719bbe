"""Hybrid models in HostKVCache: required anchors, anchor records, capped hits, anchors read with
the restore, rollback of stranded pages, anchor groups (drafter state), prefill coalescing.

Each test names the trap of issue 17 it closes."""

from __future__ import annotations

import importlib.util
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from hostkv_providers import InvalidArgumentError, Provider, Salt
from hostkv_providers.cache import (
    ANCHOR_HEADER_NBYTES,
    AnchorMismatchError,
    HostKVCache,
    abandon_prefill,
    anchor_depths,
    prefill_pages_cap,
    prefill_pending,
    put_anchor,
)
from hostkv_providers.device._copy import CpuCopyEngine
from hostkv_providers.device._hostmem import OrdinaryAllocator

# the cache tests' helpers (the suite runs with --import-mode=importlib: load them by path)
_spec = importlib.util.spec_from_file_location(
    "_hostkv_cache_common", Path(__file__).parent / "cache" / "_cache_common.py")
assert _spec is not None and _spec.loader is not None
_tc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_tc)
LAYOUT, NoViews, _pinned, make_planes, page_of, tokens = (
    _tc.LAYOUT, _tc.NoViews, _tc._pinned, _tc.make_planes, _tc.page_of, _tc.tokens)

HSALT = Salt("test/hybrid", LAYOUT, state_format="gdn/v1:float32")


@pytest.fixture
def engine() -> Iterator[CpuCopyEngine]:
    e = CpuCopyEngine()
    yield e
    e.close()


@pytest.fixture(params=["views", "staged"])
def provider(request: pytest.FixtureRequest) -> Iterator[Provider]:
    p: Provider = _pinned() if request.param == "views" else NoViews(_pinned())
    yield p
    p.close()


def hcache(provider: Provider, engine: CpuCopyEngine, **kw: object) -> HostKVCache:
    kw.setdefault("required_anchors", {"conv", "ssm"})
    return HostKVCache(provider, HSALT, engine, staging_allocator=OrdinaryAllocator(), **kw)  # type: ignore[arg-type]


def state(i: int) -> dict[str, bytes]:
    return {"conv": f"conv@{i}".encode(), "ssm": f"ssm@{i}".encode() * 100}


def test_salt_state_format_is_additive() -> None:
    # trap 4: Salt had no field for the state's format; the default leaves digests unchanged
    assert Salt("m", LAYOUT).digest == Salt("m", LAYOUT, state_format="").digest
    assert Salt("m", LAYOUT, state_format="a").digest != Salt("m", LAYOUT, state_format="b").digest
    with pytest.raises(InvalidArgumentError):
        Salt("m", LAYOUT, state_format=3)  # type: ignore[arg-type]


def test_plain_lookup_never_passes_the_required_anchors(provider: Provider, engine: CpuCopyEngine) -> None:
    # trap 2: a plain lookup returned all pages and no anchor (0/32 correct tokens)
    with hcache(provider, engine, anchor_interval=3) as c:
        src = make_planes(1)
        ks = c.keys(tokens(8 * 4, seed=1))
        # the terminal page gets only one of the two required anchors: refused (a partial state)
        with pytest.raises(InvalidArgumentError, match="only in part"):
            c.save(ks, src, list(range(8)), anchors={7: {"ssm": b"x"}})
        r = c.save(ks, src, list(range(8)), anchors=lambda i: state(i) if i != 7 else None).wait(30)
        assert r.anchors == 4 and r.stopped is None  # pages 2 and 5, two anchors each
        for hit in (c.lookup(ks), c.lookup(ks, need_anchor="ssm"), c.lookup(ks, wait=False)):
            assert (hit.num_pages, hit.stored) == (6, 8)
            hit.release()
        assert not c.lookup(ks, need_anchor="other")  # an extra name joins the required set
        with c.lookup(ks) as hit:
            planes = make_planes()
            res = c.restore(hit, planes, list(range(6)), release=False).wait(30)
            assert res.pages == 6 and res.anchor_page == 5
            assert bytes(res.anchors["ssm"]) == b"ssm@5" * 100 and bytes(res.anchors["conv"]) == b"conv@5"
            assert all(page_of(planes, b) == page_of(src, b) for b in range(6))


def test_lookup_ranks_respects_required_anchors(engine: CpuCopyEngine) -> None:
    layout = LAYOUT.__class__(num_layers=2, num_kv_heads=2, head_dim=32, page_tokens=4, dtype="float32")
    p = _pinned()
    try:
        salts = [Salt("test/hybrid", layout, tp_rank=r, tp_world_size=2, state_format="s") for r in range(2)]
        caches = [HostKVCache(p, s, engine, required_anchors={"ssm"}, staging_allocator=OrdinaryAllocator())
                  for s in salts]
        toks = tokens(6 * 4, seed=2)
        chains = [c.keys(toks) for c in caches]
        shape = (64, 4, 1, 32)
        src = [np.ones(shape, np.float32) for _ in caches[0].layout.planes]
        caches[0].save(chains[0], src, list(range(6)), anchors={3: {"ssm": b"a"}, 5: {"ssm": b"b"}}).wait(30)
        caches[1].save(chains[1], src, list(range(6)), anchors={3: {"ssm": b"a"}}).wait(30)
        with caches[0].lookup_ranks(chains) as hit:
            assert hit.num_pages == 4  # rank 1 carries the state only at page 3
        for c in caches:
            c.close()
    finally:
        p.close()


def test_short_restore_reports_the_anchor_of_the_usable_page(engine: CpuCopyEngine) -> None:
    # trap 3: after a short restore the hit's anchor (the state after the *last* page) was used
    p = NoViews(_pinned())
    with hcache(p, engine, anchor_interval=2) as c:
        src = make_planes(3)
        ks = c.keys(tokens(8 * 4, seed=3))
        c.save(ks, src, list(range(8)), anchors=state).wait(30)
        with c.lookup(ks) as hit:
            assert hit.num_pages == 8
            p.fail_reads.add(bytes(ks[6]))  # page 6 fails its checksum: 6 pages restored
            res = c.restore(hit, make_planes(), list(range(8)), release=False).wait(30)
        assert res.pages == 6 and res.anchor_page == 5  # cut back to the deepest anchored page
        assert bytes(res.anchors["conv"]) == b"conv@5"
        p.fail_reads = {bytes(ks[5])}  # 5 pages restored, the deepest anchor within is page 3
        with c.lookup(ks) as hit:
            res = c.restore(hit, make_planes(), list(range(8)), release=False).wait(30)
        assert (res.pages, res.anchor_page, bytes(res.anchors["conv"])) == (4, 3, b"conv@3")
        assert "cut back to 4 pages" in (res.stopped or "")
        p.fail_reads = {bytes(ks[1])}  # only page 0 restored, no anchor within: nothing usable
        with c.lookup(ks) as hit:
            res = c.restore(hit, make_planes(), list(range(8)), release=False).wait(30)
        assert (res.pages, res.anchor_page, res.anchors) == (0, None, {})


def test_ranged_restore_cuts_back_to_an_anchor_within_the_range(engine: CpuCopyEngine) -> None:
    # a ranged restore (pages [a, b) of a hit) was refused on hybrid caches; now the usable count
    # and its anchor are cut back to the deepest anchored page within what was restored
    p = NoViews(_pinned())
    with hcache(p, engine, anchor_interval=2) as c:  # anchors at pages 1, 3, 5, 7
        src = make_planes(4)
        ks = c.keys(tokens(8 * 4, seed=4))
        c.save(ks, src, list(range(8)), anchors=state).wait(30)
        with c.lookup(ks) as hit:
            planes = make_planes()
            res = c.restore(hit, planes, [10, 11, 12, 13, 14, 15], first_page=2, release=False).wait(30)
            assert (res.pages, res.anchor_page, bytes(res.anchors["conv"])) == (6, 7, b"conv@7")
            assert all(page_of(planes, 10 + i) == page_of(src, 2 + i) for i in range(6))
            # pages [2, 5): the deepest anchor within is page 3 -> 2 usable pages from page 2
            res = c.restore(hit, make_planes(), [0, 1, 2], first_page=2, release=False).wait(30)
            assert (res.pages, res.anchor_page, bytes(res.anchors["ssm"])) == (2, 3, b"ssm@3" * 100)
            assert res.nbytes == 2 * c.page_nbytes and "cut back to 2 pages" in (res.stopped or "")
            # page [4, 5): no anchor within: nothing usable (the engine's own state at 3 stays)
            res = c.restore(hit, make_planes(), [0], first_page=4, release=False).wait(30)
            assert (res.pages, res.anchor_page, res.anchors) == (0, None, {})
            assert "no restored page carries" in (res.stopped or "")
            # a short ranged restore: page 6 fails, [4, 6) restored, the anchor within is page 5
            p.fail_reads.add(bytes(ks[6]))
            bufs = {"ssm": bytearray(500), "conv": bytearray(6)}
            res = c.restore(hit, make_planes(), [0, 1, 2, 3], first_page=4, release=False,
                            anchors_into=bufs).wait(30)
            assert (res.pages, res.anchor_page) == (2, 5)
            assert bytes(bufs["ssm"]) == b"ssm@5" * 100 and res.anchors["conv"].obj is bufs["conv"]


def test_anchor_bound_to_position_and_format(provider: Provider, engine: CpuCopyEngine) -> None:
    # trap 4: put_anchor accepted one page's state on another page and lookup returned it
    with hcache(provider, engine, required_anchors={"ssm"}) as c:
        src = make_planes(4)
        ks = c.keys(tokens(4 * 4, seed=4))
        c.save(ks, src, list(range(4)), anchors={1: {"ssm": b"s1"}}).wait(30)
        rec1 = provider.get_anchor(ks[1], "ssm")
        assert rec1 is not None and len(rec1) == ANCHOR_HEADER_NBYTES + 2
        # refused on put: page 1's record offered for page 3 (through the save or put_anchor)
        with pytest.raises(AnchorMismatchError):
            c.save(ks, src, list(range(4)), anchors={3: {"ssm": rec1}})
        with pytest.raises(AnchorMismatchError):
            put_anchor(c, ks, 3, "ssm", rec1)
        put_anchor(c, ks, 1, "ssm", rec1)  # its own page: fine
        # written behind the cache's back: the record does not match where it is read -> a miss
        provider.put_anchor(ks[3], "ssm", rec1)
        with c.lookup(ks) as hit:
            assert hit.num_pages == 4  # the listing shows the name; the restore checks the record
            res = c.restore(hit, make_planes(), list(range(4)), release=False).wait(30)
        assert res.pages == 2 and bytes(res.anchors["ssm"]) == b"s1"
        provider.put_anchor(ks[3], "ssm", b"raw bytes, no record")
        with c.lookup(ks) as hit:  # too short to be a record: not even listed as an anchor
            assert hit.num_pages == 2
        provider.put_anchor(ks[3], "ssm", bytes(ANCHOR_HEADER_NBYTES + 8))  # record-sized garbage
        with c.lookup(ks) as hit:
            assert c.restore(hit, make_planes(), list(range(4)), release=False).wait(30).pages == 2
    # another state format under the same keys (same pages!) reads as a miss
    other = Salt("test/hybrid", LAYOUT, state_format="gdn/v2:bfloat16")
    with HostKVCache(provider, other, engine, required_anchors={"ssm"}, staging_allocator=OrdinaryAllocator()) as c2:
        ks2 = c2.keys(tokens(4 * 4, seed=4))
        assert ks2 != ks  # the format is in the salt, so keys differ too: nothing to confuse
        c2.save(ks2, src, list(range(4))).wait(30)
        for k, k2 in zip(ks, ks2, strict=True):  # copy format-1 records onto the format-2 pages
            blob = provider.get_anchor(k, "ssm")
            if blob is not None:
                provider.put_anchor(k2, "ssm", blob)
        with c2.lookup(ks2) as hit:
            res = c2.restore(hit, make_planes(), list(range(hit.num_pages)), release=False).wait(30)
        assert res.pages == 0 and res.anchors == {}


def test_max_pages_keeps_a_token_to_prefill(provider: Provider, engine: CpuCopyEngine) -> None:
    # trap 5: a prompt of exactly N full pages hit in full leaves nothing to prefill
    with hcache(provider, engine, anchor_interval=1) as c:
        toks = tokens(6 * 4, seed=5)
        ks = c.keys(toks)
        c.save(ks, make_planes(5), list(range(6)), anchors=state).wait(30)
        cap = prefill_pages_cap(len(toks), LAYOUT.page_tokens)
        assert cap == 5
        with c.lookup(ks, max_pages=cap) as hit:
            assert hit.num_pages == 5 and hit.num_tokens < len(toks)
        assert prefill_pages_cap(len(toks) + 1, 4) == 6
        with pytest.raises(InvalidArgumentError):
            c.lookup(ks, max_pages=-1)
        with pytest.raises(InvalidArgumentError):
            prefill_pages_cap(0, 4)
    with HostKVCache(provider, HSALT, engine, staging_allocator=OrdinaryAllocator()) as plain, \
            plain.lookup(ks, max_pages=2) as hit:  # any cache: the cap is not a hybrid option
        assert hit.num_pages == 2


def test_anchor_depths_are_absolute(provider: Provider, engine: CpuCopyEngine) -> None:
    # trap 6: anchor_positions(start_page=n) returns positions relative to page n
    with hcache(provider, engine, anchor_interval=4) as c:
        assert c.anchor_positions(6, start_page=6) == [1, 5]
        assert anchor_depths(c, 6, start_page=6) == [7, 11]


def test_lookup_reads_no_anchor_and_restore_copies_into_buffers(provider: Provider,
                                                               engine: CpuCopyEngine) -> None:
    # trap 7: lookup copied the anchor on the admission path; one name only was guaranteed
    calls: list[str] = []
    real = provider.get_anchor

    def counting(key: bytes, name: str) -> bytes | None:
        calls.append(name)
        return real(key, name)

    provider.get_anchor = counting  # type: ignore[method-assign]
    with hcache(provider, engine) as c:
        ks = c.keys(tokens(3 * 4, seed=7))
        c.save(ks, make_planes(7), list(range(3)), anchors=state).wait(30)
        hit = c.lookup(ks)
        assert hit.num_pages == 3 and calls == [] and hit.anchor is None
        bufs = {"ssm": bytearray(1000), "conv": np.zeros(16, np.uint8)}
        res = c.restore(hit, make_planes(), list(range(3)), anchors_into=bufs).wait(30)
        assert sorted(calls) == ["conv", "ssm"]
        assert bytes(bufs["ssm"][:500]) == b"ssm@2" * 100  # copied into the caller's buffer
        assert bytes(res.anchors["conv"]) == b"conv@2" and res.anchors["conv"].obj is not None
        with c.lookup(ks) as hit, pytest.raises(InvalidArgumentError):
            c.restore(hit, make_planes(), [0], anchors_into={"ssm": b"read-only"}, release=False)
        with c.lookup(ks) as hit:
            h = c.restore(hit, make_planes(), [0, 1, 2], anchors_into={"ssm": bytearray(3)}, release=False)
            with pytest.raises(InvalidArgumentError, match="holds 3 bytes"):
                h.wait(30)


@pytest.mark.parametrize("url", ["lmdb://{d}?budget=64MiB", "mmap://{d}?budget=64MiB",
                                 "tiered://?fast=pinned%3A%2F%2F%3Fbudget%3D8MiB&slow=lmdb%3A%2F%2F{q}%3Fbudget%3D64MiB"])
def test_restore_reads_anchors_once_into_buffers_on_every_provider(url: str, tmp_path: Path,
                                                                   engine: CpuCopyEngine) -> None:
    # trap 7: lmdb copied the anchor twice; every provider now copies it once, from its medium
    # into the caller's buffer (Provider.read_anchor), on the restore thread; get_anchor unused
    from urllib.parse import quote

    import hostkv_providers as hk

    prov = hk.open(url.format(d=tmp_path / "s", q=quote(str(tmp_path / "s"), safe="")))

    def no_get_anchor(key: bytes, name: str) -> bytes | None:
        raise AssertionError("get_anchor copies to bytes; the restore reads into the buffer")

    try:
        with hcache(prov, engine) as c:
            ks = c.keys(tokens(3 * 4, seed=13))
            big = {"conv": b"c" * 7, "ssm": bytes(range(256)) * 4096}  # 1 MiB of state
            c.save(ks, make_planes(13), list(range(3)), anchors={2: big}).wait(30)
            prov.get_anchor = no_get_anchor  # type: ignore[method-assign]
            bufs = {"ssm": np.zeros(1 << 20, np.uint8), "conv": bytearray(7)}
            with c.lookup(ks) as hit:
                res = c.restore(hit, make_planes(), list(range(3)), anchors_into=bufs, release=False).wait(30)
            assert (res.pages, res.anchor_page) == (3, 2)
            assert bufs["ssm"].tobytes() == big["ssm"] and bytes(bufs["conv"]) == big["conv"]
            assert res.anchors["ssm"].obj is bufs["ssm"]
            with c.lookup(ks) as hit:  # no buffer given: one copy into a fresh one
                res = c.restore(hit, make_planes(), list(range(3)), release=False).wait(30)
            assert bytes(res.anchors["ssm"]) == big["ssm"]
    finally:
        prov.close()


@pytest.mark.parametrize("scheme", ["lmdb", "mmap"])
def test_read_anchor_of_damaged_bytes_is_a_miss(scheme: str, tmp_path: Path) -> None:
    # read_anchor copies straight from the medium into the caller's buffers: damaged bytes there
    # (one buffer or a scatter read) fail the checksum and read as a miss, counted, never as data
    import hostkv_providers as hk

    prov = hk.open(f"{scheme}://{tmp_path / 's'}?budget=64MiB")
    try:
        key = bytes(range(32))
        with prov.reserve(key, None, 16) as res:  # type: ignore[union-attr]
            res.write(0, b"p" * 16)
            res.seal()
        blob = np.random.default_rng(17).integers(0, 256, 10_000, dtype=np.uint8).tobytes()
        for name in ("one", "two"):
            prov.put_anchor(key, name, blob)
        assert prov.read_anchor(key, "one", bytearray(len(blob))) == len(blob)
        needle = blob[1000:1064]
        hits = 0
        for f in sorted((tmp_path / "s").rglob("*")):
            if not f.is_file():
                continue
            data = bytearray(f.read_bytes())
            at = data.find(needle)
            while at >= 0:
                data[at + 10] ^= 0xFF
                hits += 1
                at = data.find(needle, at + 1)
            if hits:
                f.write_bytes(data)
        assert hits == 2  # both anchors damaged in place
        before = prov.stats().checksum_failures
        assert prov.read_anchor(key, "one", bytearray(len(blob))) is None
        assert prov.read_anchor(key, "two", [bytearray(48), bytearray(len(blob) - 48)]) is None
        assert prov.stats().checksum_failures == before + 2
        assert prov.list_anchors(key) == {}  # dropped, the entry stays
        assert prov.read_bytes(key) == b"p" * 16
    finally:
        prov.close()


class FailingAnchors(NoViews):
    name = "failing-anchors"

    def put_anchor(self, key: bytes, name: str, data: object) -> None:
        from hostkv_providers import CapacityError

        raise CapacityError("no room for the anchor")


def test_failed_anchor_write_rolls_back_stranded_pages(engine: CpuCopyEngine) -> None:
    # trap 7: a failed anchor write left sealed pages that could never be hit
    p = FailingAnchors(_pinned())
    with hcache(p, engine) as c:
        ks = c.keys(tokens(5 * 4, seed=8))
        r = c.save(ks, make_planes(8), list(range(5)), anchors={4: state(4)}).wait(30)
        assert r.stored == 5 and r.anchors == 0 and "rolled back" in (r.stopped or "")
        assert p.present(ks) == [False] * 5
        assert not c.lookup(ks, wait=False)


def test_drafter_group_restore_or_invalidate(provider: Provider, engine: CpuCopyEngine) -> None:
    # trap 8a: a stale drafter context after a restore is a foreign-state bug
    with hcache(provider, engine, required_anchors={"ssm"}, anchor_groups={"draft": {"draft.h", "draft.kv"}}) as c:
        ks = c.keys(tokens(4 * 4, seed=9))
        with pytest.raises(InvalidArgumentError, match="only in part"):
            c.save(ks, make_planes(9), list(range(4)), anchors={3: {"ssm": b"s", "draft.h": b"h"}})
        c.save(ks, make_planes(9), list(range(4)),
               anchors={1: {"ssm": b"s1", "draft.h": b"h1", "draft.kv": b"k1"}, 3: {"ssm": b"s3"}}).wait(30)
        with c.lookup(ks) as hit:  # at page 3 the drafter state is missing: invalidated
            res = c.restore(hit, make_planes(), list(range(4)), release=False).wait(30)
        assert res.pages == 4 and res.invalidated == ("draft",) and set(res.anchors) == {"ssm"}
        with c.lookup(ks, max_pages=2) as hit:  # at page 1 it is whole: restored with the state
            res = c.restore(hit, make_planes(), list(range(2)), release=False).wait(30)
        assert res.invalidated == () and bytes(res.anchors["draft.kv"]) == b"k1"
    with pytest.raises(InvalidArgumentError):
        hcache(provider, engine, required_anchors={"ssm"}, anchor_groups={"g": {"ssm"}})
    with pytest.raises(InvalidArgumentError):
        hcache(provider, engine, required_anchors="ssm")


def test_concurrent_identical_requests_cost_one_prefill(provider: Provider, engine: CpuCopyEngine) -> None:
    # trap 8b: N identical cold requests cost N prefills
    n_req = 6
    with hcache(provider, engine, coalesce_prefills=True, lookup_wait_timeout=20.0) as c:
        toks = tokens(5 * 4, seed=10)
        src = make_planes(10)
        prefills = 0
        count = threading.Lock()
        start = threading.Barrier(n_req)
        results: list[tuple[int, bytes]] = []

        def request() -> None:
            nonlocal prefills
            ks = c.keys(toks)
            start.wait()
            hit = c.lookup(ks)
            if hit.num_pages < len(ks):
                with count:
                    prefills += 1
                threading.Event().wait(0.3)  # the "prefill"
                c.save(ks, src, list(range(5)), anchors={4: state(4)}).wait(30)
                hit.release()
                with count:
                    results.append((5, b"prefilled"))
                return
            res = c.restore(hit, make_planes(), list(range(5))).wait(30)
            with count:
                results.append((res.pages, bytes(res.anchors["ssm"])))

        threads = [threading.Thread(target=request) for _ in range(n_req)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert prefills == 1
        assert sorted(results).count((5, b"ssm@4" * 100)) == n_req - 1
        # a producer that gives up wakes its twins at once
        ks = c.keys(tokens(2 * 4, seed=11))
        miss = c.lookup(ks)
        assert not miss and miss.hybrid is not None and prefill_pending(miss) is None
        twin = c.lookup(ks, wait=False)
        pending = prefill_pending(twin)
        assert pending is not None and not pending.is_set()
        abandon_prefill(twin)  # only the producer can abandon
        assert not pending.is_set()
        abandon_prefill(miss)
        assert pending.is_set()


def test_single_threaded_scheduler_defers_twins(provider: Provider, engine: CpuCopyEngine) -> None:
    # one thread for every request: lookups must not block; the twin is deferred, then restores
    with hcache(provider, engine, coalesce_prefills=True) as c:
        ks = c.keys(tokens(3 * 4, seed=12))
        producer = c.lookup(ks, wait=False)
        twin = c.lookup(ks, wait=False)
        pending = prefill_pending(twin)
        assert not producer and not twin and pending is not None and prefill_pending(producer) is None
        c.save(ks, make_planes(12), [0, 1, 2], anchors={2: state(2)}).wait(30)
        # set by the save's done callback, which may run just after wait() returns
        assert pending.wait(10)
        with c.lookup(ks, wait=False) as again:
            assert again.num_pages == 3 and prefill_pending(again) is None
