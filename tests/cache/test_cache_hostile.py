"""Hostile inputs for HostKVCache (issue 16 items 13/14): every public method with wrong types,
sizes and after close raises ``InvalidArgumentError``/``ClosedError`` and leaves the provider's
store unchanged.  The provider-generic part is in ``hostkv_providers.testing._hostile``."""

# Every lambda below is called in the loop iteration that made it.
# ruff: noqa: B023
from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from hostkv_providers import (
    ClosedError,
    HostKVCache,
    InvalidArgumentError,
    PinnedProvider,
    Provider,
)
from hostkv_providers.device import CpuCopyEngine, OrdinaryAllocator
from hostkv_providers.testing._hostile import BAD_KEYS, BAD_TIMEOUTS, expect_refused

from ._cache_common import NBLOCKS, PAGE, SALT, make_planes, tokens


@pytest.fixture
def setup() -> Iterator[tuple[HostKVCache, Provider, CpuCopyEngine]]:
    engine = CpuCopyEngine()
    provider = PinnedProvider(256 * PAGE, block=PAGE, allocator=OrdinaryAllocator())
    cache = HostKVCache(provider, SALT, engine, chunk_pages=3, staging_allocator=OrdinaryAllocator())
    yield cache, provider, engine
    cache.close()
    provider.close()
    engine.close()


def _state(provider: Provider, keys: list[bytes]) -> tuple[object, ...]:
    st = provider.stats()
    return (provider.present(keys), [provider.read_bytes(k) for k in keys], st.entries, st.used_bytes,
            st.in_flight, st.leased)


def _expect(provider: Provider, keys: list[bytes], method: str, call: Callable[[], object],
            errors: type[BaseException] | tuple[type[BaseException], ...] = InvalidArgumentError) -> None:
    before = _state(provider, keys)

    def unchanged() -> None:
        assert _state(provider, keys) == before, f"{method} changed the store"

    expect_refused(provider, f"HostKVCache.{method}", call, errors, unchanged=unchanged, what=method)


def test_hostile_constructor(setup: tuple[HostKVCache, Provider, CpuCopyEngine]) -> None:
    cache, provider, engine = setup
    keys = cache.keys(tokens(8))
    cache.save(keys, make_planes(1), [0, 1]).wait(30)
    kw: dict[str, object]
    for kw in ({"copy_engine": "x"}, {"copy_engine": 5}, {"admission": "x"}, {"admission": object()},
               {"staging_allocator": "x"}, {"wait_timeout": -1}, {"wait_timeout": math.nan},
               {"wait_timeout": "1"}, {"lookup_wait_timeout": -0.5}, {"lookup_wait_timeout": None},
               {"chunk_pages": 0}, {"chunk_pages": 1.5}, {"anchor_interval": -1}, {"seen_capacity": True}):
        args = {"staging_allocator": OrdinaryAllocator(), **kw}
        eng = args.pop("copy_engine", engine)
        _expect(provider, list(keys), "__init__",
                lambda: HostKVCache(provider, SALT, eng, **args))  # type: ignore[arg-type]
    _expect(provider, list(keys), "__init__", lambda: HostKVCache("pinned://", SALT, engine))  # type: ignore[arg-type]
    _expect(provider, list(keys), "__init__", lambda: HostKVCache(provider, "salt", engine))  # type: ignore[arg-type]


def test_hostile_methods(setup: tuple[HostKVCache, Provider, CpuCopyEngine]) -> None:
    cache, provider, _engine = setup
    src = make_planes(2)
    keys = cache.keys(tokens(16))  # 4 pages
    cache.save(keys[:2], src, [0, 1]).wait(30)
    stored = list(keys[:2])
    for start in ("x", -4, 1.5, None, True):
        _expect(provider, stored, "keys(start_token)", lambda: cache.keys(tokens(8), start_token=start))  # type: ignore[arg-type]
    _expect(provider, stored, "keys(start_token)", lambda: cache.keys(tokens(8), start_token=3))
    for parent in ("p", b"short", 5):
        _expect(provider, stored, "keys(parent)", lambda: cache.keys(tokens(8), parent=parent))  # type: ignore[arg-type]
    for args, kwargs in (((-1,), {}), ((1.5,), {}), (("3",), {}), ((4, [-1]), {}), ((4, ["a"]), {}),
                         ((4, [4]), {}), ((4, [True]), {}), ((4, 7), {}), ((4, "ab"), {}),
                         ((4,), {"start_page": -1}), ((4,), {"start_page": "1"}), ((4,), {"start_page": 1.0})):
        _expect(provider, stored, "anchor_positions", lambda: cache.anchor_positions(*args, **kwargs))  # type: ignore[arg-type]
    for bad in BAD_KEYS:
        _expect(provider, stored, "seen", lambda: cache.seen(bad))  # type: ignore[arg-type]
        _expect(provider, stored, "lookup", lambda: cache.lookup([keys[0], bad]))  # type: ignore[list-item]
    for need in ("", 5, "x" * 65):
        _expect(provider, stored, "lookup(need_anchor)", lambda: cache.lookup(keys, need_anchor=need))  # type: ignore[arg-type]
    _expect(provider, stored, "lookup(one key)", lambda: cache.lookup(keys[0]))  # type: ignore[arg-type]
    fresh = keys[2:4]
    for bids in (["a", "b"], [0.0, 1.0], [True, False], [1.7, 2.2], [-1, 2], [0, NBLOCKS], "ab", None, 5,
                 np.array([0.0, 1.0]), np.array([[0, 1]]), np.array([-1, 2]), np.array([0, NBLOCKS]),
                 np.array([0, 1, 2]), np.array([True, False]), [0], [0, 1, 2]):
        _expect(provider, stored, "save(block_ids)", lambda: cache.save(fresh, src, bids))  # type: ignore[arg-type]
    for kwargs in ({"start_page": -1, "parent": keys[1]}, {"start_page": 2}, {"parent": keys[1]},
                   {"checkpoints": [-1], "anchors": lambda i: None}, {"checkpoints": ["a"], "anchors": lambda i: None},
                   {"anchors": {0: {"": b"x"}}}, {"anchors": {9: {"a": b"x"}}}, {"anchors": 5},
                   {"anchors": {0: {"a": 5}}}, {"parent": b"short", "start_page": 2}):
        _expect(provider, stored, "save(kwargs)", lambda: cache.save(fresh, src, [2, 3], **kwargs))  # type: ignore[arg-type]
    _expect(provider, stored, "save(planes)", lambda: cache.save(fresh, "planes", [2, 3]))
    _expect(provider, stored, "save(planes)", lambda: cache.save(fresh, src[:-1], [2, 3]))
    hit = cache.lookup(stored)
    dst = make_planes(None)
    for bids in (["a", "b"], [0.5, 1], [True, 1], [-1, 0], [0, 1, 2], None, np.array([-1, 0]),
                 np.array([0, NBLOCKS], dtype=np.uint32), np.array([0.0, 1.0])):
        _expect(provider, stored, "restore(block_ids)", lambda: cache.restore(hit, dst, bids))  # type: ignore[arg-type]
    _expect(provider, stored, "restore(hit)", lambda: cache.restore("hit", dst, [0]))  # type: ignore[arg-type]
    _expect(provider, stored, "restore(planes)", lambda: cache.restore(hit, None, [0, 1]))
    hit.release()
    for t in BAD_TIMEOUTS:
        if t is None:
            continue
        _expect(provider, stored, "flush(timeout)", lambda: cache.flush(t))  # type: ignore[arg-type]
    handle = cache.save(stored, src, [0, 1])
    handle.wait(30)
    for t in (-1, math.nan, "1"):
        _expect(provider, stored, "CacheHandle.wait(timeout)", lambda: handle.wait(t))  # type: ignore[arg-type]
        _expect(provider, stored, "CacheHandle.wait_copied(timeout)", lambda: handle.wait_copied(t))  # type: ignore[arg-type]
    assert cache.flush(30) is True
    # after close: every method raises ClosedError, flush too (it used to raise RuntimeError
    # "cannot schedule new futures after shutdown")
    cache.close()
    for method, call in (("flush", cache.flush), ("flush(timeout)", lambda: cache.flush(1.0)),
                         ("lookup", lambda: cache.lookup(stored)), ("save", lambda: cache.save(fresh, src, [2, 3])),
                         ("restore", lambda: cache.restore(hit, dst, [0, 1]))):
        _expect(provider, stored, f"closed:{method}", call, ClosedError)
    cache.close()  # idempotent
