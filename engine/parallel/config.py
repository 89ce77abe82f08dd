"""How a replica is split into ranks, and the model constraints a split must meet (checked before anything starts).

Every rank runs the same engine (scheduler, block pool, sampler) on the same requests, in lockstep: only the model's
weights and KV heads are split, and the collectives inside the forward pass keep the ranks' hidden states and
logits identical. Scheduling is deterministic, so no per-step broadcast is needed beyond the requests themselves.

- ``tp`` ranks split attention heads, MLP columns and the vocabulary.
- ``ep`` ranks split MoE experts. They are the same ranks as the TP group (``ep == tp``), or, with ``tp == 1``, ranks
  whose attention is replicated. ``ep_dispatch`` is how they exchange MoE rows
  (:class:`engine.models.layers.SparseMoE`): ``all_gather`` (the default; docs/benchmarks.md section 7) or
  ``all_to_all``, both bit-identical to EP=1, or ``all_reduce`` (each rank's partial sum, added across ranks: EP=1's
  sum only up to two experts per token; kept as the baseline those two are measured against).
- ``pp`` stages each hold a contiguous range of layers; a stage is ``max(tp, ep)`` ranks, so a replica has
  ``max(tp, ep) * pp`` ranks, numbered stage by stage.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.model_config import ModelConfig
from engine.models.decoder import ShardSpec, check_tp_heads

EP_DISPATCH = ("all_gather", "all_to_all", "all_reduce")


@dataclass(slots=True, frozen=True)
class ParallelConfig:
    tp: int = 1
    ep: int = 1
    pp: int = 1
    ep_dispatch: str = "all_gather"

    def __post_init__(self) -> None:
        if self.ep_dispatch not in EP_DISPATCH:
            raise ValueError(f"ep_dispatch must be one of {', '.join(EP_DISPATCH)}, got {self.ep_dispatch!r}")
        if self.tp < 1 or self.ep < 1 or self.pp < 1:
            raise ValueError(f"tp, ep and pp must be >= 1, got tp={self.tp} ep={self.ep} pp={self.pp}")
        if self.ep > 1 and self.tp > 1 and self.ep != self.tp:
            raise ValueError(f"expert parallel size {self.ep} must equal the tensor parallel size {self.tp} "
                             "(experts are split across the TP ranks) or TP must be 1")

    @property
    def stage_width(self) -> int:
        """Ranks per pipeline stage."""
        return max(self.tp, self.ep)

    @property
    def world_size(self) -> int:
        return self.stage_width * self.pp

    def shard(self, rank: int) -> ShardSpec:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} not in [0, {self.world_size})")
        stage, r = divmod(rank, self.stage_width)
        return ShardSpec(tp_rank=r % self.tp, tp_size=self.tp, ep_rank=r % self.ep, ep_size=self.ep,
                         pp_rank=stage, pp_size=self.pp)

    def check_model(self, cfg: ModelConfig) -> None:
        """Raise ValueError naming the constraint this split breaks for ``cfg``."""
        check_tp_heads(cfg.num_heads, cfg.num_kv_heads, self.tp)
        if self.pp > cfg.num_layers:
            raise ValueError(f"pipeline parallel size {self.pp} is above the number of layers ({cfg.num_layers})")
        if cfg.intermediate_size % self.tp:
            raise ValueError(f"tensor parallel size {self.tp} must divide the MLP size ({cfg.intermediate_size})")
        if self.ep > 1:
            if cfg.moe is None:
                raise ValueError(f"expert parallel size {self.ep} needs a MoE model; {cfg.architecture} has no experts")
            if self.ep > cfg.moe.num_experts:
                raise ValueError(f"expert parallel size {self.ep} is above the number of experts "
                                 f"({cfg.moe.num_experts})")
            if cfg.moe.num_experts % self.ep:
                raise ValueError(f"expert parallel size {self.ep} must divide the experts ({cfg.moe.num_experts})")
