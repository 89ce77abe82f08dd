"""The native grammar-mask kernel (``engine/structured/apply_bitmask.c``) equals the bias path and a masked fill bit
for bit: random words and the all-ones and all-zeros words it short-cuts, a subset of rows, logits wider than the
mask (the head's padding columns) and narrower, a row stride wider than the row; and the sampler's ``apply`` takes it
for CPU fp32 logits and the bias path for others."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.structured import bitmask as bm
from engine.structured.bitmask import MaskBatch, apply_kernel, mask_bias
from engine.structured.compiler import GrammarCompiler
from engine.structured.native import MaskFiller
from engine.structured.spec import StructuredOutput
from engine.tokenizer import Tokenizer

kernel = apply_kernel()
pytestmark = pytest.mark.skipif(kernel is None, reason="no C compiler, or native kernels disabled")


def _masked_fill(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    width = logits.shape[1]
    words = bitmask.to(torch.int64) & 0xFFFFFFFF
    allowed = ((words.unsqueeze(-1) >> torch.arange(32)) & 1).bool().reshape(len(rows), -1)
    allowed = torch.cat([allowed, allowed.new_zeros(len(rows), max(0, width - allowed.shape[1]))], dim=1)[:, :width]
    out = logits.clone()
    for j, r in enumerate(rows):
        out[r].masked_fill_(~allowed[j], float("-inf"))
    return out


@pytest.mark.parametrize("width", [100, 128, 140, 2048 + 13])
@pytest.mark.parametrize("rows", [[0, 1, 2, 3, 4], [1, 4]], ids=["all-rows", "subset"])
def test_the_kernel_equals_a_masked_fill_and_the_bias_path(width: int, rows: list[int]) -> None:
    gen = torch.Generator().manual_seed(width)
    words = max(1, min(width, 2048) // 32)
    bitmask = torch.randint(-2**31, 2**31 - 1, (len(rows), words), dtype=torch.int32, generator=gen)
    bitmask[0, ::3] = -1  # all allowed: skipped
    bitmask[-1, 1::3] = 0  # none allowed: filled
    storage = torch.randn(5, width + 9, generator=gen)
    logits = storage[:, :width]  # rows further apart than their width
    logits[rows[0], 0] = -0.0
    want = _masked_fill(logits, bitmask, rows)
    got = logits.clone()
    kernel(got.data_ptr(), got.stride(0), bitmask.data_ptr(), words, np.asarray(rows, dtype=np.int64).ctypes.data,
           len(rows), width)
    assert torch.equal(got, want)
    strided = storage.clone()[:, :width]  # the kernel writes nothing past each row's width
    kernel(strided.data_ptr(), strided.stride(0), bitmask.data_ptr(), words,
           np.asarray(rows, dtype=np.int64).ctypes.data, len(rows), width)
    assert torch.equal(strided, want) and torch.equal(storage[:, width:], strided.as_strided(
        (5, 9), (strided.stride(0), 1), width))
    via_bias = logits.clone()
    via_bias.index_add_(0, torch.tensor(rows), mask_bias(bitmask, width).float())
    assert torch.equal(via_bias, want)


def test_apply_uses_the_kernel_for_cpu_fp32_logits_and_the_bias_otherwise(
        monkeypatch: pytest.MonkeyPatch, checkpoint: Callable[[str], Path]) -> None:
    path = checkpoint("llama")
    tokenizer = Tokenizer(path)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    grammars = GrammarCompiler(tokenizer, vocab, tokenizer.eos_token_id)
    matcher = grammars.matcher(StructuredOutput("regex", "[a-c]{2}"))
    batch = MaskBatch(MaskFiller(), [None, matcher], vocab, vocab + 3)
    logits = torch.randn(2, vocab + 3)
    kernel_out = logits.clone()
    batch.apply(kernel_out)
    assert batch.bias is None  # the kernel ran: no bias was built
    allowed = torch.isfinite(kernel_out[1]).nonzero().flatten().tolist()
    texts = [tokenizer.decode([t]) for t in allowed]
    assert allowed and all(0 < len(t) <= 2 and set(t) <= set("abc") for t in texts), texts
    assert torch.equal(kernel_out[0], logits[0])
    monkeypatch.setattr(bm, "apply_kernel", lambda: None)
    bias_out = logits.clone()
    batch.apply(bias_out)
    assert batch.bias is not None and torch.equal(bias_out, kernel_out)
    half = logits.to(torch.bfloat16)  # not fp32: the bias path, with the kernel back
    monkeypatch.undo()
    batch.apply(half)
    assert torch.isfinite(half[1]).nonzero().flatten().tolist() == allowed
