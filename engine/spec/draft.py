"""The draft-model proposer: a smaller model with the target's tokenizer guesses the next K tokens greedily.

The draft runs as its own :class:`LLMEngine` (its own paged KV cache, prefix caching on). Each step every
speculated request becomes a draft request whose prompt is the target request's tokens so far, decoded greedily
for K tokens; the prefix cache holds the full blocks of earlier steps, so a step recomputes at most one block's
tail plus K decode steps, batched over all requests. Rejected tokens need no rollback in the draft: nothing stays
live between steps. A greedy draft is a deterministic proposal (q one-hot), which the rejection sampler handles.

A draft whose tokenizer differs from the target's (another vocabulary, other special tokens) is refused at start:
its token ids would mean other text.
"""

from __future__ import annotations

import itertools
import json
from typing import Any, Protocol

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer


def tokenizer_identity(tok: Tokenizer) -> tuple[Any, ...]:
    """What two tokenizers must share for their ids to be interchangeable: vocabulary, added tokens, bos/eos."""
    doc = json.loads(tok.to_json())
    added = sorted((t["id"], t["content"], bool(t.get("special"))) for t in doc.get("added_tokens", []))
    vocab = doc.get("model", {}).get("vocab")
    return (json.dumps(vocab, sort_keys=True), added, tok.bos_token_id, tok.eos_token_id)


def check_same_tokenizer(target: Tokenizer, draft: Tokenizer, draft_dir: str) -> None:
    """ValueError unless ``draft`` tokenizes exactly as ``target`` does."""
    if tokenizer_identity(target) != tokenizer_identity(draft):
        raise ValueError(f"draft model {draft_dir!r} has a different tokenizer from the target model (vocabulary, "
                         "added tokens or bos/eos differ); speculative decoding needs the same token ids")


class DraftEngine(Protocol):
    """The draft's engine (an :class:`engine.llm_engine.LLMEngine`, built by the target's engine)."""

    max_model_len: int

    def add_request(self, prompt: list[int], params: SamplingParams, request_id: str | None = None) -> str: ...

    def has_unfinished(self) -> bool: ...

    def step(self) -> list[Any]: ...

    def abort(self, request_ids: list[str]) -> list[Any]: ...


def draft_engine_config(draft_dir: str, target: EngineConfig, max_model_len: int, k: int) -> EngineConfig:
    """The draft's engine: the target's dtype, device, threads and batch limits, a quarter of its KV budget."""
    return EngineConfig(
        model=draft_dir, dtype=target.dtype, device=target.device, max_model_len=max_model_len + k + 1,
        seed=target.seed, num_threads=target.num_threads,
        cache=CacheConfig(block_size=target.cache.block_size,
                          memory_budget_bytes=max(target.cache.memory_budget_bytes // 4, 64 << 20)),
        scheduler=SchedulerConfig(max_num_seqs=target.scheduler.max_num_seqs,
                                  max_num_batched_tokens=max(target.scheduler.max_num_batched_tokens, 2048)),
    )


class DraftProposer:
    def __init__(self, engine: DraftEngine, vocab_size: int) -> None:
        self.engine = engine
        self.vocab_size = vocab_size  # the target's vocabulary: a draft id at or beyond it ends the proposal
        self._ids = itertools.count()

    def propose_batch(self, items: list[tuple[list[int], int]]) -> list[list[int]]:
        """For each (token ids, k): up to k tokens the draft decodes greedily after them."""
        eng = self.engine
        rids: list[str | None] = []
        for ids, k in items:
            if k <= 0 or len(ids) + k >= eng.max_model_len:
                rids.append(None)
                continue
            rid = f"draft-{next(self._ids)}"
            eng.add_request(ids, SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True), request_id=rid)
            rids.append(rid)
        done: dict[str, list[int]] = {}
        try:
            while eng.has_unfinished():
                for out in eng.step():
                    if out.finished:
                        done[out.request_id] = list(out.token_ids)
        except BaseException:
            eng.abort([r for r in rids if r is not None])
            raise
        proposals = []
        for r in rids:
            toks = done.get(r, []) if r is not None else []
            toks = list(itertools.takewhile(lambda t: t < self.vocab_size, toks))
            proposals.append(toks)
        return proposals
