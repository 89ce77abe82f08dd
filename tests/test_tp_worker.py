"""``tandem worker --tp 2``: a served replica of two real rank processes (rank 0 the worker, rank 1 its child, gloo
on loopback) behind the real Worker gRPC API.

Greedy tokens equal transformers' fp32 ones except at a demonstrated near-tie (``tests/parallel_parity.py``; the
top-2 logprob gap is the top-2 logit gap), for prompts sent at once (one batch), a 100-token prompt prefilled in
chunks, and a second round that hits the prefix cache. A rank killed with SIGKILL takes the worker down (it exits
non-zero) and leaves no rank process; a split the model cannot take is refused before any rank starts.
"""

from __future__ import annotations

import random
import subprocess
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
from cli_runs import tandem
from parallel_parity import assert_greedy_matches, serve_greedy

from worker.launcher import WorkerProcess, start_worker

pytestmark = pytest.mark.slow

MAX_NEW = 8
FLAGS = ["--tp", "2", "--num-kv-blocks", "64", "--max-num-batched-tokens", "48", "--session-port", "-1"]


def _ranks(worker: WorkerProcess) -> list[psutil.Process]:
    """The worker's rank processes (spawned children; not multiprocessing's resource tracker)."""
    return [c for c in psutil.Process(worker.proc.pid).children() if "resource_tracker" not in " ".join(c.cmdline())]


@pytest.fixture()
def tp_worker(checkpoint: Callable[[str], Path]) -> Iterator[tuple[Path, WorkerProcess]]:
    path = checkpoint("llama")
    worker = start_worker("both", str(path), "tcp", FLAGS, timeout_s=300)
    try:
        yield path, worker
    finally:
        worker.stop(timeout=30)


def test_tp2_worker_serves_tokens_equal_to_transformers_batched_chunked_and_cached(
        tp_worker: tuple[Path, WorkerProcess], hf_greedy: Callable[[Path, list[int], int], list[int]]) -> None:
    path, worker = tp_worker
    assert len(_ranks(worker)) == 1
    rng = random.Random(27)
    prompts = [[rng.randrange(2040) for _ in range(n)] for n in (1, 5, 33, 100)]
    for round_ in range(2):
        with ThreadPoolExecutor(len(prompts)) as pool:
            results = list(pool.map(lambda p: serve_greedy(worker.address, p, MAX_NEW), prompts))
        for prompt, (ids, tops, cached) in zip(prompts, results, strict=True):
            assert tops.shape == (MAX_NEW, 2)
            assert_greedy_matches(ids, hf_greedy(path, prompt, MAX_NEW), tops, f"TP=2 worker, {len(prompt)} tokens")
            if round_ == 1 and len(prompt) >= 33:
                assert cached > 0, f"the second round of a {len(prompt)}-token prompt hit no cached block"
    assert worker.proc.poll() is None


def test_sigkill_of_a_rank_takes_the_worker_down_and_leaves_no_rank(tp_worker: tuple[Path, WorkerProcess]) -> None:
    _, worker = tp_worker
    assert serve_greedy(worker.address, [1, 2, 3], MAX_NEW)[0]
    ranks = _ranks(worker)
    assert len(ranks) == 1
    ranks[0].kill()
    try:
        code = worker.proc.wait(60)
    except subprocess.TimeoutExpired:
        pytest.fail("the worker kept running after its rank 1 was killed")
    assert code == 3  # worker/server.py: a rank exited
    _, alive = psutil.wait_procs(ranks, timeout=30)
    assert not alive


@pytest.mark.parametrize(("flags", "message"), [
    (["--role", "both", "--tp", "3"], "divide"),
    (["--role", "both", "--pp", "99"], "above the number of layers"),
    (["--role", "both", "--ep", "2"], "needs a MoE model"),
    (["--role", "prefill", "--pp", "2"], "a prefill worker with ranks: --pp above 1"),
    (["--role", "decode", "--tp", "2", "--kv-backend", "torch"], "--kv-backend torch cannot move it"),
])
def test_a_split_the_model_cannot_take_is_refused_before_any_rank_starts(
        checkpoint: Callable[[str], Path], flags: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    t0 = time.monotonic()
    argv = ["worker", "--model", str(checkpoint("llama")), *flags]
    # one case as the real command, for its exit code (~4 s of imports); the others through main in this process
    code, out, err = tandem(argv, capsys, as_process=flags == ["--role", "both", "--tp", "3"])
    assert code == 2, err
    assert message in err
    assert "READY" not in out and time.monotonic() - t0 < 120
