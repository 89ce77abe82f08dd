"""``tandem up --autoscale``: every interval, read the local cluster's metrics, ask the planner, tell the controller.

One loop, on the cluster's event loop::

    scrape the router's /metrics ──► Window (the interval's rates, lengths, latency percentiles; per tier:
    replicas ready/starting/draining from the controller, queue depth and KV use of its ready workers)
        ──► Planner.decide ──► per tier: desired replicas, with the reason
        ──► Controller.set_replicas for a tier whose desired count changed

The router's page carries all of it: its own counters and histograms (requests, prompt and output lengths, prefix
hits, TTFT, ITL) and, per worker, the queue depth and KV blocks of that worker's latest ``Load`` report (router/
metrics.py), labelled by the worker's id. A worker's own ``/metrics`` (``--metrics-port``) serves only its KV
transfer and speculative-decoding families, none of which the planner reads, so it is not scraped. Those gauges are
summed over the tier's READY replicas only (a draining replica's queue is work on its way out, not demand), mapped
by the worker id the controller learnt from each worker's ``Health``.

A scale-down is a lower desired count, which the controller carries out only through drain (controlplane/
controller.py: the router stops choosing the replica, the worker refuses new work and finishes what it has, and
only then is it stopped), so no request fails for it. The loop acts only on a decision that changes a tier; a hold
leaves the controller alone, so a replica the controller is replacing (FAILED, counted as starting here) is never
cancelled by a planner that has not seen it come back. Each change is printed with its reason, a hold whenever its
reason changes (every decision goes to this module's logger), and each replica the controller removed after
draining, with how long the drain took and what was still in flight.

The planner is handed in (:class:`Planner`): the control plane does not import ``operators``; the composition root
(cli/autoscale.py) adapts operators/planner's pure ``plan()`` to it.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import httpx

from controlplane.metrics_window import Histogram, Scrape, parse_scrape
from controlplane.replica_state import TIERS, ReplicaState, in_flight

if TYPE_CHECKING:
    from controlplane.controller import Controller
    from controlplane.replica_state import Replica

log = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class Percentiles:
    """Seconds; None where nothing was observed in the window."""

    p50: float | None = None
    p90: float | None = None
    p99: float | None = None


@dataclass(slots=True, frozen=True)
class Lengths:
    """Tokens per request over the window: mean and 90th percentile (0 when no request finished)."""

    mean: float = 0.0
    p90: float = 0.0


@dataclass(slots=True, frozen=True)
class TierWindow:
    tier: str
    ready: int
    starting: int  # STARTING, and FAILED ones (the controller is replacing them)
    draining: int
    queue_depth: float  # requests waiting, summed over the tier's READY workers
    kv_utilisation: float  # used over all KV blocks of the tier's READY workers, 0..1


@dataclass(slots=True, frozen=True)
class Window:
    """What the cluster did over one interval, in the planner's terms."""

    time_s: float  # the end of the window, time.monotonic()
    window_s: float
    request_rate: float  # requests finished per second
    input_len: Lengths
    output_len: Lengths
    prefix_hit_rate: float  # prompt tokens served from cache over prompt tokens, 0..1
    ttft: Percentiles
    itl: Percentiles
    tiers: tuple[TierWindow, ...]


@dataclass(slots=True, frozen=True)
class TierTarget:
    tier: str
    desired: int
    reason: str


class Planner(Protocol):
    """Decides each tier's replicas from one window; keeps whatever state its guards need between calls."""

    @property
    def interval_s(self) -> float: ...

    def decide(self, window: Window) -> Sequence[TierTarget]: ...


@dataclass(slots=True, frozen=True)
class ScrapeTarget:
    url: str  # the router's /metrics
    bearer: str | None = None  # an API key, when the gateway requires one


def window_between(earlier: Scrape, later: Scrape, tiers: tuple[TierWindow, ...]) -> Window:
    """The window from ``earlier`` to ``later`` (the router's families, router/metric_catalogue.py)."""
    prompt = later.window("tandem_request_prompt_tokens", earlier)
    output = later.window("tandem_request_generation_tokens", earlier)
    finished = prompt.count if prompt is not None else 0.0
    window_s = max(later.time_s - earlier.time_s, 1e-6)
    prompt_tokens = later.increase("tandem_prompt_tokens", earlier)
    cached = later.increase("tandem_prompt_cached_tokens", earlier)
    return Window(later.time_s, window_s, finished / window_s, _lengths(prompt), _lengths(output),
                  min(max(cached / prompt_tokens, 0.0), 1.0) if prompt_tokens > 0 else 0.0,
                  _percentiles(later.window("tandem_ttft_seconds", earlier)),
                  _percentiles(later.window("tandem_itl_seconds", earlier)), tiers)


def _lengths(h: Histogram | None) -> Lengths:
    if h is None or h.mean is None:
        return Lengths()
    return Lengths(h.mean, h.quantile(0.9) or 0.0)


def _percentiles(h: Histogram | None) -> Percentiles:
    if h is None:
        return Percentiles()
    return Percentiles(h.quantile(0.5), h.quantile(0.9), h.quantile(0.99))


def tier_windows(controller: Controller, scrape: Scrape) -> tuple[TierWindow, ...]:
    """Each tier's replicas from the controller, and its READY workers' queue and KV from the router's gauges."""

    def by_worker(name: str) -> dict[str, float]:
        return {labels.get("worker", ""): value for labels, value in scrape.gauges.get(name, [])}

    queue, used, free = (by_worker(n) for n in ("tandem_worker_queue_depth", "tandem_kv_blocks_used",
                                                  "tandem_kv_blocks_free"))
    out = []
    for tier in TIERS:
        replicas = controller.of_tier(tier)
        if not replicas and controller.desired[tier] == 0:
            continue
        ready = [r for r in replicas if r.state == ReplicaState.READY]
        keys = [_worker_key(r, queue) for r in ready]
        q = sum(queue.get(k, 0.0) for k in keys)
        u, f = sum(used.get(k, 0.0) for k in keys), sum(free.get(k, 0.0) for k in keys)
        out.append(TierWindow(
            tier, len(ready),
            sum(r.state in (ReplicaState.STARTING, ReplicaState.FAILED) for r in replicas),
            sum(r.state == ReplicaState.DRAINING for r in replicas), q, min(u / (u + f), 1.0) if u + f > 0 else 0.0))
    return tuple(out)


def _worker_key(r: Replica, seen: dict[str, float]) -> str:
    """The router labels a worker by its id, or by its address before it learnt the id."""
    return r.worker_id if r.worker_id in seen else r.address


def first_api_key(keys: Sequence[str], key_file: str | None) -> str | None:
    """A key the gateway accepts (``admin:KEY`` is sent as ``KEY``), for the scrape; None when none is set."""
    texts = list(keys)
    if key_file:
        with open(key_file) as f:
            texts += [line.strip() for line in f if line.strip() and not line.strip().startswith("#")]
    if not texts:
        return None
    return texts[0].removeprefix("admin:")


class Autoscaler:
    """The loop. ``say`` prints one line (``tandem up``'s stamped output)."""

    def __init__(self, controller: Controller, target: ScrapeTarget, planner: Planner,
                 say: Callable[[str], None] = print) -> None:
        self.controller = controller
        self.target = target
        self.planner = planner
        self.say = say
        self._last: Scrape | None = None
        self._said: dict[str, str] = {}  # tier -> the last hold reason printed, digits masked
        self._removed_since = time.monotonic()  # replicas removed after this are reported
        self._task: asyncio.Task[None] | None = None
        headers = {"Authorization": f"Bearer {target.bearer}"} if target.bearer else {}
        self._http = httpx.AsyncClient(headers=headers, timeout=min(planner.interval_s, 10.0), trust_env=False)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="tandem-autoscaler")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self._http.aclose()

    async def _run(self) -> None:
        next_at = time.monotonic()
        while True:
            try:
                await self.step()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a missed scrape or a refused plan: the next interval tries again
                log.warning("autoscale step failed: %r", e)
                self.say(f"autoscale: step failed ({e!r}); retrying in {self.planner.interval_s:g}s")
            # on the interval's grid; a step that overran it is followed by the next at once, not by a burst
            next_at = max(next_at + self.planner.interval_s, time.monotonic())
            await asyncio.sleep(next_at - time.monotonic())

    async def scrape(self) -> Scrape:
        r = await self._http.get(self.target.url)
        r.raise_for_status()
        return parse_scrape(r.text, time.monotonic())

    async def step(self) -> None:
        """One interval: scrape; from the second scrape on, decide over the window and apply."""
        self._report_drains()
        now = await self.scrape()
        earlier, self._last = self._last, now
        if earlier is None:
            return
        window = window_between(earlier, now, tier_windows(self.controller, now))
        current = {t.tier: t.ready + t.starting for t in window.tiers}
        for target in self.planner.decide(window):
            was = current.get(target.tier, 0)
            log.info("autoscale %s: %d -> %d (%s)", target.tier, was, target.desired, target.reason)
            if target.desired != was:
                self.controller.set_replicas(target.tier, target.desired)
                how = "scale up" if target.desired > was else "drain"
                self.say(f"autoscale: {target.tier} {was} -> {target.desired} ({how}: {target.reason})")
                self._said.pop(target.tier, None)
            elif self._said.get(target.tier) != (masked := re.sub(r"[0-9.]+", "#", target.reason)):
                self._said[target.tier] = masked
                self.say(f"autoscale: {target.tier} holds at {was} ({target.reason})")

    def _report_drains(self) -> None:
        since, self._removed_since = self._removed_since, time.monotonic()
        for r in list(self.controller.removed):
            if r.removed_at is None or r.removed_at <= since or r.drain_seconds is None:
                continue  # reported already, or a failed replica removed without a drain
            left = in_flight(r.final_load) if r.final_load is not None else 0
            self.say(f"autoscale: {r.tier} replica {r.replica_id} drained in {r.drain_seconds:.1f}s and removed "
                     f"({left} in flight at the end)")

