"""Deterministic random-weight Hugging-Face-format checkpoints: Tandem's built-in default model.

Nothing can be downloaded where Tandem is developed and tested, so :func:`write_tiny_checkpoint` writes a complete
checkpoint directory that ``transformers`` (and Tandem's own loader) can open as if it came from a model hub:
``config.json``, ``generation_config.json``, safetensors weights (one ``model.safetensors`` for ``size="tiny"``,
``model-0000N-of-0000M.safetensors`` shards plus ``model.safetensors.index.json`` for ``size="small"``),
``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json``.

Design choices:

* **Real layouts.** Each architecture writes ``config.json`` with the keys its real hub checkpoints use (legacy
  ``rope_theta``/``rope_scaling``, ``torch_dtype``, ``sliding_window``/``use_sliding_window``, ...) and the tensor
  names real checkpoints store on disk, e.g. Mixtral's per-expert
  ``model.layers.N.block_sparse_moe.experts.E.w1.weight`` and Qwen3-MoE's ``model.layers.N.mlp.experts.E.*`` rather
  than the fused ``gate_up_proj`` tensors newer ``transformers`` versions build while loading. Each tiny
  architecture also exercises the feature its family is known for: Llama-3 rope scaling, Qwen2 qkv biases and tied
  embeddings, Qwen3 ``head_dim`` different from ``hidden_size / num_attention_heads`` plus q/k norms, a short
  Mistral sliding window (64), and MoE routing (Qwen3-MoE also keeps one dense layer via ``mlp_only_layers``).
* **Byte-identical output.** Every tensor gets its own ``torch.Generator`` seeded from SHA-256 of
  ``(arch, size, seed, tensor name)``, so a tensor does not depend on which other tensors exist or their order.
  Only integers are drawn (``torch.randint``) and turned into uniform floats with single, correctly rounded IEEE
  operations in float64, so the values do not depend on which SIMD kernels (AVX2, AVX-512, ...) the CPU picks, as
  ``torch.randn`` might. Safetensors files are written with sorted keys and the fixed metadata
  ``{"format": "pt"}``; JSON files are written with sorted keys. No timestamps or version strings are written.
* **Clear logit margins.** Tandem's parity tests compare greedy tokens with ``transformers`` token for token, so
  near-ties between the top two logits must be rare. Projections use variance-preserving scales
  (``1 / sqrt(fan_in)``), so with pre-norm residual blocks the activations stay of order one through the layers,
  while ``lm_head`` is scaled so that the final logits have a standard deviation of about
  ``_LOGIT_STD`` (6) units; with a 2048 vocabulary the typical top-1/top-2 gap is then over one unit. MoE router
  weights are scaled so router logits have a standard deviation of about ``_ROUTER_LOGIT_STD`` (4), which keeps
  top-k expert selection away from ties. Norm weights are ``1`` plus small noise (so a loader that ignores them, or
  applies them Gemma-style as ``1 + w``, produces different tokens), and Qwen2 biases are non-zero. With tied
  embeddings (Qwen2) the residual-branch outputs are scaled up by ``_TIED_RESIDUAL_GAIN`` so that the current
  token's own embedding, which is also its ``lm_head`` row, does not dominate the next-token logits.
* **Tokenizer.** A byte-level BPE (``tokenizers`` ``ByteLevel`` pre-tokenizer and decoder, ``add_prefix_space``
  off, all 256 byte symbols in the initial alphabet so any UTF-8 text round-trips) is trained on the built-in
  corpus of :mod:`tinymodel.corpus`. The trainer is deterministic here (checked across processes and thread
  counts by the tests). The tokenizer depends only on the size (2048 tokens for ``tiny``, 8192 for ``small``), not on
  the architecture or seed. The four special tokens sit at the end of the vocabulary like Llama 3's:
  ``<|begin_of_text|>`` (bos, prepended by a ``TemplateProcessing`` post-processor), ``<|end_of_text|>`` (eos and
  pad), ``<|im_start|>`` and ``<|im_end|>`` for the ChatML chat template.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import pathlib
from dataclasses import dataclass
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from tinymodel.corpus import corpus_lines

__all__ = [
    "BOS_TOKEN",
    "EOS_TOKEN",
    "IM_END_TOKEN",
    "IM_START_TOKEN",
    "SUPPORTED_TINY_ARCHS",
    "SUPPORTED_TINY_SIZES",
    "TensorSpec",
    "TinyModelConfig",
    "build_state_dict",
    "build_tokenizer",
    "hf_config_dict",
    "parameter_count",
    "tensor_specs",
    "tiny_model_config",
    "write_tiny_checkpoint",
]

SUPPORTED_TINY_ARCHS = ("llama", "qwen2", "qwen3", "mistral", "mixtral", "qwen3_moe")
SUPPORTED_TINY_SIZES = ("tiny", "small")

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
_SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN)

# ChatML, with Hermes-style tools (as Qwen2.5 renders them): the tools listed in the system turn inside
# <tools></tools>, an assistant's calls as <tool_call>{"name": ..., "arguments": ...}</tool_call>, and each tool
# result as a <tool_response> in a user turn. Without tools, plain ChatML.
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages[0]['role'] == 'system' -%}{{- messages[0]['content'] + '\\n\\n' -}}{%- endif -%}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided "
    "with function signatures within <tools></tools> XML tags:\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if tools and loop.first and message['role'] == 'system' -%}"
    "{%- elif message['role'] == 'assistant' and message.get('tool_calls') -%}"
    "{{- '<|im_start|>assistant\\n' + (message['content'] or '') -}}"
    "{%- for call in message['tool_calls'] -%}"
    "{%- set args = call['function']['arguments'] -%}"
    "{{- '<tool_call>\\n{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' -}}"
    "{{- (args if args is string else (args | tojson)) + '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- elif message['role'] == 'tool' -%}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)

_MAX_POSITION_EMBEDDINGS = 4096
_LOGIT_STD = 6.0
_ROUTER_LOGIT_STD = 4.0
_EMBED_STD = 1.0
_QUERY_GAIN = 1.5
_NORM_NOISE = 0.1
_BIAS_STD = 0.2
# With tied embeddings the final hidden state still contains the current token's own embedding, which is also its
# lm_head row, so its logit gets a boost of about _LOGIT_STD ** 2 / rms(hidden); untamed, greedy decoding just repeats
# the prompt's last token. Scaling the residual-branch outputs (o_proj, down_proj) up makes that term small.
_TIED_RESIDUAL_GAIN = 16.0
_SHARD_BYTES = 200 * 1024 * 1024
_ARCHITECTURE_CLASS = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
_LLAMA3_ROPE_SCALING: dict[str, Any] = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 512,
}


@dataclass(slots=True, frozen=True)
class TinyModelConfig:
    """Shape and family options of one built-in checkpoint; see :func:`tiny_model_config`."""

    arch: str
    size: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    mlp_only_layers: tuple[int, ...] = ()
    max_position_embeddings: int = _MAX_POSITION_EMBEDDINGS

    def __post_init__(self) -> None:
        if self.arch not in SUPPORTED_TINY_ARCHS:
            raise ValueError(f"unknown tiny arch {self.arch!r}; expected one of {SUPPORTED_TINY_ARCHS}")
        if self.size not in SUPPORTED_TINY_SIZES:
            raise ValueError(f"unknown tiny size {self.size!r}; expected one of {SUPPORTED_TINY_SIZES}")
        for name in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "intermediate_size",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.vocab_size <= 256 + len(_SPECIAL_TOKENS):
            raise ValueError(f"vocab_size must exceed the 256 byte symbols plus special tokens, got {self.vocab_size}")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.rope_theta <= 0:
            raise ValueError(f"rope_theta must be positive, got {self.rope_theta}")
        if not 0 < self.rms_norm_eps < 1:
            raise ValueError(f"rms_norm_eps must be in (0, 1), got {self.rms_norm_eps}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive or None, got {self.sliding_window}")
        if self.is_moe:
            if self.num_experts < 2:
                raise ValueError(f"MoE arch {self.arch!r} needs num_experts >= 2, got {self.num_experts}")
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ValueError(
                    f"num_experts_per_tok must be in [1, num_experts={self.num_experts}], "
                    f"got {self.num_experts_per_tok}"
                )
            if self.arch == "qwen3_moe" and self.moe_intermediate_size <= 0:
                raise ValueError(f"qwen3_moe needs a positive moe_intermediate_size, got {self.moe_intermediate_size}")
        elif self.num_experts or self.num_experts_per_tok or self.moe_intermediate_size:
            raise ValueError(f"dense arch {self.arch!r} must not set expert fields")
        bad_layers = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
        if bad_layers:
            raise ValueError(f"mlp_only_layers {bad_layers} are outside [0, {self.num_hidden_layers})")
        if self.mlp_only_layers and self.arch != "qwen3_moe":
            raise ValueError(f"mlp_only_layers is only supported for qwen3_moe, not {self.arch!r}")

    @property
    def is_moe(self) -> bool:
        """Whether the architecture routes tokens to experts."""
        return self.arch in ("mixtral", "qwen3_moe")

    def is_sparse_layer(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` has an MoE block (all layers of Mixtral, all but ``mlp_only_layers``)."""
        return self.is_moe and layer not in self.mlp_only_layers

    @property
    def bos_token_id(self) -> int:
        """Id of ``<|begin_of_text|>``; the special tokens occupy the last four ids."""
        return self.vocab_size - len(_SPECIAL_TOKENS)

    @property
    def eos_token_id(self) -> int:
        """Id of ``<|end_of_text|>``, also used as the pad token."""
        return self.vocab_size - len(_SPECIAL_TOKENS) + 1


def tiny_model_config(arch: str, size: str = "tiny") -> TinyModelConfig:
    """Return the built-in configuration for ``arch`` at ``size``; raise ``ValueError`` naming a bad value."""
    if arch not in SUPPORTED_TINY_ARCHS:
        raise ValueError(f"unknown tiny arch {arch!r}; expected one of {SUPPORTED_TINY_ARCHS}")
    if size not in SUPPORTED_TINY_SIZES:
        raise ValueError(f"unknown tiny size {size!r}; expected one of {SUPPORTED_TINY_SIZES}")
    if size == "tiny":
        base: dict[str, Any] = dict(
            vocab_size=2048,
            hidden_size=256,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=32,
            intermediate_size=688,
        )
    else:
        base = dict(
            vocab_size=8192,
            hidden_size=768,
            num_hidden_layers=16,
            num_attention_heads=12,
            num_key_value_heads=4,
            head_dim=64,
            intermediate_size=2048,
        )
    qwen_head_dim = 2 * base["head_dim"]  # explicit head_dim that differs from hidden / heads
    if arch == "llama":
        extra: dict[str, Any] = dict(rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)
    elif arch == "qwen2":
        extra = dict(rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, attention_bias=True)
    elif arch == "qwen3":
        extra = dict(
            rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, qk_norm=True, head_dim=qwen_head_dim
        )
    elif arch == "mistral":
        extra = dict(rope_theta=1000000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, sliding_window=64)
    elif arch == "mixtral":
        extra = dict(
            rope_theta=1000000.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            num_experts=4,
            num_experts_per_tok=2,
        )
        if size == "small":
            extra["intermediate_size"] = 768  # per expert; keeps the small MoE near 150M parameters
    else:  # qwen3_moe
        extra = dict(
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            qk_norm=True,
            head_dim=qwen_head_dim,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=128 if size == "tiny" else 384,
            mlp_only_layers=(1,),
        )
    return TinyModelConfig(arch=arch, size=size, **{**base, **extra})


def hf_config_dict(cfg: TinyModelConfig) -> dict[str, Any]:
    """Return ``config.json`` content written the way real hub checkpoints of ``cfg.arch`` write it."""
    common: dict[str, Any] = {
        "architectures": [_ARCHITECTURE_CLASS[cfg.arch]],
        "model_type": cfg.arch,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "initializer_range": 0.02,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "attention_dropout": 0.0,
        "use_cache": True,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "torch_dtype": "float32",
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "pad_token_id": cfg.eos_token_id,
    }
    if cfg.arch == "llama":
        common.update(
            attention_bias=False,
            mlp_bias=False,
            head_dim=cfg.head_dim,
            pretraining_tp=1,
            rope_scaling=dict(_LLAMA3_ROPE_SCALING),
        )
    elif cfg.arch == "qwen2":
        # Like Qwen2.5: a sliding_window value is present but disabled by use_sliding_window.
        common.update(
            rope_scaling=None,
            use_sliding_window=False,
            sliding_window=cfg.max_position_embeddings,
            max_window_layers=cfg.num_hidden_layers,
        )
    elif cfg.arch in ("qwen3", "qwen3_moe"):
        common.update(
            attention_bias=False,
            head_dim=cfg.head_dim,
            rope_scaling=None,
            use_sliding_window=False,
            sliding_window=None,
            max_window_layers=cfg.num_hidden_layers,
        )
        if cfg.arch == "qwen3_moe":
            common.update(
                num_experts=cfg.num_experts,
                num_experts_per_tok=cfg.num_experts_per_tok,
                moe_intermediate_size=cfg.moe_intermediate_size,
                norm_topk_prob=True,
                decoder_sparse_step=1,
                mlp_only_layers=list(cfg.mlp_only_layers),
                output_router_logits=False,
                router_aux_loss_coef=0.001,
            )
    elif cfg.arch == "mistral":
        common.update(sliding_window=cfg.sliding_window)
    else:  # mixtral
        common.update(
            sliding_window=None,
            num_local_experts=cfg.num_experts,
            num_experts_per_tok=cfg.num_experts_per_tok,
            output_router_logits=False,
            router_aux_loss_coef=0.02,
        )
    return common


def _generation_config_dict(cfg: TinyModelConfig) -> dict[str, Any]:
    """Return ``generation_config.json`` content (greedy by default, same special ids as ``config.json``)."""
    return {
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "pad_token_id": cfg.eos_token_id,
        "do_sample": False,
    }


def _tensor_seed(stream: str, name: str) -> int:
    """Derive a 63-bit generator seed from a stream key (arch, size and seed) and a tensor name."""
    digest = hashlib.sha256(f"tandem-tiny:{stream}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


_UNIFORM_BITS = 24


def _uniform(stream: str, name: str, shape: tuple[int, ...], low: float, high: float) -> torch.Tensor:
    """Float32 values uniform on (``low``, ``high``), identical on every CPU for the same stream and name.

    Only integers come from the generator; each float operation is a single IEEE operation in float64, which is
    correctly rounded whether a SIMD kernel or a scalar loop runs it.
    """
    generator = torch.Generator(device="cpu")
    generator.manual_seed(_tensor_seed(stream, name))
    steps = torch.randint(0, 1 << _UNIFORM_BITS, shape, generator=generator, dtype=torch.int64)
    unit = steps.to(torch.float64).add_(0.5).mul_(1.0 / (1 << _UNIFORM_BITS))  # exact: (k + 0.5) / 2**24
    return unit.mul_(high - low).add_(low).to(torch.float32)


@dataclass(slots=True, frozen=True)
class TensorSpec:
    """Shape and initialisation of one checkpoint tensor: uniform on ``[center - half_width, center + half_width]``."""

    shape: tuple[int, ...]
    center: float
    half_width: float

    def __post_init__(self) -> None:
        if not self.shape or any(not isinstance(d, int) or d <= 0 for d in self.shape):
            raise ValueError(f"shape must be a non-empty tuple of positive ints, got {self.shape!r}")
        if not math.isfinite(self.center) or not (math.isfinite(self.half_width) and self.half_width > 0):
            raise ValueError(f"bad init center={self.center!r} half_width={self.half_width!r}")

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)


def tensor_specs(cfg: TinyModelConfig) -> dict[str, TensorSpec]:
    """Return every checkpoint tensor, named as on disk in real checkpoints of ``cfg.arch``, in sorted key order."""
    hidden, head_dim = cfg.hidden_size, cfg.head_dim
    q_out, kv_out = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim
    out_gain = _TIED_RESIDUAL_GAIN if cfg.tie_word_embeddings else 1.0
    lm_head_std = _LOGIT_STD / math.sqrt(hidden)
    specs: dict[str, TensorSpec] = {}

    def add(name: str, shape: tuple[int, ...], std: float) -> None:
        specs[name] = TensorSpec(shape, 0.0, math.sqrt(3.0) * std)  # zero mean, standard deviation ``std``

    def add_norm(name: str, size: int) -> None:
        specs[name] = TensorSpec((size,), 1.0, _NORM_NOISE)

    def add_linear(name: str, out_features: int, in_features: int, gain: float = 1.0) -> None:
        add(name, (out_features, in_features), gain / math.sqrt(in_features))  # variance preserving

    def add_mlp(prefix: str, inter: int, gate: str, up: str, down: str) -> None:
        add_linear(f"{prefix}.{gate}.weight", inter, hidden)
        add_linear(f"{prefix}.{up}.weight", inter, hidden)
        add_linear(f"{prefix}.{down}.weight", hidden, inter, out_gain)

    add("model.embed_tokens.weight", (cfg.vocab_size, hidden), lm_head_std if cfg.tie_word_embeddings else _EMBED_STD)
    if not cfg.tie_word_embeddings:
        add("lm_head.weight", (cfg.vocab_size, hidden), lm_head_std)
    add_norm("model.norm.weight", hidden)
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}"
        add_norm(f"{p}.input_layernorm.weight", hidden)
        add_norm(f"{p}.post_attention_layernorm.weight", hidden)
        add_linear(f"{p}.self_attn.q_proj.weight", q_out, hidden, _QUERY_GAIN)
        add_linear(f"{p}.self_attn.k_proj.weight", kv_out, hidden)
        add_linear(f"{p}.self_attn.v_proj.weight", kv_out, hidden)
        add_linear(f"{p}.self_attn.o_proj.weight", hidden, q_out, out_gain)
        if cfg.attention_bias:
            add(f"{p}.self_attn.q_proj.bias", (q_out,), _BIAS_STD)
            add(f"{p}.self_attn.k_proj.bias", (kv_out,), _BIAS_STD)
            add(f"{p}.self_attn.v_proj.bias", (kv_out,), _BIAS_STD)
        if cfg.qk_norm:
            add_norm(f"{p}.self_attn.q_norm.weight", head_dim)
            add_norm(f"{p}.self_attn.k_norm.weight", head_dim)
        if cfg.arch == "mixtral":
            moe = f"{p}.block_sparse_moe"
            add_linear(f"{moe}.gate.weight", cfg.num_experts, hidden, _ROUTER_LOGIT_STD)
            for expert in range(cfg.num_experts):
                add_mlp(f"{moe}.experts.{expert}", cfg.intermediate_size, "w1", "w3", "w2")
        elif cfg.is_sparse_layer(layer):
            add_linear(f"{p}.mlp.gate.weight", cfg.num_experts, hidden, _ROUTER_LOGIT_STD)
            for expert in range(cfg.num_experts):
                add_mlp(f"{p}.mlp.experts.{expert}", cfg.moe_intermediate_size, "gate_proj", "up_proj", "down_proj")
        else:
            add_mlp(f"{p}.mlp", cfg.intermediate_size, "gate_proj", "up_proj", "down_proj")
    return {name: specs[name] for name in sorted(specs)}


def parameter_count(cfg: TinyModelConfig) -> int:
    """Number of parameters stored in the checkpoint (a tied ``lm_head`` is not stored, so not counted twice)."""
    return sum(spec.numel for spec in tensor_specs(cfg).values())


def build_state_dict(cfg: TinyModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Return the checkpoint tensors for ``seed`` in sorted key order (see :func:`tensor_specs`)."""
    stream = f"{cfg.arch}:{cfg.size}:{seed}"
    return {
        name: _uniform(stream, name, spec.shape, spec.center - spec.half_width, spec.center + spec.half_width)
        for name, spec in tensor_specs(cfg).items()
    }


@functools.lru_cache(maxsize=4)
def _tokenizer_json(vocab_size: int) -> str:
    """Train the byte-level BPE for ``vocab_size`` and return its ``tokenizer.json`` text (cached per process)."""
    n_trained = vocab_size - len(_SPECIAL_TOKENS)
    tokenizer = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=n_trained,
        min_frequency=2,
        show_progress=False,
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(corpus_lines(), trainer=trainer)
    if tokenizer.get_vocab_size() != n_trained:
        raise RuntimeError(
            f"BPE training produced {tokenizer.get_vocab_size()} tokens, expected {n_trained}; enlarge the corpus"
        )
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in _SPECIAL_TOKENS])
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    if bos_id != n_trained or tokenizer.get_vocab_size() != vocab_size:
        raise RuntimeError(f"special tokens landed at unexpected ids (bos={bos_id}, vocab={vocab_size})")
    # Same template transformers builds from add_bos_token=True, so both code paths agree.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN}:0 $A:0",
        pair=f"{BOS_TOKEN}:0 $A:0 {BOS_TOKEN}:1 $B:1",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    return tokenizer.to_str(pretty=True)


def build_tokenizer(vocab_size: int) -> Tokenizer:
    """Return the built-in byte-level BPE tokenizer with ``vocab_size`` tokens (special tokens included)."""
    return Tokenizer.from_str(_tokenizer_json(vocab_size))


def _tokenizer_config_dict(cfg: TinyModelConfig) -> dict[str, Any]:
    """Return ``tokenizer_config.json`` content."""
    added = {
        str(cfg.bos_token_id + i): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, token in enumerate(_SPECIAL_TOKENS)
    }
    return {
        "added_tokens_decoder": added,
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "unk_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": cfg.max_position_embeddings,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def _special_tokens_map_dict() -> dict[str, Any]:
    """Return ``special_tokens_map.json`` content."""
    return {
        "additional_special_tokens": [IM_START_TOKEN, IM_END_TOKEN],
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
    }


def _write_json(path: pathlib.Path, obj: Any) -> None:
    """Write ``obj`` as stable, human-readable JSON."""
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def _tensor_bytes(tensor: torch.Tensor) -> int:
    """Size of ``tensor``'s data in bytes."""
    return tensor.numel() * tensor.element_size()


def _shard(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Split ``tensors`` (in key order) greedily into shards of at most ``max_bytes`` (a lone big tensor may exceed)."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    used = 0
    for name, tensor in tensors.items():
        size = _tensor_bytes(tensor)
        if shards[-1] and used + size > max_bytes:
            shards.append({})
            used = 0
        shards[-1][name] = tensor
        used += size
    return shards


def _write_weights(out: pathlib.Path, tensors: dict[str, torch.Tensor], sharded: bool) -> None:
    """Write ``model.safetensors`` or, when ``sharded``, numbered shards plus ``model.safetensors.index.json``."""
    metadata = {"format": "pt"}
    if not sharded:
        save_file(tensors, str(out / "model.safetensors"), metadata=metadata)
        return
    shards = _shard(tensors, _SHARD_BYTES)
    if len(shards) < 2:
        raise RuntimeError(f"expected at least two shards, got {len(shards)}")
    weight_map: dict[str, str] = {}
    for index, shard in enumerate(shards, start=1):
        filename = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / filename), metadata=metadata)
        weight_map.update(dict.fromkeys(shard, filename))
    index_obj = {
        "metadata": {
            "total_parameters": sum(t.numel() for t in tensors.values()),
            "total_size": sum(_tensor_bytes(t) for t in tensors.values()),
        },
        "weight_map": weight_map,
    }
    _write_json(out / "model.safetensors.index.json", index_obj)


def write_tiny_checkpoint(
    out_dir: str | os.PathLike[str], arch: str = "llama", size: str = "tiny", seed: int = 0
) -> pathlib.Path:
    """Write a deterministic random-weight checkpoint of ``arch`` at ``size`` into ``out_dir`` and return its path.

    The same ``(arch, size, seed)`` always produces byte-identical files. Existing files of the same names are
    overwritten; stale weight files from an earlier write with a different layout are removed.
    """
    cfg = tiny_model_config(arch, size)
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stale in (*out.glob("model*.safetensors"), out / "model.safetensors.index.json"):
        stale.unlink(missing_ok=True)
    _write_weights(out, build_state_dict(cfg, seed), sharded=size == "small")
    _write_json(out / "config.json", hf_config_dict(cfg))
    _write_json(out / "generation_config.json", _generation_config_dict(cfg))
    (out / "tokenizer.json").write_text(_tokenizer_json(cfg.vocab_size) + "\n", encoding="utf-8")
    _write_json(out / "tokenizer_config.json", _tokenizer_config_dict(cfg))
    _write_json(out / "special_tokens_map.json", _special_tokens_map_dict())
    return out
