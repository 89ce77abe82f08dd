"""The weight-only kernel's layouts and its bf16-activation path (``wlinear.c``), against dequantize-then-matmul.

INT4 weights whose inputs are a multiple of 128 are stored in 128-input chunks (``WQ_U4_CHUNKS``), others in nibble
pairs; the bf16 path takes one row (single-sequence decode: rows widened in registers) or several (rows widened once
per block of four), and writes bf16 itself. Each case is checked against the same bf16 input times the dequantized
fp32 weight: the kernel's fp32 sum rounded once to bf16 is within one bf16 step of the reference's."""

from __future__ import annotations

import pytest
import torch

from engine.quant.kernels import (
    WQ_I8,
    WQ_I8_BLOCKED,
    WQ_U4_CHUNKS,
    WQ_U4_CHUNKS_BLOCKED,
    WQ_U4_PAIRS,
    QuantLinear,
    pack_int4_chunks,
    unpack_int4_chunks,
    wq_linear_bf16_kernel,
    wq_linear_kernel,
)
from engine.quant.weights import QuantizedMatrix


def _matrix(bits: int, rows: int, cols: int, group: int, zero: bool, seed: int) -> QuantizedMatrix:
    g = torch.Generator().manual_seed(seed)
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    q = torch.randint(lo, hi + 1, (rows, cols), dtype=torch.int8, generator=g)
    scale = torch.rand(rows, cols // group, generator=g) * 0.01 + 1e-3
    z = torch.randint(lo, hi + 1, (rows, cols // group), dtype=torch.int8, generator=g) if zero else None
    return QuantizedMatrix(q, scale, z, bits)


def test_int4_chunk_layout_round_trips_and_puts_four_inputs_in_each_word() -> None:
    q = torch.randint(-8, 8, (3, 256), dtype=torch.int8, generator=torch.Generator().manual_seed(0))
    packed = pack_int4_chunks(q)
    assert packed.shape == (3, 128) and packed.dtype is torch.uint8
    assert torch.equal(unpack_int4_chunks(packed), q)
    word = int(packed[1, 64 + 2 * 5]) | int(packed[1, 64 + 2 * 5 + 1]) << 8  # chunk 1, word 5
    assert [(word >> (4 * s)) & 15 for s in range(4)] == [int(q[1, 128 + 5 + 32 * s]) + 8 for s in range(4)]


@pytest.mark.parametrize("bits,cols,group,fmt", [(8, 96, 32, WQ_I8_BLOCKED), (8, 100, 20, WQ_I8),
                                                (4, 96, 32, WQ_U4_PAIRS), (4, 384, 32, WQ_U4_CHUNKS_BLOCKED)])
def test_layout_choice_and_dequantize(bits: int, cols: int, group: int, fmt: int) -> None:
    fn = wq_linear_kernel()
    if fn is None:
        pytest.skip("no C compiler: quantized weights run dequantized")
    m = _matrix(bits, 5, cols, group, True, seed=1)
    ql = QuantLinear(m, fn)
    assert ql.fmt == fmt
    assert torch.equal(ql.dequantize(), m.dequantize())


@pytest.mark.parametrize("bits,cols,group", [(8, 384, 384), (8, 384, 32), (4, 96, 32), (4, 384, 32), (4, 384, 64),
                                             (4, 384, 128), (4, 384, 384)])
@pytest.mark.parametrize("zero", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 32])
def test_bf16_path_matches_dequantize_then_matmul(bits: int, cols: int, group: int, zero: bool, rows: int) -> None:
    fn = wq_linear_kernel()
    if fn is None or wq_linear_bf16_kernel() is None:
        pytest.skip("no AVX512-BF16 kernel on this CPU or compiler: the fp32 path runs (test_quant_formats)")
    m = _matrix(bits, 70, cols, group, zero, seed=rows + cols + group)  # 70 rows: a partial block of four
    ql = QuantLinear(m, fn)
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(3)).bfloat16()
    ref = x.float() @ m.dequantize().T
    got = ql(x)
    assert got.dtype is torch.bfloat16 and got.shape == (rows, 70)
    torch.testing.assert_close(got.float(), ref, rtol=2 ** -8, atol=1e-5 * float(ref.abs().max()))
    bias = torch.randn(70).bfloat16()
    torch.testing.assert_close(ql(x, bias), got + bias, rtol=0, atol=0)
    # one row alone (widened in registers) and the same row in a batch (widened once per block) agree
    torch.testing.assert_close(ql(x[-1:]).float(), got[-1:].float(), rtol=2 ** -8, atol=0)
    strided = torch.cat([x, x], dim=1)[:, :cols]  # a row stride other than the row length
    torch.testing.assert_close(ql(strided), got, rtol=0, atol=0)


@pytest.mark.parametrize("bits,piece,fmt,plain", [(8, 32, WQ_I8_BLOCKED, WQ_I8),
                                                  (4, 64, WQ_U4_CHUNKS_BLOCKED, WQ_U4_CHUNKS)])
def test_blocked_layouts_interleave_four_rows_and_give_the_row_major_kernels_sums_bit_for_bit(
        bits: int, piece: int, fmt: int, plain: int) -> None:
    fn = wq_linear_kernel()
    if fn is None:
        pytest.skip("no C compiler: quantized weights run dequantized")
    m = _matrix(bits, 70, 384, 128, bits == 4, seed=5)  # 70 rows: the last block padded with two zero rows
    blocked = QuantLinear(m, fn)
    width = 384 if bits == 8 else 192
    assert blocked.fmt == fmt and blocked.q.shape == (72, width)
    rows = m.q.contiguous() if bits == 8 else pack_int4_chunks(m.q)
    flat = blocked.q.view(-1)  # row 5 is row 1 of block 1; its second piece: 4 * width + 1 * 4 * piece + piece
    assert torch.equal(flat[4 * width + 4 * piece + piece:][:piece], rows[5, piece:2 * piece])
    padding = blocked.q.view(18, width // piece, 4, piece)[-1, :, 2:]  # rows 70 and 71 of the last block
    assert not padding.any()
    rowmajor = QuantLinear(m, fn)
    rowmajor.fmt, rowmajor.q = plain, rows
    rowmajor._args = (rowmajor.q.data_ptr(), plain, *rowmajor._args[2:])
    for n_in in (1, 3, 32):
        x = torch.randn(n_in, 384, generator=torch.Generator().manual_seed(n_in))
        for xx in (x, x.bfloat16()):  # the fp32 kernel and the bf16 one (one row: widened as read)
            assert torch.equal(blocked(xx), rowmajor(xx)), (n_in, xx.dtype)
