"""Compiling constraints into llguidance matchers, with the compiled grammars cached by spec hash.

Why llguidance rather than xgrammar: both are what vLLM and SGLang use, with comparable mask speed (tens of
microseconds a token) and Earley/pushdown grammars for JSON schema, regex and EBNF. llguidance is one small abi3
wheel with no Python dependencies, while xgrammar's wheel depends on torch, transformers and triton (hundreds of MB
on a CPU host, and a torch requirement that must never be resolved here); llguidance reports unsupported JSON
schema keywords and malformed regexes with precise messages (our 400s quote them), exports a C API in the same wheel
(so a native thread fills the masks while the forward pass runs, with no GIL: :mod:`engine.structured.native`), and
converts llama.cpp's GBNF as well as Lark, so one ``grammar`` kind takes both.

Validation (the router's 400s) goes through llguidance's Python API; the workers' matchers through its C API, made
from the same validated grammar text. ``tests/test_structured_native.py`` walks both and compares their masks.

The router validates with the same compiler (and tokenizer) as the workers, so a spec that would fail on a worker
is refused with a 400 before any worker is reached.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import llguidance as llg

from engine.structured.native import NativeMatcher, NativeTokenizer
from engine.structured.spec import StructuredOutput
from engine.tokenizer import Tokenizer


class GrammarCompiler:
    """Validates specs and makes matchers for one tokenizer. Thread-safe; keeps the ``cache_size`` most recently
    used grammars (validated, by :attr:`StructuredOutput.key`)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_id: int | None, cache_size: int = 512) -> None:
        if cache_size < 1:
            raise ValueError(f"cache_size must be >= 1, got {cache_size}")
        eos = eos_token_id if eos_token_id is not None else tokenizer.eos_token_id
        self.tokenizer = llg.LLTokenizer(tokenizer.to_json(), n_vocab=vocab_size, eos_token=eos)
        self.vocab_size = vocab_size
        self.eos_token_id: int = self.tokenizer.eos_token
        self._source = tokenizer
        self._native: NativeTokenizer | None = None  # built with the first matcher: the router only validates
        self._cache: OrderedDict[str, str] = OrderedDict()
        self._matchers: OrderedDict[str, NativeMatcher] = OrderedDict()  # compiled, never advanced: copied per request
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def grammar(self, spec: StructuredOutput) -> str:
        """The validated grammar for ``spec``. Raises ValueError naming the problem (invalid schema, regex or
        grammar, or a feature llguidance cannot enforce)."""
        key = spec.key
        with self._lock:
            got = self._cache.get(key)
            if got is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return got
        try:
            grammar = spec.to_grammar()
        except ValueError as e:
            raise ValueError(_message(spec, str(e))) from None
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if is_error:
            raise ValueError(_message(spec, messages[0] if messages else "invalid"))
        with self._lock:
            self.misses += 1
            self._cache[key] = grammar
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return grammar

    @property
    def native(self) -> NativeTokenizer:
        """The tokenizer the matchers are made with (llguidance's C API: :mod:`engine.structured.native`)."""
        with self._lock:
            if self._native is None:
                src = self._source
                self._native = NativeTokenizer(src.to_json(), self.vocab_size, self.eos_token_id,
                                               lambda text: src.encode(text, add_special_tokens=False))
            return self._native

    def matcher(self, spec: StructuredOutput, replay: list[int] | None = None) -> NativeMatcher:
        """A fresh matcher for ``spec`` that has consumed ``replay`` (tokens generated before a migration): a copy
        of the spec's compiled matcher, kept beside its grammar (a copy costs ~3 µs where compiling again cost
        ~1.2 ms for the benchmark's schema). Made through llguidance's C API, so that the masks can be filled off
        the GIL; they equal the Python API's."""
        key = spec.key
        with self._lock:
            template = self._matchers.get(key)
            if template is not None:
                self._matchers.move_to_end(key)
                m = template.deep_copy()  # under the lock: recycle() may swap the template
        if template is None:
            template = self.native.matcher(self.grammar(spec))
            if template.is_error():
                raise ValueError(_message(spec, template.get_error()))
            with self._lock:
                self._matchers[key] = template
                if len(self._matchers) > self._cache_size:
                    self._matchers.popitem(last=False)
                m = template.deep_copy()
        if replay and not m.consume_tokens(replay):
            raise ValueError(_message(spec, f"the {len(replay)} replayed tokens do not match it: {m.get_error()}"))
        return m

    def recycle(self, spec: StructuredOutput, matcher: NativeMatcher) -> None:
        """A finished request's matcher, reset to the grammar's start, becomes its spec's template.

        Why: llguidance's lexer builds its automaton lazily, state by state, as the text it meets needs them, and
        its C API copies a matcher with that automaton copied, not shared (the Python API's copies share one). A
        copy of the compiled template starts cold and rebuilds, request after request, the states every earlier
        request of the schema already built: a JSON key's first characters can cost a row ~150 us cold against ~15
        us warm. A reset keeps the automaton, so copies of a recycled matcher start with everything the schema's
        earlier requests taught it. Masks do not change: the automaton is a cache. ``matcher`` must not be used by
        its request afterwards."""
        if matcher.is_error() or not matcher.reset():
            return
        with self._lock:
            if spec.key in self._matchers:
                self._matchers[spec.key] = matcher


def _message(spec: StructuredOutput, problem: str) -> str:
    what = {"json_object": "JSON object", "json_schema": "JSON schema", "regex": "regex", "choice": "choice",
            "grammar": "grammar"}[spec.kind]
    return f"invalid {what} constraint: {problem.strip()}"
