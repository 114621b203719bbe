"""Prometheus metrics for providers and the engine-facing cache.

``ProviderCollector(provider)`` exports a provider's counters and gauges and, for a tiered
provider, the same for each tier (label ``tier="fast"`` / ``"slow"``, nested tiers dotted) plus
hit attribution per tier, promotions, write-backs and the write-back lag.
``HostKVCache.prometheus_collector()`` includes it, with the cache's own counters and latency
histograms (lookup, save, restore) in :class:`LatencyHistogram` buckets.

Metric names (prefix ``hostkv``; every sample also carries the caller's ``labels``)::

    hostkv_provider_entries{provider,tier}                       gauge
    hostkv_provider_used_bytes / _budget_bytes / _anchors / _leased / _in_flight
    hostkv_provider_hits_total{provider,tier} ... _checksum_failures_total   counters
    hostkv_provider_store_checksum_failures_total{provider,tier} store-wide (lmdb)
    hostkv_tier_hits_total{tier="fast"|"slow"}                   which tier served a read
    hostkv_tier_promotions_total, hostkv_tier_write_backs_total,
    hostkv_tier_write_back_failures_total                        counters
    hostkv_tier_write_back_pending_pages                         gauge: write-back lag (pages)
    hostkv_tier_write_back_lag_seconds{store}                    gauge: age of the oldest page
                                                                 not yet in the slow tier
    hostkv_store_hits_total{provider,tier,scope} ... _checksum_failures_total
                                                                 store-wide live counters

``hostkv_provider_*_total`` count this provider instance's calls (a scrape of an engine's process
sees that engine's traffic).  ``hostkv_store_*_total`` are the store's own counters
(:class:`~hostkv_providers.providers.SupportsStoreCounters`): for mmap and lmdb every process
that opened the store for writing, since its counters began (``scope="store"``), so a sidecar
exporter that opens the store read-only exports the engines' figures; pinned's are its own
process's (``scope="process"``).  ``prometheus_client`` is needed only when a collector is built
(the ``prometheus`` extra).
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from hostkv_providers._capabilities import SupportsStoreCounters
from hostkv_providers._errors import HostKVError, InvalidArgumentError
from hostkv_providers._provider import Provider
from hostkv_providers._reports import ProviderStats

__all__ = ["DEFAULT_BUCKETS", "LatencyHistogram", "ProviderCollector", "provider_tiers"]

#: Seconds: 50 us (a pinned lookup) .. 60 s (an 8 GB restore from a cold disk).
DEFAULT_BUCKETS: tuple[float, ...] = (
    5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
    10.0, 30.0, 60.0,
)

_COUNTERS = ("hits", "misses", "seals", "aborts", "dedup", "evictions", "evicted_bytes",
             "checksum_failures", "bytes_written", "bytes_read")
_GAUGES = ("entries", "used_bytes", "budget_bytes", "anchors", "leased", "in_flight")
_TIER_COUNTERS = ("promotions", "write_backs", "write_back_failures", "write_through")
#: The store-wide counters exported as ``{prefix}_store_{name}_total`` (SupportsStoreCounters).
_STORE_COUNTERS = ("hits", "misses", "bytes_read", "seals", "bytes_written", "aborts", "dedup", "evictions",
                   "evicted_bytes", "checksum_failures")


class LatencyHistogram:
    """Cumulative-bucket latency histogram (Prometheus semantics), thread-safe.

    ``observe`` costs one bisect and a lock; it is called once per operation (a save, a
    restore, a lookup), never per page.
    """

    __slots__ = ("_counts", "_lock", "bounds", "count", "total")

    def __init__(self, bounds: Sequence[float] = DEFAULT_BUCKETS) -> None:
        b = tuple(float(x) for x in bounds)
        if not b or any(x <= 0 for x in b) or list(b) != sorted(set(b)):
            raise InvalidArgumentError("histogram bounds must be positive and strictly increasing")
        self.bounds = b
        self._counts = [0] * (len(b) + 1)  # the last one is +Inf
        self._lock = threading.Lock()
        self.count = 0
        self.total = 0.0

    def observe(self, seconds: float) -> None:
        i = bisect.bisect_left(self.bounds, seconds)
        with self._lock:
            self._counts[i] += 1
            self.count += 1
            self.total += seconds

    def buckets(self) -> list[tuple[str, int]]:
        """``[(upper bound, cumulative count), ...]`` ending with ``("+Inf", count)``."""
        with self._lock:
            counts = list(self._counts)
        out, acc = [], 0
        for bound, c in zip([*map(repr, self.bounds), "+Inf"], counts, strict=True):
            acc += c
            out.append((bound, acc))
        return out


def provider_tiers(provider: Provider, path: str = "") -> list[tuple[str, Provider]]:
    """``[(tier, provider), ...]``: the provider itself (tier ``""`` at the top), then, for a
    tiered provider, its fast and slow tiers (``"fast"``, ``"slow"``, ``"slow.fast"`` ...)."""
    from hostkv_providers.providers import TieredProvider  # the contract module must not import it

    out = [(path, provider)]
    if isinstance(provider, TieredProvider):
        for name, tier in (("fast", provider.fast), ("slow", provider.slow)):
            out += provider_tiers(tier, f"{path}.{name}" if path else name)
    return out


def _number(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v)


class ProviderCollector:
    """A ``prometheus_client`` collector for one provider (and its tiers).

    Parameters
    ----------
    provider:
        Any provider; a tiered one is walked down to its tiers.
    prefix:
        Metric name prefix.
    labels:
        Constant labels added to every sample (e.g. ``{"engine": "vllm-0"}``).

    Register it with ``registry.register(ProviderCollector(p))``.  A scrape of a closed
    provider yields no samples (never an error in the scraper's thread).
    """

    def __init__(self, provider: Provider, *, prefix: str = "hostkv", labels: Mapping[str, str] | None = None) -> None:
        try:
            import prometheus_client  # noqa: F401 - fail now, not at the first scrape
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise InvalidArgumentError("prometheus_client is not installed",
                                       hint="pip install 'hostkv-providers[prometheus]'") from exc
        self.provider = provider
        self.prefix = prefix
        _check_labels(labels, _OWN_LABELS)
        self._label_names = sorted((labels or {}).keys())
        self._label_values = [str((labels or {})[n]) for n in self._label_names]

    def describe(self) -> Iterator[Any]:
        return iter(())  # unchecked collector: names depend on the provider's tiers

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        names, values = self._label_names, self._label_values
        snaps: list[tuple[str, Provider, ProviderStats]] = []
        live: list[tuple[str, Provider, dict[str, int]]] = []
        for tier, p in provider_tiers(self.provider):
            try:
                snaps.append((tier or "store", p, p.stats()))
                if isinstance(p, SupportsStoreCounters):
                    live.append((tier or "store", p, p.store_counters()))
            except HostKVError:  # closed or forked: report nothing for it
                continue
        pl = [*names, "provider", "tier"]
        pre = f"{self.prefix}_provider"
        for g in _GAUGES:
            fam = GaugeMetricFamily(f"{pre}_{g}", f"provider {g.replace('_', ' ')}", labels=pl)
            for tier, p, st in snaps:
                fam.add_metric([*values, p.name, tier], float(getattr(st, g)))
            yield fam
        for c in _COUNTERS:
            cfam = CounterMetricFamily(f"{pre}_{c}", f"provider {c.replace('_', ' ')}", labels=pl)
            for tier, p, st in snaps:
                cfam.add_metric([*values, p.name, tier], float(getattr(st, c)))
            yield cfam
        store_wide = GaugeMetricFamily(f"{pre}_extra", "numeric provider-specific figures (see the "
                                       "provider's docs page)", labels=[*pl, "name"])
        for tier, p, st in snaps:
            for k, v in sorted(st.extra.items()):
                num = _number(v)
                if num is not None and k not in _TIER_COUNTERS and k not in ("fast_hits", "slow_hits"):
                    store_wide.add_metric([*values, p.name, tier, k], num)
        yield store_wide
        fails = CounterMetricFamily(f"{pre}_store_checksum_failures",
                                    "checksum failures counted in the store itself (all processes)",
                                    labels=pl)
        for tier, p, st in snaps:
            n = _number(st.extra.get("store_checksum_failures"))
            if n is not None:
                fails.add_metric([*values, p.name, tier], n)
        yield fails
        # the store's own live counters (every process that used it: scope="store")
        ll = [*pl, "scope"]
        for c in _STORE_COUNTERS:
            sfam = CounterMetricFamily(f"{self.prefix}_store_{c}", f"store-wide {c.replace('_', ' ')}", labels=ll)
            for tier, p, sc in live:
                if c in sc:
                    sfam.add_metric([*values, p.name, tier, "store" if p.persistent else "process"], float(sc[c]))
            yield sfam
        lagged = [(tier, sc) for tier, _p, sc in live if "write_back_lag_ms" in sc]
        if lagged:
            lag_s = GaugeMetricFamily(f"{self.prefix}_tier_write_back_lag_seconds",
                                      "age of the oldest page sealed in the fast tier, not yet in the slow one",
                                      labels=[*names, "store"])
            for tier, sc in lagged:
                lag_s.add_metric([*values, tier], sc["write_back_lag_ms"] / 1000.0)
            yield lag_s
        # tiered: which tier served each read, and the write-back pipeline
        tiered = [(tier, p, st) for tier, p, st in snaps if "fast_hits" in st.extra]
        if tiered:
            tl = [*names, "store", "tier"]
            hits = CounterMetricFamily(f"{self.prefix}_tier_hits", "reads served, by tier", labels=tl)
            for tier, _, st in tiered:
                hits.add_metric([*values, tier, "fast"], float(st.extra["fast_hits"]))
                hits.add_metric([*values, tier, "slow"], float(st.extra.get("slow_hits", 0)))
            yield hits
            sl = [*names, "store"]
            for c in _TIER_COUNTERS:
                tfam = CounterMetricFamily(f"{self.prefix}_tier_{c}", f"tiered {c.replace('_', ' ')}", labels=sl)
                for tier, _, st in tiered:
                    tfam.add_metric([*values, tier], float(st.extra.get(c, 0)))
                yield tfam
            lag = GaugeMetricFamily(f"{self.prefix}_tier_write_back_pending_pages",
                                    "pages sealed in the fast tier, not yet written back", labels=sl)
            for tier, _, st in tiered:
                lag.add_metric([*values, tier], float(st.extra.get("pending_write_back", 0)))
            yield lag


#: Labels the provider collector sets itself: a constant label of one of these names was
#: collapsed into the collector's own by prometheus_client (the caller's value silently lost).
_OWN_LABELS = ("provider", "tier", "name", "scope", "store")


def _check_labels(labels: Mapping[str, str] | None, own: Sequence[str]) -> None:
    """Constant labels: valid Prometheus label names, none of the collector's own."""
    import re

    for name in labels or {}:
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name) or name.startswith("__"):
            raise InvalidArgumentError(f"{name!r} is not a Prometheus label name")
        if name in own:
            raise InvalidArgumentError(f"label {name!r} is set by the collector itself",
                                       hint=f"pick another name than {', '.join(own)}")

