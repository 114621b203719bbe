"""What an operation leaves to the garbage collector."""

from __future__ import annotations

import gc
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any


def cycles_left_by(op: Callable[[], object], settle: Callable[[], object] | None = None) -> Counter[str]:
    """Run ``op`` with the collector off and return the types of the objects it left in
    reference cycles (what a collection then finds as garbage), by count; empty when none.

    Why it matters to an engine: garbage in a cycle is freed only by the collector, and objects
    of a transfer that is in flight survive the young collections into the oldest generation,
    whose growth sets off a *full* pass of the engine's process (~100 ms with torch loaded, a
    decode step stalled for as long).  A save or restore through :class:`HostKVCache` should
    leave none; so should an integration's own per-request code.  Anything ``op`` keeps
    reachable (caches, pools, threads made on first use) is not garbage: warm ``op`` up first.
    ``settle``: called after ``op`` and before the collection, to wait until the threads that
    finished ``op``'s work have let go of it (a cycle still referenced there is not garbage yet).
    The collector's debug flags and anything already in ``gc.garbage`` are left as they were.
    """
    gc.collect()
    was, flags, before = gc.isenabled(), gc.get_debug(), len(gc.garbage)
    gc.disable()
    gc.set_debug(flags | gc.DEBUG_SAVEALL)
    try:
        op()
        if settle is not None:
            settle()
        gc.collect()
        return Counter(type(o).__qualname__ for o in gc.garbage[before:])
    finally:
        gc.set_debug(flags)
        del gc.garbage[before:]
        gc.collect()  # (the cycles just found, now unreferenced again: not left for a full pass later)
        if was:
            gc.enable()


def cache_settled(cache: Any) -> None:
    """Wait until a :class:`HostKVCache`'s save and restore threads are idle (a handle reads as
    done a little before its thread lets go of the job): the ``settle`` of
    :func:`cycles_left_by` for operations through the cache."""
    cache._save_pool.submit(lambda: None).result()
    pool = cache._restore_pool
    barrier = threading.Barrier(pool._max_workers)  # every restore thread free at once
    for f in [pool.submit(barrier.wait) for _ in range(pool._max_workers)]:
        f.result()
