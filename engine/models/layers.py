"""Building blocks shared by every decoder: RMSNorm, rotary embedding, gated MLP and the sparse MoE block.

Numerics follow transformers exactly where it matters for token-for-token parity: RMSNorm in float32 then cast,
rotary cos/sin computed in float32 from the same inverse frequencies and cast to the activation dtype, and MoE
routing softmax in float32.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from engine.cpu_runtime import cpu_vendor
from engine.kernels import LayerOps, layer_ops
from engine.model_config import MoEConfig, RopeConfig

log = logging.getLogger(__name__)


def native_layer_ops(x: torch.Tensor) -> LayerOps | None:
    """The fused C ops of ``engine/kernels/layer_ops.c`` when they apply to ``x`` (fp32 or bf16 on CPU), else None.

    Callers pick the fp32 function or its ``*_bf16`` twin by ``x.dtype``.
    """
    if x.dtype not in _NATIVE_DTYPES or x.device.type != "cpu":
        return None
    return layer_ops()


_NATIVE_DTYPES = (torch.float32, torch.bfloat16)


def _onednn_available() -> bool:
    try:
        return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._linear_pointwise.default is not None
    except (AttributeError, RuntimeError):
        return False


_ONEDNN = _onednn_available()
_ONEDNN_MIN_ROWS = 8
_ONEDNN_MIN_WEIGHT = 1 << 19  # elements: 2 MiB of fp32
_MKL_MAX_ROWS = 2  # fp32 GEMVs of at most this many rows take MKL (see linear())
# ... when the weight has fewer elements than this: any size on Intel, small ones elsewhere (see linear()).
_MKL_GEMV_MAX_WEIGHT = math.inf if cpu_vendor() == "GenuineIntel" else 1 << 18
_PACK_ROWS = 32  # the batch size oneDNN's blocked weight layout is chosen for (a decode batch)


def prepack_linear_weight(weight: torch.Tensor) -> None:
    """Attach oneDNN's blocked copy of a CPU weight as ``weight.packed``; :func:`linear` then reads that.

    A plain weight is re-blocked by oneDNN on every call; packed once at load, decode-sized matmuls run 1.3-2.7x
    faster here (fp32 32x256x2048: 296 -> 111 us; bf16 roughly 2x at every size), with bit-identical results to the
    unpacked oneDNN call for 8 or more rows. The dense weight stays (the embedding table, loaders, other devices).
    """
    if _ONEDNN and weight.device.type == "cpu" and weight.dim() == 2 and weight.dtype in (torch.float32,
                                                                                       torch.bfloat16):
        weight.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_ROWS)  # type: ignore[attr-defined]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``, routed on CPU to whichever GEMM is fastest for the shape and dtype.

    - **fp32, one or two rows** (single-sequence decode): torch's default GEMM (MKL's GEMV). oneDNN's packed call
      has a ~20 us floor per call that MKL does not (tiny model, 256x512 at one row: 9 vs 22 us), and at the
      small model's sizes MKL streams the weight faster too. In-engine A/B (torch 2.13, 2026-12-04, Intel with
      AMX): tiny fp32 single-sequence decode 1.55 -> 1.03 ms per token, small fp32 25.0-26.0 -> 20.8-21.9 ms;
      greedy tokens unchanged. It is also transformers' own fp32 path.
      On other vendors' CPUs only weights under ``_MKL_GEMV_MAX_WEIGHT`` elements take MKL: MKL runs its generic
      code there, and on an AMD EPYC (Zen 4, 2026-12-05) its GEMV streamed a large weight at half oneDNN's rate
      (one row, weight hot: 768x2048 104 vs 58 us, 8192x768 779 vs 288 us; small fp32 single-sequence decode
      31 tok/s with MKL against 51-55 with oneDNN, same tokens), while below ~256k elements its lower per-call
      cost still wins (256x688: 13.5 vs 21.9 us).
    - **Packed weights** (:func:`prepack_linear_weight`), everything else: oneDNN in its blocked layout, with no
      per-call re-blocking. For decode batches and prefills it beats MKL here (fp32 32 rows at 768x4096: 804 vs
      1035 us), and in bf16 it is the AMX kernel at every row count (unpacked bf16 re-blocks per call: 23 vs
      30 us at one row on the tiny model). Bit-identical to the unpacked oneDNN call for 8 or more rows.
    - **Unpacked weights** (MoE experts, sliced per call): oneDNN for 8 or more rows or a large weight, where MKL
      reaches about half of oneDNN on the skinny-K shapes of small models (75 vs 170 GFLOP/s at 4096x256x1376 on
      one core); MKL otherwise.
    - **Quantized weights** (``weight.quant``, attached by :mod:`engine.quant.attach`): that weight-only kernel.
    """
    quant = getattr(weight, "quant", None)
    if quant is not None:
        return quant(x, bias)
    if _ONEDNN and x.device.type == "cpu" and x.dim() == 2:
        packed = getattr(weight, "packed", None)
        if x.shape[0] <= _MKL_MAX_ROWS and x.dtype is torch.float32 and weight.numel() < _MKL_GEMV_MAX_WEIGHT:
            return F.linear(x, weight, bias)
        if packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
        if x.shape[0] >= _ONEDNN_MIN_ROWS or weight.numel() >= _ONEDNN_MIN_WEIGHT:
            return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # transformers: normalise in float32, cast back, then scale by the weight in the activation dtype.
        ops = native_layer_ops(x)
        if ops is not None and x.dim() == 2 and x.stride(1) == 1 and self.weight.dtype is x.dtype:
            rows, dim = x.shape
            out = torch.empty(rows, dim, dtype=x.dtype)
            if x.dtype is torch.float32:
                ops.rms_norm(x.data_ptr(), x.stride(0), self.weight.data_ptr(), out.data_ptr(), rows, dim, self.eps)
            elif native_mean_square_exact(dim):
                ops.rms_norm_bf16(x.data_ptr(), x.stride(0), self.weight.data_ptr(), out.data_ptr(), rows, dim,
                                  self.eps, None)
            else:
                # torch's own reduction: its summation order, and so every bf16 rounding after it, is transformers'
                xf = x.float()
                var = xf.mul_(xf).mean(-1)
                ops.rms_norm_bf16(x.data_ptr(), x.stride(0), self.weight.data_ptr(), out.data_ptr(), rows, dim,
                                  self.eps, var.data_ptr())
            return out
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype)


@functools.cache
def native_mean_square_exact(dim: int) -> bool:
    """Whether the native mean square of ``layer_ops.c`` equals torch's ``x.float().pow(2).mean(-1)`` bit for bit
    at this row length: it replays the summation order of torch's CPU sum kernel, which another torch build or
    dispatch could change. Checked once per length on rows that span many magnitudes; where it differs, RMSNorm
    takes torch's reduction (bf16 greedy output depends on that last bit)."""
    ops = layer_ops()
    if ops is None:
        return False
    g = torch.Generator().manual_seed(dim)
    probe = torch.randn(64, dim, generator=g) * torch.logspace(-3, 3, 64).unsqueeze(1)
    for x in (probe, probe.to(torch.bfloat16)):
        got = torch.empty(64)
        ops.mean_square(x.data_ptr(), x.stride(0), int(x.dtype is torch.bfloat16), 64, dim, got.data_ptr())
        if not torch.equal(got, x.float().pow(2).mean(-1)):
            log.warning("native mean square differs from torch's at dim %d: RMSNorm uses torch's reduction", dim)
            return False
    return True


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        old = rope.original_max_position_embeddings
        low_wavelen = old / rope.low_freq_factor
        high_wavelen = old / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding with a precomputed cos/sin table indexed by absolute position."""

    cos: torch.Tensor  # buffers, registered in __init__
    sin: torch.Tensor

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int, dtype: torch.dtype) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(rope, head_dim)
        freqs = torch.arange(max_positions, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos().to(dtype), persistent=False)
        self.register_buffer("sin", emb.sin().to(dtype), persistent=False)
        self.half_dim = head_dim // 2  # not `half`: that would shadow nn.Module.half()

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows for a step's positions, ``[T, 1, head_dim]``; gathered once per step, used by every layer."""
        return self.cos.index_select(0, positions).unsqueeze(1), self.sin.index_select(0, positions).unsqueeze(1)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``x``: [T, heads, hd] (q and k may be rotated together, stacked on the head axis).

        With the native ops (fp32 or bf16 on CPU) ``x`` is rotated in place and returned; it must be a tensor the
        caller owns (here: a slice of the fresh qkv projection). The result is bit-identical to the torch
        expression below.
        """
        ops = native_layer_ops(x)
        if ops is not None and x.stride(2) == 1 and x.stride(1) == x.shape[2] and cos.is_contiguous() \
                and sin.is_contiguous() and cos.dtype is x.dtype:
            t, heads, hd = x.shape
            fn = ops.rope if x.dtype is torch.float32 else ops.rope_bf16
            fn(x.data_ptr(), x.stride(0), t, heads, hd, cos.data_ptr(), sin.data_ptr())
            return x
        rot = torch.cat((-x[..., self.half_dim :], x[..., : self.half_dim]), dim=-1)
        return x * cos + rot * sin  # not addcmul: keep transformers' rounding in bf16


class GatedMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up packed into one matmul."""

    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = nn.Parameter(torch.empty(2 * intermediate, hidden, dtype=dtype), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(hidden, intermediate, dtype=dtype), requires_grad=False)
        self.lora: Callable[[str, torch.Tensor, torch.Tensor], None] | None = None  # engine/lora, when configured

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.lora is None:
            return linear(silu_mul(linear(x, self.gate_up_proj), self.intermediate), self.down_proj)
        gu = linear(x, self.gate_up_proj)
        self.lora("gate_up", x, gu)
        h = silu_mul(gu, self.intermediate)
        out = linear(h, self.down_proj)
        self.lora("down", h, out)
        return out


def silu_mul(gu: torch.Tensor, inter: int) -> torch.Tensor:
    """``silu(gate) * up`` for ``gu = [gate | up]`` of shape [T, 2 * inter]."""
    ops = native_layer_ops(gu)
    if ops is not None and gu.dim() == 2 and gu.stride(1) == 1:
        out = torch.empty(gu.shape[0], inter, dtype=gu.dtype)
        fn = ops.silu_mul if gu.dtype is torch.float32 else ops.silu_mul_bf16
        fn(gu.data_ptr(), gu.stride(0), out.data_ptr(), gu.shape[0], inter)
        return out
    gate, up = gu.split(inter, dim=-1)
    return F.silu(gate) * up


class ExpertExchange(Protocol):
    """The collectives expert-parallel ranks move MoE rows with (:class:`engine.parallel.process_group.GroupExchange`
    across processes, :class:`engine.parallel.thread_group.ThreadGroup` in process). ``dispatch`` picks
    :class:`SparseMoE`'s scheme: ``"all_gather"`` or ``"all_to_all"``."""

    rank: int
    size: int
    dispatch: str

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` (the same shape on all), stacked in rank order: ``[size * rows, ...]``."""
        ...

    def all_to_all(self, x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        """Send ``x``'s rows split by ``send`` to the ranks in order; return the rows received, ``recv[i]`` from
        rank ``i``, in rank order."""
        ...


class SparseMoE(nn.Module):
    """Top-k routed experts. Expert weights are stacked: ``w13`` [E, 2I, H] (gate|up), ``w2`` [E, H, I].

    Every (token, top-k slot) pair is a *row*. Rows are sorted by expert (stably, so by token within an expert);
    only the experts that receive rows run, each on its rows in token order (on CPU the cheapest exact formulation);
    then each token's output is the sum of its weighted expert outputs, added in expert order from zero
    (``index_add_`` per expert, as transformers does).

    Expert parallelism: a rank holds ``num_local`` experts from ``expert_offset``; the router is replicated and every
    rank routes every token, so every rank knows every row's expert and every split size without asking. With an
    :class:`ExpertExchange` attached, the output is the single-rank output bit for bit, because each expert runs on
    the same rows in the same order and each token's outputs are added in the same order:

    - ``all_gather``: each rank runs its experts on their rows; the weighted outputs (padded to the longest rank's
      share) are all-gathered, and every rank adds them up for every token.
    - ``all_to_all``: the tokens are split into one contiguous slice per rank. Each rank sends its slice's rows to
      their experts' ranks, which run them in (rank, token) order, i.e. token order, and send the outputs back;
      each rank adds up its slice's tokens, and the slices are all-gathered.

    With no exchange and a slice of the experts, the output is this rank's partial sum, for an all-reduce to add
    up: that matches one rank only while a token has at most two experts (``0 + a + b``), since from three on the
    ranks' partials group the terms differently (``a + (b + c)``).
    """

    def __init__(self, hidden: int, moe: MoEConfig, dtype: torch.dtype, num_local: int | None = None,
                 expert_offset: int = 0) -> None:
        super().__init__()
        self.moe = moe
        self.num_local = num_local if num_local is not None else moe.num_experts
        self.expert_offset = expert_offset
        inter = moe.intermediate_size
        self.inter = inter
        self.gate = nn.Parameter(torch.empty(moe.num_experts, hidden, dtype=dtype), requires_grad=False)
        self.w13 = nn.Parameter(torch.empty(self.num_local, 2 * inter, hidden, dtype=dtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(self.num_local, hidden, inter, dtype=dtype), requires_grad=False)
        self.exchange: ExpertExchange | None = None  # set by CausalLM.attach_expert_exchange

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, self.gate)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.moe.top_k, dim=-1)
        if self.moe.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.moe.weights_in_activation_dtype:
            weights = weights.to(x.dtype)
        flat_experts = experts.reshape(-1)
        order = torch.argsort(flat_experts, stable=True)
        counts = torch.bincount(flat_experts, minlength=self.moe.num_experts).tolist()
        token_of = order // self.moe.top_k
        w_of = weights.reshape(-1)[order]
        ex = self.exchange
        if ex is not None and ex.dispatch == "all_to_all":
            return self._all_to_all(x, ex, flat_experts[order], token_of, w_of, counts)
        if ex is not None:
            return self._all_gather(x, ex, token_of, w_of, counts)
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            local = e - self.expert_offset
            if n and 0 <= local < self.num_local:
                idx = token_of[start : start + n]
                out.index_add_(0, idx, self._expert(local, x.index_select(0, idx), w_of[start : start + n], x.dtype))
            start += n
        return out

    def _expert(self, local: int, rows: torch.Tensor, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Local expert ``local`` on ``rows`` (its rows in token order), weighted, in the activation dtype."""
        h = linear(rows, self.w13[local])
        y = linear(silu_mul(h, self.inter), self.w2[local])
        return (y * w[:, None]).to(dtype)

    def _all_gather(self, x: torch.Tensor, ex: ExpertExchange, token_of: torch.Tensor, w_of: torch.Tensor,
                    counts: list[int]) -> torch.Tensor:
        starts = [0, *itertools.accumulate(counts)]  # expert e's rows: [starts[e], starts[e + 1])
        per_rank = [starts[(r + 1) * self.num_local] - starts[r * self.num_local] for r in range(ex.size)]
        pad = max(per_rank)
        lo = starts[self.expert_offset]
        mine = x.new_zeros(pad, x.shape[1])
        for local in range(self.num_local):
            a, b = starts[self.expert_offset + local], starts[self.expert_offset + local + 1]
            if b > a:
                mine[a - lo : b - lo] = self._expert(local, x.index_select(0, token_of[a:b]), w_of[a:b], x.dtype)
        every = ex.all_gather(mine)  # rank r's rows at [r * pad, r * pad + per_rank[r])
        out = torch.zeros_like(x)
        for e, n in enumerate(counts):
            if n:
                r = e // self.num_local
                at = r * pad + starts[e] - starts[r * self.num_local]
                out.index_add_(0, token_of[starts[e] : starts[e] + n], every[at : at + n])
        return out

    def _all_to_all(self, x: torch.Tensor, ex: ExpertExchange, expert_of: torch.Tensor, token_of: torch.Tensor,
                    w_of: torch.Tensor, counts: list[int]) -> torch.Tensor:
        tokens, size, nl = x.shape[0], ex.size, self.num_local
        per = max(1, -(-tokens // size))  # tokens per slice; rank r's slice is [r * per, (r + 1) * per)
        src_of = token_of // per  # each row's source rank, in the sorted order: rows sort by (expert, source)
        # n[e][s]: rows of expert e from rank s's slice (row-major [E, size], as the rows are sorted)
        n = torch.bincount(expert_of * size + src_of, minlength=self.moe.num_experts * size).view(-1, size).tolist()
        starts = [0, *itertools.accumulate(counts)]
        send = [sum(n[e][ex.rank] for e in range(q * nl, (q + 1) * nl)) for q in range(size)]
        recv = [sum(n[e][s] for e in range(self.expert_offset, self.expert_offset + nl)) for s in range(size)]
        mine = (src_of == ex.rank).nonzero().squeeze(1)  # my slice's rows, by (expert, token): by owner rank
        got = ex.all_to_all(x.index_select(0, token_of.index_select(0, mine)), send, recv)
        # got is ordered (source, expert, token): expert e's rows from source s follow s's rows of my lower experts
        back = torch.empty_like(got)
        src_start = [0, *itertools.accumulate(recv)]
        for local in range(nl):
            e = self.expert_offset + local
            if not counts[e]:
                continue
            pieces = []
            for s in range(size):
                at = src_start[s] + sum(n[f][s] for f in range(self.expert_offset, e))
                pieces.append(torch.arange(at, at + n[e][s], device=x.device))
            idx = torch.cat(pieces)  # expert e's rows in (source, token) order: token order
            a, b = starts[e], starts[e + 1]
            back.index_copy_(0, idx, self._expert(local, got.index_select(0, idx), w_of[a:b], x.dtype))
        ret = ex.all_to_all(back, recv, send)  # my slice's rows, by (owner, expert, token): by (expert, token)
        part = x.new_zeros(per, x.shape[1])
        first = ex.rank * per
        off = 0
        for e in range(self.moe.num_experts):
            k = n[e][ex.rank]
            if k:
                a = starts[e] + sum(n[e][:ex.rank])
                part.index_add_(0, token_of[a : a + k] - first, ret[off : off + k])
                off += k
        return ex.all_gather(part)[:tokens]
