"""The token bitmask of a batch's constrained rows: computed by llguidance, applied to the logits in the sampler.

Lifecycle per step: :meth:`MaskBatch.start` (before the forward pass) hands the constrained rows' matchers to
llguidance's thread pool, which fills one int32 bitmask row per request off the GIL while the model runs;
:meth:`MaskBatch.apply` (in the sampler) waits for it and sets every disallowed token's logit to -inf. Unconstrained
rows are never touched, so they sample exactly as in a batch without constrained requests.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance as llg
import llguidance.torch as llg_torch
import torch

_SHIFTS = torch.arange(32, dtype=torch.int32)


class MaskBatch:
    """Masks for one step. ``matchers[i]`` is row i's matcher, or None for an unconstrained row."""

    def __init__(self, executor: llg.LLExecutor, matchers: Sequence[llg.LLMatcher | None], vocab_size: int,
                 background: ThreadPoolExecutor | None = None) -> None:
        self.rows = [i for i, m in enumerate(matchers) if m is not None]
        self.vocab_size = vocab_size
        self.bitmask = llg_torch.allocate_token_bitmask(len(self.rows), vocab_size) if self.rows else None
        self._pairs = [(m, j) for j, m in enumerate(m for m in matchers if m is not None)]
        self._executor = executor
        self._background = background
        self._future: Future[None] | None = None

    def start(self) -> None:
        """Compute the masks in the background (llguidance releases the GIL), if a background thread was given."""
        if self.bitmask is not None and self._background is not None and self._future is None:
            self._future = self._background.submit(self._fill)

    def _fill(self) -> None:
        assert self.bitmask is not None
        llg_torch.fill_next_token_bitmask_par(self._executor, self._pairs, self.bitmask)

    def apply(self, logits: torch.Tensor) -> None:
        """Mask ``logits`` [batch, vocab'] in place (vocab' >= the grammar's vocabulary; extra columns are padding
        the model's head has and no tokenizer token maps to, so they are masked too)."""
        if self.bitmask is None:
            return
        if self._future is None:
            self._fill()
        else:
            self._future.result()  # re-raises the fill's error here, on the engine's thread
        allowed = unpack(self.bitmask, logits.shape[1]).to(logits.device)
        idx = torch.tensor(self.rows, dtype=torch.long, device=logits.device)
        logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))


def unpack(bitmask: torch.Tensor, width: int) -> torch.Tensor:
    """int32 [rows, words] bitmask -> bool [rows, width] (bit b of word w is token 32*w + b; beyond the mask,
    False)."""
    bits = ((bitmask.unsqueeze(-1) >> _SHIFTS) & 1).bool().view(bitmask.shape[0], -1)
    if bits.shape[1] >= width:
        return bits[:, :width]
    return torch.cat([bits, bits.new_zeros(bits.shape[0], width - bits.shape[1])], dim=1)
