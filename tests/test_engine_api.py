"""Tests for the offline API (:class:`engine.llm.LLM`, :class:`engine.llm_engine.LLMEngine`) and ``tandem generate``.

All run the tiny llama checkpoint on CPU with a 64-block KV cache (block_size 16).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.llm import LLM, CompletionOutput
from engine.llm_engine import PromptTooLongError
from engine.sampling_params import SamplingParams

PROMPTS = ["The server runs the model.", "def forward(self, x):", "héllo 世界 🙂"]
REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model_dir(checkpoint: Callable[[str], Path]) -> Path:
    """The tiny llama checkpoint directory."""
    return checkpoint("llama")


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> LLM:
    """One engine over the tiny llama checkpoint, shared by this module."""
    return LLM(str(model_dir), num_kv_blocks=64, num_threads=1)


@pytest.fixture(autouse=True)
def _blocks_clean_after_each_test(request: pytest.FixtureRequest) -> Iterator[None]:
    """After every test that used the shared engine, nothing is live and every block is back."""
    yield
    if "llm" in request.fixturenames:
        request.getfixturevalue("llm").engine.check_block_accounting()


def _greedy(max_tokens: int = 16, **kwargs: Any) -> SamplingParams:
    """Greedy params that ignore eos, so the length of the output is known."""
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kwargs)


def _baseline(llm: LLM, prompt: str, max_tokens: int = 16) -> CompletionOutput:
    """Greedy output with no stop condition but max_tokens."""
    return llm.generate([prompt], _greedy(max_tokens))[0]


def test_generate_returns_text_equal_to_decoding_its_tokens(llm: LLM) -> None:
    """For text prompts, each output's text is the tokenizer's decode of its token ids, in prompt order."""
    outs = llm.generate(PROMPTS, _greedy(12))
    assert len(outs) == len(PROMPTS)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.prompt_token_ids == llm.tokenizer.encode(prompt)
        assert len(out.token_ids) == 12
        assert out.text == llm.tokenizer.decode(out.token_ids)
        assert out.finish_reason == "length"


def test_token_id_prompts_match_text_prompts(llm: LLM) -> None:
    """A prompt given as token ids generates exactly what its text form generates."""
    text_out = _baseline(llm, PROMPTS[0], 8)
    ids_out = llm.generate([llm.tokenizer.encode(PROMPTS[0])], _greedy(8))[0]
    assert ids_out.token_ids == text_out.token_ids


def test_batched_greedy_generation_matches_one_at_a_time(llm: LLM) -> None:
    """Greedy tokens do not depend on what else is in the batch."""
    together = llm.generate(PROMPTS, _greedy(10))
    alone = [_baseline(llm, p, 10) for p in PROMPTS]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]


def test_repeated_prompt_hits_the_prefix_cache_with_the_same_tokens(llm: LLM) -> None:
    """Running a 40-token prompt twice reuses its cached full blocks and gives identical tokens."""
    prompt = " ".join(["cache"] * 40)
    first = llm.generate([prompt], _greedy(6))[0]
    second = llm.generate([prompt], _greedy(6))[0]
    assert second.token_ids == first.token_ids
    assert second.num_cached_tokens >= 16
    assert second.num_cached_tokens % 16 == 0


def test_max_tokens_ends_generation_with_length(llm: LLM) -> None:
    """Generation stops after exactly max_tokens with finish_reason 'length' and no stop_reason."""
    out = llm.generate([PROMPTS[1]], _greedy(5))[0]
    assert len(out.token_ids) == 5
    assert out.finish_reason == "length"
    assert out.stop_reason is None


def _stop_string(text: str) -> tuple[int, str]:
    """A 3-character substring of ``text`` first occurring at its position (>= 5), free of U+FFFD."""
    for k in range(5, len(text) - 8):
        s = text[k : k + 3]
        if "\ufffd" not in s and text.find(s) == k:
            return k, s
    raise AssertionError(f"no usable stop string in {text!r}")


def test_stop_string_ends_generation_with_stop_reason(llm: LLM) -> None:
    """A stop string seen in the output ends generation; the text stops just before it."""
    base = _baseline(llm, PROMPTS[0], 24)
    k, stop = _stop_string(base.text)
    out = llm.generate([PROMPTS[0]], _greedy(24, stop=(stop,)))[0]
    assert out.finish_reason == "stop"
    assert out.stop_reason == stop
    assert out.text == base.text[:k]
    assert out.token_ids == base.token_ids[: len(out.token_ids)]
    assert len(out.token_ids) < len(base.token_ids)


def test_stop_string_is_included_with_include_stop_str_in_output(llm: LLM) -> None:
    """include_stop_str_in_output keeps the stop string at the end of the text."""
    base = _baseline(llm, PROMPTS[0], 24)
    k, stop = _stop_string(base.text)
    out = llm.generate([PROMPTS[0]], _greedy(24, stop=(stop,), include_stop_str_in_output=True))[0]
    assert out.text == base.text[: k + len(stop)]
    assert out.finish_reason == "stop"


def test_stop_token_id_ends_generation_with_that_id_as_stop_reason(llm: LLM) -> None:
    """A token in stop_token_ids ends generation on it, with finish_reason 'stop' and stop_reason the id."""
    base = _baseline(llm, PROMPTS[2], 16)
    pos = next(i for i in range(3, 16) if base.token_ids.index(base.token_ids[i]) == i)
    stop_id = base.token_ids[pos]
    out = llm.generate([PROMPTS[2]], _greedy(16, stop_token_ids=(stop_id,)))[0]
    assert out.token_ids == base.token_ids[: pos + 1]
    assert out.finish_reason == "stop"
    assert out.stop_reason == stop_id


def test_min_tokens_defers_a_stop_token(llm: LLM) -> None:
    """A stop token generated before min_tokens does not end generation."""
    base = _baseline(llm, PROMPTS[2], 16)
    stop_id = base.token_ids[1]
    out = llm.generate([PROMPTS[2]], _greedy(16, stop_token_ids=(stop_id,), min_tokens=8))[0]
    assert len(out.token_ids) >= 8
    assert out.token_ids == base.token_ids[: len(out.token_ids)]


def test_stop_string_before_min_tokens_does_not_garble_the_text(llm: LLM) -> None:
    """When min_tokens defers a stop string, the returned text is still a prefix of decode(token_ids)."""
    base = _baseline(llm, PROMPTS[0], 24)
    _, stop = _stop_string(base.text)
    n_before = next(n for n in range(1, 25) if stop in llm.tokenizer.decode(base.token_ids[:n]))
    out = llm.generate([PROMPTS[0]], _greedy(24, stop=(stop,), min_tokens=n_before + 4))[0]
    assert len(out.token_ids) >= n_before + 4
    assert llm.tokenizer.decode(out.token_ids).startswith(out.text)


def test_prompt_too_long_for_max_model_len_raises(model_dir: Path) -> None:
    """A 64-token prompt with max_model_len=64 raises PromptTooLongError; 63 tokens generate one token."""
    small = LLM(str(model_dir), num_kv_blocks=64, max_model_len=64, num_threads=1)
    with pytest.raises(PromptTooLongError, match="64 tokens"):
        small.generate([list(range(10, 74))], _greedy(4))
    out = small.generate([list(range(10, 73))], _greedy(4))[0]
    assert len(out.token_ids) == 1
    assert out.finish_reason == "length"
    small.engine.check_block_accounting()


@pytest.mark.parametrize("bad", [[5, 2048], [-1, 5], [100_000]])
def test_out_of_range_prompt_token_ids_raise(llm: LLM, bad: list[int]) -> None:
    """Token ids outside [0, vocab_size) raise ValueError naming the range."""
    with pytest.raises(ValueError, match=r"out of range \[0, 2048\)"):
        llm.generate([bad], _greedy(2))


def test_empty_prompt_raises(llm: LLM) -> None:
    """An empty token-id prompt raises ValueError."""
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], _greedy(2))


def test_mismatched_params_list_raises(llm: LLM) -> None:
    """A params list whose length differs from the prompts raises ValueError."""
    with pytest.raises(ValueError, match="2 prompts but 1 sampling params"):
        llm.generate(PROMPTS[:2], [_greedy(2)])


def test_abort_mid_generation_leaves_block_accounting_clean(llm: LLM) -> None:
    """Aborting some requests mid-decode returns 'abort' outputs; the rest finish and every block comes back."""
    eng = llm.engine
    ids = [eng.add_request(p, _greedy(40)) for p in PROMPTS]
    for _ in range(3):
        eng.step()
    assert eng.pool.num_used_blocks > 0
    aborted = eng.abort(ids[:2])
    assert [o.request_id for o in aborted] == ids[:2]
    assert all(o.finished and o.finish_reason == "abort" for o in aborted)
    assert eng.abort(ids[:2]) == []
    finished = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                finished[out.request_id] = out
    assert list(finished) == [ids[2]]
    assert len(finished[ids[2]].token_ids) == 40
    eng.check_block_accounting()


def test_abort_of_every_request_before_and_after_scheduling_is_clean(llm: LLM) -> None:
    """Aborting requests that are waiting and running at once frees everything."""
    eng = llm.engine
    running = eng.add_request(PROMPTS[0], _greedy(20))
    eng.step()
    waiting = eng.add_request(PROMPTS[1], _greedy(20))
    assert len(eng.abort([running, waiting])) == 2
    assert not eng.has_unfinished()
    eng.check_block_accounting()


def test_seeded_sampling_gives_the_same_tokens_in_different_batches(llm: LLM) -> None:
    """A seeded request samples the same tokens alone and amid other seeded, unseeded and greedy requests."""
    mine = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True)
    alone = llm.generate([PROMPTS[0]], mine)[0]
    others = [SamplingParams(max_tokens=7, temperature=0.0), mine,
              SamplingParams(max_tokens=12, temperature=0.8, seed=7), SamplingParams(max_tokens=3)]
    batch = llm.generate([PROMPTS[1], PROMPTS[0], PROMPTS[0], PROMPTS[2]], others)
    assert batch[1].token_ids == alone.token_ids
    other_seed = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=12, seed=4321, ignore_eos=True))[0]
    assert other_seed.token_ids != alone.token_ids


def test_logprobs_return_n_sorted_alternatives_per_token(llm: LLM) -> None:
    """logprobs=3 gives, for every generated token, its logprob and 3 alternatives sorted by logprob."""
    out = llm.generate([PROMPTS[0]], _greedy(6, logprobs=3))[0]
    assert len(out.logprobs) == len(out.token_ids) == 6
    for token, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert lp.token_id == token
        assert len(lp.top) == 3
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
        assert lp.top[0][0] == token  # greedy picks the most likely token
        assert lp.logprob == pytest.approx(lp.top[0][1])
        assert lp.logprob <= 0.0


def test_no_logprobs_requested_gives_none(llm: LLM) -> None:
    """Without logprobs in the params, the output carries no logprobs."""
    assert llm.generate([PROMPTS[0]], _greedy(3))[0].logprobs == []


def test_request_larger_than_the_kv_cache_finishes_instead_of_stalling(model_dir: Path) -> None:
    """With 2 blocks of 16 tokens, a long ignore_eos request ends with 'length' rather than livelocking."""
    small = LLM(str(model_dir), num_kv_blocks=2, block_size=16, num_threads=1)
    eng = small.engine
    rid = eng.add_request(PROMPTS[0], _greedy(100))
    final = None
    for _ in range(80):  # bounded: the bug makes step() return [] forever
        for out in eng.step():
            if out.finished:
                final = out
        if not eng.has_unfinished():
            break
    eng.abort([rid])
    assert final is not None
    assert final.finish_reason == "length"


# ---- CLI -------------------------------------------------------------------------------------------------------


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    """Run ``python -m cli.main`` from the repository root."""
    return subprocess.run([sys.executable, "-m", "cli.main", *args], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=120)


def test_cli_generate_json_prints_one_object_per_prompt(model_dir: Path) -> None:
    """`generate --json` prints one JSON object per prompt with ids, text and finish reason."""
    proc = _cli("generate", "--model", str(model_dir), "--prompt", "hi", "--prompt", "the cat", "--max-tokens", "4",
                "--ignore-eos", "--json", "--num-kv-blocks", "16", "--threads", "1")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 2
    for line in lines:
        obj = json.loads(line)
        assert {"prompt_token_ids", "token_ids", "text", "finish_reason"} <= set(obj)
        assert len(obj["token_ids"]) == 4
        assert obj["finish_reason"] == "length"
        assert isinstance(obj["text"], str)
    assert json.loads(lines[0])["prompt_token_ids"][0] == 2044  # bos


def test_cli_prompt_longer_than_max_model_len_exits_2(model_dir: Path) -> None:
    """A prompt longer than --max-model-len exits with code 2 and an 'error:' line naming the context limit."""
    proc = _cli("generate", "--model", str(model_dir), "--prompt", "a long prompt " * 10, "--max-tokens", "4",
                "--max-model-len", "8", "--num-kv-blocks", "16", "--threads", "1")
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.startswith("error: prompt has")
    assert "context is 8 tokens" in proc.stderr
    assert "Traceback" not in proc.stderr
