"""``tandem bench lora`` run small on the tiny checkpoint: its report has every side and figure, its own exactness
checks hold (the hooked engine's base rows equal the plain engine's, the mixed batch equals per-adapter batches),
and its sample outputs, one per adapter, equal transformers + peft loading the adapters it wrote. The figures'
values are not checked (the bench itself is run by hand; docs/benchmarks.md)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from lora_reference import peft_greedy

from bench.lora import format_lora_report, run_lora_bench
from bench.throughput import make_prompts
from cli.main import build_parser
from cli.main import main as tandem


def test_bench_lora_reports_every_side_and_its_outputs_are_exact(checkpoint: Callable[[str], Path],
                                                                 tmp_path: Path) -> None:
    model = checkpoint("llama")
    args = build_parser().parse_args(["bench", "lora", "--model", str(model), "--num-prompts", "6", "--input-len",
                                      "12", "--output-len", "6", "--repeats", "1", "--threads", "1", "--rank", "8",
                                      "--adapters-dir", str(tmp_path)])
    report = run_lora_bench(args)
    assert set(report["results"]) == {"base", "base_hooked", "mixed"}
    for r in report["results"].values():
        assert r["tokens_per_s"] > 0 and len(r["runs"]) == 1
        assert r["vs_base"] == r["tokens_per_s"] / report["results"]["base"]["tokens_per_s"]
    assert report["exact"] == {"base_hooked_equals_base": True, "mixed_equals_per_adapter_batches": True}
    assert report["adapter_loads_while_timed"] == 0  # all four resident
    samples = report["sample_outputs"]
    assert [s["adapter"] for s in samples] == ["lora0", "lora1", "lora2", "lora3"]
    vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
    prompts = make_prompts(6, 12, vocab, seed=1)
    for s in samples:
        prompt = prompts[s["prompt_index"]]
        assert s["token_ids"] == peft_greedy(model, tmp_path / s["adapter"], prompt, 6), s
    assert samples[0]["token_ids"] != peft_greedy(model, None, prompts[0], 6)  # the adapters change the output
    text = format_lora_report(report)
    assert "mixed" in text and "exact: base_hooked = base yes; mixed = per-adapter batches yes" in text


def test_bench_lora_refuses_a_bad_size_naming_it(checkpoint: Callable[[str], Path]) -> None:
    assert tandem(["bench", "lora", "--model", str(checkpoint("llama")), "--num-adapters", "0"]) == 2
