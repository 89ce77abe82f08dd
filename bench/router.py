"""Router micro-benchmark: prefix matches/s, routing decisions/s with latency, and the index's memory.

Workload, per worker count::

    fill    cached_blocks (hash, worker) entries as prefix trees: 32 system prompts (4-24 blocks, each cached on
            about a quarter of the workers) and per-worker conversations (a system prompt or none, then a unique
            tail of 16-96 blocks), published as event batches with sequence numbers, as workers do. Bulk hashes
            are random 64-bit ints (the index only sees ints); 256 conversations are real token ids hashed with
            ``engine.block_hash`` so that the decision path can be timed with hashing included.
    match   requests of ``request_blocks`` blocks: a cached conversation cut at a random depth, then new blocks;
            one in ten is cold (misses at block 0). 4096 distinct requests over the whole index (memory-bound: each
            lookup is a few DRAM misses), and a 64-request working set that stays in CPU cache. ``match`` returns a
            dict per hit worker; ``match_depths`` (what a decision over many candidates uses) an array per slot.
    decide  Selector.select_hashed (hashes precomputed) and Selector.select (token ids hashed), scoring every
            worker, with 64 decisions in flight (the oldest released as each new one is booked).
    churn   ``churn_events`` more stored blocks into the full index, so eviction runs; RSS must stay flat
            (compare ``before_churn`` with ``after_churn``; ``after_fill`` excludes the benchmark's own request lists).

Every loop is bounded by a count and by ``seconds``. Run: ``python -m bench.router [--workers 8,64] [--seconds 1]``.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import psutil

from engine.block_hash import extra_keys_for, hash_blocks
from router.cost import CostConfig
from router.kv_index import KVIndex
from router.load import LoadTracker
from router.selector import Selector

_BLOCK_SIZE = 16
_SYSTEM_PROMPTS = 32
_TOKEN_TEMPLATES = 256
_SAMPLE = 4096
_MAX_ITERS = 5_000_000


def _rss_mb() -> float:
    return psutil.Process().memory_info().rss / 2**20


@dataclass(slots=True)
class _Cluster:
    """Generates the workers' event streams and remembers a sample of what they cached."""

    workers: list[str]
    rng: random.Random
    systems: list[list[int]] = field(default_factory=list)
    holders: list[list[int]] = field(default_factory=list)  # per worker index: system prompts it holds
    seq: dict[str, int] = field(default_factory=dict)
    sample: list[tuple[list[int], int]] = field(default_factory=list)  # (hashes, cached depth)

    def __post_init__(self) -> None:
        share = max(1, len(self.workers) // 4)
        self.systems = [[self.rng.getrandbits(64) for _ in range(self.rng.randint(4, 24))]
                        for _ in range(_SYSTEM_PROMPTS)]
        holders: dict[str, list[int]] = {w: [] for w in self.workers}
        for s in range(_SYSTEM_PROMPTS):
            for w in self.rng.sample(self.workers, share):
                holders[w].append(s)
        self.holders = [holders[w] for w in self.workers]
        self.seq = dict.fromkeys(self.workers, -1)

    def conversation(self) -> tuple[str, list[int]]:
        i = self.rng.randrange(len(self.workers))
        systems = self.holders[i]
        prefix = self.systems[self.rng.choice(systems)] if systems and self.rng.random() < 0.8 else []
        tail = [self.rng.getrandbits(64) for _ in range(self.rng.randint(16, 96))]
        return self.workers[i], prefix + tail

    def publish(self, index: KVIndex, worker: str, hashes: list[int]) -> None:
        self.seq[worker] += 1
        index.apply(worker, self.seq[worker], hashes, b"\x01" * len(hashes))

    def fill(self, index: KVIndex, entries: int, deadline: float, grow: bool = True) -> int:
        """Publish conversations until the index grew by ``entries`` (``grow``) or ``entries`` blocks were published,
        or the deadline passed. Returns the number of blocks published."""
        target = len(index) + entries
        published = 0
        while (len(index) < target if grow else published < entries) and time.perf_counter() < deadline:
            worker, hashes = self.conversation()
            self.publish(index, worker, hashes)
            published += len(hashes)
            if len(self.sample) < _SAMPLE:
                self.sample.append((hashes, len(hashes)))
            elif self.rng.random() < 0.05:
                self.sample[self.rng.randrange(_SAMPLE)] = (hashes, len(hashes))
        return published


def _requests(cluster: _Cluster, request_blocks: int, n: int) -> list[list[int]]:
    rng = cluster.rng
    out = []
    for _ in range(n):
        if rng.random() < 0.1:
            out.append([rng.getrandbits(64) for _ in range(request_blocks)])
            continue
        hashes, depth = rng.choice(cluster.sample)
        cut = min(rng.randint(1, depth), request_blocks)
        out.append(hashes[:cut] + [rng.getrandbits(64) for _ in range(request_blocks - cut)])
    return out


def _timed(fn: Callable[[int], object], seconds: float, latencies: list[int] | None = None) -> tuple[int, float]:
    """Call ``fn(i)`` for i = 0, 1, ... until ``seconds`` or ``_MAX_ITERS``. Returns (calls, elapsed)."""
    clock = time.perf_counter
    ns = time.perf_counter_ns
    start = clock()
    deadline = start + seconds
    i = 0
    while i < _MAX_ITERS:
        if latencies is None:
            fn(i)
        else:
            t0 = ns()
            fn(i)
            latencies.append(ns() - t0)
        i += 1
        if not i & 255 and clock() >= deadline:
            break
    return i, clock() - start


def _percentile(sorted_ns: Sequence[int], q: float) -> float:
    return sorted_ns[min(len(sorted_ns) - 1, int(q * len(sorted_ns)))] / 1000.0 if sorted_ns else 0.0


def _decisions(selector: Selector, workers: list[str], call: Callable[[int], object], seconds: float
               ) -> dict[str, float]:
    inflight: deque = deque()
    latencies: list[int] = []

    def one(i: int) -> None:
        inflight.append(call(i))
        if len(inflight) > 64:
            selector.release(inflight.popleft())

    calls, elapsed = _timed(one, seconds, latencies)
    while inflight:
        selector.release(inflight.popleft())
    latencies.sort()
    return {"per_s": round(calls / elapsed), "p50_us": round(_percentile(latencies, 0.5), 1),
            "p99_us": round(_percentile(latencies, 0.99), 1), "calls": calls}


def _bench_one(num_workers: int, cached_blocks: int, request_blocks: int, seconds: float, churn_events: int,
               seed: int) -> dict[str, object]:
    gc.collect()
    rng = random.Random(seed)
    workers = [f"worker-{i}" for i in range(num_workers)]
    cluster = _Cluster(workers, rng)
    keys = extra_keys_for(model="bench")
    rss_before = _rss_mb()
    index = KVIndex(cached_blocks)

    templates: list[list[int]] = []  # real token ids, so select() hashes for real
    for t in range(_TOKEN_TEMPLATES):
        tokens = [rng.randrange(32_000) for _ in range(request_blocks * _BLOCK_SIZE)]
        hashes = hash_blocks(tokens, _BLOCK_SIZE, keys)
        cluster.publish(index, workers[t % num_workers], hashes[: rng.randint(1, request_blocks)])
        templates.append(tokens)

    t0 = time.perf_counter()
    cluster.fill(index, cached_blocks - len(index), deadline=t0 + 120.0)
    fill_s = time.perf_counter() - t0
    gc.collect()
    rss_filled = _rss_mb()

    requests = _requests(cluster, request_blocks, 4096)
    mask = len(requests) - 1
    match = index.match
    calls, elapsed = _timed(lambda i: match(requests[i & mask]), seconds)
    hot = requests[:64]  # a working set that stays in CPU cache, as in a microbenchmark
    hot_calls, hot_elapsed = _timed(lambda i: match(hot[i & 63]), seconds)
    match_depths = index.match_depths  # what the selector calls from VECTOR_MIN candidates on
    depth_calls, depth_elapsed = _timed(lambda i: match_depths(requests[i & mask]), seconds)
    hits = [index.match(r) for r in requests[:512]]
    avg_hit_workers = sum(map(len, hits)) / len(hits)
    avg_best = sum(max(h.values(), default=0) for h in hits) / len(hits)

    selector = Selector(index, LoadTracker(), CostConfig(block_size=_BLOCK_SIZE, temperature=0.1), _BLOCK_SIZE,
                        keys, seed=seed)
    n_tokens = request_blocks * _BLOCK_SIZE
    hashed = _decisions(selector, workers, lambda i: selector.select_hashed(requests[i & mask], n_tokens, workers),
                        seconds)
    tmask = len(templates) - 1
    tokenized = _decisions(selector, workers, lambda i: selector.select(templates[i & tmask], workers), seconds)

    gc.collect()
    rss_before_churn = _rss_mb()
    t0 = time.perf_counter()
    churn_published = cluster.fill(index, churn_events, deadline=t0 + 60.0, grow=False)  # the index is full: evicts
    churn_s = time.perf_counter() - t0
    churned = index.stats()
    gc.collect()
    rss_churned = _rss_mb()
    result = {
        "workers": num_workers,
        "entries": churned.entries,
        "distinct_hashes": churned.hashes,
        "fill_s": round(fill_s, 2),
        "match_per_s": round(calls / elapsed),
        "match_per_s_hot_working_set": round(hot_calls / hot_elapsed),
        "match_depths_per_s": round(depth_calls / depth_elapsed),
        "match_avg_hit_workers": round(avg_hit_workers, 1),
        "match_avg_best_blocks": round(avg_best, 1),
        "decide_hashed": hashed,
        "decide_with_hashing": tokenized,
        "rss_mb": {"before_fill": round(rss_before), "after_fill": round(rss_filled),
                   "before_churn": round(rss_before_churn), "after_churn": round(rss_churned)},
        "churn_published_blocks": churn_published,
        "churn_s": round(churn_s, 2),
        "evictions": churned.evictions,
    }
    return result


def run_router_bench(workers: Sequence[int] = (8, 64, 512), cached_blocks: int = 1_000_000, request_blocks: int = 64,
                     seconds: float = 2.0, churn_events: int = 200_000, seed: int = 0) -> dict:
    """Run the workload above once per worker count; returns ``{"config": ..., "results": [...]}``."""
    if cached_blocks < 1 or request_blocks < 1 or seconds <= 0 or churn_events < 0:
        raise ValueError("cached_blocks and request_blocks must be >= 1, seconds > 0, churn_events >= 0")
    results = [_bench_one(w, cached_blocks, request_blocks, seconds, churn_events, seed) for w in workers]
    return {"config": {"cached_blocks": cached_blocks, "request_blocks": request_blocks, "seconds": seconds,
                       "churn_events": churn_events, "block_size": _BLOCK_SIZE}, "results": results}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="8,64,512")
    parser.add_argument("--cached-blocks", type=int, default=1_000_000)
    parser.add_argument("--request-blocks", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--churn-events", type=int, default=200_000)
    args = parser.parse_args(argv)
    out = run_router_bench(tuple(int(w) for w in args.workers.split(",")), args.cached_blocks, args.request_blocks,
                           args.seconds, args.churn_events)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
