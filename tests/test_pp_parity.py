"""Pipeline parallelism on Llama: PP=2 (two stages of two layers) and TP=2 x PP=2 (four rank processes,
oversubscribed on this machine's two cores), joined by gloo on loopback.

A pipeline moves hidden states between stages and changes no arithmetic, so PP=2's logits are bit-identical to a
plain TP=1 engine's that splits decode batches into the same two micro-batches (the stages' overlap), and
TP=2 x PP=2's to the TP=2 split-emulating reference that does the same. Greedy tokens equal transformers'
(near-tie rule in ``tests/parallel_parity.py``); block accounting is checked on every rank.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from parallel_parity import assert_bit_identical, assert_greedy_matches

from engine.llm import LLM
from engine.parallel.config import ParallelConfig
from engine.parallel.emulated import emulate
from engine.parallel.llm import ParallelLLM
from engine.parallel.logit_recorder import LogitRecorder
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

MAX_NEW = 10
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
ENGINE = {"num_kv_blocks": 128, "num_threads": 1, "max_num_batched_tokens": 48}


def _prompts() -> list[list[int]]:
    rng = random.Random(72)
    return [[rng.randrange(2040) for _ in range(n)] for n in (1, 9, 40, 120)]


def test_pp2_logits_bit_identical_to_tp1_and_tokens_match_transformers(
        checkpoint: Callable[[str], Path], hf_greedy: Callable[[Path, list[int], int], list[int]]) -> None:
    path = checkpoint("llama")
    prompts = _prompts()
    plain = LLM(str(path), **ENGINE)  # type: ignore[arg-type]
    plain.engine.runner.micro_batches = 2
    runner = plain.engine.runner
    split_steps: list[int] = []
    forward_split = runner._forward_micro_batches

    def counted(*args: Any) -> torch.Tensor:
        split_steps.append(1)
        return forward_split(*args)

    runner._forward_micro_batches = counted  # type: ignore[method-assign,assignment]
    rec = LogitRecorder.attach(plain.engine)
    rec.enabled = True
    want = plain.generate(prompts, GREEDY)
    # the steps of decodes only ran as two micro-batches (the first steps also carry the long prompt's chunks)
    assert len(split_steps) >= MAX_NEW // 2
    with ParallelLLM(str(path), ParallelConfig(pp=2), **ENGINE) as llm:
        outs = llm.generate(prompts, GREEDY, record_logits=True)
        assert llm.last_logits is not None
        assert_bit_identical(llm.last_logits, rec.take(), "llama PP=2")
        llm.check_block_accounting()
        # each stage loaded two of the four layers (plus the embedding, head and final norm)
        assert all(r.weight_bytes < 0.8 * sum(p.numel() * 4 for p in plain.engine.model.parameters())
                   for r in llm.ranks)
    assert [o.token_ids for o in outs] == [o.token_ids for o in want]
    for prompt, out, rows in zip(prompts, outs, llm.last_logits, strict=True):
        assert_greedy_matches(out.token_ids, hf_greedy(path, prompt, MAX_NEW), rows, "llama PP=2")


def test_tp2_pp2_four_ranks_bit_identical_to_tp2_reference(
        checkpoint: Callable[[str], Path], hf_greedy: Callable[[Path, list[int], int], list[int]]) -> None:
    path = checkpoint("llama")
    prompts = _prompts()
    with ParallelLLM(str(path), ParallelConfig(tp=2, pp=2), **ENGINE) as llm:
        assert len(llm.pids) == 4
        outs = llm.generate(prompts, GREEDY, record_logits=True)
        llm.check_block_accounting()
    assert llm.last_logits is not None
    ref_outs, ref_logits, _ = emulate(str(path), ParallelConfig(tp=2), prompts, GREEDY, micro_batches=2, **ENGINE)
    assert_bit_identical(llm.last_logits, ref_logits, "llama TP=2 x PP=2")
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref_outs]
    for prompt, out, rows in zip(prompts, outs, llm.last_logits, strict=True):
        assert_greedy_matches(out.token_ids, hf_greedy(path, prompt, MAX_NEW), rows, "llama TP=2 x PP=2")
