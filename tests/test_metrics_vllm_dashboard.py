"""``--vllm-metrics``: every query of vLLM's published Grafana dashboard (vllm-project/vllm,
``examples/online_serving/prometheus_grafana/grafana.json``; its PromQL expressions are written down below as
data) returns a finite result from a real Prometheus scraping a Tandem router, with real prefill and decode
worker processes behind it and a short streamed and non-streamed load, long prompts disaggregated."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from gateway_harness import WORKER_FLAGS, RouterThread
from prom_harness import Prometheus, grafana_expr

from router.metric_catalogue import exported_series
from router.server import RouterConfig
from worker.launcher import WorkerProcess, start_worker

pytestmark = pytest.mark.slow

_M = '{model_name="$model_name"}'
# The expressions of vLLM's dashboard, panel by panel (E2E latency, token throughput, TPOT, scheduler state, TTFT,
# cache utilisation, prompt/generation length heatmaps, finish reason, queue time, prefill/decode time, max tokens).
VLLM_DASHBOARD_QUERIES = (
    *(f"histogram_quantile({q}, sum by(le) (rate(vllm:e2e_request_latency_seconds_bucket{_M}[$__rate_interval])))"
      for q in ("0.99", "0.95", "0.9", "0.5")),
    f"rate(vllm:e2e_request_latency_seconds_sum{_M}[$__rate_interval])\n/\n"
    f"rate(vllm:e2e_request_latency_seconds_count{_M}[$__rate_interval])",
    f"rate(vllm:prompt_tokens_total{_M}[$__rate_interval])",
    f"rate(vllm:generation_tokens_total{_M}[$__rate_interval])",
    *(f"histogram_quantile({q}, sum by(le) (rate(vllm:time_per_output_token_seconds_bucket{_M}[$__rate_interval])))"
      for q in ("0.99", "0.95", "0.9", "0.5")),
    f"rate(vllm:time_per_output_token_seconds_sum{_M}[$__rate_interval])\n/\n"
    f"rate(vllm:time_per_output_token_seconds_count{_M}[$__rate_interval])",
    f"vllm:num_requests_running{_M}",
    f"vllm:num_requests_waiting{_M}",
    *(f"histogram_quantile({q}, sum by(le) (rate(vllm:time_to_first_token_seconds_bucket{_M}[$__rate_interval])))"
      for q in ("0.99", "0.95", "0.9", "0.5")),
    f"rate(vllm:time_to_first_token_seconds_sum{_M}[$__rate_interval])\n/\n"
    f"rate(vllm:time_to_first_token_seconds_count{_M}[$__rate_interval])",
    f"vllm:gpu_cache_usage_perc{_M}",
    f"sum by(le) (increase(vllm:request_prompt_tokens_bucket{_M}[$__rate_interval]))",
    f"sum by(le) (increase(vllm:request_generation_tokens_bucket{_M}[$__rate_interval]))",
    f"sum by(finished_reason) (increase(vllm:request_success_total{_M}[$__rate_interval]))",
    f"rate(vllm:request_queue_time_seconds_sum{_M}[$__rate_interval])",
    f"rate(vllm:request_prefill_time_seconds_sum{_M}[$__rate_interval])",
    f"rate(vllm:request_decode_time_seconds_sum{_M}[$__rate_interval])",
    f"rate(vllm:request_max_num_generation_tokens_sum{_M}[$__rate_interval])",
)
_MODEL = "tiny-vllm-names"


@pytest.fixture(scope="module")
def router(checkpoint: Callable[[str], Path]) -> Iterator[RouterThread]:
    model = str(checkpoint("llama"))
    workers: list[WorkerProcess] = []
    rt = None
    try:
        workers = [start_worker(role, model, "tcp", [*WORKER_FLAGS, "--worker-id", f"vm-{role}"])
                   for role in ("prefill", "decode")]
        rt = RouterThread(RouterConfig(model=model, workers=tuple(w.address for w in workers),
                                       served_model_name=_MODEL, min_uncached_tokens=32, vllm_metrics=True))
        yield rt
    finally:
        if rt is not None:
            rt.stop()
        for w in workers:
            w.stop()


def _load(url: str) -> None:
    """A short bounded load: streamed and whole, short (colocated) and long (disaggregated) prompts."""
    with httpx.Client(base_url=url, timeout=60) as c:
        for i in range(8):
            body = {"model": _MODEL, "prompt": f"request {i} " + ("long context " * 40 if i % 2 else ""),
                    "max_tokens": 6, "ignore_eos": True, "stream": i < 6}
            if i < 6:
                with c.stream("POST", "/v1/completions", json=body) as r:
                    assert r.status_code == 200
                    events = [line for line in r.iter_lines() if line.startswith("data: ")]
                    assert events[-1] == "data: [DONE]"
                    assert any(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1])
            else:
                r = c.post("/v1/completions", json=body)
                assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6


def test_every_vllm_dashboard_query_answers_from_a_tandem_router(router: RouterThread, tmp_path: Path) -> None:
    """Each query, with ``$model_name`` and ``$__rate_interval`` substituted as Grafana would, returns at least
    one finite sample; the disaggregated and colocated paths were both taken."""
    prom = Prometheus([router.url.removeprefix("http://")], tmp_path)
    try:
        prom.wait_for('up{job="tandem"} == 1')
        _load(router.url)
        modes = {s["metric"]["mode"] for s in prom.wait_for("tandem_router_decisions_total")}
        assert modes == {"colocated", "disaggregated"}, modes
        # the tandem_ KV transfer counters the prefill worker reports in Load, labelled with its backend
        moved = prom.wait_for('tandem_kv_transfer_bytes_total{role="prefill",backend="tcp"} > 0')
        assert len(moved) == 1
        prom.wait_for('tandem_kv_transfers_total{role="prefill"} >= 3')
        for expr in VLLM_DASHBOARD_QUERIES:
            result = prom.wait_for(grafana_expr(expr, {"model_name": _MODEL}), timeout_s=30)
            assert all(s["metric"].get("model_name", _MODEL) == _MODEL for s in result), expr
    finally:
        prom.stop()


def test_the_dashboard_queries_only_name_series_the_catalogue_exports() -> None:
    """A vLLM series the catalogue does not map would fail the query above; this names it without a cluster."""
    import re

    names = {n for expr in VLLM_DASHBOARD_QUERIES for n in re.findall(r"vllm:[a-z0-9_]+", expr)}
    assert names <= exported_series(), sorted(names - exported_series())
    assert len(names) == 21, sorted(names)  # every series the dashboard uses was found in its queries
