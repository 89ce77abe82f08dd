"""Prompt logprobs: the logprob of each prompt token given the tokens before it, from the prefill forward pass.

A prefill step already computes a hidden state for every prompt position it covers; for a request that asked for
``prompt_logprobs`` those rows also go through the LM head, and position ``p``'s log-softmax scores prompt token
``p + 1`` (with the top-N alternatives). The first prompt token has no context and gets no entry. A chunked
prefill adds its chunk's entries step by step; a prefill recomputed after preemption skips the positions it already
scored. Such a request computes its whole prompt (the KV cache manager gives it no prefix hits): a cached block has
no hidden states to score.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.request import Request, TokenLogprobs


def add_prompt_logprobs(hidden: torch.Tensor, requests: list[Request], num_new_tokens: list[int],
                        compute_logits: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Append to each asking request's ``prompt_logprobs`` the entries its rows in ``hidden`` (a step's flat
    batch, requests in order, not yet advanced by the step) score."""
    t = 0
    for req, q in zip(requests, num_new_tokens, strict=True):
        k = req.params.prompt_logprobs
        start = req.num_computed_tokens
        if k is not None:
            first = max(start, len(req.prompt_logprobs))  # positions already scored are skipped
            last = min(start + q, req.num_prompt_tokens - 1)  # the last prompt position scores the first output
            if first < last:
                rows = hidden[t + first - start: t + last - start]
                req.prompt_logprobs.extend(score(compute_logits(rows).float(),
                                                 req.prompt_token_ids[first + 1: last + 1], k))
        t += q


def score(logits: torch.Tensor, targets: list[int], k: int) -> list[TokenLogprobs]:
    """For each row of ``logits``, the logprob of its target token and the top-``k`` alternatives."""
    logp = torch.log_softmax(logits, dim=-1)
    chosen = logp.gather(1, torch.tensor(targets, dtype=torch.long, device=logp.device).unsqueeze(1))
    chosen_l = chosen.squeeze(1).tolist()
    if k:
        top_v, top_i = logp.topk(k, dim=-1)
        tops = [list(zip(i, v, strict=True)) for i, v in zip(top_i.tolist(), top_v.tolist(), strict=True)]
    else:
        tops = [[] for _ in targets]
    return [TokenLogprobs(tok, lp, top) for tok, lp, top in zip(targets, chosen_l, tops, strict=True)]
