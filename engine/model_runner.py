"""Turns a scheduler step into one forward pass and one sampling call.

Inputs are built in preallocated numpy buffers exposed to torch without copies (``torch.from_numpy``), so a step
allocates only the small per-step index tensors. Logits are computed only for rows that produce a token: the last
new token of each request whose computed length reaches its full length this step.

A pipeline stage sets ``micro_batches``: a step of decodes then runs as that many forward calls over consecutive
slices of the batch, so that stage ``s`` computes slice ``k + 1`` while stage ``s + 1`` computes slice ``k`` (each
forward sends its hidden states on as soon as its layers are done).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch

from engine.attention import AttentionMetadata, build_metadata, native_attention_supported
from engine.lora.manager import LoRAManager
from engine.models.decoder import Attention, CausalLM
from engine.prompt_logprobs import add_prompt_logprobs
from engine.request import Request
from engine.sampler import Sampler, SampleResult
from engine.scheduler import SchedulerOutput


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: torch.Tensor | None  # rows of the flat batch that produce a token; None: every row, in order
    sample_requests: list[Request]
    verify: list[tuple[Request, int]]  # speculated requests and their row count, after the sampled rows


class ModelRunner:
    def __init__(self, model: CausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int,
                 max_num_tokens: int, max_num_seqs: int, max_model_len: int,
                 block_ids: Callable[[str], list[int]], sampler: Sampler, device: torch.device) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.block_ids = block_ids
        self.sampler = sampler
        self.device = device
        self._ids = np.zeros(max_num_tokens, dtype=np.int64)
        self._pos = np.zeros(max_num_tokens, dtype=np.int64)
        self._ids_t = torch.from_numpy(self._ids)
        self._pos_t = torch.from_numpy(self._pos)
        self._arange = np.arange(max_model_len + 1, dtype=np.int64)  # positions of a chunk, sliced
        self._tables = np.zeros((max_num_seqs, -(-max_model_len // block_size) + 1), dtype=np.int64)
        self.sliding_window = model.cfg.sliding_window
        attn = cast(Attention, model.layers[0].self_attn)
        self._native = native_attention_supported(attn.heads, attn.kv_heads, attn.head_dim, model.dtype, device)
        self._native_prefill = model.dtype == torch.float32  # bf16 prefills and lone decodes stay on SDPA
        self.micro_batches = 1
        self.lora: LoRAManager | None = None  # set by the engine when LoRA adapters are configured

    def prepare(self, out: SchedulerOutput, drafts: dict[str, list[int]] | None = None) -> StepInputs:
        """``drafts``: proposed tokens of decoding requests (``engine/spec``): such a request's rows are its last
        token then its drafts, and each of them produces logits (``verify``), after the sampled rows."""
        n = len(out.requests)
        q_lens = np.asarray(out.num_new_tokens, dtype=np.int64)
        verify_rows: list[int] = []
        verify: list[tuple[Request, int]] = []
        ctx = np.empty(n, dtype=np.int64)
        if n > self._tables.shape[0]:
            self._tables = np.zeros((n, self._tables.shape[1]), dtype=np.int64)
        tables = self._tables[:n]
        sample_rows = []
        sample_reqs = []
        t = 0
        ctx_max = 0
        all_decodes = True
        ids, pos = self._ids, self._pos
        for i, (req, q) in enumerate(zip(out.requests, out.num_new_tokens, strict=True)):
            start = req.num_computed_tokens
            d = drafts.get(req.request_id) if drafts else None
            if d:
                q = 1 + len(d)
                q_lens[i] = q
            end = start + q
            if d:
                all_decodes = False
                ids[t] = req.all_token_ids[start]
                ids[t + 1 : t + q] = d
                pos[t : t + q] = self._arange[start:end] if end < len(self._arange) else np.arange(start, end)
                verify_rows.extend(range(t, t + q))
                verify.append((req, q))
            elif q == 1:
                ids[t] = req.all_token_ids[start]
                pos[t] = start
            else:
                all_decodes = False
                ids[t : t + q] = req.all_token_ids[start:end]
                pos[t : t + q] = self._arange[start:end] if end < len(self._arange) else np.arange(start, end)
            ctx[i] = end
            ctx_max = max(ctx_max, end)
            row = self.block_ids(req.request_id)
            tables[i, : len(row)] = row
            t += q
            if end == req.num_tokens and not d:
                sample_rows.append(t - 1)
                sample_reqs.append(req)
        width = -(-ctx_max // self.block_size)
        native = self._native and (self._native_prefill or (n > 1 and all_decodes))
        meta = build_metadata(q_lens, ctx, tables[:, :width], self.block_size, self.sliding_window, self.device,
                              native=native)
        on_cpu = self.device.type == "cpu"
        input_ids, positions = self._ids_t[:t], self._pos_t[:t]
        return StepInputs(
            input_ids=input_ids if on_cpu else input_ids.to(self.device, non_blocking=True),
            positions=positions if on_cpu else positions.to(self.device, non_blocking=True),
            meta=meta,
            # Every row samples (a step of decodes): no gather at all.
            sample_rows=None if all_decodes and len(sample_rows) == t else torch.tensor(sample_rows + verify_rows,
                                                                          dtype=torch.long, device=self.device),
            sample_requests=sample_reqs,
            verify=verify,
        )

    def _forward_micro_batches(self, out: SchedulerOutput, inputs: StepInputs,
                               after_layer: Callable[[int], None] | None) -> torch.Tensor:
        """A step of decodes (one token per request, rows in request order) as ``micro_batches`` forward calls."""
        n = len(out.requests)
        ctx = np.fromiter((r.num_computed_tokens + 1 for r in out.requests), dtype=np.int64, count=n)
        m = min(self.micro_batches, n)
        bounds = [n * k // m for k in range(m + 1)]
        parts = []
        for a, b in itertools.pairwise(bounds):
            width = -(-int(ctx[a:b].max()) // self.block_size)
            native = self._native and (self._native_prefill or b - a > 1)  # as prepare() chooses
            meta = build_metadata(np.ones(b - a, dtype=np.int64), ctx[a:b], self._tables[a:b, :width],
                                  self.block_size, self.sliding_window, self.device, native=native)
            parts.append(self.model(inputs.input_ids[a:b], inputs.positions[a:b], meta, self.kv_caches,
                                    after_layer=after_layer))
        return torch.cat(parts)

    def execute(self, out: SchedulerOutput,
                after_layer: Callable[[int], None] | None = None) -> tuple[list[Request], SampleResult | None]:
        reqs, result, _ = self.execute_spec(out, after_layer)
        return reqs, result

    @torch.inference_mode()
    def execute_spec(self, out: SchedulerOutput, after_layer: Callable[[int], None] | None = None,
                     drafts: dict[str, list[int]] | None = None
                     ) -> tuple[list[Request], SampleResult | None, list[tuple[Request, torch.Tensor]]]:
        """One forward; the sampled requests and their tokens, and each speculated request's logits over its
        ``1 + len(drafts)`` rows for verification (``engine/spec``)."""
        inputs = self.prepare(out, drafts)
        self.sampler.prefetch(inputs.sample_requests)  # grammar masks fill on their thread during the forward
        if self.lora is not None:
            self.lora.begin_step(out.requests, [1 + len(drafts[r.request_id]) if drafts and drafts.get(r.request_id)
                                                else n for r, n in zip(out.requests, out.num_new_tokens, strict=True)])
        if self.micro_batches > 1 and inputs.sample_rows is None and len(out.requests) > 1:
            hidden = self._forward_micro_batches(out, inputs, after_layer)
        else:
            hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta, self.kv_caches,
                                after_layer=after_layer)
        if any(r.params.prompt_logprobs is not None for r in out.requests):
            add_prompt_logprobs(hidden, out.requests, out.num_new_tokens, self.model.compute_logits)
        if not inputs.sample_requests and not inputs.verify:
            return [], None, []
        rows = hidden if inputs.sample_rows is None else hidden.index_select(0, inputs.sample_rows)
        logits = self.model.compute_logits(rows)
        ns = len(inputs.sample_requests)
        verified = []
        r = ns
        for req, q in inputs.verify:
            verified.append((req, logits[r : r + q]))
            r += q
        if not ns:
            return [], None, verified
        return inputs.sample_requests, self.sampler(logits[:ns], inputs.sample_requests), verified
