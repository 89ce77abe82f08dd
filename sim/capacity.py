"""Each tier's capacity at the SLO, from the roofline: what the planner is told one replica sustains.

Dynamo's throughput planner reads these two figures from a profiling sweep; here the same sweep runs on the step
model:

- prefill: prompt tokens per second of full chunks (``max_num_batched_tokens``) at the trace's mean prompt length,
  provided one mean prompt alone prefills within the TTFT SLO (else the tier cannot meet the SLO at any load: 0);
- decode: the largest batch whose step, at the mean context, stays within the ITL SLO and whose KV fits the cache
  (and ``max_num_seqs``), in tokens per second.
"""

from __future__ import annotations

from dataclasses import dataclass

from sim.roofline import StepModel


@dataclass(slots=True, frozen=True)
class Capacity:
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    decode_batch: int


def capacity(step: StepModel, mean_input: float, mean_output: float, ttft_slo_s: float, itl_slo_s: float,
             max_num_batched_tokens: int, max_num_seqs: int, block_size: int) -> Capacity:
    chunk = max_num_batched_tokens
    ctx = mean_input / 2  # a chunk's mean position inside its prompt
    t_chunk = step.step_time(chunk, chunk * (ctx + (chunk + 1) / 2), int(chunk + ctx))
    n_in = max(int(mean_input), 1)
    alone = step.step_time(n_in, n_in * (n_in + 1) / 2, n_in)
    prefill = chunk / t_chunk if alone <= ttft_slo_s else 0.0
    context = int(mean_input + mean_output / 2)
    kv_room = step.kv_blocks(block_size) // max(-(-context // block_size), 1)
    best_b, best_rate = 0, 0.0
    for b in range(1, min(max_num_seqs, kv_room) + 1):
        t = step.step_time(b, b * (context + 1), b * (context + 1))
        if t > itl_slo_s:
            break
        best_b, best_rate = b, b / t
    return Capacity(prefill, best_rate, best_b)
