"""``tandem generate --tp/--ep/--pp``: a bad split exits 2 naming the constraint before any rank starts; TP=2 prints the
same greedy tokens as TP=1 (two real rank processes); ``--mode disaggregated --tp 2`` (a prefill and a decode worker
of two rank processes each, KV moved rank to rank over tcp) prints transformers' fp32 greedy tokens, but for a
near-tie shown in transformers' own logits at the first differing step (``tests/parallel_parity.py``)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from cli_runs import run_at_once, tandem
from parallel_parity import assert_greedy_matches


def _argv(path: Path, *flags: str) -> list[str]:
    return ["generate", "--model", str(path), "--prompt", "Hello", "--prompt", "Tandem serves tokens", "--max-tokens",
            "8", "--ignore-eos", "--json", "--num-kv-blocks", "64", *flags]


@pytest.mark.parametrize(("flags", "constraint"), [
    (["--tp", "3"], "tensor parallel size 3 must divide the attention heads (8)"),
    (["--ep", "2"], "expert parallel size 2 needs a MoE model"),
    (["--pp", "5"], "pipeline parallel size 5 is above the number of layers (4)"),
    (["--tp", "3", "--mode", "disaggregated"], "tensor parallel size 3 must divide the attention heads (8)"),
    (["--pp", "2", "--mode", "disaggregated"], "--mode disaggregated with ranks: --pp above 1"),
    (["--tp", "2", "--mode", "disaggregated", "--kv-backend", "torch"], "--kv-backend torch cannot move it"),
])
def test_generate_refuses_a_bad_split_with_exit_code_2(checkpoint: Callable[[str], Path], flags: list[str],
                                                       constraint: str, capsys: pytest.CaptureFixture[str]) -> None:
    # one case as the real command, for its exit code (a process pays ~4 s of imports); the others through main here
    code, _, stderr = tandem(_argv(checkpoint("llama"), *flags), capsys, as_process=flags == ["--tp", "3"],
                             timeout_s=600)
    assert code == 2, stderr
    assert constraint in stderr
    assert "Traceback" not in stderr


@pytest.mark.slow
def test_generate_tp2_prints_tp1s_greedy_tokens(checkpoint: Callable[[str], Path]) -> None:
    path = checkpoint("llama")
    # side by side: greedy tokens do not depend on the machine's load
    one, two = run_at_once([_argv(path), _argv(path, "--tp", "2")], timeout_s=600)
    assert one.returncode == 0 and two.returncode == 0, two.stderr
    rows = [[json.loads(line)["token_ids"] for line in r.stdout.splitlines()] for r in (one, two)]
    assert len(rows[0]) == 2 and all(len(t) == 8 for t in rows[0])
    assert rows[1] == rows[0]


def _hf_greedy_with_logits(path: Path, prompt: list[int], max_new: int) -> tuple[list[int], torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, min_new_tokens=max_new,
                             do_sample=False, eos_token_id=None, pad_token_id=0, output_logits=True,
                             return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), torch.cat(out.logits)


@pytest.mark.slow
def test_generate_disaggregated_tp2_prints_transformers_greedy_tokens(checkpoint: Callable[[str], Path]) -> None:
    path = checkpoint("llama")
    (res,) = run_at_once([_argv(path, "--mode", "disaggregated", "--tp", "2", "--kv-backend", "tcp")], timeout_s=600)
    assert res.returncode == 0, res.stderr
    rows = [json.loads(line) for line in res.stdout.splitlines()]
    assert len(rows) == 2
    for row in rows:
        ref, logits = _hf_greedy_with_logits(path, row["prompt_token_ids"], 8)
        # up to the first differing token both continued the same context, so transformers' logits there show
        # whether that step was a near-tie
        assert_greedy_matches(row["token_ids"], ref, logits, f"disaggregated TP=2, prompt {row['prompt_token_ids']}")
