"""``tandem up --autoscale``: its flags and settings, and operators/planner's ``plan()`` as the local autoscaler's
:class:`~controlplane.autoscaler.Planner`.

The local cluster's autoscaler (controlplane/autoscaler.py) measures each interval into a ``Window``; the
:class:`LocalPlanner` here turns that into the planner's ``Observations``, keeps the planner's state (cool-downs,
sustained scale-down, forecast) from one window to the next, and hands back each tier's desired replicas with the
planner's reason. It lives in the composition root because the control plane may not import ``operators``
(docs/architecture.md).

Settings come from flags, or from an ``"autoscale"`` object in ``tandem up --config`` with the names below (flags
win; ``"autoscale": true`` turns it on with the defaults). A tier's bounds default to ``[1, its start count]`` (so
``--max-decode`` or ``--max-prefill`` is what gives it room); the GPU budget, counted in ranks (a replica's
placement-group bundles, its GPUs on a GPU host), defaults to the tiers' maximums. Every planner knob
(operators/planner/config.py ``PlannerConfig``) can be set by its own name; the per-replica capacities
``prefill_tokens_per_s`` and ``decode_tokens_per_s`` (measured at the SLO, e.g. with ``tandem bench``) turn on the
predictive sizing, which otherwise has nothing to size from and leaves the reactive thresholds in charge. Any bad
value is refused here, before Ray or a worker starts.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from operators.planner.config import Mode, PlannerConfig, Role, TierConfig
from operators.planner.observations import LengthStats, Observations, Percentiles, TierObservation
from operators.planner.planner import PlannerState, plan

if TYPE_CHECKING:  # the control plane (grpc, httpx) loads when `tandem up` runs, not with the parser
    from controlplane.autoscaler import TierTarget, Window
    from controlplane.local_cluster import UpConfig

# flag dest -> (the setting it sets, its type)
FLAGS: dict[str, tuple[str, type]] = {
    "autoscale_interval": ("interval_s", float),
    "min_prefill": ("min_prefill", int), "max_prefill": ("max_prefill", int),
    "min_decode": ("min_decode", int), "max_decode": ("max_decode", int),
    "gpu_budget": ("gpu_budget", int),
    "ttft_slo": ("ttft_slo_s", float), "itl_slo": ("itl_slo_s", float),
    "queue_high": ("queue_high", float), "kv_high": ("kv_high", float),
    "scale_up_cooldown": ("scale_up_cooldown_s", float), "scale_down_cooldown": ("scale_down_cooldown_s", float),
    "scale_down_windows": ("scale_down_windows", int),
}
DEFAULT_INTERVAL_S = 10.0
_CAPACITIES = ("prefill_tokens_per_s", "decode_tokens_per_s")
_KNOBS = {f.name for f in fields(PlannerConfig)} - {"tiers", "gpu_budget"}
_OWN = {"interval_s", "min_prefill", "max_prefill", "min_decode", "max_decode", "gpu_budget", *_CAPACITIES}
_TYPES: dict[str, type] = {**{f.name: type(f.default) for f in fields(PlannerConfig) if f.name in _KNOBS},
                           **dict(FLAGS.values()), **dict.fromkeys(_CAPACITIES, float)}


def add_autoscale_flags(up: argparse.ArgumentParser) -> None:
    up.add_argument("--autoscale", action="store_true", default=None,
                    help="scale the tiers with the SLO planner from the cluster's own metrics (scale-down drains)")
    up.add_argument("--autoscale-interval", type=float, default=None, metavar="SECONDS",
                    help=f"seconds between the planner's decisions, each over the last interval (default "
                         f"{DEFAULT_INTERVAL_S:g})")
    for tier in ("prefill", "decode"):
        up.add_argument(f"--min-{tier}", type=int, default=None, metavar="N",
                        help=f"--autoscale: fewest {tier} replicas (default 1)")
        up.add_argument(f"--max-{tier}", type=int, default=None, metavar="N",
                        help=f"--autoscale: most {tier} replicas (default: --{tier})")
    up.add_argument("--gpu-budget", type=int, default=None, metavar="N",
                    help="--autoscale: ranks (GPUs) all replicas may hold together, draining ones included "
                         "(default: the tiers' maximums)")
    up.add_argument("--ttft-slo", type=float, default=None, metavar="SECONDS", help="--autoscale: TTFT target (2)")
    up.add_argument("--itl-slo", type=float, default=None, metavar="SECONDS", help="--autoscale: ITL target (0.1)")
    up.add_argument("--queue-high", type=float, default=None, metavar="N",
                    help="--autoscale: queued requests per ready replica above which a tier grows (4)")
    up.add_argument("--kv-high", type=float, default=None, metavar="FRACTION",
                    help="--autoscale: KV cache use above which a tier grows (0.85)")
    up.add_argument("--scale-up-cooldown", type=float, default=None, metavar="SECONDS",
                    help="--autoscale: least time between a tier's last change and its next scale-up (30)")
    up.add_argument("--scale-down-cooldown", type=float, default=None, metavar="SECONDS",
                    help="--autoscale: least time between a tier's last change and a drain (120)")
    up.add_argument("--scale-down-windows", type=int, default=None, metavar="N",
                    help="--autoscale: consecutive decisions that must all want fewer replicas before one drains (3)")


def autoscale_settings(args: argparse.Namespace, section: object) -> dict[str, Any] | None:
    """The config file's ``"autoscale"`` (absent, true, false or an object) overlaid with the flags; None when
    autoscaling is off. ValueError for planner flags without ``--autoscale`` or a section that is not an object."""
    flags = {name: getattr(args, dest) for dest, (name, _) in FLAGS.items() if getattr(args, dest, None) is not None}
    if not args.autoscale and section in (None, False):
        if flags:
            given = ", ".join(f"--{dest.replace('_', '-')}" for dest in FLAGS if getattr(args, dest) is not None)
            raise ValueError(f"{given} only apply with --autoscale")
        return None
    if section in (None, True, False):
        section = {}
    if not isinstance(section, dict):
        raise ValueError(f"the config's \"autoscale\" must be true, false or an object, got {section!r}")
    return {**section, **flags}


@dataclass(slots=True, frozen=True)
class AutoscaleConfig:
    interval_s: float
    planner: PlannerConfig

    def __post_init__(self) -> None:
        if not (math.isfinite(self.interval_s) and self.interval_s > 0):
            raise ValueError(f"the autoscale interval must be a finite number of seconds > 0, got {self.interval_s!r}")


def autoscale_config(up: UpConfig, settings: Mapping[str, Any]) -> AutoscaleConfig:
    """The planner's configuration for the cluster ``up`` starts, from ``settings`` (ValueError naming the problem)."""
    from controlplane.controller import ControllerConfig

    max_replicas = int(ControllerConfig.__dataclass_fields__["max_replicas"].default)  # type: ignore[arg-type]
    unknown = set(settings) - _OWN - _KNOBS
    if unknown:
        raise ValueError(f"unknown autoscale settings {sorted(unknown)} (known: {', '.join(sorted(_OWN | _KNOBS))})")
    s = {k: _typed(k, v) for k, v in settings.items()}
    capacities = {k: s[k] for k in _CAPACITIES if k in s}
    tiers = []
    for tier, start in (("prefill", up.prefill), ("decode", up.decode)):
        lo = s.get(f"min_{tier}", 1 if start else 0)
        hi = s.get(f"max_{tier}", max(start, lo))
        if start == 0:  # only prefill can start at 0 (UpConfig refuses a cluster without decode)
            if lo or hi:
                raise ValueError("the prefill tier cannot be autoscaled from --prefill 0 (colocated: the decode "
                                 "replicas prefill themselves); start with --prefill 1 to scale it")
            continue
        if lo < 1:
            raise ValueError(f"--min-{tier} must be >= 1 while the cluster has a {tier} tier, got {lo}")
        if hi > max_replicas:
            raise ValueError(f"--max-{tier} must be at most {max_replicas} (the controller's limit), got {hi}")
        if not lo <= start <= hi:
            raise ValueError(f"--{tier} {start} is outside --min-{tier} {lo} .. --max-{tier} {hi}")
        role = Role.PREFILL if tier == "prefill" else Role.DECODE if up.prefill else Role.BOTH
        tiers.append(TierConfig(tier, role, up.ranks_of(tier), lo, hi, **capacities))
    if all(t.min_replicas == t.max_replicas for t in tiers):
        raise ValueError("--autoscale has nothing to scale: give --max-decode (or --max-prefill) above the tier's "
                         "minimum")
    start_ranks = sum(n * up.ranks_of(t) for t, n in (("prefill", up.prefill), ("decode", up.decode)))
    budget = s.get("gpu_budget", sum(t.max_replicas * t.gpus_per_replica for t in tiers))
    if budget < start_ranks:
        raise ValueError(f"--gpu-budget {budget} is below the {start_ranks} ranks the cluster starts with")
    knobs = {k: s[k] for k in _KNOBS if k in s}
    if "mode" in knobs:
        try:
            knobs["mode"] = Mode(knobs["mode"])
        except ValueError:
            raise ValueError(f"autoscale mode must be one of {[m.value for m in Mode]}, got "
                             f"{knobs['mode']!r}") from None
    return AutoscaleConfig(s.get("interval_s", DEFAULT_INTERVAL_S), PlannerConfig(tuple(tiers), budget, **knobs))


def _typed(name: str, value: Any) -> Any:
    """``value`` checked against the setting's type (JSON gives ints for floats; never bools for numbers)."""
    want = _TYPES[name]
    if want is Mode:
        return value  # checked where the mode is built
    if isinstance(value, bool) or not isinstance(value, int if want is int else (int, float)):
        raise ValueError(f"autoscale setting {name} must be {'an integer' if want is int else 'a number'}, "
                         f"got {value!r}")
    return value


class LocalPlanner:
    """operators/planner's ``plan()`` over the local autoscaler's windows, its state carried between them."""

    def __init__(self, cfg: AutoscaleConfig) -> None:
        self.cfg = cfg
        self.state: PlannerState | None = None

    @property
    def interval_s(self) -> float:
        return self.cfg.interval_s

    def decide(self, window: Window) -> Sequence[TierTarget]:
        from controlplane.autoscaler import TierTarget

        decided = plan(self.cfg.planner, observations(window), self.state)
        self.state = decided.state
        return [TierTarget(d.name, d.desired, d.reason) for d in decided.tiers]


def observations(w: Window) -> Observations:
    """The planner's view of one window (the same fields, in operators/planner's types)."""
    return Observations(
        w.time_s, w.window_s, w.request_rate, LengthStats(w.input_len.mean, w.input_len.p90),
        LengthStats(w.output_len.mean, w.output_len.p90), w.prefix_hit_rate,
        Percentiles(w.ttft.p50, w.ttft.p90, w.ttft.p99), Percentiles(w.itl.p50, w.itl.p90, w.itl.p99),
        tuple(TierObservation(t.tier, t.ready, t.starting, t.draining, t.queue_depth, t.kv_utilisation)
              for t in w.tiers))


def autoscale_planner(up: UpConfig, settings: Mapping[str, Any] | None) -> LocalPlanner | None:
    """The planner ``tandem up`` runs, or None when autoscaling is off."""
    return None if settings is None else LocalPlanner(autoscale_config(up, settings))
