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


def _start(model: Path, *extra: str) -> subprocess.Popen[str]:
    args = [sys.executable, "-m", "cli.main", "generate", "--model", str(model), "--max-tokens", "24",
            "--ignore-eos", "--json", "--threads", "1", "--num-kv-blocks", "64"]
    for p in PROMPTS:
        args += ["--prompt", p]
    return subprocess.Popen([*args, *extra], cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _tokens(proc: subprocess.Popen[str]) -> list[list[int]]:
    try:
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)
    assert proc.returncode == 0, err[-2000:]
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return [line["token_ids"] for line in lines]


@pytest.mark.slow
def test_generate_with_speculation_equals_without_colocated_and_disaggregated(
        checkpoint: Callable[[str], Path]) -> None:
    model = checkpoint("llama")
    # the four runs side by side (one engine thread each; greedy tokens do not depend on the machine's load)
    runs = [_start(model), _start(model, "--speculative", "ngram", "--num-speculative-tokens", "3"),
            _start(model, "--speculative", f"draft:{model}"),
            _start(model, "--mode", "disaggregated", "--kv-backend", "tcp", "--speculative", "ngram")]
    try:
        base, ngram, draft, disaggregated = (_tokens(r) for r in runs)
    finally:
        for r in runs:
            if r.poll() is None:
                r.kill()
                r.communicate(timeout=10)
    assert len(base) == len(PROMPTS) and all(len(t) == 24 for t in base)
    assert ngram == base
    assert draft == base
    assert disaggregated == base


@pytest.mark.parametrize(("extra", "message"), [
    (["--speculative", "eagle"], "--speculative takes 'ngram' or 'draft:DIR'"),
    (["--speculative", "ngram", "--num-speculative-tokens", "0"], "num_speculative_tokens"),
    (["--speculative", "ngram", "--tp", "2"], "--speculative runs with --tp/--ep/--pp 1"),
])
def test_generate_refuses_bad_speculative_flags(checkpoint: Callable[[str], Path], extra: list[str],
                                                message: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["generate", "--model", str(checkpoint("llama")), "--max-tokens", "4", "--prompt", "hi", *extra]
    if extra == ["--speculative", "eagle"]:  # one case as the real command, for its exit code (~4 s of imports)
        proc = subprocess.run([sys.executable, "-m", "cli.main", *argv], cwd=REPO_ROOT, capture_output=True,
                              text=True, timeout=300)
        code, stderr = proc.returncode, proc.stderr
    else:  # the others through the same entry point in this process (main returns the exit code)
        from cli.main import main

        code, stderr = main(argv), capsys.readouterr().err
    assert code == 2 and message in stderr, stderr[-2000:]
