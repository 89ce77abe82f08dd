"""Greedy parity with transformers on the ~113M-parameter ``small`` checkpoint.

The tiny checkpoints keep every weight under the size at which :func:`engine.models.layers.linear` routes few-row
matmuls (single-sequence and small-batch decode) to oneDNN instead of MKL. This module covers that path: the small
model's projections are all above it, so batches of 1 and 3 decode through the few-row path (MKL's GEMV on Intel
CPUs, oneDNN's packed matrix-vector product on others) while a batch of 12 crosses into the batched path mid-run as
prompts finish prefill together.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.llm import LLM
from engine.models import layers
from engine.sampling_params import SamplingParams
from tinymodel.checkpoint import write_tiny_checkpoint

MAX_NEW = 10

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt-small"), arch="llama", size="small")


@pytest.fixture(scope="module")
def small_hf(small: Path) -> Any:
    """transformers' model of the small checkpoint, loaded once for the module's three batches (~450 MB in fp32)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(small, dtype=torch.float32).eval()


def _reference(model: Any, prompts: list[list[int]]) -> list[list[int]]:
    out: list[list[int]] = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW,
                                 min_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
            out.append(gen[0, len(p):].tolist())
    return out


def test_small_model_weights_take_the_large_weight_matmul_path(small: Path) -> None:
    llm = LLM(str(small), dtype="float32")
    decoder = llm.engine.model
    smallest = min(p.numel() for n, p in decoder.named_parameters() if n.endswith("_proj"))
    assert smallest >= layers._ONEDNN_MIN_WEIGHT


@pytest.mark.parametrize("batch", [1, 3, 12])
def test_small_model_greedy_matches_transformers(small: Path, small_hf: Any, batch: int) -> None:
    rng = random.Random(batch)
    prompts = [[rng.randrange(8000) for _ in range(rng.randint(5, 90))] for _ in range(batch)]
    llm = LLM(str(small), dtype="float32")
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in outs] == _reference(small_hf, prompts)
    llm.engine.check_block_accounting()
