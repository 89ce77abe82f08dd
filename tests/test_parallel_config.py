"""Splits a model cannot take are refused before any rank starts, with a message naming the constraint."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from engine.model_config import ModelConfig
from engine.parallel.config import ParallelConfig
from engine.parallel.llm import ParallelLLM


def test_tp_that_does_not_divide_the_attention_heads_is_refused(checkpoint: Callable[[str], Path]) -> None:
    cfg = ModelConfig.from_dir(checkpoint("llama"))  # 8 heads, 4 KV heads
    with pytest.raises(ValueError, match=r"tensor parallel size 3 must divide the attention heads \(8\)"):
        ParallelConfig(tp=3).check_model(cfg)
    ParallelConfig(tp=8).check_model(cfg)  # more ranks than KV heads: they are replicated


def test_ep_above_the_experts_or_on_a_dense_model_is_refused(checkpoint: Callable[[str], Path]) -> None:
    with pytest.raises(ValueError, match=r"expert parallel size 8 is above the number of experts \(4\)"):
        ParallelConfig(ep=8).check_model(ModelConfig.from_dir(checkpoint("mixtral")))
    with pytest.raises(ValueError, match="needs a MoE model"):
        ParallelConfig(ep=2).check_model(ModelConfig.from_dir(checkpoint("llama")))
    with pytest.raises(ValueError, match="must equal the tensor parallel size"):
        ParallelConfig(tp=2, ep=4)


def test_pp_above_the_layers_is_refused(checkpoint: Callable[[str], Path]) -> None:
    with pytest.raises(ValueError, match=r"pipeline parallel size 5 is above the number of layers \(4\)"):
        ParallelConfig(pp=5).check_model(ModelConfig.from_dir(checkpoint("llama")))
    assert [ParallelConfig(pp=3).shard(r).stage_layers(4) for r in range(3)] == [range(0, 2), range(2, 3),
                                                                                  range(3, 4)]


def test_parallel_llm_refuses_a_bad_split_before_starting_a_rank(checkpoint: Callable[[str], Path]) -> None:
    with pytest.raises(ValueError, match="attention heads"):
        ParallelLLM(str(checkpoint("llama")), ParallelConfig(tp=3))


def test_ranks_map_to_tp_and_ep_shards() -> None:
    both = ParallelConfig(tp=2, ep=2)
    assert both.world_size == 2
    assert [(s.tp_rank, s.ep_rank) for s in map(both.shard, range(2))] == [(0, 0), (1, 1)]
    ep_only = ParallelConfig(ep=4)
    tp_pp = ParallelConfig(tp=2, pp=2)
    assert [(s.tp_rank, s.pp_rank) for s in map(tp_pp.shard, range(4))] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert ep_only.world_size == 4 and ep_only.shard(3).tp_size == 1 and ep_only.shard(3).ep_rank == 3
    with pytest.raises(ValueError):
        ParallelConfig(tp=0)
