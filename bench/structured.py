"""``tandem bench structured``: the per-step cost of constrained decoding (a JSON schema) against unconstrained
decoding, at each batch size, side by side in one run on the same engine.

Workload: ``B`` copies of one chat prompt decode ``--steps`` steps each, once with no constraint and once all
constrained by one JSON schema (an object holding an array of at least 50 small objects, so no output can complete
inside the measured steps and the batch stays full). Prefill is done before the clock starts: only decode steps are
timed, through ``LLMEngine.step`` (schedule, forward, mask, sample, matcher advance). The two sides alternate for
``--repeats`` rounds and each reports its median step time; the overhead is ``constrained / unconstrained - 1``.

The grammar is compiled (and cached) before timing, as a server does on the first request with a schema; the mask
of each step is computed by llguidance on its own threads while the forward pass runs (engine/structured/).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.structured.spec import StructuredOutput

SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["items"], "additionalProperties": False,
    "properties": {"items": {"type": "array", "minItems": 50, "items": {
        "type": "object", "required": ["id", "name", "tags"], "additionalProperties": False,
        "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 100000},
                       "name": {"type": "string", "maxLength": 24},
                       "tags": {"type": "array", "maxItems": 4, "items": {"enum": ["red", "green", "blue"]}}}}}}}


def _step_time(engine: LLMEngine, prompt: list[int], batch: int, steps: int, params: SamplingParams) -> float:
    """Median wall time of one decode step of ``batch`` sequences."""
    ids = [engine.add_request(prompt, params) for _ in range(batch)]
    for _ in range(4):  # prefill (all prompts fit one step) and a first decode
        engine.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    engine.abort(ids)
    return statistics.median(times)


def run_structured_bench(model: Path, batch_sizes: tuple[int, ...], steps: int, repeats: int,
                         threads: int | None) -> dict[str, Any]:
    engine = LLMEngine(EngineConfig(model=str(model), num_threads=threads,
                                    cache=CacheConfig(enable_prefix_caching=False),
                                    scheduler=SchedulerConfig(max_num_seqs=max(batch_sizes))))
    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": "List the inventory as JSON."}])
    spec = StructuredOutput("json_schema", json.dumps(SCHEMA), strict=True)
    engine.grammars.grammar(spec)  # compiled once, as on a server's first request with this schema
    budget = steps + 8
    free = SamplingParams(max_tokens=budget, temperature=1.0, seed=0, ignore_eos=True)
    constrained = SamplingParams(max_tokens=budget, temperature=1.0, seed=0, structured=spec)
    rows = []
    for b in batch_sizes:
        _step_time(engine, prompt, b, 4, free)  # warm-up at this batch size
        _step_time(engine, prompt, b, 4, constrained)
        base, cons = [], []
        for _ in range(repeats):
            base.append(_step_time(engine, prompt, b, steps, free))
            cons.append(_step_time(engine, prompt, b, steps, constrained))
        u, c = statistics.median(base), statistics.median(cons)
        rows.append({"batch": b, "unconstrained_step_ms": round(u * 1e3, 3), "json_schema_step_ms": round(c * 1e3, 3),
                     "overhead_pct": round((c / u - 1) * 100, 2)})
    return {"engine": "tandem", "model": str(model), "steps": steps, "repeats": repeats, "threads": threads,
            "library": "llguidance", "rows": rows}


def format_structured_report(report: dict[str, Any]) -> str:
    lines = [f"structured decoding (JSON schema) vs unconstrained, {report['steps']} decode steps x "
             f"{report['repeats']} rounds, median step time", "batch  unconstrained ms  json_schema ms  overhead"]
    for r in report["rows"]:
        lines.append(f"{r['batch']:>5}  {r['unconstrained_step_ms']:>16.3f}  {r['json_schema_step_ms']:>14.3f}  "
                     f"{r['overhead_pct']:>+7.2f}%")
    return "\n".join(lines)
