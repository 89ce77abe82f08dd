"""``tandem up --autoscale``: the SLO planner (operators/planner) scaling a real local cluster from its own metrics.

The end-to-end test runs the real ``tandem up`` process (Ray, the controller, worker processes, the router) with
tiny thresholds and a one-second interval, so that a short load ramp is enough: each worker runs at most two
sequences at once (``--max-num-seqs 2``), so eight concurrent clients leave requests queued on the decode worker,
past ``--queue-high 1``. The planner asks for a second decode replica; once the load ends (one client keeps
sending, below every threshold), it drains one again. Every request must succeed, with the greedy output
transformers gives (so the same on either replica). Nothing is faked.

The other tests check what is refused before anything starts, and the window arithmetic the autoscaler does in
place of a Prometheus server.
"""

from __future__ import annotations

import json
import random
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_tandem_up import Cluster, _alive

from cli.autoscale import autoscale_config
from cli.main import main
from controlplane.local_cluster import UpConfig
from controlplane.metrics_window import parse_scrape

MAX_TOKENS = 24
HEAVY_CLIENTS = 8


def _decode_workers(url: str) -> dict[str, float]:
    """The router's decode workers (by label) and the tokens each generated, from its /metrics."""
    text = httpx.get(url + "/metrics", timeout=10).text
    up: set[str] = set()
    generated: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.labels.get("role") not in ("decode", "both"):  # both: a decode replica serving adapters
                continue
            if s.name == "tandem_worker_up" and s.value == 1:
                up.add(s.labels["worker"])
            elif s.name == "tandem_worker_generated_tokens":
                generated[s.labels["worker"]] = s.value
    return {w: generated.get(w, 0.0) for w in up}


@pytest.mark.slow
def test_a_load_ramp_scales_decode_up_and_its_end_drains_it_back_without_a_failed_request(
        checkpoint: Callable[[str], Path], hf_greedy: Callable[..., list[int]], tmp_path: Path) -> None:
    from engine.tokenizer import Tokenizer

    model = checkpoint("llama")
    config = tmp_path / "up.json"
    config.write_text(json.dumps({"worker_flags": ["--max-num-seqs", "2"],
                                  "autoscale": {"scale_down_windows": 3, "kv_low": 0.5}}))
    cluster = Cluster(model, tmp_path / "home", (
        "--prefill", "0", "--decode", "1", "--config", str(config), "--autoscale", "--max-decode", "2",
        "--autoscale-interval", "1", "--queue-high", "1", "--scale-up-cooldown", "0", "--scale-down-cooldown", "2",
        "--ttft-slo", "60", "--itl-slo", "30"))

    def read_log() -> None:  # keeps the pipe drained and the log readable while the test runs
        assert cluster.proc.stdout is not None
        for line in cluster.proc.stdout:
            cluster.lines.append(line)

    threading.Thread(target=read_log, daemon=True).start()
    pids = {cluster.proc.pid, *cluster.state["worker_pids"]}
    try:
        rng = random.Random(29)
        prompts = [[rng.randrange(2000) for _ in range(8)] for _ in range(6)]  # under a block: routed by load
        tok = Tokenizer(model)
        want = [tok.decode(hf_greedy(model, p, MAX_TOKENS)) for p in prompts]
        served = openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused").models.list().data[0].id
        results: list[tuple[int, str, float]] = []
        errors: list[str] = []
        heavy, everything = threading.Event(), threading.Event()
        budget = 2000  # requests, all clients together

        def client(k: int, stop: threading.Event) -> None:
            nonlocal budget
            c = openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=60)
            i = k
            while not stop.is_set() and budget > 0:
                budget -= 1
                p = i % len(prompts)
                i += 1
                try:
                    r = c.completions.create(model=served, prompt=prompts[p], max_tokens=MAX_TOKENS, temperature=0,
                                             extra_body={"ignore_eos": True})
                    results.append((p, r.choices[0].text, time.monotonic()))
                except Exception as e:
                    errors.append(repr(e))

        def read_pids() -> None:
            pids.update(json.loads((cluster.home / "up.json").read_text())["worker_pids"])

        trickle = threading.Thread(target=client, args=(0, everything))
        trickle.start()
        ramp = []
        for k in range(1, HEAVY_CLIENTS):  # the ramp: one more client every quarter second
            ramp.append(threading.Thread(target=client, args=(k, heavy)))
            ramp[-1].start()
            time.sleep(0.25)
        deadline = time.monotonic() + 120
        while True:  # both decode replicas up in the router, and both have served
            workers = _decode_workers(cluster.url)
            read_pids()
            if len(workers) == 2 and all(n > 0 for n in workers.values()):
                break
            assert time.monotonic() < deadline, f"decode did not scale up: {workers}\n{''.join(cluster.lines)}"
            time.sleep(0.5)
        heavy.set()
        for t in ramp:
            t.join(60)
        ended = time.monotonic()
        deadline = ended + 90
        while len(_decode_workers(cluster.url)) != 1:  # the load's end: one replica drained and removed
            assert time.monotonic() < deadline, f"decode did not scale down:\n{''.join(cluster.lines)}"
            time.sleep(0.5)
        while not any("drained in" in line for line in cluster.lines) and time.monotonic() < deadline:
            time.sleep(0.2)
        everything.set()
        trickle.join(60)

        log = "".join(cluster.lines)
        assert "autoscale: decode 1 -> 2 (scale up: reactive: queue" in log, log
        assert "autoscale: decode 2 -> 1 (drain: reactive: queue, KV and latency all low" in log, log
        assert "(0 in flight at the end)" in log, log
        assert not errors, errors
        assert len(results) > HEAVY_CLIENTS
        assert any(t > ended for _, _, t in results), "no request was served while the scale-down drained"
        wrong = [(p, text) for p, text, _ in results if text != want[p]]
        assert not wrong, f"{len(wrong)} of {len(results)} outputs differ from transformers' greedy: {wrong[:3]}"
    finally:
        heavy.set()
        everything.set()
        rc = cluster.stop()
    assert rc == 0
    deadline = time.monotonic() + 20
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in pids if _alive(p)]
        time.sleep(0.1)
    assert not alive, f"processes left behind: {alive}"
    group = subprocess.run(["pgrep", "-g", str(cluster.proc.pid)], capture_output=True, text=True).stdout.split()
    assert not group, f"processes left in tandem up's process group: {group}"
    assert not (cluster.home / "up.json").exists()


@pytest.mark.parametrize(("flags", "message"), [
    (["--max-decode", "2"], "--max-decode only apply with --autoscale"),
    (["--autoscale"], "--autoscale has nothing to scale"),
    (["--autoscale", "--max-decode", "0"], "--decode 1 is outside --min-decode 1 .. --max-decode 0"),
    (["--autoscale", "--max-decode", "3", "--min-decode", "0"], "--min-decode must be >= 1"),
    (["--autoscale", "--prefill", "0", "--max-prefill", "2", "--max-decode", "2"], "--prefill 0"),
    (["--autoscale", "--max-decode", "3", "--gpu-budget", "1"], "--gpu-budget 1 is below the 2 ranks"),
    (["--autoscale", "--max-decode", "3", "--autoscale-interval", "0"], "interval must be a finite number"),
    (["--autoscale", "--max-decode", "3", "--queue-high", "0"], "queue_high must be > 0"),
    (["--autoscale", "--max-decode", "3", "--scale-down-windows", "0"], "scale_down_windows must be >= 1"),
])
def test_bad_autoscale_values_are_refused_before_anything_starts(
        flags: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Exit 2 with the problem named; the model (absent here) is not even looked at, so nothing could start."""
    assert main(["up", "--model", str(tmp_path / "absent"), *flags]) == 2
    assert message in capsys.readouterr().err


def test_config_file_autoscale_section_is_checked_and_flags_win(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "up.json"
    config.write_text(json.dumps({"autoscale": {"max_decode": 2, "itl_slo": 1}}))
    assert main(["up", "--model", str(tmp_path / "absent"), "--config", str(config)]) == 2
    assert "unknown autoscale settings ['itl_slo']" in capsys.readouterr().err
    config.write_text(json.dumps({"autoscale": {"max_decode": True}}))
    assert main(["up", "--model", str(tmp_path / "absent"), "--config", str(config)]) == 2
    assert "max_decode must be an integer, got True" in capsys.readouterr().err
    cfg = autoscale_config(UpConfig(prefill=1, decode=2), {"max_decode": 4, "interval_s": 2, "itl_slo_s": 0.5,
                                                           "min_decode": 2, "decode_tokens_per_s": 900})
    assert cfg.interval_s == 2 and cfg.planner.itl_slo_s == 0.5 and cfg.planner.gpu_budget == 5
    prefill, decode = cfg.planner.tiers
    assert (prefill.min_replicas, prefill.max_replicas, decode.min_replicas, decode.max_replicas) == (1, 1, 2, 4)
    assert decode.role == "decode" and decode.decode_tokens_per_s == 900
    colocated = autoscale_config(UpConfig(prefill=0, decode=1), {"max_decode": 2}).planner
    assert [(t.name, t.role) for t in colocated.tiers] == [("decode", "both")]


def test_a_window_between_two_scrapes_gives_rates_and_interpolated_percentiles() -> None:
    """Counter increases over the seconds between scrapes; histogram quantiles over the window's observations only,
    interpolated within the bucket as Prometheus' histogram_quantile does; a counter reset counts from zero."""
    page = """# TYPE tandem_prompt_tokens_total counter
tandem_prompt_tokens_total {prompt}
# TYPE tandem_ttft_seconds histogram
tandem_ttft_seconds_bucket{{mode="colocated",le="0.1"}} {a}
tandem_ttft_seconds_bucket{{mode="colocated",le="1.0"}} {b}
tandem_ttft_seconds_bucket{{mode="colocated",le="+Inf"}} {b}
tandem_ttft_seconds_count{{mode="colocated"}} {b}
tandem_ttft_seconds_sum{{mode="colocated"}} {s}
tandem_ttft_seconds_bucket{{mode="disaggregated",le="0.1"}} 0
tandem_ttft_seconds_bucket{{mode="disaggregated",le="1.0"}} 0
tandem_ttft_seconds_bucket{{mode="disaggregated",le="+Inf"}} {c}
tandem_ttft_seconds_count{{mode="disaggregated"}} {c}
tandem_ttft_seconds_sum{{mode="disaggregated"}} {cs}
"""
    first = parse_scrape(page.format(prompt=100, a=10, b=10, s=0.5, c=0, cs=0), 10.0)
    # the window: 10 more under 0.1 s, 20 in (0.1, 1], 10 beyond 1 s (in disaggregated)
    second = parse_scrape(page.format(prompt=400, a=20, b=40, s=20.0, c=10, cs=30.0), 12.0)
    assert second.increase("tandem_prompt_tokens", first) / (second.time_s - first.time_s) == 150
    h = second.window("tandem_ttft_seconds", first)
    assert h is not None and h.count == 40 and h.sum == pytest.approx(49.5)
    assert h.quantile(0.25) == pytest.approx(0.1)  # the 10th of 40: the top of the first bucket
    assert h.quantile(0.5) == pytest.approx(0.1 + 0.9 * 10 / 20)  # half-way into (0.1, 1]
    assert h.quantile(0.9) == pytest.approx(1.0)  # in +Inf: the highest finite bound
    reset = parse_scrape(page.format(prompt=30, a=1, b=1, s=0.01, c=0, cs=0), 13.0)
    assert reset.increase("tandem_prompt_tokens", second) == 30
    again = reset.window("tandem_ttft_seconds", second)
    assert again is not None and again.count == 1
    assert parse_scrape("", 0.0).window("tandem_ttft_seconds", first) is None


def test_tier_queues_and_kv_count_only_ready_workers_and_failed_ones_count_as_starting(tmp_path: Path) -> None:
    """A draining worker's queue is work on its way out: only READY workers' gauges (labelled by the worker id the
    controller learnt from Health, or by address before the router knew the id) make a tier's queue and KV use."""
    from types import SimpleNamespace

    from controlplane.autoscaler import first_api_key, tier_windows
    from controlplane.replica_state import Replica, ReplicaState

    replicas = [Replica("d1", "decode", 1, ReplicaState.READY, "127.0.0.1:1", worker_id="decode-aa"),
                Replica("d2", "decode", 1, ReplicaState.DRAINING, "127.0.0.1:2", worker_id="decode-bb"),
                Replica("d3", "decode", 1, ReplicaState.FAILED, "127.0.0.1:3"),
                Replica("p1", "prefill", 1, ReplicaState.READY, "127.0.0.1:4", worker_id="prefill-cc")]
    controller = SimpleNamespace(desired={"prefill": 1, "decode": 3},
                                 of_tier=lambda t: [r for r in replicas if r.tier == t])
    workers = (("decode-aa", "decode", 3, 30, 70), ("decode-bb", "decode", 9, 90, 10),
               ("127.0.0.1:4", "prefill", 1, 5, 15))  # (label, role, queue, KV used, KV free)
    lines = []
    for column, family in enumerate(("tandem_worker_queue_depth", "tandem_kv_blocks_used", "tandem_kv_blocks_free")):
        lines.append(f"# TYPE {family} gauge")
        lines += [f'{family}{{worker="{w[0]}",role="{w[1]}"}} {w[2 + column]}' for w in workers]
    prefill, decode = tier_windows(controller, parse_scrape("\n".join(lines) + "\n", 1.0))  # type: ignore[arg-type]
    assert (decode.ready, decode.starting, decode.draining, decode.queue_depth) == (1, 1, 1, 3)
    assert decode.kv_utilisation == pytest.approx(0.3)
    assert (prefill.ready, prefill.queue_depth, prefill.kv_utilisation) == (1, 1, 0.25)
    keys = tmp_path / "keys"
    keys.write_text("# ops\n\nadmin:from-file\n")
    assert first_api_key(("admin:k1", "k2"), None) == "k1"
    assert first_api_key((), str(keys)) == "from-file"
    assert first_api_key((), None) is None
