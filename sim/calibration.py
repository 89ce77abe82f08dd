"""This CPU as the simulator's "GPU": the calibration that can fail.

The step model's inputs are this CPU measured as one worker sees it, taken as input (``bench/ceilings.py`` measures
them at the worker's thread count, as ``tandem bench`` measures its ceilings; the simulator runs no forward pass
itself): the best GEMM rate of the engine's own ``linear`` at the workload's shapes, a streaming read rate, and the
engine's own one-token decode step and one-prompt prefill step. The two rates are the roofline's peaks, with MFU =
MBU = 1 because they are already achieved rates. What the roofline leaves out is taken from the two engine steps, less
what the roofline charges for each: a fixed per-step cost (Python over the layers, sampling, the scheduler) and a
per-token cost (norms, activations, RoPE, the attention kernel's own work), the two unknowns of those two equations,
charged to every simulated step.
TP = 1, and the KV link between the tiers a loopback copy at the read rate plus a fixed per-transfer latency (the
TCP backend's round trip). Nothing is taken from the run the prediction is compared with: both steps are timed on
the engine alone, without Ray, gRPC, the router, the KV transfer or HTTP.
"""

from __future__ import annotations

from engine.model_config import ModelConfig
from operators.planner.config import Role
from sim.cluster import Cluster
from sim.config import SimConfig, TierSpec
from sim.hardware import Ceilings, GpuSpec
from sim.roofline import ModelShape, StepModel
from sim.trace import TraceRequest

TRANSFER_LATENCY_S = 1e-3  # one KV handoff over the TCP backend on loopback: connect-free, one round trip or two


def cpu_gpu(c: Ceilings, weight_bytes: float, kv_bytes: float = 2e9) -> GpuSpec:
    return GpuSpec("cpu", peak_flops=c.gemm_flops, mem_bandwidth=c.read_bandwidth, mem_bytes=(weight_bytes + kv_bytes)
                   / 0.9, nvlink_bandwidth=c.read_bandwidth, nic_bandwidth=c.read_bandwidth,
                   allreduce_latency_s=0.0, transfer_latency_s=TRANSFER_LATENCY_S)


def engine_costs(shape: ModelShape, c: Ceilings) -> tuple[float, float]:
    """``(per-step, per-token)`` seconds the roofline leaves out, solved from the engine's two measured steps:
    decode ``D = R(1) + s + u`` and prefill of ``L`` tokens ``P = R(L) + s + L u``, where ``R`` is the roofline's
    time. Each is >= 0; with no prefill step measured, ``u = 0``; with nothing measured, both are 0."""
    if not c.decode_step_s:
        return 0.0, 0.0
    roofline = StepModel(shape, cpu_gpu(c, shape.weight_bytes), tp=1, mfu=1.0, mbu=1.0, startup_s=0.0)
    n, length = c.decode_context + 1, c.decode_context
    decode_extra = max(c.decode_step_s - roofline.step_time(1, n, n), 0.0)
    if not c.prefill_step_s or length < 2:
        return decode_extra, 0.0
    prefill_extra = max(c.prefill_step_s - roofline.step_time(length, length * (length + 1) / 2, length), 0.0)
    per_token = max((prefill_extra - decode_extra) / (length - 1), 0.0)
    return max(decode_extra - per_token, 0.0), per_token


def predict(cfg: ModelConfig, c: Ceilings, trace: list[TraceRequest], dtype_bytes: int = 4,
            block_size: int = 16) -> tuple[list[float], list[float]]:
    """Each request's TTFT and mean inter-token latency on one prefill and one decode replica of this "GPU"."""
    shape = ModelShape.from_config(cfg, "calibration", dtype_bytes)
    per_step, per_token = engine_costs(shape, c)
    step = StepModel(shape, cpu_gpu(c, shape.weight_bytes), tp=1, mfu=1.0, mbu=1.0, overhead_s=per_step,
                     token_overhead_s=per_token, startup_s=0.0)
    sim = SimConfig(step, (TierSpec("prefill", Role.PREFILL, 1), TierSpec("decode", Role.DECODE, 1)),
                    model_name="calibration", block_size=block_size, max_model_len=cfg.max_position_embeddings)
    cluster = Cluster(sim, trace)
    cluster.run()
    return list(cluster.books.ttft), list(cluster.books.tpot)
