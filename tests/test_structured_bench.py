"""``tandem bench structured`` runs end to end on the tiny model and reports every side per batch size: unconstrained,
JSON schema with the masks overlapped and inline, in wall and engine-thread CPU time."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path


def test_bench_structured_reports_constrained_and_unconstrained_step_times(checkpoint: Callable[[str], Path]) -> None:
    out = subprocess.run([sys.executable, "-m", "cli.main", "bench", "structured", "--model", str(checkpoint("llama")),
                          "--batch-sizes", "1,4", "--steps", "2", "--repeats", "1", "--threads", "1", "--json"],
                         capture_output=True, text=True, timeout=600, check=True)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert [r["batch"] for r in report["rows"]] == [1, 4]
    assert report["cpus"] >= 1 and len(report["load_average"]) == 3 and report["default_masks"] in ("overlap", "inline")
    for r in report["rows"]:
        for side in ("unconstrained", "json_schema_overlap", "json_schema_inline"):
            assert r[f"{side}_step_ms"] > 0 and r[f"{side}_cpu_ms"] > 0
        assert abs(r["overhead_pct"] - (r["json_schema_step_ms"] / r["unconstrained_step_ms"] - 1) * 100) < 0.5
        assert abs(r["cpu_overhead_inline_pct"] - (r["json_schema_inline_cpu_ms"] / r["unconstrained_cpu_ms"] - 1)
                   * 100) < 0.5
