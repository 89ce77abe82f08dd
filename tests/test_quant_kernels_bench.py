"""``tandem bench quant --kernels``: the report's structure on a made-up config (only ``config.json`` is read: the
weights are random), one K of which takes no INT4 group of 128; ``--interleaved`` on the tiny model. Speeds are not
asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from bench.quant_kernels import format_interleaved_report, format_kernel_report, projection_shapes

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
CONFIG = {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
          "intermediate_size": 344, "vocab_size": 512, "num_hidden_layers": 2}


def test_projection_shapes_follow_the_engines_fused_projections() -> None:
    assert projection_shapes(CONFIG) == {"qkv": (256, 512), "o": (256, 256), "gate_up": (256, 688),
                                         "down": (344, 256), "lm_head": (256, 512)}


def test_kernel_bench_reports_every_shape_rows_and_configuration(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    proc = subprocess.run([sys.executable, "-m", "cli.main", "bench", "quant", "--kernels", "--model", str(tmp_path),
                           "--rows", "1,3", "--rounds", "2", "--json"], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["kind"] == "kernels" and report["layers"] == 2 and report["rounds"] == 2
    assert set(report["results"]) == {"qkv", "o", "gate_up", "down", "lm_head"}
    for name, by_rows in report["results"].items():
        assert set(by_rows) == {"1", "3"}
        for cell in by_rows.values():
            configs = {"bf16"} if name == "lm_head" else {"bf16", "w8a16", "w4a16"}
            assert configs <= set(cell)
            assert cell["bf16"]["cpu_us_min"] <= cell["bf16"]["cpu_us_median"] <= cell["bf16"]["cpu_us_max"]
            assert cell["bf16"]["rounds"] == 2
            if name == "down":  # 344 inputs: no INT4 group of 128
                assert "128" in cell["w4a16"]["skipped"] and "speedup_vs_bf16" in cell["w8a16"]
            elif name != "lm_head":
                assert cell["w4a16"]["speedup_vs_bf16"] > 0 and cell["w8a16"]["speedup_vs_bf16"] > 0
    for step in report["per_token"].values():  # INT4 has no down kernel here, so no INT4 step total
        assert set(step) == {"bf16_us", "w8a16_us", "w8a16_speedup_vs_bf16"}
    text = format_kernel_report(report)
    assert "qkv 256->512 M=1:" in text and "down 344->256 M=3:" in text and "per decode step of M=3" in text


def test_interleaved_decode_reports_each_configuration(checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    """``--interleaved`` on the tiny model and its INT8 copy (written beside it): the report's structure only."""
    import shutil

    model = tmp_path / "tiny"
    shutil.copytree(checkpoint("llama"), model)
    proc = subprocess.run([sys.executable, "-m", "cli.main", "bench", "quant", "--interleaved", "--model", str(model),
                           "--schemes", "w8a16", "--input-len", "8", "--output-len", "5", "--rounds", "2", "--json"],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["kind"] == "interleaved_decode" and report["rounds"] == 2 and report["output_len"] == 5
    assert set(report["results"]) == {"bf16", "w8a16"}
    for r in report["results"].values():
        assert r["cpu_ms_per_token_min"] <= r["cpu_ms_per_token_median"] <= r["cpu_ms_per_token_max"]
        assert r["rounds"] == 2
    assert "speedup_vs_bf16" in report["results"]["w8a16"] and "speedup_vs_bf16" not in report["results"]["bf16"]
    assert "w8a16:" in format_interleaved_report(report)
