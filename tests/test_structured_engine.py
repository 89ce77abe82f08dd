"""Structured outputs in the engine: greedy parity with transformers under the same llguidance constraint, validity
of sampled JSON over 200 generated schemas, mixed batches, migration replay, the compile cache and bad specs.

The reference is transformers' ``generate`` on the same checkpoint with a logits processor that applies
llguidance's own matcher and bitmask token by token (llguidance ships no transformers processor; this one unpacks
the mask with numpy, independently of the engine's torch unpacking).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import llguidance as llg
import numpy as np
import pytest
import torch

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.structured.compiler import GrammarCompiler
from engine.structured.spec import StructuredOutput

PROMPT = "The answer, as JSON:"
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
    "required": ["name", "n", "tags"], "additionalProperties": False}
SPECS = {
    "json_schema": StructuredOutput("json_schema", json.dumps(SCHEMA), strict=True),
    "json_object": StructuredOutput("json_object"),
    "regex": StructuredOutput("regex", r"[0-9]{3}-[a-z]{2,4}"),
    "choice": StructuredOutput("choice", json.dumps(["yes", "no", "maybe later"])),
    "grammar": StructuredOutput("grammar", 'root ::= "(" num ("+" num){0,5} ")"\nnum ::= [0-9]'),
}


@pytest.fixture(scope="module")
def model(checkpoint: Callable[[str], Path]) -> Path:
    return checkpoint("llama")


@pytest.fixture(scope="module")
def llm(model: Path) -> LLM:
    return LLM(str(model), max_num_seqs=64)


class _Reference:
    """transformers' generate with llguidance's mask applied to its logits at every step (batch of one)."""

    def __init__(self, tokenizer: llg.LLTokenizer, grammar: str, vocab: int) -> None:
        self.matcher = llg.LLMatcher(tokenizer, grammar)
        self.vocab = vocab
        self.seen = 0

    def process(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        ids = input_ids[0].tolist()
        if self.seen:
            assert self.matcher.consume_token(ids[-1]), self.matcher.get_error()
        self.seen = len(ids)
        words = np.frombuffer(self.matcher.compute_bitmask(), dtype="<u4")
        allowed = np.unpackbits(words.view(np.uint8), bitorder="little")[: scores.shape[1]].astype(bool)
        return scores.masked_fill(~torch.from_numpy(allowed)[None, :], float("-inf"))

    def stopped(self, input_ids: torch.Tensor, scores: torch.Tensor, **_: Any) -> torch.Tensor:
        done = False
        if len(input_ids[0]) > self.seen:  # the token just picked: does it complete the grammar?
            probe = self.matcher.deep_copy()
            probe.consume_token(int(input_ids[0, -1]))
            done = probe.is_stopped()
        return torch.tensor([done])


def _hf_constrained(model: Path, llm: LLM, prompt: list[int], spec: StructuredOutput, max_new: int) -> list[int]:
    from transformers import AutoModelForCausalLM, LogitsProcessorList, StoppingCriteriaList

    compiler = llm.engine.grammars
    ref = _Reference(compiler.tokenizer, spec.to_grammar(), compiler.vocab_size)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                          logits_processor=LogitsProcessorList([ref.process]),
                          stopping_criteria=StoppingCriteriaList([ref.stopped]),
                          eos_token_id=list(llm.engine.eos_token_ids), pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("kind", list(SPECS))
def test_greedy_constrained_output_matches_transformers_with_the_same_llguidance_mask(model: Path, llm: LLM,
                                                                                     kind: str) -> None:
    spec = SPECS[kind]
    prompt = llm.tokenizer.encode(PROMPT)
    out = llm.generate([prompt], SamplingParams(max_tokens=48, temperature=0, structured=spec))[0]
    assert out.token_ids == _hf_constrained(model, llm, prompt, spec, 48)
    if out.finish_reason == "stop":  # the grammar completed: the text is a full match
        m = llm.engine.grammars.matcher(spec)
        assert m.consume_tokens(out.token_ids) and (m.is_accepting() or m.is_stopped())
    if kind in ("json_schema", "regex", "choice"):  # small enough to complete in 48 tokens
        assert out.finish_reason == "stop", out.text


def _schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """A random JSON schema whose every instance is short (bounded strings, arrays and integers; closed objects)."""
    kinds = ["integer", "boolean", "enum", "string", "array"] + (["object"] * 2 if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 500)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "x", "y z", 1, 2, None, True], rng.randint(1, 4))}
    if kind == "string":
        return {"type": "string", "minLength": rng.randint(0, 2), "maxLength": rng.randint(2, 6)}
    if kind == "array":
        lo = rng.randint(0, 2)
        return {"type": "array", "items": _schema(rng, depth + 1), "minItems": lo, "maxItems": lo + rng.randint(0, 2)}
    names = rng.sample(["id", "name", "size", "ok", "kind", "child", "tags", "value"], rng.randint(1, 4))
    return {"type": "object", "properties": {n: _schema(rng, depth + 1) for n in names},
            "required": [n for n in names if rng.random() < 0.7], "additionalProperties": False}


@pytest.mark.slow
def test_sampled_outputs_of_200_generated_schemas_parse_and_validate(llm: LLM) -> None:
    rng = random.Random(30)
    schemas = [{"type": "object", "properties": {"a": _schema(rng), "b": _schema(rng)}, "required": ["a"],
                "additionalProperties": False} for _ in range(200)]
    params = [SamplingParams(max_tokens=400, temperature=1.0, seed=i % 4,
                             structured=StructuredOutput("json_schema", json.dumps(s), strict=True))
              for i, s in enumerate(schemas)]
    outs = llm.generate([PROMPT] * len(schemas), params)
    for s, out in zip(schemas, outs, strict=True):
        assert out.finish_reason == "stop", (s, out.text)
        jsonschema.validate(json.loads(out.text), s)


def test_a_mixed_batch_of_32_gives_the_same_unconstrained_outputs_as_without_the_constrained_half(llm: LLM) -> None:
    prompts = [f"Request number {i}: tell me" for i in range(32)]
    free = [SamplingParams(max_tokens=12, temperature=0.8 if i % 4 else 0, seed=i, ignore_eos=True)
            for i in range(16)]
    alone = llm.generate(prompts[:16], free)
    constrained = [SamplingParams(max_tokens=12, temperature=0.8, seed=i, structured=list(SPECS.values())[i % 5])
                   for i in range(16)]
    mixed = llm.generate([p for pair in zip(prompts[:16], prompts[16:], strict=True) for p in pair],
                         [p for pair in zip(free, constrained, strict=True) for p in pair])
    assert [o.token_ids for o in mixed[0::2]] == [o.token_ids for o in alone]
    assert all(o.text for o in mixed[1::2])


def test_a_fresh_matcher_replaying_the_generated_tokens_continues_the_same_output(llm: LLM) -> None:
    """What a migration does: the new engine gets prompt + generated tokens and replays them into its matcher."""
    spec = SPECS["json_schema"]
    prompt = llm.tokenizer.encode(PROMPT)
    full = llm.generate([prompt], SamplingParams(max_tokens=48, temperature=0, structured=spec))[0]
    assert full.finish_reason == "stop" and len(full.token_ids) > 4
    k = len(full.token_ids) // 2
    resumed = StructuredOutput(spec.kind, spec.spec, spec.strict, num_replay_tokens=k)
    rest = llm.generate([prompt + full.token_ids[:k]],
                        SamplingParams(max_tokens=48 - k, temperature=0, structured=resumed))[0]
    assert full.token_ids[:k] + rest.token_ids == full.token_ids and rest.finish_reason == "stop"
    json.loads(llm.tokenizer.decode(full.token_ids))


def test_a_prefix_cache_hit_keeps_the_constrained_output(llm: LLM) -> None:
    prompt = llm.tokenizer.encode(PROMPT * 4)  # several full blocks
    params = SamplingParams(max_tokens=32, temperature=0, structured=SPECS["json_schema"])
    first = llm.generate([prompt], params)[0]
    second = llm.generate([prompt], params)[0]
    assert second.num_cached_tokens > 0 and second.token_ids == first.token_ids


def test_compiled_grammars_are_cached_by_spec_hash(llm: LLM) -> None:
    compiler = GrammarCompiler(llm.tokenizer, llm.engine.model_config.vocab_size, None)
    spec = StructuredOutput("regex", "[a-c]{2}")
    compiler.grammar(spec)
    compiler.grammar(StructuredOutput("regex", "[a-c]{2}", num_replay_tokens=3))
    assert (compiler.hits, compiler.misses) == (1, 1)
    a, b = compiler.matcher(spec), compiler.matcher(spec)  # copies of one compiled matcher: independent states
    assert a.consume_tokens(llm.tokenizer.encode("ab", add_special_tokens=False)) and a.is_accepting()
    assert not b.is_accepting() and b.consume_tokens(llm.tokenizer.encode("c", add_special_tokens=False))


@pytest.mark.parametrize(("spec", "problem"), [
    (StructuredOutput("json_schema", '{"type": "foo"}'), "foo"),
    (StructuredOutput("json_schema", '{"type": "object"'), "not valid JSON"),
    (StructuredOutput("json_schema", '{"type": "string", "format": "uri-reference"}', strict=True), "uri-reference"),
    (StructuredOutput("regex", "(abc"), "unclosed group"),
    (StructuredOutput("choice", '["a", 3]'), "list of non-empty strings"),
    (StructuredOutput("grammar", "start: undefined_rule"), "undefined_rule"),
])
def test_bad_specs_are_refused_naming_the_problem(llm: LLM, spec: StructuredOutput, problem: str) -> None:
    with pytest.raises(ValueError, match="invalid") as e:
        llm.engine.grammars.grammar(spec)
    assert problem in str(e.value)
    with pytest.raises(ValueError):
        llm.engine.add_request(PROMPT, SamplingParams(structured=spec))


@pytest.mark.parametrize("spec", [StructuredOutput("regex", "[0-9]{3}", after_reasoning=True),
                                  StructuredOutput("choice", '["123", "456"]', after_reasoning=True),
                                  StructuredOutput("grammar", 'root ::= [0-9] [0-9] [0-9]', after_reasoning=True),
                                  StructuredOutput("grammar", 'start: /[0-9]{3}/', after_reasoning=True)],
                         ids=["regex", "choice", "gbnf", "lark"])
def test_after_reasoning_leaves_the_think_block_free_and_constrains_what_follows(llm: LLM,
                                                                                 spec: StructuredOutput) -> None:
    """Every kind, whether llguidance hands its grammar back as JSON (regex, JSON schema) or as Lark text (choice,
    grammar), continues after a free think block."""
    for text, ok in (("<think>anything, even {json or 12a</think>123", True), ("123", True),
                     ("<think>x</think>12a", False), ("abc", False)):
        m = llm.engine.grammars.matcher(spec)
        assert m.consume_tokens(llm.tokenizer.encode(text, add_special_tokens=False)) == ok, text
