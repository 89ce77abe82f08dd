"""Incremental detokenization and stop-string matching.

Byte-level BPE tokens need not end on a UTF-8 character boundary, so text is released only when it decodes cleanly:
we decode a small window ``tokens[prefix_offset:]`` and compare against ``tokens[prefix_offset:read_offset]``; if the
new text ends in U+FFFD (an incomplete character) we wait for the next token. The window keeps a few tokens of left
context because some decoders (e.g. metaspace / byte fallback) render a token differently at the start of a string.

Stop strings are matched on the accumulated output text, so a stop string split across tokens is still found. Text
that could be the start of a stop string is held back until it is known not to be one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.tokenizer import Tokenizer

_CONTEXT = 6


@dataclass(slots=True)
class IncrementalDetokenizer:
    tokenizer: Tokenizer
    stop: tuple[str, ...] = ()
    include_stop_str: bool = False
    skip_special_tokens: bool = True
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    emitted: int = 0
    prefix_offset: int = 0
    read_offset: int = 0
    stopped_on: str | None = None

    def _ids(self, ids: list[int]) -> list[int]:
        if not self.skip_special_tokens:
            return ids
        special = self.tokenizer.special_ids
        return [t for t in ids if t not in special]

    def add(self, token_id: int, match_stops: bool = True) -> str:
        """Append one token; return the newly released text (possibly empty).

        ``match_stops=False`` (before ``min_tokens`` are out) releases text without looking for stop strings.
        """
        if self.stopped_on is not None:
            return ""
        self.tokens.append(token_id)
        self._advance()
        return self._release(match_stops)

    def _advance(self) -> None:
        """Decode the window; take its new text unless it ends inside a character (wait for the next token)."""
        window = self.tokens[self.prefix_offset : self.read_offset]
        prefix = self.tokenizer.decode(self._ids(window), skip_special_tokens=False) if window else ""
        full = self.tokenizer.decode(self._ids(self.tokens[self.prefix_offset :]), skip_special_tokens=False)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix) :]
            self.read_offset = len(self.tokens)
            self.prefix_offset = max(self.read_offset - _CONTEXT, 0)

    def add_many(self, token_ids: list[int]) -> str:
        """Append several tokens with one decode instead of one per token; only without stop strings (which must be
        matched token by token, to know which token completed one).

        The text released by the end is the same as :meth:`add` token by token: only when it is released differs
        (a character completed mid-list but followed by an incomplete one waits for the next call).
        """
        if self.stop:
            raise ValueError("add_many is for detokenizers without stop strings; use add")
        if self.stopped_on is not None or not token_ids:
            return ""
        self.tokens.extend(token_ids)
        self._advance()
        return self._release(False)

    def _release(self, match_stops: bool) -> str:
        if self.stop and match_stops:
            # Search only where a new match can start: stop strings overlapping the unreleased tail.
            longest = max(len(s) for s in self.stop)
            start = max(self.emitted - longest + 1, 0)
            best: tuple[int, str] | None = None
            for s in self.stop:
                pos = self.text.find(s, start)
                if pos >= 0 and (best is None or pos < best[0]):
                    best = (pos, s)
            if best is not None:
                pos, s = best
                self.stopped_on = s
                self.text = self.text[: pos + len(s)] if self.include_stop_str else self.text[:pos]
                out = self.text[self.emitted :]
                self.emitted = len(self.text)
                return out
            end = len(self.text) - _partial_stop_len(self.text, self.stop)
        else:
            end = len(self.text)
        if end <= self.emitted:
            return ""
        out = self.text[self.emitted : end]
        self.emitted = end
        return out

    def flush(self) -> str:
        """At the end of generation, release whatever was held back."""
        if self.stopped_on is not None:
            return ""
        if self.read_offset < len(self.tokens):  # trailing bytes of an incomplete character: emit them as-is
            prefix = self.tokenizer.decode(self._ids(self.tokens[self.prefix_offset : self.read_offset]),
                                           skip_special_tokens=False)
            full = self.tokenizer.decode(self._ids(self.tokens[self.prefix_offset :]), skip_special_tokens=False)
            self.text += full[len(prefix) :]
            self.read_offset = len(self.tokens)
        out = self.text[self.emitted :]
        self.emitted = len(self.text)
        return out


def _partial_stop_len(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best
