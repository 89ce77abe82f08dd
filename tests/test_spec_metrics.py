"""A speculating worker's own ``/metrics`` (worker/metrics.py): after a greedy request through a router to a real
``tandem worker --role both --speculative ngram`` process, its proposed and accepted token counters, acceptance
rate and mean accepted length are exported under the catalogue's names (router/metric_catalogue.py), and the
answer equals the same request to the offline engine without speculation."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from gateway_harness import WORKER_FLAGS, RouterThread
from prom_harness import free_port
from prometheus_client.parser import text_string_to_metric_families

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from router.server import RouterConfig
from worker.launcher import WorkerProcess, start_worker


@pytest.mark.slow
def test_a_speculating_worker_exports_acceptance_on_its_metrics(checkpoint: Callable[[str], Path]) -> None:
    model = str(checkpoint("llama"))
    port = free_port()
    worker: WorkerProcess | None = None
    rt = None
    try:
        worker = start_worker("both", model, "tcp", [*WORKER_FLAGS, "--worker-id", "sp-both", "--metrics-port",
                                                     str(port), "--speculative", "ngram",
                                                     "--num-speculative-tokens", "3"])
        rt = RouterThread(RouterConfig(model=model, workers=(worker.address,)))
        with httpx.Client(base_url=rt.url, timeout=60) as c:
            served = c.get("/v1/models").json()["data"][0]["id"]
            r = c.post("/v1/completions", json={"model": served, "max_tokens": 24, "ignore_eos": True,
                                                "temperature": 0, "prompt": "hello"})
            assert r.status_code == 200, r.text
            text = r.json()["choices"][0]["text"]
            body = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    finally:
        if rt is not None:
            rt.stop()
        if worker is not None:
            worker.stop()
    values = {s.name: s.value for f in text_string_to_metric_families(body) for s in f.samples
              if s.name.startswith("tandem_spec_decode") and s.labels == {"worker": "sp-both", "role": "both"}}
    drafts, proposed = values["tandem_spec_decode_drafts_total"], values["tandem_spec_decode_draft_tokens_total"]
    accepted = values["tandem_spec_decode_accepted_tokens_total"]
    assert drafts > 0 and 0 < accepted <= proposed <= 3 * drafts
    assert values["tandem_spec_decode_acceptance_rate"] == pytest.approx(accepted / proposed)
    assert values["tandem_spec_decode_mean_accepted_length"] == pytest.approx(1 + accepted / drafts)
    want = LLM(model, num_kv_blocks=64, num_threads=1).generate(
        ["hello"], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))[0].text
    assert text == want
