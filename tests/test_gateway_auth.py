"""API keys on the gateway (auth/api_keys.py): 401 OpenAI-style for a missing or bad key on every endpoint but
``/health``, admin keys for ``x-tandem-explain``, ``/metrics`` behind a key or on a port of its own, the gRPC
Gateway API's ``authorization`` metadata; and every response, refusals included, counted by endpoint and status.
One real ``tandem worker`` (colocated) behind an in-process router."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from gateway_harness import WORKER_FLAGS, RouterThread

from auth.api_keys import ApiKeys, parse_key, read_key_file
from proto.tandem.v1 import gateway_pb2 as gpb
from proto.tandem.v1 import gateway_pb2_grpc as gpb_grpc
from router.grpc_gateway import start_grpc_gateway
from router.server import RouterConfig
from worker.launcher import WorkerProcess, start_worker

pytestmark = pytest.mark.slow
USER, ADMIN = "sk-user-1", "sk-admin-1"


@pytest.fixture(scope="module")
def worker(checkpoint: Callable[[str], Path]) -> Iterator[WorkerProcess]:
    w = start_worker("decode", str(checkpoint("llama")), "tcp", [*WORKER_FLAGS, "--worker-id", "auth-0"])
    yield w
    w.stop()


@pytest.fixture(scope="module")
def keyed(worker: WorkerProcess, checkpoint: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[RouterThread]:
    key_file = tmp_path_factory.mktemp("keys") / "keys"
    key_file.write_text(f"# the gateway's keys\n\nadmin:{ADMIN}\n")
    rt = RouterThread(RouterConfig(model=str(checkpoint("llama")), workers=(worker.address,), api_keys=(USER,),
                                   api_key_file=str(key_file)))
    yield rt
    rt.stop()


def _body(checkpoint: Callable[[str], Path], **kw: object) -> dict[str, object]:
    return {"model": checkpoint("llama").name, "prompt": [5, 6, 7, 8], "max_tokens": 3, "temperature": 0, **kw}


def test_missing_or_bad_key_gets_401_openai_style_and_health_stays_open(
        keyed: RouterThread, checkpoint: Callable[[str], Path]) -> None:
    body = _body(checkpoint)
    for headers in ({}, {"authorization": "Bearer nope"}, {"authorization": USER}, {"authorization": "Basic x"}):
        r = httpx.post(keyed.url + "/v1/completions", json=body, headers=headers, timeout=30)
        assert r.status_code == 401, (headers, r.text)
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["code"] == "invalid_api_key"
    for path in ("/v1/models", "/metrics", "/nowhere"):
        assert httpx.get(keyed.url + path, timeout=30).status_code == 401
    assert httpx.get(keyed.url + "/health", timeout=30).status_code == 200
    r = httpx.post(keyed.url + "/v1/completions", json=body, headers={"authorization": f"Bearer {USER}"}, timeout=60)
    assert r.status_code == 200 and len(r.json()["choices"][0]["text"]) > 0


def test_explain_is_honoured_for_an_admin_key_only(keyed: RouterThread, checkpoint: Callable[[str], Path]) -> None:
    body = _body(checkpoint)
    user = httpx.post(keyed.url + "/v1/completions", json=body, timeout=60,
                      headers={"authorization": f"Bearer {USER}", "x-tandem-explain": "1"})
    assert user.status_code == 200 and "x-tandem-route" not in user.headers
    admin = httpx.post(keyed.url + "/v1/completions", json=body, timeout=60,
                       headers={"authorization": f"Bearer {ADMIN}", "x-tandem-explain": "1"})
    assert admin.status_code == 200 and "ov=" in admin.headers["x-tandem-route"]
    with httpx.stream("POST", keyed.url + "/v1/completions", json={**body, "stream": True}, timeout=60,
                      headers={"authorization": f"Bearer {USER}", "x-tandem-explain": "1"}) as r:
        assert r.status_code == 200 and "x-tandem-route" not in r.headers
        r.read()


def test_every_response_is_counted_by_endpoint_and_status(keyed: RouterThread,
                                                          checkpoint: Callable[[str], Path]) -> None:
    auth = {"authorization": f"Bearer {USER}"}
    before = keyed.call(lambda r: {k: c.value for k, c in r.gateway.metrics.requests.children.items()})
    httpx.post(keyed.url + "/v1/completions", json=_body(checkpoint), timeout=30)  # 401
    httpx.post(keyed.url + "/v1/completions", content=b"{nope", headers=auth, timeout=30)  # 400
    httpx.post(keyed.url + "/v1/completions", json=_body(checkpoint, model="other"), headers=auth, timeout=30)  # 404
    httpx.get(keyed.url + "/v1/completions", headers=auth, timeout=30)  # 405
    httpx.post(keyed.url + "/v1/completions", content=b"x" * (17 << 20), headers=auth, timeout=60)  # 413 (body)
    httpx.post(keyed.url + "/v1/completions", json=_body(checkpoint, prompt="é" * (1 << 20) + "x"), headers=auth,
               timeout=60)  # 413 (prompt bytes)
    r = httpx.get(keyed.url + "/metrics", headers=auth, timeout=30)
    assert r.status_code == 200
    after = keyed.call(lambda r: {k: c.value for k, c in r.gateway.metrics.requests.children.items()})
    grew = {k for k in after if after[k] > before.get(k, 0)}
    for status in ("401", "400", "404", "405", "413"):
        assert ("/v1/completions", status) in grew, (status, grew)
    assert after[("/v1/completions", "413")] - before.get(("/v1/completions", "413"), 0) == 2
    assert 'tandem_requests_total{endpoint="/v1/completions",status="401"}' in r.text


def test_metrics_on_a_port_of_their_own(worker: WorkerProcess, checkpoint: Callable[[str], Path]) -> None:
    rt = RouterThread(RouterConfig(model=str(checkpoint("llama")), workers=(worker.address,), metrics_port=0))
    try:
        assert httpx.get(rt.url + "/metrics", timeout=30).status_code == 404
        r = httpx.get(rt.metrics_url + "/metrics", timeout=30)
        assert r.status_code == 200 and "tandem_requests_total" in r.text
        assert httpx.get(rt.metrics_url + "/v1/models", timeout=30).status_code == 404
    finally:
        rt.stop()


def test_the_grpc_gateway_checks_the_key_in_its_metadata(keyed: RouterThread,
                                                         checkpoint: Callable[[str], Path]) -> None:
    server, port = keyed.call_async(lambda r: start_grpc_gateway(r.gateway, "127.0.0.1", 0))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = gpb_grpc.GatewayStub(ch)
            req = gpb.CompleteRequest(model=checkpoint("llama").name, text="Hello", max_tokens=3, temperature=0)
            for metadata in ((), (("authorization", "Bearer nope"),)):
                with pytest.raises(grpc.RpcError) as e:
                    list(stub.Complete(req, metadata=metadata, timeout=30))
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            chunks = list(stub.Complete(req, metadata=(("authorization", f"Bearer {USER}"),), timeout=60))
            assert chunks[-1].finish_reason and sum(len(c.token_ids) for c in chunks) == 3
    finally:
        keyed.call_async(lambda r: server.stop(0.5))


def test_key_syntax_and_files(tmp_path: Path) -> None:
    assert parse_key("admin:abc").admin and not parse_key("abc").admin
    for bad in ("", "admin:", "a b", " a"):
        with pytest.raises(ValueError):
            parse_key(bad)
    f = tmp_path / "k"
    f.write_text("# none\n\n")
    with pytest.raises(ValueError, match="no API keys"):
        read_key_file(f)
    keys = ApiKeys.load(["u1", "admin:a1"])
    assert keys.check("Bearer u1") == keys.check("bearer u1") and not keys.check("Bearer u1").admin  # type: ignore[union-attr]
    assert keys.check("Bearer a1").admin and keys.check("Bearer u2") is None  # type: ignore[union-attr]
    assert keys.check(None) is None and ApiKeys().check(None).admin  # type: ignore[union-attr]


def test_tandem_up_takes_api_keys_and_refuses_bad_ones_before_starting(tmp_path: Path) -> None:
    from cli.main import build_parser
    from controlplane.local_cluster import UpConfig

    args = build_parser().parse_args(["up", "--api-key", "k1", "--api-key", "admin:k2", "--api-key-file", "f"])
    assert (args.api_key, args.api_key_file) == (["k1", "admin:k2"], "f")
    with pytest.raises(ValueError):
        UpConfig(api_keys=("a b",))
    with pytest.raises(FileNotFoundError):
        UpConfig(api_key_file=str(tmp_path / "missing"))
    (tmp_path / "keys").write_text("admin:k\n")
    assert UpConfig(api_keys=("k1",), api_key_file=str(tmp_path / "keys")).api_keys == ("k1",)


def test_two_router_processes_each_check_the_keys(worker: WorkerProcess, checkpoint: Callable[[str], Path]) -> None:
    """``python -m router.serve --processes 2``: granian's two worker processes each build a router from the
    parent's flags, keys included; connections land on either, and every one of them is checked."""
    import sys

    from router.serve import ReadyProcess

    router = ReadyProcess.start("router x2", [sys.executable, "-m", "router.serve", "--model", str(checkpoint("llama")),
                                             "--workers", worker.address, "--port", "0", "--processes", "2",
                                             "--api-key", USER])
    try:
        url = f"http://127.0.0.1:{router.port}/v1/completions"
        for _ in range(6):  # a new connection each: the kernel spreads them over both processes
            assert httpx.post(url, json=_body(checkpoint), timeout=60).status_code == 401
            r = httpx.post(url, json=_body(checkpoint), headers={"authorization": f"Bearer {USER}"}, timeout=60)
            assert r.status_code == 200, r.text
    finally:
        assert router.stop() == 0, router.tail()
