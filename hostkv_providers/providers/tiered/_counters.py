"""The tiered provider's figures: ``stats()``, and the store-wide counters it publishes into the
slow tier's counters file (``store_counters()``, ``counters_view()``)."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping

import numpy as np

from hostkv_providers._capabilities import SupportsStoreCounters
from hostkv_providers._errors import HostKVError
from hostkv_providers._reports import ProviderStats
from hostkv_providers.providers._counters import STORE_COUNTED

from ._base import _log, _TieredBase

_EXTRA_COUNTERS = frozenset(("promotions", "write_backs", "write_back_failures", "write_through", "fast_hits",
                             "slow_hits"))
#: Gauges of the write-back pipeline in ``store_counters()``: pages queued, and the age in ms of
#: the oldest page not yet in the slow tier (the write-back lag).
_GAUGES = ("write_back_queue", "write_back_lag_ms")
#: How often (seconds) the write-back thread publishes this instance's tiered figures into the
#: slow tier's store-wide counters (also on flush(), store_counters() and close()).
_PUBLISH_EVERY = 0.25


class _Figures(_TieredBase):
    """Stats and store-wide counters (a part of :class:`TieredProvider`)."""

    def stats(self) -> ProviderStats:
        self._check_usable()  # before the lock: a forked child must not wait on a copied lock
        with self._lock:
            self._check_usable()
            idx = self._index
            pending = sum(1 for p in self._pend.values() if idx.is_live(p.row, p.gen))
            for run in self._pend_runs.values():
                gens = np.arange(run.gen0, run.gen0 + run.n, dtype=np.uint64)
                pending += int((run.waiting & idx.alive[run.rows] & (idx.gen[run.rows] == gens)).sum())
            return ProviderStats(
                name=self.name,
                budget_bytes=self._budget,
                **idx.stats_fields(),
                extra={"pending_write_back": pending, "fast": self.fast.name, "slow": self.slow.name,
                       **self._counters},
                **self._tallies(),
            )

    # -- store-wide counters -----------------------------------------------------------
    def _figures(self) -> dict[str, int]:
        """This instance's cumulative figures, under the names they have in the slow tier's
        counters file: ``tiered.<counter>`` (the composite's own), ``fast.<counter>`` (the fast
        tier's: in-process memory), ``tiered.<pipeline counter>``."""
        fst = self.fast.stats()
        with self._lock:
            idx = self._index
            out = {f"tiered.{k}": v for k, v in self._tallies().items() if k in STORE_COUNTED}
            out["tiered.evictions"], out["tiered.evicted_bytes"] = idx.evictions, idx.evicted_cost
            out.update({f"tiered.{k}": v for k, v in self._counters.items()})
        out.update({f"fast.{k}": int(getattr(fst, k)) for k in STORE_COUNTED})
        return out

    def _gauges(self) -> dict[str, int]:
        with self._queue.mutex:
            head = self._queue.queue[0] if self._queue.queue else None
        since = [t for t in (self._wb_since, head[1].created if head and head[0] == "page" else 0.0) if t]
        lag = int(max(0.0, time.time() - min(since)) * 1000) if since else 0
        return {"tiered.write_back_queue": max(0, self._queued_pages), "tiered.write_back_lag_ms": lag}

    def _publish(self, *, final: bool = False) -> dict[str, int]:
        """Add what changed since the last call to the slow tier's store-wide counters (when it
        keeps them in its store: mmap, lmdb) and set the pipeline gauges; returns the figures."""
        with self._publish_lock:
            self._publish_at = time.monotonic() + _PUBLISH_EVERY
            figures = self._figures()
            gauges = dict.fromkeys(self._gauges_names(), 0) if final else self._gauges()
            sink = getattr(self.slow, "_store_sink", None)
            if sink is not None and hasattr(sink, "set_gauge"):
                sink.columns(figures)
                sink.columns(gauges, gauge=True)
                sink.add_many({k: v - self._published.get(k, 0) for k, v in figures.items()})
                for k, v in gauges.items():
                    sink.set_gauge(k, v)
                self._published = figures
            return {**figures, **gauges}

    @staticmethod
    def _gauges_names() -> tuple[str, ...]:
        return tuple(f"tiered.{g}" for g in _GAUGES)

    def _publish_logged(self, *, final: bool = False) -> dict[str, int]:
        if self._pid != os.getpid():
            return {}
        try:
            return self._publish(final=final)
        except (HostKVError, OSError, ValueError) as exc:  # figures for operators: never fail the store
            _log.warning("tiered: publishing store-wide counters failed: %r", exc)
            return {}

    def store_counters(self) -> dict[str, int]:
        """Store-wide counters (:class:`~hostkv_providers.providers.SupportsStoreCounters`), per
        tier: the composite's own (``hits`` ... ``checksum_failures``: what the engine saw),
        ``fast.*`` (the fast tier), ``slow.*`` (the slow tier, every process that used it), and
        the pipeline (``promotions``, ``write_backs``, ``write_back_failures``,
        ``write_through``, ``fast_hits``, ``slow_hits``, gauges ``write_back_queue`` and
        ``write_back_lag_ms``).  The composite's and the fast tier's figures reach the slow
        tier's counters file (so ``hostkv stats`` of the slow store shows them) within
        ``0.25`` s, on :meth:`flush` and on close; a slow tier without store-wide counters gets
        this instance's figures instead."""
        self._check_usable()
        local = self._publish()
        if isinstance(self.slow, SupportsStoreCounters):
            slow = self.slow.store_counters()
        else:
            st = self.slow.stats()
            slow = {k: int(getattr(st, k)) for k in STORE_COUNTED}
        if getattr(self.slow, "_store_sink", None) is None:
            slow = {**slow, **local}
        return self.counters_view(slow)

    @staticmethod
    def counters_view(slow_counters: Mapping[str, int]) -> dict[str, int]:
        """:meth:`store_counters` of a tiered store from its slow tier's ``store_counters()``
        (what ``hostkv stats tiered://...`` shows: it opens only the slow tier, read-only)."""
        c = slow_counters
        out = {k: int(c.get(f"tiered.{k}", 0)) for k in STORE_COUNTED}
        out.update({f"fast.{k}": int(c.get(f"fast.{k}", 0)) for k in STORE_COUNTED})
        out.update({f"slow.{k}": int(c.get(k, 0)) for k in STORE_COUNTED})
        for k in (*sorted(_EXTRA_COUNTERS), *_GAUGES):
            out[k] = int(c.get(f"tiered.{k}", 0))
        return out
