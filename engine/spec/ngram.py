"""The n-gram (prompt lookup) proposer: no model, just the request's own tokens.

Find the longest earlier match (up to ``ngram_max`` tokens, at least ``ngram_min``) of the sequence's tail within
the lookback window, the latest of equal length, and propose the (up to) K tokens that followed it. Text that
quotes or edits its prompt (code edits, summaries with quotes) repeats long spans, which is where this wins.

It runs every step for every decoding request, so it costs what ``list.index`` costs: each earlier occurrence of
the last token is found in C, and only those are extended backwards in Python (on text that does not repeat,
usually none).
"""

from __future__ import annotations

from engine.spec.config import SpeculativeConfig


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n = config.ngram_min
        self.max_n = config.ngram_max
        self.lookback = config.ngram_lookback

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens guessed to follow ``token_ids`` (empty when no n-gram recurs)."""
        total = len(token_ids)
        if k <= 0 or total < self.min_n + 1:
            return []
        lo = max(0, total - self.lookback)
        last = token_ids[-1]
        best_n, best_end = 0, -1
        pos = lo
        while True:
            try:
                j = token_ids.index(last, pos, total - 1)  # an earlier occurrence, the tail's own excluded
            except ValueError:
                break
            n = 1
            while n < self.max_n and j - n >= lo and token_ids[j - n] == token_ids[total - 1 - n]:
                n += 1
            if n >= best_n:  # the latest of the longest
                best_n, best_end = n, j
            pos = j + 1
        if best_n < self.min_n:
            return []
        return token_ids[best_end + 1 : best_end + 1 + k]
