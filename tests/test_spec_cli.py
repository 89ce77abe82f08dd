"""``tandem generate --speculative ngram|draft:DIR --num-speculative-tokens K``: greedy output equal to the run
without it, colocated and disaggregated (real prefill and decode worker processes over tcp on loopback, the decode
worker speculating), and bad values refused with exit code 2."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from cli_runs import run_at_once, tandem

PROMPTS = ["hello", "The server runs the model. The server runs"]  # "hello": a repeating answer


def _argv(model: Path, *extra: str) -> list[str]:
    args = ["generate", "--model", str(model), "--max-tokens", "24", "--ignore-eos", "--json", "--threads", "1",
            "--num-kv-blocks", "64"]
    for p in PROMPTS:
        args += ["--prompt", p]
    return [*args, *extra]


@pytest.mark.slow
def test_generate_with_speculation_equals_without_colocated_and_disaggregated(
        checkpoint: Callable[[str], Path]) -> None:
    model = checkpoint("llama")
    # the four runs side by side (one engine thread each; greedy tokens do not depend on the machine's load)
    runs = run_at_once([_argv(model), _argv(model, "--speculative", "ngram", "--num-speculative-tokens", "3"),
                        _argv(model, "--speculative", f"draft:{model}"),
                        _argv(model, "--mode", "disaggregated", "--kv-backend", "tcp", "--speculative", "ngram")])
    for r in runs:
        assert r.returncode == 0, r.stderr[-2000:]
    base, ngram, draft, disaggregated = ([json.loads(line)["token_ids"] for line in r.stdout.splitlines()
                                          if line.startswith("{")] for r in runs)
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
    # one case as the real command, for its exit code (~4 s of imports); the others through main in this process
    code, _, stderr = tandem(argv, capsys, as_process=extra == ["--speculative", "eagle"], timeout_s=300)
    assert code == 2 and message in stderr, stderr[-2000:]
