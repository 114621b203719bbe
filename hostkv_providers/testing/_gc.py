"""What an operation leaves to the garbage collector."""

from __future__ import annotations

import gc
from collections import Counter
from collections.abc import Callable


def cycles_left_by(op: Callable[[], object]) -> Counter[str]:
    """Run ``op`` with the collector off and return the types of the objects it left in
    reference cycles (what a collection then finds as garbage), by count; empty when none.

    Why it matters to an engine: garbage in a cycle is freed only by the collector, and objects
    of a transfer that is in flight survive the young collections into the oldest generation,
    whose growth sets off a *full* pass of the engine's process (~100 ms with torch loaded, a
    decode step stalled for as long).  A save or restore through :class:`HostKVCache` should
    leave none; so should an integration's own per-request objects.  Anything ``op`` keeps
    reachable (caches, pools, threads made on first use) is not garbage: warm ``op`` up first.
    """
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        op()
        gc.collect()
        return Counter(type(o).__qualname__ for o in gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        if was:
            gc.enable()
