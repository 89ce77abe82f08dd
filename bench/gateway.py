"""Gateway overhead: requests/s and added streaming TTFT through the router, against fake backends.

Processes, all on loopback and each started and stopped here by PID::

    fake backends (bench.fake_worker, K of them)  ◄──Session──  router (router.serve, 1..N granian processes)
         ▲                                                            ▲
         └────────── Session ─── load client ── HTTP/1.1 ─────────────┘      (the client is its own process)

The Session stream runs on the backends' plain-TCP session port (router/session.py), or with
``--session-transport grpc`` on the gRPC ``Session`` call (the backends then name no TCP port).

The backends are fakes (every ``Generate`` answered at once with ``tokens`` canned tokens, ``tokens_per_chunk`` per
streamed chunk: 1, as a real worker streams them, or the request's ``min_chunk_tokens`` when larger, as a real
worker paces a non-streaming request), so what a client sees beyond a direct call is the router's own cost. Phases,
each ``seconds`` long after a short warm-up:

    direct   the client sends ``Generate`` requests on the backends' ``Session`` streams (router/session.py: the
             way the router itself reaches its workers) at ``concurrency`` in flight, asking for the answer in one
             chunk (``min_chunk_tokens``, what the router asks for a non-streaming client): requests/s; then at
             each of ``ttft_concurrency``, streaming (one token per chunk), the time to the first streamed chunk.
             For reference, requests/s with a ``Generate`` call per request (``generate_calls_rps``).
    router   per entry of ``processes``: a fresh router in front of the same backends; non-streaming
             ``/v1/completions`` for ``tokens`` tokens at ``concurrency`` (one keep-alive connection per request in
             flight): requests/s; then streaming requests at each of ``ttft_concurrency``: the time from sending the
             request to its first SSE data chunk.

With ``--sglang-router EXE`` the peer is measured the same way, side by side: sglang-router (round robin; install
it with ``bench/sglang_router/install.sh``) in front of ``bench.fake_http_worker`` (the same canned answers over
HTTP, the protocol its routers speak), then that fake directly, for the peer's own added TTFT; the summary gives
the best Tandem router's requests/s over the peer's. With ``--wrk``, each router's requests/s phase is run once
more with wrk as the client (C: far less client CPU on the same cores than the asyncio client; answers counted,
not parsed). ``added_ttft_ms`` is router minus direct, percentile by percentile. ``cpu_us_per_request`` is each
process group's CPU time (user + system) over the requests/s phase divided by the requests it answered: the figure
that does not depend on how busy the shared machine was. Every answer is checked (``tokens`` tokens, finish reason
``length``); wrong answers count as ``bad``, failed ones as ``errors``. The client is a minimal asyncio HTTP/1.1
client (a protocol, no framework), so that the client's own cost is small next to the router's: client, router
and backends share this machine's cores (``cpu_count`` in the report).

Run: ``tandem bench gateway [--seconds 3] [--concurrency 64] [--processes 1,2] [--tokens 8] [--wrk]
[--sglang-router .venv-sglang-router/bin/sglang-router] [--json]``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The figures for sglang-router on the same workload (8-token non-streaming requests to fake backends).
GOALS = {"router_rps": 11_000, "peer_direct_rps": 13_400, "added_ttft_p50_ms": 0.5}
_PROMPT = "Hello, Tandem"
_PROMPT_IDS = [2044, 1193, 11, 1120]  # what the direct client sends; a fake backend never reads it


# ---- the load client (runs in its own process) ------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class Phase:
    """One measurement: ``stream`` (TTFT) or not, ``concurrency`` requests in flight, for ``seconds``."""

    stream: bool
    concurrency: int
    seconds: float
    warmup_s: float = 0.3

    def __post_init__(self) -> None:
        if self.concurrency < 1 or self.seconds <= 0 or self.warmup_s < 0:
            raise ValueError(f"need concurrency >= 1, seconds > 0, warmup_s >= 0, got {self}")


@dataclass(slots=True)
class _Tally:
    window_start: float
    window_end: float
    completed: int = 0  # inside the window
    total: int = 0  # warm-up and stragglers included: what the processes' CPU time was spent on
    errors: int = 0
    bad: int = 0
    latency_us: list[int] = field(default_factory=list)
    ttft_us: list[int] = field(default_factory=list)

    def record(self, t0: float, first: float, t1: float, ok: bool) -> None:
        self.total += 1
        if not self.window_start <= t1 < self.window_end:
            return
        self.completed += 1
        if not ok:
            self.bad += 1
        self.latency_us.append(int((t1 - t0) * 1e6))
        self.ttft_us.append(int((first - t0) * 1e6))

    def result(self, cpu_s: float) -> dict[str, Any]:
        return {"completed": self.completed, "total": self.total, "cpu_s": cpu_s, "errors": self.errors,
                "bad": self.bad,
                "window_s": self.window_end - self.window_start, "latency_us": self.latency_us,
                "ttft_us": self.ttft_us}


class _HttpConn(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection, one request at a time; parses Content-Length and chunked bodies."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.body = bytearray()
        self.waiter: asyncio.Future[tuple[int, bytes, float]] | None = None
        self.status = 0
        self.length = -1
        self.chunked = False
        self.pos = -1  # where the body (or the next chunk's size line) starts; -1 while headers are incomplete
        self.first = 0.0
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError(f"connection lost: {exc}"))

    def send(self, payload: bytes) -> asyncio.Future[tuple[int, bytes, float]]:
        """Send one request; resolves to (status, body, time of the first body byte)."""
        assert self.transport is not None
        self.buf.clear()
        self.body.clear()
        self.pos, self.length, self.chunked, self.first = -1, -1, False, 0.0
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(payload)
        return self.waiter

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if self.waiter is not None and not self.waiter.done():
            try:
                self._parse()
            except ValueError as e:
                self.waiter.set_exception(e)

    def _parse(self) -> None:
        buf = self.buf
        if self.pos < 0:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                return
            lines = bytes(buf[:end]).decode("latin-1").split("\r\n")
            self.status = int(lines[0].split(" ", 2)[1])
            for line in lines[1:]:
                name, _, value = line.partition(":")
                name = name.strip().lower()
                if name == "content-length":
                    self.length = int(value)
                elif name == "transfer-encoding" and "chunked" in value.lower():
                    self.chunked = True
            if self.length < 0 and not self.chunked:
                raise ValueError("response has neither Content-Length nor chunked encoding")
            self.pos = end + 4
        if not self.chunked:
            if len(buf) - self.pos >= self.length:
                self._done(bytes(buf[self.pos:self.pos + self.length]), time.perf_counter())
            return
        while True:
            eol = buf.find(b"\r\n", self.pos)
            if eol < 0:
                return
            size = int(bytes(buf[self.pos:eol]).split(b";", 1)[0], 16)
            if size == 0:
                if len(buf) >= eol + 4:  # no trailers: the terminating CRLF
                    self._done(bytes(self.body), self.first)
                return
            if len(buf) < eol + 4 + size:
                return
            if not self.first:
                self.first = time.perf_counter()
            self.body += buf[eol + 2:eol + 2 + size]
            self.pos = eol + 4 + size

    def _done(self, body: bytes, first: float) -> None:
        assert self.waiter is not None
        self.waiter.set_result((self.status, body, first))


def _http_ok(body: bytes, stream: bool, tokens: int) -> bool:
    try:
        if not stream:
            out = json.loads(body)
            return (out["usage"]["completion_tokens"] == tokens
                    and out["choices"][0]["finish_reason"] == "length")
        events = [e for e in body.split(b"\n\n") if e]
        if events[-1] != b"data: [DONE]":
            return False
        finish = [json.loads(e[6:])["choices"][0]["finish_reason"] for e in events[:-2]]
        return json.loads(events[-2][6:])["usage"]["completion_tokens"] == tokens and finish[-1] == "length"
    except (ValueError, KeyError, IndexError, TypeError):
        return False


def _http_payload(host: str, port: int, model: str, tokens: int, stream: bool) -> bytes:
    body: dict[str, Any] = {"model": model, "prompt": _PROMPT, "max_tokens": tokens, "temperature": 0}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    data = json.dumps(body).encode()
    return (f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode() + data


async def _http_loop(host: str, port: int, payload: bytes, phase: Phase, tokens: int, tally: _Tally) -> None:
    loop = asyncio.get_running_loop()
    conn: _HttpConn | None = None
    clock = time.perf_counter
    while clock() < tally.window_end:
        try:
            if conn is None or conn.closed:
                _, conn = await loop.create_connection(_HttpConn, host, port)
            t0 = clock()
            status, body, first = await conn.send(payload)
            t1 = clock()
        except (OSError, ValueError):
            tally.errors += 1
            conn = None
            await asyncio.sleep(0.01)
            continue
        if status != 200:
            tally.errors += 1
            continue
        tally.record(t0, first or t1, t1, _http_ok(body, phase.stream, tokens))
    if conn is not None and conn.transport is not None:
        conn.transport.close()


async def _grpc_loop(stub: Any, request: Any, phase: Phase, tokens: int, tally: _Tally) -> None:
    import grpc

    clock = time.perf_counter
    while clock() < tally.window_end:
        t0 = clock()
        first = 0.0
        n = 0
        finish = ""
        try:
            async for chunk in stub.Generate(request, timeout=30.0):
                if not first:
                    first = clock()
                n += len(chunk.token_ids)
                finish = chunk.finish_reason
        except grpc.aio.AioRpcError:
            tally.errors += 1
            await asyncio.sleep(0.01)
            continue
        tally.record(t0, first or clock(), clock(), n == tokens and finish == "length")


async def _session_loop(session: Any, phase: Phase, tokens: int, tally: _Tally, tag: str) -> None:
    from proto.tandem.v1 import worker_pb2 as pb
    from router.session import SessionError

    clock = time.perf_counter
    params = pb.SamplingParams(max_tokens=tokens)
    k = 0
    while clock() < tally.window_end:
        k += 1
        request = pb.GenerateRequest(request_id=f"{tag}-{k}", prompt_token_ids=_PROMPT_IDS, params=params,
                                     min_chunk_tokens=0 if phase.stream else tokens)
        t0 = clock()
        first = 0.0
        n = 0
        finish = ""
        try:
            async for chunk in session.generate(request, 30.0):
                if not first:
                    first = clock()
                n += len(chunk.token_ids)
                finish = chunk.finish_reason
        except SessionError:
            tally.errors += 1
            await asyncio.sleep(0.01)
            continue
        tally.record(t0, first or clock(), clock(), n == tokens and finish == "length")


async def _run_phase(target: str, model: str, tokens: int, phase: Phase) -> dict[str, Any]:
    """Drive ``target`` (``http://host:port``, or ``grpc://`` / ``session://`` and backend addresses separated by
    commas: a ``Generate`` call per request, or requests on one ``Session`` stream per backend) through one phase."""
    scheme, _, rest = target.partition("://")
    cpu0 = time.process_time()
    start = time.perf_counter() + phase.warmup_s
    tally = _Tally(start, start + phase.seconds)
    channels: list[Any] = []
    if scheme == "http":
        host, _, port = rest.rpartition(":")
        payload = _http_payload(host, int(port), model, tokens, phase.stream)
        loops = [_http_loop(host, int(port), payload, phase, tokens, tally) for _ in range(phase.concurrency)]
    elif scheme == "grpc":
        import grpc

        from proto.tandem.v1 import worker_pb2 as pb
        from proto.tandem.v1 import worker_pb2_grpc as pb_grpc

        channels = [grpc.aio.insecure_channel(a) for a in rest.split(",")]
        stubs = [pb_grpc.WorkerStub(c) for c in channels]
        # A batch phase is the direct form of a non-streaming request: it asks for tokens in one chunk, as the
        # router does for its non-streaming clients (GatewayConfig.collect_chunk_tokens).
        request = pb.GenerateRequest(request_id="bench", prompt_token_ids=_PROMPT_IDS,
                                     params=pb.SamplingParams(max_tokens=tokens),
                                     min_chunk_tokens=0 if phase.stream else tokens)
        loops = [_grpc_loop(stubs[i % len(stubs)], request, phase, tokens, tally) for i in range(phase.concurrency)]
    elif scheme == "session":
        import grpc

        from proto.tandem.v1 import worker_pb2 as pb
        from proto.tandem.v1 import worker_pb2_grpc as pb_grpc
        from router.session import WorkerSession, host_of

        channels = [grpc.aio.insecure_channel(a) for a in rest.split(",")]
        sessions = [WorkerSession(pb_grpc.WorkerStub(c), a) for c, a in zip(channels, rest.split(","), strict=True)]
        for s, c, a in zip(sessions, channels, rest.split(","), strict=True):  # the transport the router uses
            health = await pb_grpc.WorkerStub(c).Health(pb.HealthRequest(), timeout=10)
            s.use_tcp(host_of(a), health.session_port)
        loops = [_session_loop(sessions[i % len(sessions)], phase, tokens, tally, f"bench-{os.getpid()}-{i}")
                 for i in range(phase.concurrency)]
    else:
        raise ValueError(f"target must be http://..., grpc://... or session://..., got {target!r}")
    tasks = [asyncio.ensure_future(c) for c in loops]
    _, pending = await asyncio.wait(tasks, timeout=phase.warmup_s + phase.seconds + 30.0)
    for t in pending:  # a request that never finished is an error, not a hang
        t.cancel()
    tally.errors += len(pending)
    await asyncio.gather(*tasks, return_exceptions=True)
    if scheme == "session":
        for sess in sessions:
            await sess.close()
    for c in channels:
        await c.close()
    return tally.result(time.process_time() - cpu0)


def client_main(argv: Sequence[str] | None = None) -> int:
    """``python -m bench.gateway client TARGET --model M --tokens N --phase stream:concurrency:seconds ...``:
    runs each phase in order and prints one JSON list of results."""
    p = argparse.ArgumentParser(prog="bench.gateway client")
    p.add_argument("target")
    p.add_argument("--model", default="")
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument("--phase", action="append", default=[], help="stream|batch:CONCURRENCY:SECONDS")
    args = p.parse_args(argv)
    phases = [Phase(kind == "stream", int(c), float(s)) for kind, c, s in (ph.split(":") for ph in args.phase)]

    async def run() -> list[dict[str, Any]]:
        return [await _run_phase(args.target, args.model, args.tokens, ph) for ph in phases]

    gc.collect()
    gc.freeze()
    print(json.dumps(asyncio.run(run())), flush=True)
    return 0


# ---- the orchestration -------------------------------------------------------------------------------------------


def _pct(samples_us: list[int], q: float) -> float:
    if not samples_us:
        return 0.0
    s = sorted(samples_us)
    return round(s[min(len(s) - 1, int(q * len(s)))] / 1000.0, 3)


def _summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Merge one phase's results from several client processes."""
    completed = sum(r["completed"] for r in results)
    window = max(r["window_s"] for r in results)
    lat = [x for r in results for x in r["latency_us"]]
    ttft = [x for r in results for x in r["ttft_us"]]
    return {"rps": round(completed / window, 1), "completed": completed,
            "total": sum(r["total"] for r in results), "client_cpu_s": sum(r["cpu_s"] for r in results),
            "errors": sum(r["errors"] for r in results), "bad": sum(r["bad"] for r in results),
            "latency_ms": {"p50": _pct(lat, 0.5), "p99": _pct(lat, 0.99)},
            "ttft_ms": {"p50": _pct(ttft, 0.5), "p99": _pct(ttft, 0.99)}}


def _drive(target: str, model: str, tokens: int, phases: list[Phase], clients: int = 1) -> list[dict[str, Any]]:
    """Run ``phases`` from ``clients`` client processes at once (each with its share of the concurrency)."""
    procs = []
    for i in range(clients):
        cmd = [sys.executable, "-m", "bench.gateway", "client", target, "--model", model, "--tokens", str(tokens)]
        for ph in phases:
            share = ph.concurrency // clients + (1 if i < ph.concurrency % clients else 0)
            cmd += ["--phase", f"{'stream' if ph.stream else 'batch'}:{max(share, 1)}:{ph.seconds}"]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    limit = sum(ph.warmup_s + ph.seconds + 35.0 for ph in phases) + 30.0
    outs = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=limit)
            if proc.returncode != 0:
                raise RuntimeError(f"load client failed ({proc.returncode}):\n{err[-4000:]}")
            outs.append(json.loads(out))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(5)
    return [_summary([o[i] for o in outs]) for i in range(len(phases))]


def _cpu_s(pids: Sequence[int]) -> float:
    """User + system CPU seconds of these processes and all their descendants (a router supervisor's children)."""
    import psutil

    total = 0.0
    for pid in pids:
        try:
            root = psutil.Process(pid)
            for p in [root, *root.children(recursive=True)]:
                t = p.cpu_times()
                total += t.user + t.system
        except psutil.Error:
            pass
    return total


def _measure(target: str, model: str, tokens: int, seconds: float, concurrency: int,
             ttft_concurrency: Sequence[int], clients: int, watch: dict[str, list[int]]) -> dict[str, Any]:
    """The requests/s phase (with each watched group's CPU time per request), then the TTFT phases."""
    before = {name: _cpu_s(pids) for name, pids in watch.items()}
    rps = _drive(target, model, tokens, [Phase(False, concurrency, seconds)], clients)[0]
    n = max(rps["total"], 1)
    cpu = {name: round((_cpu_s(pids) - before[name]) / n * 1e6) for name, pids in watch.items()}
    cpu["client"] = round(rps.pop("client_cpu_s") / n * 1e6)
    ttft = _drive(target, model, tokens, [Phase(True, c, seconds) for c in ttft_concurrency])
    for t in ttft:
        t.pop("client_cpu_s")
    return {"rps": rps["rps"], "cpu_us_per_request": cpu, "throughput": rps,
            "ttft": {str(c): t for c, t in zip(ttft_concurrency, ttft, strict=True)}}


def run_gateway_bench(seconds: float = 3.0, concurrency: int = 64, processes: Sequence[int] = (1, 2),
                      tokens: int = 8, backends: int = 1, ttft_concurrency: Sequence[int] = (1, 8),
                      clients: int = 1, model: str | Path | None = None, tokens_per_chunk: int = 1,
                      wrk: bool = False, sglang_router: str | None = None,
                      session_transport: str = "tcp") -> dict[str, Any]:
    """Start the fake backends, measure direct, then one fresh router per ``processes`` entry; see the module doc."""
    from router.serve import ReadyProcess

    if seconds <= 0 or min(concurrency, tokens, backends, clients, tokens_per_chunk) < 1:
        raise ValueError("need seconds > 0 and concurrency, tokens, backends, clients, tokens_per_chunk >= 1")
    if not processes or min(processes) < 1 or not ttft_concurrency or min(ttft_concurrency) < 1:
        raise ValueError("processes and ttft_concurrency must be non-empty lists of counts >= 1")
    if session_transport not in ("tcp", "grpc"):
        raise ValueError(f"session_transport must be tcp or grpc, not {session_transport!r}")
    if wrk and shutil.which("wrk") is None:
        raise ValueError("--wrk needs the wrk load generator on PATH (apt-get install wrk)")
    if sglang_router is not None and not os.access(sglang_router, os.X_OK):
        raise ValueError(f"--sglang-router {sglang_router!r} is not an executable (bench/sglang_router/install.sh)")
    model_dir = Path(model) if model is not None else _default_model()
    name = model_dir.name
    py = sys.executable
    fakes: list[ReadyProcess] = []
    try:
        for i in range(backends):
            fakes.append(ReadyProcess.start(f"fake-{i}", [py, "-m", "bench.fake_worker", "--port", "0", "--tokens",
                                                          str(tokens), "--tokens-per-chunk", str(tokens_per_chunk),
                                                          "--worker-id", f"fake-{i}",
                                                          *(["--no-tcp-session"] if session_transport == "grpc"
                                                            else [])]))
        addresses = ",".join(f"127.0.0.1:{f.port}" for f in fakes)
        backend_pids = [f.proc.pid for f in fakes]
        # Direct: the client on the backends' Session streams, as the router reaches them; then, for reference,
        # a Generate call per request (requests/s only).
        direct = _measure(f"session://{addresses}", name, tokens, seconds, concurrency, ttft_concurrency, clients,
                          {"backends": backend_pids})
        calls = _drive(f"grpc://{addresses}", name, tokens, [Phase(False, concurrency, seconds)], clients)[0]
        direct["generate_calls_rps"] = calls["rps"]
        routers = []
        for n in processes:
            router = ReadyProcess.start(f"router x{n}", [py, "-m", "router.serve", "--model", str(model_dir),
                                                        "--workers", addresses, "--port", "0", "--processes", str(n)],
                                        timeout_s=120.0)
            try:
                r = _measure(f"http://127.0.0.1:{router.port}", name, tokens, seconds, concurrency,
                             ttft_concurrency, clients, {"router": [router.proc.pid], "backends": backend_pids})
                if wrk:
                    r["wrk"] = _wrk(router.port, name, tokens, concurrency, seconds,
                                    {"router": [router.proc.pid], "backends": backend_pids})
            finally:
                router.stop()
            r["processes"] = n
            r["ratio_to_direct"] = round(r["rps"] / direct["rps"], 3) if direct["rps"] else 0.0
            r["added_ttft_ms"] = {c: {q: round(r["ttft"][c]["ttft_ms"][q] - direct["ttft"][c]["ttft_ms"][q], 3)
                                      for q in ("p50", "p99")} for c in r["ttft"]}
            routers.append(r)
        peer = (_measure_sglang_router(sglang_router, model_dir, tokens, seconds, concurrency, ttft_concurrency,
                                       clients, wrk) if sglang_router else None)
    finally:
        for f in fakes:
            f.stop()
    return {"config": {"seconds": seconds, "concurrency": concurrency, "tokens": tokens,
                       "tokens_per_chunk": tokens_per_chunk, "backends": backends, "clients": clients,
                       "session_transport": session_transport,
                       "ttft_concurrency": list(ttft_concurrency), "processes": list(processes), "model": name,
                       "cpu_count": os.cpu_count(), "cpus_usable": len(os.sched_getaffinity(0))},
            "direct": direct, "router": routers, **({"peer": peer} if peer else {}), "goals": dict(GOALS),
            "summary": _headline(direct, routers, peer)}


def _wrk(port: int, model: str, tokens: int, concurrency: int, seconds: float,
         watch: dict[str, list[int]]) -> dict[str, Any]:
    """The requests/s phase again with wrk (C, one thread, ``concurrency`` keep-alive connections) as the client:
    a client that costs far less CPU than the asyncio one, on the same cores. Answers are not checked here (the
    asyncio phase checks every one); non-2xx answers and socket errors are counted."""
    body = json.dumps({"model": model, "prompt": _PROMPT, "max_tokens": tokens, "temperature": 0})
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(f'wrk.method = "POST"\nwrk.body = {json.dumps(body)}\n'
                'wrk.headers["Content-Type"] = "application/json"\n')
        script = f.name
    url = f"http://127.0.0.1:{port}/v1/completions"
    try:
        subprocess.run(["wrk", "-t1", f"-c{concurrency}", "-d1s", "-s", script, url], capture_output=True,
                       timeout=30, check=True)  # warm-up
        before = {name: _cpu_s(pids) for name, pids in watch.items()}
        out = subprocess.run(["wrk", "-t1", f"-c{concurrency}", f"-d{max(1, round(seconds))}s", "-s", script, url],
                             capture_output=True, text=True, timeout=seconds + 60, check=True).stdout
    finally:
        os.unlink(script)
    fields = dict(re.findall(r"^\s*(Requests/sec|Non-2xx or 3xx responses):\s*([\d.]+)", out, re.M))
    total = re.search(r"(\d+) requests in", out)
    n = max(int(total.group(1)) if total else 0, 1)
    errors = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    return {"rps": float(fields.get("Requests/sec", 0.0)), "requests": n,
            "non_2xx": int(float(fields.get("Non-2xx or 3xx responses", 0))),
            "socket_errors": sum(int(x) for x in errors.groups()) if errors else 0,
            "cpu_us_per_request": {name: round((_cpu_s(pids) - before[name]) / n * 1e6)
                                   for name, pids in watch.items()}}


def _measure_sglang_router(exe: str, model_dir: Path, tokens: int, seconds: float, concurrency: int,
                           ttft_concurrency: Sequence[int], clients: int, wrk: bool) -> dict[str, Any]:
    """The peer, side by side: sglang-router (round robin) in front of an HTTP fake backend
    (``bench.fake_http_worker``, the same canned answers on the protocol its routers speak), measured as Tandem's
    router is; then the same fake without it (its own direct), for the peer's added TTFT."""
    from router.serve import ReadyProcess

    fake = ReadyProcess.start("fake-http", [sys.executable, "-m", "bench.fake_http_worker", "--port", "0", "--tokens",
                                            str(tokens), "--model", model_dir.name, "--model-path", str(model_dir)])
    proc = None
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        proc = subprocess.Popen([exe, "launch", "--host", "127.0.0.1", "--port", str(port), "--worker-urls",
                                 f"http://127.0.0.1:{fake.port}", "--policy", "round_robin", "--log-level", "error",
                                 "--model-path", str(model_dir), "--tokenizer-path", str(model_dir)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        _wait_http_ok(port, model_dir.name, proc, 60.0)
        watch = {"router": [proc.pid], "backends": [fake.proc.pid]}
        peer = _measure(f"http://127.0.0.1:{port}", model_dir.name, tokens, seconds, concurrency, ttft_concurrency,
                        clients, watch)
        if wrk:
            peer["wrk"] = _wrk(port, model_dir.name, tokens, concurrency, seconds, watch)
        direct = _measure(f"http://127.0.0.1:{fake.port}", model_dir.name, tokens, seconds, concurrency,
                          ttft_concurrency, clients, {"backends": [fake.proc.pid]})
        peer["direct"] = direct
        peer["added_ttft_ms"] = {c: {q: round(peer["ttft"][c]["ttft_ms"][q] - direct["ttft"][c]["ttft_ms"][q], 3)
                                     for q in ("p50", "p99")} for c in peer["ttft"]}
        peer["name"] = "sglang-router"
        return peer
    finally:
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        fake.stop()


def _wait_http_ok(port: int, model: str, proc: subprocess.Popen[str], timeout_s: float) -> None:
    """Until a 1-token completion through the peer answers 200 (it registers its workers asynchronously)."""
    import urllib.error
    import urllib.request

    body = json.dumps({"model": model, "prompt": _PROMPT, "max_tokens": 1}).encode()
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            err = proc.stderr.read() if proc.stderr is not None else ""
            raise RuntimeError(f"sglang-router exited with {proc.returncode}: {err[-2000:]}")
        try:
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"sglang-router on port {port} not answering after {timeout_s:.0f} s")
        time.sleep(0.2)


def _headline(direct: dict[str, Any], routers: list[dict[str, Any]],
              peer: dict[str, Any] | None = None) -> dict[str, Any]:
    low = min(direct["ttft"], key=int)  # the lowest concurrency measured: the TTFT goal's setting
    wrk = {str(r["processes"]): r["wrk"]["rps"] for r in routers if "wrk" in r}
    peer_part: dict[str, Any] = {}
    if peer is not None:
        best = max(max(r["rps"], r.get("wrk", {}).get("rps", 0.0)) for r in routers)
        peer_best = max(peer["rps"], peer.get("wrk", {}).get("rps", 0.0))
        peer_part = {"peer": peer["name"], "peer_rps": peer["rps"],
                     **({"peer_rps_wrk": peer["wrk"]["rps"]} if "wrk" in peer else {}),
                     "peer_direct_rps": peer["direct"]["rps"],
                     "ratio_best_router_to_peer": round(best / peer_best, 3) if peer_best else 0.0,
                     "peer_added_ttft_ms": peer["added_ttft_ms"][low]}
    return {**peer_part,"direct_rps": direct["rps"],
            "direct_generate_calls_rps": direct["generate_calls_rps"],
            "router_rps": {str(r["processes"]): r["rps"] for r in routers},
            **({"router_rps_wrk": wrk} if wrk else {}),
            "ratio_to_direct": {str(r["processes"]): r["ratio_to_direct"] for r in routers},
            "router_cpu_us_per_request": {str(r["processes"]): r["cpu_us_per_request"]["router"] for r in routers},
            "ttft_concurrency": int(low),
            "ttft_ms": {"direct": direct["ttft"][low]["ttft_ms"],
                        **{f"router x{r['processes']}": r["ttft"][low]["ttft_ms"] for r in routers}},
            "added_ttft_ms": {str(r["processes"]): r["added_ttft_ms"][low] for r in routers},
            "meets_rps_goal": any(max(r["rps"], r.get("wrk", {}).get("rps", 0.0)) >= GOALS["router_rps"]
                                  for r in routers),
            "meets_ttft_goal": any(r["added_ttft_ms"][low]["p50"] <= GOALS["added_ttft_p50_ms"] for r in routers),
            "all_answers_ok": all(not m["errors"] and not m["bad"]
                                  for x in [direct, *routers, *([peer, peer["direct"]] if peer else [])]
                                  for m in [x["throughput"], *x["ttft"].values()])
                              and all(not r["wrk"]["non_2xx"] and not r["wrk"]["socket_errors"]
                                      for r in [*routers, *([peer] if peer else [])] if "wrk" in r)}


def _default_model() -> Path:
    from controlplane.paths import DEFAULT_MODEL_DIR

    if not (DEFAULT_MODEL_DIR / "config.json").is_file():
        from tinymodel.checkpoint import write_tiny_checkpoint

        write_tiny_checkpoint(DEFAULT_MODEL_DIR)
    return DEFAULT_MODEL_DIR


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["client"]:
        return client_main(argv[1:])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_gateway_args(p)
    args = p.parse_args(argv)
    print(json.dumps(run_from_args(args), indent=None if args.json else 2))
    return 0


def add_gateway_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seconds", type=float, default=3.0, help="length of each measurement (after 0.3 s warm-up)")
    p.add_argument("--concurrency", type=int, default=64, help="requests in flight for the requests/s phase")
    p.add_argument("--processes", default="1,2", help="router process counts to measure, comma-separated")
    p.add_argument("--tokens", type=int, default=8, help="tokens per answer")
    p.add_argument("--tokens-per-chunk", type=int, default=1, help="tokens per streamed gRPC chunk from a backend")
    p.add_argument("--backends", type=int, default=1, help="fake backend processes")
    p.add_argument("--clients", type=int, default=1, help="load client processes for the requests/s phase")
    p.add_argument("--ttft-concurrency", default="1,8", help="concurrency levels of the streaming TTFT phases")
    p.add_argument("--model", default=None, help="checkpoint whose tokenizer the router loads (default: tiny)")
    p.add_argument("--wrk", action="store_true", help="also measure requests/s with wrk as the client")
    p.add_argument("--sglang-router", default=None, metavar="EXE",
                   help="also measure this sglang-router executable, side by side (bench/sglang_router/install.sh)")
    p.add_argument("--session-transport", default="tcp", choices=["tcp", "grpc"],
                   help="router-to-backend Session stream: the plain-TCP session port, or the gRPC Session call")
    p.add_argument("--json", action="store_true", help="one line of JSON")


def run_from_args(args: argparse.Namespace) -> dict[str, Any]:
    return run_gateway_bench(seconds=args.seconds, concurrency=args.concurrency,
                             processes=tuple(int(x) for x in args.processes.split(",")), tokens=args.tokens,
                             backends=args.backends, ttft_concurrency=tuple(int(x) for x in
                                                                            args.ttft_concurrency.split(",")),
                             clients=args.clients, model=args.model, tokens_per_chunk=args.tokens_per_chunk,
                             wrk=args.wrk, sglang_router=args.sglang_router,
                             session_transport=args.session_transport)


if __name__ == "__main__":
    sys.exit(main())
