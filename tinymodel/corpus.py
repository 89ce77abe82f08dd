"""Built-in, deterministically generated training text for the tiny tokenizer.

Nothing can be downloaded in the environments Tandem runs its tests in, so the byte-level BPE tokenizer of the
built-in tiny checkpoints (see :mod:`tinymodel.checkpoint`) is trained on text generated here.

Design choices:

* The text comes from a private :class:`random.Random` seeded with a constant, whose ``random()``, ``choice()`` and
  ``randrange()`` sequences are stable across processes and CPython versions, so the corpus (and therefore the
  trained tokenizer) is byte-identical everywhere. No ``hash()``-ordered containers are iterated.
* It mixes English-like sentences, a large pool of pronounceable pseudo-words with a Zipf-like frequency profile
  (this is what lets BPE reach 8192 tokens on a corpus of about 1 MB), numbers, Python-like code, chat-like turns,
  accented Latin text, CJK and emoji, so the learned merges cover the kinds of prompts the tests send.
* Byte-level BPE sees every UTF-8 byte in its initial alphabet anyway, so rare scripts only need to appear a little.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

__all__ = ["CORPUS_SEED", "corpus_lines"]

CORPUS_SEED = 20240531

_COMMON_WORDS_TEXT = """
    the of and to in is was that for it with as his on be at by had are but from or have an they which one you were
    her all she there would their we him been has when who will more no if out so said what up its about into than
    them can only other new some could time these two may then do first any my now such like our over man me even
    most made after also did many before must through back years where much your way well down should because each
    just those people how too little state good very make world still own see men work long get here between both
    life being under never day same another know while last might us great old year off come since against go came
    right used take three small house number water light model token server request stream batch cache memory kernel
    tensor queue prompt answer question engine latency throughput sample greedy decode prefill schedule block page
    weight layer head attention expert router logits vocabulary sentence story morning evening river mountain city
    garden window music teacher student doctor market coffee summer winter friend family happy quiet bright simple
"""
_COMMON_WORDS: tuple[str, ...] = tuple(_COMMON_WORDS_TEXT.split())

_TOPICS: tuple[str, ...] = (
    "The server", "A tiny model", "My friend", "The scheduler", "Every request", "The old river", "This kernel",
    "Our team", "The cache", "A quiet city", "The teacher", "Each expert", "The batch", "Her garden", "The engine",
)

_VERBS: tuple[str, ...] = (
    "runs", "reads", "writes", "keeps", "finds", "moves", "builds", "checks", "loads", "sends", "waits for",
    "answers", "streams", "schedules", "remembers", "forgets", "prefers", "returns", "measures", "shares",
)

_MULTILINGUAL: tuple[str, ...] = (
    "héllo wörld, ça va très bien", "naïve café au déjà vu", "Grüße aus München und Köln", "el niño juega mañana",
    "São Paulo é uma cidade grande", "Ærøskøbing ligger på Ærø", "Zürich, Genève, Besançon", "año señor pingüino",
    "你好，世界", "世界很大", "我们今天学习", "中文分词测试", "こんにちは世界", "ありがとうございます", "東京と大阪",
    "안녕하세요 세계", "Привет, мир", "Здравствуйте", "Γειά σου Κόσμε", "مرحبا بالعالم", "שלום עולם", "नमस्ते दुनिया",
    "🙂", "😀 😃 😄", "👍🏽 🎉 🚀", "❤️ ✨ 🌍", "🐍 🦀 ☕", "emoji 🙂 inside text 🙃",
)

_CODE_LINES: tuple[str, ...] = (
    "def forward(self, x: torch.Tensor) -> torch.Tensor:",
    "    return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))",
    "for i in range(len(tokens)):",
    "    if tokens[i] == eos_id:",
    "        break",
    "import json, os, sys",
    "with open(path, 'r', encoding='utf-8') as f:",
    "    data = json.load(f)",
    "class Scheduler:",
    "    def __init__(self, max_batch: int = 8) -> None:",
    "        self.queue: list[Request] = []",
    "x = [n * n for n in range(10) if n % 2 == 0]",
    'print(f"{name}: {value:.3f}")',
    "assert out.shape == (batch, seq_len, hidden)",
    "{\"role\": \"user\", \"content\": \"Hello!\"}",
    "SELECT id, name FROM users WHERE age > 30 ORDER BY name;",
    "fn main() { println!(\"hello\"); }",
    "if (x != nullptr && x->size() > 0) { return x[0]; }",
    "$ curl -s http://localhost:8000/v1/completions -d '{\"prompt\": \"hi\"}'",
    "<html><body><p>Hello &amp; welcome</p></body></html>",
)

_ONSETS: tuple[str, ...] = (
    "b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "z",
    "br", "ch", "cl", "dr", "fl", "gr", "kr", "pl", "pr", "sh", "sl", "st", "th", "tr", "qu", "",
)
_VOWELS: tuple[str, ...] = ("a", "e", "i", "o", "u", "ai", "ea", "ou", "io", "y")
_CODAS: tuple[str, ...] = ("", "", "", "n", "r", "s", "l", "m", "t", "nd", "st", "ng", "x", "ck")


def _pseudo_word(rng: random.Random) -> str:
    """Return one pronounceable made-up word of one to four syllables."""
    n_syllables = 1 + rng.randrange(4)
    return "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(n_syllables))


def _zipf_pick(rng: random.Random, pool: Sequence[str]) -> str:
    """Pick from ``pool`` with probability roughly proportional to ``1 / (rank + 1)``."""
    # Inverse-CDF of a continuous 1/x law on [1, n + 1): exp(u * ln(n + 1)) - 1.
    n = len(pool)
    index = int((n + 1) ** rng.random()) - 1
    return pool[min(max(index, 0), n - 1)]


def _sentence(rng: random.Random, pseudo: Sequence[str]) -> str:
    """Return one English-like sentence mixing common words and pseudo-words."""
    words = [rng.choice(_TOPICS), rng.choice(_VERBS)]
    for _ in range(3 + rng.randrange(10)):
        roll = rng.random()
        if roll < 0.55:
            words.append(rng.choice(_COMMON_WORDS))
        elif roll < 0.95:
            words.append(_zipf_pick(rng, pseudo))
        else:
            words.append(str(rng.randrange(100000)))
    text = " ".join(words)
    return text + rng.choice((".", ".", ".", "!", "?", ",", ";", ":"))


def _line(rng: random.Random, pseudo: Sequence[str]) -> str:
    """Return one corpus line of a randomly chosen kind."""
    roll = rng.random()
    if roll < 0.62:
        return " ".join(_sentence(rng, pseudo) for _ in range(1 + rng.randrange(3)))
    if roll < 0.74:
        return rng.choice(_CODE_LINES)
    if roll < 0.82:
        return rng.choice(_MULTILINGUAL) + " " + _sentence(rng, pseudo)
    if roll < 0.90:
        role = rng.choice(("user", "assistant", "system"))
        return f"{role}: {_sentence(rng, pseudo)}"
    if roll < 0.95:
        year, month, day = 1900 + rng.randrange(200), 1 + rng.randrange(12), 1 + rng.randrange(28)
        hour, minute = rng.randrange(24), rng.randrange(60)
        dollars, cents = rng.randrange(10000), rng.randrange(100)
        return f"On {year:04d}-{month:02d}-{day:02d} at {hour:02d}:{minute:02d} we paid ${dollars}.{cents:02d}"
    return " ".join(_pseudo_word(rng).capitalize() for _ in range(2 + rng.randrange(6)))


def corpus_lines(n_lines: int = 24000, n_pseudo_words: int = 24000, seed: int = CORPUS_SEED) -> list[str]:
    """Return ``n_lines`` lines of deterministic training text.

    The same arguments always return the same list, in every process.
    """
    if n_lines <= 0:
        raise ValueError(f"n_lines must be positive, got {n_lines}")
    if n_pseudo_words <= 0:
        raise ValueError(f"n_pseudo_words must be positive, got {n_pseudo_words}")
    rng = random.Random(seed)
    pseudo = [_pseudo_word(rng) for _ in range(n_pseudo_words)]
    return [_line(rng, pseudo) for _ in range(n_lines)]
