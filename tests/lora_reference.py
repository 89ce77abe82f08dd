"""The LoRA tests' reference: transformers (+ peft for an adapter) greedy continuations, float32, one prompt at a
time, models cached per (base, adapter) for the session."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

_MODELS: dict[tuple[Path, Path | None], Any] = {}


def peft_greedy(base: Path, adapter: Path | None, prompt: list[int], max_new: int) -> list[int]:
    """``max_new`` greedy tokens after ``prompt`` from transformers loading ``base``, with peft's ``adapter``."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = _MODELS.get((base, adapter))
    if model is None:
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
        if adapter is not None:
            model = PeftModel.from_pretrained(model, str(adapter)).eval()
        _MODELS[(base, adapter)] = model
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                             min_new_tokens=max_new, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()
