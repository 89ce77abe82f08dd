"""Running ``tandem`` commands from tests: several real processes side by side, or a refusal through the CLI's own
entry point in this process.

A ``python -m cli.main`` process pays seconds of imports (torch, transformers) on a 2-core CI host. Commands whose
results do not depend on the machine's load (greedy tokens, a refusal) run side by side (:func:`run_at_once`); of a
family of refusals, one runs as the real command for its exit code end to end and the others through
``cli.main.main`` here (:func:`tandem`), where no child process (a rank, a worker) may have started.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import psutil
import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


def command(*argv: str) -> list[str]:
    """``tandem ARGV`` as this interpreter runs it."""
    return [sys.executable, "-m", "cli.main", *argv]


def run_at_once(argvs: Sequence[Sequence[str]], envs: Sequence[Mapping[str, str] | None] | None = None,
                timeout_s: float = 300.0) -> list[subprocess.CompletedProcess[str]]:
    """Run ``tandem ARGV`` for each of ``argvs`` side by side (``envs[i]``: the i-th one's environment, None:
    inherited) and return how each ended, in order; every process still running when one fails is killed."""
    envs = envs if envs is not None else [None] * len(argvs)
    started = [(cmd := command(*argv), subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                                                         stderr=subprocess.PIPE, text=True))
               for argv, env in zip(argvs, envs, strict=True)]
    done: list[subprocess.CompletedProcess[str]] = []
    try:
        for cmd, proc in started:
            out, err = proc.communicate(timeout=timeout_s)
            done.append(subprocess.CompletedProcess(cmd, proc.returncode, out, err))
    finally:
        for _, proc in started:
            if proc.poll() is None:
                proc.kill()
                proc.communicate(timeout=10)
    return done


def tandem(argv: Sequence[str], capsys: pytest.CaptureFixture[str], as_process: bool,
           timeout_s: float = 120.0) -> tuple[int, str, str]:
    """``tandem ARGV``'s exit code, stdout and stderr: as a real process (``as_process``), or through
    ``cli.main.main`` in this process, asserting that it started no child process."""
    if as_process:
        (done,) = run_at_once([argv], timeout_s=timeout_s)
        return done.returncode, done.stdout, done.stderr
    from cli.main import main

    before = {c.pid for c in psutil.Process().children(recursive=True)}
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert {c.pid for c in psutil.Process().children(recursive=True)} <= before, "a rank or worker process started"
    return code, out, err
