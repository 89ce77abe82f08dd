"""CPU weight-only INT8 and INT4 matmuls: the native kernels of ``wlinear.c``, built on first use like the engine's
other kernels (:func:`native.build.compile_shared`).

Why our own kernels: torch's packed kernels (``torch._weight_int8pack_mm``, ``torch._weight_int4pack_mm_for_cpu``)
are exact enough (fp32 accumulation, within 1e-4 of dequantize-then-matmul) but, measured on the small model's
shapes on this project's CPU (AMD EPYC, AVX-512 with BF16, no AMX; one thread; 24 weights of 4096x768 cycled so they
stream from memory), no faster than oneDNN's packed bf16 matmul at one row (INT8 16.8 ms, INT4 9.8 ms, bf16 10.1 ms),
4x slower at 32 rows (151 / 127 / 34 ms), and their fp32 paths are scalar (10x slower than fp32 MKL).
``wlinear.c`` reads the quantized bytes once per call. With bf16 inputs the weights widen exactly to bf16 and
AVX512-BF16's ``vdpbf16ps`` does the products (exact in fp32) and fp32 sums, the group scale applied once per group
to the partial sum; with fp32 inputs (and where the CPU lacks BF16, or a group is not a multiple of 32) rows widen to
fp32 and FMA. At one row (single-sequence decode) each block of four rows is widened in registers as it is read,
with a software prefetch ahead of the stream; at more rows each block is widened once into a buffer and dotted with
two input rows per pass. INT4 weights whose inputs are a multiple of 128 are repacked at load into 128-input chunks
(:func:`pack_int4_chunks`) that widen with a shift and one ternary-logic instruction per 32 inputs; others keep
nibble pairs. Figures: docs/benchmarks.md section 9 (``tandem bench quant --kernels``).

:class:`QuantLinear` is what :func:`engine.models.layers.linear` calls for a weight that carries one (``weight.quant``):
up to ``MAX_KERNEL_ROWS`` rows (decode batches) the kernel; more rows (prefill) dequantize the weight to the
activation dtype and take the dense GEMM, whose blocking wins there and whose cost then dwarfs the dequantization.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import subprocess
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.quant.weights import QuantizedMatrix
from native.build import compile_shared, compiler, enabled

log = logging.getLogger(__name__)

MAX_KERNEL_ROWS = 32
_FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")
_SOURCE = Path(__file__).with_name("wlinear.c")
_p = ctypes.c_void_p
_i = ctypes.c_int64


@functools.cache
def _library() -> ctypes.CDLL | None:
    cc = compiler()
    if not enabled() or cc is None:
        log.info("native kernels disabled or no C compiler: quantized weights run dequantized")
        return None
    try:
        return ctypes.CDLL(str(compile_shared(cc, _SOURCE, _FLAGS)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.warning("could not build the quantized-linear kernel (%s): quantized weights run dequantized", e)
        return None


# The weight layouts of ``wlinear.c`` (its ``fmt`` argument).
WQ_I8, WQ_U4_PAIRS, WQ_U4_CHUNKS, WQ_U4_CHUNKS_BLOCKED, WQ_I8_BLOCKED = 8, 4, 5, 6, 9
U4_CHUNK = 128  # inputs per WQ_U4_CHUNKS chunk
BLOCK_ROWS = 4  # the blocked layouts' rows per block (wlinear.c's RB)
I8_PIECE = 32  # WQ_I8_BLOCKED: bytes per interleaved piece (WQ_U4_CHUNKS_BLOCKED's is one chunk, 64 bytes)


def _bind(lib: ctypes.CDLL, name: str, argtypes: list[type]) -> ctypes._CFuncPtr:  # type: ignore[name-defined]
    fn = getattr(lib, name)
    fn.argtypes = argtypes
    fn.restype = None
    return fn


@functools.cache
def wq_linear_kernel() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """``tandem_wq_linear`` (fp32 inputs; see ``wlinear.c``), or None when native kernels are off or cannot be
    built."""
    lib = _library()
    return None if lib is None else _bind(lib, "tandem_wq_linear",
                                          [_p, _i, _p, _p, ctypes.c_int, _p, _p, _p, _i, _i, _i, _i])


@functools.cache
def wq_linear_bf16_kernel() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """``tandem_wq_linear_bf16`` (bf16 inputs, AVX512-BF16), or None where the CPU or compiler lacks it."""
    lib = _library()
    if lib is None or not lib.tandem_wq_has_bf16():
        return None
    return _bind(lib, "tandem_wq_linear_bf16",
                 [_p, _i, _p, ctypes.c_int, _p, _p, _p, ctypes.c_int, _i, _i, _i, _i])


def interleave_blocks(p: torch.Tensor, piece: int) -> torch.Tensor:
    """A [N, B] byte matrix (B a multiple of ``piece``) -> the blocked layouts of ``wlinear.c``: rows padded with
    zeros to a multiple of 4, each block of 4 rows as ``piece``-byte pieces interleaved (row 0's first piece, row 1's,
    row 2's, row 3's, then their second pieces, ...): a block is read as one linear stream."""
    n, width = p.shape
    padded = -(-n // BLOCK_ROWS) * BLOCK_ROWS
    full = torch.zeros(padded, width, dtype=p.dtype)
    full[:n] = p
    blocks = full.view(padded // BLOCK_ROWS, BLOCK_ROWS, width // piece, piece)
    return blocks.permute(0, 2, 1, 3).contiguous().view(padded, width)


def deinterleave_blocks(p: torch.Tensor, n: int, piece: int) -> torch.Tensor:
    padded, width = p.shape
    blocks = p.view(padded // BLOCK_ROWS, width // piece, BLOCK_ROWS, piece)
    return blocks.permute(0, 2, 1, 3).contiguous().view(padded, width)[:n]


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int8 values in [-8, 7], ``[N, K]`` -> uint8 ``[N, K / 2]``: input 2j in the low nibble, 2j + 1 in the high."""
    u = (q.to(torch.int16) + 8).to(torch.uint8)
    return (u[:, 0::2] | (u[:, 1::2] << 4)).contiguous()


def unpack_int4(p: torch.Tensor) -> torch.Tensor:
    lo = (p & 15).to(torch.int8) - 8
    hi = (p >> 4).to(torch.int8) - 8
    return torch.stack((lo, hi), dim=-1).view(p.shape[0], -1)


def pack_int4_chunks(q: torch.Tensor) -> torch.Tensor:
    """int8 values in [-8, 7], ``[N, K]`` with K a multiple of 128 -> uint8 ``[N, K / 2]`` in ``wlinear.c``'s
    WQ_U4_CHUNKS layout: per 128 inputs, 16-bit word t holds inputs t, t + 32, t + 64, t + 96 (bits 0-3 .. 12-15)."""
    n, k = q.shape
    u = (q.to(torch.int16) + 8).to(torch.uint8).view(n, k // U4_CHUNK, 4, 32)
    lo, hi = u[:, :, 0] | (u[:, :, 1] << 4), u[:, :, 2] | (u[:, :, 3] << 4)  # the little-endian word's two bytes
    return torch.stack((lo, hi), dim=-1).reshape(n, k // 2).contiguous()


def unpack_int4_chunks(p: torch.Tensor) -> torch.Tensor:
    n = p.shape[0]
    b = p.view(n, -1, 32, 2)
    parts = [b[..., 0] & 15, b[..., 0] >> 4, b[..., 1] & 15, b[..., 1] >> 4]
    return (torch.stack(parts, dim=2).to(torch.int8) - 8).reshape(n, -1)


class QuantLinear:
    """One quantized weight ready for the kernel: ``y = x @ ((q - zero) * scale).T``."""

    __slots__ = ("_args", "bits", "fmt", "fn", "fn_bf16", "group", "groups", "k", "n", "q", "scale", "zero")

    def __init__(self, m: QuantizedMatrix, fn: ctypes._CFuncPtr) -> None:  # type: ignore[name-defined]
        self.bits = m.bits
        self.n, self.k = m.shape
        self.group = m.group_size
        self.groups = m.scale.shape[1]
        if self.bits == 4 and self.k % 2:
            raise ValueError(f"an INT4 weight needs an even number of inputs, got {self.k}")
        if self.bits == 8 and self.k % I8_PIECE == 0:
            self.fmt, self.q = WQ_I8_BLOCKED, interleave_blocks(m.q, I8_PIECE)
        elif self.bits == 8:
            self.fmt, self.q = WQ_I8, m.q.contiguous()
        elif self.k % U4_CHUNK == 0:
            self.fmt, self.q = WQ_U4_CHUNKS_BLOCKED, interleave_blocks(pack_int4_chunks(m.q), U4_CHUNK // 2)
        else:
            self.fmt, self.q = WQ_U4_PAIRS, pack_int4(m.q)
        self.scale = m.scale.float().contiguous()
        self.zero = None if m.zero is None else m.zero.float().contiguous()
        self.fn = fn
        self.fn_bf16 = wq_linear_bf16_kernel() if self.group % 32 == 0 else None
        # the bf16 kernel's fixed arguments, after x, its row stride and y: (q, fmt, scale, zero)
        self._args = (self.q.data_ptr(), self.fmt, self.scale.data_ptr(),
                      None if self.zero is None else self.zero.data_ptr())

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.scale) + ((self.zero,) if self.zero is not None
                                                                                 else ()))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        q = {WQ_I8: lambda p: p, WQ_U4_PAIRS: unpack_int4, WQ_U4_CHUNKS: unpack_int4_chunks,
             WQ_I8_BLOCKED: lambda p: deinterleave_blocks(p, self.n, I8_PIECE),
             WQ_U4_CHUNKS_BLOCKED: lambda p: unpack_int4_chunks(deinterleave_blocks(p, self.n, U4_CHUNK // 2))
             }[self.fmt](self.q)
        zero = None if self.zero is None else self.zero.to(torch.int8)
        return QuantizedMatrix(q, self.scale, zero, self.bits).dequantize().to(dtype)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.shape[0]
        if rows > MAX_KERNEL_ROWS or x.dim() != 2:
            return F.linear(x, self.dequantize(x.dtype), bias)
        if x.dtype is torch.bfloat16 and self.fn_bf16 is not None:  # the decode path: one call, bf16 out
            xb = x if x.stride(1) == 1 else x.contiguous()
            out = torch.empty(rows, self.n, dtype=torch.bfloat16)
            q, fmt, scale, zero = self._args
            self.fn_bf16(xb.data_ptr(), xb.stride(0), q, fmt, scale, zero, out.data_ptr(), 1, rows, self.n, self.k,
                         self.group)
            return out if bias is None else out.add_(bias)
        y = torch.empty(rows, self.n, dtype=torch.float32)
        xf = x if x.dtype is torch.float32 and x.stride(1) == 1 else x.float().contiguous()
        xs = None if self.zero is None else xf.view(rows, self.groups, self.group).sum(-1)
        self.fn(xf.data_ptr(), xf.stride(0), None if xs is None else xs.data_ptr(), self.q.data_ptr(), self.fmt,
                self.scale.data_ptr(), None if self.zero is None else self.zero.data_ptr(), y.data_ptr(), rows,
                self.n, self.k, self.group)
        out = y if x.dtype is torch.float32 else y.to(x.dtype)
        return out if bias is None else out.add_(bias)
