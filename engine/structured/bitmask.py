"""The token bitmask of a batch's constrained rows: computed by llguidance, applied to the logits in the sampler.

Per step the sampler builds a :class:`MaskBatch` for its rows: llguidance fills one int32 bitmask row per constrained
request (on its own thread pool, in parallel over requests, off the GIL, when the host has more than two CPUs),
then every disallowed token's logit becomes -inf. Unconstrained rows are never touched, so they sample exactly as in
a batch without constrained requests.

The masks are computed inline, after the forward pass, not overlapped with it: handing the fill to a background
Python thread cost ~2 ms a step in GIL hand-offs on a 2-core host (``tandem bench structured``), about what the fill of
32 JSON-schema rows costs there, so on such hosts overlapping gains nothing.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import llguidance as llg
import llguidance.torch as llg_torch
import numpy as np
import torch

# llguidance's thread pool pays a thread wake-up per step; with two CPUs or fewer (where its pool has one thread) that
# costs more than it saves: 10 ms against 5 ms a step for 32 JSON-schema rows on a busy 2-core host.
_PARALLEL = (os.cpu_count() or 1) > 2


class MaskBatch:
    """Masks for one step. ``matchers[i]`` is row i's matcher, or None for an unconstrained row."""

    def __init__(self, executor: llg.LLExecutor, matchers: Sequence[llg.LLMatcher | None], vocab_size: int) -> None:
        self.rows = [i for i, m in enumerate(matchers) if m is not None]
        self.all_rows = len(self.rows) == len(matchers)
        self.vocab_size = vocab_size
        self.bitmask = llg_torch.allocate_token_bitmask(len(self.rows), vocab_size) if self.rows else None
        self._pairs = [(m, j) for j, m in enumerate(m for m in matchers if m is not None)]
        self._executor = executor

    def apply(self, logits: torch.Tensor) -> None:
        """Mask ``logits`` [batch, vocab'] in place (vocab' may exceed the grammar's vocabulary: the model's head
        has padding columns no token maps to, and they are masked too)."""
        if self.bitmask is None:
            return
        if len(self._pairs) > 1 and _PARALLEL:
            llg_torch.fill_next_token_bitmask_par(self._executor, self._pairs, self.bitmask)
        else:
            for m, j in self._pairs:
                llg_torch.fill_next_token_bitmask(m, self.bitmask, j)
        allowed = unpack(self.bitmask, logits.shape[1]).to(logits.device)
        if self.all_rows:
            logits.masked_fill_(~allowed, float("-inf"))
            return
        idx = torch.tensor(self.rows, dtype=torch.long, device=logits.device)
        logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))


def unpack(bitmask: torch.Tensor, width: int) -> torch.Tensor:
    """int32 [rows, words] bitmask -> bool [rows, width] (bit b of word w is token 32*w + b; beyond the mask,
    False)."""
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little").view(np.bool_)
    out = torch.from_numpy(bits)
    if out.shape[1] >= width:
        return out[:, :width]
    return torch.cat([out, out.new_zeros(out.shape[0], width - out.shape[1])], dim=1)
