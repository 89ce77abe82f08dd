"""The locust suite (loadtest/) against ``tandem up``: a ~15 s headless closed-loop run of the mixed scenario with
both users (OpenAI HTTP streaming, gRPC Gateway) ends with 0 failures, records TTFT and ITL, and writes locust's
CSV and HTML reports and the percentile summary; a short open-loop run at a fixed rate does too. locust runs as
its own process, as a user would start it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from test_tandem_up import Cluster

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def cluster(checkpoint: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(checkpoint("llama"), tmp_path_factory.mktemp("tandem-home"))
    yield c
    assert c.stop() == 0


def _locust(cluster: Cluster, out: Path, locustfiles: str, *args: str) -> dict[str, object]:
    exe = shutil.which("locust") or shutil.which("locust", path=str(Path(sys.executable).parent))
    assert exe is not None, "locust is not installed (pip install -e '.[test]')"
    out.mkdir()
    cmd = [exe, "-f", locustfiles, "--host", cluster.url, "--headless", "--only-summary", "--csv", str(out / "run"),
           "--html", str(out / "run.html"), "--summary-file", str(out / "summary.json"), "--max-tokens", "16",
           "--long-words", "150", "--stop-timeout", "30", "--grpc-target", f"127.0.0.1:{cluster.grpc_port}", *args]
    proc = subprocess.run(cmd, cwd=out, capture_output=True, text=True, timeout=240,
                          env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[:3000] + proc.stderr[-3000:]
    for name in ("run_stats.csv", "run_stats_history.csv", "run_failures.csv", "run.html", "summary.json"):
        assert (out / name).stat().st_size > 0, name
    return dict(json.loads((out / "summary.json").read_text()))


def test_closed_loop_mixed_run_has_no_failures_and_records_ttft_and_itl(cluster: Cluster, tmp_path: Path) -> None:
    s = _locust(cluster, tmp_path / "closed", str(ROOT / "loadtest" / "locustfile.py"),
                "-u", "4", "-r", "4", "-t", "15s", "--scenario", "mix")
    print("closed-loop summary:", json.dumps(s))
    assert s["failures"] == 0
    ttft, itl = s["TTFT"], s["ITL"]
    assert isinstance(ttft, dict) and isinstance(itl, dict)
    assert ttft["count"] >= 4 and 0 < ttft["p50_ms"] <= ttft["p99_ms"]
    assert itl["count"] >= ttft["count"] and itl["p50_ms"] > 0
    stats = (tmp_path / "closed" / "run_stats.csv").read_text()
    assert "Gateway/Complete [mix]" in stats and "/v1/" in stats  # both users ran


def test_open_loop_constant_rate_run_has_no_failures(cluster: Cluster, tmp_path: Path) -> None:
    files = f"{ROOT / 'loadtest' / 'locustfile.py'},{ROOT / 'loadtest' / 'open_loop.py'}"
    s = _locust(cluster, tmp_path / "open", files, "-t", "8s", "--rate", "3", "--max-users", "6",
                "--scenario", "chat", "OpenAIHTTP")
    assert s["failures"] == 0
    ttft = s["TTFT"]
    assert isinstance(ttft, dict) and 12 <= ttft["count"] <= 30  # ~3/s for 8 s, not as fast as the server allows
