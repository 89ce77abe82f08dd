"""The one modelled part: how long a replica's step takes, from the tokens it computes and the KV it reads.

For a step that computes ``T`` new tokens in all, where request ``i`` computes ``n_i`` tokens after ``c_i`` already in
its KV cache, on a replica of ``tp`` GPUs::

    flops   = 2 · P_active · T + 4 · L · d_q · Σ n_i · (c_i + (n_i + 1) / 2)     matmuls + attention (QK^T and AV)
    bytes   = W + kv_bytes_per_token · Σ (c_i + n_i)                             every weight once + every KV read
    compute = flops / (tp · peak · MFU)          prefill is here: compute-bound
    memory  = bytes / (tp · bandwidth · MBU)     decode is here: memory-bound
    comm    = 2 · L · (α + 2 (tp - 1) / tp · T · hidden · dtype / nvlink)     two ring all-reduces per layer (TP)
    step    = max(compute, memory) + comm + overhead

A KV transfer of ``B`` bytes between replicas takes ``B / (tp · nic) + latency``; it streams layer by layer while
prefill computes, so it ends one layer's share after prefill does, or later if the link is the bottleneck.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.model_config import ModelConfig
from sim.hardware import GpuSpec
from sim.weights import weights_per_token


@dataclass(slots=True, frozen=True)
class ModelShape:
    name: str
    layers: int
    hidden: int
    q_dim: int  # heads x head_dim
    active_params: int  # weights one token multiplies by (active experts only) incl. the LM head
    weight_bytes: float  # every weight held, per replica
    kv_bytes_per_token: float
    dtype_bytes: int

    @classmethod
    def from_config(cls, cfg: ModelConfig, name: str, dtype_bytes: int = 2) -> ModelShape:
        active = weights_per_token(cfg)
        total = active + (0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size)
        if cfg.moe is not None:  # every expert is held, only top_k are used per token
            moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
            per_expert = 3 * cfg.hidden_size * cfg.moe.intermediate_size
            total += moe_layers * per_expert * (cfg.moe.num_experts - cfg.moe.top_k)
        return cls(name, cfg.num_layers, cfg.hidden_size, cfg.num_heads * cfg.head_dim, active,
                   float(total * dtype_bytes), float(cfg.kv_bytes_per_token * dtype_bytes), dtype_bytes)


@dataclass(slots=True, frozen=True)
class StepModel:
    model: ModelShape
    gpu: GpuSpec
    tp: int = 1
    mfu: float = 0.5
    mbu: float = 0.7
    overhead_s: float = 0.0
    startup_s: float = 120.0  # a new replica: pod scheduled, weights loaded, warmed up
    token_overhead_s: float = 0.0  # per computed token, what the roofline leaves out (norms, activations, RoPE)

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise ValueError(f"tp must be >= 1, got {self.tp}")
        if not 0 < self.mfu <= 1 or not 0 < self.mbu <= 1:
            raise ValueError(f"mfu and mbu must be in (0, 1], got {self.mfu}, {self.mbu}")
        if self.overhead_s < 0 or self.startup_s < 0 or self.token_overhead_s < 0:
            raise ValueError("overhead_s, startup_s and token_overhead_s must be >= 0")

    @property
    def kv_capacity_bytes(self) -> float:
        """KV cache per replica: 90% of the GPUs' memory (as vLLM's gpu_memory_utilization) less the weights."""
        return self.tp * self.gpu.mem_bytes * 0.9 - self.model.weight_bytes

    def kv_blocks(self, block_size: int) -> int:
        blocks = int(self.kv_capacity_bytes // (self.model.kv_bytes_per_token * block_size))
        if blocks < 1:
            raise ValueError(f"{self.model.name} does not fit {self.tp} x {self.gpu.name}")
        return blocks

    def step_time(self, tokens: int, attn_pairs: float, kv_tokens: int) -> float:
        """Seconds for one step: ``tokens`` computed, ``attn_pairs`` = Σ n_i (c_i + (n_i+1)/2), ``kv_tokens`` =
        Σ (c_i + n_i) read from the KV cache."""
        m, g, tp = self.model, self.gpu, self.tp
        flops = 2.0 * m.active_params * tokens + 4.0 * m.layers * m.q_dim * attn_pairs
        nbytes = m.weight_bytes + m.kv_bytes_per_token * kv_tokens
        t = max(flops / (tp * g.peak_flops * self.mfu), nbytes / (tp * g.mem_bandwidth * self.mbu))
        if tp > 1:
            msg = tokens * m.hidden * m.dtype_bytes
            t += 2 * m.layers * (g.allreduce_latency_s + 2 * (tp - 1) / tp * msg / g.nvlink_bandwidth)
        return t + self.overhead_s + tokens * self.token_overhead_s

    def transfer_time(self, tokens: int) -> float:
        """Seconds to move ``tokens`` of KV from one replica to another (both of this TP degree)."""
        return self.model.kv_bytes_per_token * tokens / (self.tp * self.gpu.nic_bandwidth) + self.gpu.transfer_latency_s

    def transfer_tail(self, tokens: int) -> float:
        """How long after prefill's last layer the KV is all there: the last layer's share, or the whole transfer
        less the prefill time if the link is slower than the compute (the caller takes the max)."""
        return self.transfer_time(tokens) / self.model.layers + self.gpu.transfer_latency_s
