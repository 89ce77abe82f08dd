"""Engine tunables. Every knob lives here, in frozen dataclasses validated at construction."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.lora.config import LoRAConfig
from engine.spec.config import SpeculativeConfig

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def parse_dtype(name: str, device: str) -> torch.dtype:
    """Map a dtype name to torch, refusing combinations this engine does not run (fp16 on CPU)."""
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; choose one of {sorted(_DTYPES)}")
    dtype = _DTYPES[name]
    if device == "cpu" and dtype == torch.float16:
        raise ValueError("dtype float16 is not supported on CPU; use float32 or bfloat16")
    if device.startswith("cuda") and dtype == torch.float32:
        # Allowed, but slow; CUDA users normally want half precision.
        pass
    return dtype


@dataclass(slots=True, frozen=True)
class CacheConfig:
    """Paged KV cache geometry.

    Exactly one of ``num_blocks`` and ``memory_budget_bytes`` sizes the cache; ``num_blocks`` wins when given.
    """

    block_size: int = 16
    num_blocks: int | None = None
    memory_budget_bytes: int = 1 << 30
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.memory_budget_bytes <= 0:
            raise ValueError(f"memory_budget_bytes must be > 0, got {self.memory_budget_bytes}")


@dataclass(slots=True, frozen=True)
class SchedulerConfig:
    """Continuous batching limits. Prefill is always chunked to fit ``max_num_batched_tokens``."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")


@dataclass(slots=True, frozen=True)
class EngineConfig:
    """Everything needed to build an engine over one checkpoint directory."""

    model: str
    dtype: str = "float32"
    device: str = "cpu"
    max_model_len: int | None = None
    seed: int = 0
    num_threads: int | None = None
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig | None = None  # speculative decoding (engine/spec); None: off
    lora: LoRAConfig | None = None  # servable LoRA adapters (engine/lora); None: base model only

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model must name a checkpoint directory")
        if self.device != "cpu" and not self.device.startswith("cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        parse_dtype(self.dtype, self.device)
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype, self.device)
