"""One simulated request: the fields the engine's scheduler and KV cache manager read, without token lists.

``engine.request.Request`` keeps every token id of its prompt and output and hashes its blocks in ``__post_init__``;
at 12k-token prompts and thousands in flight that is gigabytes of Python ints the simulator never reads. This record
carries what ``engine/scheduler.py`` and ``engine/kv_cache_manager.py`` use (``request_id``, ``num_tokens``,
``num_computed_tokens``, ``num_cached_tokens``, ``num_preemptions``, ``status``, ``params``, ``block_hashes``,
``is_finished``) with the prompt's real block hashes computed once by ``tokens.py``. Appending a token is
``num_tokens += 1``; output blocks get no hash, so they are never published to a prefix cache (the engine would
publish them, but no later request in a Mooncake trace could name them: its hash ids cover prompts only).
"""

from __future__ import annotations

from typing import Any

from engine.request import RequestStatus
from engine.sampling_params import SamplingParams

_PARAMS = SamplingParams(max_tokens=1 << 30)


class SimRequest:
    __slots__ = ("arrival_s", "block_hashes", "decision", "decode_decision", "first_token_s", "generated", "index",
                 "itl_sum", "last_token_s", "num_cached_tokens", "num_computed_tokens", "num_preemptions",
                 "num_tokens", "output_len", "params", "prompt_len", "request_id", "status")

    def __init__(self, request_id: str, index: int, arrival_s: float, prompt_len: int, output_len: int,
                 block_hashes: list[int], num_tokens: int | None = None) -> None:
        self.request_id = request_id
        self.index = index  # the trace request this serves (a disaggregated request has two records)
        self.arrival_s = arrival_s
        self.prompt_len = prompt_len
        self.output_len = output_len
        self.block_hashes = block_hashes
        self.num_tokens = prompt_len if num_tokens is None else num_tokens
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.params = _PARAMS
        self.generated = 0
        self.first_token_s = -1.0
        self.last_token_s = -1.0
        self.itl_sum = 0.0
        self.decision: Any = None  # the router's booking on the worker that runs this record
        self.decode_decision: SimRequest | None = None  # a prefill record's partner record on its decode worker

    @property
    def is_finished(self) -> bool:
        return self.status >= RequestStatus.FINISHED_STOPPED
