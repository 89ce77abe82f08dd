"""``tools``, ``tool_choice`` and ``parallel_tool_calls`` of a chat request, parsed and turned into a constraint.

- ``none``: the tools are still rendered into the prompt (as vLLM does) but the output is plain content;
- ``auto`` (the default with tools): the model decides; its text is parsed with the server's tool-call parser;
- ``required``: the output is constrained to a JSON array of ``{"name": ..., "parameters": {...}}``, each item one
  of the tools with its own parameter schema (one item when ``parallel_tool_calls`` is false);
- a named function: the output is constrained to that function's parameter schema: it is the call's arguments.

``required`` and named choices are grammar constraints (:mod:`engine.structured`), so they hold on every path.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from engine.structured.spec import StructuredOutput
from router.api_error import APIError

MAX_TOOLS = 128


@dataclass(slots=True, frozen=True)
class ToolRequest:
    tools: tuple[dict[str, Any], ...]  # as the client sent them (rendered through the chat template)
    mode: str  # none | auto | required | named
    name: str | None = None  # the named function
    parallel: bool = True

    @property
    def constraint(self) -> StructuredOutput | None:
        by_name = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in self.tools}
        if self.mode == "named":
            assert self.name is not None
            return StructuredOutput("json_schema", json.dumps(by_name[self.name], sort_keys=True))
        if self.mode == "required":
            item = {"anyOf": [{"type": "object", "properties": {"name": {"const": n}, "parameters": p},
                               "required": ["name", "parameters"], "additionalProperties": False}
                              for n, p in by_name.items()]}
            schema: dict[str, Any] = {"type": "array", "items": item, "minItems": 1}
            if not self.parallel:
                schema["maxItems"] = 1
            return StructuredOutput("json_schema", json.dumps(schema, sort_keys=True))
        return None


def parse_tools(body: dict[str, Any], chat: bool) -> ToolRequest | None:
    """The request's tools (None: no tools). Raises APIError(400) naming the field."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise APIError(400, "'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    if not tools:
        if choice not in (None, "none", "auto"):
            raise APIError(400, "'tool_choice' needs 'tools'", "tool_choice")
        return None
    if not chat:
        raise APIError(400, "'tools' are only supported on chat completions", "tools")
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise APIError(400, f"'tools' must be a list of at most {MAX_TOOLS} tools", "tools")
    names = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise APIError(400, f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}", "tools")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise APIError(400, f"tools[{i}].function.parameters must be a JSON schema object", "tools")
        names.append(fn["name"])
    if len(set(names)) != len(names):
        raise APIError(400, "'tools' has two functions with the same name", "tools")
    if choice is None or choice in ("auto", "none", "required"):
        return ToolRequest(tuple(tools), choice or "auto", parallel=parallel is not False)
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
        raise APIError(400, "'tool_choice' must be none, auto, required or {'type': 'function', 'function': "
                       "{'name': ...}}", "tool_choice")
    if name not in names:
        raise APIError(400, f"'tool_choice' names {name!r}, which is not in 'tools'", "tool_choice")
    return ToolRequest(tuple(tools), "named", name, parallel=parallel is not False)
