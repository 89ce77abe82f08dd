"""``tandem bench quant --kernels``: the weight-only kernels alone, on the model's real projection shapes.

One process, pinned to one CPU, one thread (``OMP_NUM_THREADS=1`` and ``torch.set_num_threads(1)``, so the kernel's
OpenMP and oneDNN both run on the caller's thread). For each projection the engine runs through a quantized kernel
(q|k|v fused, o, gate|up fused, down; the shapes come from the model's ``config.json``) and for the dense
``lm_head`` (which stays bf16 in every configuration), ``--layers`` distinct random weights are built per
configuration (default the model's layer count, so they stream from memory as in the model, not from a warm cache):
bf16 through :func:`engine.models.layers.linear` on a prepacked weight (what the bf16 engine runs), INT8 per channel
and INT4 grouped by 128 through :class:`engine.quant.kernels.QuantLinear`. Each round times one call on every copy,
configuration after configuration in a rotating order, so load that comes and goes falls on all of them alike.
The figure is the thread's CPU time per call (``CLOCK_THREAD_CPUTIME_ID``: time the thread was descheduled by other
jobs does not count), median over rounds with the range; wall time per call is kept beside it.

``per_token`` adds up one decode step's projections (each shape times the layer count, plus the bf16 lm_head in
every configuration), the part of a single-sequence token that these kernels decide.

``tandem bench quant --interleaved`` (:func:`interleaved_decode`) is the end-to-end counterpart: the bf16 model and
each quantized copy loaded in one pinned single-threaded process, single-sequence decode timed round by round in a
rotating order, in process CPU time, so that load which comes and goes cannot favour the configuration that happened
to run in a quiet minute (as it can in ``tandem bench quant``'s one-process-per-configuration runs).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

CONFIGS = ("bf16", "w8a16", "w4a16")
INT4_GROUP = 128


def projection_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """``name -> (inputs, outputs)`` of one layer's projections as the engine fuses them, and the lm_head."""
    hidden = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    kv = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    inter = int(cfg["intermediate_size"])
    return {"qkv": (hidden, (heads + 2 * kv) * head_dim), "o": (heads * head_dim, hidden),
            "gate_up": (hidden, 2 * inter), "down": (inter, hidden), "lm_head": (hidden, int(cfg["vocab_size"]))}


def _impls(config: str, k: int, n: int, copies: int, gen: Any) -> list[Callable[..., Any]] | None:
    """``copies`` callables ``x -> y`` for one configuration and shape; None when the shape does not take it."""
    import torch

    from engine.models.layers import linear, prepack_linear_weight
    from engine.quant.kernels import QuantLinear, wq_linear_kernel
    from engine.quant.weights import QuantizedMatrix

    if config == "bf16":
        out = []
        for _ in range(copies):
            w = torch.randn(n, k, generator=gen).bfloat16()
            prepack_linear_weight(w)
            out.append(lambda x, w=w: linear(x, w))
        return out
    fn = wq_linear_kernel()
    group = k if config == "w8a16" else INT4_GROUP
    if fn is None or k % group:
        return None
    bits = 8 if config == "w8a16" else 4
    lim = 2 ** (bits - 1)
    out = []
    for _ in range(copies):
        q = torch.randint(-lim, lim, (n, k), generator=gen, dtype=torch.int8)
        scale = torch.rand(n, k // group, generator=gen) / 64 + 1e-3
        out.append(QuantLinear(QuantizedMatrix(q, scale, None, bits), fn))
    return out


def _time_round(calls: list[Callable[..., Any]], x: Any) -> tuple[float, float]:
    """CPU and wall seconds per call over one call on every copy."""
    c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
    for f in calls:
        f(x)
    c1, w1 = time.thread_time_ns(), time.perf_counter_ns()
    return (c1 - c0) / 1e9 / len(calls), (w1 - w0) / 1e9 / len(calls)


def _summary(cpu: list[float], wall: list[float]) -> dict[str, Any]:
    us = [v * 1e6 for v in cpu]
    return {"cpu_us_median": statistics.median(us), "cpu_us_min": min(us), "cpu_us_max": max(us),
            "wall_us_median": statistics.median(v * 1e6 for v in wall), "rounds": len(us)}


def measure(cfg: dict[str, Any], rows_list: list[int], rounds: int, layers: int, cpu: int | None) -> dict[str, Any]:
    import torch

    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    shapes = projection_shapes(cfg)
    results: dict[str, dict[str, dict[str, Any]]] = {}
    for name, (k, n) in shapes.items():
        copies = layers if name != "lm_head" else 1
        impls = {c: _impls(c, k, n, copies, gen) for c in (CONFIGS if name != "lm_head" else ("bf16",))}
        runnable = {c: f for c, f in impls.items() if f is not None}
        for rows in rows_list:
            x = torch.randn(rows, k, generator=gen).bfloat16()
            for f in runnable.values():  # warm-up: builds, packs, first-touch
                for call in f:
                    call(x)
            samples: dict[str, tuple[list[float], list[float]]] = {c: ([], []) for c in runnable}
            order = list(runnable)
            for r in range(rounds):
                for c in order[r % len(order):] + order[:r % len(order)]:
                    c_s, w_s = _time_round(runnable[c], x)
                    samples[c][0].append(c_s)
                    samples[c][1].append(w_s)
            cell = {c: _summary(*samples[c]) for c in runnable}
            for c in impls:
                if c not in runnable:
                    cell[c] = {"skipped": f"{k} inputs take no group of {INT4_GROUP}" if c == "w4a16"
                               else "no native kernel"}
            base = cell["bf16"]["cpu_us_median"]
            for c in runnable:
                if c != "bf16":
                    cell[c]["speedup_vs_bf16"] = base / cell[c]["cpu_us_median"]
            results.setdefault(name, {})[str(rows)] = {"inputs": k, "outputs": n, **cell}
    return {"shapes": {k: {"inputs": v[0], "outputs": v[1]} for k, v in shapes.items()}, "results": results,
            "per_token": _per_token(results, rows_list, int(cfg["num_hidden_layers"]))}


def _per_token(results: dict[str, dict[str, dict[str, Any]]], rows_list: list[int], layers: int) -> dict[str, Any]:
    """One decode step's projections per configuration (median CPU us), and the ratios to bf16."""
    out: dict[str, Any] = {}
    for rows in rows_list:
        key = str(rows)
        head = results["lm_head"][key]["bf16"]["cpu_us_median"]
        step: dict[str, Any] = {}
        for c in CONFIGS:
            cells = [results[s][key][c] for s in results if s != "lm_head"]
            if any("cpu_us_median" not in cell for cell in cells):
                continue
            step[f"{c}_us"] = layers * sum(cell["cpu_us_median"] for cell in cells) + head
        for c in CONFIGS[1:]:
            if f"{c}_us" in step:
                step[f"{c}_speedup_vs_bf16"] = step["bf16_us"] / step[f"{c}_us"]
        out[key] = step
    return out


def default_model() -> Path:
    """The built-in small Llama (~113M parameters), generated on first use: both quant benches' default."""
    from controlplane.paths import DEFAULT_MODEL_DIR
    from tinymodel.checkpoint import write_tiny_checkpoint

    path = DEFAULT_MODEL_DIR.parent / "small-llama"
    if not (path / "config.json").is_file():
        write_tiny_checkpoint(path, arch="llama", size="small")
    return path


def quantized_copy(model: Path, scheme: str) -> Path:
    """``model`` quantized by ``tandem model quantize`` into ``scheme``, written beside it once and reused."""
    from engine.quant.quantize import quantize_checkpoint

    out = model.parent / f"{model.name}-{scheme}"
    if not (out / "config.json").is_file():
        quantize_checkpoint(model, out, scheme)
    return out


def run_kernel_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Run :func:`measure` in a fresh single-threaded process (OpenMP reads its thread count at start)."""
    model = Path(args.model) if args.model else default_model()
    cpu = args.cpu if args.cpu is not None else max(os.sched_getaffinity(0))
    cmd = [sys.executable, "-m", "bench.quant_kernels", "--model", str(model), "--rows", args.rows, "--rounds",
           str(args.rounds), "--cpu", str(cpu), *(["--layers", str(args.layers)] if args.layers else [])]
    return _run_pinned(cmd, "the kernel bench")


def _run_pinned(cmd: list[str], what: str) -> dict[str, Any]:
    """Run one of this module's measuring processes (one OpenMP thread) from the repository root; its JSON report,
    the last line it prints. RuntimeError naming ``what`` with its stderr's tail if it fails."""
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          timeout=3600, cwd=Path(__file__).resolve().parents[1])
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    report: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return report


def format_kernel_report(report: dict[str, Any]) -> str:
    lines = [f"model {report['model']}: one thread pinned to CPU {report['cpu']}, {report['layers']} weights per "
             f"shape, {report['rounds']} interleaved rounds; thread CPU us per call, median [min-max]"]
    for name, by_rows in report["results"].items():
        for rows, cell in by_rows.items():
            parts = []
            for c in CONFIGS:
                r = cell.get(c)
                if r is None:
                    continue
                if "skipped" in r:
                    parts.append(f"{c} skipped ({r['skipped']})")
                    continue
                ratio = f" {r['speedup_vs_bf16']:.2f}x" if "speedup_vs_bf16" in r else ""
                parts.append(f"{c} {r['cpu_us_median']:.1f} [{r['cpu_us_min']:.1f}-{r['cpu_us_max']:.1f}]{ratio}")
            lines.append(f"{name} {cell['inputs']}->{cell['outputs']} M={rows}: " + ", ".join(parts))
    for rows, step in report["per_token"].items():
        parts = [f"{c} {step[f'{c}_us'] / 1000:.2f} ms" + (f" ({step[f'{c}_speedup_vs_bf16']:.2f}x)"
                                                           if f"{c}_speedup_vs_bf16" in step else "")
                 for c in CONFIGS if f"{c}_us" in step]
        lines.append(f"per decode step of M={rows} (projections + bf16 lm_head): " + ", ".join(parts))
    return "\n".join(lines)


def interleaved_decode(models: dict[str, str], input_len: int, output_len: int, rounds: int,
                       cpu: int | None) -> dict[str, Any]:
    """Single-sequence decode of every configuration in this one process, interleaved round by round in a rotating
    order: ``(t(output_len tokens) - t(1 token)) / (output_len - 1)`` for one prompt, in process CPU time (time spent
    descheduled by other jobs does not count) and wall time, median over rounds with the range."""
    import torch

    from bench.throughput import make_prompts
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    torch.set_num_threads(1)
    llms = {name: LLM(path, dtype="bfloat16", num_threads=1, enable_prefix_caching=False)
            for name, path in models.items()}
    vocab = next(iter(llms.values())).engine.model_config.vocab_size
    prompt = make_prompts(1, input_len, vocab)
    full = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for llm in llms.values():
        llm.generate(prompt, full)
    cpu_ms: dict[str, list[float]] = {n: [] for n in llms}
    wall_ms: dict[str, list[float]] = {n: [] for n in llms}
    order = list(llms)
    for r in range(rounds):
        for name in order[r % len(order):] + order[:r % len(order)]:
            c0, w0 = time.process_time(), time.perf_counter()
            llms[name].generate(prompt, one)
            c1, w1 = time.process_time(), time.perf_counter()
            llms[name].generate(prompt, full)
            c2, w2 = time.process_time(), time.perf_counter()
            cpu_ms[name].append(((c2 - c1) - (c1 - c0)) * 1000 / (output_len - 1))
            wall_ms[name].append(((w2 - w1) - (w1 - w0)) * 1000 / (output_len - 1))
    out: dict[str, Any] = {}
    for name in llms:
        med = statistics.median(cpu_ms[name])
        out[name] = {"cpu_ms_per_token_median": med, "cpu_ms_per_token_min": min(cpu_ms[name]),
                     "cpu_ms_per_token_max": max(cpu_ms[name]), "wall_ms_per_token_median":
                     statistics.median(wall_ms[name]), "rounds": rounds}
    base = out["bf16"]["cpu_ms_per_token_median"]
    for name in out:
        if name != "bf16":
            out[name]["speedup_vs_bf16"] = base / out[name]["cpu_ms_per_token_median"]
    return out


def run_interleaved_bench(args: argparse.Namespace) -> dict[str, Any]:
    """:func:`interleaved_decode` on the dense model in bf16 and each quantized copy, in a fresh pinned process."""
    model = Path(args.model) if args.model else default_model()
    models = {"bf16": str(model)} | {s: str(quantized_copy(model, s)) for s in args.schemes.split(",") if s}
    cpu = args.cpu if args.cpu is not None else max(os.sched_getaffinity(0))
    cmd = [sys.executable, "-m", "bench.quant_kernels", "--decode", json.dumps(models), "--input-len",
           str(args.input_len), "--output-len", str(args.output_len), "--rounds", str(args.rounds), "--cpu", str(cpu)]
    return _run_pinned(cmd, "the interleaved decode bench")


def format_interleaved_report(report: dict[str, Any]) -> str:
    lines = [f"single-sequence decode, {report['input_len']}-token prompt, {report['output_len']} tokens, one thread "
             f"pinned to CPU {report['cpu']}, {report['rounds']} interleaved rounds; process CPU ms per token, "
             "median [min-max]"]
    for name, r in report["results"].items():
        ratio = f", {r['speedup_vs_bf16']:.2f}x bf16" if "speedup_vs_bf16" in r else ""
        lines.append(f"{name}: {r['cpu_ms_per_token_median']:.2f} [{r['cpu_ms_per_token_min']:.2f}-"
                     f"{r['cpu_ms_per_token_max']:.2f}] ms (wall median {r['wall_ms_per_token_median']:.2f}){ratio}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--decode", default=None, help="JSON {name: checkpoint}: interleaved single-sequence decode instead")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=33)
    p.add_argument("--rows", default="1,32")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--cpu", type=int, default=None)
    a = p.parse_args()
    if a.decode:
        results = interleaved_decode(json.loads(a.decode), a.input_len, a.output_len, a.rounds, a.cpu)
        print(json.dumps({"kind": "interleaved_decode", "cpu": a.cpu, "rounds": a.rounds, "input_len": a.input_len,
                          "output_len": a.output_len, "results": results}))
        return
    if a.model is None:
        p.error("--model is required without --decode")
    cfg = json.loads((Path(a.model) / "config.json").read_text())
    layers = a.layers or int(cfg["num_hidden_layers"])
    report = measure(cfg, [int(r) for r in a.rows.split(",") if r], a.rounds, layers, a.cpu)
    print(json.dumps({"kind": "kernels", "model": a.model, "cpu": a.cpu, "layers": layers, "rounds": a.rounds,
                      "rows": a.rows, **report}))


if __name__ == "__main__":
    main()
