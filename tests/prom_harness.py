"""A real ``prometheus`` server (the apt package) on loopback for the observability tests: it scrapes the given
targets every second (static ones, or those of a file_sd file such as ``tandem up``'s) and answers PromQL over its
HTTP API; stopped by PID. Grafana's variables are substituted
the way Grafana would before a query is sent."""

from __future__ import annotations

import json
import math
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def grafana_expr(expr: str, variables: dict[str, str], rate_interval: str = "5m") -> str:
    """``expr`` as Grafana sends it: ``$__rate_interval`` and each ``$name``/``${name}`` replaced."""
    out = expr.replace("$__rate_interval", rate_interval).replace("$__interval", rate_interval)
    for name, value in sorted(variables.items(), key=lambda kv: -len(kv[0])):
        out = out.replace("${" + name + "}", value).replace("$" + name, value)
    assert "$" not in out, f"unsubstituted variable in {out!r}"
    return out


class Prometheus:
    def __init__(self, targets: list[str], home: Path, file_sd: Path | None = None) -> None:
        exe = shutil.which("prometheus")
        if exe is None:
            pytest.fail("prometheus is not installed (.ci/run installs it)")
        config = home / "prometheus.yml"
        job: dict[str, Any] = {"job_name": "tandem"}
        if targets:
            job["static_configs"] = [{"targets": targets}]
        if file_sd is not None:
            job["file_sd_configs"] = [{"files": [str(file_sd)], "refresh_interval": "1s"}]
        config.write_text(json.dumps({  # JSON is YAML
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [job],
        }))
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = home / "prometheus.log"
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen([exe, f"--config.file={config}", f"--storage.tsdb.path={home / 'tsdb'}",
                                          f"--web.listen-address={self.url.removeprefix('http://')}"],
                                         stdout=out, stderr=subprocess.STDOUT)

    def query(self, expr: str) -> list[dict[str, Any]]:
        r = httpx.get(self.url + "/api/v1/query", params={"query": expr}, timeout=10)
        if r.status_code == 503:
            raise httpx.HTTPError("prometheus is still starting")
        assert r.status_code == 200, f"{expr!r}: {r.text}"
        body = r.json()
        assert body["status"] == "success", body
        return list(body["data"]["result"])

    def wait_for(self, expr: str, timeout_s: float = 60.0) -> list[dict[str, Any]]:
        """The result of ``expr`` once it has a sample with a finite value (waiting for scrapes and the server)."""
        deadline = time.monotonic() + timeout_s
        last: list[dict[str, Any]] = []
        while True:
            assert self.proc.poll() is None, "prometheus exited:\n" + self.log.read_text()[-3000:]
            try:
                last = self.query(expr)
                if any(math.isfinite(float(s["value"][1])) for s in last):
                    return last
            except httpx.HTTPError:
                pass  # not listening yet
            assert time.monotonic() < deadline, f"no finite result for {expr!r} (last: {last})"
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
