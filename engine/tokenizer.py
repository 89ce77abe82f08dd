"""Tokenizer for an HF checkpoint directory: ``tokenizer.json`` through the Rust ``tokenizers`` library, plus the
special tokens and chat template from ``tokenizer_config.json``. transformers is not needed at serving time.

Chat templates render with Jinja2 in a sandbox, the way transformers does (``trim_blocks``, ``lstrip_blocks``,
``raise_exception``), and the rendered text is encoded without adding special tokens again, as
``apply_chat_template`` does.
"""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path
from typing import Any

from jinja2 import Template
from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

_LONG_TEXT = 16384  # characters: longer texts are tokenised through encode_batch (see Tokenizer.encode)


def _token_str(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        root = Path(model_dir)
        path = root / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found")
        self._tok = HFTokenizer.from_file(str(path))
        cfg_path = root / "tokenizer_config.json"
        cfg: dict[str, Any] = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.config = cfg
        self.bos_token = _token_str(cfg.get("bos_token"))
        self.eos_token = _token_str(cfg.get("eos_token"))
        self.chat_template: str | None = cfg.get("chat_template")
        template_file = root / "chat_template.jinja"
        if self.chat_template is None and template_file.is_file():
            self.chat_template = template_file.read_text()
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.special_ids = frozenset(
            i for i, t in self._tok.get_added_tokens_decoder().items() if getattr(t, "special", False)
        )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) > _LONG_TEXT:
            # ``encode_batch`` lets other threads run while it works and ``encode`` mostly does not: a long prompt
            # tokenised in the router's parser threads would otherwise stall its event loop (164 -> 58 ms for a
            # 250 kB one-word prompt here).
            return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def to_json(self) -> str:
        """The tokenizer as ``tokenizer.json`` text (what the structured-output compiler builds its own from)."""
        return self._tok.to_str()

    @cached_property
    def _template_env(self) -> ImmutableSandboxedEnvironment:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        env.globals["raise_exception"] = raise_exception
        env.filters["tojson"] = _tojson  # transformers' (no HTML escaping), which tool-calling templates expect
        return env

    @cached_property
    def _chat_template(self) -> Template:
        """The chat template compiled once: Jinja's ``from_string`` parses and compiles the source on every call
        (tens of milliseconds for a tool-calling template; transformers caches the compiled one the same way)."""
        assert self.chat_template is not None
        return self._template_env.from_string(self.chat_template)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        if not self.chat_template:
            raise ValueError("this model has no chat template")
        return self._chat_template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs)

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None) -> list[int]:
        kwargs = {"tools": tools} if tools else {}
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, **kwargs),
                           add_special_tokens=False)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
