"""Quantized weights without a model: format round trips, the CPU kernel against dequantize-then-matmul, and the
refusal of unsupported schemes (in a checkpoint's config and on ``tandem model quantize``'s command line)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine.quant import formats
from engine.quant.kernels import QuantLinear, wq_linear_kernel
from engine.quant.scheme import UnsupportedQuantizationError, cli_scheme, scheme_from_config
from engine.quant.weights import QuantizedMatrix

REPO = Path(__file__).resolve().parents[1]


def _matrix(bits: int, rows: int, cols: int, group: int, zero: bool, seed: int = 0) -> QuantizedMatrix:
    g = torch.Generator().manual_seed(seed)
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    q = torch.randint(lo, hi + 1, (rows, cols), dtype=torch.int8, generator=g)
    scale = torch.rand(rows, cols // group, generator=g) * 0.01 + 1e-3
    # GPTQ v1 cannot store an unsigned zero point of 0 (it writes zero - 1), so zero points stay above lo
    z = torch.randint(lo + 1, hi + 1, (rows, cols // group), dtype=torch.int8, generator=g) if zero else None
    return QuantizedMatrix(q, scale, z, bits)


@pytest.mark.parametrize("fmt", ["compressed-tensors", "gptq", "awq"])
@pytest.mark.parametrize("bits,zero", [(4, False), (4, True), (8, False), (8, True)])
def test_each_format_round_trips_integers_scales_and_zero_points(fmt: str, bits: int, zero: bool) -> None:
    if fmt == "awq" and bits == 8:
        pytest.skip("AWQ's GEMM layout holds INT4 only")
    m = _matrix(bits, 48, 256, 64, zero)
    pack, unpack = {"compressed-tensors": (formats.to_compressed_tensors, formats.from_compressed_tensors),
                    "gptq": (formats.to_gptq, formats.from_gptq), "awq": (formats.to_awq, formats.from_awq)}[fmt]
    back = unpack(pack(m, torch.float32), bits)
    assert isinstance(back, QuantizedMatrix)
    assert torch.equal(back.q, m.q) and torch.equal(back.scale, m.scale)
    assert (back.zero is None) == (m.zero is None)
    if m.zero is not None:
        assert back.zero is not None and torch.equal(back.zero, m.zero)
    assert torch.equal(back.dequantize(), m.dequantize())


def test_gptq_act_order_loads_dense_in_its_group_order() -> None:
    m = _matrix(4, 32, 128, 32, zero=True)
    t = formats.to_gptq(m, torch.float32)
    perm = torch.randperm(128, generator=torch.Generator().manual_seed(1))
    t["g_idx"] = (torch.arange(128) // 32)[perm].to(torch.int32)  # input k belongs to group g_idx[k]
    dense = formats.from_gptq(t, 4)
    assert isinstance(dense, torch.Tensor)
    q = m.q.float()
    expected = (q - m.zero.float()[:, t["g_idx"].long()]) * m.scale[:, t["g_idx"].long()]  # type: ignore[union-attr]
    assert torch.equal(dense, expected)


@pytest.mark.parametrize("bits,group,zero", [(8, 256, False), (8, 16, True), (4, 32, False), (4, 16, True),
                                             (4, 128, False)])
@pytest.mark.parametrize("rows", [1, 5, 32, 40])
def test_kernel_matches_dequantize_then_matmul(bits: int, group: int, zero: bool, rows: int) -> None:
    fn = wq_linear_kernel()
    if fn is None:
        pytest.skip("no C compiler: quantized weights run dequantized, which the parity tests cover")
    m = _matrix(bits, 70, 256, group, zero, seed=rows)  # 70 rows: a partial block of four
    ql = QuantLinear(m, fn)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(2))
    ref = x @ m.dequantize().T
    got = ql(x)
    assert got.dtype is torch.float32
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    bias = torch.randn(70)
    torch.testing.assert_close(ql(x, bias), ref + bias, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    got_bf16 = ql(x.bfloat16())
    assert got_bf16.dtype is torch.bfloat16
    torch.testing.assert_close(got_bf16.float(), x.bfloat16().float() @ m.dequantize().T, rtol=1e-2,
                               atol=1e-2 * float(ref.abs().max()))
    assert torch.equal(ql.dequantize(), m.dequantize())


def _ct_config(**weights: object) -> dict[str, object]:
    w = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128} | weights
    return {"quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                    "config_groups": {"group_0": {"targets": ["Linear"], "weights": w}}}}


def test_supported_schemes_parse() -> None:
    assert scheme_from_config({}) is None
    s = scheme_from_config(_ct_config())
    assert s is not None and (s.method, s.bits, s.group_size) == ("compressed-tensors", 4, 128)
    s = scheme_from_config(_ct_config(num_bits=8, strategy="channel", group_size=None))
    assert s is not None and (s.bits, s.group_size) == (8, None)
    s = scheme_from_config({"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128}})
    assert s is not None and s.name == "gptq:w4a16"
    s = scheme_from_config({"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 64,
                                                    "version": "gemm", "zero_point": True}})
    assert s is not None and (s.method, s.group_size) == ("awq", 64)


@pytest.mark.parametrize("config,named", [
    ({"quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True}}, "bitsandbytes"),
    ({"quantization_config": {"quant_method": "gguf"}}, "gguf"),
    ({"quantization_config": {"quant_method": "awq", "bits": 4, "version": "exllama"}}, "exllama"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 3}}, "3-bit"),
    (_ct_config(num_bits=2), "2-bit"),
    (_ct_config(strategy="block"), "block"),
    (_ct_config() | {"quantization_config": {**_ct_config()["quantization_config"],  # type: ignore[dict-item]
                                             "format": "marlin-24"}}, "marlin-24"),
])
def test_unsupported_scheme_in_config_is_refused_naming_it(config: dict[str, object], named: str) -> None:
    with pytest.raises(UnsupportedQuantizationError, match=named):
        scheme_from_config(config)


def test_activation_quantization_is_refused_naming_it() -> None:
    cfg = _ct_config(num_bits=8, strategy="channel", group_size=None)
    group = cfg["quantization_config"]["config_groups"]["group_0"]  # type: ignore[index]
    group["input_activations"] = {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}
    with pytest.raises(UnsupportedQuantizationError, match="input_activations"):
        scheme_from_config(cfg)


def test_loading_a_checkpoint_with_an_unsupported_scheme_fails_naming_it(checkpoint: Callable[[str], Path],
                                                                          tmp_path: Path) -> None:
    from engine.loader import load_model

    src = checkpoint("llama")
    dst = tmp_path / "bnb"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedQuantizationError, match="'bitsandbytes'"):
        load_model(dst, torch.float32)


def test_cli_scheme_names() -> None:
    assert cli_scheme("w8a16") == (8, None)
    assert cli_scheme("w4a16") == (4, 128)
    assert cli_scheme("w4a16", 32) == (4, 32)
    with pytest.raises(ValueError, match="power of two"):
        cli_scheme("w4a16", 48)


@pytest.mark.parametrize("argv,named", [(["--scheme", "w3a16"], "'w3a16'"), (["--scheme", "fp4"], "'fp4'"),
                                        (["--scheme", "w4a16", "--format", "gguf"], "'gguf'")])
def test_quantize_command_refuses_an_unsupported_scheme_naming_it(checkpoint: Callable[[str], Path],
                                                                    tmp_path: Path, argv: list[str],
                                                                    named: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "cli.main", "model", "quantize", str(checkpoint("llama")),
                           str(tmp_path / "out"), *argv, "--group-size", "16"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert named in proc.stderr
    assert not (tmp_path / "out" / "model.safetensors").exists()
