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

import pytest
from parallel_parity import assert_all_blocks_free, assert_greedy_matches, serve_greedy

from worker.launcher import start_worker

pytestmark = pytest.mark.slow

MAX_NEW = 8
FLAGS = ["--ep", "2", "--num-kv-blocks", "64", "--max-num-batched-tokens", "48", "--session-port", "-1"]


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_ep2_worker_serves_tokens_equal_to_transformers_and_frees_every_block(
        arch: str, checkpoint: Callable[[str], Path], hf_greedy: Callable[[Path, list[int], int], list[int]]) -> None:
    path = checkpoint(arch)
    worker = start_worker("both", str(path), "tcp", FLAGS, timeout_s=300)
    try:
        rng = random.Random(28)
        prompts = [[rng.randrange(2040) for _ in range(n)] for n in (1, 6, 40)]
        with ThreadPoolExecutor(len(prompts)) as pool:
            results = list(pool.map(lambda p: serve_greedy(worker.address, p, MAX_NEW), prompts))
        for prompt, (ids, tops, _) in zip(prompts, results, strict=True):
            assert tops.shape == (MAX_NEW, 2)
            assert_greedy_matches(ids, hf_greedy(path, prompt, MAX_NEW), tops, f"EP=2 worker {arch}, {len(prompt)}")
        assert_all_blocks_free(worker.address)
        assert worker.proc.poll() is None
    finally:
        worker.stop(timeout=30)
