"""One scrape of a Prometheus ``/metrics`` page, and what two scrapes say about the window between them.

``tandem up --autoscale`` (controlplane/autoscaler.py) needs rates and percentiles over its last interval, and a
local cluster runs no Prometheus server: so this module does the two queries it would have answered, on the text
that ``prometheus_client.parser`` reads. A counter's rate is its increase between two scrapes over the seconds
between them (an increase below zero is a restart: the later value is the increase, as Prometheus' ``rate()``
takes it). A histogram's window is the difference of its cumulative buckets, and a quantile of it interpolates
linearly inside the bucket that holds it, as ``histogram_quantile()`` does (an answer in the ``+Inf`` bucket is the
highest finite bound). Both sum a family over its labels: the window is the cluster's, not one series'.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families


@dataclass(slots=True, frozen=True)
class Histogram:
    """Cumulative counts per upper bound (ascending, ``+Inf`` last), summed over the family's labels."""

    buckets: tuple[tuple[float, float], ...]
    count: float
    sum: float

    def since(self, earlier: Histogram | None) -> Histogram:
        """The observations made after ``earlier`` (the whole histogram when there is none, or after a reset)."""
        if earlier is None or earlier.count > self.count or [b for b, _ in earlier.buckets] != [
                b for b, _ in self.buckets]:
            return self
        return Histogram(tuple((b, n - m) for (b, n), (_, m) in zip(self.buckets, earlier.buckets, strict=True)),
                         self.count - earlier.count, self.sum - earlier.sum)

    @property
    def mean(self) -> float | None:
        return self.sum / self.count if self.count > 0 else None

    def quantile(self, q: float) -> float | None:
        """The ``q`` quantile (0..1), interpolated within its bucket; None when nothing was observed."""
        if not 0 <= q <= 1:
            raise ValueError(f"a quantile is in [0, 1], got {q}")
        if self.count <= 0 or not self.buckets:
            return None
        rank = q * self.count
        lower, below = 0.0, 0.0
        for bound, cumulative in self.buckets:
            if cumulative >= rank and cumulative > below:
                if math.isinf(bound):
                    return lower
                return lower + (bound - lower) * (rank - below) / (cumulative - below)
            if not math.isinf(bound):
                lower = bound
            below = cumulative
        return lower


@dataclass(slots=True, frozen=True)
class Scrape:
    """One page: counters and histograms summed over their labels, gauges kept per label set."""

    time_s: float
    counters: dict[str, float] = field(default_factory=dict)
    histograms: dict[str, Histogram] = field(default_factory=dict)
    gauges: dict[str, list[tuple[dict[str, str], float]]] = field(default_factory=dict)

    def increase(self, name: str, earlier: Scrape) -> float:
        """How much counter ``name`` grew since ``earlier`` (0 when absent)."""
        now, then = self.counters.get(name, 0.0), earlier.counters.get(name, 0.0)
        return now - then if now >= then else now

    def window(self, name: str, earlier: Scrape) -> Histogram | None:
        """Histogram ``name``'s observations since ``earlier``; None when the page has no such family."""
        h = self.histograms.get(name)
        return h.since(earlier.histograms.get(name)) if h is not None else None


def parse_scrape(text: str, time_s: float) -> Scrape:
    """Read a text-format page (ValueError when it is not one)."""
    counters: dict[str, float] = {}
    gauges: dict[str, list[tuple[dict[str, str], float]]] = {}
    histograms: dict[str, Histogram] = {}
    for family in text_string_to_metric_families(text):
        if family.type == "counter":
            counters[family.name] = sum(s.value for s in family.samples if s.name.endswith("_total"))
        elif family.type == "gauge":
            gauges[family.name] = [(dict(s.labels), s.value) for s in family.samples]
        elif family.type == "histogram":
            by_bound: dict[float, float] = {}
            count = total = 0.0
            for s in family.samples:
                if s.name.endswith("_bucket"):
                    bound = float(s.labels["le"])
                    by_bound[bound] = by_bound.get(bound, 0.0) + s.value
                elif s.name.endswith("_count"):
                    count += s.value
                elif s.name.endswith("_sum"):
                    total += s.value
            histograms[family.name] = Histogram(tuple(sorted(by_bound.items())), count, total)
    return Scrape(time_s, counters, histograms, gauges)
