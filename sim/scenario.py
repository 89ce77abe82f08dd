"""A simulation as the CLI and the docs name it (model config, GPU, TP, tier sizes, autoscale, SLOs), built into a
``SimConfig``: the step model from the config.json, and with ``autoscale`` the planner, told each tier's capacity at
the SLO (``capacity.py``) for the trace's mean lengths.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.model_config import ModelConfig
from operators.planner.config import PlannerConfig, Role, TierConfig
from sim.capacity import capacity
from sim.cluster import Cluster
from sim.config import SimConfig, TierSpec
from sim.hardware import gpu
from sim.results import summarize
from sim.roofline import ModelShape, StepModel
from sim.trace import TraceRequest

DEFAULT_MODEL = str(Path(__file__).with_name("data") / "llama-3-70b")


@dataclass(slots=True, frozen=True)
class Scenario:
    model: str = DEFAULT_MODEL  # an HF checkpoint dir or its config.json
    gpu: str = "h100"
    tp: int = 8
    prefill: int = 1  # 0: a colocated fleet of ``decode`` replicas
    decode: int = 1
    autoscale: bool = False
    gpu_budget: int | None = None  # default: the starting fleet's GPUs
    min_replicas: int = 1
    mfu: float = 0.5
    mbu: float = 0.7
    overhead_s: float = 0.0
    startup_s: float = 120.0
    block_size: int = 16
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    routing: str = "kv"
    ttft_slo_s: float = 2.0
    itl_slo_s: float = 0.1
    planner_window_s: float = 30.0
    target_utilisation: float = 0.8  # the planner's: each tier planned at this fraction of its capacity at the SLO
    seed: int = 0

    def __post_init__(self) -> None:
        if self.prefill < 0 or self.decode < 1 or self.tp < 1:
            raise ValueError("need prefill >= 0, decode >= 1 and tp >= 1")

    def model_config(self) -> ModelConfig:
        path = Path(self.model)
        return ModelConfig.from_dir(path.parent if path.name == "config.json" else path)


def build(scn: Scenario, trace: list[TraceRequest]) -> SimConfig:
    path = Path(scn.model)
    name = (path.parent if path.name == "config.json" else path).name
    step = StepModel(ModelShape.from_config(scn.model_config(), name), gpu(scn.gpu), scn.tp, scn.mfu, scn.mbu,
                     scn.overhead_s, scn.startup_s)
    tiers: tuple[TierSpec, ...]
    if scn.prefill:
        tiers = (TierSpec("prefill", Role.PREFILL, scn.prefill), TierSpec("decode", Role.DECODE, scn.decode))
    else:
        tiers = (TierSpec("colocated", Role.BOTH, scn.decode),)
    planner = None
    if scn.autoscale:
        n = max(len(trace), 1)
        cap = capacity(step, sum(r.input_len for r in trace) / n, sum(r.output_len for r in trace) / n,
                       scn.ttft_slo_s, scn.itl_slo_s, scn.max_num_batched_tokens, scn.max_num_seqs, scn.block_size)
        budget = scn.gpu_budget or (scn.prefill + scn.decode) * scn.tp
        most = budget // scn.tp
        planner = PlannerConfig(
            tuple(TierConfig(t.name, t.role, scn.tp, scn.min_replicas, most,
                             cap.prefill_tokens_per_s if t.role is not Role.DECODE else 0.0,
                             cap.decode_tokens_per_s if t.role is not Role.PREFILL else 0.0) for t in tiers),
            gpu_budget=budget, ttft_slo_s=scn.ttft_slo_s, itl_slo_s=scn.itl_slo_s, lead_time_s=scn.startup_s,
            target_utilisation=scn.target_utilisation,
            scale_up_cooldown_s=scn.planner_window_s, scale_down_cooldown_s=4 * scn.planner_window_s)
    return SimConfig(step, tiers, model_name=name, block_size=scn.block_size,
                     max_num_batched_tokens=scn.max_num_batched_tokens, max_num_seqs=scn.max_num_seqs,
                     routing=scn.routing, ttft_slo_s=scn.ttft_slo_s, itl_slo_s=scn.itl_slo_s, planner=planner,
                     planner_window_s=scn.planner_window_s, seed=scn.seed)


def simulate(scn: Scenario, trace: list[TraceRequest]) -> tuple[Cluster, dict[str, Any]]:
    t0 = time.perf_counter()
    cluster = Cluster(build(scn, trace), trace)
    cluster.run()
    return cluster, summarize(cluster, time.perf_counter() - t0)
