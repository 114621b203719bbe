"""A page evicted while the write-back was copying it out of the fast tier, then saved again
with new bytes: the fast tier still held the old copy (pinned by the writer's batch), the new
run went to a heap run, and reads were served the old bytes from the fast tier until the batch
ended (a review helper's finding; fails before). The save now waits for the batch to let the
old copy go, and evicts it first."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import hostkv_providers as hk
from hostkv_providers import PinnedProvider
from hostkv_providers.device import OrdinaryAllocator
from hostkv_providers.testing import key_of

PAGE = 4096


def test_a_key_saved_again_during_its_write_back_reads_its_new_bytes(tmp_path: Path) -> None:
    fast = PinnedProvider(8 * PAGE, block=PAGE, allocator=OrdinaryAllocator())
    slow = hk.open(f"mmap://{tmp_path / 'slow'}?budget={512 * PAGE}&slot={PAGE}&durability=none")
    t = hk.TieredProvider(fast, slow, budget_bytes=256 * PAGE)
    entered, go = threading.Event(), threading.Event()
    orig = slow.put_many  # type: ignore[attr-defined]

    def held(items: Any, **kw: Any) -> Any:  # the writer's batch, held until released
        if threading.current_thread() is t._writer and not go.is_set():
            entered.set()
            assert go.wait(30)
        return orig(items, **kw)

    slow.put_many = held  # type: ignore[attr-defined]
    try:
        k, c = key_of("resaved"), key_of("resaved-child")
        old, new = b"A" * PAGE, b"B" * PAGE
        assert t.put_many([(k, None, old), (c, k, old)]) == [True, True]  # type: ignore[attr-defined]
        assert entered.wait(10)  # the writer is copying the run out (its fast copies pinned)
        assert t.evict([k]).entries == 2
        threading.Timer(0.5, go.set).start()  # the batch ends a moment later
        assert t.put_many([(k, None, new), (c, k, new)]) == [True, True]  # type: ignore[attr-defined]
        assert t.read_bytes(k) == new and t.read_bytes(c) == new
        outs = [bytearray(PAGE), bytearray(PAGE)]
        assert t.read_many([k, c], outs) == [True, True] and outs == [new, new]  # type: ignore[attr-defined]
        t.flush()  # type: ignore[attr-defined]
        assert t.read_bytes(k) == new
    finally:
        go.set()
        t.close()
