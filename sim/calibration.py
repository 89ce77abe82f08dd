"""This CPU as the simulator's "GPU": the calibration that can fail.

The step model's two rates are set to what ``bench/ceilings.py`` measures here (the best GEMM rate of the engine's
own ``linear`` at the workload's shapes, and a streaming read rate), with MFU = MBU = 1 because those are already
achieved rates, TP = 1, and the KV link between the tiers a loopback copy at the same read rate plus a fixed
per-transfer latency (the TCP backend's round trip). Nothing is fitted to the run it is compared with: if the
roofline misses what the real engine does per step (Python overhead, attention, sampling), the prediction is off
and the test that compares it with a real ``tandem up`` run fails.
"""

from __future__ import annotations

from dataclasses import dataclass

from bench.ceilings import Workload, gemm_peak_gflops, read_bandwidth_gbps
from engine.model_config import ModelConfig
from operators.planner.config import Role
from sim.cluster import Cluster
from sim.config import SimConfig, TierSpec
from sim.hardware import GpuSpec
from sim.roofline import ModelShape, StepModel
from sim.trace import TraceRequest

TRANSFER_LATENCY_S = 1e-3  # one KV handoff over the TCP backend on loopback: connect-free, one round trip or two


@dataclass(slots=True, frozen=True)
class Ceilings:
    gemm_flops: float  # FLOP/s
    read_bandwidth: float  # bytes/s


def measure_ceilings(cfg: ModelConfig, prompt_len: int, output_len: int, dtype: str = "float32") -> Ceilings:
    gemm = gemm_peak_gflops(cfg, Workload(1, prompt_len, output_len), dtype, square=1024)
    return Ceilings(max(gemm.values()) * 1e9, read_bandwidth_gbps(dtype) * 1e9)


def cpu_gpu(c: Ceilings, weight_bytes: float, kv_bytes: float = 2e9) -> GpuSpec:
    return GpuSpec("cpu", peak_flops=c.gemm_flops, mem_bandwidth=c.read_bandwidth, mem_bytes=(weight_bytes + kv_bytes)
                   / 0.9, nvlink_bandwidth=c.read_bandwidth, nic_bandwidth=c.read_bandwidth,
                   allreduce_latency_s=0.0, transfer_latency_s=TRANSFER_LATENCY_S)


def predict(cfg: ModelConfig, c: Ceilings, trace: list[TraceRequest], dtype_bytes: int = 4,
            block_size: int = 16) -> tuple[list[float], list[float]]:
    """Each request's TTFT and mean inter-token latency on one prefill and one decode replica of this "GPU"."""
    shape = ModelShape.from_config(cfg, "calibration", dtype_bytes)
    step = StepModel(shape, cpu_gpu(c, shape.weight_bytes), tp=1, mfu=1.0, mbu=1.0, startup_s=0.0)
    sim = SimConfig(step, (TierSpec("prefill", Role.PREFILL, 1), TierSpec("decode", Role.DECODE, 1)),
                    model_name="calibration", block_size=block_size, max_model_len=cfg.max_position_embeddings)
    cluster = Cluster(sim, trace)
    cluster.run()
    return list(cluster.books.ttft), list(cluster.books.tpot)
