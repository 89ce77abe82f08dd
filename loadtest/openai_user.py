"""A locust user speaking OpenAI HTTP (``/v1/completions`` and ``/v1/chat/completions``), streaming or not.

Streamed responses are read as server-sent events; their TTFT, ITL and end-to-end latency go to locust as custom
entries (report.py). A response that is not 200, or a stream that ends without ``data: [DONE]`` or without any
content, is a failure.
"""

from __future__ import annotations

import json
import random

from locust import HttpUser, task
from report import StreamTimer
from scenarios import make_request


class OpenAIUser(HttpUser):
    abstract = True  # the locustfile's subclass sets the wait time; options come from the command line

    def on_start(self) -> None:
        opts = self.environment.parsed_options
        self.rng = random.Random()
        self.model = opts.model if opts is not None and opts.model else self._first_model()

    def _first_model(self) -> str:
        with self.client.get("/v1/models", name="/v1/models", catch_response=True) as r:
            if r.status_code != 200:
                r.failure(f"/v1/models answered {r.status_code}")
                return "unknown"
            return str(r.json()["data"][0]["id"])

    @task
    def generate(self) -> None:
        opts = self.environment.parsed_options
        assert opts is not None
        req = make_request(opts.scenario, self.rng, opts.long_words)
        path = "/v1/chat/completions" if req.chat else "/v1/completions"
        body = req.body(self.model, opts.max_tokens, opts.stream)
        name = f"{path} [{opts.scenario}]"
        if not opts.stream:
            with self.client.post(path, json=body, name=name, catch_response=True) as r:
                if r.status_code != 200:
                    r.failure(f"{r.status_code}: {r.text[:200]}")
            return
        timer = StreamTimer(self.environment, name)
        with self.client.post(path, json=body, name=name, stream=True, catch_response=True) as r:
            if r.status_code != 200:
                r.failure(f"{r.status_code}: {r.text[:200]}")
                return
            done = False
            for raw in r.iter_lines():
                line = raw.decode() if isinstance(raw, bytes) else raw
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                event = json.loads(line[6:])
                if "error" in event:
                    r.failure(f"stream error: {event['error']}")
                    return
                for choice in event.get("choices", []):
                    if choice.get("text") or (choice.get("delta") or {}).get("content"):
                        timer.chunk()
                        break
            if not done or not timer.chunks:
                r.failure(f"stream ended without [DONE] or content ({timer.chunks} content chunks)")
                return
            timer.done()
