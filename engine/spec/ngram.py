"""The n-gram (prompt lookup) proposer: no model, just the request's own tokens.

For n from ``ngram_max`` down to ``ngram_min``, find the latest earlier occurrence of the sequence's last n tokens
within the lookback window and propose the (up to) K tokens that followed it. Text that quotes or edits its
prompt (code edits, summaries with quotes) repeats long spans, which is where this wins.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from engine.spec.config import SpeculativeConfig


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n = config.ngram_min
        self.max_n = config.ngram_max
        self.lookback = config.ngram_lookback

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens guessed to follow ``token_ids`` (empty when no n-gram recurs)."""
        if k <= 0 or len(token_ids) < self.min_n + 1:
            return []
        seq = np.asarray(token_ids[-self.lookback:], dtype=np.int64)
        total = len(seq)
        for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):
            tail = seq[total - n:]
            # windows starting at 0 .. total-n-1: every earlier occurrence, the tail itself excluded
            windows = sliding_window_view(seq[:total - 1], n)
            hits = np.flatnonzero((windows == tail).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return seq[start:start + k].tolist()
        return []
