"""Shared by the engine side-by-side benchmarks: memoise a test helper's page generator.

The engine helpers compute a page's expected bytes from its key (a PRNG), which is what the tests
want; a throughput benchmark that regenerated them on every store and load would time the PRNG.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType


def memoize(module: ModuleType, name: str) -> None:
    """Replace ``module.name`` (a page generator) by a memoised version of itself."""
    gen: Callable[..., object] = getattr(module, name)
    memo: dict[object, object] = {}

    def cached(*args: object) -> object:
        key = tuple(bytes(a) if isinstance(a, (bytes, bytearray)) else (a if isinstance(a, int) else str(a))
                    for a in args)
        if key not in memo:
            memo[key] = gen(*args)
        return memo[key]

    setattr(module, name, cached)
