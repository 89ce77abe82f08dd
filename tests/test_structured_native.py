"""llguidance through its C API (``engine/structured/native.py``, ``llg_masks.c``): the masks equal the Python API's
bit for bit on random walks through every constraint kind, from fresh and from recycled templates; the native masks
thread, the inline fill and the compiler-less fallback give the same masks; a matcher in its error state gets an
EOS-only mask; the tokenizer cache answers like the tokenizer it fronts. Real llguidance, real tiny checkpoint."""

from __future__ import annotations

import ctypes
import json
import random
from collections.abc import Callable
from pathlib import Path

import llguidance as llg
import numpy as np
import pytest

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.structured import native
from engine.structured.compiler import GrammarCompiler
from engine.structured.native import MaskFiller, NativeMatcher, NativeTokenizer
from engine.structured.spec import StructuredOutput
from engine.tokenizer import Tokenizer

SCHEMA = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0}, "name": {"type": "string", "maxLength": 12},
    "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3}},
    "required": ["id", "name", "tags"], "additionalProperties": False}
SPECS = {
    "json_object": StructuredOutput("json_object"),
    "json_schema": StructuredOutput("json_schema", json.dumps(SCHEMA), strict=True),
    "regex": StructuredOutput("regex", r"[a-z]{2,5}-[0-9]{1,3}( [A-Z]+)?"),
    "choice": StructuredOutput("choice", json.dumps(["alpha", "beta gamma", "delta-7"])),
    "grammar": StructuredOutput("grammar", 'start: "(" item ("," item)* ")"\nitem: /[0-9]+/ | "x"'),
    "after_reasoning": StructuredOutput("regex", "[0-9]{4}", after_reasoning=True),
}


@pytest.fixture(scope="module")
def model(checkpoint: Callable[[str], Path]) -> Path:
    return checkpoint("llama")


@pytest.fixture(scope="module")
def grammars(model: Path) -> GrammarCompiler:
    tok = Tokenizer(model)
    return GrammarCompiler(tok, json.loads((model / "config.json").read_text())["vocab_size"], tok.eos_token_id)


def _allowed(words: np.ndarray, vocab: int) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little")[:vocab])


def _walk(grammars: GrammarCompiler, spec: StructuredOutput, seed: int, steps: int = 40) -> int:
    """One random walk with a native matcher and a Python-API matcher side by side; returns the steps taken."""
    words = (grammars.vocab_size + 31) // 32
    ours, ref = np.zeros(words, np.uint32), np.zeros(words, np.uint32)
    m = grammars.matcher(spec)
    py = llg.LLMatcher(grammars.tokenizer, grammars.grammar(spec), log_level=0)
    rng = random.Random(seed)
    for step in range(steps):
        assert m.is_stopped() == py.is_stopped() and m.is_accepting() == py.is_accepting(), step
        if m.is_stopped():
            return step
        assert m.compute_mask_into(ours.ctypes.data, words * 4)
        py.unsafe_compute_mask_ptr(ref.ctypes.data, words * 4)
        assert np.array_equal(ours, ref), (spec.kind, seed, step)
        allowed = _allowed(ours, grammars.vocab_size)
        token = int(allowed[rng.randrange(len(allowed))])
        assert m.consume_token(token) == py.consume_token(token), step
    return steps


@pytest.mark.parametrize("kind", list(SPECS))
def test_native_masks_equal_the_python_apis_on_random_walks(grammars: GrammarCompiler, kind: str) -> None:
    spec = SPECS[kind]
    taken = [_walk(grammars, spec, seed) for seed in range(4)]
    assert min(taken) >= 2 and sum(taken) >= 8  # every walk compared masks over several steps
    done = grammars.matcher(spec)  # a request that ran: recycled, its warm lexer becomes the template
    for token in grammars._source.encode({"json_object": '{"a":', "json_schema": '{"id":7,',
                                          "regex": "ab-1", "choice": "al", "grammar": "(1,",
                                          "after_reasoning": "<think>x</think>1"}[kind],
                                         add_special_tokens=False):
        done.consume_token(token)
    grammars.recycle(spec, done)
    assert grammars._matchers[spec.key] is done
    assert sum(_walk(grammars, spec, seed) for seed in range(4, 7)) >= 6  # copies of it start at the beginning


def test_a_matcher_in_its_error_state_is_not_recycled(grammars: GrammarCompiler) -> None:
    spec = SPECS["regex"]
    template = grammars._matchers.get(spec.key) or (grammars.matcher(spec) and grammars._matchers[spec.key])
    bad = grammars.matcher(spec)
    digit = grammars._source.encode("7", add_special_tokens=False)[0]
    assert not bad.consume_token(digit) and bad.is_error() and bad.is_stopped()
    assert bad.get_error()
    grammars.recycle(spec, bad)
    assert grammars._matchers[spec.key] is template


def test_threaded_inline_and_fallback_fills_give_the_same_masks_and_errors_allow_only_eos(
        grammars: GrammarCompiler, model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    words = (grammars.vocab_size + 31) // 32
    rng = random.Random(0)
    matchers: list[NativeMatcher] = []
    for i, spec in enumerate([SPECS["json_schema"], SPECS["regex"], SPECS["grammar"]] * 5):
        m = grammars.matcher(spec)
        buf = np.zeros(words, np.uint32)
        for _ in range(i % 6):  # rows in different states
            if m.is_stopped():
                break
            m.compute_mask_into(buf.ctypes.data, words * 4)
            allowed = _allowed(buf, grammars.vocab_size)
            m.consume_token(int(allowed[rng.randrange(len(allowed))]))
        matchers.append(m)
    bad = grammars.matcher(SPECS["regex"])
    bad.consume_token(grammars._source.encode("7", add_special_tokens=False)[0])
    matchers.append(bad)
    eos = grammars.eos_token_id

    def fill(how: str, filler: MaskFiller) -> tuple[np.ndarray, int]:
        out = np.full((len(matchers), words), 0xDEADBEEF, np.uint32)
        if how == "thread":
            filler.start(matchers, out.ctypes.data, words, eos)
            errors = filler.finish()
        else:
            errors = filler.fill(matchers, out.ctypes.data, words, eos)
        return out, errors

    filler = MaskFiller()
    inline, errors = fill("inline", filler)
    assert errors == 1
    assert _allowed(inline[-1], grammars.vocab_size).tolist() == [eos]
    for j, m in enumerate(matchers[:-1]):
        ref = np.zeros(words, np.uint32)
        assert m.compute_mask_into(ref.ctypes.data, words * 4) and np.array_equal(inline[j], ref)
    if filler.threaded:
        for _ in range(3):  # the worker reused, step after step
            threaded, errors = fill("thread", filler)
            assert errors == 1 and np.array_equal(threaded, inline)
    filler.close()
    monkeypatch.setattr(native, "masks_lib", lambda: None)  # no C compiler: ctypes calls per row
    plain = MaskFiller()
    assert not plain.threaded
    fallback, errors = fill("inline", plain)
    assert errors == 1 and np.array_equal(fallback, inline)
    tok = Tokenizer(model)  # and a tokenizer whose tokenize function is Python's own, uncached
    uncached = NativeTokenizer(tok.to_json(), grammars.vocab_size, eos,
                               lambda text: tok.encode(text, add_special_tokens=False))
    assert uncached.cache_stats() == {"hits": 0, "misses": 0, "entries": 0}
    a, b = uncached.matcher(grammars.grammar(SPECS["json_schema"])), grammars.matcher(SPECS["json_schema"])
    x, y = np.zeros(words, np.uint32), np.zeros(words, np.uint32)
    for token in tok.encode('{"id":12,"name":"', add_special_tokens=False):
        assert a.compute_mask_into(x.ctypes.data, words * 4) and b.compute_mask_into(y.ctypes.data, words * 4)
        assert np.array_equal(x, y) and a.consume_token(token) and b.consume_token(token)


def test_the_tokenizer_cache_answers_as_the_tokenizer_and_asks_it_once_per_text() -> None:
    lib = native.masks_lib()
    if lib is None:
        pytest.skip("no C compiler, or native kernels disabled")
    calls: list[bytes] = []

    def slow(_data: object, data: object, length: int, out: object, cap: int) -> int:
        text = ctypes.string_at(data, length)  # type: ignore[arg-type]
        calls.append(text)
        if text == b"fail":
            return 0  # what the engine's callback answers when the tokenizer raised
        ids = list(text) * 3  # 3 tokens a byte: more than the cache's first buffer for long texts
        for i, t in enumerate(ids[:cap]):
            out[i] = t  # type: ignore[index]
        return len(ids)

    callback = native._TOKENIZE(slow)
    cache = lib.tandem_tokcache_new(native._address(callback), None, 4)  # 16 slots: cleared before a 9th entry
    fn = ctypes.CFUNCTYPE(ctypes.c_size_t, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t,
                          ctypes.POINTER(ctypes.c_uint32), ctypes.c_size_t)(native._address(lib.tandem_tokenize_cached))
    try:
        texts = [b"ab", b"ab", b"", b"x" * 40, b"x" * 40, b"ab"] + [bytes([65 + i]) for i in range(12)] + [b"ab"]
        for text in texts:
            out = (ctypes.c_uint32 * 200)()
            n = fn(cache, text, len(text), out, 200)
            assert n == 3 * len(text) and list(out[:n]) == list(text) * 3
            short = (ctypes.c_uint32 * 2)()
            assert fn(cache, text, len(text), short, 2) == n  # a short buffer gets the count and a prefix
            assert list(short[:min(n, 2)]) == (list(text) * 3)[:2]
        assert calls.count(b"ab") == 2 and calls.count(b"x" * 40) == 1  # "ab" again only after the clearing
        for _ in range(2):  # a failed answer is not cached
            assert fn(cache, b"fail", 4, (ctypes.c_uint32 * 4)(), 4) == 0
        assert calls.count(b"fail") == 2
        h, m, e = ctypes.c_uint64(), ctypes.c_uint64(), ctypes.c_uint64()
        lib.tandem_tokcache_stats(cache, ctypes.byref(h), ctypes.byref(m), ctypes.byref(e))
        assert m.value == len(calls) and h.value + m.value == 2 * len(texts) + 2 and 0 < e.value <= 8
    finally:
        lib.tandem_tokcache_free(cache)


def test_the_engine_recycles_a_finished_requests_matcher_and_keeps_its_output(checkpoint: Callable[[str], Path]
                                                                             ) -> None:
    llm = LLM(str(checkpoint("llama")))
    spec = SPECS["json_schema"]
    prompt = llm.tokenizer.encode("Inventory:")
    params = SamplingParams(max_tokens=40, temperature=0.8, seed=3, structured=spec)
    first = llm.generate([prompt], [params])[0]
    template = llm.engine.grammars._matchers[spec.key]
    second = llm.generate([prompt], [params])[0]  # copied from the recycled (warm) template
    assert first.token_ids == second.token_ids
    assert llm.engine.grammars._matchers[spec.key] is not template  # the second request's matcher, recycled
    if first.finish_reason == "stop":
        assert isinstance(json.loads(llm.tokenizer.decode(first.token_ids)), dict)
    llm.engine.check_block_accounting()
