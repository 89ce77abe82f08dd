"""Verification of proposed tokens against the target model's distributions (speculative sampling).

Given the target's logits at the K+1 positions of one request's verified rows and the K proposed tokens:

- greedy: accept each proposal while it equals the target's argmax; then emit the target's argmax at the first
  mismatch (or after the last proposal). Output is exactly what non-speculative greedy decoding gives.
- sampling (Leviathan et al., Chen et al.): with p the target's filtered distribution at a position and q the
  proposer's, accept proposal d with probability min(1, p(d) / q(d)); on rejection draw from norm(max(0, p - q))
  and stop; if all K are accepted draw a bonus token from p at the last position. The emitted tokens are then
  distributed exactly as sampling from the target alone. A deterministic proposer (n-gram, a greedy draft) is the
  case q = one-hot(d): accept with probability p(d), on rejection draw from p with d removed.

The target's processing is the sampler's (logit bias, temperature, top-k, top-p, min-p); requests that need
penalties, logprobs or a grammar are never speculated (``decoder.py``), since their distribution at a position
depends on what was emitted before it within the step.
"""

from __future__ import annotations

import torch

from engine.sampler import apply_logit_bias, filtered_probs
from engine.sampling_params import SamplingParams


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution the sampler draws from at each row of ``logits`` [rows, vocab] (float32, rows sum to 1)."""
    logits = logits.float()
    if params.logit_bias:
        logits = logits.clone()
        for row in logits:
            apply_logit_bias(row, params.logit_bias)
    return torch.stack([filtered_probs(row / params.temperature, params.top_k, params.top_p, params.min_p)
                        for row in logits])


def verify_greedy(logits: torch.Tensor, drafts: list[int], params: SamplingParams) -> list[int]:
    """Tokens emitted this step: the accepted prefix of ``drafts`` and the target's next token after it."""
    if params.logit_bias:
        logits = logits.clone()
        for row in logits:
            apply_logit_bias(row, params.logit_bias)
    target: list[int] = logits.argmax(dim=-1).tolist()
    out = []
    for i, d in enumerate(drafts):
        if d != target[i]:
            break
        out.append(d)
    out.append(target[len(out)])
    return out


def verify_sampled(p: torch.Tensor, drafts: list[int], q: torch.Tensor | None, generator: torch.Generator) -> list[int]:
    """Rejection-sample ``drafts`` against target probabilities ``p`` [K+1, V]; ``q`` [K, V] is the proposer's
    distribution (None: deterministic proposals, q = one-hot). Tokens emitted this step, 1 to K+1 of them."""
    out: list[int] = []
    u = torch.rand(len(drafts), generator=generator, dtype=torch.float64).tolist()
    for i, d in enumerate(drafts):
        pd = float(p[i, d])
        qd = 1.0 if q is None else float(q[i, d])
        if qd > 0 and u[i] < min(1.0, pd / qd):
            out.append(d)
            continue
        if q is None:
            residual = p[i].clone()
            residual[d] = 0.0
        else:
            residual = (p[i] - q[i]).clamp_min(0.0)
        total = float(residual.sum())
        # p == q (or p one-hot on d): the rejection has probability 0, so any draw is never used; fall back to p.
        dist = residual / total if total > 0 else p[i]
        out.append(int(torch.multinomial(dist, 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(p[len(drafts)], 1, generator=generator)))
    return out
