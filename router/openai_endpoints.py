"""The OpenAI-adjacent endpoints besides generation: ``/tokenize`` and ``/detokenize`` (vLLM's request and
response shapes), ``/version`` and ``GET /v1/models/{id}``.

``/tokenize`` takes ``{"prompt": str, "add_special_tokens": bool}`` or chat ``{"messages": [...],
"add_generation_prompt": bool}`` (tokenised exactly as ``/v1/chat/completions`` would) and answers ``{"count",
"max_model_len", "tokens", "token_strs"}``; ``/detokenize`` takes ``{"tokens": [...]}`` and answers ``{"prompt"}``.
A ``model`` other than the served one or one of its LoRA adapters (the tokenizer is the base model's) is a 404,
as on the generation endpoints. Tokenisation of a large body runs
off the event loop (the ``tokenizers`` library releases the GIL).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection
from importlib import metadata
from typing import Any

import orjson

from engine.tokenizer import Tokenizer
from router.api_error import APIError
from router.openai_protocol import chat_token_ids

INLINE_BYTES = 4096  # bodies up to this are tokenised on the loop (tens of µs)


def _version() -> str:
    try:
        return metadata.version("tandem")
    except metadata.PackageNotFoundError:
        return "unknown"


VERSION = _version()


class UtilityEndpoints:
    def __init__(self, tokenizer: Tokenizer, model_name: str, max_model_len: int, vocab_size: int,
                 max_prompt_bytes: int, adapters: Callable[[], Collection[str]] = frozenset) -> None:
        """``adapters``: the LoRA adapters served now (a ``model`` may name one)."""
        self.adapters = adapters
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.max_prompt_bytes = max_prompt_bytes

    def model_card(self) -> dict[str, Any]:
        return {"id": self.model_name, "object": "model", "created": 0, "owned_by": "tandem",
                "root": self.model_name, "max_model_len": self.max_model_len}

    def model(self, model_id: str) -> dict[str, Any]:
        """``GET /v1/models/{id}``."""
        if model_id != self.model_name:
            raise APIError(404, f"The model '{model_id}' does not exist", "model", code="model_not_found")
        return self.model_card()

    @staticmethod
    def version() -> dict[str, Any]:
        return {"version": VERSION}

    async def tokenize(self, raw: bytes) -> dict[str, Any]:
        body = self._body(raw)
        if len(raw) <= INLINE_BYTES:
            return self._tokenize(body)
        return await asyncio.to_thread(self._tokenize, body)

    async def detokenize(self, raw: bytes) -> dict[str, Any]:
        body = self._body(raw)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                   and 0 <= t < self.vocab_size for t in tokens):
            raise APIError(400, f"'tokens' must be a list of token ids in [0, {self.vocab_size})", "tokens")
        if len(raw) <= INLINE_BYTES:
            return {"prompt": self.tokenizer.decode(tokens)}
        return {"prompt": await asyncio.to_thread(self.tokenizer.decode, tokens)}

    def _body(self, raw: bytes) -> dict[str, Any]:
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise APIError(400, "request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise APIError(400, "request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.model_name and model not in self.adapters():
            raise APIError(404, f"The model '{model}' does not exist; this server serves '{self.model_name}'",
                           "model", code="model_not_found")
        return body

    def _tokenize(self, body: dict[str, Any]) -> dict[str, Any]:
        strs = body.get("return_token_strs", False)
        if not isinstance(strs, bool):
            raise APIError(400, "'return_token_strs' must be a boolean", "return_token_strs")
        if "messages" in body:
            gen = body.get("add_generation_prompt", True)
            if not isinstance(gen, bool):
                raise APIError(400, "'add_generation_prompt' must be a boolean", "add_generation_prompt")
            if _text_bytes(body.get("messages")) > self.max_prompt_bytes:
                raise APIError(413, f"the messages exceed {self.max_prompt_bytes} bytes", "messages")
            ids = chat_token_ids(body, self.tokenizer, gen)
        else:
            prompt = body.get("prompt")
            special = body.get("add_special_tokens", True)
            if not isinstance(prompt, str):
                raise APIError(400, "'prompt' must be a string (or send 'messages')", "prompt")
            if not isinstance(special, bool):
                raise APIError(400, "'add_special_tokens' must be a boolean", "add_special_tokens")
            if len(prompt.encode()) > self.max_prompt_bytes:
                raise APIError(413, f"the prompt exceeds {self.max_prompt_bytes} bytes", "prompt")
            ids = self.tokenizer.encode(prompt, add_special_tokens=special)
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids,
                "token_strs": [self.tokenizer.id_to_token(t) for t in ids] if strs else None}


def _text_bytes(messages: Any) -> int:
    if not isinstance(messages, list):
        return 0
    return sum(len(orjson.dumps(m.get("content"))) for m in messages if isinstance(m, dict))
