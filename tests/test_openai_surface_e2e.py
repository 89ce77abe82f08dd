"""The OpenAI surface end to end, through the official ``openai`` client: a real router (in-process, its own loop
on a thread, HTTP on loopback) over a real prefill and a real decode worker process (``--kv-backend tcp``).

Short prompts run colocated on the decode worker; prompts of 64 tokens and more run disaggregated, so prompt
logprobs are checked on both paths. Greedy output is compared with transformers, token for token, and logprobs with
transformers' log-softmax.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from gateway_harness import RouterThread

from engine.tokenizer import Tokenizer
from router.server import RouterConfig
from worker.launcher import WorkerProcess, start_worker

pytestmark = pytest.mark.slow
FLAGS = ["--num-kv-blocks", "256", "--threads", "1"]
SERVED = "tiny-surface"


@pytest.fixture(scope="module")
def served(checkpoint: Callable[[str], Path]) -> Iterator[tuple[RouterThread, Path]]:
    path = checkpoint("llama")
    workers: list[WorkerProcess] = []
    rt = None
    try:
        workers.append(start_worker("prefill", str(path), "tcp", [*FLAGS, "--worker-id", "pre-0"]))
        workers.append(start_worker("decode", str(path), "tcp", [*FLAGS, "--worker-id", "dec-0"]))
        rt = RouterThread(RouterConfig(model=str(path), workers=tuple(w.address for w in workers),
                                       served_model_name=SERVED))
        yield rt, path
    finally:
        if rt is not None:
            rt.stop()
        for w in workers:
            w.stop()


@pytest.fixture(scope="module")
def client(served: tuple[RouterThread, Path]) -> openai.OpenAI:
    return openai.OpenAI(base_url=served[0].url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def hf(served: tuple[RouterThread, Path]) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(served[1], dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tok(served: tuple[RouterThread, Path]) -> Tokenizer:
    return Tokenizer(served[1])


def _greedy(hf: Any, ids: list[int], n: int, **kw: Any) -> list[int]:
    t = torch.tensor([ids])
    with torch.inference_mode():
        out = hf.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                          eos_token_id=None, pad_token_id=0, **kw)
    return out[0, len(ids):].tolist()


def _prompt_logp(hf: Any, ids: list[int]) -> list[float]:
    """transformers' logprob of each prompt token after the first."""
    with torch.inference_mode():
        logp = torch.log_softmax(hf(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)
    return logp.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1).tolist()


def _ids(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text)


def test_a_list_of_prompts_is_answered_as_choices_indexed_prompt_times_n(
        client: openai.OpenAI, tok: Tokenizer, hf: Any) -> None:
    prompts: list[Any] = ["Hello, Tandem", "The quick brown fox", [5, 17, 42, 99, 3]]
    r = client.completions.create(model=SERVED, prompt=prompts, n=2, max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == list(range(6))
    by_index = {c.index: c.text for c in r.choices}
    for p, prompt in enumerate(prompts):
        ids = prompt if isinstance(prompt, list) else _ids(tok, prompt)
        want = tok.decode(_greedy(hf, ids, 5))
        assert by_index[2 * p] == by_index[2 * p + 1] == want
    assert r.usage is not None
    assert r.usage.prompt_tokens == sum(len(p if isinstance(p, list) else _ids(tok, p)) for p in prompts)
    assert r.usage.completion_tokens == 30


@pytest.mark.parametrize("length", [0, 80])  # colocated; disaggregated (prefill picks the first token)
def test_logit_bias_changes_the_greedy_answer_as_transformers_sequence_bias_does(
        client: openai.OpenAI, tok: Tokenizer, hf: Any, length: int) -> None:
    ids = [(i * 31 + 5) % 400 + 3 for i in range(length)] + _ids(tok, "Hello, Tandem")
    plain = _greedy(hf, ids, 6)
    bias = {plain[0]: -100, plain[1]: -100}
    r = client.completions.create(model=SERVED, prompt=ids, max_tokens=6, temperature=0,
                                  logit_bias={str(t): b for t, b in bias.items()},
                                  extra_body={"ignore_eos": True})
    want = _greedy(hf, ids, 6, sequence_bias={(t,): float(b) for t, b in bias.items()})
    assert r.choices[0].text == tok.decode(want) and plain[0] not in want


def test_echo_with_logprobs_returns_the_prompt_tokens_first_scored_by_the_prefill(
        client: openai.OpenAI, tok: Tokenizer, hf: Any) -> None:
    text = "The quick brown fox jumps"
    ids = _ids(tok, text)
    r = client.completions.create(model=SERVED, prompt=text, max_tokens=3, temperature=0, echo=True, logprobs=1,
                                  extra_body={"ignore_eos": True})
    c = r.choices[0]
    assert c.text.startswith(text) and c.logprobs is not None
    lp = c.logprobs
    assert lp.token_logprobs is not None and lp.top_logprobs is not None and lp.text_offset is not None
    assert len(lp.token_logprobs) == len(ids) + 3 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:len(ids)] == pytest.approx(_prompt_logp(hf, ids), abs=1e-4)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


@pytest.mark.parametrize("length", [12, 80])  # colocated, disaggregated
def test_prompt_logprobs_match_transformers_on_both_paths(served: tuple[RouterThread, Path], tok: Tokenizer,
                                                          hf: Any, length: int) -> None:
    ids = [(i * 53 + 7) % 400 + 3 for i in range(length)]
    r = httpx.post(served[0].url + "/v1/completions", timeout=120, json={
        "model": SERVED, "prompt": ids, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 2})
    assert r.status_code == 200, r.text
    plp = r.json()["choices"][0]["prompt_logprobs"]
    assert len(plp) == length and plp[0] is None
    got = [entry[str(t)]["logprob"] for entry, t in zip(plp[1:], ids[1:], strict=True)]
    assert got == pytest.approx(_prompt_logp(hf, ids), abs=1e-4)
    assert all(len(entry) >= 2 for entry in plp[1:])  # the prompt token and its top-2 (merged where equal)


def test_a_streamed_answer_has_running_text_offsets_and_the_sampled_token_in_top_logprobs(
        client: openai.OpenAI, tok: Tokenizer) -> None:
    stream = client.completions.create(model=SERVED, prompt="Hello, Tandem", max_tokens=8, temperature=0.8,
                                       seed=3, logprobs=1, stream=True, extra_body={"ignore_eos": True})
    tokens: list[str] = []
    offsets: list[int] = []
    for chunk in stream:
        for c in chunk.choices:
            if c.logprobs is None:
                continue
            for t, top in zip(c.logprobs.tokens or [], c.logprobs.top_logprobs or [], strict=True):
                assert t in top  # the sampled token, whatever its rank
            tokens += c.logprobs.tokens or []
            offsets += c.logprobs.text_offset or []
    assert len(tokens) == 8
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(8)]


def test_best_of_returns_the_candidate_with_the_highest_cumulative_logprob(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = {"model": SERVED, "prompt": "Once upon", "max_tokens": 6, "temperature": 1.0, "seed": 11,
                          "extra_body": {"ignore_eos": True}}
    every = client.completions.create(n=3, logprobs=0, **kw)
    score = {c.index: sum(c.logprobs.token_logprobs or []) for c in every.choices if c.logprobs is not None}
    best = max(score, key=lambda i: (score[i], -i))
    r = client.completions.create(n=1, best_of=3, **kw)
    assert len(r.choices) == 1 and r.choices[0].index == 0
    assert r.choices[0].text == next(c.text for c in every.choices if c.index == best)
    assert r.choices[0].logprobs is None


def test_include_stop_str_in_output_keeps_the_stop_string(client: openai.OpenAI, tok: Tokenizer,
                                                         hf: Any) -> None:
    ids = _ids(tok, "Hello, Tandem")
    full = tok.decode(_greedy(hf, ids, 12))
    stop = full[3:6] if len(full) >= 6 else full[-2:]
    kw: dict[str, Any] = {"model": SERVED, "prompt": ids, "max_tokens": 12, "temperature": 0, "stop": [stop]}
    cut = client.completions.create(**kw).choices[0]
    kept = client.completions.create(**kw, extra_body={"include_stop_str_in_output": True}).choices[0]
    assert cut.finish_reason == kept.finish_reason == "stop"
    assert kept.text == cut.text + stop and not cut.text.endswith(stop)


@pytest.mark.parametrize(("field", "value"), [
    ("tools", [{"type": "function", "function": {"name": 3}}]),
    ("tool_choice", "required"), ("response_format", {"type": "json_schema", "json_schema": {"schema": 3}})])
def test_chat_refuses_what_it_cannot_honour_naming_the_field(client: openai.OpenAI, field: str, value: Any) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       extra_body={field: value})
    assert isinstance(e.value.body, dict) and e.value.body.get("param") == field


def test_completions_refuse_suffix(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=SERVED, prompt="def f(", suffix="return 1", max_tokens=2)
    assert isinstance(e.value.body, dict) and e.value.body.get("param") == "suffix"


def test_tokenize_detokenize_version_and_the_model_by_id(served: tuple[RouterThread, Path], tok: Tokenizer,
                                                        client: openai.OpenAI) -> None:
    url = served[0].url
    t = httpx.post(url + "/tokenize", json={"model": SERVED, "prompt": "Hello, Tandem"}, timeout=30).json()
    assert t["tokens"] == tok.encode("Hello, Tandem") and t["count"] == len(t["tokens"])
    d = httpx.post(url + "/detokenize", json={"model": SERVED, "tokens": t["tokens"]}, timeout=30).json()
    assert d == {"prompt": "Hello, Tandem"}
    assert isinstance(httpx.get(url + "/version", timeout=30).json()["version"], str)
    assert client.models.retrieve(SERVED).id == SERVED
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_a_streamed_echo_sends_the_prompt_first_and_offsets_run_on_from_it(client: openai.OpenAI,
                                                                          tok: Tokenizer) -> None:
    text = "Once upon a time"
    ids = _ids(tok, text)
    chunks = list(client.completions.create(model=SERVED, prompt=text, max_tokens=4, temperature=0, echo=True,
                                            logprobs=0, stream=True, extra_body={"ignore_eos": True}))
    pieces = [c.choices[0] for c in chunks if c.choices]
    assert pieces[0].text.startswith(text)
    tokens: list[str] = []
    offsets: list[int] = []
    values: list[float | None] = []
    for p in pieces:
        if p.logprobs is not None:
            tokens += p.logprobs.tokens or []
            offsets += p.logprobs.text_offset or []
            values += p.logprobs.token_logprobs or []
    assert len(tokens) == len(ids) + 4 and values[0] is None and all(v is not None for v in values[1:])
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
