"""``tandem bench quant`` end to end on the tiny model (INT8 only: the tiny MLP's 688 inputs take no INT4 group of
128): every configuration runs and the report carries both measures and their ratios. Speeds are not asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]


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
    assert "not run" in report["vllm_cpu"]
