"""The calibration that can fail: the simulator, given this CPU's measured GEMM rate and read bandwidth as its "GPU",
predicts the TTFT and inter-token latency of a real ``tandem up`` run of the same workload within 20%.

The real side: ``tandem up`` (real Ray, a real prefill and a real decode worker process, the router) on the built-in
small Llama (~110M parameters, float32: big enough that a step is its matmuls and weight reads, not Python), sent
one request at a time (512 random prompt tokens, 32 output tokens, greedy, EOS ignored) over streaming HTTP; TTFT
and the mean gap between tokens are taken at the client. The simulated side: the same model's config.json, the same
requests, one prefill and one decode replica whose "GPU" is ``bench/ceilings.py``'s measurement of this CPU, taken
just before and just after the real run (the mean of the two, so a machine whose load shifts during the test is
seen at the same load as the run), with MFU = MBU = 1 (they are already achieved rates). Nothing is fitted. When
the two measurements differ by more than 25% the machine's speed moved under the run (a shared machine), and the
test is skipped with both figures rather than compared against a moving target.
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
from pathlib import Path

import httpx
import pytest

from engine.model_config import ModelConfig
from sim.calibration import Ceilings, measure_ceilings, predict
from sim.trace import TraceRequest
from tinymodel.checkpoint import write_tiny_checkpoint

pytestmark = pytest.mark.slow

PROMPT, OUTPUT, REQUESTS = 512, 32, 4
STEADY = 0.25  # the most the measured ceilings may move between before and after the real run


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _real_run(model: Path, home: Path) -> tuple[list[float], list[float]]:
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
        rng = random.Random(0)
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
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


@pytest.mark.xfail(strict=True, reason=(
    "measured on a steady machine (ceilings within 14%): TTFT real 1.39 s vs simulated 1.07 s (-23%), inter-token "
    "real 49.6 ms vs simulated 18.1 ms (-64%); the roofline leaves out the engine's per-step cost (Python, norms, "
    "attention, sampling, the token stream), which a decode step of this 110M model is mostly made of. Strict: "
    "the day it passes, this marker must go"))
def test_the_simulator_on_this_cpus_ceilings_predicts_a_real_tandem_up_run_within_20_percent(
        tmp_path: Path) -> None:
    model = write_tiny_checkpoint(tmp_path / "small-llama", arch="llama", size="small")
    cfg = ModelConfig.from_dir(model)
    before = measure_ceilings(cfg, PROMPT, OUTPUT)
    real_ttft, real_itl = _real_run(model, tmp_path / "home")
    after = measure_ceilings(cfg, PROMPT, OUTPUT)
    drift = max(abs(before.gemm_flops - after.gemm_flops) / min(before.gemm_flops, after.gemm_flops),
                abs(before.read_bandwidth - after.read_bandwidth) / min(before.read_bandwidth, after.read_bandwidth))
    ceilings = Ceilings((before.gemm_flops + after.gemm_flops) / 2, (before.read_bandwidth + after.read_bandwidth) / 2)
    trace = [TraceRequest(1000.0 * i, PROMPT, OUTPUT, (1000 + 2 * i, 1001 + 2 * i)) for i in range(REQUESTS)]
    sim_ttft, sim_itl = predict(cfg, ceilings, trace)
    real = (sum(real_ttft) / len(real_ttft), sum(real_itl) / len(real_itl))
    sim = (sum(sim_ttft) / len(sim_ttft), sum(sim_itl) / len(sim_itl))
    report = (f"TTFT real {real[0]:.3f} s sim {sim[0]:.3f} s; ITL real {real[1] * 1e3:.1f} ms sim "
              f"{sim[1] * 1e3:.1f} ms; ceilings before {before}, after {after}")
    print(report)
    if drift > STEADY:
        # The "GPU" changed speed under the run (other work on a shared machine): there is nothing to compare with.
        pytest.skip(f"this CPU's ceilings moved {drift:.0%} during the run; the calibration needs a machine whose "
                    f"speed holds still within {STEADY:.0%} ({report})")
    assert abs(sim[0] - real[0]) <= 0.2 * real[0], report
    assert abs(sim[1] - real[1]) <= 0.2 * real[1], report
