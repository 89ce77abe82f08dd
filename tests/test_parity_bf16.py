"""bfloat16 parity with transformers (same dtype on both sides).

Dense models and Qwen3-MoE match transformers token for token in bf16 for single sequences: the prefill is bitwise
identical, and decode uses the same unmasked attention kernel. Where bf16 rounding can legitimately flip a greedy
choice (Mixtral, whose transformers path uses a grouped-GEMM expert kernel, and batches whose masked attention
kernel rounds differently), the test is tie-aware: output must match up to the first divergence, and at that
position transformers' own logits for the two candidate tokens must be within bf16 resolution of each other.
Anything else is a real bug.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine.llm import LLM
from engine.sampling_params import SamplingParams

MAX_NEW = 16
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
EXACT_SINGLE = ["llama", "qwen2", "qwen3", "qwen3_moe"]
ALL = ["llama", "qwen2", "qwen3", "mistral", "mixtral", "qwen3_moe"]


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(2000) for _ in range(n)] for n in (1, 5, 17, 40, 100)]


def _hf(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()


def _hf_greedy(model: torch.nn.Module, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW,  # type: ignore[operator]
                             min_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch", EXACT_SINGLE)
def test_bf16_single_sequence_matches_transformers_exactly(arch: str, checkpoint: Callable[[str], Path]) -> None:
    path = checkpoint(arch)
    hf = _hf(path)
    llm = LLM(str(path), dtype="bfloat16", num_kv_blocks=128)
    for prompt in _prompts():
        assert llm.generate([prompt], GREEDY)[0].token_ids == _hf_greedy(hf, prompt), f"len {len(prompt)}"
    llm.engine.check_block_accounting()


@pytest.mark.parametrize("arch", ALL)
def test_bf16_batched_matches_transformers_up_to_bf16_ties(arch: str, checkpoint: Callable[[str], Path]) -> None:
    path = checkpoint(arch)
    hf = _hf(path)
    llm = LLM(str(path), dtype="bfloat16", num_kv_blocks=128)
    prompts = _prompts()
    outs = llm.generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outs, strict=True):
        ref = _hf_greedy(hf, prompt)
        d = next((i for i, (a, b) in enumerate(zip(ref, out.token_ids, strict=True)) if a != b), None)
        if d is None:
            continue
        ids = torch.tensor([prompt + ref[:d]])
        with torch.inference_mode():
            logits = hf(ids).logits[0, -1].float()
        gap = (logits[ref[d]] - logits[out.token_ids[d]]).item()
        # bf16 carries 8 significant bits: one ulp at |logit| in [16, 32) is 0.125.
        tol = 2.0 ** (torch.floor(torch.log2(logits[ref[d]].abs())).item() - 7)
        assert gap <= 2 * tol, f"len {len(prompt)}: diverged at {d} with a logit gap {gap:.4f} (> bf16 tie {tol})"
    llm.engine.check_block_accounting()
