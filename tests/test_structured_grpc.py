"""Structured outputs and tools through the router's gRPC API (``tandem.v1.Gateway``), over a real worker process:
each constraint kind on ``Complete`` and ``Chat`` gives, for the same request and seed (sampling on), exactly the
HTTP gateway's output; ``required`` and named tool choices come back as ``tool_calls`` equal to the HTTP answer's;
a bad schema, regex, grammar, tool or tool choice is ``INVALID_ARGUMENT`` naming this API's field (in the details
and the ``tandem-error-field`` trailing metadata), before any worker is reached.

The router runs in-process (gateway_harness), its gRPC gateway on a real ``grpc.aio`` server on loopback beside
its HTTP gateway; the worker is a ``tandem worker`` process stopped by PID.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import jsonschema
import pytest
from gateway_harness import WORKER_FLAGS, RouterThread

from proto.tandem.v1 import gateway_pb2 as gpb
from proto.tandem.v1 import gateway_pb2_grpc as gpb_grpc
from proto.tandem.v1 import worker_pb2 as pb
from proto.tandem.v1 import worker_pb2_grpc as pb_grpc
from router.grpc_gateway import chat_body, completions_body, start_grpc_gateway
from router.server import RouterConfig
from worker.launcher import WorkerProcess, start_worker

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["name", "n"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["C", "F"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}}}]
GRPC_TOOLS = [gpb.Tool(name=t["function"]["name"], description=t["function"].get("description", ""),
                       parameters=json.dumps(t["function"]["parameters"])) for t in TOOLS]
GRAMMAR = 'root ::= "(" num ("+" num){0,5} ")"\nnum ::= [0-9]'
# (the gRPC constraint, the same constraint as HTTP body fields)
KINDS: list[tuple[str, gpb.StructuredOutputs, dict[str, Any]]] = [
    ("json_schema", gpb.StructuredOutputs(json_schema=gpb.JsonSchema(schema=json.dumps(SCHEMA), strict=True)),
     {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}}),
    ("json_object", gpb.StructuredOutputs(json_object=True), {"response_format": {"type": "json_object"}}),
    ("regex", gpb.StructuredOutputs(regex=r"[0-9]{3}-[a-z]{2,4}"), {"guided_regex": r"[0-9]{3}-[a-z]{2,4}"}),
    ("choice", gpb.StructuredOutputs(choice=gpb.Choices(choices=["yes", "no", "maybe later"])),
     {"guided_choice": ["yes", "no", "maybe later"]}),
    ("grammar", gpb.StructuredOutputs(grammar=GRAMMAR), {"structured_outputs": {"grammar": GRAMMAR}}),
]


@pytest.fixture(scope="module")
def model(checkpoint: Callable[[str], Path]) -> Path:
    return checkpoint("llama")


@pytest.fixture(scope="module")
def served(model: Path) -> Iterator[tuple[RouterThread, gpb_grpc.GatewayStub, WorkerProcess]]:
    worker = start_worker("decode", str(model), "tcp", [*WORKER_FLAGS, "--worker-id", "so-grpc-0"])
    rt = None
    try:
        rt = RouterThread(RouterConfig(model=str(model), workers=(worker.address,)))
        server, port = rt.call_async(lambda r: start_grpc_gateway(r.gateway, "127.0.0.1", 0))
        try:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                yield rt, gpb_grpc.GatewayStub(channel), worker
        finally:
            rt.call_async(lambda r: server.stop(0.5))
    finally:
        if rt is not None:
            rt.stop()
        worker.stop()


def _http(rt: RouterThread, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(rt.url + path, json=body, timeout=120)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "constraint", "fields"), KINDS, ids=[k[0] for k in KINDS])
def test_complete_with_each_constraint_kind_equals_the_http_gateway_for_the_same_seed(
        served: Any, model: Path, kind: str, constraint: gpb.StructuredOutputs, fields: dict[str, Any]) -> None:
    rt, stub, _ = served
    chunks = list(stub.Complete(gpb.CompleteRequest(model=model.name, text="Answer:", max_tokens=24, temperature=0.9,
                                                    seed=11, structured=constraint), timeout=120))
    http = _http(rt, "/v1/completions", {"model": model.name, "prompt": "Answer:", "max_tokens": 24,
                                         "temperature": 0.9, "seed": 11, **fields})["choices"][0]
    assert "".join(c.text for c in chunks) == http["text"]
    assert chunks[-1].finish_reason == http["finish_reason"]
    if kind == "json_schema":
        jsonschema.validate(json.loads(http["text"]), SCHEMA)


@pytest.mark.slow
def test_chat_with_a_json_schema_equals_the_http_gateway_for_the_same_seed(served: Any, model: Path) -> None:
    rt, stub, _ = served
    constraint, fields = KINDS[0][1], KINDS[0][2]
    request = gpb.ChatRequest(model=model.name, messages=[gpb.ChatMessage(role="user", content="A thing as JSON.")],
                              max_tokens=48, temperature=0.9, seed=5, structured=constraint)
    chunks = list(stub.Chat(request, timeout=120))
    http = _http(rt, "/v1/chat/completions", {"model": model.name, "max_tokens": 48, "temperature": 0.9, "seed": 5,
                                              "messages": [{"role": "user", "content": "A thing as JSON."}], **fields})
    content = "".join(c.content for c in chunks)
    assert content == http["choices"][0]["message"]["content"]
    jsonschema.validate(json.loads(content), SCHEMA)
    assert chunks[-1].finish_reason == http["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1].usage.completion_tokens == http["usage"]["completion_tokens"]


def _calls(chunks: list[gpb.ChatChunk]) -> list[dict[str, str]]:
    """The tool calls a Chat stream carries, assembled as a client would from their deltas."""
    calls: list[dict[str, str]] = []
    for chunk in chunks:
        for d in chunk.tool_calls:
            if d.index == len(calls):
                assert d.id.startswith("call_") and d.name
                calls.append({"name": d.name, "arguments": d.arguments})
            else:
                calls[d.index]["arguments"] += d.arguments
    return calls


@pytest.mark.slow
@pytest.mark.parametrize("choice", ["required", "named"])
def test_chat_tool_choices_stream_tool_calls_equal_to_the_http_gateway(served: Any, model: Path, choice: str) -> None:
    rt, stub, _ = served
    tool_choice = (gpb.ToolChoice(mode="required") if choice == "required"
                   else gpb.ToolChoice(function="get_weather"))
    messages = [gpb.ChatMessage(role="user", content="What is the weather in Paris?")]
    chunks = list(stub.Chat(gpb.ChatRequest(model=model.name, messages=messages, tools=GRPC_TOOLS,
                                            tool_choice=tool_choice, max_tokens=120, temperature=0.8, seed=3),
                            timeout=120))
    http = _http(rt, "/v1/chat/completions", {
        "model": model.name, "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "tools": TOOLS, "max_tokens": 120, "temperature": 0.8, "seed": 3,
        "tool_choice": "required" if choice == "required" else {"type": "function",
                                                                "function": {"name": "get_weather"}}})
    want = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
            for c in http["choices"][0]["message"]["tool_calls"]]
    assert _calls(chunks) == want and want
    assert chunks[-1].finish_reason == http["choices"][0]["finish_reason"] == "tool_calls"
    assert not "".join(c.content for c in chunks)
    for call in want:
        schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call["name"])
        jsonschema.validate(json.loads(call["arguments"]), schema)


def _generated(w: WorkerProcess) -> int:
    with grpc.insecure_channel(w.address) as ch:
        return int(pb_grpc.WorkerStub(ch).Load(pb.LoadRequest(), timeout=10).generated_tokens)


def _msg(text: str) -> list[gpb.ChatMessage]:
    return [gpb.ChatMessage(role="user", content=text)]


BAD: list[tuple[str, Callable[[str], Any]]] = [
    ("structured.json_schema", lambda m: gpb.CompleteRequest(model=m, text="x", structured=gpb.StructuredOutputs(
        json_schema=gpb.JsonSchema(schema="{not json")))),
    ("structured.json_schema", lambda m: gpb.CompleteRequest(model=m, text="x", structured=gpb.StructuredOutputs(
        json_schema=gpb.JsonSchema(schema='{"type": "foo"}')))),
    ("structured.json_schema", lambda m: gpb.ChatRequest(model=m, messages=_msg("x"), structured=gpb.StructuredOutputs(
        json_schema=gpb.JsonSchema(schema='{"type": "string", "format": "uri-reference"}', strict=True)))),
    ("structured.regex", lambda m: gpb.CompleteRequest(model=m, text="x", structured=gpb.StructuredOutputs(
        regex="(abc"))),
    ("structured.choice", lambda m: gpb.CompleteRequest(model=m, text="x", structured=gpb.StructuredOutputs(
        choice=gpb.Choices()))),
    ("structured.grammar", lambda m: gpb.ChatRequest(model=m, messages=_msg("x"), structured=gpb.StructuredOutputs(
        grammar="root ::= missing_rule"))),
    ("tools", lambda m: gpb.ChatRequest(model=m, messages=_msg("x"), tools=[gpb.Tool(name="f", parameters="{")])),
    ("tool_choice", lambda m: gpb.ChatRequest(model=m, messages=_msg("x"), tools=GRPC_TOOLS,
                                              tool_choice=gpb.ToolChoice(function="missing"))),
    ("tool_choice", lambda m: gpb.ChatRequest(model=m, messages=_msg("x"), tools=GRPC_TOOLS, tool_choice=gpb.ToolChoice(
        function="get_time"), structured=gpb.StructuredOutputs(regex="a"))),
    ("messages[0].role", lambda m: gpb.ChatRequest(model=m, messages=[gpb.ChatMessage(role="robot", content="x")])),
]


@pytest.mark.slow
@pytest.mark.parametrize(("field", "make"), BAD, ids=[f"{f}-{i}" for i, (f, _) in enumerate(BAD)])
def test_a_bad_constraint_or_tool_is_invalid_argument_naming_the_field_before_any_worker(
        served: Any, model: Path, field: str, make: Callable[[str], Any]) -> None:
    _, stub, worker = served
    before = _generated(worker)
    request = make(model.name)
    call = stub.Chat if isinstance(request, gpb.ChatRequest) else stub.Complete
    with pytest.raises(grpc.RpcError) as e:
        list(call(request, timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (e.value.details() or "").startswith(f"{field}: "), e.value.details()
    assert ("tandem-error-field", field) in tuple(e.value.trailing_metadata() or ())
    assert _generated(worker) == before


def test_requests_map_onto_the_http_bodies_the_same_constraint_and_tools_mean() -> None:
    """What reaches the shared validation: the constraint as response_format / structured_outputs, tools and
    tool_choice in OpenAI's shape, messages with their calls; unset fields left out."""
    for _, constraint, fields in KINDS:
        body = completions_body(gpb.CompleteRequest(model="m", text="hi", structured=constraint))
        got = {k: v for k, v in body.items() if k not in ("model", "stream", "prompt")}
        if "response_format" in fields:
            assert got["response_format"]["type"] == fields["response_format"]["type"]
            if "json_schema" in fields["response_format"]:
                assert got["response_format"]["json_schema"]["schema"] == SCHEMA
                assert got["response_format"]["json_schema"]["strict"] is True
        else:
            assert list(got) == ["structured_outputs"] and len(got["structured_outputs"]) == 1
    body = chat_body(gpb.ChatRequest(
        model="m", tools=GRPC_TOOLS, tool_choice=gpb.ToolChoice(function="get_time"), parallel_tool_calls=False,
        top_logprobs=2, messages=[gpb.ChatMessage(role="user", content="hi"),
                                  gpb.ChatMessage(role="assistant", tool_calls=[gpb.ToolCall(id="call_1", name="f",
                                                                                             arguments="{}")]),
                                  gpb.ChatMessage(role="tool", content="42", tool_call_id="call_1")]))
    assert body == {"model": "m", "stream": True, "tools": TOOLS, "parallel_tool_calls": False, "logprobs": True,
                    "top_logprobs": 2, "tool_choice": {"type": "function", "function": {"name": "get_time"}},
                    "messages": [{"role": "user", "content": "hi"},
                                 {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function",
                                                                       "function": {"name": "f", "arguments": "{}"}}]},
                                 {"role": "tool", "content": "42", "tool_call_id": "call_1"}]}
