"""``tandem generate --speculative ngram|draft:DIR --num-speculative-tokens K``: greedy output equal to the run
without it, colocated and disaggregated (real prefill and decode worker processes over tcp on loopback, the decode
worker speculating), and bad values refused with exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["hello", "The server runs the model. The server runs"]  # "hello": a repeating answer


def _generate(model: Path, *extra: str) -> list[list[int]]:
    args = [sys.executable, "-m", "cli.main", "generate", "--model", str(model), "--max-tokens", "24",
            "--ignore-eos", "--json", "--threads", "1", "--num-kv-blocks", "64"]
    for p in PROMPTS:
        args += ["--prompt", p]
    proc = subprocess.run([*args, *extra], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return [line["token_ids"] for line in lines]


@pytest.mark.slow
def test_generate_with_speculation_equals_without_colocated_and_disaggregated(
        checkpoint: Callable[[str], Path]) -> None:
    model = checkpoint("llama")
    base = _generate(model)
    assert len(base) == len(PROMPTS) and all(len(t) == 24 for t in base)
    assert _generate(model, "--speculative", "ngram", "--num-speculative-tokens", "3") == base
    assert _generate(model, "--speculative", f"draft:{model}") == base
    assert _generate(model, "--mode", "disaggregated", "--kv-backend", "tcp", "--speculative", "ngram") == base


@pytest.mark.parametrize(("extra", "message"), [
    (["--speculative", "eagle"], "--speculative takes 'ngram' or 'draft:DIR'"),
    (["--speculative", "ngram", "--num-speculative-tokens", "0"], "num_speculative_tokens"),
    (["--speculative", "ngram", "--tp", "2"], "--speculative runs with --tp/--ep/--pp 1"),
])
def test_generate_refuses_bad_speculative_flags(checkpoint: Callable[[str], Path], extra: list[str],
                                                message: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "cli.main", "generate", "--model", str(checkpoint("llama")),
                           "--max-tokens", "4", "--prompt", "hi", *extra], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]
