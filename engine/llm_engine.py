"""The engine loop: add requests, ``step()`` until done, collect outputs.

One ``step()`` = schedule → forward → sample → append tokens → check stops → free finished requests. The engine is
single-threaded and synchronous; workers drive it from their own loop.

A disaggregated role attaches a KV connector (``engine/kv_connector.py``): each step then starts with the
connector's finished transfers (held blocks freed, landed requests joining the batch, failed ones ended) and each
layer's forward is followed by the connector's ``save_kv_layer``. Without one (colocated) none of that runs.
"""

from __future__ import annotations

import gc
import itertools
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import torch

from engine.block_hash import extra_keys_for
from engine.block_pool import BlockPool, KVEventBatch
from engine.config import EngineConfig
from engine.cpu_runtime import configure_cpu_runtime
from engine.detokenizer import IncrementalDetokenizer
from engine.kv_cache import allocate_kv_cache, num_blocks_for
from engine.kv_cache_manager import KVCacheManager
from engine.kv_connector import EngineKV, FinishedTransfers, KVConnector, LoadDone
from engine.loader import load_model
from engine.lora.config import LoRAConfig
from engine.lora.manager import LoRAManager, UnknownAdapterError
from engine.model_runner import ModelRunner
from engine.models.decoder import AllReduce, Attention, Pipe, ShardSpec, _identity
from engine.request import Request, RequestStatus, TokenLogprobs
from engine.sampler import Sampler, SampleResult
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.spec.decoder import SpecDecoder, build_proposer
from engine.spec.draft import DraftProposer, check_same_tokenizer, draft_engine_config
from engine.structured.compiler import GrammarCompiler
from engine.tokenizer import Tokenizer


class PromptTooLongError(ValueError):
    """The prompt does not fit in the model's context (leaving room for at least one generated token)."""


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request. ``new_*`` is the delta; the rest is cumulative."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    text: str = ""
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # prompt tokens 1.., when asked for


def _eos_ids(model_dir: Path, config_eos: tuple[int, ...], tok_eos: int | None) -> tuple[int, ...]:
    ids = set(config_eos)
    gen = model_dir / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        if isinstance(eos, list):
            ids.update(int(e) for e in eos)
        elif eos is not None:
            ids.add(int(eos))
    if tok_eos is not None and not ids:
        ids.add(tok_eos)
    return tuple(sorted(ids))


class LLMEngine:
    def __init__(self, config: EngineConfig, shard: ShardSpec | None = None, tp_reduce: AllReduce = _identity,
                 ep_reduce: AllReduce = _identity, pipe: Pipe | None = None) -> None:
        self.config = config
        if config.device == "cpu":
            configure_cpu_runtime(config.num_threads)
        model_dir = Path(config.model)
        self.tokenizer = Tokenizer(model_dir)
        device = torch.device(config.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("device cuda requested but torch.cuda.is_available() is False")
        dtype = config.torch_dtype
        self.model, self.model_config = load_model(model_dir, dtype, config.device,
                                                   shard=shard, tp_reduce=tp_reduce, ep_reduce=ep_reduce, pipe=pipe)
        cfg = self.model_config
        self.max_model_len = min(config.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        cache = config.cache
        kv_heads = cast(Attention, self.model.layers[0].self_attn).kv_heads
        num_blocks = num_blocks_for(cache, cfg, dtype, kv_heads)
        # A sequence can never outgrow the whole cache: it would preempt itself forever.
        cache_tokens = num_blocks * cache.block_size
        if config.max_model_len is not None and config.max_model_len > cache_tokens:
            raise ValueError(f"max_model_len={config.max_model_len} exceeds the KV cache ({num_blocks} blocks x "
                             f"{cache.block_size} = {cache_tokens} tokens); add blocks or lower max_model_len")
        self.max_model_len = min(self.max_model_len, cache_tokens)
        self.block_size = cache.block_size
        self.kv_caches = allocate_kv_cache(cfg.num_layers, num_blocks, cache.block_size, kv_heads, cfg.head_dim,
                                           dtype, device, layers=self.model.stage)
        self.pool = BlockPool(num_blocks, cache.enable_prefix_caching)
        self.kv = KVCacheManager(self.pool, cache.block_size)
        self.scheduler = Scheduler(config.scheduler, self.kv, self.max_model_len)
        self.sampler = Sampler(torch.Generator().manual_seed(config.seed), vocab_size=cfg.vocab_size)
        self.runner = ModelRunner(self.model, self.kv_caches, cache.block_size,
                                  config.scheduler.max_num_batched_tokens, config.scheduler.max_num_seqs,
                                  self.max_model_len, self.kv.block_ids, self.sampler, device)
        self.spec: SpecDecoder | None = None
        if config.speculative is not None:
            self.spec = self._spec_decoder(config)
        self.eos_token_ids = _eos_ids(model_dir, cfg.eos_token_ids, self.tokenizer.eos_token_id)
        self.extra_keys = extra_keys_for(model=model_dir.name)
        self.lora: LoRAManager | None = None
        if config.lora is not None and config.lora.adapters:
            self.lora = self._lora_manager(config.lora, shard)
        self._grammars: GrammarCompiler | None = None
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._ids = itertools.count()
        self.connector: KVConnector | None = None
        self.num_steps = 0
        self.num_scheduled_tokens = 0
        self.step_seconds = 0.0
        self.schedule_seconds = 0.0
        gc.collect()
        gc.freeze()

    def _spec_decoder(self, config: EngineConfig) -> SpecDecoder:
        spec = config.speculative
        assert spec is not None

        def draft() -> DraftProposer:
            path = str(spec.draft_model)
            check_same_tokenizer(self.tokenizer, Tokenizer(Path(path)), path)
            engine = LLMEngine(draft_engine_config(path, config, self.max_model_len, spec.num_speculative_tokens))
            return DraftProposer(engine, self.model_config.vocab_size)

        return SpecDecoder(spec, build_proposer(spec, draft), self.kv, self.max_model_len,
                           config.scheduler.max_num_batched_tokens)

    def _lora_manager(self, config: LoRAConfig, shard: ShardSpec | None) -> LoRAManager:
        if shard is not None and (shard.tp_size > 1 or shard.pp_size > 1 or shard.ep_size > 1):
            raise ValueError("LoRA adapters run on a single-rank engine only (no --tp/--pp/--ep)")
        manager = LoRAManager(config, self.model_config, self.config.torch_dtype)
        manager.attach(self.model.layers)
        self.runner.lora = manager
        return manager

    # ---- requests ------------------------------------------------------------------------------------------

    def make_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                     stream_text: bool = False, lora: str | None = None) -> Request:
        """``lora``: the name of a configured adapter to run the request under (None: the base model)."""
        extra_keys = self.extra_keys
        if lora is not None:
            if self.lora is None:
                raise UnknownAdapterError(f"unknown LoRA adapter {lora!r}; this engine serves none")
            self.lora.check(lora)
            extra_keys = extra_keys_for(model=Path(self.config.model).name, lora=lora)
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("prompt is empty")
        if len(ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"prompt has {len(ids)} tokens; the model's context is {self.max_model_len} tokens and at least one "
                "must be left to generate"
            )
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
        bad = [t for t, _ in params.logit_bias if t >= vocab]
        if bad:
            raise ValueError(f"logit_bias token ids out of range [0, {vocab}): {bad[:5]}")
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        req = Request(rid, ids, params, eos_token_ids=self.eos_token_ids, extra_keys=extra_keys,
                      block_size=self.block_size, lora=lora)
        if params.structured is not None:
            n = params.structured.num_replay_tokens
            if n >= len(ids):
                raise ValueError(f"structured output replays {n} tokens of a {len(ids)}-token prompt")
            req.matcher = self.grammars.matcher(params.structured, ids[len(ids) - n:] if n else None)
        if params.stop or stream_text:
            self._detok[rid] = IncrementalDetokenizer(self.tokenizer, params.stop, params.include_stop_str_in_output,
                                                      params.skip_special_tokens)
        return req

    @property
    def grammars(self) -> GrammarCompiler:
        """The structured-output compiler (built on the first constrained request: ~1 s for a large vocabulary)."""
        if self._grammars is None:
            eos = self.eos_token_ids[0] if self.eos_token_ids else None
            self._grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size, eos)
        return self._grammars

    def attach_connector(self, connector: KVConnector) -> None:
        """Make this engine one side of a disaggregated pair (see ``engine/kv_connector.py``); once, before work."""
        if self.connector is not None or self.scheduler.has_unfinished():
            raise RuntimeError("a KV connector is attached once, to an idle engine")
        self.connector = connector
        self.scheduler.connector = connector
        connector.register_kv_caches(EngineKV(self.kv_caches, self.model_config.num_layers, self.block_size,
                                              self.kv.block_ids))

    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                    stream_text: bool = False, lora: str | None = None) -> str:
        req = self.make_request(prompt, params, request_id, stream_text, lora)
        if not self.add(req):
            raise ValueError(f"request {req.request_id!r}: not enough free KV blocks for its remote KV")
        return req.request_id

    def add(self, request: Request) -> bool:
        """Queue a request from :meth:`make_request`. False (nothing kept) only when the connector has its prompt's
        KV come from another engine and the blocks for it are not free now; ValueError if it can never run. A
        request waiting for remote KV has its blocks reserved and its receive started when this returns."""
        rid = request.request_id
        try:
            added = self.scheduler.add(request)
        except ValueError:
            self._detok.pop(rid, None)
            raise
        if not added:
            self._detok.pop(rid, None)
            return False
        if self.connector is not None and request.status == RequestStatus.WAITING_FOR_REMOTE_KV:
            try:
                self.connector.start_load_kv(request, list(self.kv.block_ids(rid)))
            except Exception:
                self.abort([rid])
                raise
        return True

    def abort(self, request_ids: list[str]) -> list[RequestOutput]:
        outputs = []
        for req in self.scheduler.abort(request_ids):
            outputs.append(self._output(req, [], ""))
            self._detok.pop(req.request_id, None)
        return outputs

    def has_unfinished(self) -> bool:
        """Requests not finished, or the connector's transfers still in flight (a step polls them)."""
        return self.scheduler.has_unfinished() or (self.connector is not None and self.connector.has_pending())

    def has_runnable(self) -> bool:
        """Requests a step can compute (not those waiting for remote KV): without any, a loop may sleep."""
        return bool(self.scheduler.waiting or self.scheduler.running)

    def idle_wait_s(self, default: float) -> float:
        """How long a loop with nothing runnable may sleep: the connector's wait while requests wait for remote
        KV (its finished transfers wake the loop), else ``default``."""
        c = self.connector
        if c is not None and c.remote_wait_s is not None and self.scheduler.remote:
            return c.remote_wait_s
        return default

    # ---- the loop ------------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        c = self.connector
        outputs = self._apply(c.get_finished()) if c is not None else []
        sched = self.scheduler.schedule()
        t1 = time.perf_counter()
        if not sched:
            return outputs
        if c is not None:
            c.bind_step(sched.requests, sched.num_new_tokens)
        drafts = self.spec.plan(sched) if self.spec is not None else None
        reqs, result, verified = self.runner.execute_spec(sched, None if c is None else c.save_kv_layer, drafts)
        self.scheduler.finish_step(sched)
        outputs += self._process(reqs, result)
        if verified:
            outputs += self._process_verified(verified)
        if self.spec is not None:  # the step's cost with its extra rows, for the cost-aware policy
            self.spec.observe_step(time.perf_counter() - t1)
        self.num_steps += 1
        self.num_scheduled_tokens += sched.total_tokens
        t2 = time.perf_counter()
        self.schedule_seconds += t1 - t0
        self.step_seconds += t2 - t0
        return outputs

    def _process(self, reqs: list[Request], result: SampleResult | None) -> list[RequestOutput]:
        if result is None:
            return []
        now = time.monotonic()
        return [self._accept_token(req, token, lp, now)
                for req, token, lp in zip(reqs, result.token_ids, result.logprobs, strict=True)
                if not req.is_finished]

    def _process_verified(self, verified: list[tuple[Request, torch.Tensor]]) -> list[RequestOutput]:
        """Speculated requests: the verified tokens appended one by one (stops checked after each), one output."""
        spec = self.spec
        assert spec is not None
        now = time.monotonic()
        outputs = []
        for req, logits in verified:
            if req.is_finished:
                continue
            tokens = spec.verify(req, logits, self.sampler.generator)
            out = None
            new_text = []
            for token in tokens:
                out = self._accept_token(req, token, None, now)
                new_text.append(out.new_text)
                if req.is_finished:
                    break
            assert out is not None
            n = len(new_text)
            out.new_token_ids = tokens[:n]
            out.new_text = "".join(new_text)
            outputs.append(out)
            if not req.is_finished:
                spec.settle(req, n)
        return outputs

    def _accept_token(self, req: Request, token: int, lp: TokenLogprobs | None, now: float) -> RequestOutput:
        """Append one sampled token: detokenize, check stops, finish (freeing blocks) if it ends the request."""
        req.append_token(token)
        if req.matcher is not None:
            req.matcher.consume_token(token)
        if req.first_token_time is None:
            req.first_token_time = now
        if lp is not None:
            req.logprobs.append(lp)
        new_text = ""
        detok = self._detok.get(req.request_id)
        if detok is not None:
            new_text = detok.add(token, match_stops=req.num_output_tokens >= req.params.min_tokens)
        status = self._check_stop(req, token, detok)
        if status is not None:
            if detok is not None and detok.stopped_on is None:
                new_text += detok.flush()
            self.scheduler.finish(req, status)
        out = self._output(req, [token], new_text)
        if req.is_finished:
            self._detok.pop(req.request_id, None)
        return out

    # ---- the KV connector's finished transfers -------------------------------------------------------------------

    def _apply(self, done: FinishedTransfers) -> list[RequestOutput]:
        if not done:
            return []
        for rid in done.sent:
            self.scheduler.free_held(rid)
        outputs = []
        for failed in done.failed:
            out = self.finish_request(failed.request_id, RequestStatus.FINISHED_ERROR)
            if out is not None:
                out.new_text = failed.message
                outputs.append(out)
        for loaded in done.loaded:
            out = self._start_loaded(loaded)
            if out is not None:
                outputs.append(out)
        return outputs

    def _start_loaded(self, loaded: LoadDone) -> RequestOutput | None:
        """The prompt's KV landed and the remote engine sampled the first token: accept it, join the batch."""
        req = self.scheduler.remote.get(loaded.request_id)
        if req is None:  # ended meanwhile (aborted)
            return None
        out = self._accept_token(req, loaded.first_token, loaded.first_logprob, time.monotonic())
        if not req.is_finished:
            self.scheduler.remote_kv_ready(req.request_id, req.num_prompt_tokens)
        return out

    def finish_request(self, request_id: str, status: RequestStatus) -> RequestOutput | None:
        """End a live request with ``status`` (e.g. FINISHED_ERROR when its KV transfer failed)."""
        req = self.scheduler.requests.get(request_id)
        if req is None:
            return None
        self.scheduler.finish(req, status)
        out = self._output(req, [], "")
        self._detok.pop(request_id, None)
        return out

    def _check_stop(self, req: Request, token: int, detok: IncrementalDetokenizer | None) -> RequestStatus | None:
        p = req.params
        n = req.num_output_tokens
        if req.matcher is not None and req.matcher.is_stopped():  # also true in its error state
            # The grammar is complete (or, never expected, the matcher refused a token: stop rather than sample
            # from an empty mask).
            req.stop_reason = None
            return RequestStatus.FINISHED_STOPPED if not req.matcher.is_error() else RequestStatus.FINISHED_ERROR
        if n >= p.min_tokens:
            if not p.ignore_eos and token in req.eos_token_ids:
                req.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if token in p.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
            if detok is not None and detok.stopped_on is not None:
                req.stop_reason = detok.stopped_on
                return RequestStatus.FINISHED_STOPPED
        if n >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _output(self, req: Request, new_ids: list[int], new_text: str) -> RequestOutput:
        if req.matcher is not None and req.is_finished and req.params.structured is not None:
            self.sampler.settle_masks()  # no mask fill may still hold it
            self.grammars.recycle(req.params.structured, req.matcher)  # its warm lexer serves the next requests
            req.matcher = None
        detok = self._detok.get(req.request_id)
        return RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            token_ids=req.output_token_ids,
            new_token_ids=new_ids,
            new_text=new_text,
            finished=req.is_finished,
            finish_reason=req.status.finish_reason,
            stop_reason=req.stop_reason,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            logprobs=req.logprobs,
            text=detok.text if detok is not None else "",
            prompt_logprobs=req.prompt_logprobs,
        )

    # ---- introspection -------------------------------------------------------------------------------------

    def take_kv_events(self) -> KVEventBatch | None:
        return self.pool.take_events()

    def check_block_accounting(self) -> None:
        """Raise AssertionError unless, with no live requests, every block is free or cached (nothing leaked)."""
        if self.scheduler.has_unfinished():
            raise AssertionError(f"{self.scheduler.num_unfinished} requests still live")
        if self.kv.block_tables:
            raise AssertionError(f"block tables left for {list(self.kv.block_tables)[:5]}")
        if self.kv.held:
            raise AssertionError(f"blocks still held for sends of {list(self.kv.held)[:5]}")
        self.pool.check_accounting()

    @property
    def overhead_fraction(self) -> float:
        """Fraction of step time spent in scheduling (Python bookkeeping before the forward pass)."""
        return self.schedule_seconds / self.step_seconds if self.step_seconds else 0.0
