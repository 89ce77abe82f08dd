"""Speculative decoding's settings: which proposer, and how many tokens it proposes per step.

``method`` is ``ngram`` (prompt lookup: the tokens that followed the latest earlier occurrence of the last n tokens)
or ``draft`` (a smaller model sharing the target's tokenizer, at ``draft_model``); ``num_speculative_tokens`` is the
most a request verifies per step, and with ``adaptive`` (the default) fewer or none where the engine's measured
step costs and the request's acceptance say more would not pay (``engine/spec/policy.py``). Parsed from the
command line's ``--speculative ngram|draft:DIR`` by :func:`parse_speculative`.
"""

from __future__ import annotations

from dataclasses import dataclass

METHODS = ("ngram", "draft")


@dataclass(slots=True, frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4
    draft_model: str | None = None
    ngram_min: int = 2
    ngram_max: int = 4
    ngram_lookback: int = 2048  # tokens searched back from the end; bounds the proposer's cost per step
    adaptive: bool = True  # choose 0..K proposals per request from measured step costs and acceptance (policy.py)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown speculative method {self.method!r}; choose one of {list(METHODS)}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}")
        if (self.method == "draft") != bool(self.draft_model):
            raise ValueError("a draft model directory is given exactly when method is 'draft'")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, {self.ngram_max}")
        if self.ngram_lookback < self.ngram_max + 1:
            raise ValueError(f"ngram_lookback must exceed ngram_max, got {self.ngram_lookback}")


def parse_speculative(value: str | None, num_tokens: int) -> SpeculativeConfig | None:
    """``ngram`` or ``draft:DIR`` (None or empty: no speculation) into a config; ValueError naming a bad value."""
    if not value:
        return None
    if value == "ngram":
        return SpeculativeConfig("ngram", num_tokens)
    if value.startswith("draft:") and value[len("draft:"):]:
        return SpeculativeConfig("draft", num_tokens, draft_model=value[len("draft:"):])
    raise ValueError(f"--speculative takes 'ngram' or 'draft:DIR', got {value!r}")
