"""``/tokenize``, ``/detokenize``, ``/version`` and ``GET /v1/models/{id}`` (router/openai_endpoints.py) in vLLM's
and OpenAI's shapes, called directly (the HTTP path is covered by the end-to-end surface tests)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import orjson
import pytest

from engine.tokenizer import Tokenizer
from router.api_error import APIError
from router.openai_endpoints import UtilityEndpoints


@pytest.fixture(scope="module")
def ep(checkpoint: Callable[[str], Path]) -> UtilityEndpoints:
    tok = Tokenizer(checkpoint("llama"))
    return UtilityEndpoints(tok, "tiny", 256, tok.vocab_size, max_prompt_bytes=10_000)


def _run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


def test_tokenize_and_detokenize_round_trip_in_vllms_shape(ep: UtilityEndpoints) -> None:
    out = _run(ep.tokenize(orjson.dumps({"model": "tiny", "prompt": "Hello, Tandem", "return_token_strs": True})))
    assert out["tokens"] == ep.tokenizer.encode("Hello, Tandem")
    assert out["count"] == len(out["tokens"]) and out["max_model_len"] == 256
    assert out["token_strs"] == [ep.tokenizer.id_to_token(t) for t in out["tokens"]]
    assert _run(ep.detokenize(orjson.dumps({"tokens": out["tokens"]}))) == {"prompt": "Hello, Tandem"}
    bare = _run(ep.tokenize(orjson.dumps({"prompt": "Hello", "add_special_tokens": False})))
    assert bare["tokens"] == ep.tokenizer.encode("Hello", add_special_tokens=False) and bare["token_strs"] is None


def test_tokenize_messages_as_chat_completions_would(ep: UtilityEndpoints) -> None:
    msgs = [{"role": "user", "content": "hi"}]
    out = _run(ep.tokenize(orjson.dumps({"messages": msgs})))
    assert out["tokens"] == ep.tokenizer.encode_chat(msgs, add_generation_prompt=True)
    big = _run(ep.tokenize(orjson.dumps({"prompt": "word " * 1000})))  # tokenised off the loop
    assert big["count"] == len(ep.tokenizer.encode("word " * 1000))


@pytest.mark.parametrize(("call", "body", "status", "param"), [
    ("tokenize", {"model": "other", "prompt": "x"}, 404, "model"), ("tokenize", {"prompt": 5}, 400, "prompt"),
    ("tokenize", {"prompt": "x" * 10_001}, 413, "prompt"), ("detokenize", {"tokens": [1 << 20]}, 400, "tokens"),
    ("detokenize", {"tokens": [True]}, 400, "tokens"), ("tokenize", [1], 400, None)])
def test_bad_tokenize_requests_are_refused(ep: UtilityEndpoints, call: str, body: object, status: int,
                                           param: str | None) -> None:
    with pytest.raises(APIError) as e:
        _run(getattr(ep, call)(orjson.dumps(body)))
    assert (e.value.status, e.value.param) == (status, param)


def test_model_by_id_and_version(ep: UtilityEndpoints) -> None:
    assert ep.model("tiny")["id"] == "tiny" and ep.model("tiny")["object"] == "model"
    with pytest.raises(APIError) as e:
        ep.model("gpt-4")
    assert e.value.status == 404 and e.value.code == "model_not_found"
    assert isinstance(ep.version()["version"], str)
