"""Review mends of the provider authors' kit (a helper wrote a provider the way
docs/writing-a-provider.md says; each test failed before): ``IndexedProvider`` published an entry
whose ``_store`` raised (visible with no bytes, chained under, then dropped as corrupt at the first
read), and a ``_discard`` that raised inside ``reserve`` left the key in flight for good; anchors
added to a retained entry grew the retained bytes past ``retain_share`` (every later reservation
then failed); the suite's cut points assumed 4 KiB pages; two of its families were not exported."""

from __future__ import annotations

import errno
from collections.abc import Sequence
from pathlib import Path

import pytest

import hostkv_providers as hk
from hostkv_dictstore import DictProvider
from hostkv_providers import CapacityError, PinnedProvider
from hostkv_providers.device._hostmem import OrdinaryAllocator
from hostkv_providers.testing import ProviderTests, key_of, page_bytes, put_page

P = 4096


class Flaky(DictProvider):
    fail_store = False
    fail_discard = False

    def _store(self, key: hk.Key, data: bytes) -> None:
        if self.fail_store:
            raise OSError(errno.ENOSPC, "No space left on device")
        super()._store(key, data)

    def _discard(self, keys: Sequence[hk.Key]) -> None:
        if self.fail_discard:
            raise OSError(errno.EIO, "I/O error")
        super()._discard(keys)


def test_a_seal_whose_store_fails_publishes_nothing() -> None:
    p = Flaky(16 * P)
    k, child = key_of("store-fails"), key_of("store-fails-child")
    res = p.reserve(k, None, P)
    assert res is not None
    res.write(0, page_bytes(k, P))
    p.fail_store = True
    with pytest.raises(OSError):
        p.seal(res)
    p.fail_store = False
    assert res.state == "aborted"
    assert p.present([k]) == [False] and p.entry(k) is None and p.longest_prefix([k]) == 0
    assert not p.in_flight(k)
    with pytest.raises(hk.UnknownKeyError):
        p.reserve(child, k, P)  # nothing to chain onto
    assert p.read(k, bytearray(P)) is False and p.stats().checksum_failures == 0
    put_page(p, k, None, P)  # the key saves again
    assert p.read_bytes(k) == page_bytes(k, P)


def test_a_discard_that_fails_inside_reserve_leaves_no_flight_behind() -> None:
    p = Flaky(2 * P)
    a, b, c = key_of("d-a"), key_of("d-b"), key_of("d-c")
    put_page(p, a, None, P)
    put_page(p, b, None, P)
    p.fail_discard = True
    with pytest.warns(ResourceWarning, match="discarding"):
        res = p.reserve(c, None, P)  # evicts a for room; forgetting a's bytes fails
    p.fail_discard = False
    assert res is not None
    res.write(0, page_bytes(c, P))
    p.seal(res)
    assert p.present([a, b, c]) == [False, True, True]
    assert p.read_bytes(c) == page_bytes(c, P)
    assert p.stats().in_flight == 0


def _pinned(budget: int) -> PinnedProvider:
    return PinnedProvider(budget, block=P, chunk=budget, allocator=OrdinaryAllocator(), background=False,
                          prefault=False)


@pytest.mark.parametrize("kind", ["indexed", "pinned", "mmap", "lmdb", "tiered"])
def test_anchors_on_a_retained_entry_stay_within_retain_share(tmp_path: Path, kind: str) -> None:
    budget = 16 * P
    if kind == "indexed":
        p: hk.Provider = DictProvider(budget)
    elif kind == "pinned":
        p = _pinned(budget)
    elif kind == "mmap":
        p = hk.open(f"mmap://{tmp_path / 'm'}?budget={budget}&slot={P}")
    elif kind == "lmdb":
        p = hk.open(f"lmdb://{tmp_path / 'l'}?budget={budget}")
    else:
        p = hk.TieredProvider(_pinned(budget), hk.open(f"mmap://{tmp_path / 's'}?budget={4 * budget}&slot={P}"))
    try:
        k = key_of("system-prompt")
        put_page(p, k, None, P)
        assert p.retain([k]) == 1  # retain_share 0.5: half the budget retained at most
        share = p.stats().budget_bytes // 2
        with pytest.raises(CapacityError, match="retain"):
            p.put_anchor(k, "state", b"s" * share)  # with the page: past the share
        st = p.stats()
        assert st.retained_bytes <= 0.5 * st.budget_bytes
        p.put_anchor(k, "state", b"s" * (2 * P))  # within the share: fine
        res = p.reserve(key_of("next-request"), None, 2 * P)  # not wedged
        assert res is not None
        res.abort()
    finally:
        p.close()


@pytest.mark.parametrize("page", [256, 1024])
def test_the_suite_runs_at_small_page_sizes(page: int, pytester: pytest.Pytester) -> None:
    """The suite's cut points scale with page_nbytes (at 1 KiB, 4 of its tests failed a correct
    provider with SpanError)."""
    pytester.makepyfile(f"""
        from hostkv_dictstore import DictProvider
        from hostkv_providers.testing import ProviderTests

        class TestSmallPages(ProviderTests):
            page_nbytes = {page}
            default_budget_pages = 64

            def make_provider(self, tmp_path, budget_bytes):
                return DictProvider(budget_bytes)
        """)
    got = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider", "-k",
                                        "spans or pieces or contiguous_buffer or incomplete")
    outcomes = got.parseoutcomes()
    assert got.ret == 0 and outcomes.get("failed", 0) == 0 and outcomes["passed"] >= 4, outcomes


def test_every_family_of_the_suite_is_public_and_on_suitebase() -> None:
    import hostkv_providers.testing as t

    families = [c for c in ProviderTests.__mro__ if c.__name__.endswith("Tests") and c is not ProviderTests]
    assert {c.__name__ for c in families} <= set(t.__all__)
    assert all(issubclass(c, t.SuiteBase) for c in families)
