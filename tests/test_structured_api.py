"""Structured outputs through the router, over real worker processes: the official ``openai`` client gets outputs
that parse and validate, identical on the colocated path, the disaggregated path (tcp and nixl: prefill masks the
first token, decode advances its matcher with it), after a decode worker is SIGKILLed mid-output (the new worker
replays the generated tokens into a fresh matcher) and on a prefix-cache hit; every bad spec is a 400 naming the
problem, answered by the router before any worker is reached.

The router runs in-process (its own event loop on a thread, HTTP on loopback); workers are ``tandem worker``
processes stopped by PID. The reference is the offline engine on the same checkpoint (itself checked token for
token against transformers in tests/test_structured_engine.py).
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import jsonschema
import openai
import pytest
from gateway_harness import RouterThread, routed_worker, wait_idle

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.structured.spec import StructuredOutput
from proto.tandem.v1 import worker_pb2 as pb
from proto.tandem.v1 import worker_pb2_grpc as pb_grpc
from router.server import RouterConfig
from worker.launcher import WorkerProcess, start_worker

pytestmark = pytest.mark.slow
FLAGS = ["--num-kv-blocks", "512", "--threads", "1"]
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
    "required": ["name", "n", "tags"], "additionalProperties": False}
LONG = 'root ::= "(" num ("+" num){0,200} ")"\nnum ::= [0-9]'  # greedy on the tiny model runs long


@pytest.fixture(scope="module")
def model(checkpoint: Callable[[str], Path]) -> Path:
    return checkpoint("llama")


@pytest.fixture(scope="module")
def offline(model: Path) -> LLM:
    return LLM(str(model))


def _reference(llm: LLM, prompt: list[int], spec: StructuredOutput, max_tokens: int) -> str:
    return llm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0, structured=spec))[0].text


def _long_prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2000) for _ in range(160)]  # past min_uncached_tokens: disaggregated when it can be


@pytest.fixture(scope="module")
def colocated(model: Path) -> Iterator[tuple[RouterThread, list[WorkerProcess]]]:
    workers = [start_worker("decode", str(model), "tcp", [*FLAGS, "--worker-id", f"so-{i}"]) for i in range(2)]
    rt = RouterThread(RouterConfig(model=str(model), workers=tuple(w.address for w in workers)))
    yield rt, workers
    rt.stop()
    for w in workers:
        w.stop()


def _client(rt: RouterThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=rt.url + "/v1", api_key="none", max_retries=0, timeout=120)


def test_openai_client_gets_schema_valid_json_equal_to_the_offline_engine(colocated: Any, model: Path,
                                                                          offline: LLM) -> None:
    rt, _ = colocated
    client = _client(rt)
    messages: list[Any] = [{"role": "user", "content": "Describe a thing as JSON."}]
    rf: Any = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}
    out = client.chat.completions.create(model=model.name, messages=messages, temperature=0, response_format=rf,
                                         max_tokens=64)
    choice = out.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.message.content is not None
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    prompt = offline.tokenizer.encode_chat(messages)
    spec = StructuredOutput("json_schema", json.dumps(SCHEMA, sort_keys=True), strict=True)
    assert choice.message.content == _reference(offline, prompt, spec, 64)
    # The router learns of the cached prompt from the worker's KV events, asynchronously: until it has, a repeat
    # may go to the other worker and miss. Repeat (bounded) until one is a hit; every answer must be the same.
    cached = 0
    for _ in range(10):
        again = client.chat.completions.create(model=model.name, messages=messages, temperature=0,
                                               response_format=rf, max_tokens=64)
        assert again.choices[0].message.content == choice.message.content  # a prefix-cache hit changes nothing
        assert again.usage is not None and again.usage.prompt_tokens_details is not None
        cached = again.usage.prompt_tokens_details.cached_tokens or 0
        if cached > 0:
            break
        time.sleep(0.2)
    assert cached > 0


@pytest.mark.parametrize(("field", "value", "spec"), [
    ("guided_regex", r"[0-9]{3}-[a-z]{2,4}", StructuredOutput("regex", r"[0-9]{3}-[a-z]{2,4}")),
    ("guided_choice", ["yes", "no", "maybe later"], StructuredOutput("choice", '["yes", "no", "maybe later"]')),
    ("structured_outputs", {"grammar": 'root ::= "(" num ("+" num){0,5} ")"\nnum ::= [0-9]'},
     StructuredOutput("grammar", 'root ::= "(" num ("+" num){0,5} ")"\nnum ::= [0-9]')),
    ("response_format", {"type": "json_object"}, StructuredOutput("json_object")),
])
def test_each_constraint_kind_streams_and_answers_the_offline_engine_output(colocated: Any, model: Path,
                                                                           offline: LLM, field: str, value: Any,
                                                                           spec: StructuredOutput) -> None:
    rt, _ = colocated
    client = _client(rt)
    prompt = offline.tokenizer.encode("Answer:")
    want = _reference(offline, prompt, spec, 24)
    whole = client.completions.create(model=model.name, prompt=prompt, max_tokens=24, temperature=0,
                                      extra_body={field: value})
    assert whole.choices[0].text == want
    stream = client.completions.create(model=model.name, prompt=prompt, max_tokens=24, temperature=0, stream=True,
                                       extra_body={field: value})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert whole.choices[0].finish_reason == [c for c in chunks if c.choices][-1].choices[0].finish_reason


def test_constrained_streams_cut_off_by_their_clients_leave_the_others_exact_and_free_every_block(
        colocated: Any, model: Path, offline: LLM) -> None:
    """24 constrained streams at once (JSON schema, regex, grammar; seeded sampling), half of them closed by their
    clients after the first chunk, while the masks thread fills masks for the batch: the other half answer exactly
    the offline engine's text for the same seed, the workers live on, and no KV block or request is left."""
    rt, workers = colocated
    kinds = [("response_format", {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}},
              StructuredOutput("json_schema", json.dumps(SCHEMA, sort_keys=True))),  # as the router writes it
             ("guided_regex", "[a-z]{3,8}-[0-9]{2,5}", StructuredOutput("regex", "[a-z]{3,8}-[0-9]{2,5}")),
             ("guided_grammar", LONG, StructuredOutput("grammar", LONG))]
    prompt = offline.tokenizer.encode("Record:")
    results: dict[int, str] = {}
    errors: list[BaseException] = []

    def one(i: int) -> None:
        field, value, _ = kinds[i % 3]
        try:
            stream = _client(rt).completions.create(
                model=model.name, prompt=prompt, max_tokens=32, temperature=0.9, seed=i, stream=True,
                extra_body={field: value})
            if i % 2:  # this client goes away after its first chunk
                next(iter(stream))
                stream.close()
                return
            results[i] = "".join(c.choices[0].text for c in stream if c.choices)
        except BaseException as e:  # reported below, with the request
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(24)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not errors, errors[:3]
    assert sorted(results) == list(range(0, 24, 2))
    for i, text in results.items():
        spec = kinds[i % 3][2]
        want = offline.generate([prompt], SamplingParams(max_tokens=32, temperature=0.9, seed=i, structured=spec)
                                )[0].text
        assert text == want, (i, spec.kind)
    assert all(w.proc.poll() is None for w in workers)
    loads = wait_idle(workers)
    assert all(ld.used_blocks == 0 and ld.running == 0 for ld in loads), loads


@pytest.mark.parametrize(("body", "param", "problem"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "foo"}}}}, "response_format",
     "foo"),
    ({"response_format": {"type": "json_schema", "json_schema": {"strict": True, "schema": {
        "type": "string", "format": "uri-reference"}}}}, "response_format", "uri-reference"),
    ({"response_format": {"type": "xml"}}, "response_format", "xml"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_regex": "(abc"}, "guided_regex", "unclosed group"),
    ({"guided_choice": []}, "guided_choice", "non-empty list"),
    ({"guided_grammar": "root ::= missing_rule"}, "guided_grammar", "missing_rule"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "only one"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex", "only one"),
])
def test_bad_constraints_get_a_400_naming_the_problem_before_any_worker(colocated: Any, model: Path,
                                                                        body: dict[str, Any], param: str,
                                                                        problem: str) -> None:
    rt, workers = colocated
    before = [_requests_seen(w) for w in workers]
    with pytest.raises(openai.BadRequestError) as e:
        _client(rt).completions.create(model=model.name, prompt="x", max_tokens=4, extra_body=body)
    err = e.value.body
    assert isinstance(err, dict) and err.get("param") == param and problem in str(err.get("message")), err
    assert [_requests_seen(w) for w in workers] == before


def _requests_seen(w: WorkerProcess) -> int:
    with grpc.insecure_channel(w.address) as ch:
        return int(pb_grpc.WorkerStub(ch).Load(pb.LoadRequest(), timeout=10).generated_tokens)


@pytest.mark.parametrize("backend", ["tcp", "nixl"])
def test_disaggregated_output_equals_the_offline_engine(backend: str, model: Path, offline: LLM) -> None:
    dec = start_worker("decode", str(model), backend, [*FLAGS, "--worker-id", f"sod-{backend}"])
    pre = start_worker("prefill", str(model), backend, [*FLAGS, "--worker-id", f"sop-{backend}"])
    rt = RouterThread(RouterConfig(model=str(model), workers=(dec.address, pre.address)))
    try:
        client = _client(rt)
        prompt = _long_prompt(1)
        spec = StructuredOutput("json_schema", json.dumps(SCHEMA, sort_keys=True), strict=True)
        raw = client.completions.with_raw_response.create(
            model=model.name, prompt=prompt, max_tokens=64, temperature=0, extra_headers={"x-tandem-explain": "1"},
            extra_body={"guided_json": SCHEMA})
        assert "prefill[" in raw.headers["x-tandem-route"]
        out = raw.parse().choices[0]
        assert out.finish_reason == "stop" and out.text == _reference(offline, prompt, spec, 64)
        jsonschema.validate(json.loads(out.text), SCHEMA)
    finally:
        rt.stop()
        dec.stop()
        pre.stop()


@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_decode_worker_killed_mid_output_migrates_and_the_grammar_continues(mode: str, model: Path,
                                                                           offline: LLM) -> None:
    """SIGKILL the decode worker after five streamed chunks: the router resends prompt + tokens so far to the other
    worker, whose fresh matcher replays them, and the client's text is exactly the uninterrupted output."""
    decodes = [start_worker("decode", str(model), "tcp", [*FLAGS, "--worker-id", f"som-{i}"]) for i in range(2)]
    pre = start_worker("prefill", str(model), "tcp", [*FLAGS, "--worker-id", "som-pre"]) \
        if mode == "disaggregated" else None
    rt = RouterThread(RouterConfig(model=str(model),
                                   workers=(*(w.address for w in decodes), *([pre.address] if pre else []))))
    try:
        prompt = _long_prompt(2) if pre else offline.tokenizer.encode("Sum:")
        spec = StructuredOutput("grammar", LONG)
        want = _reference(offline, prompt, spec, 120)
        chunks: list[str] = []
        raw = _client(rt).completions.with_raw_response.create(
            model=model.name, prompt=prompt, max_tokens=120, temperature=0, stream=True,
            extra_headers={"x-tandem-explain": "1"}, extra_body={"guided_grammar": LONG})
        victim = decodes[int(routed_worker(raw.headers["x-tandem-route"]).split("-")[1])]
        for c in raw.parse():
            if c.choices:
                chunks.append(c.choices[0].text)
            if len(chunks) == 5:
                victim.kill()
        assert "".join(chunks) == want
        assert rt.call(lambda r: r.dispatcher.stats.migrations) == 1
    finally:
        rt.stop()
        for w in (*decodes, *([pre] if pre else [])):
            w.stop()
