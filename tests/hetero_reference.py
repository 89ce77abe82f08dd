"""The split-emulating reference of heterogeneous P/D: prefill at TP=a hands its KV to decode at TP=b.

The prompt is prefilled by the reference at TP=a (ranks as threads of one process, partials added in rank order,
as :func:`engine.parallel.emulated.emulate`), which samples the first token. Its ranks' prompt KV, heads
concatenated in rank order and split again for TP=b (KV heads are split contiguously, as ``kvtransfer/plan.py``
maps them), is then written through the engine's KV-connector seam (``engine/kv_connector.py``) into the blocks
the TP=b reference's ranks reserve for it, exactly as a landing transfer would; those ranks decode the rest. So
every token's logits are those a served prefill TP=a -> decode TP=b pair must produce bit for bit, and its
logprobs (``log_softmax`` of them, by the same sampler) float for float.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from engine.kv_connector import EngineKV, FinishedTransfers, KVConnector, LoadDone
from engine.llm import LLM, CompletionOutput
from engine.models.decoder import _identity
from engine.parallel.config import ParallelConfig
from engine.parallel.emulated import generate_on_threads
from engine.parallel.thread_group import ThreadGroup
from engine.request import Request, TokenLogprobs
from engine.sampling_params import SamplingParams


class _Connector(KVConnector):
    """One reference rank's side of the hand-off: on prefill it notes the prompt's block ids (the blocks are freed
    at the end but nothing else runs on the engine, so their KV stays intact); on decode it writes the given KV
    into the reserved blocks and reports the load at the next step, with the prefill's first token."""

    def __init__(self, landing: tuple[list[tuple[torch.Tensor, torch.Tensor]], TokenLogprobs] | None = None) -> None:
        self.landing = landing  # per layer (K, V) [tokens, local heads, head_dim], and the first token
        self.block_ids: list[int] = []
        self.loaded: list[LoadDone] = []
        self.kv: EngineKV | None = None

    def num_remote_tokens(self, request: Request) -> int:
        return request.num_prompt_tokens if self.landing is not None else 0

    def request_finished(self, request: Request, block_ids: list[int]) -> bool:
        self.block_ids = list(block_ids)
        return False

    def has_pending(self) -> bool:
        return bool(self.loaded)

    def register_kv_caches(self, kv: EngineKV) -> None:
        self.kv = kv

    def start_load_kv(self, request: Request, block_ids: list[int]) -> None:
        assert self.landing is not None and self.kv is not None
        layers, first = self.landing
        bs = self.kv.block_size
        for (k_cache, v_cache), (k, v) in zip(self.kv.kv_caches, layers, strict=True):
            for cache, src in ((k_cache, k), (v_cache, v)):
                for i, block in enumerate(block_ids):
                    rows = src[i * bs:(i + 1) * bs]
                    cache[block, :len(rows)] = rows
        self.loaded.append(LoadDone(request.request_id, first.token_id, first))

    def get_finished(self) -> FinishedTransfers:
        loaded, self.loaded = self.loaded, []
        return FinishedTransfers(loaded=loaded)


def _run_ranks(model: str, tp: int, prompt: list[int], params: SamplingParams, connector: Callable[[int], _Connector],
               llm_kwargs: dict[str, Any]) -> tuple[CompletionOutput, list[LLM]]:
    """``prompt`` through a TP=``tp`` reference (one thread per rank, one ThreadGroup); rank 0's output."""
    parallel = ParallelConfig(tp=tp)
    group = ThreadGroup(tp)
    llms = []
    for rank in range(tp):
        llm = LLM(model, shard=parallel.shard(rank), tp_reduce=group.reducer(rank) if tp > 1 else _identity,
                  **llm_kwargs)
        llm.engine.attach_connector(connector(rank))
        llms.append(llm)
    return generate_on_threads(llms, group, [prompt], params, name="hetero-ref")[0], llms


def hetero_reference(model: str, prompt: Sequence[int], prefill_tp: int, decode_tp: int, params: SamplingParams,
                     **llm_kwargs: Any) -> CompletionOutput:
    """What a prefill TP=``prefill_tp`` -> decode TP=``decode_tp`` pair samples for ``prompt``: rank 0 of the
    decode reference's output, whose first token (and its logprobs) the prefill reference sampled."""
    prompt = list(prompt)
    first_params = dataclasses.replace(params, max_tokens=1)
    prefill_conns = [_Connector() for _ in range(prefill_tp)]
    first, prefill_llms = _run_ranks(model, prefill_tp, prompt, first_params, lambda r: prefill_conns[r], llm_kwargs)
    assert len(first.token_ids) == 1 and first.logprobs, "the prefill reference samples one token, with logprobs"
    n = len(prompt)
    layers: list[tuple[torch.Tensor, torch.Tensor]] = []
    num_layers = len(prefill_llms[0].engine.kv_caches)
    for layer in range(num_layers):
        pair = []
        for side in (0, 1):
            parts = []  # each prefill rank's heads of the prompt's tokens, in rank order
            for llm, conn in zip(prefill_llms, prefill_conns, strict=True):
                cache = llm.engine.kv_caches[layer][side]
                parts.append(cache[conn.block_ids].reshape(-1, *cache.shape[2:])[:n])
            pair.append(torch.cat(parts, dim=1))
        layers.append((pair[0], pair[1]))
    heads = layers[0][0].shape[1]
    if heads % decode_tp:
        raise ValueError(f"{heads} KV heads cannot be split across decode TP={decode_tp}")
    per = heads // decode_tp

    def landing(rank: int) -> _Connector:
        mine = [(k[:, rank * per:(rank + 1) * per].clone(), v[:, rank * per:(rank + 1) * per].clone())
                for k, v in layers]
        return _Connector((mine, first.logprobs[0]))

    out, decode_llms = _run_ranks(model, decode_tp, prompt, params, landing, llm_kwargs)
    for llm in [*prefill_llms, *decode_llms]:
        llm.engine.check_block_accounting()
    assert out.token_ids[0] == first.token_ids[0]
    return out

