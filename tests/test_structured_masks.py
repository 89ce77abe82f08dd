"""Grammar masks in the sampler: the additive bias equals llguidance's bitmask bit for bit, adding it equals a masked
fill, and masks filled on the masks thread during the forward pass give exactly the tokens of masks filled inline
(greedy and seeded sampling, constrained rows mixed with unconstrained ones), as do masks computed as the matchers
advance at the end of the step before (``ReadyMasks``)."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import llguidance as llg
import pytest
import torch

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.structured.bitmask import MaskBatch, MaskBuffers, ReadyMasks, mask_bias
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
    matchers: list[llg.LLMatcher | None] = [grammars.matcher(spec) if i in rows else None for i in range(4)]
    for i, text in zip(rows, ['{"name":"a', '{"name":"abc","n":1'], strict=False):
        m = matchers[i]
        assert m is not None and m.consume_tokens(llm.tokenizer.encode(text, add_special_tokens=False))
    width = grammars.vocab_size + 7
    logits = torch.randn(4, width, generator=torch.Generator().manual_seed(1))
    logits[0, 5] = -0.0
    masks = MaskBatch(llg.LLExecutor(1), matchers, grammars.vocab_size, width)
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


def test_a_prefetch_for_other_rows_is_not_used_and_one_never_started_is_filled_inline(llm: LLM) -> None:
    grammars = llm.engine.grammars
    m = grammars.matcher(StructuredOutput("regex", "[0-9]{3}"))
    pf = MaskPrefetch(llg.LLExecutor(1), MaskBuffers())
    try:
        pf.start([m, None], grammars.vocab_size, grammars.vocab_size)
        assert pf.take([None, m], grammars.vocab_size) is None  # different rows: the sampler fills its own
        gate = threading.Event()
        pf._pool.submit(gate.wait, 30)  # the masks thread is busy: the next fill cannot start
        pf.start([m], grammars.vocab_size, grammars.vocab_size)
        batch = pf.take([m], grammars.vocab_size)
        gate.set()
        assert batch is not None and batch.bias is None and pf.inline == 1  # cancelled before it began
        logits = torch.zeros(1, grammars.vocab_size)
        batch.apply(logits)  # filled inline now
        allowed = {int(t) for t in torch.nonzero(torch.isfinite(logits[0]))}
        assert allowed and all(llm.tokenizer.decode([t]).isdigit() for t in allowed)
        pf.start([m], grammars.vocab_size, grammars.vocab_size)
        pf.settle()  # started, never taken (a forward pass that raised): waited for, then dropped
        assert pf.take([m], grammars.vocab_size) is None
    finally:
        pf.close()


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
    taken = sampler.ready_masks.taken
    try:
        for overlap, on_advance in ((False, False), (False, True), (True, True)):
            sampler.mask_overlap, sampler.fill_on_advance = overlap, on_advance
            runs.append([o.token_ids for o in llm.generate(prompts, params)])
            if not overlap:
                assert (sampler.ready_masks.taken > taken + 10) == on_advance
                taken = sampler.ready_masks.taken
    finally:
        sampler.mask_overlap, sampler.fill_on_advance = default, True
    assert runs[0] == runs[1] == runs[2]
    assert sampler._prefetch is not None and sampler._prefetch.prefetched > 10


def test_masks_computed_as_the_matchers_advance_equal_masks_computed_after(llm: LLM) -> None:
    """ReadyMasks: each advanced matcher's next mask, taken by a later batch in any row order (copied), beside rows
    it has no mask for (a new matcher, one advanced again since, which was discarded): all equal fresh fills."""
    grammars = llm.engine.grammars
    vocab = grammars.vocab_size
    spec = StructuredOutput("json_schema", json.dumps(SCHEMA))
    matchers, pairs = [], []
    for text in ('{"name":"a', '{"name":"abc","n":1', '{"na'):
        ids = llm.tokenizer.encode(text, add_special_tokens=False)
        m = grammars.matcher(spec)
        assert m.consume_tokens(ids[:-1])
        matchers.append(m)
        pairs.append((m, ids[-1]))
    ready = ReadyMasks()
    ready.advance(pairs, vocab)

    def fresh(ms: Sequence[llg.LLMatcher | None]) -> torch.Tensor:
        batch = MaskBatch(llg.LLExecutor(1), ms, vocab, vocab)
        batch.fill(one_call=False)
        assert batch.bitmask is not None
        return batch.bitmask.clone()

    same = MaskBatch(llg.LLExecutor(1), matchers, vocab, vocab, MaskBuffers(), ready)
    assert same.filled and same.bitmask is not None and ready.taken == 3  # all ready, in order: nothing filled
    assert torch.equal(same.bitmask, fresh(matchers))
    new = grammars.matcher(spec)
    rows: list[llg.LLMatcher | None] = [None, matchers[2], new, matchers[0], None]
    mixed = MaskBatch(llg.LLExecutor(1), rows, vocab, vocab, MaskBuffers(), ready)
    assert not mixed.filled and ready.taken == 5
    mixed.fill(one_call=True)
    assert mixed.bitmask is not None and torch.equal(mixed.bitmask, fresh(rows))
    assert matchers[1].consume_token(llm.tokenizer.encode("2", add_special_tokens=False)[-1])
    ready.discard(matchers[1])
    again = MaskBatch(llg.LLExecutor(1), matchers[:2], vocab, vocab, MaskBuffers(), ready)
    assert ready.taken == 6
    again.fill(one_call=False)
    assert again.bitmask is not None and torch.equal(again.bitmask, fresh(matchers[:2]))
    assert not torch.equal(again.bitmask[1], same.bitmask[1])  # its mask moved on with it
