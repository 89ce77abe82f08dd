"""``python3 -m bench.structured_advance``: the matcher work of one constrained decode step at batch B, without the
model, each way the engine has done it: llguidance's Python API (a ``consume_token`` per row, then an
``unsafe_compute_mask_ptr`` per row after the forward pass: what the engine ran before the C API), and the C API the
engine runs now (:mod:`engine.structured.native`: the same advance, then the masks filled inline in one call, or on
the native masks thread while the forward pass runs, the engine's thread paying only the start and the finish).

Workload: ``B`` matchers of the structured bench's JSON schema (:data:`bench.structured.SCHEMA`), each replaying its
own random walk through the grammar (tokens drawn uniformly from the allowed ones, seeded), ``--steps`` steps, the
ways interleaved round by round, each way's matchers copied from a template warmed by the previous round (as
``GrammarCompiler.recycle`` keeps it in the engine). A step's "forward pass" is a multiply over a 32 MiB tensor on
the calling thread, untimed. Reported per way: median wall and thread CPU time of the timed part per step, over
``--rounds`` rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

import llguidance as llg
import numpy as np
import torch

from bench.structured import SCHEMA
from engine.structured.compiler import GrammarCompiler
from engine.structured.native import MaskFiller
from engine.structured.spec import StructuredOutput
from engine.tokenizer import Tokenizer

WAYS = ("python API: row advance, row fill after", "C API: row advance, fill after in one call",
        "C API: row advance, fill on the masks thread")


def _walks(compiler: GrammarCompiler, spec: StructuredOutput, batch: int, steps: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    words = (compiler.vocab_size + 31) // 32
    mask = np.empty(words, dtype=np.int32)
    walks = []
    for _ in range(batch):
        m, walk = compiler.matcher(spec), []
        for _ in range(steps):
            assert m.compute_mask_into(mask.ctypes.data, words * 4)
            allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")[:compiler.vocab_size])
            token = int(allowed[rng.randrange(len(allowed))])
            assert m.consume_token(token)
            walk.append(token)
        walks.append(walk)
    return walks


def run_advance_bench(model: Path, batch: int, steps: int, rounds: int) -> dict[str, Any]:
    if batch < 1 or steps < 1 or rounds < 1:
        raise ValueError(f"batch, steps and rounds must be >= 1, got {batch}, {steps}, {rounds}")
    load_before = [round(x, 2) for x in os.getloadavg()]
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    compiler = GrammarCompiler(Tokenizer(model), vocab, None)
    spec = StructuredOutput("json_schema", json.dumps(SCHEMA), strict=True)
    walks = _walks(compiler, spec, batch, steps, seed=0)
    py_template = llg.LLMatcher(compiler.tokenizer, compiler.grammar(spec), log_level=0)
    filler = MaskFiller()
    eos = compiler.eos_token_id
    words = (vocab + 31) // 32
    bitmask = torch.empty(batch, words, dtype=torch.int32)
    ptr, row_bytes = bitmask.data_ptr(), words * 4
    forward = torch.ones(8 << 20)  # 32 MiB: evicts the caches as a forward pass would
    wall: dict[str, list[float]] = {w: [] for w in WAYS}
    cpu: dict[str, list[float]] = {w: [] for w in WAYS}
    for r in range(rounds):
        for k in range(len(WAYS)):
            way = WAYS[(r + k) % len(WAYS)]
            if way == WAYS[0]:
                ms: list[Any] = [py_template.deep_copy() for _ in range(batch)]
            else:
                ms = [compiler.matcher(spec) for _ in range(batch)]
            for step in range(steps):
                forward.mul_(1.0)
                t0, c0 = time.perf_counter(), time.thread_time()
                for m, walk in zip(ms, walks, strict=True):
                    m.consume_token(walk[step])
                    m.is_stopped()
                if way == WAYS[2] and filler.threaded:
                    filler.start(ms, ptr, words, eos)
                t1, c1 = time.perf_counter(), time.thread_time()
                forward.mul_(1.0)
                t2, c2 = time.perf_counter(), time.thread_time()
                if way == WAYS[0]:
                    for j, m in enumerate(ms):
                        m.unsafe_compute_mask_ptr(ptr + j * row_bytes, row_bytes)
                elif way == WAYS[1] or not filler.threaded:
                    filler.fill(ms, ptr, words, eos)
                else:
                    filler.finish()
                wall[way].append((t1 - t0) + (time.perf_counter() - t2))
                cpu[way].append((c1 - c0) + (time.thread_time() - c2))
            if way != WAYS[0]:
                compiler.recycle(spec, ms[0])
    filler.close()
    return {"model": str(model), "batch": batch, "steps": steps, "rounds": rounds, "cpus": os.cpu_count(),
            "load_average": load_before, "load_average_after": [round(x, 2) for x in os.getloadavg()],
            "ways": {w: {"wall_us": round(statistics.median(wall[w]) * 1e6, 1),
                         "cpu_us": round(statistics.median(cpu[w]) * 1e6, 1)} for w in WAYS}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="~/.cache/tandem/tiny-llama", help="HF checkpoint dir")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    report = run_advance_bench(Path(args.model).expanduser(), args.batch, args.steps, args.rounds)
    if args.json:
        print(json.dumps(report))
        return
    print(f"matcher advance + mask fill per step, batch {report['batch']}, {report['steps']} steps x "
          f"{report['rounds']} rounds, load average {report['load_average'][0]} -> "
          f"{report['load_average_after'][0]} on {report['cpus']} CPUs: median wall us (thread CPU us)")
    for way, v in report["ways"].items():
        print(f"  {way:<34} {v['wall_us']:>9.1f} ({v['cpu_us']:.1f})")


if __name__ == "__main__":
    main()
