"""``tandem bench parallel``: tensor parallelism against TP=1 on the same checkpoint, each as rank processes.

For every TP size in ``--tp`` (default ``1,2``) a :class:`engine.parallel.llm.ParallelLLM` is started (TP=1 is one
rank process with every allowed core; TP=N gives each rank its own slice of the cores when there are N or more, and
shares them otherwise), then, after one warm-up:

- ``tokens_per_s``: generated tokens per second for ``--num-prompts`` seeded random prompts of ``--input-len``
  tokens, exactly ``--output-len`` greedy tokens each (median of ``--repeats``);
- ``single_decode_tokens_per_s``: one sequence, ``(M - 1) / (t(M tokens) - t(1 token))`` (prefill excluded);
- ``rss_mb`` and ``weights_mb`` per rank (the weights should be about 1/TP of the model, plus the replicated norms);
- ``allreduce_fraction``: the wall time inside all-reduces over the engine's step time, per rank, in the
  throughput runs. On one host the all-reduce is gloo over loopback TCP; with fewer cores than ranks it also
  includes waiting for the other rank to be scheduled.

Token ids are compared with TP=1's (``same_tokens_as_tp1``).

On a MoE model, ``--ep`` adds expert-parallel sizes: each EP size above 1 runs once per ``--ep-dispatch`` scheme
(``all_gather``, ``all_to_all``, ``all_reduce``; :class:`engine.models.layers.SparseMoE`), and ``exchange_fraction``
is the wall time inside the MoE row exchanges over the step time. The first configuration is the one the others'
tokens are compared with.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import TYPE_CHECKING, Any

from bench.throughput import make_prompts

if TYPE_CHECKING:  # the engine (torch) is imported by the run, not by the `tandem` parser that adds these flags
    from engine.parallel.llm import ParallelLLM
    from engine.sampling_params import SamplingParams


def add_parallel_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True)
    p.add_argument("--tp", default="1,2", help="TP sizes to compare, comma-separated (default 1,2)")
    p.add_argument("--ep", default="1", help="EP sizes (MoE models), comma-separated, each with every --tp size")
    p.add_argument("--ep-dispatch", default="all_gather",
                   help="comma-separated EP dispatch schemes, each run for every EP size above 1 (all_gather, "
                        "all_to_all, all_reduce), in this order")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--single-len", type=int, default=32, help="tokens of the single-sequence decode run")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--num-kv-blocks", type=int, default=512,
                   help="KV blocks on every rank (the same count at every TP: a rank's cache is then 1/TP of TP=1's)")
    p.add_argument("--json", action="store_true")


def _timed(llm: ParallelLLM, prompts: list[list[int]], params: SamplingParams) -> tuple[float, list[list[int]]]:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    return time.perf_counter() - t0, [o.token_ids for o in outs]


def run_one(model: str, tp: int, args: argparse.Namespace, ep: int = 1, dispatch: str = "all_gather"
            ) -> dict[str, Any]:
    from engine.model_config import ModelConfig
    from engine.parallel.config import ParallelConfig
    from engine.parallel.llm import ParallelLLM
    from engine.sampling_params import SamplingParams

    cfg = ModelConfig.from_dir(model)
    prompts = make_prompts(args.num_prompts, args.input_len, cfg.vocab_size)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    one = make_prompts(1, 16, cfg.vocab_size, seed=1)
    first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    many = SamplingParams(max_tokens=args.single_len, temperature=0.0, ignore_eos=True)
    with ParallelLLM(model, ParallelConfig(tp=tp, ep=ep, ep_dispatch=dispatch), dtype=args.dtype,
                     enable_prefix_caching=False,
                     num_kv_blocks=args.num_kv_blocks) as llm:
        _timed(llm, prompts, params)  # warm-up
        llm.stats()
        runs = [_timed(llm, prompts, params) for _ in range(args.repeats)]
        stats = llm.stats()
        singles = []
        for _ in range(args.repeats):
            t1, _ = _timed(llm, one, first)
            tm, _ = _timed(llm, one, many)
            singles.append((args.single_len - 1) / (tm - t1))
        ranks = llm.ranks
    seconds = statistics.median(t for t, _ in runs)
    return {
        "tp": tp,
        "ep": ep,
        "ep_dispatch": dispatch if ep > 1 else None,
        "tokens_per_s": args.num_prompts * args.output_len / seconds,
        "single_decode_tokens_per_s": statistics.median(singles),
        "rss_mb": [round(s["rss_bytes"] / 2**20, 1) for s in stats],
        "weights_mb": [round(r.weight_bytes / 2**20, 1) for r in ranks],
        "cpus": [list(r.cpus) for r in ranks],
        "allreduce_fraction": [round(s["allreduce_s"] / s["step_s"], 3) if s["step_s"] else 0.0 for s in stats],
        "allreduce_calls_per_step": [round(s["allreduce_calls"] / max(s["steps"], 1), 1) for s in stats],
        "exchange_fraction": [round(s["exchange_s"] / s["step_s"], 3) if s["step_s"] else 0.0 for s in stats],
        "token_ids": runs[0][1],
    }


def run_from_args(args: argparse.Namespace) -> dict[str, Any]:
    sizes = [int(t) for t in args.tp.split(",")]
    dispatches = args.ep_dispatch.split(",")
    configs = [(tp, ep, d) for tp in sizes for ep in (int(e) for e in args.ep.split(","))
               for d in (dispatches if ep > 1 else ["all_gather"])]
    results = [run_one(args.model, tp, args, ep, d) for tp, ep, d in configs]
    base = results[0]["token_ids"]
    for r in results:
        r["same_tokens_as_tp1"] = r.pop("token_ids") == base if sizes[0] == 1 else None
    return {"model": args.model, "num_prompts": args.num_prompts, "input_len": args.input_len,
            "output_len": args.output_len, "dtype": args.dtype, "results": results}


def format_report(report: dict[str, Any]) -> str:
    lines = [f"{report['model']}: {report['num_prompts']} prompts x {report['input_len']} in, "
             f"{report['output_len']} out, {report['dtype']}"]
    for r in report["results"]:
        ep = f" EP={r['ep']} {r['ep_dispatch']}" if r.get("ep", 1) > 1 else ""
        lines.append(f"TP={r['tp']}{ep}: {r['tokens_per_s']:.1f} tok/s, single-sequence decode "
                     f"{r['single_decode_tokens_per_s']:.1f} tok/s, RSS/rank {r['rss_mb']} MiB, weights/rank "
                     f"{r['weights_mb']} MiB, all-reduce {r['allreduce_fraction']} and exchange "
                     f"{r.get('exchange_fraction')} of a step, cpus {r['cpus']}, "
                     f"same tokens as TP=1: {r['same_tokens_as_tp1']}")
    return "\n".join(lines)
