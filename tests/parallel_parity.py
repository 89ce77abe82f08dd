"""Shared checks of the parallel-rank tests: greedy parity with transformers, allowing only a demonstrated near-tie.

A TP all-reduce does not add in TP=1's order, so fp32 logits may move by ~1e-7. A greedy token may then differ from
transformers' only where the two best logits were within ``NEAR_TIE`` at that step, and the outputs must agree up to
it; any other difference fails.
"""

from __future__ import annotations

import grpc
import torch

from proto.tandem.v1 import worker_pb2 as pb
from proto.tandem.v1 import worker_pb2_grpc as pb_grpc

NEAR_TIE = 1e-4


def assert_greedy_matches(ours: list[int], ref: list[int], logits: torch.Tensor, what: str) -> None:
    """``logits``: the rows ``ours`` was sampled from, ``[len(ours), vocab]``."""
    assert len(ours) == len(ref), f"{what}: {len(ours)} tokens vs transformers' {len(ref)}"
    for step, (a, b) in enumerate(zip(ours, ref, strict=True)):
        if a != b:
            top2 = torch.topk(logits[step], 2).values
            gap = float(top2[0] - top2[1])
            assert gap < NEAR_TIE, (f"{what}: token {step} is {a}, transformers' {b}, top-2 gap {gap:.3g} is no "
                                    f"near-tie; ours {ours}, transformers {ref}")
            return  # past a near-tie the continuations legitimately differ


def assert_bit_identical(got: list[torch.Tensor], want: list[torch.Tensor], what: str) -> None:
    assert len(got) == len(want), what
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.shape == w.shape, f"{what}: prompt {i} logits {tuple(g.shape)} vs {tuple(w.shape)}"
        if not torch.equal(g, w):
            diff = float((g - w).abs().max())
            raise AssertionError(f"{what}: prompt {i} logits differ from the split-emulating reference by {diff:.3g}")


def serve_greedy(address: str, prompt: list[int], max_new: int) -> tuple[list[int], torch.Tensor, int]:
    """A worker's greedy tokens for ``prompt`` over ``Generate``, each step's top-2 logprobs (``[steps, 2]``, for
    :func:`assert_greedy_matches`) and the prompt tokens it served from its cache."""
    with grpc.insecure_channel(address) as ch:
        chunks = list(pb_grpc.WorkerStub(ch).Generate(pb.GenerateRequest(
            prompt_token_ids=prompt, params=pb.SamplingParams(max_tokens=max_new, temperature=0, ignore_eos=True,
                                                              logprobs=2)), timeout=240))
    ids = [t for c in chunks for t in c.token_ids]
    tops = torch.tensor([[top.logprob for top in lp.top[:2]] for c in chunks for lp in c.logprobs])
    return ids, tops, chunks[-1].num_cached_tokens


def assert_all_blocks_free(address: str) -> None:
    """The worker runs nothing, holds nothing, and every KV block is free."""
    with grpc.insecure_channel(address) as ch:
        load = pb_grpc.WorkerStub(ch).Load(pb.LoadRequest(), timeout=30)
    assert (load.running, load.waiting, load.used_blocks, load.held_blocks) == (0, 0, 0, 0), load
    assert load.free_blocks == load.total_blocks
