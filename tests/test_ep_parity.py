"""Expert parallelism at EP=2 on Mixtral and Qwen3-MoE: two real rank processes (gloo on loopback), each holding
half of every MoE layer's experts, attention replicated.

- ``all_gather`` and ``all_to_all`` dispatch (:class:`engine.models.layers.SparseMoE`): logits are bit-identical to
  EP=1 (one rank with every expert), and so are the greedy tokens;
- ``all_reduce`` (each rank's partial sum, added by an all-reduce): logits are bit-identical to the split-emulating
  reference, and greedy tokens equal transformers' fp32 ones except at a demonstrated near-tie
  (``tests/parallel_parity.py``);
- TP=2 × EP=2 (attention split too): logits bit-identical to the split-emulating reference with the same exchange.

Block accounting is checked on every rank.
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


def _prompts() -> list[list[int]]:
    rng = random.Random(4)
    return [[rng.randrange(2040) for _ in range(n)] for n in (1, 7, 30, 90)]


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe"])
def arch(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def ep1(arch: str, checkpoint: Callable[[str], Path]) -> tuple[list[list[int]], list]:
    """EP=1: one rank with every expert (in process; the same engine code), its tokens and logits rows."""
    outs, logits, llms = emulate(str(checkpoint(arch)), ParallelConfig(), _prompts(), GREEDY, **ENGINE)
    llms[0].engine.check_block_accounting()
    return [o.token_ids for o in outs], logits


@pytest.fixture(scope="module", params=["all_gather", "all_to_all", "all_reduce"])
def ep2(request: pytest.FixtureRequest, arch: str,
        checkpoint: Callable[[str], Path]) -> Iterator[tuple[Path, ParallelConfig, ParallelLLM]]:
    path = checkpoint(arch)
    parallel = ParallelConfig(ep=2, ep_dispatch=request.param)
    with ParallelLLM(str(path), parallel, **ENGINE) as llm:
        yield path, parallel, llm


def test_ep2_logits_bit_identical_to_ep1_by_exchange_or_to_split_reference_by_all_reduce(
        ep2: tuple[Path, ParallelConfig, ParallelLLM], ep1: tuple[list[list[int]], list],
        hf_greedy: Callable[[Path, list[int], int], list[int]]) -> None:
    path, parallel, llm = ep2
    what = f"{path.name} EP=2 {parallel.ep_dispatch}"
    prompts = _prompts()
    outs = llm.generate(prompts, GREEDY, record_logits=True)
    assert llm.last_logits is not None
    if parallel.ep_dispatch == "all_reduce":
        ref_outs, ref_logits, ref_llms = emulate(str(path), parallel, prompts, GREEDY, **ENGINE)
        ref_tokens = [o.token_ids for o in ref_outs]
        for ref in ref_llms:
            ref.engine.check_block_accounting()
    else:
        ref_tokens, ref_logits = ep1  # the exchange adds every token's expert outputs in EP=1's order
    assert_bit_identical(llm.last_logits, ref_logits, what)
    assert [o.token_ids for o in outs] == ref_tokens
    for prompt, out, rows in zip(prompts, outs, llm.last_logits, strict=True):
        assert_greedy_matches(out.token_ids, hf_greedy(path, prompt, MAX_NEW), rows, what)
    llm.check_block_accounting()
    assert llm.ranks[0].weight_bytes == llm.ranks[1].weight_bytes
    stats = llm.stats()
    if parallel.ep_dispatch == "all_reduce":
        assert all(s["exchange_calls"] == 0 and s["allreduce_calls"] > 0 for s in stats)
    else:  # one exchange per MoE layer per step (all_gather), or three (all_to_all); no all-reduce at all
        assert all(s["exchange_calls"] > 0 and s["allreduce_calls"] == 0 for s in stats)


@pytest.mark.parametrize("dispatch", ["all_gather", "all_to_all"])
def test_tp2_ep2_logits_bit_identical_to_split_reference(
        dispatch: str, checkpoint: Callable[[str], Path]) -> None:
    """Experts split across the TP ranks: attention's all-reduces and the MoE exchange in one forward pass."""
    path = checkpoint("qwen3_moe")
    parallel = ParallelConfig(tp=2, ep=2, ep_dispatch=dispatch)
    prompts = _prompts()
    with ParallelLLM(str(path), parallel, **ENGINE) as llm:
        outs = llm.generate(prompts, GREEDY, record_logits=True)
        assert llm.last_logits is not None
        llm.check_block_accounting()
    ref_outs, ref_logits, ref_llms = emulate(str(path), parallel, prompts, GREEDY, **ENGINE)
    assert_bit_identical(llm.last_logits, ref_logits, f"{path.name} TP=2 EP=2 {dispatch}")
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref_outs]
    # each rank holds half of the experts of every MoE layer
    for rank, ref in enumerate(ref_llms):
        for layer in ref.engine.model.layers:
            moe = cast(DecoderLayer, layer).mlp
            if isinstance(moe, SparseMoE):
                assert moe.num_local * 2 == moe.moe.num_experts and moe.expert_offset == rank * moe.num_local
                assert moe.exchange is not None and moe.exchange.dispatch == dispatch
        ref.engine.check_block_accounting()
