"""Greedy token-for-token parity with HF transformers, for every supported architecture and every engine mode.

The reference is transformers' ``generate`` (greedy, float32, one prompt at a time so no padding is involved) on the
same checkpoint directory that Tandem's loader reads. Every test also checks, at the end, that every KV block is
back in the pool (free or cached) and none leaked.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from engine.llm import LLM
from engine.sampling_params import SamplingParams

ARCHS = ["llama", "qwen2", "qwen3", "mistral", "mixtral", "qwen3_moe"]
MAX_NEW = 12
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


def _prompts(vocab: int) -> list[list[int]]:
    """16 prompts with lengths from 1 to 150 tokens (longer than Mistral's 64-token sliding window)."""
    rng = random.Random(1234)
    lengths = [1, 2, 3, 5, 8, 13, 16, 17, 31, 32, 33, 47, 64, 65, 100, 150]
    return [[rng.randrange(vocab - 8) for _ in range(n)] for n in lengths]


class Reference:
    """transformers' greedy continuations, computed once per (arch, prompt)."""

    def __init__(self, path: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.cache: dict[tuple[int, ...], list[int]] = {}

    def __call__(self, prompt: list[int], max_new: int = MAX_NEW) -> list[int]:
        key = (*prompt, -max_new)
        if key not in self.cache:
            ids = torch.tensor([prompt])
            with torch.inference_mode():
                out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                                          min_new_tokens=max_new, do_sample=False, eos_token_id=None, pad_token_id=0)
            self.cache[key] = out[0, len(prompt):].tolist()
        return self.cache[key]


@pytest.fixture(scope="module", params=ARCHS)
def arch_setup(request: pytest.FixtureRequest, checkpoint: Callable[[str], Path]) -> tuple[str, Path, Reference]:
    path = checkpoint(request.param)
    return request.param, path, Reference(path)



@pytest.fixture
def make_llm(arch_setup: tuple[str, Path, Reference]) -> Iterator[Callable[..., LLM]]:
    made: list[LLM] = []

    def make(**kw: object) -> LLM:
        llm = LLM(str(arch_setup[1]), num_kv_blocks=kw.pop("num_kv_blocks", 256), **kw)  # type: ignore[arg-type]
        made.append(llm)
        return llm

    yield make
    for llm in made:
        llm.engine.check_block_accounting()


def _vocab(llm: LLM) -> int:
    return llm.engine.model_config.vocab_size


@pytest.mark.parametrize("batch", [1, 5, 16])
def test_batched_greedy_matches_transformers(arch_setup: tuple[str, Path, Reference],
                                             make_llm: Callable[..., LLM], batch: int) -> None:
    _, _, ref = arch_setup
    llm = make_llm()
    prompts = _prompts(_vocab(llm))
    chosen = prompts[-batch:] if batch < len(prompts) else prompts
    outs = llm.generate(chosen, GREEDY)
    for prompt, out in zip(chosen, outs, strict=True):
        assert out.token_ids == ref(prompt), f"prompt of {len(prompt)} tokens diverged"
        assert out.finish_reason == "length"


def test_chunked_prefill_matches_transformers(arch_setup: tuple[str, Path, Reference],
                                              make_llm: Callable[..., LLM]) -> None:
    """A 16-token budget splits every long prompt into chunks, mixed with other requests' decode steps."""
    _, _, ref = arch_setup
    llm = make_llm(max_num_batched_tokens=16)
    prompts = _prompts(_vocab(llm))[6:]
    outs = llm.generate(prompts, GREEDY)
    assert llm.engine.num_steps > sum(len(p) for p in prompts) // 16
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == ref(prompt)


def test_prefix_cache_hit_computes_fewer_tokens_and_matches(arch_setup: tuple[str, Path, Reference],
                                                             make_llm: Callable[..., LLM]) -> None:
    _, _, ref = arch_setup
    llm = make_llm()
    rng = random.Random(7)
    vocab = _vocab(llm)
    prefix = [rng.randrange(vocab - 8) for _ in range(96)]
    first = [*prefix, 11, 12, 13]
    others = [[*prefix, *(rng.randrange(vocab - 8) for _ in range(5 + i))] for i in range(4)]
    assert llm.generate([first], GREEDY)[0].token_ids == ref(first)
    before = llm.engine.num_scheduled_tokens
    outs = llm.generate(others, GREEDY)
    computed = llm.engine.num_scheduled_tokens - before
    uncached = sum(len(p) for p in others) + len(others) * (MAX_NEW - 1)
    assert computed <= uncached - len(others) * 96
    for prompt, out in zip(others, outs, strict=True):
        assert out.num_cached_tokens == 96
        assert out.token_ids == ref(prompt)


def test_preemption_by_recompute_matches_transformers(arch_setup: tuple[str, Path, Reference],
                                                      make_llm: Callable[..., LLM]) -> None:
    """60 blocks of 4 tokens hold about half of 8 long prompts: growing requests preempt others, which recompute."""
    _, _, ref = arch_setup
    llm = make_llm(num_kv_blocks=60, block_size=4)
    prompts = _prompts(_vocab(llm))[8:]
    preempted: list[int] = []
    orig = llm.engine.scheduler._preempt

    def spy(req):  # type: ignore[no-untyped-def]
        preempted.append(1)
        orig(req)

    llm.engine.scheduler._preempt = spy  # type: ignore[method-assign]
    outs = llm.generate(prompts, GREEDY)
    assert preempted, "the tiny cache should have forced at least one preemption"
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == ref(prompt)


def test_without_prefix_caching_matches_transformers(arch_setup: tuple[str, Path, Reference],
                                                     make_llm: Callable[..., LLM]) -> None:
    _, _, ref = arch_setup
    llm = make_llm(enable_prefix_caching=False, block_size=8)
    prompts = _prompts(_vocab(llm))[::3]
    for prompt, out in zip(prompts, llm.generate(prompts, GREEDY), strict=True):
        assert out.token_ids == ref(prompt)
        assert out.num_cached_tokens == 0
