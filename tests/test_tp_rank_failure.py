"""A rank killed with SIGKILL takes its TP=2 replica down: the next command fails with ``RankFailedError`` naming
the rank (no hang on the surviving rank's collective), and no rank process is left behind."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from engine.parallel.config import ParallelConfig
from engine.parallel.llm import ParallelLLM, RankFailedError
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone for our purposes once reaped; report it as alive
        return f.read().split()[2] != "X"


def test_sigkill_of_one_rank_stops_the_replica_and_leaves_no_rank(checkpoint: Callable[[str], Path]) -> None:
    llm = ParallelLLM(str(checkpoint("llama")), ParallelConfig(tp=2), num_kv_blocks=32, num_threads=1,
                      command_timeout_s=120)
    pids = llm.pids
    try:
        assert len(llm.generate([[1, 2, 3]], GREEDY)[0].token_ids) == 4
        os.kill(pids[1], signal.SIGKILL)
        with pytest.raises(RankFailedError, match="rank 1"):
            for _ in range(20):  # bounded: the first command after the kill must fail
                llm.generate([[1, 2, 3]], GREEDY)
                time.sleep(0.1)
    finally:
        llm.close(timeout_s=10)
    deadline = time.monotonic() + 30
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in pids if _alive(p)]
