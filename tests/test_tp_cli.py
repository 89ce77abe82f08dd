"""``tandem generate --tp/--ep/--pp``: a bad split exits 2 naming the constraint before any rank starts; TP=2 prints the
same greedy tokens as TP=1 (two real rank processes)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest


def _generate(path: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cli.main", "generate", "--model", str(path), "--prompt", "Hello",
                           "--prompt", "Tandem serves tokens", "--max-tokens", "8", "--ignore-eos", "--json",
                           "--num-kv-blocks", "64", *flags], capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize(("flags", "constraint"), [
    (["--tp", "3"], "tensor parallel size 3 must divide the attention heads (8)"),
    (["--ep", "2"], "expert parallel size 2 needs a MoE model"),
    (["--pp", "5"], "pipeline parallel size 5 is above the number of layers (4)"),
    (["--tp", "2", "--mode", "disaggregated"], "--tp/--ep/--pp run colocated only"),
])
def test_generate_refuses_a_bad_split_with_exit_code_2(checkpoint: Callable[[str], Path], flags: list[str],
                                                       constraint: str) -> None:
    res = _generate(checkpoint("llama"), *flags)
    assert res.returncode == 2, res.stderr
    assert constraint in res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.slow
def test_generate_tp2_prints_tp1s_greedy_tokens(checkpoint: Callable[[str], Path]) -> None:
    path = checkpoint("llama")
    one, two = _generate(path), _generate(path, "--tp", "2")
    assert one.returncode == 0 and two.returncode == 0, two.stderr
    rows = [[json.loads(line)["token_ids"] for line in r.stdout.splitlines()] for r in (one, two)]
    assert len(rows[0]) == 2 and all(len(t) == 8 for t in rows[0])
    assert rows[1] == rows[0]
