"""One decoder-only transformer for Llama, Mistral, Qwen2, Qwen3, Mixtral and Qwen3-MoE.

The architectures differ only in switches read from :class:`ModelConfig` (q/k/v bias, q/k norm, sliding window,
sparse MoE layers, tied embeddings), so one class serves them all.

Weights load through a per-parameter ``weight_loader`` (attached to each parameter) and a packed-modules mapping:
HF's separate ``q_proj``/``k_proj``/``v_proj`` land in shards of one ``qkv_proj`` matrix, ``gate_proj``/``up_proj``
in ``gate_up_proj``, and per-expert matrices in stacked expert tensors. The loaders take a tensor-parallel rank and
world size and copy only this rank's slice, casting as they copy: a checkpoint tensor arrives memory-mapped and
uncast, so a rank reads (pages in) only its own rows or columns of it:

- column parallel: attention heads (q, and k/v split across ranks, or replicated when there are fewer KV heads than
  ranks) and MLP gate/up columns;
- row parallel: ``o_proj`` and ``down_proj`` input columns, whose partial products ``tp_reduce`` sums;
- vocab parallel: the embedding and the LM head hold ``ceil(vocab / tp)`` rows each; a rank embeds only its ids
  (zeros elsewhere) and writes its logits into a zero row of the whole vocabulary, and ``tp_reduce`` sums both.
  Every element then has one non-zero term, so the sum is exact (an all-gather done with the one collective);
- norms and the MoE router are replicated; experts are split across expert-parallel ranks, which exchange MoE rows
  through the :class:`ExpertExchange` that :meth:`CausalLM.attach_expert_exchange` gives every MoE layer (exact:
  see :class:`SparseMoE`), or sum their partial outputs with ``ep_reduce`` (not in EP=1's order).

Pipeline stages hold a contiguous range of layers (:meth:`ShardSpec.stage_layers`); the others are built but never
loaded nor touched (their memory is never committed). A stage receives the previous stage's hidden states and sends
its own through a :class:`Pipe`; the last stage's logits are shared with every rank.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionMetadata, paged_attention, write_kv
from engine.cpu_runtime import empty_on_huge_pages
from engine.model_config import ModelConfig
from engine.models.layers import (
    ExpertExchange,
    GatedMLP,
    RMSNorm,
    RotaryEmbedding,
    SparseMoE,
    linear,
    prepack_linear_weight,
)

AllReduce = Callable[[torch.Tensor], torch.Tensor]


class Pipe(Protocol):
    """A pipeline stage's links: hidden states from the previous stage, to the next, and the last stage's logits."""

    def recv_hidden(self, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor: ...

    def send_hidden(self, x: torch.Tensor) -> None: ...

    def share_logits(self, logits: torch.Tensor | None, shape: tuple[int, int]) -> torch.Tensor: ...


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


@dataclass(slots=True, frozen=True)
class ShardSpec:
    """This rank's place in the model's tensor-, expert- and pipeline-parallel layout."""

    tp_rank: int = 0
    tp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.pp_rank < self.pp_size:
            raise ValueError(f"pp_rank={self.pp_rank} not in [0, pp_size={self.pp_size})")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank={self.tp_rank} not in [0, tp_size={self.tp_size})")
        if not 0 <= self.ep_rank < self.ep_size:
            raise ValueError(f"ep_rank={self.ep_rank} not in [0, ep_size={self.ep_size})")

    def stage_layers(self, num_layers: int) -> range:
        """This pipeline stage's layers: contiguous, the first ``num_layers % pp_size`` stages one layer longer."""
        base, extra = divmod(num_layers, self.pp_size)
        start = self.pp_rank * base + min(self.pp_rank, extra)
        return range(start, start + base + (self.pp_rank < extra))

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def vocab_rows(self, vocab_size: int) -> tuple[int, int]:
        """(first row, rows per rank) of this rank's slice of a vocab-parallel table; the last may be padded."""
        per = -(-vocab_size // self.tp_size)
        return self.tp_rank * per, per


def check_tp_heads(num_heads: int, num_kv_heads: int, tp: int) -> None:
    """Raise ValueError unless ``tp`` ranks can split the attention heads (KV heads split or replicated)."""
    if num_heads % tp:
        raise ValueError(f"tensor parallel size {tp} must divide the attention heads ({num_heads})")
    if num_kv_heads % tp and tp % num_kv_heads:
        raise ValueError(f"tensor parallel size {tp} must divide the KV heads ({num_kv_heads}) or be a multiple of "
                         "them (KV heads are then replicated)")


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(empty_on_huge_pages(shape, dtype), requires_grad=False)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: ShardSpec, dtype: torch.dtype, rotary: RotaryEmbedding) -> None:
        super().__init__()
        tp = shard.tp_size
        check_tp_heads(cfg.num_heads, cfg.num_kv_heads, tp)
        self.heads = cfg.num_heads // tp
        self.kv_heads = max(cfg.num_kv_heads // tp, 1)
        # the checkpoint's first KV head on this rank: with fewer KV heads than ranks, the one its q heads share
        self.kv_head_start = shard.tp_rank * cfg.num_kv_heads // tp
        self.head_dim = cfg.head_dim
        self.q_size = self.heads * cfg.head_dim
        self.kv_size = self.kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.qkv_proj = _param(self.q_size + 2 * self.kv_size, cfg.hidden_size, dtype=dtype)
        self.qkv_bias = _param(self.q_size + 2 * self.kv_size, dtype=dtype) if cfg.qkv_bias else None
        self.o_proj = _param(cfg.hidden_size, self.q_size, dtype=dtype)
        self.o_bias = _param(cfg.hidden_size, dtype=dtype) if cfg.o_bias else None
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.rotary = rotary
        self.tp_rank = shard.tp_rank
        self.lora: Callable[[str, torch.Tensor, torch.Tensor], None] | None = None  # engine/lora, when configured

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv: tuple[torch.Tensor, torch.Tensor],
        all_reduce: AllReduce,
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = linear(x, self.qkv_proj, self.qkv_bias)
        if self.lora is not None:
            self.lora("qkv", x, qkv)
        qkv = qkv.view(t, self.heads + 2 * self.kv_heads, self.head_dim)
        qk, v = qkv.split((self.heads + self.kv_heads, self.kv_heads), dim=1)
        assert meta.cos is not None and meta.sin is not None
        if self.q_norm is not None and self.k_norm is not None:
            q, k = qk.split((self.heads, self.kv_heads), dim=1)
            qk = torch.cat((self.q_norm.forward(q), self.k_norm.forward(k)), dim=1)
        qk = self.rotary.rotate(qk, meta.cos, meta.sin)
        q, k = qk.split((self.heads, self.kv_heads), dim=1)
        write_kv(kv[0], kv[1], k, v, meta)
        o = paged_attention(q, kv[0], kv[1], meta, self.scale)
        out = linear(o, self.o_proj)
        if self.lora is not None:
            self.lora("o", o, out)
        out = all_reduce(out)
        if self.o_bias is not None:
            out = out + self.o_bias
        return out


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, shard: ShardSpec, dtype: torch.dtype,
                 rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = Attention(cfg, shard, dtype, rotary)
        self.mlp: nn.Module
        if cfg.is_moe_layer(layer):
            assert cfg.moe is not None
            if cfg.moe.num_experts % shard.ep_size:
                raise ValueError(f"ep_size={shard.ep_size} must divide num_experts={cfg.moe.num_experts}")
            local = cfg.moe.num_experts // shard.ep_size
            self.mlp = SparseMoE(cfg.hidden_size, cfg.moe, dtype, num_local=local, expert_offset=shard.ep_rank * local)
        else:
            if cfg.intermediate_size % shard.tp_size:
                raise ValueError(f"tp_size={shard.tp_size} must divide intermediate={cfg.intermediate_size}")
            self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size // shard.tp_size, dtype)
        self.moe = cfg.is_moe_layer(layer)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv: tuple[torch.Tensor, torch.Tensor], tp_reduce: AllReduce, ep_reduce: AllReduce) -> torch.Tensor:
        # Submodules' forward is called directly on this hot path: nn.Module.__call__ costs ~3 us a call for hooks
        # that Tandem never registers (tiny model: 5-8% of a single-sequence decode step).
        h = x + self.self_attn.forward(self.input_layernorm.forward(x), positions, meta, kv, tp_reduce)
        m = self.mlp.forward(self.post_attention_layernorm.forward(h))
        return h + (ep_reduce(m) if self.moe else tp_reduce(m))


class CausalLM(nn.Module):
    packed_modules_mapping: ClassVar[dict[str, tuple[str, str | int]]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    expert_mapping: ClassVar[dict[str, tuple[str, int | None]]] = {
        "w1": ("w13", 0), "gate_proj": ("w13", 0),
        "w3": ("w13", 1), "up_proj": ("w13", 1),
        "w2": ("w2", None), "down_proj": ("w2", None),
    }

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, max_positions: int,
                 shard: ShardSpec | None = None, tp_reduce: AllReduce = _identity,
                 ep_reduce: AllReduce = _identity, pipe: Pipe | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.shard = shard or ShardSpec()
        self.stage = self.shard.stage_layers(cfg.num_layers)
        if self.shard.pp_size > 1 and pipe is None:
            raise ValueError("a pipeline stage needs a pipe to its neighbours")
        self.pipe = pipe
        self.dtype = dtype
        self.tp_reduce = tp_reduce
        self.ep_reduce = ep_reduce
        # an expert-parallel rank needs an exchange or an ep_reduce, or its MoE layers would return partial sums
        self._ep_unwired = self.shard.ep_size > 1 and ep_reduce is _identity
        rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, max_positions, dtype)
        self.rotary = rotary
        self.vocab_start, self.vocab_rows = self.shard.vocab_rows(cfg.vocab_size)
        self.embed_tokens = _param(self.vocab_rows, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, self.shard, dtype, rotary) for i in range(cfg.num_layers))
        self._layer_seq: tuple[DecoderLayer, ...] = tuple(cast("Iterable[DecoderLayer]", self.layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = self.embed_tokens if cfg.tie_word_embeddings else _param(self.vocab_rows, cfg.hidden_size,
                                                                               dtype=dtype)
        self._attach_loaders()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                layers: range | None = None, hidden: torch.Tensor | None = None,
                after_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """Run ``layers`` (this stage's by default) from ``hidden`` (the embeddings, or what the previous stage
        sends through the pipe, by default).

        ``after_layer(i)`` is called once layer ``i`` has written its KV, which is when its blocks can be sent.
        """
        if self._ep_unwired:
            raise RuntimeError("an expert-parallel rank runs with neither an ep_reduce nor an expert exchange "
                               "(CausalLM.attach_expert_exchange)")
        layers = layers if layers is not None else self.stage
        if hidden is None and self.pipe is not None and not self.shard.first_stage:
            hidden = self.pipe.recv_hidden((input_ids.shape[0], self.cfg.hidden_size), self.dtype)
        x = self.embed(input_ids) if hidden is None else hidden
        if meta.cos is None:
            meta.cos, meta.sin = self.rotary.tables(positions)
        seq = self._layer_seq
        for i in layers:
            x = seq[i].forward(x, positions, meta, kv_caches[i], self.tp_reduce, self.ep_reduce)
            if after_layer is not None:
                after_layer(i)
        if self.pipe is not None and not self.shard.last_stage:
            self.pipe.send_hidden(x)
        return x

    def attach_expert_exchange(self, exchange: ExpertExchange) -> None:
        """Give every MoE layer of this stage the row exchange of its expert-parallel group (instead of an
        ``ep_reduce``: the MoE layers then return the whole output, bit-identical to EP=1)."""
        if exchange.size != self.shard.ep_size or exchange.rank != self.shard.ep_rank:
            raise ValueError(f"exchange rank {exchange.rank} of {exchange.size}, but this shard is expert-parallel "
                             f"rank {self.shard.ep_rank} of {self.shard.ep_size}")
        if self.ep_reduce is not _identity:
            raise ValueError("this model already sums its MoE partial outputs with an ep_reduce")
        for i in self.stage:
            mlp = self._layer_seq[i].mlp
            if isinstance(mlp, SparseMoE):
                mlp.exchange = exchange
        self._ep_unwired = False

    def prepack(self) -> None:
        """Pack the dense matmul weights for oneDNN (CPU); see :func:`prepack_linear_weight`."""
        for i in self.stage:
            layer = self._layer_seq[i]
            attn = layer.self_attn
            weights = [attn.qkv_proj, attn.o_proj]
            if isinstance(layer.mlp, GatedMLP):
                weights += [layer.mlp.gate_up_proj, layer.mlp.down_proj]
            for w in weights:
                prepack_linear_weight(w)
        prepack_linear_weight(self.lm_head)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.shard.tp_size == 1:
            return F.embedding(input_ids, self.embed_tokens)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_rows)
        x = F.embedding(local.masked_fill(outside, 0), self.embed_tokens)
        return self.tp_reduce(x.masked_fill_(outside.unsqueeze(1), 0.0))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.pipe is None:
            return self._logits(hidden)
        shape = (hidden.shape[0], self.cfg.vocab_size)
        return self.pipe.share_logits(self._logits(hidden) if self.shard.last_stage else None, shape)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = linear(self.norm.forward(hidden), self.lm_head).float()
        if self.shard.tp_size == 1:
            return logits
        full = logits.new_zeros(logits.shape[0], self.vocab_rows * self.shard.tp_size)
        full.narrow(1, self.vocab_start, self.vocab_rows).copy_(logits)
        return self.tp_reduce(full)[:, : self.cfg.vocab_size]

    # ---- weight loading -------------------------------------------------------------------------------------

    def _attach_loaders(self) -> None:
        sh = self.shard
        _set_loader(self.embed_tokens, _vocab_loader(self.vocab_start, self.cfg.vocab_size))
        if not self.cfg.tie_word_embeddings:
            _set_loader(self.lm_head, _vocab_loader(self.vocab_start, self.cfg.vocab_size))
        for layer in cast("Iterable[DecoderLayer]", self.layers):
            attn = layer.self_attn
            q, kv = attn.q_size, attn.kv_size
            kv_src, kv_total = attn.kv_head_start * attn.head_dim, self.cfg.num_kv_heads * attn.head_dim
            # shard id -> (first row in the packed parameter, rows, first row in the checkpoint, checkpoint rows)
            slices = {"q": (0, q, sh.tp_rank * q, q * sh.tp_size), "k": (q, kv, kv_src, kv_total),
                      "v": (q + kv, kv, kv_src, kv_total)}
            _set_loader(attn.qkv_proj, _column_loader(slices))
            if attn.qkv_bias is not None:
                _set_loader(attn.qkv_bias, _column_loader(slices))
            _set_loader(attn.o_proj, _row_loader(sh))
            mlp = layer.mlp
            if isinstance(mlp, GatedMLP):
                i = mlp.intermediate
                src, total = sh.tp_rank * i, i * sh.tp_size
                _set_loader(mlp.gate_up_proj, _column_loader({0: (0, i, src, total), 1: (i, i, src, total)}))
                _set_loader(mlp.down_proj, _row_loader(sh))
            elif isinstance(mlp, SparseMoE):
                _set_loader(mlp.w13, _expert_loader(mlp))
                _set_loader(mlp.w2, _expert_loader(mlp))

    def hf_to_param(self, name: str) -> tuple[str, str | int | None, int | None] | None:
        """Map an HF checkpoint key to (parameter name, shard id, expert id); None for keys to skip."""
        if "rotary_emb.inv_freq" in name:
            return None
        name = name.removeprefix("model.")
        if name == "lm_head.weight":
            return (None if self.cfg.tie_word_embeddings else ("lm_head", None, None))  # type: ignore[return-value]
        if name == "embed_tokens.weight":
            return ("embed_tokens", None, None)
        if name == "norm.weight":
            return ("norm.weight", None, None)
        m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
        if m is None:
            raise KeyError(name)
        layer, rest = m.group(1), m.group(2)
        p = f"layers.{layer}."
        if rest in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            return (p + rest, None, None)
        m = re.fullmatch(r"self_attn\.([qkvo])_proj\.(weight|bias)", rest)
        if m:
            which, kind = m.groups()
            if which == "o":
                return (p + ("self_attn.o_proj" if kind == "weight" else "self_attn.o_bias"), None, None)
            return (p + ("self_attn.qkv_proj" if kind == "weight" else "self_attn.qkv_bias"), which, None)
        m = re.fullmatch(r"self_attn\.([qk])_norm\.weight", rest)
        if m:
            return (p + f"self_attn.{m.group(1)}_norm.weight", None, None)
        m = re.fullmatch(r"mlp\.(gate_proj|up_proj|down_proj)\.weight", rest)
        if m:
            proj = m.group(1)
            if proj == "down_proj":
                return (p + "mlp.down_proj", None, None)
            shard_id: str | int | None
            target, shard_id = self.packed_modules_mapping[proj]
            return (p + f"mlp.{target}", shard_id, None)
        m = re.fullmatch(r"(?:block_sparse_moe|mlp)\.gate\.weight", rest)
        if m:
            return (p + "mlp.gate", None, None)
        m = re.fullmatch(r"(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight",
                         rest)
        if m:
            target, shard_id = self.expert_mapping[m.group(2)]
            return (p + f"mlp.{target}", shard_id, int(m.group(1)))
        m = re.fullmatch(r"mlp\.experts\.(gate_up_proj|down_proj)", rest)  # transformers-5 fused experts
        if m:
            return (p + ("mlp.w13" if m.group(1) == "gate_up_proj" else "mlp.w2"), "fused", None)
        raise KeyError(name)

    def in_stage(self, pname: str) -> bool:
        layer = _layer_of(pname)
        return layer is None or layer in self.stage

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters(remove_duplicate=False))
        expected: dict[str, int] = {}
        for pname, param in params.items():
            if (pname == "lm_head" and self.cfg.tie_word_embeddings) or not self.in_stage(pname):
                continue
            expected[pname] = _expected_pieces(pname, param)
        seen: dict[str, int] = {}
        for name, tensor in weights:
            try:
                target = self.hf_to_param(name)
            except KeyError:
                raise ValueError(f"unexpected weight {name!r} in checkpoint for {self.cfg.architecture}") from None
            if target is None:
                continue
            pname, shard_id, expert = target
            if not self.in_stage(pname):
                continue  # another pipeline stage's layer
            if pname not in params:
                raise ValueError(f"weight {name!r} maps to {pname!r}, which this model does not have")
            param = params[pname]
            loader = getattr(param, "weight_loader", _default_loader)
            with torch.no_grad():  # the loader's copy_ casts, so only this rank's slice of ``tensor`` is ever read
                loader(param, tensor, shard_id, expert)
            seen[pname] = seen.get(pname, 0) + (expected.get(pname, 1) if shard_id == "fused" else 1)
        missing = [p for p, n in expected.items() if seen.get(p, 0) < n]
        if missing:
            raise ValueError(f"checkpoint is missing weights for {missing[:6]}{'...' if len(missing) > 6 else ''}")


def _layer_of(pname: str) -> int | None:
    m = re.match(r"layers\.(\d+)\.", pname)
    return int(m.group(1)) if m else None


def _expected_pieces(pname: str, param: nn.Parameter) -> int:
    """How many checkpoint tensors fill this parameter (3 for qkv, 2 for gate_up, per expert for MoE)."""
    if pname.endswith(("qkv_proj", "qkv_bias")):
        return 3
    if pname.endswith("gate_up_proj"):
        return 2
    if pname.endswith("mlp.w13"):
        return 2 * param.shape[0]
    if pname.endswith("mlp.w2"):
        return param.shape[0]
    return 1


def _set_loader(param: nn.Parameter, loader: Callable[..., None]) -> None:
    """Attach ``loader`` as ``param.weight_loader`` (read back by :meth:`CausalLM.load_weights`)."""
    setattr(param, "weight_loader", loader)  # noqa: B010 (not an attribute nn.Parameter declares)


def _default_loader(param: nn.Parameter, w: torch.Tensor, shard_id: object, expert: object) -> None:
    if param.shape != w.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(w.shape)}")
    param.data.copy_(w)


def _column_loader(slices: Mapping[Any, tuple[int, int, int, int]]) -> Callable[..., None]:
    def load(param: nn.Parameter, w: torch.Tensor, shard_id: str | int, expert: object) -> None:
        start, size, src, total = slices[shard_id]
        if w.shape[0] != total:
            raise ValueError(f"shard {shard_id!r}: checkpoint has {w.shape[0]} rows, expected {total}")
        param.data.narrow(0, start, size).copy_(w.narrow(0, src, size))
    return load


def _vocab_loader(start: int, vocab_size: int) -> Callable[..., None]:
    """This rank's rows ``[start, start + rows)`` of a vocab-parallel table; rows past the vocabulary are zero."""
    def load(param: nn.Parameter, w: torch.Tensor, shard_id: object, expert: object) -> None:
        if w.shape != (vocab_size, param.shape[1]):
            raise ValueError(f"vocab table: checkpoint {tuple(w.shape)}, expected {(vocab_size, param.shape[1])}")
        n = max(min(param.shape[0], vocab_size - start), 0)
        param.data.narrow(0, 0, n).copy_(w.narrow(0, start, n))
        param.data.narrow(0, n, param.shape[0] - n).zero_()
    return load


def _row_loader(sh: ShardSpec) -> Callable[..., None]:
    def load(param: nn.Parameter, w: torch.Tensor, shard_id: object, expert: object) -> None:
        size = param.shape[1]
        if w.shape[1] != size * sh.tp_size or w.shape[0] != param.shape[0]:
            raise ValueError(f"row-parallel shape mismatch: {tuple(w.shape)} vs local {tuple(param.shape)}")
        param.data.copy_(w.narrow(1, sh.tp_rank * size, size))
    return load


def _expert_loader(moe: SparseMoE) -> Callable[..., None]:
    def load(param: nn.Parameter, w: torch.Tensor, shard_id: int | str | None, expert: int | None) -> None:
        lo, n = moe.expert_offset, moe.num_local
        if shard_id == "fused":
            param.data.copy_(w[lo : lo + n])
            return
        assert expert is not None
        local = expert - lo
        if not 0 <= local < n:
            return  # another expert-parallel rank owns it
        if shard_id is None:
            param.data[local].copy_(w)
        else:
            inter = moe.inter
            param.data[local].narrow(0, int(shard_id) * inter, inter).copy_(w)
    return load
