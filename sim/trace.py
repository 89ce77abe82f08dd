"""Requests to replay: Mooncake-format traces, and synthetic generators that write the same records.

A record is Mooncake's (kvcache-ai/Mooncake FAST'25 trace release): ``timestamp`` (ms from the start),
``input_length``, ``output_length`` (tokens) and ``hash_ids``, one id per 512-token block of the prompt, shared by
requests that share that prefix. ``tokens.py`` turns ids into token ids so that the real block hash sees the shared
prefixes. Synthetic generators give each request a shared system prompt drawn from a few, then blocks of its own:

- ``poisson``: exponential gaps at a constant rate;
- ``bursty``: a Markov-modulated Poisson process, alternating calm and burst periods (rate x ``burst_factor``);
- ``diurnal``: a rate that follows one sinusoidal day compressed into ``period_s`` (a thinned Poisson process).
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

MOONCAKE_BLOCK = 512  # tokens per hash id in Mooncake traces


@dataclass(slots=True, frozen=True)
class TraceRequest:
    arrival_s: float
    input_len: int
    output_len: int
    hash_ids: tuple[int, ...]


def load_mooncake(path: str | Path, speedup: float = 1.0, duration_s: float | None = None,
                  limit: int | None = None) -> list[TraceRequest]:
    """A Mooncake jsonl trace, its clock divided by ``speedup``, cut at ``duration_s`` (of replayed time) or at
    ``limit`` requests."""
    if speedup <= 0:
        raise ValueError(f"speedup must be > 0, got {speedup}")
    out: list[TraceRequest] = []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            rec = json.loads(line)
            t = rec["timestamp"] / 1000.0 / speedup
            if (duration_s is not None and t > duration_s) or (limit is not None and len(out) >= limit):
                break
            inp, outp = int(rec["input_length"]), int(rec["output_length"])
            if inp < 1 or outp < 1:
                continue
            out.append(TraceRequest(t, inp, outp, tuple(rec["hash_ids"])))
    out.sort(key=lambda r: r.arrival_s)
    return out


@dataclass(slots=True, frozen=True)
class SyntheticShape:
    input_mean: int = 2048
    output_mean: int = 256
    num_system_prompts: int = 8
    system_prompt_blocks: int = 2  # Mooncake blocks (x512 tokens) shared by every request with that prompt
    seed: int = 0

    def __post_init__(self) -> None:
        if min(self.input_mean, self.output_mean, self.num_system_prompts) < 1 or self.system_prompt_blocks < 0:
            raise ValueError(f"bad synthetic shape {self}")


def _requests(times: Iterator[float], shape: SyntheticShape, rng: random.Random) -> list[TraceRequest]:
    out = []
    next_id = 1 << 30  # private ids, away from a real trace's
    prompts = [tuple(range(1 + i * 1000, 1 + i * 1000 + shape.system_prompt_blocks))
               for i in range(shape.num_system_prompts)]
    for t in times:
        inp = max(1, int(rng.expovariate(1 / shape.input_mean)))
        outp = max(1, int(rng.expovariate(1 / shape.output_mean)))
        blocks = math.ceil(inp / MOONCAKE_BLOCK)
        shared = rng.choice(prompts)[:blocks]
        own = tuple(range(next_id, next_id + blocks - len(shared)))
        next_id += len(own)
        out.append(TraceRequest(t, inp, outp, shared + own))
    return out


def poisson(rate: float, duration_s: float, shape: SyntheticShape = SyntheticShape()) -> list[TraceRequest]:
    if rate <= 0 or duration_s <= 0:
        raise ValueError("rate and duration_s must be > 0")
    rng = random.Random(shape.seed)

    def times() -> Iterator[float]:
        t = rng.expovariate(rate)
        while t < duration_s:
            yield t
            t += rng.expovariate(rate)

    return _requests(times(), shape, rng)


def bursty(rate: float, duration_s: float, burst_factor: float = 4.0, mean_period_s: float = 60.0,
           burst_fraction: float = 0.2, shape: SyntheticShape = SyntheticShape()) -> list[TraceRequest]:
    """Mean rate ``rate``; a fraction ``burst_fraction`` of the time at ``burst_factor`` times the calm rate."""
    if not 0 < burst_fraction < 1 or burst_factor < 1:
        raise ValueError("need 0 < burst_fraction < 1 and burst_factor >= 1")
    rng = random.Random(shape.seed)
    calm = rate / (1 - burst_fraction + burst_fraction * burst_factor)

    def times() -> Iterator[float]:
        t, burst = 0.0, False
        while t < duration_s:
            span = rng.expovariate(1 / (mean_period_s * (burst_fraction if burst else 1 - burst_fraction) * 2))
            end = min(t + span, duration_s)
            r = calm * (burst_factor if burst else 1.0)
            t += rng.expovariate(r)
            while t < end:
                yield t
                t += rng.expovariate(r)
            t, burst = end, not burst

    return _requests(times(), shape, rng)


def diurnal(peak_rate: float, duration_s: float, period_s: float | None = None, trough_fraction: float = 0.2,
            shape: SyntheticShape = SyntheticShape()) -> list[TraceRequest]:
    """Rate ``peak · (trough + (1 - trough) · (1 - cos(2πt/period)) / 2)``: trough at the start, peak mid-period."""
    period = period_s or duration_s
    if peak_rate <= 0 or period <= 0 or not 0 <= trough_fraction <= 1:
        raise ValueError("need peak_rate > 0, period_s > 0 and trough_fraction in [0, 1]")
    rng = random.Random(shape.seed)

    def rate(t: float) -> float:
        return peak_rate * (trough_fraction + (1 - trough_fraction) * (1 - math.cos(2 * math.pi * t / period)) / 2)

    def times() -> Iterator[float]:
        t = rng.expovariate(peak_rate)
        while t < duration_s:
            if rng.random() * peak_rate <= rate(t):
                yield t
            t += rng.expovariate(peak_rate)

    return _requests(times(), shape, rng)


def write_mooncake(requests: list[TraceRequest], path: str | Path) -> None:
    with open(path, "w") as f:
        for r in requests:
            f.write(json.dumps({"timestamp": round(r.arrival_s * 1000), "input_length": r.input_len,
                                "output_length": r.output_len, "hash_ids": list(r.hash_ids)}) + "\n")
