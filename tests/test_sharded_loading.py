"""Sharded loading: a tensor-parallel rank reads only its own slice of each sharded checkpoint tensor.

Every checkpoint tensor is wrapped so that it records how many of its elements any operation other than taking a
view (``narrow``, indexing, ``.shape``) touches. At TP=2, loaded into a dtype other than the checkpoint's (so a
cast is needed), each rank must read half of every column-, row- and vocab-parallel weight and all of the
replicated norms, and hold the same parameters as a TP=2 shard loaded from plain tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from engine.loader import iter_weights
from engine.model_config import ModelConfig
from engine.models.decoder import CausalLM, ShardSpec

VIEWS = {"narrow", "__getitem__", "select", "__get__", "dim", "size", "numel", "__len__"}


class _Reads(torch.Tensor):
    """A checkpoint tensor (or a view of one) that logs the most elements any non-view operation read of it."""

    reads: ClassVar[dict[str, int]] = {}
    key: str

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        srcs = [a for a in (*args, *kwargs.values()) if isinstance(a, _Reads)]
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        key = srcs[0].key
        if getattr(func, "__name__", "") in VIEWS:
            if isinstance(out, torch.Tensor):
                out = out.as_subclass(_Reads)
                out.key = key
            return out
        cls.reads[key] = max(cls.reads.get(key, 0), *(s.numel() for s in srcs))
        return out


def _tracked(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in iter_weights(path):
        wrapped = tensor.as_subclass(_Reads)
        wrapped.key = name
        yield name, wrapped


def _load(path: Path, rank: int, weights: Callable[[Path], Iterator[tuple[str, torch.Tensor]]]) -> CausalLM:
    cfg = ModelConfig.from_dir(path)
    model = CausalLM(cfg, torch.bfloat16, 256, shard=ShardSpec(tp_rank=rank, tp_size=2))
    model.load_weights(weights(path))
    return model


@pytest.mark.parametrize("rank", [0, 1])
def test_a_tp2_rank_reads_half_of_every_sharded_weight(checkpoint: Callable[[str], Path], rank: int) -> None:
    path = checkpoint("llama")
    sizes = {name: t.numel() for name, t in iter_weights(path)}
    assert next(iter_weights(path))[1].dtype == torch.float32  # the load below casts to bf16
    _Reads.reads = {}
    tracked = _load(path, rank, _tracked)
    sharded = ("_proj.weight", "embed_tokens.weight", "lm_head.weight")
    for name, n in sizes.items():
        read = _Reads.reads.get(name, 0)
        if name.endswith(sharded):
            assert read == n // 2, f"rank {rank} read {read} of {name}'s {n} elements, not its half"
        else:
            assert read == n, f"{name} is replicated: rank {rank} read {read} of {n}"
    plain = _load(path, rank, iter_weights)
    for (name, got), (_, want) in zip(tracked.named_parameters(), plain.named_parameters(), strict=True):
        assert torch.equal(got, want), name
