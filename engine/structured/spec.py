"""What a constrained request asks for, as the engine and the wire carry it: a kind and a spec string.

The kinds are those of OpenAI's ``response_format`` and vLLM's ``structured_outputs`` / ``guided_*`` fields:
``json_object`` (any JSON object), ``json_schema`` (the spec is the schema's JSON text; ``strict`` refuses any
keyword the library cannot enforce instead of ignoring it), ``regex``, ``choice`` (the spec is a JSON list of
strings) and ``grammar`` (Lark, or llama.cpp's GBNF, which llguidance converts to Lark).

``after_reasoning``: for a reasoning model (the router's ``--reasoning-parser``) the output may open with a
``<think>...</think>`` block, left free; the constraint holds from the end of that block on.

``num_replay_tokens``: after a migration the router resends the tokens already generated at the end of the prompt;
the new engine replays that many prompt-tail tokens into a fresh matcher before sampling, so the grammar state
continues exactly where the failed worker left it.

JSON is generated compact (no whitespace between tokens): flexible whitespace lets a model pad JSON with blanks
until it runs out of tokens, and compact output is what ``json.dumps(..., separators=(",", ":"))`` writes.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import llguidance as llg

# One lexeme: "<think>", anything without "</think>", then "</think>"; the answer's grammar follows.
_REASONING_LARK = ("start: THINK @answer | @answer\n"
                   r"THINK: /<think>(.|\n)*<\/think>/ & ~/<think>(.|\n)*<\/think>(.|\n)*<\/think>/")
KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")
_JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False}


@dataclass(slots=True, frozen=True)
class StructuredOutput:
    kind: str
    spec: str = ""
    strict: bool = False
    num_replay_tokens: int = 0
    after_reasoning: bool = False  # the constraint starts after an optional <think>...</think> block

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured output kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.kind != "json_object" and not self.spec:
            raise ValueError(f"structured output of kind {self.kind!r} needs a non-empty spec")
        if self.num_replay_tokens < 0:
            raise ValueError(f"num_replay_tokens must be >= 0, got {self.num_replay_tokens}")

    @property
    def key(self) -> str:
        """The compiled grammar's cache key: a hash of what determines it (not the replay count)."""
        return hashlib.sha256(f"{self.kind}\0{int(self.strict)}\0{int(self.after_reasoning)}\0{self.spec}".encode()
                              ).hexdigest()

    def to_grammar(self) -> str:
        """The llguidance grammar text (see :meth:`_grammar`), behind an optional reasoning block if asked."""
        grammar = self._grammar()
        if not self.after_reasoning:
            return grammar
        # regex and JSON kinds come as llguidance's JSON grammar; choice and grammar as Lark text
        inner = json.loads(grammar)["grammars"] if grammar.lstrip().startswith("{") else [{"lark_grammar": grammar}]
        inner[0]["name"] = "answer"
        return json.dumps({"grammars": [{"lark_grammar": _REASONING_LARK}, *inner]})

    def _grammar(self) -> str:
        """The llguidance grammar text. Raises ValueError for a spec that is not even well-formed (a JSON schema
        that is not JSON, a choice that is not a list of strings); deeper errors surface in validation."""
        if self.kind == "json_object":
            return llg.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=_JSON_OPTIONS)  # type: ignore[arg-type]
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.spec)
            except json.JSONDecodeError as e:
                raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
            if not isinstance(schema, dict | bool):
                raise ValueError("the JSON schema must be an object or a boolean")
            options = dict(_JSON_OPTIONS, lenient=not self.strict)
            return llg.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=options)  # type: ignore[arg-type]
        if self.kind == "regex":
            return llg.LLMatcher.grammar_from_regex(self.spec)
        if self.kind == "choice":
            try:
                choices = json.loads(self.spec)
            except json.JSONDecodeError as e:
                raise ValueError(f"the choice list is not valid JSON: {e}") from None
            if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
                raise ValueError("choice must be a non-empty list of non-empty strings")
            return llg.grammar_from("choice", json.dumps(choices))
        return llg.grammar_from("grammar", self.spec)
