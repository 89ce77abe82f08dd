"""``tandem worker --ep 2`` on Mixtral and Qwen3-MoE: a served replica of two real rank processes (rank 0 the worker,
rank 1 its child, gloo on loopback) whose MoE layers exchange rows by the default all-gather, behind the real Worker
gRPC API.

Greedy tokens equal transformers' fp32 ones except at a demonstrated near-tie (``tests/parallel_parity.py``; the
top-2 logprob gap is the top-2 logit gap) for prompts sent at once, and every block is free or cached afterwards.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import torch
from parallel_parity import assert_greedy_matches

from proto.tandem.v1 import worker_pb2 as pb
from proto.tandem.v1 import worker_pb2_grpc as pb_grpc
from worker.launcher import start_worker

pytestmark = pytest.mark.slow

MAX_NEW = 8
FLAGS = ["--ep", "2", "--num-kv-blocks", "64", "--max-num-batched-tokens", "48", "--session-port", "-1"]


def _generate(address: str, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    with grpc.insecure_channel(address) as ch:
        chunks = list(pb_grpc.WorkerStub(ch).Generate(pb.GenerateRequest(
            prompt_token_ids=prompt, params=pb.SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True,
                                                              logprobs=2)), timeout=240))
    ids = [t for c in chunks for t in c.token_ids]
    return ids, torch.tensor([[top.logprob for top in lp.top[:2]] for c in chunks for lp in c.logprobs])


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_ep2_worker_serves_tokens_equal_to_transformers_and_frees_every_block(
        arch: str, checkpoint: Callable[[str], Path], hf_greedy: Callable[[Path, list[int], int], list[int]]) -> None:
    path = checkpoint(arch)
    worker = start_worker("both", str(path), "tcp", FLAGS, timeout_s=300)
    try:
        rng = random.Random(28)
        prompts = [[rng.randrange(2040) for _ in range(n)] for n in (1, 6, 40)]
        with ThreadPoolExecutor(len(prompts)) as pool:
            results = list(pool.map(lambda p: _generate(worker.address, p), prompts))
        for prompt, (ids, tops) in zip(prompts, results, strict=True):
            assert tops.shape == (MAX_NEW, 2)
            assert_greedy_matches(ids, hf_greedy(path, prompt, MAX_NEW), tops, f"EP=2 worker {arch}, {len(prompt)}")
        with grpc.insecure_channel(worker.address) as ch:
            load = pb_grpc.WorkerStub(ch).Load(pb.LoadRequest(), timeout=30)
        assert (load.running, load.waiting, load.used_blocks, load.held_blocks) == (0, 0, 0, 0)
        assert load.free_blocks == load.total_blocks
        assert worker.proc.poll() is None
    finally:
        worker.stop(timeout=30)
