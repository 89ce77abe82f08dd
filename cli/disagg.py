"""``tandem generate --mode disaggregated``: one prefill and one decode worker as separate processes on loopback.

Prompts are tokenized here, sent through the full handoff concurrently (so the workers batch them), and printed in
prompt order in the same format as colocated mode.
"""

from __future__ import annotations

import argparse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from router.handoff import WorkerClient, disaggregated_generate
from worker.convert import params_to_proto
from worker.launcher import start_worker


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
    return flags


def generate_disaggregated(args: argparse.Namespace, prompts: list[str], params: SamplingParams) -> list[Result]:
    tok = Tokenizer(args.model)
    ids = [tok.encode(p) for p in prompts]
    flags = worker_flags(args)
    workers = []
    try:
        workers.append(start_worker("prefill", args.model, args.kv_backend, flags))
        workers.append(start_worker("decode", args.model, args.kv_backend, flags))
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
