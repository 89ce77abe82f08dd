"""Greedy token-for-token parity of quantized checkpoints with transformers running the same weights dequantized.

``tandem model quantize`` writes compressed-tensors checkpoints of the tiny models; the reference is transformers
loading that very checkpoint (its compressed-tensors integration unpacks and dequantizes the weights to float32 on
CPU) and generating greedily in float32. Tandem runs the integers through its weight-only kernel. INT8 per channel and
INT4 grouped (group 16: the tiny MLP's 688 inputs admit no larger power of two), on Llama and Qwen2 (q/k/v bias, tied
embeddings).

GPTQ and AWQ: transformers (5.25) loads both formats, on CPU too, only through gptqmodel (plus optimum for GPTQ),
which is not installable here: gptqmodel 7.7.0 is a source build that requires torch>=2.14.1, and Tandem runs the
CPU build of torch 2.13 (installing it would replace torch). So the same integers and scales are written in the GPTQ
and AWQ layouts by ``--format gptq|awq`` and checked to load to the same dense weights and the same tokens as the
compressed-tensors checkpoint, whose reference is transformers as above.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine.llm import LLM
from engine.loader import iter_weights
from engine.quant.quantize import quantize_checkpoint
from engine.quant.reader import QuantizedCheckpoint
from engine.quant.scheme import scheme_from_config
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow
MAX_NEW = 12
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
GROUP = {"w8a16": None, "w4a16": 16}


@pytest.fixture(scope="module")
def quantized(checkpoint: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
              ) -> Callable[[str, str, str], Path]:
    cache: dict[tuple[str, str, str], Path] = {}

    def get(arch: str, scheme: str, fmt: str = "compressed-tensors") -> Path:
        key = (arch, scheme, fmt)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"{arch}-{scheme}-{fmt}")
            cache[key] = quantize_checkpoint(checkpoint(arch), out, scheme, GROUP[scheme], fmt)
        return cache[key]

    return get


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(31)
    return [[rng.randrange(vocab - 8) for _ in range(n)] for n in (1, 7, 33, 100)]


def _reference(path: Path, prompts: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW,
                                 min_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
        outs.append(out[0, len(p):].tolist())
    return outs


def _kernel_weights(llm: LLM) -> int:
    return sum(1 for p in llm.engine.model.parameters() if getattr(p, "quant", None) is not None)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("scheme", ["w8a16", "w4a16"])
def test_quantized_greedy_matches_transformers_on_the_dequantized_weights(
        quantized: Callable[..., Path], arch: str, scheme: str) -> None:
    path = quantized(arch, scheme)
    llm = LLM(str(path), num_kv_blocks=128)
    layers = llm.engine.model_config.num_layers
    if _kernel_weights(llm) == 0:
        pytest.skip("no native kernel here: the dequantized path is what runs (covered by the unquantized parity)")
    assert _kernel_weights(llm) == 4 * layers  # qkv, o, gate_up, down of every layer; lm_head stays dense
    prompts = _prompts(llm.engine.model_config.vocab_size)
    outs = llm.generate(prompts, GREEDY)
    ref = _reference(path, prompts)
    for prompt, out, expected in zip(prompts, outs, ref, strict=True):
        assert out.token_ids == expected, f"{arch} {scheme}: prompt of {len(prompt)} tokens diverged"
    llm.engine.check_block_accounting()


@pytest.mark.parametrize("scheme,fmt", [("w4a16", "gptq"), ("w8a16", "gptq"), ("w4a16", "awq")])
def test_gptq_and_awq_checkpoints_load_the_same_weights_and_tokens(quantized: Callable[..., Path], scheme: str,
                                                                   fmt: str) -> None:
    import json

    ct, other = quantized("llama", scheme), quantized("llama", scheme, fmt)

    def dense(path: Path) -> dict[str, torch.Tensor]:
        s = scheme_from_config(json.loads((path / "config.json").read_text()))
        assert s is not None and s.method == (fmt if path == other else "compressed-tensors")
        return dict(QuantizedCheckpoint(s, iter_weights(path)).weights())

    a, b = dense(ct), dense(other)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name].float(), b[name].float()), name
    prompts = _prompts(2048)
    llm_ct = LLM(str(ct), num_kv_blocks=128)
    llm_other = LLM(str(other), num_kv_blocks=128)
    assert _kernel_weights(llm_other) == _kernel_weights(llm_ct)
    got = [o.token_ids for o in llm_other.generate(prompts, GREEDY)]
    assert got == [o.token_ids for o in llm_ct.generate(prompts, GREEDY)]
    assert got == _reference(ct, prompts)


def test_fp8_weights_load_dequantized_and_match_transformers(checkpoint: Callable[[str], Path],
                                                             tmp_path: Path) -> None:
    """compressed-tensors ``float-quantized`` FP8 (e4m3) weights with per-channel scales, written here (the quantizer
    writes integer schemes only): Tandem widens them to float32 at load (no CPU kernel takes FP8), transformers runs
    the same checkpoint with its own compressed-tensors handling."""
    import json
    import re
    import shutil

    from safetensors.torch import save_file

    src, dst = checkpoint("llama"), tmp_path / "fp8"
    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        f.unlink()
    tensors = {}
    for name, t in iter_weights(src):
        if re.search(r"\.(q|k|v|o|gate|up|down)_proj\.weight$", name):
            scale = t.abs().amax(1, keepdim=True) / 448.0  # e4m3's largest finite value
            tensors[name] = (t / scale).to(torch.float8_e4m3fn)
            tensors[name.removesuffix("weight") + "weight_scale"] = scale
        else:
            tensors[name] = t
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
        "ignore": ["lm_head"], "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False}}}}
    (dst / "config.json").write_text(json.dumps(cfg))
    llm = LLM(str(dst), num_kv_blocks=128)
    assert _kernel_weights(llm) == 0
    qkv: torch.Tensor = llm.engine.model._layer_seq[0].self_attn.qkv_proj
    q_rows = tensors["model.layers.0.self_attn.q_proj.weight"].shape[0]
    expected = tensors["model.layers.0.self_attn.q_proj.weight"].float() \
        * tensors["model.layers.0.self_attn.q_proj.weight_scale"]
    assert torch.equal(qkv[:q_rows], expected)
    prompts = _prompts(2048)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == _reference(dst, prompts)


def test_quantized_moe_experts_load_dequantized_and_match_transformers(quantized: Callable[..., Path],
                                                                       tmp_path: Path) -> None:
    """Mixtral with every expert's w1/w2/w3 quantized (INT8): experts run dense from the dequantized integers (no
    kernel), attention through the kernel; the reference is transformers on the dequantized checkpoint
    (``dequantized_checkpoint``: ``(q - zero) * scale`` in float32, written as a plain HF checkpoint)."""
    from engine.quant.quantize import dequantized_checkpoint

    path = quantized("mixtral", "w8a16")
    llm = LLM(str(path), num_kv_blocks=128)
    assert _kernel_weights(llm) == 2 * llm.engine.model_config.num_layers  # qkv and o; experts stay dense
    prompts = _prompts(2048)[:2]
    got = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert got == _reference(dequantized_checkpoint(path, tmp_path / "dense"), prompts)
