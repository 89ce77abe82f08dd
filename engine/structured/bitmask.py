"""The token bitmask of a batch's constrained rows: computed by llguidance, applied to the logits in the sampler.

A :class:`MaskBatch` holds one step's masks. :meth:`MaskBatch.fill` has llguidance write one int32 bitmask row per
constrained request, off the GIL. :meth:`MaskBatch.apply`
masks the constrained rows of the logits. CPU fp32 logits (the engine's) take the native kernel
``apply_bitmask.c``: one pass that writes -inf where a bit is clear and skips all-ones words, ~10 us for 32 rows of
2k tokens. Elsewhere (GPU logits, other dtypes, no C compiler) the bits become an additive bias (0 where a token is
allowed, -inf where not, in bfloat16, built with integer ops on the unpacked bits) added in one op: ~150 us for the
same rows on this project's busy 2-vCPU host, where the kernel saved that much engine-thread CPU per step at batch 32
(``tandem bench structured``; docs/benchmarks.md). Both equal a masked fill (for finite logits ``x + 0 == x`` and
``x + -inf == -inf``; the bias turns a -0.0 logit into +0.0, which compares, exponentiates and divides alike).
Unconstrained rows are never touched, so they sample exactly as in a batch without constrained requests. The fill
runs on the native masks thread while the forward pass computes (:mod:`.prefetch`); the sampler's thread takes
whatever rows it has not begun.

The fill is one ctypes call for the batch into ``llg_masks.c`` (:class:`~engine.structured.native.MaskFiller`),
which computes each row with llguidance's C API off the GIL; a row whose matcher is in its error state allows only
EOS, as llguidance's Python API writes it.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.structured.native import MaskFiller, NativeMatcher
from native.build import BASE_FLAGS, compile_shared, compiler, enabled

log = logging.getLogger(__name__)
_NEG_INF_BITS = np.int16(-128)  # 0xFF80: bfloat16 -inf


@functools.cache
def apply_kernel() -> Any:
    """``tandem_apply_token_bitmask`` from ``apply_bitmask.c`` (see its header), or None without a C compiler, with
    native kernels disabled (``TANDEM_NATIVE_KERNELS=0``), or when the build fails: then the bias path runs."""
    cc = compiler()
    if not enabled() or cc is None:
        return None
    try:
        lib = ctypes.CDLL(str(compile_shared(cc, Path(__file__).with_name("apply_bitmask.c"), BASE_FLAGS)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.warning("could not build the grammar-mask kernel (%s); masks are applied as an added bias", e)
        return None
    fn = lib.tandem_apply_token_bitmask
    p, i = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [p, i, p, i, p, i, i]
    fn.restype = None
    return fn


class MaskBuffers:
    """The bitmask and bias memory of one step at a time, kept across steps (grow-only): a fresh bias each step paid
    its page faults. One step's masks are done with before the next step's are started, so one set serves."""

    def __init__(self) -> None:
        self._bitmask = torch.empty(0, 0, dtype=torch.int32)
        self._bias = torch.empty(0, 0, dtype=torch.bfloat16)

    def bitmask(self, rows: int, words: int) -> torch.Tensor:
        if self._bitmask.shape[0] < rows or self._bitmask.shape[1] != words:
            self._bitmask = torch.empty(max(rows, self._bitmask.shape[0]), words, dtype=torch.int32)
        return self._bitmask[:rows]

    def bias(self, rows: int, width: int) -> torch.Tensor:
        if self._bias.shape[0] < rows or self._bias.shape[1] != width:
            self._bias = torch.empty(max(rows, self._bias.shape[0]), width, dtype=torch.bfloat16)
        return self._bias[:rows]


class MaskBatch:
    """Masks for one step. ``matchers[i]`` is row i's matcher, or None for an unconstrained row. ``width`` is the
    logits' width (the model's head may have padding columns past the grammar's vocabulary: they are disallowed)."""

    def __init__(self, filler: MaskFiller, matchers: Sequence[NativeMatcher | None], vocab_size: int, width: int,
                 buffers: MaskBuffers | None = None) -> None:
        self.matchers = list(matchers)
        self.rows = [i for i, m in enumerate(matchers) if m is not None]
        self.all_rows = len(self.rows) == len(matchers)
        self.width = width
        self._buffers = buffers or MaskBuffers()
        # every word of every row is written by the fill: no need to initialise it. One bit per token, 32 to a word,
        # as llguidance.torch.get_bitmask_shape computes it: importing that module costs every engine process
        # torch._dynamo (its @torch.compile), seconds of start-up on a 2-core host, for this one line.
        self.words = (vocab_size + 31) // 32
        self.bitmask = self._buffers.bitmask(len(self.rows), self.words) if self.rows else None
        self.filled = False
        self.bias: torch.Tensor | None = None  # bfloat16 [constrained rows, width]: 0 or -inf, built where needed
        self.constrained: list[NativeMatcher] = [m for m in matchers if m is not None]
        if self.constrained:
            tok = self.constrained[0].tokenizer
            if (tok.vocab_size + 31) // 32 != self.words:
                raise ValueError(f"masks of {self.words} words for a grammar vocabulary of {tok.vocab_size} tokens")
            self.eos = tok.eos_token_id
        self._filler = filler

    def start(self) -> None:
        """Hand the fill to the filler's native thread; the caller must ``finish`` before reading the masks."""
        if self.bitmask is not None and not self.filled:
            self._filler.start(self.constrained, self.bitmask.data_ptr(), self.words, self.eos)

    def finish(self) -> None:
        """The fill ``start`` began, completed (the calling thread takes the rows the worker has not begun)."""
        if self.bitmask is not None and not self.filled:
            self._filler.finish()
            self.filled = True

    def fill(self) -> None:
        """Compute the masks (once), on the calling thread."""
        if self.bitmask is None or self.filled:
            return
        self._filler.fill(self.constrained, self.bitmask.data_ptr(), self.words, self.eos)
        self.filled = True

    def apply(self, logits: torch.Tensor) -> None:
        """Mask ``logits`` [batch, width] in place, filling first if that is not done yet."""
        if self.bitmask is None:
            return
        if logits.shape[1] != self.width:
            raise ValueError(f"masks of width {self.width} for logits of width {logits.shape[1]}")
        self.fill()
        kernel = apply_kernel()
        if kernel is not None and logits.device.type == "cpu" and logits.dtype == torch.float32 \
                and logits.stride(1) == 1:
            rows = np.asarray(self.rows, dtype=np.int64)
            kernel(logits.data_ptr(), logits.stride(0), self.bitmask.data_ptr(), self.bitmask.shape[1],
                   rows.ctypes.data, len(self.rows), self.width)
            return
        if self.bias is None:
            self.bias = mask_bias(self.bitmask, self.width, self._buffers.bias(len(self.rows), self.width))
        bias = self.bias.to(logits.device)
        if self.all_rows:
            logits.add_(bias)
        else:
            logits.index_add_(0, torch.tensor(self.rows, dtype=torch.long, device=logits.device), bias.to(logits.dtype))


def mask_bias(bitmask: torch.Tensor, width: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """int32 [rows, words] bitmask -> bfloat16 [rows, width] (into ``out`` if given): 0.0 for an allowed token (bit b
    of word w is token 32*w + b), -inf for the others and for every column beyond the mask. Built in place as int16
    bit patterns (``(bit - 1) & 0xFF80``), no float op; bfloat16 holds 0 and -inf exactly in half float32's bytes."""
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little", count=width)
    if out is None:
        out = torch.empty(bitmask.shape[0], width, dtype=torch.bfloat16)
    pattern = out.view(torch.int16).numpy()
    np.subtract(bits, 1, out=pattern, dtype=np.int16)
    np.bitwise_and(pattern, _NEG_INF_BITS, out=pattern)
    return out
