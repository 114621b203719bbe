"""HostKVCache under concurrency and eviction pressure: never wrong bytes.

Every page's content is a pure function of its key, so each thread can check every restored
block against the key it was restored for, while other threads save, look up, restore and evict
over a budget far smaller than the working set.  Also: the tiered provider's write-back racing
an eviction never copies memory that was handed to another page.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from hostkv_providers import KVLayout, PinnedProvider, Provider, Salt
from hostkv_providers.cache._cache import HostKVCache
from hostkv_providers.device._copy import CpuCopyEngine
from hostkv_providers.device._hostmem import OrdinaryAllocator
from hostkv_providers.providers.tiered._provider import TieredProvider
from hostkv_providers.testing._pages import key_of, page_bytes

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, page_tokens=4, dtype="uint8")  # 2 KiB pages
PAGE = LAYOUT.page_nbytes
BLOCK = 4096
THREADS = 4
BLOCKS_PER_THREAD = 64


def fill(planes: list[np.ndarray], block: int, content: bytes) -> None:
    for spec, arr in zip(LAYOUT.planes, planes, strict=True):
        arr[block].reshape(-1)[:] = np.frombuffer(content, np.uint8, spec.nbytes, spec.offset)


def read_back(planes: list[np.ndarray], block: int) -> bytes:
    return b"".join(arr[block].tobytes() for arr in planes)


@pytest.fixture(params=["pinned", "tiered"])
def provider(request: pytest.FixtureRequest) -> Iterator[Provider]:
    budget = 40 * BLOCK  # far less than the ~300 distinct pages the threads touch
    p: Provider
    if request.param == "pinned":
        p = PinnedProvider(budget, block=BLOCK, allocator=OrdinaryAllocator())
    else:
        p = TieredProvider(PinnedProvider(24 * BLOCK, block=BLOCK, allocator=OrdinaryAllocator()),
                           PinnedProvider(2 * budget, block=BLOCK, allocator=OrdinaryAllocator()),
                           budget_bytes=budget, queue_pages=8)
    yield p
    p.close()


def test_concurrent_saves_lookups_restores_never_return_wrong_bytes(provider: Provider) -> None:
    engine = CpuCopyEngine()
    cache = HostKVCache(provider, Salt("stress", LAYOUT), engine, chunk_pages=3,
                        staging_allocator=OrdinaryAllocator())
    shape = (THREADS * BLOCKS_PER_THREAD, LAYOUT.page_tokens, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    planes = [np.zeros(shape, np.uint8) for _ in LAYOUT.planes]
    prefixes = [np.random.default_rng(i).integers(0, 1000, 4 * 6) for i in range(3)]
    errors: list[str] = []
    counts = {"restored": 0, "saved": 0}
    lock = threading.Lock()

    def worker(t: int) -> None:
        rnd = random.Random(t)
        base = t * BLOCKS_PER_THREAD
        try:
            for _ in range(25):
                prefix = prefixes[rnd.randrange(3)]
                tail = np.array([rnd.randrange(1000) for _ in range(4 * rnd.randrange(0, 6))], dtype=np.int64)
                keys = cache.keys(np.concatenate([prefix, tail]))
                src = list(range(base, base + len(keys)))
                for b, k in zip(src, keys, strict=True):
                    fill(planes, b, page_bytes(k, PAGE))
                res = cache.save(keys, planes, src).wait(60)
                hit = cache.lookup(keys)
                dst = list(range(base + 32, base + 32 + hit.num_pages))
                out = cache.restore(hit, planes, dst).wait(60)
                for i in range(out.pages):
                    if read_back(planes, dst[i]) != page_bytes(keys[i], PAGE):
                        errors.append(f"thread {t}: wrong bytes for page {i}")
                with lock:
                    counts["restored"] += out.pages
                    counts["saved"] += res.stored
        except Exception as exc:  # surfaced below
            errors.append(f"thread {t}: {exc!r}")

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(THREADS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    cache.close()
    engine.close()
    assert not errors, errors[:5]
    st = provider.stats()
    assert st.used_bytes <= st.budget_bytes
    assert counts["restored"] > 0 and counts["saved"] > 0
    assert st.evictions > 0  # the budget really was under pressure


class _BlockingSlow(PinnedProvider):
    """A slow tier whose write of one chosen key blocks until released, recording what it got."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.block_key: bytes | None = None
        self.entered = threading.Event()
        self.release = threading.Event()
        self.written: dict[bytes, bytes] = {}

    def write(self, reservation: object, offset: int, data: object) -> None:
        if reservation.key == self.block_key:  # type: ignore[attr-defined]
            self.entered.set()
            assert self.release.wait(30)
            self.written[reservation.key] = bytes(memoryview(data).cast("B"))  # type: ignore[attr-defined,arg-type]
        super().write(reservation, offset, data)  # type: ignore[arg-type]


def test_eviction_during_write_back_keeps_the_copied_memory(tmp_path: Path) -> None:
    fast = PinnedProvider(2 * BLOCK, block=BLOCK, allocator=OrdinaryAllocator())
    slow = _BlockingSlow(16 * BLOCK, block=BLOCK, allocator=OrdinaryAllocator())
    t = TieredProvider(fast, slow, budget_bytes=8 * BLOCK)
    try:
        a, b, c = key_of("race-a"), key_of("race-b"), key_of("race-c")
        slow.block_key = a
        t.put(a, None, page_bytes(a, BLOCK))
        assert slow.entered.wait(30)  # the writer is copying a's bytes out of the fast tier
        assert t.evict([a]).entries == 1
        assert t.present([a]) == [False]
        # a new page wants fast-tier memory; a's block must not be handed out meanwhile
        t.put(b, None, page_bytes(b, BLOCK))
        assert fast.present([a, b]) == [True, True]  # a is still pinned there, b took the other block
        slow.release.set()
        assert t.flush(30)
        assert slow.written[a] == page_bytes(a, BLOCK)  # the copy read a's bytes, not b's
        assert slow.present([a]) == [False] and fast.present([a]) == [False]  # undone in both tiers
        t.put(c, None, page_bytes(c, BLOCK))  # a's block is free again
        for k in (b, c):
            assert t.read_bytes(k) == page_bytes(k, BLOCK)
        assert t.flush(30) and slow.read_bytes(b) == page_bytes(b, BLOCK)
    finally:
        slow.release.set()
        t.close()
