"""``tandem up`` end to end: a real local Ray cluster, real prefill and decode worker processes, the router's
OpenAI gateway on loopback, driven by the official ``openai`` client and plain HTTP.

One cluster is started for the module (``--min-uncached-tokens`` is left at its default, so short prompts run
colocated on the decode worker and long ones disaggregated through the prefill worker). It runs with
``--speculative ngram --num-speculative-tokens 3``, so that every greedy answer checked against transformers below
is also a check of speculative decoding (requests with logprobs are never speculated), and one test reads the
acceptance counters off the decode worker's own /metrics. It also serves a LoRA adapter (``--lora a=DIR``, on both
workers), listed by /v1/models and selected by ``model: a``, colocated and disaggregated. The last test stops it
with SIGINT and checks that every process it started is gone.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from prom_harness import Prometheus

from router.server import RouterConfig

pytestmark = pytest.mark.slow
SPECULATIVE = ("--speculative", "ngram", "--num-speculative-tokens", "3")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Cluster:
    def __init__(self, model: Path, home: Path, flags: tuple[str, ...] = ()) -> None:
        self.port = _free_port()
        self.grpc_port = _free_port()
        self.home = home
        env = {**os.environ, "TANDEM_HOME": str(home), "RAY_AUTH_MODE": "disabled"}
        self.proc = subprocess.Popen([sys.executable, "-m", "cli.main", "up", "--model", str(model), "--port",
                                      str(self.port), "--grpc-port", str(self.grpc_port), *flags],
                                     stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
        self.lines: list[str] = []
        deadline = time.monotonic() + 180
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line and self.proc.poll() is not None:
                raise RuntimeError("tandem up exited:\n" + "".join(self.lines[-50:]))
            self.lines.append(line)
            if "serving OpenAI API at" in line:
                break
        else:
            self.stop()
            raise TimeoutError("tandem up did not become ready:\n" + "".join(self.lines[-50:]))
        self.state = json.loads((home / "up.json").read_text())
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        return self.proc.returncode


@pytest.fixture(scope="module")
def adapter(checkpoint: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    from cli.main import main as tandem

    out = tmp_path_factory.mktemp("up-lora") / "a"
    assert tandem(["model", "init-lora", str(checkpoint("llama")), str(out), "--targets", "q_proj,v_proj",
                   "--seed", "5"]) == 0
    return out


@pytest.fixture(scope="module")
def cluster(checkpoint: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory,
            adapter: Path) -> Iterator[Cluster]:
    c = Cluster(checkpoint("llama"), tmp_path_factory.mktemp("tandem-home"), (*SPECULATIVE, "--lora", f"a={adapter}"))
    yield c
    c.stop()


@pytest.fixture(scope="module")
def client(cluster: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def test_models_lists_the_served_checkpoint(client: openai.OpenAI, checkpoint: Callable[[str], Path]) -> None:
    """/v1/models names the one model the cluster serves."""
    assert _model(client) == checkpoint("llama").name


def test_the_lora_adapter_given_to_tandem_up_is_listed_and_served_exactly(
        client: openai.OpenAI, checkpoint: Callable[[str], Path], adapter: Path) -> None:
    """``--lora a=DIR`` reaches both workers through the controller: /v1/models lists ``a`` with the base model as
    parent, and ``model: a`` answers what the in-process engine answers under the adapter (itself token-exact with
    transformers + peft: tests/test_lora.py), unlike the base model, for a short prompt (colocated) and a long one
    (disaggregated: prefill and decode both apply the adapter)."""
    from engine.llm import LLM
    from engine.lora.config import LoRAConfig
    from engine.sampling_params import SamplingParams
    from engine.tokenizer import Tokenizer

    base = checkpoint("llama").name
    models = {m.id: m.model_dump() for m in client.models.list()}
    assert set(models) == {base, "a"} and models["a"]["parent"] == base
    tok = Tokenizer(checkpoint("llama"))
    llm = LLM(str(checkpoint("llama")), num_kv_blocks=64, lora=LoRAConfig((("a", str(adapter)),)))
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for text, mode in (("hello adapter", "colocated"), ("adapter " * 40, "disaggregated")):  # 81 tokens: past 64
        prompt = tok.encode(text)
        want = {name: llm.generate([prompt], greedy, lora=name or None)[0].text for name in ("a", "")}
        assert want["a"] != want[""]
        for model, name in (("a", "a"), (base, "")):
            r = client.completions.with_raw_response.create(
                model=model, prompt=prompt, max_tokens=12, temperature=0,
                extra_body={"ignore_eos": True}, extra_headers={"x-tandem-explain": "1"})
            assert r.parse().choices[0].text == want[name], (model, mode)
            assert r.headers["x-tandem-route"].startswith(mode), r.headers["x-tandem-route"]


def test_a_bad_lora_flag_is_refused_before_anything_starts(checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    env = {**os.environ, "TANDEM_HOME": str(tmp_path), "RAY_AUTH_MODE": "disabled"}
    done = subprocess.run([sys.executable, "-m", "cli.main", "up", "--model", str(checkpoint("llama")), "--lora",
                           "nodir"], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 2 and "NAME=DIR, got 'nodir'" in done.stderr, done.stderr
    assert not (tmp_path / "up.json").exists()


def test_greedy_completion_equals_transformers(client: openai.OpenAI, checkpoint: Callable[[str], Path],
                                               hf_greedy: Callable[..., list[int]]) -> None:
    """Token ids in, greedy tokens out: short (colocated) and long (disaggregated) prompts both match HF."""
    rng = random.Random(3)
    for n in (5, 120):
        prompt = [rng.randrange(2000) for _ in range(n)]
        r = client.completions.create(model=_model(client), prompt=prompt, max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True}, logprobs=0)
        ref = hf_greedy(checkpoint("llama"), prompt, 8)
        from engine.tokenizer import Tokenizer

        tok = Tokenizer(checkpoint("llama"))
        assert r.choices[0].text == tok.decode(ref)
        assert r.usage is not None and r.usage.completion_tokens == 8 and r.usage.prompt_tokens == n


def test_speculating_workers_answer_exactly_and_the_decode_worker_exports_acceptance(
        cluster: Cluster, client: openai.OpenAI, checkpoint: Callable[[str], Path],
        hf_greedy: Callable[..., list[int]]) -> None:
    """Greedy requests without logprobs (speculated), colocated and disaggregated, streamed and not: the openai
    client gets transformers' greedy text (= decoding without speculation); then the decode worker's /metrics,
    found in tandem up's file_sd targets, counts verified proposals and exports the acceptance gauges."""
    from engine.tokenizer import Tokenizer

    path = checkpoint("llama")
    tok = Tokenizer(path)
    for text in ("hello", "hello " * 40):  # 2 tokens: colocated; 81: past the 64 uncached, disaggregated
        prompt = tok.encode(text)
        want = tok.decode(hf_greedy(path, prompt, 24))
        r = client.completions.create(model=_model(client), prompt=prompt, max_tokens=24, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.choices[0].text == want
        assert r.usage is not None and r.usage.completion_tokens == 24
        stream = client.completions.create(model=_model(client), prompt=prompt, max_tokens=24, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].text for c in stream if c.choices) == want
    groups = json.loads(Path(cluster.state["prometheus_targets"]).read_text())
    decode = [g["targets"][0] for g in groups if g["labels"].get("tier") == "decode"]
    assert len(decode) == 1, groups
    from prometheus_client.parser import text_string_to_metric_families

    body = httpx.get(f"http://{decode[0]}/metrics", timeout=10).text
    values = {s.name: s.value for f in text_string_to_metric_families(body) for s in f.samples
              if s.name.startswith("tandem_spec_decode_")}
    drafts, proposed = values["tandem_spec_decode_drafts_total"], values["tandem_spec_decode_draft_tokens_total"]
    accepted = values["tandem_spec_decode_accepted_tokens_total"]
    assert drafts > 0 and 0 < accepted <= proposed <= 3 * drafts, values
    assert values["tandem_spec_decode_acceptance_rate"] == pytest.approx(accepted / proposed)
    assert values["tandem_spec_decode_mean_accepted_length"] == pytest.approx(1 + accepted / drafts)


def test_completion_streaming_matches_non_streaming_and_reports_usage(client: openai.OpenAI) -> None:
    """SSE chunks concatenate to the non-streamed text; include_usage adds a final usage chunk."""
    model = _model(client)
    full = client.completions.create(model=model, prompt="Once upon a time", max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(model=model, prompt="Once upon a time", max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_completion_streaming_and_not(client: openai.OpenAI) -> None:
    """Chat: role delta first, content deltas, a finish reason; same text as the non-streamed answer."""
    model = _model(client)
    msgs: list[ChatCompletionMessageParam] = [{"role": "system", "content": "You are terse."},
                                              {"role": "user", "content": "Say hi"}]
    full = client.chat.completions.create(model=model, messages=msgs, max_tokens=10, temperature=0)
    stream = list(client.chat.completions.create(model=model, messages=msgs, max_tokens=10, temperature=0,
                                                 stream=True))
    assert stream[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == full.choices[0].message.content
    assert full.choices[0].finish_reason in ("stop", "length")
    assert full.usage is not None and full.usage.prompt_tokens > 5


def test_stop_string_ends_the_completion_before_it(client: openai.OpenAI) -> None:
    """A stop string that the greedy text contains truncates there, with finish_reason stop."""
    model = _model(client)
    base = client.completions.create(model=model, prompt="Hello", max_tokens=16, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    assert len(base) > 6
    stop = base[3:6]
    r = client.completions.create(model=model, prompt="Hello", max_tokens=16, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == base[: base.index(stop)]


def test_seeded_sampling_is_reproducible_and_n_gives_distinct_choices(client: openai.OpenAI) -> None:
    """Same seed → same text; n=3 returns three indexed choices."""
    model = _model(client)
    kw = {"model": model, "prompt": "The weather", "max_tokens": 10, "temperature": 1.0, "seed": 1234}
    a = client.completions.create(**kw).choices[0].text  # type: ignore[call-overload]
    b = client.completions.create(**kw).choices[0].text  # type: ignore[call-overload]
    assert a == b
    many = client.completions.create(**kw, n=3)  # type: ignore[call-overload]
    assert sorted(c.index for c in many.choices) == [0, 1, 2]


@pytest.fixture(scope="module")
def gateway(cluster: Cluster) -> Iterator[Any]:
    """A stub of the client gRPC API that ``tandem up`` serves beside HTTP."""
    import grpc

    from proto.tandem.v1 import gateway_pb2_grpc as gpb_grpc

    assert any(f"127.0.0.1:{cluster.grpc_port}" in line for line in cluster.lines)  # announced while starting
    channel = grpc.insecure_channel(f"127.0.0.1:{cluster.grpc_port}")
    yield gpb_grpc.GatewayStub(channel)
    channel.close()


def test_grpc_complete_streams_what_http_answers_and_equals_transformers(
        gateway: Any, client: openai.OpenAI, checkpoint: Callable[[str], Path],
        hf_greedy: Callable[..., list[int]]) -> None:
    """The gRPC API streams the same greedy tokens as transformers and the same text as HTTP, for a short
    (colocated) and a long (disaggregated) prompt; the last chunk carries finish_reason and usage."""
    from engine.tokenizer import Tokenizer
    from proto.tandem.v1 import gateway_pb2 as gpb

    model = _model(client)
    tok = Tokenizer(checkpoint("llama"))
    rng = random.Random(5)
    for n in (6, 120):
        prompt = [rng.randrange(2000) for _ in range(n)]
        chunks = list(gateway.Complete(gpb.CompleteRequest(model=model, token_ids=gpb.PromptTokens(ids=prompt),
                                                           max_tokens=8, temperature=0.0, ignore_eos=True),
                                       timeout=60))
        ids = [t for c in chunks for t in c.token_ids]
        assert ids == hf_greedy(checkpoint("llama"), prompt, 8)
        assert "".join(c.text for c in chunks) == tok.decode(ids)
        http = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0,
                                         extra_body={"ignore_eos": True})
        assert "".join(c.text for c in chunks) == http.choices[0].text
        assert len(chunks) > 1 and all(not c.finish_reason for c in chunks[:-1])
        last = chunks[-1]
        assert last.finish_reason == "length" and last.request_id.startswith("cmpl-")
        assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (n, 8)


def test_grpc_complete_text_prompt_stop_and_logprobs(gateway: Any, client: openai.OpenAI) -> None:
    """A text prompt with a stop string ends before it with finish_reason "stop", like HTTP; logprobs come per
    token with the requested alternatives."""
    from proto.tandem.v1 import gateway_pb2 as gpb

    model = _model(client)
    base = list(gateway.Complete(gpb.CompleteRequest(model=model, text="Once upon a time", max_tokens=12,
                                                     temperature=0.0, ignore_eos=True, logprobs=2), timeout=60))
    text = "".join(c.text for c in base)
    lps = [lp for c in base for lp in c.logprobs]
    assert len(lps) == 12 and all(len(lp.top) == 2 for lp in lps)
    assert [lp.token_id for lp in lps] == [t for c in base for t in c.token_ids]
    # A stop string from the middle of that text: two visible characters, not already seen before them.
    at = next(i for i in range(len(text) // 2, len(text) - 1)
              if text[i:i + 2].strip() == text[i:i + 2] and "\ufffd" not in text[i:i + 2]
              and text.index(text[i:i + 2]) == i)
    stop = text[at:at + 2]
    cut = list(gateway.Complete(gpb.CompleteRequest(model=model, text="Once upon a time", max_tokens=12,
                                                    temperature=0.0, ignore_eos=True, stop=[stop]), timeout=60))
    http = client.completions.create(model=model, prompt="Once upon a time", max_tokens=12, temperature=0,
                                     stop=[stop], extra_body={"ignore_eos": True})
    assert "".join(c.text for c in cut) == http.choices[0].text == text[:at]
    assert cut[-1].finish_reason == "stop"


def test_grpc_bad_input_gets_a_status_with_the_http_message(gateway: Any, client: openai.OpenAI) -> None:
    """Unknown model: NOT_FOUND; a bad field, a missing prompt or a prompt past the context: INVALID_ARGUMENT;
    each with the message the HTTP gateway gives. Models lists the served model (and its LoRA adapter)."""
    import grpc

    from proto.tandem.v1 import gateway_pb2 as gpb

    model = _model(client)
    cases = [
        (gpb.CompleteRequest(model="nope", text="hi"), grpc.StatusCode.NOT_FOUND, "does not exist"),
        (gpb.CompleteRequest(model=model, text="hi", temperature=7.0), grpc.StatusCode.INVALID_ARGUMENT,
         "temperature"),
        (gpb.CompleteRequest(model=model), grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
        (gpb.CompleteRequest(model=model, token_ids=gpb.PromptTokens(ids=[1] * 100_000)),
         grpc.StatusCode.INVALID_ARGUMENT, "maximum context length"),
    ]
    for request, code, words in cases:
        with pytest.raises(grpc.RpcError) as e:
            list(gateway.Complete(request, timeout=30))
        assert e.value.code() == code and words in e.value.details(), e.value.details()
    models = gateway.Models(gpb.ModelsRequest(), timeout=10).models
    assert [(m.id, m.parent) for m in models] == [(model, ""), ("a", model)]  # the cluster's LoRA adapter too
    assert models[0].max_model_len > 0


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"prompt": "x"}, 400, "model"),
    ({"model": "nope", "prompt": "x"}, 404, "model"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": 5}, 400, "prompt"),
    ({"prompt": [1, -3]}, 400, "prompt"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": "3"}, 400, "max_tokens"),
    ({"prompt": "x", "temperature": 3}, 400, "temperature"),
    ({"prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"prompt": "x", "n": 0}, 400, "n"),
    ({"prompt": "x", "stop": [""]}, 400, "stop"),
    ({"prompt": "x", "seed": "a"}, 400, "seed"),
    ({"prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ({"prompt": "x", "stream": "yes"}, 400, "stream"),
    ({"prompt": "x", "presence_penalty": 5}, 400, "presence_penalty"),
    ({"prompt": "x " * 5000}, 400, "prompt"),
    ({"prompt": "x", "max_tokens": 100000}, 400, "max_tokens"),
])
def test_bad_completion_input_gets_a_4xx_with_a_message(cluster: Cluster, client: openai.OpenAI,
                                                        body: dict[str, object], status: int, param: str) -> None:
    """Each malformed field is answered with the right status, an OpenAI error body and the parameter named."""
    if "model" not in body and param != "model":
        body = {"model": _model(client), **body}
    r = httpx.post(cluster.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["param"] == param


def test_bad_chat_input_and_invalid_json_get_400(cluster: Cluster, client: openai.OpenAI) -> None:
    """Chat without messages, a bad role, and a non-JSON body are all 400 with a message."""
    model = _model(client)
    for body in ({"model": model}, {"model": model, "messages": [{"role": "robot", "content": "x"}]}):
        r = httpx.post(cluster.url + "/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["message"]
    r = httpx.post(cluster.url + "/v1/completions", content=b"{not json", timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]


def test_unknown_endpoint_wrong_method_and_oversized_body_get_4xx(cluster: Cluster) -> None:
    """404 for a path the gateway does not serve, 405 for a served path with the wrong method, 413 for a body over
    the configured body limit (refused from its Content-Length, before it is read) and 413 for a well-formed
    request whose prompt is over the prompt-byte cap (before it is tokenised); each with an OpenAI error body."""
    defaults = RouterConfig(model="m", workers=("127.0.0.1:1",))  # tandem up leaves these limits at their defaults
    max_body, max_prompt = defaults.http.max_body_bytes, defaults.max_prompt_bytes
    assert max_prompt < max_body
    r = httpx.get(cluster.url + "/v1/engines", timeout=10)
    assert r.status_code == 404 and "/v1/engines" in r.json()["error"]["message"]
    r = httpx.get(cluster.url + "/v1/completions", timeout=10)
    assert r.status_code == 405 and "GET" in r.json()["error"]["message"]
    r = httpx.post(cluster.url + "/v1/completions", content=b"x" * (max_body + 1), timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 413 and str(max_body) in r.json()["error"]["message"]
    for path, body, param in (
            ("/v1/completions", {"model": "m", "prompt": "x" * (max_prompt + 1)}, "prompt"),
            ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "x" * max_prompt},
                                                                 {"role": "user", "content": "y"}]}, "messages")):
        r = httpx.post(cluster.url + path, json=body, timeout=30)
        assert r.status_code == 413, (path, r.text[:200])
        assert r.json()["error"]["param"] == param and str(max_prompt) in r.json()["error"]["message"]


def test_health_and_metrics_endpoints(cluster: Cluster, client: openai.OpenAI) -> None:
    """/health is ok with workers up; /metrics exports the tandem_ series the dashboards query."""
    assert httpx.get(cluster.url + "/health", timeout=10).json()["status"] == "ok"
    client.completions.create(model=_model(client), prompt="metrics please", max_tokens=2)
    text = httpx.get(cluster.url + "/metrics", timeout=10).text
    for name in ("tandem_ttft_seconds", "tandem_e2e_latency_seconds", "tandem_router_decisions_total",
                 "tandem_kv_blocks_used", "tandem_kv_blocks_free", "tandem_requests_total"):
        assert name in text, name


def test_a_real_prometheus_scrapes_the_gateway_and_sees_every_worker(cluster: Cluster, client: openai.OpenAI,
                                                                     tmp_path: Path) -> None:
    """A real Prometheus (the apt package) scrapes the router's /metrics: the exposition parses, the target is up,
    request counters rise between scrapes, both workers' KV gauges appear with their roles, and the TTFT
    histogram answers the ``histogram_quantile`` query a dashboard panel runs."""
    prom = Prometheus([f"127.0.0.1:{cluster.port}"], tmp_path)
    try:
        up = prom.wait_for('up{job="tandem"} == 1')
        assert len(up) == 1
        before = prom.wait_for('sum(tandem_requests_total{endpoint="/v1/completions"}) or vector(0)')
        n_before = float(before[0]["value"][1])
        for i in range(3):  # streamed: TTFT is observed for streams, end-to-end latency for every request
            stream = client.completions.create(model=_model(client), prompt=f"scrape me {i}", max_tokens=2,
                                               stream=True)
            assert "".join(c.choices[0].text for c in stream if c.choices)
        counted = prom.wait_for(f'sum(tandem_requests_total{{endpoint="/v1/completions"}}) >= {n_before + 3}')
        assert float(counted[0]["value"][1]) >= n_before + 3
        free = prom.wait_for("tandem_kv_blocks_free")
        roles = {s["metric"]["role"] for s in free}
        assert roles == {"prefill", "decode"}, roles
        assert all(float(s["value"][1]) > 0 for s in free)
        healthy = prom.wait_for("tandem_worker_up == 1")
        assert len(healthy) == 2
        for hist in ("tandem_ttft_seconds", "tandem_e2e_latency_seconds"):
            p50 = prom.wait_for(f"histogram_quantile(0.5, sum by (le) ({hist}_bucket)) > 0")
            assert float(p50[0]["value"][1]) < 60, hist
    finally:
        prom.stop()
    assert prom.proc.returncode is not None


def test_every_worker_runs_the_hosts_cpus_shared_among_the_ranks_as_torch_threads(cluster: Cluster) -> None:
    """The worker processes ``tandem up`` started (one prefill, one decode) each got ``--threads`` = this host's
    CPUs // 2, at least 1, rather than the one thread Ray's OMP_NUM_THREADS would leave them."""
    want = str(max(1, len(os.sched_getaffinity(0)) // 2))
    for pid in cluster.state["worker_pids"]:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        assert argv[argv.index("--threads") + 1] == want, argv


def test_a_dead_worker_replica_is_restarted_and_re_registered(cluster: Cluster, client: openai.OpenAI,
                                                               checkpoint: Callable[[str], Path],
                                                               hf_greedy: Callable[..., list[int]]) -> None:
    """SIGKILL the decode worker process: the controller replaces the replica (a new placement group and worker),
    the router swaps the address, and completions are exact again within a minute (the replacement is stopped by
    tandem down like the rest)."""
    decode = [p for p in cluster.state["worker_pids"]
              if "decode" in Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode()]
    assert len(decode) == 1
    os.kill(decode[0], signal.SIGKILL)
    prompt = [11, 12, 13, 14]
    want = hf_greedy(checkpoint("llama"), prompt, 4)
    from engine.tokenizer import Tokenizer

    deadline = time.monotonic() + 90
    while True:
        try:
            r = client.completions.create(model=_model(client), prompt=prompt, max_tokens=4, temperature=0,
                                          extra_body={"ignore_eos": True})
            if r.choices[0].text == Tokenizer(checkpoint("llama")).decode(want):
                break
        except openai.APIError:
            pass  # 503 while the only decode replica is down
        assert time.monotonic() < deadline, "the decode replica did not come back"
        time.sleep(0.5)
    assert not _alive(decode[0])


def test_tandem_up_stops_cleanly_leaving_no_processes(cluster: Cluster) -> None:
    """SIGINT stops the router, every worker process and Ray; the state file is removed."""
    pids = [cluster.proc.pid, *cluster.state["worker_pids"]]
    assert cluster.stop() == 0
    deadline = time.monotonic() + 20
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [p for p in pids if _alive(p)]
        time.sleep(0.1)
    assert not alive, f"processes left behind: {alive}"
    group = subprocess.run(["pgrep", "-g", str(cluster.proc.pid)], capture_output=True, text=True).stdout.split()
    assert not group, f"processes left in tandem up's process group: {group}"
    assert not (cluster.home / "up.json").exists()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_router_takes_the_block_size_the_workers_are_given() -> None:
    """`tandem up` passes worker flags through; the router must hash with the same block size or it refuses them."""
    from cli.up import flag_int

    assert flag_int(("--threads", "1", "--block-size", "32"), "--block-size", 16) == 32
    assert flag_int(("--block-size=8",), "--block-size", 16) == 8
    assert flag_int(("--threads", "1"), "--block-size", 16) == 16
