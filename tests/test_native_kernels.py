"""The native CPU kernels (engine/kernels) against the engine's torch path, and the fallback.

The torch path is itself checked against transformers by the parity tests; here the paged-attention kernel must
agree with it on every shape the engine produces: decodes, fresh and chunked prefills, mixed batches, sliding
windows, GQA ratios, head sizes with and without the vectorised specialisation, odd block sizes, strided queries,
bf16. The fused layer ops (RMSNorm, SiLU-and-multiply, rotary) are compared with the torch ops they replace. The
last tests run greedy parity with transformers with every kernel switched off, so both paths stay covered end to
end.

CI installs gcc (``.ci/run``), so the kernel must build there; the fallback test builds with a compiler that fails.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

import engine.model_runner as model_runner
import engine.models.layers as layers
from engine.attention import build_metadata, paged_attention, write_kv
from engine.kernels import layer_ops, paged_attention_kernel
from engine.llm import LLM
from engine.model_config import RopeConfig
from engine.request import Request
from engine.sampling_params import SamplingParams
from native.build import enabled

CPU = torch.device("cpu")


def test_kernels_build_here() -> None:
    if not enabled():
        pytest.skip("TANDEM_NATIVE_KERNELS=0")
    assert paged_attention_kernel() is not None
    assert layer_ops() is not None


def _no_layer_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(layers, "layer_ops", lambda: None)


@pytest.mark.parametrize("rows", [1, 7, 300])
def test_layer_ops_match_torch(rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    if layer_ops() is None:
        pytest.skip("native layer ops unavailable")
    g = torch.Generator().manual_seed(rows)
    norm = layers.RMSNorm(96, 1e-5)
    norm.weight.data = torch.randn(96, generator=g)
    wide = torch.randn(rows, 200, generator=g)
    x = wide[:, 10:106]  # strided rows
    gu = torch.randn(rows, 2 * 77, generator=g) * 4
    rope = layers.RotaryEmbedding(RopeConfig(theta=10000.0), 32, 512, torch.float32)
    cos, sin = rope.tables(torch.randint(0, 512, (rows,), generator=g))
    qkv = torch.randn(rows, 6, 32, generator=g)

    native = (norm(x), layers.silu_mul(gu, 77), rope.rotate(qkv.clone()[:, :4], cos, sin))
    _no_layer_ops(monkeypatch)
    ref = (norm(x), layers.silu_mul(gu, 77), rope.rotate(qkv[:, :4], cos, sin))
    assert torch.equal(native[0], ref[0])  # RMSNorm: torch's summation order, then the same roundings
    torch.testing.assert_close(native[1], ref[1], rtol=4e-6, atol=1e-6)
    assert torch.equal(native[2], ref[2])  # rotary: the same roundings, bit for bit


@pytest.mark.parametrize("rows", [1, 7, 300])
def test_bf16_layer_ops_round_where_transformers_rounds(rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bf16 twins against the torch expressions they replace, run in bf16 as transformers runs them."""
    if layer_ops() is None:
        pytest.skip("native layer ops unavailable")
    bf = torch.bfloat16
    g = torch.Generator().manual_seed(100 + rows)
    norm = layers.RMSNorm(96, 1e-5, bf)
    norm.weight.data = torch.randn(96, generator=g).to(bf)
    wide = (torch.randn(rows, 200, generator=g) * 3).to(bf)
    x = wide[:, 10:106]  # strided rows
    gu = (torch.randn(rows, 2 * 77, generator=g) * 4).to(bf)  # 77: a scalar tail after the 16-lane loop
    rope = layers.RotaryEmbedding(RopeConfig(theta=10000.0), 64, 512, bf)
    cos, sin = rope.tables(torch.randint(0, 512, (rows,), generator=g))
    qkv = torch.randn(rows, 6, 64, generator=g).to(bf)

    native = (norm(x), layers.silu_mul(gu, 77), rope.rotate(qkv.clone()[:, :4], cos, sin))
    assert all(t.dtype is bf for t in native)
    _no_layer_ops(monkeypatch)
    ref = (norm(x), layers.silu_mul(gu, 77), rope.rotate(qkv[:, :4], cos, sin))
    assert torch.equal(native[0], ref[0])  # RMSNorm: torch's summation order, then the same roundings
    assert torch.equal(native[2], ref[2])  # rotary: every product and the sum rounded to bf16, as torch does
    # silu: expf may move the pre-rounding value by an fp32 ulp, so at most one bf16 ulp apart, and only where
    # torch's value sat on a rounding boundary.
    ulp = torch.finfo(bf).eps * ref[1].float().abs().clamp_min(torch.finfo(bf).tiny)
    assert bool(((native[1].float() - ref[1].float()).abs() <= ulp).all())
    assert (native[1] != ref[1]).float().mean().item() <= 0.01


@pytest.mark.parametrize("dim", [8, 64, 100, 256, 768, 1000, 4096, 5120, 16384])
def test_native_mean_square_replays_torchs_summation_order(dim: int) -> None:
    """Short rows, leftovers past the 8-lane vectors and the 4 accumulators, and rows long enough for the
    cascade's levels: each row's mean square equals torch's bit for bit, in fp32 and from bf16."""
    ops = layer_ops()
    if ops is None:
        pytest.skip("native layer ops unavailable")
    assert layers.native_mean_square_exact(dim)
    g = torch.Generator().manual_seed(dim)
    for x in (torch.randn(9, dim + 3, generator=g)[:, 3:], (torch.randn(9, dim, generator=g) * 50).bfloat16()):
        got = torch.empty(9)
        ops.mean_square(x.data_ptr(), x.stride(0), int(x.dtype is torch.bfloat16), 9, dim, got.data_ptr())
        assert torch.equal(got, x.float().pow(2).mean(-1))


def _case(q_lens: list[int], ctx: list[int], heads: int, kv_heads: int, head_dim: int, block_size: int,
          seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, torch.Tensor, torch.Tensor, torch.Tensor]:
    rng = np.random.default_rng(seed)
    ql = np.asarray(q_lens, dtype=np.int64)
    cl = np.asarray(ctx, dtype=np.int64)
    width = int(-(-cl.max() // block_size))
    num_blocks = len(ql) * width + 7
    tables = rng.permutation(num_blocks)[: len(ql) * width].reshape(len(ql), width).astype(np.int64)
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    v = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    # Queries as a strided view (the engine passes a slice of the fused qkv projection).
    wide = torch.randn(int(ql.sum()), heads + 2 * kv_heads, head_dim, generator=g)
    return ql, cl, tables, wide[:, :heads], k, v


CASES = {
    "decode batch": ([1] * 9, [1, 2, 15, 16, 17, 33, 100, 257, 300], 8, 4, 32, 16),
    "fresh prefills": ([1, 7, 16, 40], [1, 7, 16, 40], 8, 4, 32, 16),
    "chunked prefill on a cached prefix": ([5, 24], [37, 300], 4, 4, 64, 16),
    "mixed decode and prefill": ([1, 9, 1, 30, 1], [64, 9, 5, 70, 513], 8, 2, 32, 16),
    "multi-query attention": ([1, 12], [40, 12], 8, 1, 128, 16),
    "generic head size": ([1, 5, 3], [20, 5, 66], 6, 3, 48, 16),
    "block size 1": ([1, 4], [10, 30], 4, 2, 32, 1),
    "odd block size": ([3, 1], [50, 23], 4, 2, 64, 5),
    "long context (several score chunks)": ([1, 20], [1000, 600], 4, 2, 32, 16),
}


@pytest.mark.parametrize("window", [None, 4, 64], ids=["full", "window4", "window64"])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_kernel_matches_torch_path(case: str, window: int | None) -> None:
    if paged_attention_kernel() is None:
        pytest.skip("native kernel unavailable")
    q_lens, ctx, heads, kv_heads, head_dim, bs = CASES[case]
    ql, cl, tables, q, k, v = _case(q_lens, ctx, heads, kv_heads, head_dim, bs, seed=len(case))
    ref_meta = build_metadata(ql, cl, tables, bs, window, CPU)
    nat_meta = build_metadata(ql, cl, tables, bs, window, CPU, native=True)
    assert nat_meta.native is not None and not nat_meta.groups
    scale = head_dim**-0.5
    ref = paged_attention(q, k, v, ref_meta, scale)
    out = paged_attention(q, k, v, nat_meta, scale)
    assert out.shape == ref.shape == (int(ql.sum()), heads * head_dim)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_matches_index_copy(dtype: torch.dtype) -> None:
    if paged_attention_kernel() is None:
        pytest.skip("native kernel unavailable")
    ql, cl, tables, _, k0, v0 = _case([1, 9, 30], [20, 9, 70], 8, 4, 32, 16, seed=5)
    qkv = torch.randn(int(ql.sum()), 16, 32).to(dtype)
    k, v = qkv[:, 8:12], qkv[:, 12:16]  # strided token rows, as the engine passes them
    caches = []
    for native in (False, True):
        kc, vc = k0.to(dtype).clone(), v0.to(dtype).clone()
        write_kv(kc, vc, k, v, build_metadata(ql, cl, tables, 16, None, CPU, native=native))
        caches.append((kc, vc))
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    assert not torch.equal(caches[0][0], k0.to(dtype))  # something was written


@pytest.mark.parametrize("case", ["decode batch", "mixed decode and prefill", "generic head size"])
def test_kernel_bf16_matches_fp32_math(case: str) -> None:
    if paged_attention_kernel() is None:
        pytest.skip("native kernel unavailable")
    q_lens, ctx, heads, kv_heads, head_dim, bs = CASES[case]
    ql, cl, tables, q, k, v = _case(q_lens, ctx, heads, kv_heads, head_dim, bs, seed=7)
    qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
    scale = head_dim**-0.5
    # Reference: the same bf16 inputs, computed in fp32 by the torch path, rounded once at the end.
    ref = paged_attention(qb.float(), kb.float(), vb.float(), build_metadata(ql, cl, tables, bs, None, CPU), scale)
    out = paged_attention(qb, kb, vb, build_metadata(ql, cl, tables, bs, None, CPU, native=True), scale)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref.bfloat16(), rtol=1.6e-2, atol=1e-2)


def test_unsupported_shapes_stay_on_torch() -> None:
    from engine.attention import native_attention_supported

    assert not native_attention_supported(8, 4, 32, torch.float16, CPU)
    assert not native_attention_supported(34, 2, 32, torch.float32, CPU)  # 17 query heads per KV head
    assert not native_attention_supported(8, 4, 512, torch.float32, CPU)
    assert not native_attention_supported(8, 4, 32, torch.float32, torch.device("cuda"))


def test_fallback_when_the_compiler_fails(tmp_path: Path) -> None:
    """A host whose compiler fails gets no kernel and a warning, and the engine keeps working on the torch path."""
    script = (
        "import logging, torch\n"
        "logging.basicConfig(level=logging.WARNING)\n"
        "from engine.kernels import paged_attention_kernel\n"
        "from engine.attention import native_attention_supported\n"
        "assert paged_attention_kernel() is None\n"
        "assert not native_attention_supported(8, 4, 32, torch.float32, torch.device('cpu'))\n"
        "print('fallback ok')\n"
    )
    env = {**os.environ, "CC": "/bin/false", "TANDEM_KERNEL_CACHE": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stderr
    assert "fallback ok" in proc.stdout
    assert "could not build the native paged_attention kernel" in proc.stderr


def test_build_all_fills_the_cache_without_torch(tmp_path: Path) -> None:
    """``tandem up`` compiles the kernels beside ``ray.init`` in a process that never imports torch."""
    if not enabled():
        pytest.skip("TANDEM_NATIVE_KERNELS=0")
    script = "import sys\nfrom engine.kernels import build_all\nbuild_all()\nprint('torch' in sys.modules)\n"
    proc = subprocess.run([sys.executable, "-c", script], env={**os.environ, "TANDEM_KERNEL_CACHE": str(tmp_path)},
                          capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"
    assert sorted(p.name.split("-")[0] for p in tmp_path.glob("*.so")) == ["block_hash", "layer_ops", "paged_attention"]


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3_moe"])
def test_torch_path_parity_with_transformers(arch: str, checkpoint: Callable[[str], Path],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy parity with transformers with every native kernel off: a mixed-length batch, chunked prefill forced small,
    and a cache small enough to preempt (Mistral's prompts are longer than its 64-token sliding window)."""
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(model_runner, "native_attention_supported", lambda *a: False)
    _no_layer_ops(monkeypatch)
    path = checkpoint(arch)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rng = np.random.default_rng(3)
    vocab = hf.config.vocab_size
    prompts = [rng.integers(0, vocab - 8, size=n).tolist() for n in (1, 17, 80, 150)]
    llm = LLM(str(path), max_num_batched_tokens=48, num_kv_blocks=16, block_size=16)
    assert not llm.engine.runner._native
    preempted: list[str] = []
    orig = llm.engine.scheduler._preempt

    def preempt(req: Request) -> None:
        preempted.append(req.request_id)
        orig(req)

    monkeypatch.setattr(llm.engine.scheduler, "_preempt", preempt)
    outs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    assert preempted
    for prompt, out in zip(prompts, outs, strict=True):
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, min_new_tokens=10,
                              do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert out.token_ids == ref
    llm.engine.check_block_accounting()


def test_engine_uses_the_kernel_by_default(checkpoint: Callable[[str], Path]) -> None:
    if paged_attention_kernel() is None:
        pytest.skip("native kernel unavailable")
    llm = LLM(str(checkpoint("llama")), num_kv_blocks=64)
    assert llm.engine.runner._native
    bf16 = LLM(str(checkpoint("llama")), num_kv_blocks=64, dtype="bfloat16")
    assert bf16.engine.runner._native and not bf16.engine.runner._native_prefill
