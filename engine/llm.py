"""Offline Python API: ``LLM(model).generate(prompts, params)``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.llm_engine import LLMEngine, RequestOutput
from engine.lora.config import LoRAConfig
from engine.models.decoder import AllReduce, Pipe, ShardSpec, _identity
from engine.request import TokenLogprobs
from engine.sampling_params import SamplingParams
from engine.spec.config import SpeculativeConfig


@dataclass(slots=True)
class CompletionOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    stop_reason: int | str | None
    num_cached_tokens: int
    logprobs: list[TokenLogprobs]
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # prompt tokens 1.., when asked for


class LLM:
    def __init__(self, model: str, *, dtype: str = "float32", device: str = "cpu", block_size: int = 16,
                 num_kv_blocks: int | None = None, kv_memory_bytes: int = 1 << 30, enable_prefix_caching: bool = True,
                 max_num_batched_tokens: int = 8192, max_num_seqs: int = 256, max_model_len: int | None = None,
                 seed: int = 0, num_threads: int | None = None, shard: ShardSpec | None = None,
                 tp_reduce: AllReduce = _identity, ep_reduce: AllReduce = _identity, pipe: Pipe | None = None,
                 speculative: SpeculativeConfig | None = None, lora: LoRAConfig | None = None) -> None:
        """``shard`` and the reducers make this one rank of a parallel replica (see :mod:`engine.parallel`);
        ``speculative`` turns on speculative decoding (:mod:`engine.spec`); ``lora`` serves adapters
        (:mod:`engine.lora`), which :meth:`generate` selects per prompt by name."""
        self.engine = LLMEngine(EngineConfig(
            model=model, dtype=dtype, device=device, max_model_len=max_model_len, seed=seed, num_threads=num_threads,
            cache=CacheConfig(block_size=block_size, num_blocks=num_kv_blocks, memory_budget_bytes=kv_memory_bytes,
                              enable_prefix_caching=enable_prefix_caching),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens),
            speculative=speculative, lora=lora,
        ), shard=shard, tp_reduce=tp_reduce, ep_reduce=ep_reduce, pipe=pipe)
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: Sequence[str | list[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 lora: str | Sequence[str | None] | None = None) -> list[CompletionOutput]:
        """Generate for every prompt; results come back in prompt order. Prompts are text or token ids; ``lora``
        names the adapter of every prompt, or of each (None: the base model)."""
        if params is None:
            params = SamplingParams()
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(plist)} sampling params")
        loras = [lora] * len(prompts) if lora is None or isinstance(lora, str) else list(lora)
        if len(loras) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(loras)} adapters")
        eng = self.engine
        ids = []
        try:
            for prompt, p, name in zip(prompts, plist, loras, strict=True):
                ids.append(eng.add_request(prompt, p, lora=name))
            final: dict[str, RequestOutput] = {}
            while eng.has_unfinished():
                for out in eng.step():
                    if out.finished:
                        final[out.request_id] = out
        except BaseException:
            eng.abort(ids)
            raise
        results = []
        for rid, p in zip(ids, plist, strict=True):
            out = final[rid]
            text = out.text if p.stop else self.tokenizer.decode(out.token_ids, p.skip_special_tokens)
            results.append(CompletionOutput(out.prompt_token_ids, list(out.token_ids), text, out.finish_reason,
                                            out.stop_reason, out.num_cached_tokens, list(out.logprobs),
                                            list(out.prompt_logprobs)))
        return results
