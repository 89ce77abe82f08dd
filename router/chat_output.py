"""One chat choice's generated text split into what the client sees: ``reasoning_content`` (an output that opens with
``<think>``, up to ``</think>``, with ``--reasoning-parser``), ``content`` and ``tool_calls``, both streamed (as
deltas, the way OpenAI sends them) and whole.

Tool calls: with a named ``tool_choice`` the text *is* the arguments, streamed as they come; with ``required`` it is
a JSON array of calls, each sent once complete; with ``auto`` the server's tool-call parser finds them, content
streaming at once up to a possible start of a call. Each call gets an id (``call_<hex>``), and a choice that ended
normally with calls finishes with ``tool_calls``.
"""

from __future__ import annotations

import json
import os
from typing import Any

from router.tool_choice import ToolRequest
from router.tool_parsers import ParsedCall, tool_parser

THINK_START, THINK_END = "<think>", "</think>"
REASONING_PARSERS = ("qwen3", "deepseek_r1")  # both write <think>...</think>


def _held(text: str, marker: str) -> int:
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ChatOutput:
    def __init__(self, tools: ToolRequest | None, parser: str, reasoning: bool) -> None:
        self.tools = tools if tools is not None and tools.mode != "none" else None
        self.parser = tool_parser(parser) if self.tools is not None and self.tools.mode == "auto" else None
        self.reasoning_on = reasoning
        self.in_reasoning = reasoning
        self.raw = ""  # everything generated
        self.body = ""  # the part after the reasoning
        self.reasoning = ""
        self.content = ""
        self.calls: list[dict[str, Any]] = []
        self._reason_pos = 0
        self._args_sent = 0

    def feed(self, text: str, final: bool = False) -> list[dict[str, Any]]:
        """The deltas that ``text`` (the next piece of output) makes certain; ``final`` at the end."""
        deltas: list[dict[str, Any]] = []
        self.raw += text
        if self.in_reasoning:
            text = self._reason(deltas, final)
        self.body += text
        if self.tools is None:
            if text:
                self.content += text
                deltas.append({"content": text})
        elif self.tools.mode == "named":
            self._named(deltas)
        elif self.tools.mode == "required":
            self._required(deltas, final)
        else:
            self._auto(deltas, final)
        return deltas

    def _reason(self, deltas: list[dict[str, Any]], final: bool) -> str:
        r = self.raw
        if len(r) < len(THINK_START) and THINK_START.startswith(r) and not final:
            return ""  # undecided yet
        if not r.startswith(THINK_START):  # no reasoning block: all of it is the answer (as Qwen3's parser does)
            self.in_reasoning = False
            return r
        at = max(self._reason_pos, len(THINK_START))
        end = r.find(THINK_END, at)
        if end < 0:
            upto = len(r) if final else len(r) - _held(r, THINK_END)
            rest = ""
        else:
            upto = end
            rest = r[end + len(THINK_END):]
            self.in_reasoning = False
        piece = r[at:upto]
        if piece:
            self.reasoning += piece
            deltas.append({"reasoning_content": piece})
        self._reason_pos = upto
        return rest

    def _call_delta(self, call: ParsedCall) -> dict[str, Any]:
        entry: dict[str, Any] = {"id": f"call_{os.urandom(12).hex()}", "type": "function",
                 "function": {"name": call.name, "arguments": call.arguments}}
        self.calls.append(entry)
        return {"tool_calls": [{"index": len(self.calls) - 1, **entry, "function": dict(entry["function"])}]}

    def _named(self, deltas: list[dict[str, Any]]) -> None:
        assert self.tools is not None and self.tools.name is not None
        if not self.body:
            return
        if not self.calls:
            deltas.append(self._call_delta(ParsedCall(self.tools.name, "")))
        piece = self.body[self._args_sent:]
        if piece:
            self.calls[0]["function"]["arguments"] += piece
            deltas.append({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]})
            self._args_sent = len(self.body)

    def _required(self, deltas: list[dict[str, Any]], final: bool) -> None:
        body = self.body.lstrip()
        if not body.startswith("["):
            return
        dec = json.JSONDecoder()
        pos, found = 1, []
        while True:
            while pos < len(body) and body[pos] in " \n\t,":
                pos += 1
            try:
                obj, pos = dec.raw_decode(body, pos)
            except json.JSONDecodeError:
                break
            found.append(obj)
        for obj in found[len(self.calls):]:
            if isinstance(obj, dict) and isinstance(obj.get("name"), str):
                params = obj.get("parameters", {})
                deltas.append(self._call_delta(ParsedCall(obj["name"], json.dumps(params, ensure_ascii=False))))

    def _auto(self, deltas: list[dict[str, Any]], final: bool) -> None:
        assert self.parser is not None and self.tools is not None
        content_end, calls, _ = self.parser.split(self.body, final)
        piece = self.body[len(self.content):content_end] if content_end > len(self.content) else ""
        if piece:
            self.content += piece
            deltas.append({"content": piece})
        if not self.tools.parallel:
            calls = calls[:1]
        for call in calls[len(self.calls):]:
            deltas.append(self._call_delta(call))

    def finish(self, finish_reason: str | None) -> tuple[list[dict[str, Any]], str | None]:
        """The last deltas and the choice's finish reason (``tool_calls`` when it ended with calls)."""
        deltas = self.feed("", final=True)
        if self.calls and finish_reason == "stop":
            finish_reason = "tool_calls"
        return deltas, finish_reason

    def message(self) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "assistant", "content": self.content if (self.content or not self.calls)
                               else None}
        if self.reasoning_on:
            msg["reasoning_content"] = self.reasoning or None
        if self.calls:
            msg["tool_calls"] = self.calls
        return msg
