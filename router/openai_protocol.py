"""OpenAI-compatible request parsing and response shapes (completions and chat completions).

Parsing validates every field and raises :class:`APIError` with the HTTP status, OpenAI error type and the
offending parameter, so the gateway can answer ``{"error": {...}}`` exactly as OpenAI does. The result is a
:class:`GenerationRequest`: token ids (tokenized once, here in the router; one list per prompt of a batched
``/v1/completions`` request) plus wire sampling params.

Nothing accepted is ignored. Every field of OpenAI's and vLLM's request schemas that changes what is generated or
how it is returned is either implemented or refused with a 400 naming it (:data:`UNSUPPORTED`; e.g. the
deprecated ``functions``, ``guided_whitespace_pattern``, ``suffix``, beam search), refused only when it
asks for something other than the default. Fields outside both schemas are ignored, as vLLM does (OpenAI itself
refuses them): SDKs and harnesses add bookkeeping fields (``user``, ``metadata``, ``store``, ``service_tier``, new
ones every release) that change no output, and refusing them would break clients for nothing, while every field
that could change output is named in the list. The list holds the fields of both schemas as of this writing; a
field added to either later is ignored until it is added here.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from engine.tokenizer import Tokenizer
from proto.tandem.v1 import worker_pb2 as pb
from router.api_error import APIError
from router.structured_fields import parse_structured, parse_structured_spec
from router.tool_choice import parse_tools

MAX_N = 16
MAX_STOP = 8
MAX_LOGPROBS = 20
MAX_BEST_OF = 20
MAX_PROMPTS = 64
MAX_SEQUENCES = 256  # prompts x best_of: the sequences one request may start
MAX_LOGIT_BIAS = 300  # entries, as OpenAI allows

_ABSENT = object()


def _not(*defaults: Any) -> Any:
    """A check that a field is unsupported unless it holds one of ``defaults`` (or is absent or null)."""
    return lambda v: v is not None and not any(v == d and type(v) is type(d) for d in defaults)


# Known fields that would change output and are not implemented: each refused (400 naming it) when it asks for
# anything but the default. The structured-output fields are parsed in router.structured_fields.
UNSUPPORTED: dict[str, Any] = {
    "functions": _not([]), "function_call": _not("none"),
    "guided_whitespace_pattern": _not(),
    "suffix": _not(""), "use_beam_search": _not(False), "length_penalty": _not(1, 1.0), "early_stopping": _not(False),
    "allowed_token_ids": _not(), "bad_words": _not([]), "truncate_prompt_tokens": _not(),
    "skip_special_tokens": _not(True), "spaces_between_special_tokens": _not(True),
    "return_tokens_as_token_ids": _not(False), "prompt_embeds": _not(),
    "audio": _not(), "modalities": _not(["text"]), "prediction": _not(), "web_search_options": _not(),
    "reasoning_effort": _not(), "documents": _not(), "chat_template": _not(), "chat_template_kwargs": _not({}),
    "continue_final_message": _not(False), "add_generation_prompt": _not(True), "mm_processor_kwargs": _not(),
    "cache_salt": _not(), "logits_processors": _not([]), "vllm_xargs": _not({}), "kv_transfer_params": _not(),
}


@dataclass(slots=True)
class GenerationRequest:
    """One parsed request. ``prompts`` holds every prompt (several only in a batched ``/v1/completions``);
    ``prompt_token_ids`` is the first. Each prompt runs ``best_of`` sequences, of which the ``n`` with the highest
    cumulative logprob are answered (all of them when ``best_of == n``); choice ``index`` is ``prompt * n + j``,
    as OpenAI numbers them."""

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
    prompts: list[list[int]] = field(default_factory=list)
    best_of: int = 1
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs, as the client asked (None: not asked)
    tools: Any = None  # router.tool_choice.ToolRequest of a chat request with tools
    tool_parser: str = "hermes"  # how the model writes tool calls (router/tool_parsers.py)
    reasoning: bool = False  # split <think>...</think> into reasoning_content
    lora: str = ""  # the LoRA adapter ``model`` named (empty: the served model itself)

    def __post_init__(self) -> None:
        if not self.prompts:
            self.prompts = [self.prompt_token_ids]
        self.best_of = max(self.best_of, self.n)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


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
                  vocab_size: int, tool_parser: str = "hermes", reasoning_parser: str | None = None,
                  adapters: Collection[str] = ()) -> GenerationRequest:
    """``adapters``: the LoRA adapters served besides ``served_model``; a ``model`` naming one runs under it."""
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise APIError(400, "'model' is required", "model")
    lora = ""
    if model != served_model:
        if model not in adapters:
            raise APIError(404, unknown_model_message(model, served_model, adapters), "model",
                           code="model_not_found")
        lora = model
    _refuse_unsupported(body, chat)
    tools = parse_tools(body, chat)
    prompts = [chat_token_ids(body, tokenizer, tools=list(tools.tools) if tools else None)] if chat else \
        _prompts(body, tokenizer, vocab_size)
    n = _num(body, "n", 1, 1, MAX_N, integer=True)
    best_of = _num(body, "best_of", n, 1, MAX_BEST_OF, integer=True)
    if best_of < n:
        raise APIError(400, f"'best_of' ({best_of}) must be at least 'n' ({n})", "best_of")
    if best_of * len(prompts) > MAX_SEQUENCES:
        raise APIError(400, f"{len(prompts)} prompts x best_of {best_of} is more than {MAX_SEQUENCES} sequences",
                       "best_of" if best_of > 1 else "prompt")
    longest = max(len(ids) for ids in prompts)
    where = "messages" if chat else "prompt"
    if longest >= max_model_len:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens. However, your "
                       f"prompt has {longest} tokens.", where, code="context_length_exceeded")
    room = max_model_len - longest
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is None:
        max_tokens = room if chat else min(16, room)  # OpenAI's defaults: all the room (chat), 16 (completions)
    max_tokens = _checked("max_tokens", max_tokens, 1, 1 << 20, True)
    if longest + max_tokens > max_model_len:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens. However, you "
                       f"requested {longest + max_tokens} tokens ({longest} in the prompt, {max_tokens} for "
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
    for flag in ("ignore_eos", "include_stop_str_in_output"):
        v = body.get(flag)
        if v is not None and not isinstance(v, bool):
            raise APIError(400, f"'{flag}' must be a boolean", flag)
        if v:
            fields[flag] = True
    params = pb.SamplingParams(**fields)
    if body.get("seed") is not None:
        params.seed = _num(body, "seed", 0, -(1 << 63), (1 << 63) - 1, integer=True)
    for name in ("stop_token_ids",):
        if body.get(name) is not None:
            v = body[name]
            if not isinstance(v, list) or not all(_is_int(t) and 0 <= t < vocab_size for t in v):
                raise APIError(400, f"'{name}' must be a list of token ids in [0, {vocab_size})", name)
            params.stop_token_ids.extend(v)
    so = parse_structured(body, tokenizer, vocab_size)
    forced = tools.constraint if tools is not None else None
    if forced is not None:
        if so is not None:
            raise APIError(400, f"tool_choice {body.get('tool_choice')!r} is a constraint of its own: it cannot be "
                           "combined with a structured output constraint", "tool_choice")
        so = forced
    if so is not None:
        if chat and reasoning_parser is not None:  # a free <think> block first, then the constraint
            so = dataclasses.replace(so, after_reasoning=True)
            parse_structured_spec(so, tokenizer, vocab_size)
        params.structured.CopyFrom(pb.StructuredOutput(kind=so.kind, spec=so.spec, strict=so.strict,
                                                       after_reasoning=so.after_reasoning))
    bias = _logit_bias(body.get("logit_bias"), vocab_size)
    if bias:
        params.logit_bias.update(bias)
    logprobs: int | None = None
    if chat:
        lp = body.get("logprobs")
        if lp is not None and not isinstance(lp, bool):
            raise APIError(400, "'logprobs' must be a boolean", "logprobs")
        if lp:
            logprobs = _num(body, "top_logprobs", 0, 0, MAX_LOGPROBS, integer=True)
        elif body.get("top_logprobs") is not None:
            raise APIError(400, "'top_logprobs' requires 'logprobs': true", "top_logprobs")
    elif body.get("logprobs") is not None:
        logprobs = _num(body, "logprobs", 0, 0, 5, integer=True)
    if logprobs is not None:
        params.logprobs = logprobs
    elif best_of > n:
        params.logprobs = 0  # the candidates are ranked by their cumulative logprob
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise APIError(400, "'stream' must be a boolean", "stream")
    if stream and best_of > n:
        raise APIError(400, "'best_of' greater than 'n' cannot be streamed: the best candidates are known only at "
                       "the end", "best_of")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise APIError(400, "'stream_options' must be an object", "stream_options")
    if opts and not stream:
        raise APIError(400, "'stream_options' is only allowed when 'stream' is true", "stream_options")
    echo = body.get("echo", False)
    if not isinstance(echo, bool):
        raise APIError(400, "'echo' must be a boolean", "echo")
    prompt_logprobs = None
    if body.get("prompt_logprobs") is not None:
        prompt_logprobs = _num(body, "prompt_logprobs", 0, 0, MAX_LOGPROBS, integer=True)
        if chat and stream:  # vLLM's chat stream has no place for them either
            raise APIError(400, "'prompt_logprobs' cannot be streamed on chat completions", "prompt_logprobs")
    # Echo with logprobs scores the prompt too: the prompt's logprobs, from the prefill pass.
    wanted = [k for k in (prompt_logprobs, logprobs if echo else None) if k is not None]
    if wanted:
        params.prompt_logprobs = max(wanted)
    prefix = "chatcmpl" if chat else "cmpl"
    return GenerationRequest(request_id=f"{prefix}-{os.urandom(16).hex()}", model=model, chat=chat,
                             prompt_token_ids=prompts[0], params=params, n=n, stream=stream,
                             include_usage=bool(opts.get("include_usage", False)), echo=echo,
                             logprobs=logprobs, want_logprobs=logprobs is not None, prompts=prompts,
                             best_of=best_of, prompt_logprobs=prompt_logprobs, tools=tools, tool_parser=tool_parser,
                             reasoning=chat and reasoning_parser is not None, lora=lora)


def unknown_model_message(model: str, served_model: str, adapters: Collection[str] = ()) -> str:
    """The 404 message for a ``model`` that is neither the served model nor one of its LoRA adapters."""
    also = f" and the LoRA adapters {', '.join(repr(a) for a in sorted(adapters))}" if adapters else ""
    return f"The model '{model}' does not exist; this server serves '{served_model}'{also}"


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _refuse_unsupported(body: dict[str, Any], chat: bool) -> None:
    for name, v in body.items():
        refuse = UNSUPPORTED.get(name)
        if refuse is not None and refuse(v):
            raise APIError(400, f"'{name}' is not supported by this server", name, code="unsupported_parameter")
    # Defaults that differ by endpoint: completions add the tokenizer's special tokens, a chat template has them.
    special = body.get("add_special_tokens")
    if special is not None and special is not (not chat):
        raise APIError(400, f"'add_special_tokens': {special!r} is not supported on this endpoint",
                       "add_special_tokens", code="unsupported_parameter")
    if chat and body.get("echo") not in (None, False):  # vLLM's chat echo (the last message) is not implemented
        raise APIError(400, "'echo' is not supported on chat completions", "echo", code="unsupported_parameter")


def _logit_bias(bias: Any, vocab_size: int) -> dict[int, float]:
    """OpenAI's ``{"token id": bias}`` (keys are strings in JSON) → ``{id: bias}``, each bias in [-100, 100]."""
    if bias is None:
        return {}
    if not isinstance(bias, dict):
        raise APIError(400, "'logit_bias' must be an object mapping token ids to numbers", "logit_bias")
    if len(bias) > MAX_LOGIT_BIAS:
        raise APIError(400, f"'logit_bias' takes at most {MAX_LOGIT_BIAS} entries", "logit_bias")
    out: dict[int, float] = {}
    for key, v in bias.items():
        try:
            tid = int(key)
        except ValueError:
            raise APIError(400, f"'logit_bias' keys must be token ids, got {key!r}", "logit_bias") from None
        if not 0 <= tid < vocab_size:
            raise APIError(400, f"'logit_bias' token id {tid} is outside [0, {vocab_size})", "logit_bias")
        out[tid] = float(_checked("logit_bias", v, -100, 100, False))
    return out


def _prompts(body: dict[str, Any], tokenizer: Tokenizer, vocab_size: int) -> list[list[int]]:
    """``prompt`` as OpenAI takes it: a string, a list of token ids, or a list of either (a batch)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        if len(prompt) > MAX_PROMPTS:
            raise APIError(400, f"'prompt' takes at most {MAX_PROMPTS} prompts", "prompt")
        return [_prompt_ids(p, tokenizer, vocab_size, f"prompt[{i}]") for i, p in enumerate(prompt)]
    return [_prompt_ids(prompt, tokenizer, vocab_size, "prompt")]


def _prompt_ids(prompt: Any, tokenizer: Tokenizer, vocab_size: int, where: str) -> list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise APIError(400, f"'{where}' must not be empty", "prompt")
        return tokenizer.encode(prompt)
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise APIError(400, f"{where}: token ids must be in [0, {vocab_size}); got {bad[:3]}", "prompt")
        return list(prompt)
    raise APIError(400, f"'{where}' must be a non-empty string or a non-empty list of token ids", "prompt")


def chat_token_ids(body: dict[str, Any], tokenizer: Tokenizer, add_generation_prompt: bool = True,
                   tools: list[dict[str, Any]] | None = None) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "'messages' must be a non-empty list", "messages")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "developer", "tool"):
            raise APIError(400, f"messages[{i}] needs a 'role' of system, user, assistant, developer or tool",
                           f"messages[{i}].role")
        content = m.get("content")
        calls = m.get("tool_calls") if m["role"] == "assistant" else None
        if calls is not None:
            if not isinstance(calls, list) or not all(
                    isinstance(c, dict) and isinstance(c.get("function"), dict)
                    and isinstance(c["function"].get("name"), str) for c in calls):
                raise APIError(400, f"messages[{i}].tool_calls must be a list of function calls",
                               f"messages[{i}].tool_calls")
            if content is None:
                content = ""
        if isinstance(content, list):  # content parts: keep the text ones
            texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
            if len(texts) != len(content) or not all(isinstance(t, str) for t in texts):
                raise APIError(400, f"messages[{i}].content: only text parts (with a string 'text') are supported",
                               f"messages[{i}].content")
            content = "".join(t for t in texts if isinstance(t, str))
        if not isinstance(content, str):
            raise APIError(400, f"messages[{i}].content must be a string", f"messages[{i}].content")
        entry: dict[str, Any] = {"role": "system" if m["role"] == "developer" else m["role"], "content": content}
        if calls:
            entry["tool_calls"] = calls
        if m["role"] == "tool" and isinstance(m.get("tool_call_id"), str):
            entry["tool_call_id"] = m["tool_call_id"]
        clean.append(entry)
    try:
        return tokenizer.encode_chat(clean, add_generation_prompt=add_generation_prompt, tools=tools)
    except ValueError as e:
        raise APIError(400, str(e), "messages") from None


def usage(prompt_tokens: int, completion_tokens: int, cached: int = 0) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}
