"""The split-emulating reference: a replica's ranks as threads of one process, summing partials in rank order.

It builds the same per-rank shards as :class:`engine.parallel.llm.ParallelLLM` and runs them through
:class:`engine.parallel.thread_group.ThreadGroup`, so its logits are those of a TP=1 computation that adds the same
partial products in the same order. Real ranks must match it bit for bit (tests only).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch

from engine.llm import LLM, CompletionOutput
from engine.model_config import ModelConfig
from engine.models.decoder import _identity
from engine.parallel.config import ParallelConfig
from engine.parallel.logit_recorder import LogitRecorder
from engine.parallel.thread_group import ThreadGroup
from engine.sampling_params import SamplingParams


def emulate(model: str, parallel: ParallelConfig, prompts: Sequence[str | list[int]], params: SamplingParams,
            micro_batches: int = 1, **llm_kwargs: Any) -> tuple[list[CompletionOutput], list[torch.Tensor], list[LLM]]:
    """Rank 0's outputs and logits rows (per prompt), and every rank's engine (for block accounting).
    ``micro_batches``: split decode steps as a pipeline of that many stages would."""
    parallel.check_model(ModelConfig.from_dir(model))
    if parallel.pp > 1:
        raise ValueError("the split-emulating reference runs one pipeline stage (a pipeline changes no arithmetic)")
    group = ThreadGroup(parallel.world_size)
    llms, recorders = [], []
    for rank in range(parallel.world_size):
        red = group.reducer(rank)
        by_reduce = parallel.ep > 1 and parallel.ep_dispatch == "all_reduce"
        llm = LLM(model, shard=parallel.shard(rank), tp_reduce=red if parallel.tp > 1 else _identity,
                  ep_reduce=red if by_reduce else _identity, **llm_kwargs)
        if parallel.ep > 1 and not by_reduce:
            llm.engine.model.attach_expert_exchange(group.exchange(parallel.shard(rank).ep_rank, parallel.ep_dispatch))
        llm.engine.runner.micro_batches = micro_batches
        llms.append(llm)
        rec = LogitRecorder.attach(llm.engine)
        rec.enabled = True
        recorders.append(rec)
    return generate_on_threads(llms, group, prompts, params), recorders[0].take(), llms


def generate_on_threads(llms: Sequence[LLM], group: ThreadGroup, prompts: Sequence[str | list[int]],
                        params: SamplingParams, name: str = "emulated") -> list[CompletionOutput]:
    """``prompts`` through every rank's engine at once, one thread per rank joined by ``group``; rank 0's outputs.
    A rank that raises aborts the group (the others' collectives return) and its error is raised here."""
    results: list[list[CompletionOutput] | None] = [None] * len(llms)
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            results[rank] = llms[rank].generate(prompts, params)
        except BaseException as e:
            errors.append(e)
            group.abort()

    threads = [threading.Thread(target=run, args=(r,), name=f"{name}-rank{r}") for r in range(len(llms))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    assert results[0] is not None
    return results[0]
