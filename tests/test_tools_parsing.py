"""Tool-call parsers and the chat output splitter on hand-written text: content, calls and reasoning, whole and
streamed piece by piece (every split of the text gives the same result, and content never waits for the end)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from router.api_error import APIError
from router.chat_output import ChatOutput
from router.tool_choice import ToolRequest, parse_tools
from router.tool_parsers import ParsedCall, tool_parser

TOOLS = ({"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}})


@pytest.mark.parametrize(("parser", "text", "content", "calls"), [
    ("hermes", 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
     '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>', "Let me check.",
     [ParsedCall("get_weather", '{"city": "Paris"}'), ParsedCall("get_time", "{}")]),
    ("hermes", "no calls here", "no calls here", []),
    ("hermes", '<tool_call>{"name": "get_time", "arguments": {}}', "", [ParsedCall("get_time", "{}")]),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "get_time", "parameters": {}}',
     "", [ParsedCall("get_weather", '{"city": "Oslo"}'), ParsedCall("get_time", "{}")]),
    ("llama3_json", "{not a call", "{not a call", []),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}}]', "",
     [ParsedCall("get_weather", '{"city": "Rome"}')]),
    ("mistral", "Plain answer.", "Plain answer.", []),
])
def test_each_parser_splits_content_and_calls(parser: str, text: str, content: str, calls: list[ParsedCall]) -> None:
    end, found, _ = tool_parser(parser).split(text, final=True)
    assert (text[:end], found) == (content, calls)


def _run(out: ChatOutput, pieces: list[str], finish: str = "stop") -> tuple[list[dict[str, Any]], str | None]:
    deltas: list[dict[str, Any]] = []
    for p in pieces:
        deltas += out.feed(p)
    more, reason = out.finish(finish)
    return deltas + more, reason


def _calls_from(deltas: list[dict[str, Any]]) -> list[dict[str, str]]:
    calls: list[dict[str, str]] = []
    for d in deltas:
        for tc in d.get("tool_calls", []):
            if tc["index"] == len(calls):
                assert tc["id"].startswith("call_") and tc["type"] == "function"
                calls.append({"name": tc["function"]["name"], "arguments": tc["function"]["arguments"]})
            else:
                calls[tc["index"]]["arguments"] += tc["function"]["arguments"]
    return calls


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_streamed_hermes_calls_match_the_whole_answer_for_any_chunking(step: int) -> None:
    text = ('Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
            '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    req = ToolRequest(TOOLS, "auto")
    deltas, reason = _run(ChatOutput(req, "hermes", False), [text[i:i + step] for i in range(0, len(text), step)])
    assert reason == "tool_calls"
    assert "".join(d.get("content", "") for d in deltas) == "Sure."
    assert _calls_from(deltas) == [{"name": "get_weather", "arguments": '{"city": "Paris"}'},
                                   {"name": "get_time", "arguments": "{}"}]
    whole = ChatOutput(req, "hermes", False)
    whole.feed(text)
    whole.finish("stop")
    assert whole.message()["content"] == "Sure." and len(whole.message()["tool_calls"]) == 2


def test_content_streams_before_the_end_and_a_call_is_sent_as_soon_as_it_closes() -> None:
    out = ChatOutput(ToolRequest(TOOLS, "auto"), "hermes", False)
    assert out.feed("Hello <tool") == [{"content": "Hello "}]  # "<tool" may start a call: held back
    assert out.feed('_call>{"name": "get_time", "arguments": {}}') == []
    assert _calls_from(out.feed("</tool_call>")) == [{"name": "get_time", "arguments": "{}"}]


def test_named_choice_streams_the_arguments_as_they_come() -> None:
    out = ChatOutput(ToolRequest(TOOLS, "named", "get_weather"), "hermes", False)
    first = out.feed('{"city"')
    assert first[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert first[1]["tool_calls"][0]["function"] == {"arguments": '{"city"'}
    deltas, reason = _run(out, [': "Paris"}'])
    assert reason == "tool_calls" and _calls_from(first + deltas) == [{"name": "get_weather",
                                                                      "arguments": '{"city": "Paris"}'}]


def test_required_choice_sends_each_call_once_complete() -> None:
    out = ChatOutput(ToolRequest(TOOLS, "required"), "hermes", False)
    first = out.feed('[{"name": "get_time", "parameters": {}}')
    assert _calls_from(first) == [{"name": "get_time", "arguments": "{}"}]  # before the array closes
    deltas, reason = _run(out, [', {"name": "get_weather", "parameters": {"city": "X"}}]'])
    assert reason == "tool_calls" and _calls_from(first + deltas)[1] == {"name": "get_weather",
                                                                         "arguments": '{"city": "X"}'}
    assert [c["function"]["name"] for c in out.message()["tool_calls"]] == ["get_time", "get_weather"]


@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_reasoning_is_split_from_content_for_any_chunking(step: int) -> None:
    text = "<think>Two plus two.</think>It is 4."
    deltas, reason = _run(ChatOutput(None, "hermes", True), [text[i:i + step] for i in range(0, len(text), step)])
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Two plus two."
    assert "".join(d.get("content", "") for d in deltas) == "It is 4." and reason == "stop"


def test_tool_choice_constraints_and_refusals() -> None:
    named = parse_tools({"tools": list(TOOLS), "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
                        chat=True)
    assert named is not None and named.constraint is not None and json.loads(named.constraint.spec) == {
        "type": "object"}
    req = parse_tools({"tools": list(TOOLS), "tool_choice": "required", "parallel_tool_calls": False}, chat=True)
    assert req is not None and req.constraint is not None and json.loads(req.constraint.spec)["maxItems"] == 1
    auto = parse_tools({"tools": list(TOOLS)}, chat=True)
    assert auto is not None and auto.mode == "auto" and auto.constraint is None
    for body, chat in (({"tools": list(TOOLS), "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                        True), ({"tools": list(TOOLS)}, False), ({"tool_choice": "required"}, True),
                       ({"tools": [{"type": "function"}]}, True)):
        with pytest.raises(APIError):
            parse_tools(body, chat)
