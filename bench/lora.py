"""``tandem bench lora``: a batch mixing 4 LoRA adapters against the same batch on the base model alone.

One workload, ``--num-prompts`` random prompts of ``--input-len`` tokens decoded together (one ``generate`` call,
continuous batching), ``--output-len`` greedy tokens each, ignoring eos. Three sides, built once in this process and
timed in alternation, ``--repeats`` runs each (the median is reported), so load from other processes hits all alike:

- ``base``: an engine without adapters (no LoRA hooks attached): the base model's throughput;
- ``base_hooked``: the engine serving the adapters, every request on the base model: what attaching the hooks costs;
- ``mixed``: that engine with the requests spread round-robin over ``--num-adapters`` adapters (all resident,
  ``max_loras`` = their number): each step adds every adapter's deltas to its own rows of the batch.

The adapters are random (``tandem model init-lora``'s writer) with ``--rank`` on ``--targets``, written to
``--adapters-dir`` (kept) or a temporary directory (removed). Exactness, from the untimed first run of each side:
``base_hooked`` gives the base engine's tokens, and the mixed batch gives each request the tokens it gets in a batch
of its own adapter only (no mixing). ``sample_outputs`` holds the first request of each adapter, for a comparison
with transformers + peft (tests/test_lora_bench.py). The 1-minute load average before and after is reported.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.throughput import make_prompts

ALL_TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"


def add_lora_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF checkpoint (default: the built-in small Llama)")
    p.add_argument("--num-adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--targets", default=ALL_TARGETS, help="comma-separated projections every adapter adapts")
    p.add_argument("--adapters-dir", default=None, help="write the adapters here and keep them (default: a temp dir)")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", action="store_true")


def _check(args: argparse.Namespace) -> None:
    for name in ("num_adapters", "rank", "num_prompts", "input_len", "output_len", "repeats"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")


def _run(llm: Any, prompts: list[list[int]], output_len: int, loras: list[str | None]) -> tuple[float, list[list[int]]]:
    """Output tokens per second of one batched ``generate``, and every request's tokens."""
    from engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, lora=loras)
    elapsed = time.perf_counter() - t0
    return len(prompts) * output_len / elapsed, [o.token_ids for o in outs]


def _per_adapter(llm: Any, prompts: list[list[int]], output_len: int, loras: list[str | None]) -> list[list[int]]:
    """Every request's tokens when each adapter's requests run as a batch of their own."""
    tokens: list[list[int]] = [[] for _ in prompts]
    for name in dict.fromkeys(loras):
        idx = [i for i, n in enumerate(loras) if n == name]
        _, outs = _run(llm, [prompts[i] for i in idx], output_len, [name] * len(idx))
        for i, out in zip(idx, outs, strict=True):
            tokens[i] = out
    return tokens


def run_lora_bench(args: argparse.Namespace) -> dict[str, Any]:
    from bench.quant import _default_model
    from engine.llm import LLM
    from engine.lora.config import LoRAConfig
    from engine.lora.init_random import write_random_adapter

    _check(args)
    model = Path(args.model) if args.model else _default_model()
    targets = tuple(t for t in args.targets.split(",") if t)
    with contextlib.ExitStack() as stack:
        root = Path(args.adapters_dir or stack.enter_context(tempfile.TemporaryDirectory(prefix="tandem-lora-")))
        names = [f"lora{i}" for i in range(args.num_adapters)]
        adapters = tuple((name, str(write_random_adapter(model, root / name, args.rank, targets, seed=i + 1)))
                         for i, name in enumerate(names))
        load_before = os.getloadavg()[0]
        kw: dict[str, Any] = {"num_threads": args.threads, "enable_prefix_caching": False}
        plain = LLM(str(model), **kw)
        hooked = LLM(str(model), lora=LoRAConfig(adapters, max_loras=args.num_adapters), **kw)
        vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
        prompts = make_prompts(args.num_prompts, args.input_len, vocab, seed=1)
        base: list[str | None] = [None] * len(prompts)
        mixed: list[str | None] = [names[i % len(names)] for i in range(len(prompts))]
        sides = {"base": (plain, base), "base_hooked": (hooked, base), "mixed": (hooked, mixed)}
        first = {side: _run(llm, prompts, args.output_len, loras)[1] for side, (llm, loras) in sides.items()}
        exact = {"base_hooked_equals_base": first["base_hooked"] == first["base"],
                 "mixed_equals_per_adapter_batches": first["mixed"] == _per_adapter(hooked, prompts, args.output_len,
                                                                                     mixed)}
        manager = hooked.engine.lora
        assert manager is not None
        loads_before = manager.loads
        runs: dict[str, list[float]] = {side: [] for side in sides}
        for _ in range(args.repeats):
            for side, (llm, loras) in sides.items():
                runs[side].append(_run(llm, prompts, args.output_len, loras)[0])
        med = {side: statistics.median(r) for side, r in runs.items()}
        results = {side: {"tokens_per_s": med[side], "runs": runs[side], "vs_base": med[side] / med["base"]}
                   for side in sides}
        samples = [{"prompt_index": i, "adapter": mixed[i], "token_ids": first["mixed"][i]}
                   for i in range(min(len(names), len(prompts)))]
        return {"model": str(model), "num_adapters": args.num_adapters, "rank": args.rank, "targets": list(targets),
                "adapters_dir": str(root) if args.adapters_dir else None, "num_prompts": args.num_prompts,
                "input_len": args.input_len, "output_len": args.output_len, "repeats": args.repeats,
                "threads": args.threads, "cpus": os.cpu_count(), "load_avg_1m_before": load_before,
                "load_avg_1m_after": os.getloadavg()[0], "results": results, "exact": exact,
                "adapter_loads_while_timed": manager.loads - loads_before, "sample_outputs": samples}


def format_lora_report(report: dict[str, Any]) -> str:
    lines = [f"model {report['model']}: {report['num_prompts']} prompts of {report['input_len']} tokens batched, "
             f"{report['output_len']} tokens each; {report['num_adapters']} adapters of rank {report['rank']} on "
             f"{','.join(report['targets'])}; median of {report['repeats']}; load avg "
             f"{report['load_avg_1m_before']:.1f} -> {report['load_avg_1m_after']:.1f} on {report['cpus']} CPUs",
             f"{'side':<14}{'tok/s':>10}{'vs base':>10}"]
    for side, r in report["results"].items():
        lines.append(f"{side:<14}{r['tokens_per_s']:>10.1f}{r['vs_base']:>9.2f}x")
    ex = report["exact"]
    lines.append(f"exact: base_hooked = base {'yes' if ex['base_hooked_equals_base'] else 'NO'}; mixed = "
                 f"per-adapter batches {'yes' if ex['mixed_equals_per_adapter_batches'] else 'NO'}; adapter loads "
                 f"while timed: {report['adapter_loads_while_timed']}")
    return "\n".join(lines)
