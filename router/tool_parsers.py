"""Tool-call parsers: how a model writes its calls in plain text, selected by ``--tool-call-parser``.

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number, text around them is content
  (Hermes, Qwen2.5/3, and the tiny model's template);
- ``llama3_json``: the whole output is ``{"name": ..., "parameters": {...}}`` (several joined by ``;``);
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``.

A parser splits text into content and calls. For streaming, :meth:`ToolParser.split` also says how much of an
unfinished text is certainly content (everything before a possible start of a call), so content streams at once and a
call is sent as soon as it is complete.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True, frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text


def _call(obj: Any, args_key: str = "arguments") -> ParsedCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    return ParsedCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def _held(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker`` (it may become the marker)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ToolParser:
    name = ""

    def split(self, text: str, final: bool) -> tuple[int, list[ParsedCall], int]:
        """``(content_end, calls, consumed)``: ``text[:content_end]`` is content for sure, ``calls`` are the complete
        calls found in ``text[content_end:consumed]``; the rest may still be the start of a call. With ``final``,
        everything is decided."""
        raise NotImplementedError


class HermesParser(ToolParser):
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"

    def split(self, text: str, final: bool) -> tuple[int, list[ParsedCall], int]:
        start = text.find(self.START)
        if start < 0:
            keep = 0 if final else _held(text, self.START)
            return len(text) - keep, [], len(text) - keep
        calls: list[ParsedCall] = []
        pos = start
        while text.startswith(self.START, pos):
            body_at = pos + len(self.START)
            end = text.find(self.END, body_at)
            if end < 0:
                if final:  # a model that ends on EOS right after the JSON, without the closing tag
                    call = _parse_json_call(text[body_at:])
                    calls.extend([call] if call is not None else [])
                break
            call = _parse_json_call(text[body_at:end])
            calls.extend([call] if call is not None else [])
            pos = end + len(self.END)
            while pos < len(text) and text[pos].isspace():
                pos += 1
        return start, calls, len(text) if final else pos


def _parse_json_call(body: str) -> ParsedCall | None:
    try:
        return _call(json.loads(body))
    except json.JSONDecodeError:
        return None


class _WholeOutputParser(ToolParser):
    """Calls that take the whole output, recognised by how it starts: decided only at the end."""

    marker = ""

    def _starts(self, text: str) -> bool:
        s = text.lstrip()
        return s.startswith(self.marker) or (not s or self.marker.startswith(s))

    def split(self, text: str, final: bool) -> tuple[int, list[ParsedCall], int]:
        if not self._starts(text):
            return len(text), [], len(text)
        if not final:
            return 0, [], 0
        calls = self._parse(text.lstrip())
        return (0, calls, len(text)) if calls else (len(text), [], len(text))

    def _parse(self, text: str) -> list[ParsedCall]:
        raise NotImplementedError


class Llama3JsonParser(_WholeOutputParser):
    name = "llama3_json"
    marker = "{"

    def _parse(self, text: str) -> list[ParsedCall]:
        calls = []
        for part in text.split(";"):
            call = _parse_json_call(part.strip())
            if call is None:
                return []
            calls.append(call)
        return calls


class MistralParser(_WholeOutputParser):
    name = "mistral"
    marker = "[TOOL_CALLS]"

    def _parse(self, text: str) -> list[ParsedCall]:
        try:
            objs = json.loads(text[len(self.marker):])
        except json.JSONDecodeError:
            return []
        calls = [_call(o) for o in (objs if isinstance(objs, list) else [objs])]
        return [c for c in calls if c is not None] if all(calls) else []


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)}


def tool_parser(name: str) -> ToolParser:
    try:
        return PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; one of {', '.join(PARSERS)}") from None
