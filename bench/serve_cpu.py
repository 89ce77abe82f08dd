"""CPU accounting for ``tandem bench serve``: CPU-seconds per output token, per process of a ``tandem up``.

Throughput on a shared machine moves with everyone else's load; CPU time spent per generated token moves far less,
so it is the figure to compare before and after a change to the serving path. Read from ``/proc`` (Linux):

- ``router``: the ``tandem up`` process (the router, the controller and the Ray driver share it);
- one entry per worker, named by its ``--role`` (``prefill``, ``decode``; ``decode`` serves colocated requests too);
- ``ray``: every other process of ``tandem up``'s session (GCS, raylet, the replica actors that own the workers).

A worker names its Python threads in the OS (``worker/aio_server.py``), so its ``engine-loop`` thread, which runs
the scheduler, the forward pass, sampling and detokenization, is counted apart as ``engine_s``; what the process
spends beyond it (gRPC, the session transport, KV transfer threads, the asyncio handlers) is ``overhead_s``.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ENGINE_THREAD = "engine-loop"  # the engine loop's thread name (engine/engine_loop.py), as the worker sets it in the OS
_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def _stat_fields(path: str) -> list[str]:
    """The fields of a ``/proc/.../stat`` file after the command name (which may hold spaces and parentheses)."""
    with open(path) as f:
        return f.read().rsplit(")", 1)[1].split()


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of every thread of ``pid``, live or exited (utime + stime)."""
    f = _stat_fields(f"/proc/{pid}/stat")
    return (int(f[11]) + int(f[12])) * _TICK_S


def thread_cpu_s(pid: int, name: str) -> float:
    """CPU seconds of ``pid``'s live threads named ``name`` in the OS (``/proc/PID/task/TID/comm``)."""
    total = 0.0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as c:
                if c.read().strip() != name:
                    continue
            f = _stat_fields(f"/proc/{pid}/task/{tid}/stat")
        except FileNotFoundError:  # the thread ended between the listing and the read
            continue
        total += (int(f[11]) + int(f[12])) * _TICK_S
    return total


def _role(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        argv = f.read().decode(errors="replace").split("\0")
    return argv[argv.index("--role") + 1] if "--role" in argv[:-1] else "worker"


def _session_pids(sid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getsid(int(entry)) == sid:
                    pids.append(int(entry))
            except OSError:  # gone, or not ours to ask
                continue
    return pids


@dataclass(slots=True)
class CpuSample:
    """CPU seconds per process name at one instant; ``engine_s`` only for workers."""
    at: float
    cpu_s: dict[str, float] = field(default_factory=dict)
    engine_s: dict[str, float] = field(default_factory=dict)


class CpuMeter:
    """Samples the processes of one ``tandem up`` (its state file ``up.json``) before and after a load."""

    def __init__(self, state_file: Path) -> None:
        state = json.loads(state_file.read_text())
        self.router_pid = int(state["pid"])
        self.workers: dict[str, int] = {}
        for pid in sorted(int(p) for p in state["worker_pids"]):
            role = _role(pid)
            name, n = role, 1
            while name in self.workers:  # several replicas of a role: decode, decode-2, ...
                n += 1
                name = f"{role}-{n}"
            self.workers[name] = pid
        self.sid = os.getsid(self.router_pid)

    def sample(self) -> CpuSample:
        s = CpuSample(time.perf_counter())
        s.cpu_s["router"] = process_cpu_s(self.router_pid)
        for name, pid in self.workers.items():
            s.cpu_s[name] = process_cpu_s(pid)
            s.engine_s[name] = thread_cpu_s(pid, ENGINE_THREAD)
        known = {self.router_pid, *self.workers.values()}
        ray = 0.0
        for pid in _session_pids(self.sid):
            if pid not in known:
                try:
                    ray += process_cpu_s(pid)
                except FileNotFoundError:
                    continue
        s.cpu_s["ray"] = ray
        return s


def cpu_report(before: CpuSample, after: CpuSample, output_tokens: int, client_cpu_s: float) -> dict[str, Any]:
    """Per process: CPU seconds over the load and microseconds per output token, split into engine and overhead
    for workers; ``total`` over all of them; ``client`` is the load generator's own CPU (this process)."""
    tokens = max(output_tokens, 1)

    def per_token(seconds: float) -> float:
        return round(seconds / tokens * 1e6, 1)

    procs: dict[str, dict[str, float]] = {}
    for name, end in after.cpu_s.items():
        cpu = max(end - before.cpu_s.get(name, 0.0), 0.0)
        row = {"cpu_s": round(cpu, 3), "us_per_token": per_token(cpu)}
        if name in after.engine_s:
            engine = min(max(after.engine_s[name] - before.engine_s.get(name, 0.0), 0.0), cpu)
            row.update(engine_s=round(engine, 3), engine_us_per_token=per_token(engine),
                       overhead_s=round(cpu - engine, 3), overhead_us_per_token=per_token(cpu - engine))
        procs[name] = row
    total = sum(r["cpu_s"] for r in procs.values())
    engine = sum(r.get("engine_s", 0.0) for r in procs.values())
    wall = after.at - before.at
    return {"wall_s": round(wall, 3), "output_tokens": output_tokens, "processes": procs,
            "total": {"cpu_s": round(total, 3), "us_per_token": per_token(total), "engine_s": round(engine, 3),
                      "engine_us_per_token": per_token(engine), "overhead_s": round(total - engine, 3),
                      "overhead_us_per_token": per_token(total - engine),
                      "cores_busy": round(total / wall, 2) if wall > 0 else None},
            "client": {"cpu_s": round(client_cpu_s, 3), "us_per_token": per_token(client_cpu_s)}}


def format_cpu(name: str, cpu: dict[str, Any]) -> list[str]:
    """Report lines: one per process, µs of CPU per output token (engine + overhead for workers)."""
    rows = [f"{name}: CPU per output token over the load ({cpu['output_tokens']} tokens, {cpu['wall_s']} s): "
            f"total {cpu['total']['us_per_token']} us (engine loop {cpu['total']['engine_us_per_token']}, "
            f"overhead {cpu['total']['overhead_us_per_token']}), {cpu['total']['cores_busy']} cores busy; "
            f"client {cpu['client']['us_per_token']} us"]
    for proc, r in cpu["processes"].items():
        split = (f" (engine loop {r['engine_us_per_token']}, overhead {r['overhead_us_per_token']})"
                 if "engine_s" in r else "")
        rows.append(f"  {proc}: {r['us_per_token']} us{split}")
    return rows
