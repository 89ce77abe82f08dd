"""Request state as the engine sees it.

A request's life is one number moving: ``num_computed_tokens`` chases ``num_tokens`` (prompt plus output so far).
The scheduler has no prefill or decode phase; a prefill is simply a request far behind, a decode one token behind.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.block_hash import ROOT_HASH, hash_blocks
from engine.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Ordered so that ``status >= FINISHED_STOPPED`` means finished."""

    WAITING = 0
    WAITING_FOR_REMOTE_KV = 1
    RUNNING = 2
    PREEMPTED = 3
    FINISHED_STOPPED = 4
    FINISHED_LENGTH = 5
    FINISHED_ABORTED = 6
    FINISHED_ERROR = 7

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(slots=True)
class TokenLogprobs:
    """The sampled token's logprob and the top-N alternatives at one position."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    extra_keys: tuple[str, ...] = ()
    block_size: int = 16
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    block_hashes: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # prompt tokens 1.., when asked for
    generator: torch.Generator | None = None
    first_token_time: float | None = None
    matcher: Any = None  # the llguidance matcher of a constrained request (params.structured), advanced per token
    lora: str | None = None  # the LoRA adapter this request runs under (engine/lora); None: the base model

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id!r} has an empty prompt")
        self.all_token_ids = list(self.prompt_token_ids)
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)
        self._extend_hashes()

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status >= RequestStatus.FINISHED_STOPPED

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if len(self.all_token_ids) % self.block_size == 0:
            self._extend_hashes()

    def _extend_hashes(self) -> None:
        bs = self.block_size
        done = len(self.block_hashes)
        parent = self.block_hashes[-1] if done else ROOT_HASH
        # The chain's tail in one call (native when built): a 2k-token prompt is 128 blocks, one hashlib call each.
        self.block_hashes.extend(hash_blocks(self.all_token_ids, bs, self.extra_keys, parent, done * bs))
