"""This CPU as the simulator's "GPU": the calibration that can fail.

The step model's inputs are this CPU measured as one worker sees it, taken as input (``bench/ceilings.py`` measures
them at the worker's thread count, as ``tandem bench`` measures its ceilings; the simulator runs no forward pass
itself): the best GEMM rate of the engine's own ``linear`` at the workload's shapes, a streaming read rate, and the
engine's own one-token decode step. The two rates are the roofline's peaks, with MFU = MBU = 1 because they are
already achieved rates; the decode step, less what the roofline charges for that same step, is the fixed per-step
cost the roofline leaves out (Python over the layers, norms, sampling, the scheduler), charged to every step.
TP = 1, and the KV link between the tiers a loopback copy at the read rate plus a fixed per-transfer latency (the
TCP backend's round trip). Nothing is taken from the run the prediction is compared with: the decode step is timed
on the engine alone, without Ray, gRPC, the router or HTTP, and the prefill side is the roofline's alone.
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


def step_overhead_s(shape: ModelShape, c: Ceilings) -> float:
    """The engine's measured one-token decode step less the roofline's time for that step (>= 0; 0 unmeasured)."""
    if not c.decode_step_s:
        return 0.0
    roofline = StepModel(shape, cpu_gpu(c, shape.weight_bytes), tp=1, mfu=1.0, mbu=1.0, startup_s=0.0)
    n = c.decode_context + 1
    return max(c.decode_step_s - roofline.step_time(1, n, n), 0.0)


def predict(cfg: ModelConfig, c: Ceilings, trace: list[TraceRequest], dtype_bytes: int = 4,
            block_size: int = 16) -> tuple[list[float], list[float]]:
    """Each request's TTFT and mean inter-token latency on one prefill and one decode replica of this "GPU"."""
    shape = ModelShape.from_config(cfg, "calibration", dtype_bytes)
    step = StepModel(shape, cpu_gpu(c, shape.weight_bytes), tp=1, mfu=1.0, mbu=1.0,
                     overhead_s=step_overhead_s(shape, c), startup_s=0.0)
    sim = SimConfig(step, (TierSpec("prefill", Role.PREFILL, 1), TierSpec("decode", Role.DECODE, 1)),
                    model_name="calibration", block_size=block_size, max_model_len=cfg.max_position_embeddings)
    cluster = Cluster(sim, trace)
    cluster.run()
    return list(cluster.books.ttft), list(cluster.books.tpot)
