"""Batched token sampling.

Order of operations, per row: penalties on the raw logits (repetition over prompt+output, presence/frequency over
output), then the request's ``logit_bias`` added, then greedy argmax, or temperature, top-k, top-p and min-p
filtering followed by a draw. Logprobs are those of the model's raw distribution (before penalties, bias and
temperature), as vLLM reports them by default.

Reproducibility: a request with a seed draws from its own ``torch.Generator`` using one exponential variate per
vocabulary entry per step (the Gumbel-max trick, ``argmax(p / E)``). The draw depends only on the request's own
probabilities and generator state, so the same seed gives the same tokens whatever else shares the batch.
Unseeded rows share the engine's generator.

Constrained rows (``params.structured``): after penalties and bias, every token the request's grammar does not allow
next gets -inf (:mod:`engine.structured.bitmask`), then the same pick. The masks are filled on a native thread while
the forward pass runs (:meth:`Sampler.prefetch`, which the model runner calls before it; see
:mod:`engine.structured.prefetch`), or inline where no C compiler built that thread.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.request import Request, TokenLogprobs
from engine.structured.bitmask import MaskBatch, MaskBuffers
from engine.structured.native import MaskFiller
from engine.structured.prefetch import MaskPrefetch


@dataclass(slots=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


class Sampler:
    def __init__(self, generator: torch.Generator | None = None, vocab_size: int = 0) -> None:
        self.generator = generator or torch.Generator().manual_seed(0)
        self.vocab_size = vocab_size  # the grammar masks' width (0: the logits' width)
        self._filler: MaskFiller | None = None
        self._prefetch: MaskPrefetch | None = None
        self._mask_buffers = MaskBuffers()  # one step's masks at a time, prefetched or inline
        self._width = 0  # the logits' width, as last seen
        self._mask_overlap: bool | None = None  # None: the default, decided at the first constrained step

    @property
    def mask_overlap(self) -> bool:
        """Grammar masks filled on the native masks thread during the forward pass; the engine's thread takes the
        rows it has not begun, so this is never slower than inline (tandem bench structured times both). False:
        filled inline, in __call__. Off by default where no C compiler built the thread; decided on first use, so
        an engine that never sees a constrained request never builds or loads it."""
        if self._mask_overlap is None:
            self._mask_overlap = self.filler().threaded
        return self._mask_overlap

    @mask_overlap.setter
    def mask_overlap(self, on: bool) -> None:
        self._mask_overlap = on

    def filler(self) -> MaskFiller:
        if self._filler is None:
            self._filler = MaskFiller()
        return self._filler

    def prefetch(self, requests: list[Request]) -> None:
        """Start filling the grammar masks of ``requests`` (the rows of the next call) on the masks thread."""
        if not self._width or all(r.matcher is None for r in requests) or not self.mask_overlap:
            return
        if self._prefetch is None:
            self._prefetch = MaskPrefetch(self.filler(), self._mask_buffers)
        self._prefetch.start([r.matcher for r in requests], self.vocab_size or self._width, self._width)

    def settle_masks(self) -> None:
        """Complete a mask fill started for a step no sampler took (its matchers are then free to change)."""
        if self._prefetch is not None:
            self._prefetch.settle()

    def _masks(self, requests: list[Request], width: int) -> MaskBatch:
        matchers = [r.matcher for r in requests]
        masks = self._prefetch.take(matchers, width) if self._prefetch is not None else None
        return masks or MaskBatch(self.filler(), matchers, self.vocab_size or width, width, self._mask_buffers)

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> SampleResult:
        """``logits``: float32 [len(requests), vocab], on CPU or GPU."""
        n = len(requests)
        raw = logits
        params = [r.params for r in requests]
        masks = None
        self._width = logits.shape[1]
        if any(r.matcher is not None for r in requests):
            masks = self._masks(requests, logits.shape[1])
        if masks is None and all(p.greedy and not p.needs_processing for p in params):
            tokens = logits.argmax(dim=-1)
        else:
            logits = logits.clone()
            for i, r in enumerate(requests):
                if r.params.needs_penalties:
                    _apply_penalties(logits[i], r)
                if r.params.logit_bias:
                    apply_logit_bias(logits[i], r.params.logit_bias)
            if masks is not None:
                masks.apply(logits)
            tokens = torch.empty(n, dtype=torch.long, device=logits.device)
            greedy_rows = [i for i, p in enumerate(params) if p.greedy]
            if greedy_rows:
                idx = torch.tensor(greedy_rows, device=logits.device)
                tokens[idx] = logits[idx].argmax(dim=-1)
            sample_rows = [i for i, p in enumerate(params) if not p.greedy]
            if sample_rows:
                tokens_s = self._sample(logits, sample_rows, requests)
                tokens[torch.tensor(sample_rows, device=logits.device)] = tokens_s
        token_list: list[int] = tokens.tolist()
        lps: list[TokenLogprobs | None] = [None] * n
        want = [i for i, p in enumerate(params) if p.logprobs is not None]
        if want:
            idx = torch.tensor(want, device=raw.device)
            logp = torch.log_softmax(raw[idx], dim=-1)
            k = max(params[i].logprobs or 0 for i in want)
            top_v, top_i = (logp.topk(k, dim=-1) if k else (logp[:, :0], logp[:, :0].long()))
            chosen = logp.gather(1, tokens[idx].unsqueeze(1)).squeeze(1).tolist()
            top_v_l, top_i_l = top_v.tolist(), top_i.tolist()
            for j, i in enumerate(want):
                kk = params[i].logprobs or 0
                lps[i] = TokenLogprobs(token_list[i], chosen[j], list(zip(top_i_l[j][:kk], top_v_l[j][:kk],
                                                                           strict=True)))
        return SampleResult(token_list, lps)

    def _sample(self, logits: torch.Tensor, rows: list[int], requests: list[Request]) -> torch.Tensor:
        out = []
        for i in rows:
            p = requests[i].params
            row = logits[i] / p.temperature
            probs = filtered_probs(row, p.top_k, p.top_p, p.min_p)
            gen = requests[i].generator or self.generator
            e = torch.empty_like(probs).exponential_(generator=gen) if probs.device.type == "cpu" else \
                torch.empty(probs.shape, dtype=probs.dtype).exponential_(generator=gen).to(probs.device)
            out.append(torch.argmax(probs / e))
        return torch.stack(out)


def filtered_probs(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Softmax over the support left after top-k, then top-p (nucleus), then min-p. 1-D input."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        cum = sorted_p.cumsum(-1)
        # Keep the smallest prefix whose mass reaches top_p (always at least the top token).
        drop_sorted = (cum - sorted_p) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    if min_p > 0.0:
        probs = probs.masked_fill(probs < min_p * probs.max(), 0.0)
    return probs / probs.sum()


def apply_logit_bias(row: torch.Tensor, bias: tuple[tuple[int, float], ...]) -> None:
    """Add each ``(token_id, bias)`` to ``row`` in place (ids are validated against the vocabulary upstream)."""
    ids = torch.tensor([t for t, _ in bias], dtype=torch.long, device=row.device)
    vals = torch.tensor([b for _, b in bias], dtype=row.dtype, device=row.device)
    row.index_add_(0, ids, vals)


def _apply_penalties(row: torch.Tensor, r: Request) -> None:
    p = r.params
    device = row.device
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(r.all_token_ids)), dtype=torch.long, device=device)
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and r.output_token_ids:
        out = torch.tensor(r.output_token_ids, dtype=torch.long, device=device)
        counts = torch.bincount(out, minlength=row.shape[0]).to(row.dtype)
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
