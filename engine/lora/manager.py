"""The resident adapter set and the per-step application of LoRA deltas over a mixed batch.

The engine registers every ``--lora NAME=DIR`` at start (each is read and checked then), keeps at most
``max_loras`` of them loaded, and loads an evicted one again when a request names it, dropping the least recently
used adapter that the step does not need. A step with more distinct adapters than ``max_loras`` loads the extra ones
for that step (the scheduler does not yet cap a batch's distinct adapters), and the set is trimmed back after it.

Each step the model runner hands :meth:`LoRAManager.begin_step` the batch's requests and their row counts (rows of a
request are contiguous). Requests of one adapter form a group; for every target linear of every layer, each group's
rows get ``(x A^T) B^T * scaling`` added to the base output in place: one pair of small matmuls per adapter present
(gathered rows when the group is not one contiguous span), none for base-model rows. The hooks are attached to the
model only when adapters are configured, so the base path pays nothing otherwise.

At run time (the worker's ``LoadLoRAAdapter``/``UnloadLoRAAdapter``, on the engine loop's thread between steps)
:meth:`LoRAManager.register` adds an adapter (read and checked first: a bad directory changes nothing) and
:meth:`LoRAManager.unregister` drops one; the caller refuses an unload while requests of it are unfinished. Cached KV
blocks are keyed by the adapter's *name* (the block hash's extra keys), so a name, once served, stays bound to its
content for the manager's life: registering other content under a name used before is refused (a new name, or the
same files again, is fine). Each adapter is named by a content hash too (sha256 of its two files), which the
workers advertise so that a router can tell the same adapter from a namesake.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.lora.adapter import LoRAAdapter, LoRAWeights, load_adapter
from engine.lora.config import LoRAConfig, check_adapter_name
from engine.model_config import ModelConfig
from engine.request import Request


class UnknownAdapterError(ValueError):
    """A request named an adapter this engine does not serve."""


@dataclass(slots=True)
class _Group:
    adapter: LoRAAdapter
    span: tuple[int, int] | None  # contiguous rows, else ``rows``
    rows: torch.Tensor | None


LoRAHook = Callable[[str, torch.Tensor, torch.Tensor], None]


class LoRAManager:
    def __init__(self, config: LoRAConfig, model_config: ModelConfig, dtype: torch.dtype) -> None:
        self.config = config
        self.model_config = model_config
        self.dtype = dtype
        self.paths: dict[str, Path] = {name: Path(path) for name, path in config.adapters}
        self.resident: OrderedDict[str, LoRAAdapter] = OrderedDict()
        self.loads = 0  # adapters read from disk, start-up included
        self._groups: list[_Group] = []
        self.hashes: dict[str, str] = {}  # name -> content hash of every adapter served (content_hash)
        self._bound: dict[str, str] = {}  # name -> content hash of every adapter ever served: its KV's key
        for name in self.paths:  # every adapter is checked at start; the first max_loras stay loaded
            self._load(name)
            self.hashes[name] = self._bound[name] = content_hash(self.paths[name])
            self._trim(set())

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.paths)

    def check(self, name: str) -> None:
        if name not in self.paths:
            raise UnknownAdapterError(f"unknown LoRA adapter {name!r}; this engine serves {sorted(self.paths)}")

    def _load(self, name: str) -> LoRAAdapter:
        adapter = load_adapter(name, self.paths[name], self.model_config, self.dtype)
        self.resident[name] = adapter
        self.loads += 1
        return adapter

    def get(self, name: str) -> LoRAAdapter:
        """The adapter, loaded if it was evicted; marked most recently used."""
        self.check(name)
        adapter = self.resident.get(name)
        if adapter is None:
            return self._load(name)
        self.resident.move_to_end(name)
        return adapter

    def register(self, name: str, path: str | Path) -> str:
        """Serve the adapter at ``path`` under ``name`` from now on (loaded, most recently used); its content hash.
        ValueError naming the problem (bad name or directory, an adapter that does not fit the model, a name that
        serves or served other content); nothing changes then. The same name and content again is a no-op."""
        check_adapter_name(name)
        path = Path(path)
        if not path.is_dir():
            raise ValueError(f"adapter {name!r}: {path} is not a directory")
        digest = content_hash(path)
        bound = self._bound.get(name)
        if bound is not None and bound != digest:
            what = "serves" if name in self.paths else "served"
            raise ValueError(f"adapter {name!r} already {what} other content (hash {bound}, {path} has {digest}); "
                             "its cached KV is keyed by the name: load these files under a new name")
        if name in self.paths:
            return digest
        adapter = load_adapter(name, path, self.model_config, self.dtype)  # raises before anything changes
        self.paths[name] = path
        self.hashes[name] = self._bound[name] = digest
        self.resident[name] = adapter
        self.loads += 1
        self._trim({name})
        return digest

    def unregister(self, name: str) -> None:
        """Stop serving ``name`` (UnknownAdapterError if it is not served); the caller makes sure no unfinished
        request names it."""
        self.check(name)
        del self.paths[name]
        del self.hashes[name]
        self.resident.pop(name, None)

    def _trim(self, keep: set[str]) -> None:
        for name in list(self.resident):
            if len(self.resident) <= self.config.max_loras:
                return
            if name not in keep:
                del self.resident[name]

    # ---- per step ----------------------------------------------------------------------------------------------

    def attach(self, layers: Iterable[torch.nn.Module]) -> None:
        """Give each decoder layer's attention and dense MLP the hook that adds this step's deltas."""
        cfg = self.model_config
        q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
        packed = {"qkv": (("q_proj", 0, q), ("k_proj", q, kv), ("v_proj", q + kv, kv)), "o": (("o_proj", 0, -1),),
                  "gate_up": (("gate_proj", 0, inter), ("up_proj", inter, inter)), "down": (("down_proj", 0, -1),)}
        for i, layer in enumerate(layers):
            layer.self_attn.lora = self._hook(i, packed)  # type: ignore[union-attr]
            if not cfg.is_moe_layer(i):
                layer.mlp.lora = self._hook(i, packed)  # type: ignore[union-attr]

    def begin_step(self, requests: Sequence[Request], rows: Sequence[int]) -> None:
        """Group this step's rows by adapter: ``rows[i]`` rows of the flat batch belong to ``requests[i]``."""
        spans: dict[str, list[tuple[int, int]]] = {}
        t = 0
        for req, n in zip(requests, rows, strict=True):
            if req.lora is not None:
                spans.setdefault(req.lora, []).append((t, t + n))
            t += n
        groups = []
        for name, parts in spans.items():
            adapter = self.get(name)
            if len(parts) == 1:
                groups.append(_Group(adapter, parts[0], None))
            else:
                idx = torch.cat([torch.arange(a, b) for a, b in parts])
                groups.append(_Group(adapter, None, idx))
        self._trim(set(spans))
        self._groups = groups

    def _hook(self, layer: int, packed: dict[str, tuple[tuple[str, int, int], ...]]) -> LoRAHook:
        def apply(module: str, x: torch.Tensor, out: torch.Tensor) -> None:
            if not self._groups:
                return
            x2 = x.reshape(x.shape[0], -1)
            for group in self._groups:
                weights = group.adapter.layers[layer]
                if group.span is not None:
                    xs = x2[group.span[0] : group.span[1]]
                else:
                    assert group.rows is not None
                    xs = x2.index_select(0, group.rows)
                for proj, start, size in packed[module]:
                    w = weights.get(proj)
                    if w is not None:
                        _add_delta(out, xs, w, start, size if size >= 0 else out.shape[1], group)
        return apply


def content_hash(path: str | Path) -> str:
    """16 hex digits of sha256 over an adapter directory's ``adapter_config.json`` and ``adapter_model.safetensors``
    (the same adapter has the same hash on every host); ValueError when either file is missing."""
    h = hashlib.sha256()
    for file in ("adapter_config.json", "adapter_model.safetensors"):
        try:
            with open(Path(path) / file, "rb") as f:
                h.update(hashlib.file_digest(f, "sha256").digest())
        except FileNotFoundError:
            raise ValueError(f"{path} needs adapter_config.json and adapter_model.safetensors") from None
    return h.hexdigest()[:16]


def _add_delta(out: torch.Tensor, xs: torch.Tensor, w: LoRAWeights, start: int, size: int, group: _Group) -> None:
    # PEFT's order of operations: result + lora_B(lora_A(x)) * scaling
    delta = F.linear(F.linear(xs, w.a), w.b) * w.scaling
    cols = out.narrow(1, start, size)
    if group.span is not None:
        cols[group.span[0] : group.span[1]] += delta
    else:
        assert group.rows is not None
        cols.index_add_(0, group.rows, delta)
