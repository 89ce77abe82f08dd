"""The structured-output fields of a request, parsed into one :class:`StructuredOutput` and validated here.

Accepted: OpenAI's ``response_format`` (``text``, ``json_object``, ``json_schema`` with ``strict``), vLLM's
``structured_outputs`` object (``json``, ``json_object``, ``regex``, ``choice``, ``grammar``) and its older
``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` fields (``guided_decoding_backend`` is
accepted and ignored: the constraint means the same whichever engine enforces it). At most one constraint per
request. The spec is compiled against the served tokenizer with the workers' own compiler (cached by spec hash),
so an invalid schema, regex or grammar, or a schema keyword the library cannot enforce, is a 400 naming the
problem before any worker is reached.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

from engine.structured.compiler import GrammarCompiler
from engine.structured.spec import StructuredOutput
from engine.tokenizer import Tokenizer
from router.api_error import APIError

_SO_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
            "json_object": "json_object"}
_GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}
_FIELDS = frozenset({"response_format", "structured_outputs", "guided_decoding_backend", *_GUIDED})


@lru_cache(maxsize=8)
def compiler_for(tokenizer: Tokenizer, vocab_size: int) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, vocab_size, tokenizer.eos_token_id)


def parse_structured(body: dict[str, Any], tokenizer: Tokenizer, vocab_size: int) -> StructuredOutput | None:
    """The request's constraint (None: unconstrained). Raises APIError(400) naming the field and the problem."""
    if _FIELDS.isdisjoint(body):  # most requests: none of the fields below, nothing to check
        return None
    found: list[tuple[str, StructuredOutput]] = []
    rf = body.get("response_format")
    if rf is not None:
        so = _response_format(rf)
        if so is not None:
            found.append(("response_format", so))
    so_field = body.get("structured_outputs")
    if so_field is not None:
        found.extend(("structured_outputs", s) for s in _structured_outputs(so_field))
    for name, kind in _GUIDED.items():
        v = body.get(name)
        if v is not None:
            found.append((name, _spec(name, kind, v)))
    backend = body.get("guided_decoding_backend")
    if backend is not None and not isinstance(backend, str):
        raise APIError(400, "'guided_decoding_backend' must be a string", "guided_decoding_backend")
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(sorted({n for n, _ in found}))
        raise APIError(400, f"only one structured output constraint per request, got several ({names})", found[1][0])
    name, so = found[0]
    parse_structured_spec(so, tokenizer, vocab_size, name)
    return so


def parse_structured_spec(so: StructuredOutput, tokenizer: Tokenizer, vocab_size: int, name: str = "") -> None:
    """Compile ``so`` (cached) as the workers will; APIError(400) naming ``name`` if it does not compile."""
    try:
        compiler_for(tokenizer, vocab_size).grammar(so)
    except ValueError as e:
        raise APIError(400, str(e), name or None) from None


def _response_format(rf: Any) -> StructuredOutput | None:
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise APIError(400, "'response_format' must be an object with a 'type'", "response_format")
    kind = rf["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or "schema" not in js:
            raise APIError(400, "'response_format.json_schema' must be an object with a 'schema'",
                           "response_format")
        strict = js.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise APIError(400, "'response_format.json_schema.strict' must be a boolean", "response_format")
        return _spec("response_format", "json_schema", js["schema"], bool(strict))
    raise APIError(400, f"'response_format.type' must be text, json_object or json_schema, got {kind!r}",
                   "response_format")


def _structured_outputs(v: Any) -> list[StructuredOutput]:
    if not isinstance(v, dict):
        raise APIError(400, "'structured_outputs' must be an object", "structured_outputs")
    unknown = sorted(k for k, x in v.items() if x is not None and k not in _SO_KEYS
                     and k not in ("backend", "disable_any_whitespace", "disable_fallback",
                                   "disable_additional_properties"))
    if unknown:
        raise APIError(400, f"'structured_outputs.{unknown[0]}' is not supported by this server", "structured_outputs",
                       code="unsupported_parameter")
    out = []
    for key, kind in _SO_KEYS.items():
        x = v.get(key)
        if x is None or (key == "json_object" and x is False):
            continue
        if key == "json_object":
            if x is not True:
                raise APIError(400, "'structured_outputs.json_object' must be a boolean", "structured_outputs")
            out.append(StructuredOutput("json_object"))
        else:
            out.append(_spec("structured_outputs", kind, x))
    return out


def _spec(name: str, kind: str, v: Any, strict: bool = False) -> StructuredOutput:
    if kind == "json_schema":
        if isinstance(v, str):
            try:
                v = json.loads(v)
            except json.JSONDecodeError as e:
                raise APIError(400, f"invalid JSON schema constraint: not valid JSON: {e}", name) from None
        if not isinstance(v, dict | bool):
            raise APIError(400, "invalid JSON schema constraint: a schema must be an object", name)
        return StructuredOutput("json_schema", json.dumps(v, sort_keys=True), strict=strict)
    if kind == "choice":
        if not isinstance(v, list) or not v or not all(isinstance(c, str) and c for c in v):
            raise APIError(400, f"'{name}' choice must be a non-empty list of non-empty strings", name)
        return StructuredOutput("choice", json.dumps(v))
    if not isinstance(v, str) or not v:
        raise APIError(400, f"'{name}' {kind} must be a non-empty string", name)
    return StructuredOutput(kind, v)
