"""The conformance suite catches broken providers.

Each broken provider below is the pinned provider with one rule of the contract violated on
purpose.  We run the relevant suite tests against it in a nested pytest session (``pytester``)
and require every one of them to fail — and the same tests to pass against the healthy pinned
provider, so a failure is the rule being caught and not a broken test.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import pytest
from hypothesis import Phase

from hostkv_providers import ByteSpan, CapacityError, Key, Lease, PinnedProvider, Provider, Reservation
from hostkv_providers.device._hostmem import OrdinaryAllocator
from hostkv_providers.providers._tree import TreeIndex
from hostkv_providers.testing import ProviderTests

PAGE = 4096
HERE = Path(__file__).resolve().parent


# --------------------------------------------------------------------------------------------
# Broken providers
# --------------------------------------------------------------------------------------------
class _PuncturingIndex(TreeIndex):
    """Evicts the least recently used *entry*, leaf or not: chains get holes."""

    def _evict_lru(self, need: int) -> list[int]:  # the eviction-policy hook
        out: list[int] = []
        freed = 0
        rows = [int(r) for r in self.live_rows()]
        for row in sorted(rows, key=lambda r: int(self.tick[r])):
            if freed >= need:
                break
            if self.hold[row] or self.retained[row]:
                continue
            self.children[row] = 0  # orphan the children instead of refusing
            freed += int(self.cost[row])
            self._remove(row)
            out.append(row)
        return out


class _MostRecentIndex(TreeIndex):
    """Evicts the most recently used leaf first (MRU instead of LRU)."""

    def _evict_lru(self, need: int) -> list[int]:  # the eviction-policy hook
        out: list[int] = []
        freed = 0
        while freed < need:
            leaves = [int(r) for r in self.live_rows()
                      if not self.children[r] and not self.hold[r] and not self.retained[r]]
            if not leaves:
                break
            row = max(leaves, key=lambda r: int(self.tick[r]))
            freed += int(self.cost[row])
            self._remove(row)
            out.append(row)
        heapq.heapify(self._heap)
        return out


class _BasePinned(PinnedProvider):
    def __init__(self, budget_bytes: int) -> None:
        super().__init__(budget_bytes, block=PAGE, allocator=OrdinaryAllocator(), verify_reads=True)


class PuncturingProvider(_BasePinned):
    def __init__(self, budget_bytes: int) -> None:
        super().__init__(budget_bytes)
        self._index = _PuncturingIndex(self._index.budget)


class MostRecentFirstProvider(_BasePinned):
    def __init__(self, budget_bytes: int) -> None:
        super().__init__(budget_bytes)
        self._index = _MostRecentIndex(self._index.budget)


class VisibleAfterAbortProvider(_BasePinned):
    """``abort`` publishes whatever was written (a failed write left visible)."""

    def abort(self, reservation: Reservation) -> None:
        if reservation.state == "open" and reservation.complete:
            self.seal(reservation)
            reservation._finish("aborted")
            return
        super().abort(reservation)


class OverBudgetProvider(_BasePinned):
    """Claims half the memory it actually fills: ``used_bytes`` runs past ``budget_bytes``."""

    def __init__(self, budget_bytes: int) -> None:
        super().__init__(2 * budget_bytes)
        self._claimed = budget_bytes

    @property
    def budget_bytes(self) -> int:
        return self._claimed

    def stats(self) -> Any:
        st = super().stats()
        st.budget_bytes = self._claimed
        return st


class LeaseIgnoringProvider(_BasePinned):
    """``lease`` reports presence but pins nothing."""

    def lease(self, keys: Sequence[bytes]) -> Lease:
        ks = self._keys(keys)
        return Lease(self, ks, self.present(ks), token=[])


class EvictThenRefuseProvider(_BasePinned):
    """Wipes the cache before refusing a request that can never fit (no satisfiability guard)."""

    def reserve(self, key: bytes, parent: bytes | None, nbytes: int, *, salt_tag: str = "") -> Reservation | None:
        try:
            return super().reserve(key, parent, nbytes, salt_tag=salt_tag)
        except CapacityError:
            self.evict(nbytes=self.budget_bytes)
            raise


class SpanIgnoringProvider(_BasePinned):
    """Reads every span from offset 0 (returns bytes of the wrong part of the entry)."""

    def read(self, key: bytes, out: object, span: ByteSpan | None = None) -> bool:
        if span is not None and isinstance(span, ByteSpan) and span.offset:
            span = ByteSpan(0, span.nbytes)
        return super().read(key, out, span)


class OverwritingProvider(_BasePinned):
    """No dedup: a sealed key is evicted and reserved again, so a second writer overwrites it."""

    def reserve(self, key: bytes, parent: bytes | None, nbytes: int, *, salt_tag: str = "") -> Reservation | None:
        if self.present([key])[0]:
            self.evict([key])
        return super().reserve(key, parent, nbytes, salt_tag=salt_tag)


class UncheckedReadsProvider(PinnedProvider):
    """Never checks the seal-time checksum: corrupted memory is handed out as a hit."""

    def __init__(self, budget_bytes: int) -> None:
        super().__init__(budget_bytes, block=PAGE, allocator=OrdinaryAllocator(), verify_reads=False)


class ForkBlindProvider(_BasePinned):
    """Ignores the process id: a forked child uses the parent's memory as its own."""

    def _check_usable(self) -> None:
        if self._closed:
            super()._check_usable()


# --------------------------------------------------------------------------------------------
# Suite bindings (no Test prefix: only the nested sessions collect them)
# --------------------------------------------------------------------------------------------
class BoundSuite(ProviderTests):
    provider_class: type[PinnedProvider] = _BasePinned
    # a falsifying example is all we need here; shrinking it would only cost time
    stateful_settings: ClassVar[dict[str, Any]] = {"phases": [Phase.explicit, Phase.reuse, Phase.generate]}

    def make_provider(self, tmp_path: Path, budget_bytes: int) -> Provider:
        return self.provider_class(budget_bytes)

    def backdoor_read(self, provider: Provider, key: Key) -> bytes | None:
        assert isinstance(provider, PinnedProvider)
        regions = provider._entry_regions(key)
        return None if regions is None else b"".join(bytes(r.view) for r in regions)

    def backdoor_corrupt(self, provider: Provider, key: Key) -> None:
        assert isinstance(provider, PinnedProvider)
        regions = provider._entry_regions(key)
        assert regions is not None
        regions[0].view[5] ^= 0xFF


#: broken provider -> the suite tests (``-k`` expression) that must catch it
CASES: dict[str, tuple[type[PinnedProvider], str]] = {
    "puncture": (PuncturingProvider,
                 "never_punctures or leaves_before_their_parents or test_stateful"),
    "mru": (MostRecentFirstProvider, "lru_leaf_order or pressure_evicts_lru"),
    "visible_after_abort": (VisibleAfterAbortProvider, "abort_leaves_no_trace or test_stateful"),
    "over_budget": (OverBudgetProvider, "budget_never_exceeded or test_stateful"),
    "lease_ignored": (LeaseIgnoringProvider,
                      "leased_entries_survive or evict_keys_skips_leased or test_stateful"),
    "evict_then_refuse": (EvictThenRefuseProvider,
                          "unsatisfiable_reserve_evicts_nothing or larger_than_budget or in_flight_space"),
    "span_ignored": (SpanIgnoringProvider, "test_read_spans or test_stateful"),
    "overwrite": (OverwritingProvider, "test_dedup_of_sealed_key or test_stateful"),
    "unchecked_reads": (UncheckedReadsProvider, "checksum_failure"),
    "fork_blind": (ForkBlindProvider, "test_use_after_fork"),
}

_MODULE = """
import sys
sys.path.insert(0, {here!r})
from test_suite_selftest import BoundSuite, {cls}

class TestTarget(BoundSuite):
    provider_class = {cls}
"""


def _run(pytester: pytest.Pytester, cls: type[PinnedProvider], select: str) -> tuple[list[str], list[str]]:
    pytester.makepyfile(test_target=_MODULE.format(here=str(HERE), cls=cls.__name__))
    reprec = pytester.inline_run("-p", "no:cacheprovider", "-k", select, "-q")
    passed, skipped, failed = reprec.listoutcomes()
    assert not skipped, [r.nodeid for r in skipped]
    return [r.nodeid for r in passed], [r.nodeid for r in failed]


@pytest.mark.parametrize("case", sorted(CASES))
def test_suite_catches_broken_provider(pytester: pytest.Pytester, case: str) -> None:
    cls, select = CASES[case]
    passed, failed = _run(pytester, cls, select)
    assert failed, f"no test selected by {select!r} ran"
    assert passed == [], f"{case}: these tests did not catch the bug: {passed}"
    # every alternative of the selection caught it (not just one of them)
    for alternative in select.split(" or "):
        assert any(alternative.strip() in nodeid for nodeid in failed), f"{alternative} did not fail"


def test_same_tests_pass_on_healthy_provider(pytester: pytest.Pytester) -> None:
    select = " or ".join(sorted({alt.strip() for _, sel in CASES.values() for alt in sel.split(" or ")}))
    passed, failed = _run(pytester, _BasePinned, select)
    assert failed == []
    assert len(passed) >= len(CASES)
