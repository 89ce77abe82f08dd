"""The token bitmask of a batch's constrained rows: computed by llguidance, applied to the logits in the sampler.

A :class:`MaskBatch` holds one step's masks. :meth:`MaskBatch.fill` has llguidance write one int32 bitmask row per
constrained request, then turns the bits into an additive bias (0 where a token is allowed, -inf where it is not, in
bfloat16) with integer ops on the unpacked bits; any thread may fill, as llguidance computes with the GIL released.
:meth:`MaskBatch.apply` adds the bias to the constrained rows of the logits, one op for the batch: ~40 us for 32 rows
of 2k tokens, bias included, where ``masked_fill_`` with a boolean mask took ~220 us. For finite logits ``x + 0 == x``
and ``x + -inf == -inf``, so the result is exactly a masked fill's (a -0.0 logit becomes +0.0, which compares,
exponentiates and divides alike). Unconstrained rows are never touched, so they sample exactly as in a batch without
constrained requests. Where the host has CPUs to spare the fill runs on a worker thread while the forward pass
computes (:mod:`.prefetch`); the sampler fills inline whatever was not prefetched.

One fill, two ways: a single call into llguidance's executor for the whole batch (one GIL release; its pool spreads
the rows over its threads), or one call per row on the calling thread. Inline fills on hosts with two CPUs or fewer
use the second: the executor's pool thread there spins for work beside the engine's own thread (10 ms against 5 ms
a step for 32 JSON-schema rows on a busy 2-core host).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import llguidance as llg
import llguidance.torch as llg_torch
import numpy as np
import torch

SMALL_HOST = (os.cpu_count() or 1) <= 2
_NEG_INF_BITS = np.int16(-128)  # 0xFF80: bfloat16 -inf


class MaskBuffers:
    """The bitmask and bias memory of one step at a time, kept across steps (grow-only): a fresh bias each step paid
    its page faults. One step's masks are done with before the next step's are started, so one set serves."""

    def __init__(self) -> None:
        self._bitmask = torch.empty(0, 0, dtype=torch.int32)
        self._bias = torch.empty(0, 0, dtype=torch.bfloat16)

    def bitmask(self, rows: int, words: int) -> torch.Tensor:
        if self._bitmask.shape[0] < rows or self._bitmask.shape[1] != words:
            self._bitmask = torch.empty(max(rows, self._bitmask.shape[0]), words, dtype=torch.int32)
        return self._bitmask[:rows]

    def bias(self, rows: int, width: int) -> torch.Tensor:
        if self._bias.shape[0] < rows or self._bias.shape[1] != width:
            self._bias = torch.empty(max(rows, self._bias.shape[0]), width, dtype=torch.bfloat16)
        return self._bias[:rows]


class MaskBatch:
    """Masks for one step. ``matchers[i]`` is row i's matcher, or None for an unconstrained row. ``width`` is the
    logits' width (the model's head may have padding columns past the grammar's vocabulary: they are disallowed)."""

    def __init__(self, executor: llg.LLExecutor, matchers: Sequence[llg.LLMatcher | None], vocab_size: int,
                 width: int, buffers: MaskBuffers | None = None) -> None:
        self.matchers = list(matchers)
        self.rows = [i for i, m in enumerate(matchers) if m is not None]
        self.all_rows = len(self.rows) == len(matchers)
        self.width = width
        self._buffers = buffers or MaskBuffers()
        # every word of every row is written by the fill: no need to initialise it
        self.bitmask = self._buffers.bitmask(*llg_torch.get_bitmask_shape(len(self.rows), vocab_size)) \
            if self.rows else None
        self.bias: torch.Tensor | None = None  # bfloat16 [constrained rows, width]: 0 or -inf, once filled
        self._pairs = [(m, j) for j, m in enumerate(m for m in matchers if m is not None)]
        self._executor = executor

    def fill(self, one_call: bool = not SMALL_HOST) -> None:
        """Compute the masks (once). ``one_call``: the whole batch in one call into llguidance's executor."""
        if self.bitmask is None or self.bias is not None:
            return
        # Straight into our own contiguous int32 buffer (llguidance checks each row's size against its vocabulary):
        # llguidance.torch's per-row wrapper slices a tensor view per row, ~2.5 us a row, more than most masks cost.
        ptr, row_bytes = self.bitmask.data_ptr(), self.bitmask.shape[1] * 4
        if one_call and len(self._pairs) > 1:
            self._executor.unsafe_compute_mask_ptr(self._pairs, ptr, row_bytes, len(self._pairs))
        else:
            for m, j in self._pairs:
                m.unsafe_compute_mask_ptr(ptr + j * row_bytes, row_bytes)
        self.bias = mask_bias(self.bitmask, self.width, self._buffers.bias(len(self.rows), self.width))

    def apply(self, logits: torch.Tensor) -> None:
        """Mask ``logits`` [batch, width] in place, filling first if that is not done yet."""
        if self.bitmask is None:
            return
        if logits.shape[1] != self.width:
            raise ValueError(f"masks of width {self.width} for logits of width {logits.shape[1]}")
        self.fill()
        assert self.bias is not None
        bias = self.bias.to(logits.device)
        if self.all_rows:
            logits.add_(bias)
        else:
            logits.index_add_(0, torch.tensor(self.rows, dtype=torch.long, device=logits.device), bias.to(logits.dtype))


def mask_bias(bitmask: torch.Tensor, width: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """int32 [rows, words] bitmask -> bfloat16 [rows, width] (into ``out`` if given): 0.0 for an allowed token (bit b
    of word w is token 32*w + b), -inf for the others and for every column beyond the mask. Built in place as int16
    bit patterns (``(bit - 1) & 0xFF80``), no float op; bfloat16 holds 0 and -inf exactly in half float32's bytes."""
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little", count=width)
    if out is None:
        out = torch.empty(bitmask.shape[0], width, dtype=torch.bfloat16)
    pattern = out.view(torch.int16).numpy()
    np.subtract(bits, 1, out=pattern, dtype=np.int16)
    np.bitwise_and(pattern, _NEG_INF_BITS, out=pattern)
    return out
