"""The metric catalogue (router/metric_catalogue.py) against what a router renders: every family it exports is
catalogued with its help text, every catalogued family is exported, and ``vllm_names`` adds the vLLM names with the
same values. The pool is a stand-in holding one worker's ``Load`` report (no worker process is needed to render)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from proto.tandem.v1 import worker_pb2 as pb
from router.metric_catalogue import BY_NAME, METRICS, MetricSpec, exported_series
from router.metrics import RouterMetrics


def _pool() -> Any:
    load = pb.LoadResponse(waiting=2, running=3, waiting_for_kv=1, used_blocks=30, free_blocks=70, total_blocks=100,
                           transfers_in_flight=1, generated_tokens=42)
    w = SimpleNamespace(worker_id="d0", address="127.0.0.1:1", role="decode", healthy=True, cutoffs=0, last_load=load,
                        kv_backend="tcp")
    p_load = pb.LoadResponse(total_blocks=100, free_blocks=100, kv_transfers_done=3, kv_transfers_failed=1,
                             kv_transfer_bytes=4096, kv_transfer_exposed_us=1500)
    p = SimpleNamespace(worker_id="p0", address="127.0.0.1:2", role="prefill", healthy=True, cutoffs=0,
                        last_load=p_load, kv_backend="nixl")
    return SimpleNamespace(workers={"d0": w, "p0": p})


def _render(m: RouterMetrics) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(m.render().decode())}


def _metrics(vllm: bool) -> RouterMetrics:
    m = RouterMetrics(_pool(), retries=lambda: 1, migrations=lambda: 0, model_name="tiny", vllm_names=vllm,
                      tiers=lambda: {"prefill": (2, 1), "decode": (1, 1)})
    m.prompt_tokens.inc(10)
    m.cached_tokens.inc(4)
    m.generation_tokens.inc(6)
    m.request_done(10, [6, 2], ["length", None], t0=1.0, dispatched=1.25, first_token=1.5, end=3.5)
    return m


def test_every_exported_family_is_catalogued_with_its_help_and_every_catalogued_one_is_exported() -> None:
    fams = _render(_metrics(False))
    router_served = {n for n, m in BY_NAME.items() if m.exporter == "router"}  # workers': test_kv_transfer_metrics
    assert set(fams) == router_served, set(fams) ^ router_served
    for name, f in fams.items():
        assert f.documentation == BY_NAME[name].help and f.type == BY_NAME[name].kind, name


def test_request_phases_tokens_and_finish_reasons_are_observed() -> None:
    fams = _render(_metrics(False))

    def value(fam: str, sample: str, **labels: str) -> float:
        return next(s.value for s in fams[fam].samples if s.name == sample and s.labels == labels)

    assert value("tandem_request_queue_time_seconds", "tandem_request_queue_time_seconds_sum") == 0.25
    assert value("tandem_request_prefill_time_seconds", "tandem_request_prefill_time_seconds_sum") == 0.25
    assert value("tandem_request_decode_time_seconds", "tandem_request_decode_time_seconds_sum") == 2.0
    assert value("tandem_request_generation_tokens", "tandem_request_generation_tokens_sum") == 8
    assert value("tandem_request_max_num_generation_tokens", "tandem_request_max_num_generation_tokens_sum") == 6
    assert value("tandem_request_success", "tandem_request_success_total", finished_reason="length") == 1
    assert value("tandem_request_success", "tandem_request_success_total", finished_reason="abort") == 1
    assert value("tandem_prefix_cache_hit_rate", "tandem_prefix_cache_hit_rate") == pytest.approx(0.4)
    assert value("tandem_kv_cache_usage_ratio", "tandem_kv_cache_usage_ratio", worker="d0", role="decode") == 0.3
    kv = {"worker": "p0", "role": "prefill", "backend": "nixl"}
    assert value("tandem_kv_transfers", "tandem_kv_transfers_total", **kv) == 3
    assert value("tandem_kv_transfer_failures", "tandem_kv_transfer_failures_total", **kv) == 1
    assert value("tandem_kv_transfer_bytes", "tandem_kv_transfer_bytes_total", **kv) == 4096
    assert value("tandem_kv_transfer_exposed_seconds", "tandem_kv_transfer_exposed_seconds_total", **kv) == 0.0015
    assert value("tandem_tier_replicas_desired", "tandem_tier_replicas_desired", tier="prefill") == 2
    assert value("tandem_tier_replicas_ready", "tandem_tier_replicas_ready", tier="prefill") == 1


def test_vllm_names_repeat_the_tandem_values_with_a_model_name_label() -> None:
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(_metrics(True).render().decode()) for s in f.samples}
    assert samples[("vllm:prompt_tokens_total", (("model_name", "tiny"),))] == 10
    assert samples[("vllm:prefix_cache_hits_total", (("model_name", "tiny"),))] == 4
    assert samples[("vllm:num_requests_running", (("model_name", "tiny"), ("role", "decode"), ("worker", "d0")))] == 4
    assert samples[("vllm:num_requests_waiting", (("model_name", "tiny"), ("role", "decode"), ("worker", "d0")))] == 2
    assert samples[("vllm:gpu_cache_usage_perc", (("model_name", "tiny"), ("role", "decode"), ("worker", "d0")))] == 0.3
    assert samples[("vllm:request_decode_time_seconds_sum", (("model_name", "tiny"),))] == 2.0
    exported = {name for name, _ in samples}
    assert {n for n in exported if n.startswith("vllm:")} <= exported_series()
    assert not any(n.startswith("vllm:") for n in {s.name for f in text_string_to_metric_families(
        _metrics(False).render().decode()) for s in f.samples})


def test_a_catalogue_entry_is_checked_when_it_is_written() -> None:
    assert all(m.name.startswith("tandem_") for m in METRICS)
    with pytest.raises(ValueError, match="without _total"):
        MetricSpec("tandem_x_total", "counter", "x")
    with pytest.raises(ValueError, match="buckets"):
        MetricSpec("tandem_x_seconds", "histogram", "x")
    with pytest.raises(ValueError, match="prefixed"):
        MetricSpec("x", "gauge", "x")
