"""OpenAI response pieces the gateway assembles: each choice's state, logprobs in the completions and chat shapes,
echoed prompts, vLLM's ``prompt_logprobs``, and the best ``n`` of ``best_of`` candidates.

A request runs ``best_of`` sequences per prompt (a :class:`Choice` each, numbered ``prompt * best_of + j``); the
answer shows the ``n`` of each prompt with the highest cumulative logprob, renumbered ``prompt * n + rank`` as
OpenAI numbers a batch's choices (when ``best_of == n``, every sequence, numbered as it ran; only then may a
request stream).

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

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.detokenizer import IncrementalDetokenizer
from engine.tokenizer import Tokenizer
from proto.tandem.v1 import worker_pb2 as pb
from router.chat_output import ChatOutput
from router.openai_protocol import GenerationRequest, usage

TokenText = Callable[[int], str]  # a token id's text (special tokens included)
Decode = Callable[[list[int]], str]  # token ids' text


@dataclass(slots=True)
class Choice:
    """One running sequence of a request: its prompt, what it generated so far, and where its stream stands."""

    index: int
    detok: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[pb.TokenLogprob] = field(default_factory=list)
    cached: int = 0
    prompt: list[int] = field(default_factory=list)
    prompt_logprobs: list[pb.TokenLogprob] = field(default_factory=list)  # prompt tokens 1.., when asked for
    offset: int = 0  # text_offset of the next streamed token
    started: bool = False  # its first stream chunk is written (the echo, prompt logprobs went with it)
    output: ChatOutput | None = None  # a chat choice with tools or a reasoning parser: its text split up
    created_at: float = field(default_factory=time.perf_counter)  # made once admitted, as it is handed to routing
    first_at: float = 0.0  # when its first generated token arrived (perf_counter; 0 until then)
    second_at: float = 0.0  # when a later chunk first brought tokens (disaggregated: decode's first chunk)
    trace_root: Any = None  # the request's root span when tracing is on (router/tracing.py; shared by its choices)
    trace_metadata: tuple[tuple[str, str], ...] = ()  # its W3C trace context, sent to the workers as gRPC metadata


def new_choice(req: GenerationRequest, index: int, tokenizer: Tokenizer) -> Choice:
    """Sequence ``index`` of ``req``: it runs prompt ``index // best_of``."""
    return Choice(index, IncrementalDetokenizer(tokenizer, tuple(req.params.stop),
                                                req.params.include_stop_str_in_output),
                  prompt=req.prompts[index // req.best_of], output=chat_output(req))


def chat_output(req: GenerationRequest) -> ChatOutput | None:
    if not req.chat or (req.tools is None and not req.reasoning):
        return None
    return ChatOutput(req.tools, req.tool_parser, req.reasoning)


def chat_deltas(c: Choice, text: str, has_logprobs: bool) -> tuple[list[dict[str, Any]], str | None]:
    """A streamed chat choice's deltas for its new ``text`` and its finish reason once it has one."""
    if c.output is None:
        return ([{"content": text}] if text or has_logprobs else []), c.finish_reason
    deltas = c.output.feed(text)
    finish = c.finish_reason
    if finish:
        more, finish = c.output.finish(finish)
        deltas += more
    return deltas, finish


def take_prompt_logprobs(c: Choice, chunk: pb.TokenChunk) -> None:
    """The prompt logprobs a chunk carries (a request's first; a migrated request's retry scores a longer prompt,
    whose first entries are the same: the first attempt's are kept)."""
    if chunk.prompt_logprobs and not c.prompt_logprobs:
        c.prompt_logprobs.extend(chunk.prompt_logprobs[:max(len(c.prompt) - 1, 0)])


def shown(req: GenerationRequest, choices: list[Choice]) -> list[Choice]:
    """The choices the answer shows: the ``n`` best of each prompt's ``best_of``, renumbered."""
    if req.best_of == req.n:
        return choices
    out = []
    for p in range(len(req.prompts)):
        cands = choices[p * req.best_of:(p + 1) * req.best_of]
        for rank, i in enumerate(best_indexes([cumulative_logprob(c.logprobs) for c in cands], req.n)):
            cands[i].index = p * req.n + rank
            out.append(cands[i])
    return out


def final_body(req: GenerationRequest, choices: list[Choice], tok: TokenText, decode: Decode) -> dict[str, Any]:
    """The whole non-streamed answer. Usage counts every prompt once and every generated token (all candidates)."""
    out: dict[str, Any] = {"id": req.request_id, "created": req.created, "model": req.model,
                           "usage": usage(req.num_prompt_tokens, sum(len(c.token_ids) for c in choices),
                                          max((c.cached for c in choices), default=0))}
    best = shown(req, choices)
    if req.chat:
        out["object"] = "chat.completion"
        out["choices"] = [_chat_choice(req, c, tok) for c in best]
        if req.prompt_logprobs is not None and best:
            out["prompt_logprobs"] = prompt_logprobs(tok, best[0].prompt_logprobs, req.prompt_logprobs)
    else:
        out["object"] = "text_completion"
        out["choices"] = []
        for c in best:
            c.started = False
            c.offset = 0
            out["choices"].append(completion_piece(req, c, c.text, c.logprobs, tok, decode))
    return out


def _chat_choice(req: GenerationRequest, c: Choice, tok: TokenText) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": c.text}
    finish = c.finish_reason
    split = chat_output(req)
    if split is not None:
        split.feed(c.text)
        finish = split.finish(finish)[1]
        message = split.message()
    return {"index": c.index, "message": message,
            "logprobs": chat_logprobs(tok, c.logprobs) if req.want_logprobs else None, "finish_reason": finish}


def completion_piece(req: GenerationRequest, c: Choice, text: str, lps: Sequence[pb.TokenLogprob],
                     tok: TokenText, decode: Decode) -> dict[str, Any]:
    """A completions choice object for ``text`` and its tokens' ``lps``: the whole answer, or one stream chunk.
    The choice's first piece carries the echoed prompt (text, and its tokens' logprobs) and vLLM's
    ``prompt_logprobs``; ``text_offset`` runs on from the previous piece."""
    extra: dict[str, Any] = {}
    head: dict[str, Any] | None = None
    if not c.started:
        c.started = True
        if req.echo:
            text = decode(c.prompt) + text
            if req.want_logprobs:
                head, c.offset = completion_logprobs(tok, c.prompt_logprobs, 0, lead=c.prompt[0])
        if req.prompt_logprobs is not None:
            extra["prompt_logprobs"] = prompt_logprobs(tok, c.prompt_logprobs, req.prompt_logprobs)
    lp = None
    if req.want_logprobs:
        lp, c.offset = completion_logprobs(tok, lps, c.offset)
        if head is not None:
            lp = joined(head, lp)
    return {"index": c.index, "text": text, "logprobs": lp, "finish_reason": c.finish_reason, **extra}


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
