"""Admission policies: which pages of a save a :class:`~hostkv_providers.cache.HostKVCache` stores."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from hostkv_providers._errors import (
    InvalidArgumentError,
)
from hostkv_providers._keys import Key

# --------------------------------------------------------------------------------------------
# Admission
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AdmissionRequest:
    """What a policy sees of one save: the chain, its depth, anchors and how often pages were seen."""

    keys: Sequence[Key]
    start_page: int  # depth of keys[0] in its chain (0 for a root)
    anchored: frozenset[int]  # indices into keys of pages the save attaches anchors to
    seen: Callable[[Key], int]  # how many lookups included this key (bounded memory)


class AdmissionPolicy(Protocol):
    """Decides how many leading pages of a save are stored (a prefix, so chains stay closed)."""

    def admit(self, request: AdmissionRequest) -> int: ...


@dataclass(frozen=True)
class AdmitAll:
    """Store every page."""

    def admit(self, request: AdmissionRequest) -> int:
        return len(request.keys)


@dataclass(frozen=True)
class MinDepth:
    """Store a chain only when it is at least ``pages`` pages deep (short prompts are cheap to
    recompute and not worth budget)."""

    pages: int

    def __post_init__(self) -> None:
        if type(self.pages) is not int or self.pages < 0:
            raise InvalidArgumentError(f"MinDepth.pages must be an int >= 0, got {self.pages!r}")

    def admit(self, request: AdmissionRequest) -> int:
        depth = request.start_page + len(request.keys)
        return len(request.keys) if depth >= self.pages else 0


@dataclass(frozen=True)
class SeenAtLeast:
    """Store the longest prefix whose pages were looked up at least ``times`` times, so a one-shot
    long prompt does not push reusable roots out of the budget."""

    times: int

    def __post_init__(self) -> None:
        if type(self.times) is not int or self.times < 1:
            raise InvalidArgumentError(f"SeenAtLeast.times must be an int >= 1, got {self.times!r}")

    def admit(self, request: AdmissionRequest) -> int:
        n = 0
        for k in request.keys:
            if request.seen(k) < self.times:
                break
            n += 1
        return n


@dataclass(frozen=True)
class AnchorsOnly:
    """Store the chain only up to its deepest page that carries an anchor in this save (for
    hybrid models, KV beyond the last anchor is unusable)."""

    def admit(self, request: AdmissionRequest) -> int:
        return max(request.anchored) + 1 if request.anchored else 0


@dataclass(frozen=True)
class AllOf:
    """Every policy must agree: the shortest admitted prefix wins."""

    policies: tuple[AdmissionPolicy, ...]

    def __init__(self, *policies: AdmissionPolicy) -> None:
        object.__setattr__(self, "policies", tuple(policies))

    def admit(self, request: AdmissionRequest) -> int:
        return min((p.admit(request) for p in self.policies), default=len(request.keys))
