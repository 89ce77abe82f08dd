"""Streaming latencies as locust request entries, and the TTFT/ITL percentile summary written at the end.

Each streamed request fires ``TTFT`` (first content), ``ITL`` (each gap between content chunks) and ``E2E`` (last
byte) through ``events.request.fire``, so locust's own statistics, CSV and HTML reports carry their percentiles
beside the HTTP entries (the fw-ai llm_bench pattern). Response times are milliseconds, locust's unit.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from locust.env import Environment

KINDS = ("TTFT", "ITL", "E2E")
PERCENTILES = (0.5, 0.9, 0.99)


class StreamTimer:
    """Times one streamed response: call ``chunk()`` as each content chunk arrives, ``done()`` at the end."""

    def __init__(self, env: Environment, name: str) -> None:
        self.env = env
        self.name = name
        self.start = time.perf_counter()
        self.last: float | None = None
        self.chunks = 0

    def _fire(self, kind: str, seconds: float, exc: BaseException | None = None) -> None:
        self.env.events.request.fire(request_type=kind, name=self.name, response_time=seconds * 1000.0,
                                     response_length=0, exception=exc, context={})

    def chunk(self) -> None:
        now = time.perf_counter()
        if self.last is None:
            self._fire("TTFT", now - self.start)
        else:
            self._fire("ITL", now - self.last)
        self.last = now
        self.chunks += 1

    def done(self) -> None:
        self._fire("E2E", time.perf_counter() - self.start)


def summary(env: Environment) -> dict[str, Any]:
    """TTFT, ITL and E2E percentiles (ms) and counts, over every request name, plus the run's failure count."""
    out: dict[str, Any] = {"failures": env.stats.total.num_failures, "requests": env.stats.total.num_requests}
    for kind in KINDS:
        entries = [e for (name, method), e in env.stats.entries.items() if method == kind]
        if not entries:
            continue
        merged = entries[0].__class__(env.stats, kind, kind)
        for e in entries:
            merged.extend(e)
        out[kind] = {"count": merged.num_requests, "mean_ms": round(merged.avg_response_time, 3),
                     **{f"p{int(p * 100)}_ms": merged.get_response_time_percentile(p) for p in PERCENTILES}}
    return out


def write_summary(env: Environment, path: str) -> dict[str, Any]:
    data = summary(env)
    Path(path).write_text(json.dumps(data, indent=2) + "\n")
    return data
