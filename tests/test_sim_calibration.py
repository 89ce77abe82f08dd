"""The calibration that can fail: the simulator, given this CPU as one worker sees it (its measured GEMM rate, read
bandwidth and the engine's own one-token decode and one-prompt prefill steps) as its "GPU", predicts the TTFT and
inter-token latency of a real ``tandem up`` run of the same workload within 20%.

The real side: ``tandem up`` (real Ray, a real prefill and a real decode worker process, the router) on the built-in
small Llama (~110M parameters, float32: big enough that a step is its matmuls and weight reads, not Python), sent one
request at a time (512 random prompt tokens, 32 output tokens, greedy, EOS ignored, fresh prompts in every round so
that no prefix is cached) over streaming HTTP; TTFT and the mean gap between tokens are taken at the client, and the
median request's are compared (a neighbour's burst during one request of a shared CI host does not decide it).
The simulated side: the same model's config.json, the same requests, one prefill and one decode replica whose
"GPU" is ``bench/ceilings.py``'s measurement of this CPU at the decode worker's own thread count (read from the
running worker's ``--threads``, which ``tandem up`` sets), in a fresh process, taken just before and just after the
requests while ``tandem up`` idles (the mean of the two), with MFU = MBU = 1 (they are already achieved rates).
The measured decode and prefill steps, less the roofline's time for each, give the per-step and per-token costs the
roofline charges every step; nothing is taken from the run it is compared with. When the two measurements differ by
more than 25% the machine's speed moved under the run (a shared machine), and the test is skipped with both figures
rather than compared against a moving target.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from bench.ceilings import worker_ceilings
from engine.model_config import ModelConfig
from sim.calibration import predict
from sim.hardware import Ceilings
from sim.trace import TraceRequest
from tinymodel.checkpoint import write_tiny_checkpoint

PROMPT, OUTPUT, REQUESTS = 512, 32, 4
STEADY = 0.25  # the most the measured ceilings may move between before and after the real run


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker_threads(home: Path, role: str) -> int:
    """The torch threads of the ``tandem up`` worker of ``role`` started with ``TANDEM_HOME=home``: its ``--threads``
    (``tandem up`` gives every worker one), else its ``OMP_NUM_THREADS``, else the CPUs it may run on."""
    for proc in psutil.process_iter(["cmdline"]):
        cmd = proc.info["cmdline"] or []
        if "worker" not in cmd or (f"--role={role}" not in cmd and role not in cmd[cmd.index("worker"):]):
            continue
        try:
            env = proc.environ()
        except (psutil.AccessDenied, psutil.NoSuchProcess):
            continue
        if env.get("TANDEM_HOME") == str(home):
            if "--threads" in cmd:
                return int(cmd[cmd.index("--threads") + 1])
            return int(env.get("OMP_NUM_THREADS") or len(proc.cpu_affinity() or []) or os.cpu_count() or 1)
    raise AssertionError(f"no {role} worker with TANDEM_HOME={home} found")


@contextlib.contextmanager
def _tandem_up(model: Path, home: Path) -> Iterator[int]:
    port = _free_port()
    env = {**os.environ, "TANDEM_HOME": str(home), "RAY_AUTH_MODE": "disabled"}
    proc = subprocess.Popen([sys.executable, "-m", "cli.main", "up", "--model", str(model), "--port", str(port),
                             "--grpc-port", "-1"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                raise RuntimeError("tandem up exited:\n" + "".join(lines[-40:]))
            lines.append(line)
            if "serving OpenAI API at" in line:
                break
        else:
            raise TimeoutError("tandem up did not become ready:\n" + "".join(lines[-40:]))
        yield port
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


def _requests(model: Path, port: int, seed: int) -> tuple[list[float], list[float]]:
    rng = random.Random(seed)  # a round's own prompts: a later round on the same cluster must not hit the cache
    ttft, itl = [], []
    with httpx.Client(timeout=300) as client:
        for i in range(REQUESTS + 1):  # the first one warms the path up and is not counted
            body = {"model": model.name, "prompt": [rng.randrange(300, 8000) for _ in range(PROMPT)],
                    "max_tokens": OUTPUT, "ignore_eos": True, "temperature": 0, "stream": True}
            t0 = time.perf_counter()
            times = []
            with client.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
                assert r.status_code == 200
                for raw in r.iter_lines():
                    if raw.startswith("data: ") and raw != "data: [DONE]":
                        chunk = json.loads(raw[6:])
                        if chunk.get("choices") and chunk["choices"][0].get("text"):
                            times.append(time.perf_counter() - t0)
            assert 2 <= len(times) <= OUTPUT  # tokens may share a chunk when the client falls behind
            if i:
                ttft.append(times[0])
                itl.append((times[-1] - times[0]) / (OUTPUT - 1))
    return ttft, itl


def _drift(a: float, b: float) -> float:
    return abs(a - b) / min(a, b)


def _verdict(before: Ceilings, after: Ceilings, real: tuple[float, float], sim: tuple[float, float],
             report: str) -> None:
    """Skip only when one of the three measured figures moved more than ``STEADY`` between before and after (the
    "GPU" changed speed under the run, so there is nothing to compare with), naming the figure; otherwise assert the
    median request's TTFT and inter-token latency within 20% of the real run's."""
    drifts = {"GEMM rate": _drift(before.gemm_flops, after.gemm_flops),
              "read bandwidth": _drift(before.read_bandwidth, after.read_bandwidth),
              "decode step": _drift(before.decode_step_s, after.decode_step_s),
              "prefill step": _drift(before.prefill_step_s, after.prefill_step_s)}
    worst = max(drifts, key=lambda k: drifts[k])
    if drifts[worst] > STEADY:
        pytest.skip(f"this CPU's {worst} moved {drifts[worst]:.0%} during the run; the calibration needs a machine "
                    f"whose speed holds still within {STEADY:.0%} ({report})")
    assert abs(sim[0] - real[0]) <= 0.2 * real[0], f"TTFT off by more than 20%: {report}"
    assert abs(sim[1] - real[1]) <= 0.2 * real[1], f"inter-token latency off by more than 20%: {report}"


def test_the_comparison_skips_only_on_drift_and_otherwise_asserts_20_percent() -> None:
    """The skip is narrow: a steady machine always gets the 20% assertion, pass or fail; only a measured figure
    that moved more than 25% skips, whatever the latencies."""
    base = Ceilings(100e9, 20e9, 0.040, PROMPT, 1, 0.5)
    steady = Ceilings(110e9, 18e9, 0.048, PROMPT, 1, 0.55)  # each figure within 25% of base
    _verdict(base, steady, (1.0, 0.040), (1.15, 0.034), "r")  # +15% / -15%: passes
    for sim in ((1.25, 0.040), (1.0, 0.031)):  # TTFT +25%, then inter-token -22.5%: fails, not skipped
        with pytest.raises(AssertionError, match="off by more than 20%"):
            _verdict(base, steady, (1.0, 0.040), sim, "r")
    for moved, name in ((Ceilings(70e9, 20e9, 0.040, PROMPT, 1, 0.5), "GEMM rate"),
                        (Ceilings(100e9, 15e9, 0.040, PROMPT, 1, 0.5), "read bandwidth"),
                        (Ceilings(100e9, 20e9, 0.052, PROMPT, 1, 0.5), "decode step"),
                        (Ceilings(100e9, 20e9, 0.040, PROMPT, 1, 0.65), "prefill step")):
        with pytest.raises(pytest.skip.Exception, match=f"{name} moved"):
            _verdict(base, moved, (1.0, 0.040), (1.0, 0.040), "r")  # even a perfect prediction: nothing to compare


ROUNDS = 2  # measurement rounds on one tandem up; a systematic error fails every one


def _round(model: Path, cfg: ModelConfig, home: Path, port: int, seed: int
           ) -> tuple[Ceilings, Ceilings, tuple[float, float], tuple[float, float], str]:
    """One measurement: ceilings, the real requests, ceilings again; and the simulator's prediction from them."""
    threads = _worker_threads(home, "decode")
    before = worker_ceilings(model, PROMPT, OUTPUT, threads)
    real_ttft, real_itl = _requests(model, port, seed)
    after = worker_ceilings(model, PROMPT, OUTPUT, threads)
    ceilings = Ceilings((before.gemm_flops + after.gemm_flops) / 2, (before.read_bandwidth + after.read_bandwidth) / 2,
                        (before.decode_step_s + after.decode_step_s) / 2, PROMPT, threads,
                        (before.prefill_step_s + after.prefill_step_s) / 2)
    trace = [TraceRequest(1000.0 * i, PROMPT, OUTPUT, (1000 + 2 * i, 1001 + 2 * i)) for i in range(REQUESTS)]
    sim_ttft, sim_itl = predict(cfg, ceilings, trace)
    real = (statistics.median(real_ttft), statistics.median(real_itl))
    sim = (statistics.median(sim_ttft), statistics.median(sim_itl))
    report = (f"TTFT real {real[0]:.3f} s sim {sim[0]:.3f} s; ITL real {real[1] * 1e3:.1f} ms sim "
              f"{sim[1] * 1e3:.1f} ms (per request {', '.join(f'{x * 1e3:.1f}' for x in real_itl)}); worker threads "
              f"{threads}; ceilings before {before}, after {after}")
    return before, after, real, sim, report


@pytest.mark.slow
def test_the_simulator_on_this_cpus_ceilings_predicts_a_real_tandem_up_run_within_20_percent(
        tmp_path: Path) -> None:
    """Up to ``ROUNDS`` rounds on the same ``tandem up``: the first round within 20% (and steady) passes; a round
    that misses is measured again, because on a 2-CPU CI machine a neighbour's burst during the requests (not seen
    by the before/after ceilings) once put the real inter-token latency 34% above its quiet value. An error of the
    model itself misses in every round and fails with every round's figures."""
    model = write_tiny_checkpoint(tmp_path / "small-llama", arch="llama", size="small")
    cfg = ModelConfig.from_dir(model)
    home = tmp_path / "home"
    misses: list[str] = []
    with _tandem_up(model, home) as port:
        for seed in range(ROUNDS):
            before, after, real, sim, report = _round(model, cfg, home, port, seed)
            print(report)
            try:
                _verdict(before, after, real, sim, report)
                return
            except AssertionError as e:
                misses.append(str(e).split("\n")[0])
    raise AssertionError(f"every round missed: {misses}")
