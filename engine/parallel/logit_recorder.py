"""Keeping every logits row an engine samples from, per request: how exactness tests compare ranks' outputs.

Installed in place of the engine's sampler (it forwards every call), it clones each row before sampling, so the
comparison sees the model's logits and not what penalties or masks did to them afterwards.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.llm_engine import LLMEngine
from engine.request import Request
from engine.sampler import Sampler, SampleResult


class LogitRecorder:
    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler
        self.enabled = False
        self.rows: dict[str, list[torch.Tensor]] = {}

    @classmethod
    def attach(cls, engine: LLMEngine) -> LogitRecorder:
        rec = cls(engine.runner.sampler)
        engine.runner.sampler = rec  # type: ignore[assignment]
        return rec

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sampler, name)

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> SampleResult:
        if self.enabled:
            for req, row in zip(requests, logits, strict=True):
                self.rows.setdefault(req.request_id, []).append(row.clone())
        return self.sampler(logits, requests)

    def take(self) -> list[torch.Tensor]:
        """Each request's rows stacked ``[steps, vocab]``, in the order the requests were added (``req-N``)."""
        rows, self.rows = self.rows, {}
        return [torch.stack(rows[k]) for k in sorted(rows, key=lambda rid: int(rid.rsplit("-", 1)[1]))]
