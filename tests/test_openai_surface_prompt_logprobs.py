"""Prompt logprobs from the engine's prefill forward pass: parity with transformers' log-softmax over the prompt,
whole, chunked, and after the same prompt was cached (a request asking for them takes no prefix hits)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine.llm import LLM
from engine.sampling_params import SamplingParams

PROMPT = [(i * 37 + 11) % 480 + 3 for i in range(45)]


@pytest.fixture(scope="module")
def reference(checkpoint: Callable[[str], Path]) -> tuple[Path, torch.Tensor]:
    """transformers' log-softmax at every prompt position: row p scores token p + 1."""
    from transformers import AutoModelForCausalLM

    path = checkpoint("llama")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = hf(torch.tensor([PROMPT])).logits[0, :-1].float()
    return path, torch.log_softmax(logits, dim=-1)


def _check(got: list, logp: torch.Tensor, k: int) -> None:
    assert [e.token_id for e in got] == PROMPT[1:]
    want = logp.gather(1, torch.tensor(PROMPT[1:]).unsqueeze(1)).squeeze(1)
    assert torch.allclose(torch.tensor([e.logprob for e in got]), want, atol=1e-4)
    top_v, top_i = logp.topk(k, dim=-1)
    for p, e in enumerate(got):
        assert [t for t, _ in e.top] == top_i[p].tolist()
        assert torch.allclose(torch.tensor([v for _, v in e.top]), top_v[p], atol=1e-4)


@pytest.mark.parametrize("budget", [8192, 16])
def test_prompt_logprobs_match_transformers_whole_and_chunked(reference: tuple[Path, torch.Tensor],
                                                              budget: int) -> None:
    path, logp = reference
    llm = LLM(str(path), num_kv_blocks=64, max_num_batched_tokens=budget)
    out = llm.generate([PROMPT], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3))[0]
    _check(out.prompt_logprobs, logp, 3)
    llm.engine.check_block_accounting()


def test_prompt_logprobs_after_the_prompt_is_cached_still_cover_every_token(
        reference: tuple[Path, torch.Tensor]) -> None:
    path, logp = reference
    llm = LLM(str(path), num_kv_blocks=64)
    llm.generate([PROMPT], SamplingParams(max_tokens=1, temperature=0))  # caches the prompt's full blocks
    out = llm.generate([PROMPT], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))[0]
    assert out.num_cached_tokens == 0
    _check(out.prompt_logprobs, logp, 0)
    plain = llm.generate([PROMPT], SamplingParams(max_tokens=1, temperature=0))[0]
    assert plain.num_cached_tokens > 0 and not plain.prompt_logprobs
    llm.engine.check_block_accounting()
