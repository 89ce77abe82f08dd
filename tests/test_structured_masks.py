"""Grammar masks in the sampler: the additive bias equals llguidance's bitmask bit for bit, adding it equals a masked
fill, and masks filled on the native masks thread during the forward pass give exactly the tokens of masks filled
inline (greedy and seeded sampling, constrained rows mixed with unconstrained ones)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.structured.bitmask import MaskBatch, MaskBuffers, mask_bias
from engine.structured.native import MaskFiller, NativeMatcher
from engine.structured.prefetch import MaskPrefetch
from engine.structured.spec import StructuredOutput

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 999}},
          "required": ["name", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def llm(checkpoint: Callable[[str], Path]) -> LLM:
    return LLM(str(checkpoint("llama")))


def test_the_bias_is_zero_exactly_where_the_bitmask_allows_and_minus_inf_elsewhere() -> None:
    gen = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, 4), dtype=torch.int32, generator=gen)
    words = bitmask.to(torch.int64) & 0xFFFFFFFF
    allowed = ((words.unsqueeze(-1) >> torch.arange(32)) & 1).bool().reshape(3, 128)
    for width in (100, 128, 140):  # narrower than the mask, equal, wider (the head's padding columns)
        bias = mask_bias(bitmask, width)
        assert bias.shape == (3, width) and bias.dtype == torch.bfloat16
        want = torch.full((3, width), float("-inf"), dtype=torch.bfloat16)
        want[:, :min(width, 128)][allowed[:, :width]] = 0.0
        assert torch.equal(bias, want)


@pytest.mark.parametrize("rows", [[0, 1, 2, 3], [1, 3]], ids=["all-rows", "mixed"])
def test_applying_the_masks_equals_a_masked_fill_of_the_constrained_rows(llm: LLM, rows: list[int]) -> None:
    grammars = llm.engine.grammars
    spec = StructuredOutput("json_schema", json.dumps(SCHEMA))
    matchers: list[NativeMatcher | None] = [grammars.matcher(spec) if i in rows else None for i in range(4)]
    for i, text in zip(rows, ['{"name":"a', '{"name":"abc","n":1'], strict=False):
        m = matchers[i]
        assert m is not None and m.consume_tokens(llm.tokenizer.encode(text, add_special_tokens=False))
    width = grammars.vocab_size + 7
    logits = torch.randn(4, width, generator=torch.Generator().manual_seed(1))
    logits[0, 5] = -0.0
    masks = MaskBatch(MaskFiller(), matchers, grammars.vocab_size, width)
    got = logits.clone()
    masks.apply(got)
    want = logits.clone()
    assert masks.bitmask is not None
    for j, i in enumerate(rows):
        words = masks.bitmask[j].to(torch.int64) & 0xFFFFFFFF
        allowed = ((words.unsqueeze(-1) >> torch.arange(32)) & 1).bool().reshape(-1)[:width]
        allowed = torch.cat([allowed, allowed.new_zeros(width - allowed.numel())])
        want[i].masked_fill_(~allowed, float("-inf"))
    assert torch.equal(got, want)
    assert 0 < int(torch.isfinite(got[rows]).sum()) < len(rows) * width


def test_a_prefetch_for_other_rows_is_not_used_and_one_never_taken_is_completed(llm: LLM) -> None:
    grammars = llm.engine.grammars
    m = grammars.matcher(StructuredOutput("regex", "[0-9]{3}"))
    filler = MaskFiller()
    if not filler.threaded:
        pytest.skip("no C compiler, or native kernels disabled: no masks thread")
    pf = MaskPrefetch(filler, MaskBuffers())
    try:
        pf.start([m, None], grammars.vocab_size, grammars.vocab_size)
        assert pf.take([None, m], grammars.vocab_size) is None  # different rows: the sampler fills its own
        pf.start([m], grammars.vocab_size, grammars.vocab_size)
        batch = pf.take([m], grammars.vocab_size)
        assert batch is not None and batch.filled and pf.prefetched == 2
        logits = torch.zeros(1, grammars.vocab_size)
        batch.apply(logits)
        allowed = {int(t) for t in torch.nonzero(torch.isfinite(logits[0]))}
        assert allowed and all(llm.tokenizer.decode([t]).isdigit() for t in allowed)
        pf.start([m], grammars.vocab_size, grammars.vocab_size)
        pf.settle()  # started, never taken (a forward pass that raised): completed, then dropped
        assert pf.take([m], grammars.vocab_size) is None
        assert m.consume_token(next(iter(allowed)))  # the matcher is free again
    finally:
        filler.close()


def test_masks_filled_during_the_forward_give_the_tokens_of_masks_filled_inline(llm: LLM) -> None:
    """A batch of constrained rows (greedy and seeded sampling) beside unconstrained ones, with the masks thread on
    and off: token for token the same, and the masks really came from the thread."""
    prompts = [llm.tokenizer.encode(f"Item {i}:") for i in range(12)]
    kinds = [StructuredOutput("json_schema", json.dumps(SCHEMA)), StructuredOutput("regex", "[a-z]{2,6}-[0-9]{2,4}"),
             None]
    params = [SamplingParams(max_tokens=24, temperature=0 if i % 2 else 0.9, seed=i, structured=kinds[i % 3])
              for i in range(12)]
    sampler = llm.engine.sampler
    default = sampler.mask_overlap
    runs = []
    try:
        for overlap in (False, True):
            sampler.mask_overlap = overlap
            runs.append([o.token_ids for o in llm.generate(prompts, params)])
    finally:
        sampler.mask_overlap = default
    assert runs[0] == runs[1]
    assert sampler._prefetch is not None and sampler._prefetch.prefetched > 10
