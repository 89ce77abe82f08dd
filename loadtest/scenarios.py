"""What each simulated user sends: four scenarios, each a function from a random generator to one request.

- ``chat``: chat completions that share a long system prompt (a prefix the router's KV index should route to
  where it is cached), each with its own short question;
- ``random``: completions of random words, no two alike (no prefix reuse: the cache-miss baseline);
- ``long``: long random prompts (past the router's disaggregation threshold: the prefill -> decode path);
- ``mix``: each request one of the three, weighted 2:2:1.

Prompts are words, not token ids, so the same scenario runs against any OpenAI-compatible server.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

SCENARIOS = ("chat", "random", "long", "mix")
_WORDS = ("serving", "prefill", "decode", "cache", "token", "latency", "router", "batch", "stream", "layer", "block",
          "model", "request", "worker", "tier", "budget", "queue", "graph", "kernel", "memory", "network", "replica")
SYSTEM_PROMPT = " ".join(["You are a careful assistant for an inference platform team. Answer briefly."] * 8)


@dataclass(slots=True, frozen=True)
class Request:
    chat: bool  # /v1/chat/completions (messages) or /v1/completions (prompt)
    prompt: str
    system: str = ""

    def body(self, model: str, max_tokens: int, stream: bool) -> dict[str, Any]:
        out: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "stream": stream, "ignore_eos": True,
                               "temperature": 0}
        if stream:
            out["stream_options"] = {"include_usage": True}
        if self.chat:
            msgs = ([{"role": "system", "content": self.system}] if self.system else [])
            out["messages"] = [*msgs, {"role": "user", "content": self.prompt}]
        else:
            out["prompt"] = self.prompt
        return out


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) + str(rng.randrange(1000)) for _ in range(n))


def make_request(scenario: str, rng: random.Random, long_words: int = 400) -> Request:
    if scenario == "mix":
        scenario = rng.choices(("chat", "random", "long"), weights=(2, 2, 1))[0]
    if scenario == "chat":
        return Request(True, f"Question {rng.randrange(10**6)}: what does {_words(rng, 3)} mean?", SYSTEM_PROMPT)
    if scenario == "random":
        return Request(False, _words(rng, 24))
    if scenario == "long":
        return Request(False, _words(rng, long_words))
    raise ValueError(f"unknown scenario {scenario!r} (choose from {', '.join(SCENARIOS)})")
