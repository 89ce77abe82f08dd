"""Tests for :mod:`engine.detokenizer` and :mod:`engine.tokenizer` with the tiny checkpoint's byte-level BPE."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from engine.detokenizer import IncrementalDetokenizer
from engine.tokenizer import Tokenizer

TEXT = "héllo 世界 🙂 and more text"
EOS_ID = 2045


@pytest.fixture(scope="module")
def tok(checkpoint: Callable[[str], Path]) -> Tokenizer:
    """The tiny llama checkpoint's tokenizer."""
    return Tokenizer(checkpoint("llama"))


@pytest.fixture(scope="module")
def ids(tok: Tokenizer) -> list[int]:
    """TEXT encoded without special tokens."""
    return tok.encode(TEXT, add_special_tokens=False)


def _stream(tok: Tokenizer, ids: list[int], **kwargs: Any) -> tuple[IncrementalDetokenizer, list[str]]:
    """Feed ``ids`` one at a time until a stop string is hit (as the engine does); return the released chunks."""
    detok = IncrementalDetokenizer(tok, **kwargs)
    chunks = []
    for t in ids:
        chunks.append(detok.add(t))
        if detok.stopped_on is not None:
            break
    return detok, chunks


def _token_index(tok: Tokenizer, ids: list[int], piece: str) -> int:
    """Index of the token that decodes (alone) to ``piece``."""
    return [tok.decode([t]) for t in ids].index(piece)


def test_text_has_a_character_that_spans_tokens(tok: Tokenizer, ids: list[int]) -> None:
    """Precondition: some character of TEXT is split across byte-level tokens (a lone token decodes to U+FFFD)."""
    assert tok.decode(ids) == TEXT
    assert any("\ufffd" in tok.decode([t]) for t in ids)


def test_streamed_text_equals_full_decode_without_replacement_chars(tok: Tokenizer, ids: list[int]) -> None:
    """Chunks from add() join to decode(all) and no chunk ever contains U+FFFD."""
    detok, chunks = _stream(tok, ids)
    assert "".join(chunks) == tok.decode(ids) == detok.text
    assert all("\ufffd" not in c for c in chunks)
    assert detok.flush() == ""


def test_incomplete_character_is_held_until_its_last_byte(tok: Tokenizer, ids: list[int]) -> None:
    """The token carrying only the first bytes of 🙂 releases nothing; the next one releases the character."""
    first = next(i for i, t in enumerate(ids) if "\ufffd" in tok.decode([t]))
    _, chunks = _stream(tok, ids)
    assert "🙂" not in "".join(chunks[: first + 1])
    assert "🙂" in chunks[first + 1]


def test_streamed_text_of_a_generated_style_sequence_matches_decode(tok: Tokenizer) -> None:
    """A longer mixed-script sequence streams to exactly its full decode."""
    text = "naïve café — 日本語のテキスト 🙂🙃 ✓ ok\nsecond line ∑ x²"
    seq = tok.encode(text, add_special_tokens=False)
    _, chunks = _stream(tok, seq)
    assert "".join(chunks) == text
    assert all("\ufffd" not in c for c in chunks)


def test_special_tokens_are_skipped_by_default_and_rendered_on_request(tok: Tokenizer, ids: list[int]) -> None:
    """An eos token adds no text when skip_special_tokens is on, and its literal text when off."""
    _, chunks = _stream(tok, [*ids, EOS_ID])
    assert "".join(chunks) == TEXT
    _, chunks = _stream(tok, [*ids, EOS_ID], skip_special_tokens=False)
    assert "".join(chunks) == TEXT + "<|end_of_text|>"


def test_stop_string_split_across_two_tokens_is_found(tok: Tokenizer, ids: list[int]) -> None:
    """A stop string spanning a token boundary stops the text just before it."""
    stop = "more te"
    assert not any(stop in tok.decode([t]) for t in ids)
    detok, chunks = _stream(tok, ids, stop=(stop,))
    assert detok.stopped_on == stop
    assert len(chunks) == _token_index(tok, ids, " tex") + 1  # found on the token that completes it
    assert detok.text == TEXT[: TEXT.index(stop)]
    assert "".join(chunks) == detok.text
    assert detok.flush() == ""


def test_stop_string_is_kept_with_include_stop_str(tok: Tokenizer, ids: list[int]) -> None:
    """With include_stop_str the released text ends with the stop string itself."""
    stop = "more te"
    detok, chunks = _stream(tok, ids, stop=(stop,), include_stop_str=True)
    assert detok.text == TEXT[: TEXT.index(stop) + len(stop)]
    assert "".join(chunks) == detok.text


def test_stop_string_that_is_a_multibyte_character_is_found(tok: Tokenizer, ids: list[int]) -> None:
    """A stop string made of one character split over two tokens is matched."""
    detok, chunks = _stream(tok, ids, stop=("🙂",))
    assert detok.stopped_on == "🙂"
    assert "".join(chunks) == "héllo 世界 "


def test_earliest_stop_string_wins(tok: Tokenizer, ids: list[int]) -> None:
    """With several stop strings present, the one that starts first in the text is the one reported."""
    detok, _ = _stream(tok, ids, stop=("text", "and", "世"))
    assert detok.stopped_on == "世"
    assert detok.text == "héllo "


def test_partial_stop_match_is_held_back_then_released(tok: Tokenizer, ids: list[int]) -> None:
    """Text that could begin a stop string is withheld, and released once the next token rules the stop out."""
    detok, chunks = _stream(tok, ids, stop=("and more tea",))
    held = [tok.decode(ids[: i + 1])[len("".join(chunks[: i + 1])) :] for i in range(len(ids))]
    assert held[_token_index(tok, ids, " and")] == "and"
    assert held[_token_index(tok, ids, " more")] == "and more"
    assert chunks[_token_index(tok, ids, " more")] == ""
    assert held[_token_index(tok, ids, " tex")] == ""
    assert "and more tex" in chunks[_token_index(tok, ids, " tex")]
    assert detok.stopped_on is None
    assert "".join(chunks) == TEXT


def test_flush_releases_text_held_for_a_stop_that_never_came(tok: Tokenizer, ids: list[int]) -> None:
    """At end of generation, flush() returns the tail that was held as a possible stop-string prefix."""
    detok, chunks = _stream(tok, ids, stop=("texts",))
    assert "".join(chunks) == TEXT[: -len("text")]
    assert detok.flush() == "text"
    assert detok.flush() == ""


def test_encode_chat_matches_transformers_apply_chat_template(checkpoint: Callable[[str], Path],
                                                              tok: Tokenizer) -> None:
    """Tokenizer.encode_chat gives the same ids as transformers' apply_chat_template with a generation prompt."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(checkpoint("llama")))
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "héllo, what is 2+2? 🙂"},
    ]
    expected = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    if not isinstance(expected, list):  # transformers 5 returns a BatchEncoding
        expected = expected["input_ids"]
    ours = tok.encode_chat(messages)
    assert ours == list(expected)
    assert ours[0] == tok.bos_token_id
    assert ours.count(tok.bos_token_id) == 1


def test_add_many_releases_the_same_text_as_add_token_by_token(tok: Tokenizer, ids: list[int]) -> None:
    """Chunks of 1-5 tokens, split inside multi-byte characters too: the same text in the end, never more early."""
    one = IncrementalDetokenizer(tok)
    ref = "".join(one.add(t) for t in ids) + one.flush()
    for size in (1, 2, 3, 5):
        many = IncrementalDetokenizer(tok)
        parts = [many.add_many(ids[i:i + size]) for i in range(0, len(ids), size)]
        assert "".join(parts) + many.flush() == ref == TEXT
        assert many.tokens == ids
    with pytest.raises(ValueError, match="stop strings"):
        IncrementalDetokenizer(tok, stop=("x",)).add_many(ids)
