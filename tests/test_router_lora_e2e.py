"""LoRA adapters through the router, end to end: one real ``tandem worker --role both --lora a=DIR`` behind a real
in-process router with API keys (a user key and an admin key), driven by the official ``openai`` client, plain
HTTP and the gRPC gateway.

- ``/v1/models`` lists the adapter with ``parent`` the base model; ``model: a`` (completions, chat, gRPC) gives the
  in-process engine's output for adapter ``a`` (itself token-exact with transformers + peft: tests/test_lora.py);
- an unknown model is a 404 naming it; the router's KV index holds the prompt's blocks under the adapter's keys,
  never the base model's;
- ``/v1/load_lora_adapter`` refuses a user key (403) and no key (401), names a bad path (400), loads ``b`` (then
  served, equal to the engine), and gives it to a worker that joins later; ``/v1/unload_lora_adapter`` refuses
  while a stream of ``b`` runs (409), unloads it everywhere once the stream's client left (then a 404 again, and
  unloading again is a 404)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from gateway_harness import WORKER_FLAGS, RouterThread

from cli.main import main as tandem
from engine.block_hash import hash_blocks
from engine.llm import LLM
from engine.lora.config import LoRAConfig
from engine.sampling_params import SamplingParams
from proto.tandem.v1 import gateway_pb2 as gpb
from proto.tandem.v1 import gateway_pb2_grpc as gpb_grpc
from router.grpc_gateway import start_grpc_gateway
from router.server import RouterConfig
from worker.launcher import WorkerProcess, start_worker

pytestmark = pytest.mark.slow
USER, ADMIN = "sk-user-lora", "sk-admin-lora"
MAX_NEW = 8
PROMPT = [5, 17, 42, 99, 7, 3, 250, 11, 64, 8, 31, 2, 77, 19, 23, 101, 4, 9, 81, 12, 33, 200, 1, 54, 76, 18, 29,
          140, 61, 62, 63, 64, 65, 66, 67]  # two full blocks and a bit


@pytest.fixture(scope="module")
def adapters(checkpoint: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("router-lora")
    for name, seed in (("a", 11), ("b", 12)):
        assert tandem(["model", "init-lora", str(checkpoint("llama")), str(root / name), "--targets",
                       "q_proj,v_proj,o_proj", "--seed", str(seed)]) == 0
    return {"a": root / "a", "b": root / "b"}


@pytest.fixture(scope="module")
def expected(checkpoint: Callable[[str], Path], adapters: dict[str, Path]) -> dict[str, list[int]]:
    """Greedy continuations of PROMPT under each adapter and the base model, from the in-process engine."""
    llm = LLM(str(checkpoint("llama")), num_kv_blocks=64,
              lora=LoRAConfig(tuple((name, str(path)) for name, path in adapters.items())))
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    outs = llm.generate([PROMPT] * 3, params, lora=["a", "b", None])
    got = {"a": outs[0].token_ids, "b": outs[1].token_ids, "": outs[2].token_ids}
    assert len({tuple(v) for v in got.values()}) == 3  # the adapters really change the output
    return got


@pytest.fixture(scope="module")
def worker(checkpoint: Callable[[str], Path], adapters: dict[str, Path]) -> Iterator[WorkerProcess]:
    w = start_worker("both", str(checkpoint("llama")), "tcp", [*WORKER_FLAGS, "--worker-id", "lora-0",
                                                                "--lora", f"a={adapters['a']}"])
    yield w
    w.stop()


@pytest.fixture(scope="module")
def served(worker: WorkerProcess, checkpoint: Callable[[str], Path]) -> Iterator[RouterThread]:
    rt = RouterThread(RouterConfig(model=str(checkpoint("llama")), workers=(worker.address,),
                                   api_keys=(USER, f"admin:{ADMIN}")))
    yield rt
    rt.stop()


def _text(checkpoint: Callable[[str], Path], ids: list[int]) -> str:
    from engine.tokenizer import Tokenizer

    return Tokenizer(checkpoint("llama")).decode(ids)


def _complete(client: openai.OpenAI, model: str) -> str:
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_NEW, temperature=0,
                                    extra_body={"ignore_eos": True})
    return out.choices[0].text


def test_models_list_the_adapter_and_model_a_runs_under_it(
        served: RouterThread, checkpoint: Callable[[str], Path], expected: dict[str, list[int]]) -> None:
    base = checkpoint("llama").name
    client = openai.OpenAI(base_url=served.url + "/v1", api_key=USER, max_retries=0, timeout=120)
    models = {m.id: m.model_dump() for m in client.models.list()}
    assert set(models) == {base, "a"}
    assert models["a"]["parent"] == base and models["a"]["object"] == "model"
    assert client.models.retrieve("a").model_dump()["parent"] == base
    assert _complete(client, "a") == _text(checkpoint, expected["a"])
    assert _complete(client, base) == _text(checkpoint, expected[""])
    # chat: the same adapter on the chat template's token ids gives the completion of those ids
    messages = [{"role": "user", "content": "Tell me about adapters"}]
    ids = httpx.post(served.url + "/tokenize", json={"model": "a", "messages": messages,
                                                     "add_generation_prompt": True},
                     headers={"authorization": f"Bearer {USER}"}, timeout=30).json()["tokens"]
    chat = client.chat.completions.create(model="a", messages=messages,  # type: ignore[arg-type]
                                          max_tokens=MAX_NEW, temperature=0, extra_body={"ignore_eos": True})
    plain = client.completions.create(model="a", prompt=ids, max_tokens=MAX_NEW, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content == plain.choices[0].text
    with pytest.raises(openai.NotFoundError, match="'zz' does not exist") as e:
        _complete(client, "zz")
    assert e.value.body["code"] == "model_not_found"  # type: ignore[index]


def test_the_index_keys_an_adapter_requests_blocks_by_the_adapter(
        served: RouterThread, checkpoint: Callable[[str], Path]) -> None:
    prompt = [t + 100 for t in PROMPT]  # never run under the base model
    body = {"model": "a", "prompt": prompt, "max_tokens": 2, "temperature": 0}
    r = httpx.post(served.url + "/v1/completions", json=body, timeout=60,
                   headers={"authorization": f"Bearer {ADMIN}", "x-tandem-explain": "1"})
    assert r.status_code == 200 and r.headers["x-tandem-route"].startswith("colocated:no_prefill_worker:")
    selector = served.call(lambda router: router.dispatcher.decode_selector)
    under_a = hash_blocks(prompt, 16, selector.keys_for("a"))
    under_base = hash_blocks(prompt, 16, selector.keys_for(None))
    deadline = time.monotonic() + 30
    while served.call(lambda router: router.index.match(under_a)).get("lora-0", 0) < 2:
        assert time.monotonic() < deadline, "the worker's KV events never reached the router's index"
        time.sleep(0.1)
    assert served.call(lambda router: router.index.match(under_base)) == {}


def test_grpc_gateway_lists_and_serves_the_adapter(served: RouterThread, checkpoint: Callable[[str], Path],
                                                   expected: dict[str, list[int]]) -> None:
    server, port = served.call_async(lambda router: start_grpc_gateway(router.gateway, "127.0.0.1", 0))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = gpb_grpc.GatewayStub(ch)
            meta = (("authorization", f"Bearer {USER}"),)
            models = stub.Models(gpb.ModelsRequest(), metadata=meta, timeout=30).models
            assert [(m.id, m.parent) for m in models] == [(checkpoint("llama").name, ""),
                                                          ("a", checkpoint("llama").name)]
            req = gpb.CompleteRequest(model="a", token_ids=gpb.PromptTokens(ids=PROMPT), max_tokens=MAX_NEW,
                                      temperature=0.0, ignore_eos=True)
            got = [t for chunk in stub.Complete(req, metadata=meta, timeout=120) for t in chunk.token_ids]
            assert got == expected["a"]
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Complete(gpb.CompleteRequest(model="zz", text="hi", max_tokens=2), metadata=meta,
                                   timeout=30))
            assert e.value.code() == grpc.StatusCode.NOT_FOUND  # type: ignore[attr-defined]
    finally:
        served.call_async(lambda router: server.stop(1.0))


def test_load_use_unload_an_adapter_at_run_time_with_an_admin_key_only(
        served: RouterThread, checkpoint: Callable[[str], Path], adapters: dict[str, Path],
        expected: dict[str, list[int]], tmp_path: Path) -> None:
    url = served.url
    admin, user = {"authorization": f"Bearer {ADMIN}"}, {"authorization": f"Bearer {USER}"}
    load = {"lora_name": "b", "lora_path": str(adapters["b"])}
    r = httpx.post(url + "/v1/load_lora_adapter", json=load, headers=user, timeout=60)
    assert r.status_code == 403 and "admin" in r.json()["error"]["message"]
    assert httpx.post(url + "/v1/load_lora_adapter", json=load, timeout=60).status_code == 401
    missing = str(tmp_path / "missing")
    r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": missing}, headers=admin,
                   timeout=60)
    assert r.status_code == 400 and missing in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "b"}, headers=admin, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"

    r = httpx.post(url + "/v1/load_lora_adapter", json=load, headers=admin, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "loaded" and r.json()["workers"]["lora-0"]
    client = openai.OpenAI(base_url=url + "/v1", api_key=USER, max_retries=0, timeout=120)
    assert {m.id for m in client.models.list()} == {checkpoint("llama").name, "a", "b"}
    assert _complete(client, "b") == _text(checkpoint, expected["b"])
    # a worker that joins later gets b from the router (started without adapters: not a, only what was loaded)
    late = start_worker("both", str(checkpoint("llama")), "tcp", [*WORKER_FLAGS, "--worker-id", "lora-late"])
    try:
        served.call(lambda router: router.pool.add(late.address))
        deadline = time.monotonic() + 60
        while served.call(lambda router: sorted(router.pool.workers[late.address].loras)) != ["b"]:
            assert time.monotonic() < deadline, "the late worker was never given the run-time adapter"
            time.sleep(0.2)
        for _ in range(4):  # a is served by lora-0 alone: every request of a goes there, and is right
            assert _complete(client, "a") == _text(checkpoint, expected["a"])
        assert _complete(client, "b") == _text(checkpoint, expected["b"])
        _unload_b_refused_while_its_stream_runs(url, admin, user, {"lora-0", "lora-late"})
        assert served.call(lambda router: [w.worker_id for w in router.pool.workers.values() if "b" in w.loras]) == []
    finally:
        served.call_async(lambda router: router.pool.remove(late.address))
        late.stop()
    assert {m.id for m in client.models.list()} == {checkpoint("llama").name, "a"}
    with pytest.raises(openai.NotFoundError, match="'b' does not exist"):
        _complete(client, "b")
    r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "b"}, headers=admin, timeout=60)
    assert r.status_code == 404 and "'b'" in r.json()["error"]["message"]
    assert _complete(client, "a") == _text(checkpoint, expected["a"])  # the other adapter is untouched


def _unload_b_refused_while_its_stream_runs(url: str, admin: dict[str, str], user: dict[str, str],
                                            workers: set[str]) -> None:
    """A worker that unloaded b beside the 409 may get it back from the router's sync (the unload was refused)
    or not yet: the last, successful unload names the workers it unloaded b from now."""
    r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "b"}, headers=user, timeout=60)
    assert r.status_code == 403
    # in use: a stream of b that has thousands of tokens to go holds it; its end (the client leaves) frees it
    long = {"model": "b", "prompt": PROMPT, "max_tokens": 3500, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=long, headers=user, timeout=60) as stream:
        lines = stream.iter_lines()  # kept: a dropped generator closes the stream (the client leaves)
        assert next(lines).startswith("data: ")
        r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "b"}, headers=admin, timeout=60)
        assert r.status_code == 409 and "in use by 1 unfinished" in r.json()["error"]["message"], r.text
    deadline = time.monotonic() + 30
    while (r := httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "b"}, headers=admin,
                           timeout=60)).status_code == 409:
        assert time.monotonic() < deadline, "the abandoned stream's request never ended on the worker"
        time.sleep(0.1)
    assert r.status_code == 200 and set(r.json()["workers"]) <= workers and r.json()["workers"]


def test_the_registry_entry_carries_the_adapters_and_a_redis_router_finds_them(
        checkpoint: Callable[[str], Path], adapters: dict[str, Path], tmp_path: Path) -> None:
    """With Redis: the worker's signed registry entry lists its adapters (name -> content hash), a router that
    knows its workers only from Redis lists and serves them, and a run-time load rewrites the entry at once."""
    import redis
    from test_redis_registry_faults import RedisServer

    from auth.signing import verify
    from auth.token import ensure_cluster_token
    from engine.lora.manager import content_hash
    from wire.redis_keys import worker_key

    server = RedisServer(tmp_path)
    w: WorkerProcess | None = None
    rt: RouterThread | None = None
    try:
        path = checkpoint("llama")
        w = start_worker("both", str(path), "tcp", [*WORKER_FLAGS, "--worker-id", "lora-r", "--redis", server.url,
                                                    "--lora", f"a={adapters['a']}"])
        entry = redis.Redis(port=server.port)
        key = worker_key(path.name, "lora-r")

        def ad() -> dict[str, object]:
            raw = entry.get(key)
            assert raw is not None
            return verify(raw, ensure_cluster_token())

        assert ad()["loras"] == {"a": content_hash(adapters["a"])}
        rt = RouterThread(RouterConfig(model=str(path), workers=(), redis=server.url))
        client = openai.OpenAI(base_url=rt.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        deadline = time.monotonic() + 30
        while {m.id for m in client.models.list()} != {path.name, "a"}:
            assert time.monotonic() < deadline, "the router never listed the registry's adapter"
            time.sleep(0.1)
        assert _complete(client, "a")
        r = httpx.post(rt.url + "/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": str(adapters["b"])},
                       timeout=120)  # no keys configured: every caller is an admin
        assert r.status_code == 200, r.text
        assert ad()["loras"] == {"a": content_hash(adapters["a"]), "b": content_hash(adapters["b"])}
        entry.close()
    finally:
        if rt is not None:
            rt.stop()
        if w is not None:
            w.stop()
        server.kill()
