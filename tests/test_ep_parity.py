"""Expert parallelism at EP=2 on Mixtral and Qwen3-MoE: two real rank processes (gloo on loopback), each holding
half of every MoE layer's experts, attention replicated; the partial expert outputs are summed by an all-reduce.

Logits are bit-identical to the split-emulating reference and greedy tokens equal transformers' fp32 ones except
at a demonstrated near-tie (``tests/parallel_parity.py``); block accounting is checked on every rank.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import cast

import pytest
from parallel_parity import assert_bit_identical, assert_greedy_matches

from engine.models.decoder import DecoderLayer
from engine.models.layers import SparseMoE
from engine.parallel.config import ParallelConfig
from engine.parallel.emulated import emulate
from engine.parallel.llm import ParallelLLM
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

MAX_NEW = 10
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
ENGINE = {"num_kv_blocks": 128, "num_threads": 1, "max_num_batched_tokens": 48}


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe"])
def ep2(request: pytest.FixtureRequest, checkpoint: Callable[[str], Path]) -> Iterator[tuple[Path, ParallelLLM]]:
    path = checkpoint(request.param)
    with ParallelLLM(str(path), ParallelConfig(ep=2), **ENGINE) as llm:
        yield path, llm


def test_ep2_logits_bit_identical_to_split_reference_and_tokens_match_transformers(
        ep2: tuple[Path, ParallelLLM], hf_greedy: Callable[[Path, list[int], int], list[int]]) -> None:
    path, llm = ep2
    rng = random.Random(4)
    prompts = [[rng.randrange(2040) for _ in range(n)] for n in (1, 7, 30, 90)]
    outs = llm.generate(prompts, GREEDY, record_logits=True)
    assert llm.last_logits is not None
    ref_outs, ref_logits, ref_llms = emulate(str(path), ParallelConfig(ep=2), prompts, GREEDY, **ENGINE)
    assert_bit_identical(llm.last_logits, ref_logits, f"{path.name} EP=2")
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref_outs]
    for prompt, out, rows in zip(prompts, outs, llm.last_logits, strict=True):
        assert_greedy_matches(out.token_ids, hf_greedy(path, prompt, MAX_NEW), rows, f"{path.name} EP=2")
    # each rank holds half of the experts of every MoE layer
    for rank, ref in enumerate(ref_llms):
        moes = [cast(DecoderLayer, layer).mlp for layer in ref.engine.model.layers]
        for moe in moes:
            if isinstance(moe, SparseMoE):
                assert moe.num_local * 2 == moe.moe.num_experts and moe.expert_offset == rank * moe.num_local
        ref.engine.check_block_accounting()
    llm.check_block_accounting()
    assert llm.ranks[0].weight_bytes == llm.ranks[1].weight_bytes
