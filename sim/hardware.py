"""Accelerator figures from the vendors' spec sheets, and a CPU measured in place as a stand-in "GPU".

Sources (NVIDIA data sheets, SXM form factor; dense figures, i.e. the sheets' "with sparsity" numbers halved):

- H100 SXM: BF16 Tensor Core 1,979 TFLOPS with sparsity -> 989 TFLOPS dense; GPU memory 80 GB HBM3 at 3.35 TB/s;
  NVLink 900 GB/s (bidirectional, so 450 GB/s each way). https://www.nvidia.com/en-us/data-center/h100/
- H200 SXM: BF16 Tensor Core 1,979 TFLOPS with sparsity -> 989 TFLOPS dense; 141 GB HBM3e at 4.8 TB/s; NVLink
  900 GB/s. https://www.nvidia.com/en-us/data-center/h200/

Between replicas (prefill to decode KV transfer) the default is one 400 Gb/s NDR InfiniBand/ConnectX-7 NIC per GPU,
as in NVIDIA's DGX H100/H200 systems (8 x 400 Gb/s compute fabric): 50 GB/s per GPU, times the replica's TP degree.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class GpuSpec:
    name: str
    peak_flops: float  # dense BF16 FLOP/s per GPU
    mem_bandwidth: float  # bytes/s per GPU
    mem_bytes: float  # per GPU
    nvlink_bandwidth: float  # bytes/s per GPU, one direction
    nic_bandwidth: float  # bytes/s per GPU to other replicas
    allreduce_latency_s: float = 8e-6  # fixed cost of one NCCL all-reduce of a small message inside a node
    transfer_latency_s: float = 50e-6  # fixed cost of one KV transfer between replicas (RDMA setup, completion)

    def __post_init__(self) -> None:
        for name in ("peak_flops", "mem_bandwidth", "mem_bytes", "nvlink_bandwidth", "nic_bandwidth"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{self.name}: {name} must be > 0")
        if self.allreduce_latency_s < 0 or self.transfer_latency_s < 0:
            raise ValueError(f"{self.name}: latencies must be >= 0")


@dataclass(slots=True, frozen=True)
class Ceilings:
    """A CPU measured as the calibration's stand-in "GPU" (``bench/ceilings.py`` measures it, at the thread count a
    worker runs with): its two rates, and the engine's own one-token decode step and one-prompt prefill step, from
    which the roofline's missing per-step and per-token costs are taken (``calibration.engine_costs``)."""

    gemm_flops: float  # FLOP/s
    read_bandwidth: float  # bytes/s
    decode_step_s: float = 0.0  # one engine step decoding one token of a single sequence (0: not measured)
    decode_context: int = 0  # that sequence's tokens already in the KV cache when the step ran
    threads: int = 0  # torch intra-op threads of the measurement (0: not recorded)
    prefill_step_s: float = 0.0  # one engine step computing a decode_context-token prompt (0: not measured)

    def __post_init__(self) -> None:
        if not (self.gemm_flops > 0 and self.read_bandwidth > 0):
            raise ValueError(f"ceilings must be > 0, got {self.gemm_flops}, {self.read_bandwidth}")
        if self.decode_step_s < 0 or self.decode_context < 0 or self.threads < 0 or self.prefill_step_s < 0:
            raise ValueError("decode_step_s, decode_context, threads and prefill_step_s must be >= 0")


H100 = GpuSpec("h100", peak_flops=989e12, mem_bandwidth=3.35e12, mem_bytes=80e9, nvlink_bandwidth=450e9,
               nic_bandwidth=50e9)
H200 = GpuSpec("h200", peak_flops=989e12, mem_bandwidth=4.8e12, mem_bytes=141e9, nvlink_bandwidth=450e9,
               nic_bandwidth=50e9)
GPUS = {"h100": H100, "h200": H200}


def gpu(name: str) -> GpuSpec:
    try:
        return GPUS[name]
    except KeyError:
        raise ValueError(f"unknown gpu {name!r}; known: {sorted(GPUS)}") from None
