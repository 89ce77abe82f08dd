"""OpenAI-compatible request parsing and response shapes (completions and chat completions).

Parsing validates every field and raises :class:`APIError` with the HTTP status, OpenAI error type and the
offending parameter, so the gateway can answer ``{"error": {...}}`` exactly as OpenAI does. The result is a
:class:`GenerationRequest`: token ids (tokenized once, here in the router) plus wire sampling params.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

from engine.tokenizer import Tokenizer
from proto.tandem.v1 import worker_pb2 as pb

MAX_N = 16
MAX_STOP = 8
MAX_LOGPROBS = 20


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, err_type: str | None = None,
                 code: str | None = None, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.err_type = err_type or ("invalid_request_error" if status < 500 else "server_error")
        self.code = code
        self.retry_after = retry_after

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.err_type, "param": self.param, "code": self.code}}


@dataclass(slots=True)
class GenerationRequest:
    request_id: str
    model: str
    chat: bool
    prompt_token_ids: list[int]
    params: pb.SamplingParams
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    logprobs: int | None = None  # top-N alternatives wanted (0 = only the sampled token's logprob)
    want_logprobs: bool = False
    created: int = field(default_factory=lambda: int(time.time()))


_NUMBER = (int, float)  # a tuple: ``int | float`` would build a union object on every call


# OpenAI's sampling fields (and vLLM's extensions) that map one to one onto SamplingParams: range and integer-ness.
_SAMPLING_RANGES: dict[str, tuple[float, float, bool]] = {
    "temperature": (0.0, 2.0, False), "top_p": (1e-9, 1.0, False), "top_k": (-1, 1 << 20, True),
    "min_p": (0.0, 1.0, False), "repetition_penalty": (1e-3, 10.0, False),
    "presence_penalty": (-2.0, 2.0, False), "frequency_penalty": (-2.0, 2.0, False)}
# Their values when absent (or null) that differ from the proto's zero.
_SAMPLING_DEFAULTS: dict[str, Any] = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "repetition_penalty": 1.0}


def _num(body: dict[str, Any], name: str, default: float, lo: float, hi: float, integer: bool = False) -> Any:
    v = body.get(name)
    if v is None:  # absent or null: the default (most fields of most requests)
        return default
    return _checked(name, v, lo, hi, integer)


def _checked(name: str, v: Any, lo: float, hi: float, integer: bool) -> Any:
    if isinstance(v, bool) or not isinstance(v, _NUMBER) or (integer and not isinstance(v, int)):
        raise APIError(400, f"'{name}' must be {'an integer' if integer else 'a number'}, got {v!r}", name)
    if not lo <= v <= hi:
        raise APIError(400, f"'{name}' must be between {lo} and {hi}, got {v}", name)
    return v


def _stops(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise APIError(400, "'stop' must be a non-empty string or a list of non-empty strings", "stop")
    if len(stop) > MAX_STOP:
        raise APIError(400, f"'stop' takes at most {MAX_STOP} sequences", "stop")
    return stop


def parse_request(body: Any, chat: bool, tokenizer: Tokenizer, served_model: str, max_model_len: int,
                  vocab_size: int) -> GenerationRequest:
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise APIError(400, "'model' is required", "model")
    if model != served_model:
        raise APIError(404, f"The model '{model}' does not exist; this server serves '{served_model}'", "model",
                       code="model_not_found")
    ids = _chat_ids(body, tokenizer) if chat else _prompt_ids(body, tokenizer, vocab_size)
    if len(ids) >= max_model_len:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens. However, your "
                       f"prompt has {len(ids)} tokens.", "messages" if chat else "prompt",
                       code="context_length_exceeded")
    room = max_model_len - len(ids)
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is None:
        max_tokens = room if chat else min(16, room)  # OpenAI's defaults: all the room (chat), 16 (completions)
    max_tokens = _num({"max_tokens": max_tokens}, "max_tokens", 16, 1, 1 << 20, integer=True)
    if len(ids) + max_tokens > max_model_len:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens. However, you "
                       f"requested {len(ids) + max_tokens} tokens ({len(ids)} in the prompt, {max_tokens} for "
                       "the completion).", "max_tokens", code="context_length_exceeded")
    # Sampling fields: only those present are checked (most requests carry one or two of them).
    fields: dict[str, Any] = {"max_tokens": max_tokens, **_SAMPLING_DEFAULTS}
    for name, v in body.items():
        spec = _SAMPLING_RANGES.get(name)
        if spec is not None and v is not None:
            fields[name] = _checked(name, v, *spec)
    if fields["top_k"] < 0:
        fields["top_k"] = 0
    min_tokens = body.get("min_tokens")
    if min_tokens is not None:
        fields["min_tokens"] = _checked("min_tokens", min_tokens, 0, max_tokens, True)
    stop = _stops(body)
    if stop:
        fields["stop"] = stop
    if body.get("ignore_eos"):
        fields["ignore_eos"] = True
    params = pb.SamplingParams(**fields)
    if body.get("seed") is not None:
        params.seed = _num(body, "seed", 0, -(1 << 63), (1 << 63) - 1, integer=True)
    for name in ("stop_token_ids",):
        if body.get(name) is not None:
            v = body[name]
            if not isinstance(v, list) or not all(isinstance(t, int) and 0 <= t < vocab_size for t in v):
                raise APIError(400, f"'{name}' must be a list of token ids in [0, {vocab_size})", name)
            params.stop_token_ids.extend(v)
    n = _num(body, "n", 1, 1, MAX_N, integer=True)
    logprobs: int | None = None
    if chat:
        if body.get("logprobs"):
            logprobs = _num(body, "top_logprobs", 0, 0, MAX_LOGPROBS, integer=True)
        elif body.get("top_logprobs") is not None:
            raise APIError(400, "'top_logprobs' requires 'logprobs': true", "top_logprobs")
    elif body.get("logprobs") is not None:
        logprobs = _num(body, "logprobs", 0, 0, 5, integer=True)
    if logprobs is not None:
        params.logprobs = logprobs
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise APIError(400, "'stream' must be a boolean", "stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise APIError(400, "'stream_options' must be an object", "stream_options")
    if opts and not stream:
        raise APIError(400, "'stream_options' is only allowed when 'stream' is true", "stream_options")
    echo = bool(body.get("echo", False)) and not chat
    prefix = "chatcmpl" if chat else "cmpl"
    return GenerationRequest(request_id=f"{prefix}-{os.urandom(16).hex()}", model=model, chat=chat,
                             prompt_token_ids=ids, params=params, n=n, stream=stream,
                             include_usage=bool(opts.get("include_usage", False)), echo=echo,
                             logprobs=logprobs, want_logprobs=logprobs is not None)


def _prompt_ids(body: dict[str, Any], tokenizer: Tokenizer, vocab_size: int) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise APIError(400, "'prompt' must not be empty", "prompt")
        return tokenizer.encode(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise APIError(400, f"prompt token ids must be in [0, {vocab_size}); got {bad[:3]}", "prompt")
        return list(prompt)
    if isinstance(prompt, list) and len(prompt) > 1:
        raise APIError(400, "batched prompts are not supported; send one prompt per request", "prompt")
    raise APIError(400, "'prompt' must be a non-empty string or a list of token ids", "prompt")


def _chat_ids(body: dict[str, Any], tokenizer: Tokenizer) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "'messages' must be a non-empty list", "messages")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "developer", "tool"):
            raise APIError(400, f"messages[{i}] needs a 'role' of system, user, assistant, developer or tool",
                           f"messages[{i}].role")
        content = m.get("content")
        if isinstance(content, list):  # content parts: keep the text ones
            texts = [p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"]
            if len(texts) != len(content):
                raise APIError(400, f"messages[{i}].content: only text parts are supported",
                               f"messages[{i}].content")
            content = "".join(texts)
        if not isinstance(content, str):
            raise APIError(400, f"messages[{i}].content must be a string", f"messages[{i}].content")
        clean.append({"role": "system" if m["role"] == "developer" else m["role"], "content": content})
    try:
        return tokenizer.encode_chat(clean, add_generation_prompt=True)
    except ValueError as e:
        raise APIError(400, str(e), "messages") from None


def usage(prompt_tokens: int, completion_tokens: int, cached: int = 0) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}
