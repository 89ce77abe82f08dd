"""``tandem up --prefill 0 --decode 2 --decode-tp 2``: a real local cluster (Ray, the controller, the router) whose
decode replicas are workers with two rank processes each (rank 1 the worker's child, gloo on loopback), served to
the official openai client exactly; a rank killed under load has its replica replaced with no request failing, and
SIGINT leaves no process behind, ranks included. ``tandem up --prefill 1 --prefill-tp 2 --decode 1``: a prefill
replica of two ranks feeds a TP=1 decode replica, each prefill rank sending its own heads' KV (its prefill worker's
/metrics count the transfers), and serves the openai client exactly. A split the model cannot take, or ranks whose
KV cannot move between the tiers rank to rank, are refused before anything starts (flags and --config).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import psutil
import pytest
from cli_runs import run_at_once
from openai.types.chat import ChatCompletionMessageParam
from test_tandem_up import Cluster, _alive

from engine.tokenizer import Tokenizer

pytestmark = pytest.mark.slow


BAD_SPLITS = [
    (["--prefill", "0", "--decode-tp", "3"], "decode: tensor parallel size 3"),
    (["--prefill", "0", "--pp", "99"], "above the number of layers"),
    (["--prefill", "0", "--ep", "2"], "needs a MoE model"),
    (["--decode-tp", "2", "--pp", "2"], "pp must be 1"),
    (["--prefill-tp", "8"], "prefill: tp 8 is above the model's 4 KV heads"),
    (["--prefill", "0", "--decode-tp", "0"], "decode_tp must be an int >= 1"),
]


Runs = dict[str, tuple[Path, subprocess.CompletedProcess[str]]]


@pytest.fixture(scope="module")
def bad_split_runs(checkpoint: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> Runs:
    """Every bad split's ``tandem up`` at once, each in its own TANDEM_HOME (one process of ~2 s of imports each;
    side by side instead of one after another): by ' '.join(flags), its home and how it ended."""
    homes = [tmp_path_factory.mktemp("bad-split-home") for _ in BAD_SPLITS]
    done = run_at_once([["up", "--model", str(checkpoint("llama")), *flags] for flags, _ in BAD_SPLITS],
                       [{**os.environ, "TANDEM_HOME": str(home), "RAY_AUTH_MODE": "disabled"} for home in homes],
                       timeout_s=120)
    return {" ".join(flags): (home, d) for (flags, _), home, d in zip(BAD_SPLITS, homes, done, strict=True)}


@pytest.mark.parametrize(("flags", "message"), BAD_SPLITS)
def test_a_bad_split_is_refused_before_anything_starts(bad_split_runs: Runs, flags: list[str], message: str) -> None:
    home, done = bad_split_runs[" ".join(flags)]
    assert done.returncode == 2, done.stdout + done.stderr
    assert message in done.stderr
    assert "ray" not in done.stdout.lower() and not (home / "up.json").exists()


def test_the_config_file_takes_the_same_settings_and_checks(checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    cfg = tmp_path / "up.conf.json"
    cfg.write_text('{"prefill": 0, "decode_tp": 3, "pp": 1}')
    env = {**os.environ, "TANDEM_HOME": str(tmp_path), "RAY_AUTH_MODE": "disabled"}
    done = subprocess.run([sys.executable, "-m", "cli.main", "up", "--model", str(checkpoint("llama")), "--config",
                           str(cfg)], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 2 and "decode: tensor parallel size 3 must divide" in done.stderr, done.stderr


def test_a_prefill_tp2_replica_feeds_a_tp1_decode_replica_through_the_openai_client(
        checkpoint: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory,
        hf_greedy: Callable[..., list[int]]) -> None:
    path = checkpoint("llama")
    c = Cluster(path, tmp_path_factory.mktemp("tandem-home"),
                ("--prefill", "1", "--prefill-tp", "2", "--decode", "1"))
    try:
        workers = list(c.state["worker_pids"])
        assert sorted("--tp 2" in " ".join(psutil.Process(w).cmdline()) for w in workers) == [False, True]
        pids = [c.proc.pid, *workers, *[p.pid for w in workers for p in psutil.Process(w).children()]]
        client = openai.OpenAI(base_url=c.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        tok = Tokenizer(path)
        # above the router's 64 uncached tokens: each goes disaggregated
        prompts = [[random.Random(i).randrange(2000) for _ in range(n)] for i, n in ((1, 70), (2, 90))]
        for prompt in prompts:
            r = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0,
                                          extra_body={"ignore_eos": True})
            assert r.choices[0].text == tok.decode(hf_greedy(path, prompt, 8))
        targets = json.loads(Path(c.state["prometheus_targets"]).read_text())
        (prefill_metrics,) = [t for g in targets if g["labels"].get("tier") == "prefill" for t in g["targets"]]
        text = urllib.request.urlopen(f"http://{prefill_metrics}/metrics", timeout=10).read().decode()
        sent = [line for line in text.splitlines() if line.startswith("tandem_kv_transfer_seconds_count")]
        assert sent and sum(float(line.split()[-1]) for line in sent) >= len(prompts), text[:2000]
    finally:
        code = c.stop()
    assert code == 0
    deadline = time.monotonic() + 30
    while (alive := [p for p in pids if _alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive, f"processes left behind: {alive}"


def test_tp2_replicas_serve_openai_exactly_and_a_rank_killed_under_load_fails_no_request(
        checkpoint: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory,
        hf_greedy: Callable[..., list[int]]) -> None:
    """Two decode replicas of TP=2 (four rank processes on two cores, oversubscribed) serve the openai client
    (completions equal transformers', chat streamed equals unstreamed); then, under a bounded closed-loop
    load (40 requests, 2 at a time, 240 s at most): rank 1 of one replica is killed with SIGKILL after the 5th
    answer. Its worker exits, the controller replaces the replica as a whole, every request succeeds with
    transformers' tokens (the router retries or migrates what was on the dead replica), and nothing is left."""
    c = Cluster(checkpoint("llama"), tmp_path_factory.mktemp("tandem-home"),
                ("--prefill", "0", "--decode", "2", "--decode-tp", "2"))
    try:
        workers = list(c.state["worker_pids"])
        assert len(workers) == 2
        ranks = {w: [p.pid for p in psutil.Process(w).children() if "resource_tracker" not in " ".join(p.cmdline())]
                 for w in workers}
        assert all(len(r) == 1 for r in ranks.values()), "a TP=2 replica's rank 1 is not a child of its worker"
        assert all("--tp 2" in " ".join(psutil.Process(w).cmdline()) for w in workers)
        client = openai.OpenAI(base_url=c.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        tok = Tokenizer(checkpoint("llama"))
        long = [random.Random(5).randrange(2000) for _ in range(70)]
        r = client.completions.create(model=model, prompt=long, max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.choices[0].text == tok.decode(hf_greedy(checkpoint("llama"), long, 8))
        chat: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Say hi"}]
        full = client.chat.completions.create(model=model, messages=chat, max_tokens=10, temperature=0)
        stream = list(client.chat.completions.create(model=model, messages=chat, max_tokens=10, temperature=0,
                                                     stream=True))
        assert "".join(x.choices[0].delta.content or "" for x in stream if x.choices) == full.choices[0].message.content
        prompt = [7, 8, 9, 10, 11]
        want = tok.decode(hf_greedy(checkpoint("llama"), prompt, 8))
        done, failed, wrong = [], [], []
        killed = threading.Event()
        deadline = time.monotonic() + 240

        def one(i: int) -> None:
            if time.monotonic() > deadline:
                failed.append(f"{i}: past the load's deadline")
                return
            try:
                r = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0,
                                              extra_body={"ignore_eos": True})
            except openai.APIError as e:
                failed.append(f"{i}: {e}")
                return
            done.append(i)
            if r.choices[0].text != want:
                wrong.append(i)
            if len(done) == 5 and not killed.is_set():
                killed.set()
                os.kill(ranks[workers[0]][0], signal.SIGKILL)

        with ThreadPoolExecutor(2) as pool:
            list(pool.map(one, range(40)))
        assert killed.is_set()
        assert not failed, f"{len(failed)} of 40 failed: {failed[:3]}"
        assert not wrong, f"answers differ from transformers': {wrong}"
        replaced = time.monotonic() + 180
        while True:
            now = json.loads((c.home / "up.json").read_text())["worker_pids"]
            if workers[0] not in now and len(now) == 2 and all(_alive(p) for p in now):
                break
            assert time.monotonic() < replaced, f"the replica was not replaced: {now}"
            time.sleep(0.5)
        assert not _alive(workers[0]) and not _alive(ranks[workers[0]][0])
        new = next(w for w in now if w != workers[1])
        pids = [c.proc.pid, *now, *ranks[workers[1]], *[p.pid for p in psutil.Process(new).children()]]
    finally:
        code = c.stop()
    assert code == 0
    stop_deadline = time.monotonic() + 30
    alive = pids
    while alive and time.monotonic() < stop_deadline:
        alive = [p for p in pids if _alive(p)]
        time.sleep(0.2)
    assert not alive, f"processes left behind: {alive}"
