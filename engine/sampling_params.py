"""Per-request sampling parameters (OpenAI / vLLM semantics)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.structured.spec import StructuredOutput


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    ``temperature == 0`` is greedy. ``top_k <= 0`` and ``top_p == 1`` disable those filters. Repetition penalty
    follows the CTRL/HF rule over prompt and output tokens; presence and frequency penalties follow OpenAI over
    output tokens. ``seed`` makes a request's samples independent of what else is in the batch. ``logprobs=N``
    returns the sampled token's logprob and the top-N alternatives at each step.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: tuple[tuple[int, float], ...] = ()
    prompt_logprobs: int | None = None
    structured: StructuredOutput | None = None  # a constraint on the output (JSON schema, regex, choice, grammar)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not -2 <= self.presence_penalty <= 2:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2 <= self.frequency_penalty <= 2:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise ValueError(f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}")
        for entry in self.logit_bias:
            if len(entry) != 2 or entry[0] < 0 or not -100 <= entry[1] <= 100:
                raise ValueError(f"logit_bias entries must be (token_id >= 0, bias in [-100, 100]), got {entry!r}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if isinstance(self.stop, str) or isinstance(self.stop_token_ids, int):
            raise ValueError("stop and stop_token_ids must be tuples")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def needs_processing(self) -> bool:
        """Whether the logits change before the pick (penalties or a logit bias)."""
        return bool(self.logit_bias) or self.needs_penalties

    @property
    def needs_filters(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0
