"""OpenAI response pieces the gateway assembles: logprobs in the completions and chat shapes, echoed prompts,
vLLM's ``prompt_logprobs``, and the best ``n`` of ``best_of`` candidates.

Completions logprobs follow OpenAI's legacy shape: ``tokens``, ``token_logprobs``, ``top_logprobs`` (a dict per
token that always holds the sampled token besides the top-N alternatives, so ``logprobs=1`` gives the sampled
token and the best other one whenever they differ) and ``text_offset``, each token's character offset in the
choice's text. The offset runs on across a stream's chunks (the caller keeps the cursor) and, with ``echo``,
starts at the prompt's first token, whose logprob is null (it has no context). Chat logprobs are OpenAI's
``content`` list, whose ``top_logprobs`` is the top-N only, as OpenAI returns it. ``prompt_logprobs`` is vLLM's
shape (a null for the first prompt token, then per token a dict from token id to its logprob and decoded text)
without vLLM's ``rank``, which the workers do not compute.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from proto.tandem.v1 import worker_pb2 as pb

TokenText = Callable[[int], str]  # a token id's text (special tokens included)


def completion_logprobs(tok: TokenText, lps: Sequence[pb.TokenLogprob], offset: int,
                        lead: int | None = None) -> tuple[dict[str, Any], int]:
    """OpenAI's completions ``logprobs`` for ``lps``, the first token at character ``offset``; also the offset
    after the last token. ``lead``: a token placed first with no logprob (an echoed prompt's first token)."""
    tokens: list[str] = []
    values: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    if lead is not None:
        tokens.append(tok(lead))
        values.append(None)
        tops.append(None)
    for lp in lps:
        s = tok(lp.token_id)
        tokens.append(s)
        values.append(lp.logprob)
        top = {tok(t.token_id): t.logprob for t in lp.top}
        top.setdefault(s, lp.logprob)  # the sampled token is always there, as OpenAI returns it
        tops.append(top)
    for s in tokens:
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}, offset


def joined(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Two consecutive completions logprobs objects as one."""
    return {k: a[k] + b[k] for k in a}


def chat_logprobs(tok: TokenText, lps: Sequence[pb.TokenLogprob]) -> dict[str, Any]:
    def entry(tid: int, lp: float) -> dict[str, Any]:
        s = tok(tid)
        return {"token": s, "logprob": lp, "bytes": list(s.encode())}

    return {"content": [{**entry(lp.token_id, lp.logprob),
                         "top_logprobs": [entry(t.token_id, t.logprob) for t in lp.top]} for lp in lps]}


def prompt_logprobs(tok: TokenText, lps: Sequence[pb.TokenLogprob], k: int) -> list[dict[str, Any] | None]:
    """vLLM's ``prompt_logprobs``: null for the first prompt token, then each prompt token's and its top-``k``."""
    out: list[dict[str, Any] | None] = [None]
    for lp in lps:
        entry = {str(t.token_id): {"logprob": t.logprob, "decoded_token": tok(t.token_id)} for t in lp.top[:k]}
        entry.setdefault(str(lp.token_id), {"logprob": lp.logprob, "decoded_token": tok(lp.token_id)})
        out.append(entry)
    return out


def cumulative_logprob(lps: Sequence[pb.TokenLogprob]) -> float:
    return sum(lp.logprob for lp in lps)


def best_indexes(scores: Sequence[float], n: int) -> list[int]:
    """The positions of the ``n`` highest scores, best first (ties: the earlier candidate)."""
    return sorted(range(len(scores)), key=lambda i: (-scores[i], i))[:n]
