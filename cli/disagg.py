"""``tandem generate --mode disaggregated``: one prefill and one decode worker as separate processes on loopback.

Prompts are tokenized here, sent through the full handoff concurrently (so the workers batch them), and printed in
prompt order in the same format as colocated mode. With ``--tp N`` each worker is a replica of N ranks (its child
processes, joined by gloo), and every prefill rank sends its own heads' KV to the decode rank holding them (tcp or
nixl); the split is checked against the model before any worker starts.
"""

from __future__ import annotations

import argparse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from router.handoff import WorkerClient, disaggregated_generate
from worker.convert import params_to_proto
from worker.launcher import resolve_kv_backend, start_worker


@dataclass(slots=True)
class Result:
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    num_cached_tokens: int = 0


def worker_flags(args: argparse.Namespace) -> list[str]:
    flags = ["--dtype", args.dtype, "--max-num-batched-tokens", str(args.max_num_batched_tokens),
             "--max-num-seqs", str(args.max_num_seqs), "--block-size", str(args.block_size)]
    if args.num_kv_blocks:
        flags += ["--num-kv-blocks", str(args.num_kv_blocks)]
    if args.max_model_len:
        flags += ["--max-model-len", str(args.max_model_len)]
    if args.no_prefix_caching:
        flags.append("--no-prefix-caching")
    if args.threads:
        flags += ["--threads", str(args.threads)]
    if args.speculative:  # the decode worker speculates; the prefill worker ignores it
        k = 4 if args.num_speculative_tokens is None else args.num_speculative_tokens
        flags += ["--speculative", args.speculative, "--num-speculative-tokens", str(k)]
    if max(args.tp, args.pp, args.ep) > 1:
        flags += ["--tp", str(args.tp), "--pp", str(args.pp), "--ep", str(args.ep)]
    return flags


def check_ranks(args: argparse.Namespace) -> None:
    """ValueError naming the constraint a ``--tp/--pp/--ep`` split breaks, before any worker or rank starts: the
    model's heads, layers or experts, and what moving KV rank to rank needs (TP only, a tcp or nixl backend)."""
    from engine.model_config import ModelConfig
    from engine.parallel.config import ParallelConfig
    from worker.server import rank_kv_refusal

    parallel = ParallelConfig(tp=args.tp, ep=args.ep, pp=args.pp)
    if parallel.world_size == 1:
        return
    if args.speculative:
        raise ValueError("--speculative runs with --tp/--ep/--pp 1")
    cfg = ModelConfig.from_dir(args.model)
    parallel.check_model(cfg)
    why = rank_kv_refusal(parallel, cfg.num_kv_heads, resolve_kv_backend(args.kv_backend))
    if why is not None:
        raise ValueError(f"--mode disaggregated with ranks: {why}")


def generate_disaggregated(args: argparse.Namespace, prompts: list[str], params: SamplingParams) -> list[Result]:
    check_ranks(args)
    tok = Tokenizer(args.model)
    ids = [tok.encode(p) for p in prompts]
    flags = worker_flags(args)
    timeout_s = 120.0 * max(args.tp, args.pp, args.ep)  # every rank loads its shard, on however many cores
    workers = []
    try:
        workers.append(start_worker("prefill", args.model, args.kv_backend, flags, timeout_s=timeout_s))
        workers.append(start_worker("decode", args.model, args.kv_backend, flags, timeout_s=timeout_s))
        prefill, decode = (WorkerClient.connect(w.address) for w in workers)
        wire = params_to_proto(params)

        def run(i: int) -> Result:
            res = Result(ids[i])
            # The answer is printed whole, so the decode worker may send it in few messages (output pacing).
            for chunk in disaggregated_generate(prefill, decode, f"cli-{i}", ids[i], wire, min_chunk_tokens=32):
                res.token_ids.extend(chunk.token_ids)
                res.text += chunk.text
                res.num_cached_tokens = max(res.num_cached_tokens, chunk.num_cached_tokens)
                if chunk.finish_reason:
                    res.finish_reason = chunk.finish_reason
            return res

        with ThreadPoolExecutor(max_workers=min(64, len(ids))) as pool:
            results = list(pool.map(run, range(len(ids))))
        prefill.close()
        decode.close()
        return results
    finally:
        for w in workers:
            w.stop()
