"""``<think>`` end to end: a router with ``--reasoning-parser qwen3`` in front of real ``tandem worker`` processes (a
colocated path and a prefill/decode pair over tcp) splits a model's ``<think>...</think>`` into
``reasoning_content`` and ``content``, whole and streamed, over HTTP (the official ``openai`` client) and gRPC
(``Gateway.Chat``); a constrained answer (choice, JSON schema) holds only after the reasoning ends, on both paths.

The model: the random-weight tiny checkpoint never writes ``<think>`` on its own, so the test derives one that
does, by editing weights, not by faking anything: every layer's attention and MLP output projections are zeroed
(the residual stream is then the current token's embedding: a bigram model) and ``lm_head`` rows are set so that
after the chat template's last token it writes ``<think>hello</think>hello</think>...``, one token at a time. The
workers, router, parsers and grammars are the real ones; the reference is the offline engine on that checkpoint.
"""

from __future__ import annotations

import itertools
import json
import random
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import jsonschema
import openai
import pytest
import torch
from gateway_harness import WORKER_FLAGS, RouterThread
from safetensors.torch import load_file, save_file

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.structured.spec import StructuredOutput
from engine.tokenizer import Tokenizer
from proto.tandem.v1 import gateway_pb2 as gpb
from proto.tandem.v1 import gateway_pb2_grpc as gpb_grpc
from router.grpc_gateway import start_grpc_gateway
from router.server import RouterConfig
from worker.launcher import WorkerProcess, start_worker

pytestmark = pytest.mark.slow
ANSWER = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
          "additionalProperties": False}
SHORT = [{"role": "user", "content": "Is it raining?"}]


def thinking_checkpoint(src: Path, dst: Path) -> Path:
    """``src`` with its weights edited into a bigram model that writes ``<think>hello</think>hello...``."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, dst / f.name)
    w = load_file(src / "model.safetensors")
    for name in w:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            w[name] = torch.zeros_like(w[name])
    tok = Tokenizer(src)
    eps = json.loads((src / "config.json").read_text())["rms_norm_eps"]

    def hidden(t: int) -> torch.Tensor:  # what reaches lm_head for token t: its embedding through the final norm
        x = w["model.embed_tokens.weight"][t]
        return x * torch.rsqrt(x.pow(2).mean() + eps) * w["model.norm.weight"]

    (last,) = tok.encode("\n", add_special_tokens=False)  # the chat template's generation prompt ends with it
    (hello,) = tok.encode("hello", add_special_tokens=False)
    script = [last, *(tok.encode(c, add_special_tokens=False)[0] for c in "<think>"), hello,
              *tok.encode("</think>", add_special_tokens=False), hello]
    sources: dict[int, set[int]] = {}
    for s, t in itertools.pairwise(script):
        sources.setdefault(t, set()).add(s)
    head = w["lm_head.weight"].clone()
    for t, srcs in sources.items():  # logit 40 for t after each of its sources, ~0 elsewhere (near-orthogonal)
        head[t] = sum((40 * hidden(s) / hidden(s).pow(2).sum() for s in srcs), torch.zeros_like(head[t]))
    w["lm_head.weight"] = head
    save_file(w, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def model(checkpoint: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return thinking_checkpoint(checkpoint("llama"), tmp_path_factory.mktemp("thinking") / "thinking-llama")


@pytest.fixture(scope="module")
def offline(model: Path) -> LLM:
    return LLM(str(model))


@pytest.fixture(scope="module")
def served(model: Path) -> Iterator[tuple[openai.OpenAI, gpb_grpc.GatewayStub]]:
    workers: list[WorkerProcess] = []
    rt = None
    try:
        workers.append(start_worker("decode", str(model), "tcp", [*WORKER_FLAGS, "--worker-id", "think-d"]))
        workers.append(start_worker("prefill", str(model), "tcp", [*WORKER_FLAGS, "--worker-id", "think-p"]))
        rt = RouterThread(RouterConfig(model=str(model), workers=tuple(w.address for w in workers),
                                       reasoning_parser="qwen3"))
        server, port = rt.call_async(lambda r: start_grpc_gateway(r.gateway, "127.0.0.1", 0))
        try:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                yield (openai.OpenAI(base_url=rt.url + "/v1", api_key="none", max_retries=0, timeout=120),
                       gpb_grpc.GatewayStub(channel))
        finally:
            rt.call_async(lambda r: server.stop(0.5))
    finally:
        if rt is not None:
            rt.stop()
        for w in workers:
            w.stop()


def _split(raw: str) -> tuple[str, str]:
    """(reasoning, content) of a raw output that opens with a closed think block."""
    assert raw.startswith("<think>") and "</think>" in raw, raw
    reasoning, content = raw[len("<think>"):].split("</think>", 1)
    return reasoning, content


def _expected(offline: LLM, messages: list[dict[str, str]], max_tokens: int,
              spec: StructuredOutput | None) -> tuple[str, str]:
    prompt = offline.tokenizer.encode_chat(messages)
    return _split(offline.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0,
                                                            structured=spec))[0].text)


def _long_messages(seed: int) -> list[dict[str, str]]:
    rng = random.Random(seed)
    words = ["rain", "cloud", "sun", "wind", "snow", "storm", "fog", "mist"]
    return [{"role": "user", "content": " ".join(rng.choice(words) for _ in range(200)) + "?"}]


def _streamed(client: openai.OpenAI, model: Path, messages: Any, **kw: Any) -> tuple[str, str, str | None]:
    reasoning = content = ""
    finish = None
    for chunk in client.chat.completions.create(model=model.name, messages=messages, stream=True, **kw):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta.model_dump()
        reasoning += delta.get("reasoning_content") or ""
        content += delta.get("content") or ""
        finish = chunk.choices[0].finish_reason or finish
    return reasoning, content, finish


def test_reasoning_content_is_split_from_content_whole_and_streamed(served: Any, model: Path,
                                                                    offline: LLM) -> None:
    client, _ = served
    reasoning, content = _expected(offline, SHORT, 14, None)
    assert reasoning == "hello" and content == "hello"  # the checkpoint does what it was built for
    whole = client.chat.completions.create(model=model.name, messages=SHORT, max_tokens=14, temperature=0)
    msg = whole.choices[0].message.model_dump()
    assert (msg["reasoning_content"], msg["content"]) == (reasoning, content)
    assert whole.choices[0].finish_reason == "length"
    assert _streamed(client, model, SHORT, max_tokens=14, temperature=0) == (reasoning, content, "length")


@pytest.mark.parametrize("path", ["colocated", "disaggregated"])
def test_a_constrained_answer_follows_the_free_reasoning_on_each_path(served: Any, model: Path, offline: LLM,
                                                                      path: str) -> None:
    """A choice and a JSON schema each constrain only what follows ``</think>``: the reasoning is the model's own,
    the answer satisfies the constraint, and the grammar's end stops the request. A long prompt is prefilled by
    the prefill worker (prefill masks the first token, which opens the think block; decode continues)."""
    client, _ = served
    cases: list[tuple[dict[str, Any], StructuredOutput]] = [
        ({"guided_choice": ["yes", "no"]}, StructuredOutput("choice", '["yes", "no"]', after_reasoning=True)),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER}}},
         StructuredOutput("json_schema", json.dumps(ANSWER, sort_keys=True), after_reasoning=True))]
    for i, (body, spec) in enumerate(cases):
        # a prompt of its own each: a repeat would be a prefix hit on the decode worker, served there colocated
        messages = SHORT if path == "colocated" else _long_messages(i)
        reasoning, content = _expected(offline, messages, 40, spec)
        raw = client.chat.completions.with_raw_response.create(
            model=model.name, messages=messages, max_tokens=40, temperature=0, extra_body=body,
            extra_headers={"x-tandem-explain": "1"})
        assert ("prefill[" in raw.headers["x-tandem-route"]) == (path == "disaggregated"), raw.headers
        out = raw.parse().choices[0]
        msg = out.message.model_dump()
        assert (msg["reasoning_content"], msg["content"], out.finish_reason) == (reasoning, content, "stop")
        assert reasoning == "hello"
        if "guided_choice" in body:
            assert content in ("yes", "no")
        else:
            jsonschema.validate(json.loads(content), ANSWER)
        assert _streamed(client, model, messages, max_tokens=40, temperature=0, extra_body=body) == (
            reasoning, content, "stop")


def test_grpc_chat_streams_reasoning_and_a_constrained_answer_as_http_answers(served: Any, model: Path) -> None:
    client, stub = served
    for constraint, body in ((None, {}), (gpb.StructuredOutputs(choice=gpb.Choices(choices=["yes", "no"])),
                                          {"guided_choice": ["yes", "no"]})):
        messages = [gpb.ChatMessage(role=m["role"], content=m["content"]) for m in SHORT]
        request = gpb.ChatRequest(model=model.name, messages=messages, max_tokens=14, temperature=0)
        if constraint is not None:
            request.structured.CopyFrom(constraint)
        chunks = list(stub.Chat(request, timeout=120))
        http = client.chat.completions.create(model=model.name, messages=SHORT, max_tokens=14, temperature=0,
                                              extra_body=body).choices[0]
        msg = http.message.model_dump()
        assert "".join(c.reasoning_content for c in chunks) == msg["reasoning_content"] == "hello"
        assert "".join(c.content for c in chunks) == msg["content"]
        assert chunks[-1].finish_reason == http.finish_reason == ("length" if constraint is None else "stop")
        # streamed as it came: the reasoning as soon as </think> was seen, well before the answer ends
        at = next(i for i, c in enumerate(chunks) if c.reasoning_content)
        assert at < len(chunks) - 1 and not any(c.content for c in chunks[:at])
