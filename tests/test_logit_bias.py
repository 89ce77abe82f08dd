"""``logit_bias`` in the engine's sampler: parity with transformers (greedy, its ``sequence_bias`` processor) and
with a torch reference that applies the same bias and the sampler's seeded Gumbel-max draw to transformers' logits.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.llm import LLM
from engine.sampling_params import SamplingParams

PROMPT = [5, 17, 42, 99, 3, 250, 7, 61]
MAX_NEW = 8


@pytest.fixture(scope="module")
def tiny(checkpoint: Callable[[str], Path]) -> tuple[Path, LLM, Any]:
    from transformers import AutoModelForCausalLM

    path = checkpoint("llama")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, LLM(str(path), num_kv_blocks=64), hf


def _bias_against(llm: LLM) -> dict[int, float]:
    """A bias that changes the greedy output: the unbiased first two tokens pushed down, another token pulled up."""
    plain = llm.generate([PROMPT], SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True))[0].token_ids
    up = next(t for t in range(300, 400) if t not in plain)
    return {plain[0]: -100.0, plain[1]: -30.0, up: 6.5}


def test_greedy_with_logit_bias_matches_transformers_sequence_bias(tiny: tuple[Path, LLM, Any]) -> None:
    _, llm, hf = tiny
    bias = _bias_against(llm)
    plain = llm.generate([PROMPT], SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True))[0].token_ids
    got = llm.generate([PROMPT], SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True,
                                                logit_bias=tuple(bias.items())))[0].token_ids
    ids = torch.tensor([PROMPT])
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW,
                          do_sample=False, eos_token_id=None, pad_token_id=0,
                          sequence_bias={(t,): b for t, b in bias.items()})
    assert got == out[0, len(PROMPT):].tolist()
    assert got != plain and got[0] not in (plain[0],)
    llm.engine.check_block_accounting()


def _reference_seeded(hf: Any, bias: dict[int, float], temperature: float, seed: int) -> list[int]:
    """transformers' logits + the bias, then the sampler's draw: softmax(logits / T) / Exp(1) noise, argmax, with
    one exponential variate per vocabulary entry per step from a generator seeded with ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    seq = list(PROMPT)
    with torch.inference_mode():
        for _ in range(MAX_NEW):
            logits = hf(torch.tensor([seq])).logits[0, -1].float()
            for t, b in bias.items():
                logits[t] += b
            probs = torch.softmax(logits / temperature, dim=-1)
            e = torch.empty_like(probs).exponential_(generator=gen)
            seq.append(int(torch.argmax(probs / e)))
    return seq[len(PROMPT):]


@pytest.mark.parametrize("seed", [7, 1234])
def test_seeded_sampling_with_logit_bias_matches_a_torch_reference(tiny: tuple[Path, LLM, Any],
                                                                   seed: int) -> None:
    _, llm, hf = tiny
    bias = _bias_against(llm)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.7, seed=seed, ignore_eos=True,
                            logit_bias=tuple(bias.items()))
    got = llm.generate([PROMPT], params)[0].token_ids
    assert got == _reference_seeded(hf, bias, 0.7, seed)
    assert next(iter(bias)) not in got  # -100 rules it out
    llm.engine.check_block_accounting()


def test_a_minus_100_bias_bans_a_token_in_every_row_of_a_mixed_batch(tiny: tuple[Path, LLM, Any]) -> None:
    _, llm, _ = tiny
    plain = llm.generate([PROMPT], SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True))[0].token_ids
    banned = tuple((t, -100.0) for t in set(plain))
    outs = llm.generate([PROMPT, PROMPT, PROMPT], [
        SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True, logit_bias=banned),
        SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=MAX_NEW, temperature=1.0, seed=3, ignore_eos=True, logit_bias=banned)])
    assert not set(outs[0].token_ids) & set(plain)
    assert outs[1].token_ids == plain  # a row without a bias is untouched by its neighbours'
    assert not set(outs[2].token_ids) & set(plain)


def test_logit_bias_is_validated() -> None:
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=((3, 101.0),))
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=((-1, 1.0),))
