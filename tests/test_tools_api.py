"""Tool calls and reasoning through the router with the official ``openai`` client, over a real worker process:
``required`` and named choices (grammar-constrained) return ``tool_calls`` whose arguments validate against the
tool's schema, whole and streamed (``delta.tool_calls`` incremental); ``auto`` parses the Hermes
``<tool_call>`` text (the tiny random-weight model never writes one on its own, so the test steers it there with a
regex constraint, which ``auto`` leaves free); a full round trip sends the call and a ``role: tool`` result back
through the chat template; ``--reasoning-parser`` splits ``<think>`` into ``reasoning_content``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from gateway_harness import RouterThread

from engine.tokenizer import Tokenizer
from router.server import RouterConfig
from worker.launcher import WorkerProcess, start_worker

pytestmark = pytest.mark.slow
FLAGS = ["--num-kv-blocks", "512", "--threads", "1"]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "unit": {"enum": ["C", "F"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}}}]
MESSAGES: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def worker(checkpoint: Callable[[str], Path]) -> Iterator[WorkerProcess]:
    w = start_worker("decode", str(checkpoint("llama")), "tcp", [*FLAGS, "--worker-id", "tools-0"])
    yield w
    w.stop()


def _serve(model: Path, worker: WorkerProcess, reasoning_parser: str | None) -> Iterator[tuple[openai.OpenAI, Path]]:
    rt = RouterThread(RouterConfig(model=str(model), workers=(worker.address,), reasoning_parser=reasoning_parser))
    yield openai.OpenAI(base_url=rt.url + "/v1", api_key="none", max_retries=0, timeout=120), model
    rt.stop()


@pytest.fixture(scope="module")
def served(checkpoint: Callable[[str], Path], worker: WorkerProcess) -> Iterator[tuple[openai.OpenAI, Path]]:
    yield from _serve(checkpoint("llama"), worker, None)


@pytest.fixture(scope="module")
def reasoning(checkpoint: Callable[[str], Path], worker: WorkerProcess) -> Iterator[tuple[openai.OpenAI, Path]]:
    yield from _serve(checkpoint("llama"), worker, "qwen3")


def _check_call(call: Any) -> None:
    assert call.id.startswith("call_") and call.type == "function"
    schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call.function.name)
    jsonschema.validate(json.loads(call.function.arguments), schema)


def _streamed_calls(stream: Any) -> tuple[list[dict[str, str]], str | None]:
    calls: list[dict[str, str]] = []
    finish = None
    for chunk in stream:
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        for tc in ch.delta.tool_calls or []:
            if tc.index == len(calls):
                assert tc.id and tc.id.startswith("call_") and tc.function and tc.function.name
                calls.append({"name": tc.function.name, "arguments": tc.function.arguments or ""})
            else:
                assert tc.function is not None
                calls[tc.index]["arguments"] += tc.function.arguments or ""
        finish = ch.finish_reason or finish
    return calls, finish


@pytest.mark.parametrize("choice", ["required", "named"])
def test_required_and_named_choices_return_valid_tool_calls_whole_and_streamed(served: Any, choice: str) -> None:
    client, model = served
    tool_choice: Any = "required" if choice == "required" else {"type": "function",
                                                                "function": {"name": "get_weather"}}
    out = client.chat.completions.create(model=model.name, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice,
                                         max_tokens=120, temperature=0)
    ch = out.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.tool_calls
    for call in ch.message.tool_calls:
        _check_call(call)
    if choice == "named":
        assert [c.function.name for c in ch.message.tool_calls] == ["get_weather"]  # type: ignore[union-attr]
    calls, finish = _streamed_calls(client.chat.completions.create(
        model=model.name, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, max_tokens=120, temperature=0,
        stream=True))
    assert finish == "tool_calls"
    assert calls == [{"name": c.function.name, "arguments": c.function.arguments}  # type: ignore[union-attr]
                     for c in ch.message.tool_calls]


def test_auto_parses_a_hermes_tool_call_and_a_tool_result_round_trips(served: Any) -> None:
    client, model = served
    steer = {"structured_outputs": {"regex": r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": '
                                             r'"[A-Z][a-z]{2,6}", "unit": "C"\}\}\n</tool_call>'}}
    out = client.chat.completions.create(model=model.name, messages=MESSAGES, tools=TOOLS, max_tokens=80,
                                         temperature=0, extra_body=steer)
    ch = out.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.tool_calls and not ch.message.content
    call = ch.message.tool_calls[0]
    _check_call(call)
    calls, finish = _streamed_calls(client.chat.completions.create(
        model=model.name, messages=MESSAGES, tools=TOOLS, max_tokens=80, temperature=0, extra_body=steer,
        stream=True))
    assert finish == "tool_calls" and calls == [{"name": "get_weather",
                                                 "arguments": call.function.arguments}]  # type: ignore[union-attr]
    history: list[Any] = [*MESSAGES, ch.message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"}]
    final = client.chat.completions.create(model=model.name, messages=history, tools=TOOLS, tool_choice="none",
                                           max_tokens=8, temperature=0)
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls
    rendered = Tokenizer(model).apply_chat_template(history, tools=TOOLS)
    assert "<tool_response>\n18 degrees and sunny\n</tool_response>" in rendered and "<tool_call>" in rendered
    assert final.usage is not None and final.usage.prompt_tokens == len(Tokenizer(model).encode(
        rendered, add_special_tokens=False))


def test_with_a_reasoning_parser_an_answer_without_a_think_block_is_all_content(served: Any,
                                                                                reasoning: Any) -> None:
    """This random-weight model never closes a ``<think>`` block on its own (how a think block is split, whole and
    in every chunking, is tested in tests/test_tools_parsing.py; that a constraint starts after one, in
    tests/test_structured_engine.py): a plain answer passes through the qwen3 parser unchanged, whole and
    streamed, and a constrained one still honours its constraint."""
    plain, model = served
    client, _ = reasoning
    want = plain.chat.completions.create(model=model.name, messages=MESSAGES, max_tokens=12, temperature=0)
    got = client.chat.completions.create(model=model.name, messages=MESSAGES, max_tokens=12, temperature=0)
    assert got.choices[0].message.content == want.choices[0].message.content
    assert got.choices[0].message.model_dump().get("reasoning_content") is None
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=model.name, messages=MESSAGES, max_tokens=12, temperature=0, stream=True) if c.choices)
    assert streamed == want.choices[0].message.content
    named = client.chat.completions.create(model=model.name, messages=MESSAGES, tools=TOOLS, max_tokens=120,
                                           temperature=0, tool_choice={"type": "function",
                                                                       "function": {"name": "get_weather"}})
    calls = named.choices[0].message.tool_calls
    assert calls and named.choices[0].finish_reason == "tool_calls"
    _check_call(calls[0])


def test_tools_on_completions_and_an_unknown_named_tool_are_400s(served: Any) -> None:
    client, model = served
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model.name, messages=MESSAGES, tools=TOOLS, max_tokens=4,
                                       tool_choice={"type": "function", "function": {"name": "missing"}})
    assert isinstance(e.value.body, dict) and e.value.body.get("param") == "tool_choice"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model.name, prompt="x", max_tokens=4, extra_body={"tools": TOOLS})
    assert isinstance(e.value.body, dict) and e.value.body.get("param") == "tools"
