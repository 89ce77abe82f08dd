"""KV cache tensors: per layer, K and V each ``[num_blocks, block_size, num_kv_heads, head_dim]``, contiguous.

The cache is sized from ``CacheConfig.num_blocks`` if set, otherwise from the memory budget.

On CPU the cache is backed by transparent huge pages where the kernel allows it (see
:func:`engine.cpu_runtime.empty_on_huge_pages`): a decode step reads every running sequence's blocks, scattered
over a cache of hundreds of MiB, and with 4 KiB pages that is a TLB miss every two blocks.
"""

from __future__ import annotations

import torch

from engine.config import CacheConfig
from engine.cpu_runtime import empty_on_huge_pages
from engine.model_config import ModelConfig


def num_blocks_for(cache: CacheConfig, cfg: ModelConfig, dtype: torch.dtype, kv_heads: int) -> int:
    if cache.num_blocks is not None:
        return cache.num_blocks
    elem = torch.empty((), dtype=dtype).element_size()
    per_block = 2 * cfg.num_layers * cache.block_size * kv_heads * cfg.head_dim * elem
    n = cache.memory_budget_bytes // per_block
    if n < 1:
        raise ValueError(f"memory budget {cache.memory_budget_bytes} B holds no KV block of {per_block} B")
    return int(n)


def allocate_kv_cache(
    num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
    device: str | torch.device = "cpu", layers: range | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One (K, V) pair per layer; only ``layers`` (a pipeline stage's, default all) get blocks, the rest none."""
    shape = (num_blocks, block_size, kv_heads, head_dim)
    held = layers if layers is not None else range(num_layers)

    def pair(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = (n, *shape[1:])
        if torch.device(device).type == "cpu":
            return empty_on_huge_pages(s, dtype).zero_(), empty_on_huge_pages(s, dtype).zero_()
        return torch.zeros(s, dtype=dtype, device=device), torch.zeros(s, dtype=dtype, device=device)

    return [pair(num_blocks if i in held else 0) for i in range(num_layers)]
