"""vLLM (CPU build) peers of Tandem's feature benchmarks: structured outputs and n-gram speculation.

Run it with the vLLM virtualenv's python, from the repo root as a module (the spawned engine processes re-import it)::

    VENV/bin/python -m bench.vllm_cpu.run_features structured --model DIR --prompt-file p.json --schema-file s.json
    VENV/bin/python -m bench.vllm_cpu.run_features spec --model DIR --prompts-file w.json --output-len 64

It imports nothing from Tandem but :mod:`bench.vllm_cpu.run_offline` (the CPU environment, set before vLLM is
imported). The last stdout line is one JSON object; logs go to stderr.

``structured``: the per-step cost of vLLM's ``structured_outputs`` (a JSON schema) against no constraint, the workload
of ``tandem bench structured``: ``B`` copies of one prompt (token ids), sampled at temperature 1 with seed 0 (EOS
ignored when unconstrained; the schema cannot complete inside the measured steps), for each batch size. Requests go
straight to ``LLM.llm_engine`` (``add_request``, then ``step`` until every request has its first decode token), then
``--steps`` engine steps are timed one by one: the wall time between two ``step`` returns is one engine-core step
(scheduler, forward, grammar bitmask, sampling, and the frontend's output processing). The two sides alternate for
``--repeats`` rounds after one warm-up round per batch size; each round's median step is kept, and the report gives
the median over rounds, the rounds' range, and the per-round overhead (constrained / unconstrained - 1) as median and
range; and the same for the CPU time per step of all of vLLM's processes (frontend, engine core, worker: user + system,
psutil), which the host's load moves far less than the wall time. The grammar is compiled before timing (one
request with the schema), as a server does on its first request.
``--backend`` is vLLM's ``structured_outputs_config.backend`` (``auto`` picks xgrammar for JSON schemas it supports;
``guidance`` is llguidance, Tandem's library).

``spec``: n-gram speculation (``speculative_config={"method": "ngram", ...}``, prompt lookup of 2 to 4 tokens as
Tandem's ``ngram`` proposer) against none, the workload of ``tandem bench spec``: for each named workload, its prompts
decoded one at a time (greedy, EOS ignored, ``--output-len`` tokens), tokens per second over the wall time (prefill
included). One engine at a time (without speculation, then with it; each shut down before the next starts),
``--repeats`` runs each per workload: not interleaved, so load that changes between the two halves moves the ratio.
Acceptance comes from vLLM's own ``spec_decode`` counters over the timed runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench.vllm_cpu.run_offline import cpu_environment

BLOCK = 128  # the CPU backend's default block size; max_model_len is rounded up to it


def _spread(values: list[float], scale: float = 1e3, digits: int = 3) -> dict[str, Any]:
    if not values:
        return {"median": None, "min": None, "max": None, "runs": []}
    return {"median": round(statistics.median(values) * scale, digits),
            "min": round(min(values) * scale, digits), "max": round(max(values) * scale, digits),
            "runs": [round(v * scale, digits) for v in values]}


def _tree_cpu_s() -> float:
    """User + system CPU seconds of this process and its descendants (vLLM's engine core and worker)."""
    import psutil

    me = psutil.Process()
    total = 0.0
    for proc in [me, *me.children(recursive=True)]:
        try:
            t = proc.cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system
    return total


def _llm(model: str, max_model_len: int, max_num_seqs: int, **extra: Any) -> Any:
    from vllm import LLM

    return LLM(model=model, tokenizer=model, dtype="float32", seed=0, max_model_len=max_model_len,
               max_num_seqs=max_num_seqs, enable_prefix_caching=False, max_num_batched_tokens=2048,
               tensor_parallel_size=1, **extra)


def _structured(a: argparse.Namespace) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import StructuredOutputsParams

    prompt: list[int] = [int(t) for t in json.loads(Path(a.prompt_file).read_text())]
    schema: dict[str, Any] = json.loads(Path(a.schema_file).read_text())
    batches = [int(b) for b in a.batch_sizes.split(",")]
    budget = a.steps + 16
    t0 = time.perf_counter()
    llm = _llm(a.model, -(-(len(prompt) + budget) // BLOCK) * BLOCK, max(batches), disable_log_stats=True,
               structured_outputs_config={"backend": a.backend})
    load_s = time.perf_counter() - t0
    engine = llm.llm_engine
    constraint = StructuredOutputsParams(json=schema)

    def sides() -> dict[str, Any]:  # fresh each time: LLM.generate sets its params' output kind to final-only
        return {"unconstrained": SamplingParams(temperature=1.0, seed=0, max_tokens=budget, ignore_eos=True),
                "json_schema": SamplingParams(temperature=1.0, seed=0, max_tokens=budget,
                                              structured_outputs=constraint)}

    llm.generate([TokensPrompt(prompt_token_ids=prompt)], sides()["json_schema"], use_tqdm=False)  # compile, cache
    serial = iter(range(1 << 30))

    def step_time(batch: int, params: Any, steps: int) -> tuple[float, float]:
        """Median wall time of one decode step, and the CPU time per step of all of vLLM's processes."""
        ids = [f"r{next(serial)}" for _ in range(batch)]
        for rid in ids:
            engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt), params)
        produced = dict.fromkeys(ids, 0)
        while min(produced.values()) < 2:  # prefill, then a first decode step for every request
            if not engine.has_unfinished_requests():
                raise RuntimeError(f"requests {ids} finished before their first decode step")
            for out in engine.step():
                produced[out.request_id] += 1
        times: list[float] = []
        cpu0 = _tree_cpu_s()
        last = time.perf_counter()
        while len(times) < steps:
            outs = engine.step()
            now = time.perf_counter()
            if len(outs) == batch:  # a decode step of the whole batch
                times.append(now - last)
            last = now
        cpu = (_tree_cpu_s() - cpu0) / len(times)
        engine.abort_request(ids)
        while engine.has_unfinished_requests():
            engine.step()
        return statistics.median(times), cpu

    rows = []
    for b in batches:
        rounds: dict[str, list[tuple[float, float]]] = {name: [] for name in sides()}
        for r in range(a.repeats + 1):  # round 0 warms up this batch size and is not counted
            for name, params in sides().items():
                t = step_time(b, params, a.steps if r else 4)
                if r:
                    rounds[name].append(t)
        c, u = rounds["json_schema"], rounds["unconstrained"]
        row: dict[str, Any] = {"batch": b, **{f"{n}_step_ms": _spread([w for w, _ in v]) for n, v in rounds.items()},
                               **{f"{n}_cpu_ms": _spread([x for _, x in v]) for n, v in rounds.items()},
                               "overhead_pct": _spread([x[0] / y[0] - 1 for x, y in zip(c, u, strict=True)], 100, 2),
                               # psutil counts CPU time in clock ticks (10 ms): a short round can read 0
                               "cpu_overhead_pct": _spread([x[1] / y[1] - 1 for x, y in zip(c, u, strict=True)
                                                            if y[1] > 0], 100, 2)}
        row["overhead_of_medians_pct"] = round((row["json_schema_step_ms"]["median"]
                                                / row["unconstrained_step_ms"]["median"] - 1) * 100, 2)
        rows.append(row)
    llm.llm_engine.engine_core.shutdown()
    return {"backend": a.backend, "steps": a.steps, "repeats": a.repeats, "load_s": round(load_s, 1), "rows": rows}


def _spec_counters(llm: Any) -> dict[str, float]:
    names = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "proposed",
             "vllm:spec_decode_num_accepted_tokens": "accepted"}
    out = dict.fromkeys(names.values(), 0.0)
    for m in llm.get_metrics():
        if m.name in names:
            out[names[m.name]] += float(getattr(m, "value", 0.0))
    return out


def _spec(a: argparse.Namespace) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    workloads: dict[str, list[list[int]]] = json.loads(Path(a.prompts_file).read_text())
    longest = max(len(p) for ps in workloads.values() for p in ps)
    max_len = -(-(longest + a.output_len) // BLOCK) * BLOCK

    def timed(llm: Any, prompts: list[list[int]], n: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True)
        start = time.perf_counter()
        for p in prompts:
            llm.generate([TokensPrompt(prompt_token_ids=p)], params, use_tqdm=False)
        return len(prompts) * n / (time.perf_counter() - start)

    # One engine at a time: each binds its worker's OpenMP threads to every core and its idle shm reader spins for a
    # second after each use, so two alive at once compete for the CPUs (as does any other vLLM process on the host).
    runs: dict[str, dict[str, list[float]]] = {"off": {}, "on": {}}
    counters: dict[str, dict[str, float]] = {}
    load_s = 0.0
    for side in ("off", "on"):
        extra: dict[str, Any] = {} if side == "off" else {"speculative_config": {
            "method": "ngram", "num_speculative_tokens": a.num_speculative_tokens,
            "prompt_lookup_min": a.prompt_lookup_min, "prompt_lookup_max": a.prompt_lookup_max}}
        t0 = time.perf_counter()
        llm = _llm(a.model, max_len, 1, disable_log_stats=False, **extra)
        load_s += time.perf_counter() - t0
        for name, prompts in workloads.items():
            timed(llm, prompts, 16)  # warm on every prompt
            before = _spec_counters(llm)
            runs[side][name] = [timed(llm, prompts, a.output_len) for _ in range(a.repeats)]
            after = _spec_counters(llm)
            if side == "on":
                counters[name] = {k: after[k] - before[k] for k in after}
        llm.llm_engine.engine_core.shutdown()
    results: dict[str, Any] = {}
    for name in workloads:
        c = counters[name]
        t_off, t_on = statistics.median(runs["off"][name]), statistics.median(runs["on"][name])
        results[name] = {"tokens_per_s_off": t_off, "tokens_per_s_on": t_on, "speedup": t_on / t_off,
                         "runs_off": runs["off"][name], "runs_on": runs["on"][name],
                         "proposed_tokens": c["proposed"],
                         "acceptance_rate": c["accepted"] / c["proposed"] if c["proposed"] else 0.0,
                         "mean_accepted_length": 1 + c["accepted"] / c["drafts"] if c["drafts"] else 0.0}
    return {"num_speculative_tokens": a.num_speculative_tokens, "prompt_lookup_min": a.prompt_lookup_min,
            "prompt_lookup_max": a.prompt_lookup_max, "output_len": a.output_len, "repeats": a.repeats,
            "load_s": round(load_s, 1), "results": results}


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    sub = parser.add_subparsers(dest="mode", required=True)
    st = sub.add_parser("structured")
    st.add_argument("--model", required=True)
    st.add_argument("--prompt-file", required=True, help="JSON list of token ids (one prompt)")
    st.add_argument("--schema-file", required=True, help="the JSON schema")
    st.add_argument("--batch-sizes", default="1,32")
    st.add_argument("--steps", type=int, default=32)
    st.add_argument("--repeats", type=int, default=5)
    st.add_argument("--backend", default="auto", help="structured_outputs_config.backend: auto|xgrammar|guidance|...")
    sp = sub.add_parser("spec")
    sp.add_argument("--model", required=True)
    sp.add_argument("--prompts-file", required=True, help='JSON {"workload": [[token ids], ...], ...}')
    sp.add_argument("--output-len", type=int, default=64)
    sp.add_argument("--repeats", type=int, default=3)
    sp.add_argument("--num-speculative-tokens", type=int, default=4)
    sp.add_argument("--prompt-lookup-min", type=int, default=2)
    sp.add_argument("--prompt-lookup-max", type=int, default=4)
    for p in (st, sp):
        p.add_argument("--kvcache-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE (default 1)")
    args = parser.parse_args(argv)
    for name in ("steps", "repeats", "output_len"):
        if getattr(args, name, 1) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    os.environ.update(cpu_environment(dict(os.environ), sys.prefix, kvcache_gib=args.kvcache_gib))
    import vllm

    load_before = [round(x, 2) for x in os.getloadavg()]
    report = _structured(args) if args.mode == "structured" else _spec(args)
    report.update({"engine": "vllm-cpu", "version": vllm.__version__, "mode": args.mode,
                   "load_average_before": load_before, "load_average_after": [round(x, 2) for x in os.getloadavg()],
                   "threads_bind": os.environ["VLLM_CPU_OMP_THREADS_BIND"]})
    sys.stderr.flush()
    sys.stdout.write("\n" + json.dumps(report) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
