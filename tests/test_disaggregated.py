"""Disaggregated serving with real worker processes on loopback: a prefill and a decode ``tandem worker`` per KV
backend (NIXL/UCX, torch.distributed gloo, TCP), driven through the real gRPC handoff.

Output must equal colocated mode and transformers token for token, and every KV block must be back in the pool on
both sides afterwards (checked through each worker's ``Load``).
"""

from __future__ import annotations

import json
import os
import random
import statistics
import time
from collections.abc import Callable, Generator, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import cast

import grpc
import pytest

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from proto.tandem.v1 import worker_pb2 as pb
from router.handoff import WorkerClient, disaggregated_generate
from worker.convert import params_to_proto
from worker.launcher import WorkerProcess, start_worker

BACKENDS = ["tcp", "nixl", "torch"]
MAX_NEW = 10
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
FLAGS = ["--num-kv-blocks", "256", "--threads", "1"]


def prompts(n: int, seed: int = 0, prefix: list[int] | None = None) -> list[list[int]]:
    rng = random.Random(seed)
    return [[*(prefix or []), *(rng.randrange(2000) for _ in range(rng.randrange(1, 90)))] for _ in range(n)]


class Pair:
    def __init__(self, model: Path, backend: str, prefill_flags: list[str] | None = None,
                 decode_flags: list[str] | None = None) -> None:
        self.procs: list[WorkerProcess] = []
        self.procs.append(start_worker("prefill", str(model), backend, FLAGS + (prefill_flags or [])))
        self.procs.append(start_worker("decode", str(model), backend, FLAGS + (decode_flags or [])))
        self.prefill = WorkerClient.connect(self.procs[0].address)
        self.decode = WorkerClient.connect(self.procs[1].address)

    def generate(self, rid: str, prompt: list[int], params: SamplingParams = GREEDY,
                 lease_ms: int = 20_000) -> list[int]:
        out: list[int] = []
        for chunk in disaggregated_generate(self.prefill, self.decode, rid, prompt, params_to_proto(params),
                                            lease_ms=lease_ms, rpc_timeout_s=60):
            out.extend(chunk.token_ids)
        return out

    def wait_all_free(self, timeout_s: float = 20.0) -> tuple[pb.LoadResponse, pb.LoadResponse]:
        """Poll both workers until no block is in use and no transfer is pending; return the final loads."""
        deadline = time.monotonic() + timeout_s
        while True:
            loads = tuple(c.stub.Load(pb.LoadRequest(), timeout=5) for c in (self.prefill, self.decode))
            idle = all(ld.used_blocks == 0 and ld.held_blocks == 0 and ld.running == 0 and ld.waiting == 0
                       and ld.waiting_for_kv == 0 for ld in loads)
            if idle or time.monotonic() > deadline:
                return loads  # type: ignore[return-value]
            time.sleep(0.05)

    def close(self) -> None:
        for c in (self.prefill, self.decode):
            c.close()
        for p in self.procs:
            p.stop()


@pytest.fixture(scope="module", params=BACKENDS)
def pair(request: pytest.FixtureRequest, checkpoint: Callable[[str], Path]) -> Iterator[Pair]:
    p = Pair(checkpoint("llama"), request.param)
    yield p
    p.close()


def assert_all_free(p: Pair) -> None:
    pre, dec = p.wait_all_free()
    for name, ld in (("prefill", pre), ("decode", dec)):
        assert ld.used_blocks == 0 and ld.free_blocks == ld.total_blocks == 256, f"{name} leaked blocks: {ld}"
        assert ld.held_blocks == 0 and ld.transfers_in_flight == 0, f"{name} has transfers left: {ld}"


@pytest.mark.slow
def test_disaggregated_equals_colocated_equals_transformers(pair: Pair, checkpoint: Callable[[str], Path],
                                                            hf_greedy: Callable[..., list[int]]) -> None:
    """A concurrent batch of 12 prompts, then 4 prompts sharing a 64-token prefix (prefix-cache hits on prefill)."""
    path = checkpoint("llama")
    batch = prompts(12, seed=1)
    shared = prompts(4, seed=2, prefix=list(range(100, 164)))
    all_prompts = batch + shared
    colocated = LLM(str(path), num_kv_blocks=256).generate(all_prompts, GREEDY)
    with ThreadPoolExecutor(8) as ex:
        disagg = list(ex.map(lambda ip: pair.generate(f"eq-{ip[0]}", ip[1]), enumerate(batch)))
    disagg += [pair.generate(f"eq-shared-{i}", pr) for i, pr in enumerate(shared)]
    for prompt, d, c in zip(all_prompts, disagg, colocated, strict=True):
        ref = hf_greedy(path, prompt, MAX_NEW)
        assert c.token_ids == ref
        assert d == ref, f"disaggregated output diverged for a {len(prompt)}-token prompt"
    assert_all_free(pair)


@pytest.mark.slow
def test_block_accounting_exact_after_500_mixed_requests_with_aborts(pair: Pair) -> None:
    """500 requests (varied lengths and budgets, 1 in 5 cancelled mid-stream) leave zero blocks in use anywhere."""
    rng = random.Random(5)
    jobs = [(i, p, rng.randrange(1, 6), i % 5 == 0) for i, p in enumerate(prompts(500, seed=9))]

    def run(job: tuple[int, list[int], int, bool]) -> int:
        i, prompt, max_new, cancel = job
        params = SamplingParams(max_tokens=max_new, temperature=0.0, ignore_eos=True)
        # a generator function, so the stream can be closed early
        stream = cast(Generator[pb.TokenChunk, None, None],
                      disaggregated_generate(pair.prefill, pair.decode, f"mix-{i}", prompt, params_to_proto(params)))
        n = 0
        for chunk in stream:
            n += len(chunk.token_ids)
            if cancel:
                pair.decode.stub.Abort(pb.AbortRequest(request_id=f"mix-{i}"), timeout=5)
                stream.close()
                break
        return n

    with ThreadPoolExecutor(16) as ex:
        counts = list(ex.map(run, jobs))
    for (_, _, max_new, cancel), n in zip(jobs, counts, strict=True):
        assert n >= 1 if cancel else n == max_new
    assert_all_free(pair)


def test_output_pacing_holds_tokens_until_min_chunk_tokens_without_changing_them(pair: Pair) -> None:
    """worker.proto's output pacing, on Decode (disaggregated) and Generate (colocated on the decode worker): with
    ``min_chunk_tokens`` = 4 every chunk but the last carries at least 4 tokens, with ``min_chunk_tokens`` above
    the answer's length the answer is one chunk, and the tokens, text and finish reason are the unpaced ones.

    One exemption, the first token of a disaggregated request: it comes from ``PrefillResponse`` and is yielded
    alone the moment ``Prefill`` returns (TTFT never waits, on pacing or on the transfer), so it is always a
    1-token chunk of its own; pacing applies, exactly as above, to decode's stream from the second token on."""
    prompt = prompts(1, seed=7)[0]
    wire = params_to_proto(GREEDY)

    def decode(rid: str, pace: int) -> list[pb.TokenChunk]:
        return list(disaggregated_generate(pair.prefill, pair.decode, rid, prompt, wire, min_chunk_tokens=pace))

    def generate(rid: str, pace: int) -> list[pb.TokenChunk]:
        req = pb.GenerateRequest(request_id=rid, prompt_token_ids=prompt, params=wire, min_chunk_tokens=pace)
        return list(pair.decode.stub.Generate(req, timeout=60))

    def flat(chunks: list[pb.TokenChunk]) -> tuple[list[int], str, str]:
        return [t for c in chunks for t in c.token_ids], "".join(c.text for c in chunks), chunks[-1].finish_reason

    for run, exempt in ((decode, 1), (generate, 0)):
        plain = run(f"pace-{run.__name__}-0", 0)
        tokens, _, finish = flat(plain)
        assert len(tokens) == MAX_NEW and finish == "length"
        paced = run(f"pace-{run.__name__}-4", 4)
        assert flat(paced) == flat(plain)
        assert all(len(c.token_ids) == 1 for c in paced[:exempt])  # prefill's first token, alone and unpaced
        sizes = [len(c.token_ids) for c in paced[exempt:]]
        assert all(n >= 4 for n in sizes[:-1]) and len(sizes) <= -(-(MAX_NEW - exempt) // 4), sizes
        whole = run(f"pace-{run.__name__}-all", MAX_NEW + 5)
        assert [len(c.token_ids) for c in whole] == [1] * exempt + [MAX_NEW - exempt] and flat(whole) == flat(plain)
    assert_all_free(pair)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["tcp", "nixl"])
def test_prefill_killed_mid_transfer_fails_decode_within_lease(backend: str,
                                                               checkpoint: Callable[[str], Path]) -> None:
    """SIGKILL the prefill process while it stalls between layers: decode reports an explicit failure within the
    lease, frees the reserved blocks, and keeps serving through a healthy prefill worker."""
    path = checkpoint("llama")
    p = Pair(path, backend, prefill_flags=["--debug-stall-after-layer", "1"])
    healthy = start_worker("prefill", str(path), backend, FLAGS)
    try:
        lease_ms = 3000
        with ThreadPoolExecutor(1) as ex:
            fut = ex.submit(p.generate, "victim", prompts(1, seed=4)[0], GREEDY, lease_ms)
            deadline = time.monotonic() + 30
            while p.decode.stub.Load(pb.LoadRequest(), timeout=5).transfers_in_flight == 0:
                assert time.monotonic() < deadline, "transfer never started"
                time.sleep(0.02)
            time.sleep(0.2)
            killed_at = time.monotonic()
            p.procs[0].kill()
            # Decode side: the reservation fails explicitly and its blocks are freed within the lease.
            while True:
                dec = p.decode.stub.Load(pb.LoadRequest(), timeout=5)
                if dec.used_blocks == 0 and dec.waiting_for_kv == 0:
                    break
                assert time.monotonic() - killed_at < lease_ms / 1000 + 2, f"decode kept blocks: {dec}"
                time.sleep(0.02)
            # Caller side: a bounded error naming the failed step, never a hang.
            with pytest.raises(Exception) as info:
                fut.result(timeout=lease_ms / 1000 + 10)
        assert "Prefill" in str(info.value)
        good = WorkerClient.connect(healthy.address)
        out: list[int] = []
        for chunk in disaggregated_generate(good, p.decode, "after", [5, 6, 7], params_to_proto(GREEDY)):
            out.extend(chunk.token_ids)
        assert len(out) == MAX_NEW
        good.close()
    finally:
        healthy.stop()
        p.close()


@pytest.mark.slow
def test_decode_killed_mid_transfer_frees_prefill_blocks_within_lease(checkpoint: Callable[[str], Path]) -> None:
    """SIGKILL decode while prefill stalls (2 s) between layers: prefill's held blocks are freed within the lease."""
    p = Pair(checkpoint("llama"), "tcp", prefill_flags=["--debug-stall-after-layer", "1",
                                                         "--debug-stall-seconds", "2"])
    try:
        lease_ms = 4000
        with ThreadPoolExecutor(1) as ex:
            fut = ex.submit(p.generate, "victim", prompts(1, seed=6)[0], GREEDY, lease_ms)
            deadline = time.monotonic() + 30
            while p.decode.stub.Load(pb.LoadRequest(), timeout=5).transfers_in_flight == 0:
                assert time.monotonic() < deadline, "transfer never started"
                time.sleep(0.02)
            p.procs[1].kill()
            with pytest.raises(Exception):  # noqa: B017 - the caller sees the handoff fail, whatever the step
                fut.result(timeout=30)
        deadline = time.monotonic() + lease_ms / 1000 + 5
        while True:
            ld = p.prefill.stub.Load(pb.LoadRequest(), timeout=5)
            if ld.used_blocks == 0 and ld.held_blocks == 0:
                break
            assert time.monotonic() < deadline, f"prefill still holds blocks after the lease: {ld}"
            time.sleep(0.05)
        assert ld.transfers_in_flight == 0
    finally:
        p.close()


@pytest.mark.slow
def test_incompatible_layout_is_refused_at_the_handshake(checkpoint: Callable[[str], Path]) -> None:
    """A decode worker with another block size is refused before any work, with the field named."""
    p = Pair(checkpoint("llama"), "tcp", decode_flags=["--block-size", "32"])
    try:
        with pytest.raises(Exception) as info:
            p.generate("mismatch", [1, 2, 3, 4])
        assert "block_size" in str(info.value) and "FAILED_PRECONDITION" in str(info.value)
        assert_all_free(p)
    finally:
        p.close()


def test_reserve_refuses_prompt_too_long_with_invalid_argument(checkpoint: Callable[[str], Path]) -> None:
    """Bad input on the worker API is a 4xx-class gRPC status with a message, not a hang or a crash."""
    w = start_worker("decode", str(checkpoint("llama")), "tcp", [*FLAGS, "--max-model-len", "64"])
    c = WorkerClient.connect(w.address)
    try:
        with pytest.raises(grpc.RpcError) as info:
            c.stub.Reserve(pb.ReserveRequest(request_id="long", prompt_token_ids=list(range(100)),
                                             params=params_to_proto(GREEDY)), timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "64" in (info.value.details() or "")
        with pytest.raises(grpc.RpcError) as info:
            c.stub.Reserve(pb.ReserveRequest(request_id="bad", prompt_token_ids=[1],
                                             params=pb.SamplingParams(max_tokens=4, top_p=2.0)), timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "top_p" in (info.value.details() or "")
    finally:
        c.close()
        w.stop()


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process CPU time from /proc")
def test_decode_worker_waiting_for_kv_sleeps_instead_of_spinning(checkpoint: Callable[[str], Path]) -> None:
    """A reservation waiting for its KV gives the engine nothing to compute, yet counts as unfinished: the loop must
    sleep, not step an empty schedule back to back (that took a whole core, and the GIL, from the threads landing
    the bytes), and must still answer commands."""
    cpu = max(os.sched_getaffinity(0))  # pinned as `tandem bench kv` pins its decode worker: every thread obeys
    w = start_worker("decode", str(checkpoint("llama")), "tcp", FLAGS, cpus={cpu})
    c = WorkerClient.connect(w.address)
    try:
        threads = list(Path(f"/proc/{w.proc.pid}/task").iterdir())
        assert len(threads) > 3 and all(os.sched_getaffinity(int(t.name)) == {cpu} for t in threads)
        c.stub.Reserve(pb.ReserveRequest(request_id="waits", prompt_token_ids=list(range(1, 40)),
                                         params=params_to_proto(GREEDY), lease_ms=20_000), timeout=10)
        time.sleep(0.3)
        before = _cpu_seconds(w.proc.pid)
        time.sleep(1.5)
        cores = (_cpu_seconds(w.proc.pid) - before) / 1.5
        assert cores < 0.4, f"the decode worker used {cores:.2f} cores while only waiting for KV"
        t0 = time.monotonic()
        assert c.stub.Load(pb.LoadRequest(), timeout=5).waiting_for_kv == 1
        assert time.monotonic() - t0 < 1.0
    finally:
        c.close()
        w.stop()


@pytest.mark.slow
def test_bench_overlap_runs_in_its_own_process_and_reports_a_consistent_measurement(
        checkpoint: Callable[[str], Path]) -> None:
    """``tandem bench kv``'s overlap phase, end to end on the tiny model over tcp: spawned in a fresh process, a real
    prefill worker and a real decode worker process; the report's bytes are the request's KV and its overlap is
    computed from the measured serial and exposed times."""
    from bench.kv import measure_overlap_isolated

    model = checkpoint("llama")
    report = measure_overlap_isolated(str(model), "tcp", 256, 1, repeats=2)
    assert report["backend"] == "tcp" and report["prompt_len"] == 256 and len(report["runs"]) == 2
    cfg = json.loads((model / "config.json").read_text())
    kv_heads = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    assert report["kv_bytes"] == 2 * cfg["num_hidden_layers"] * 256 * kv_heads * head_dim * 4  # fp32, 256 tokens
    for run in report["runs"]:
        assert run["serial_transfer_s"] > 0 and run["exposed_after_compute_s"] >= 0
        expected = max(0.0, min(1.0, 1 - run["exposed_after_compute_s"] / run["serial_transfer_s"]))
        assert run["overlap"] == pytest.approx(expected)
        assert run["request_s"] > run["exposed_after_compute_s"]
    assert report["overlap"] == pytest.approx(sum(r["overlap"] for r in report["runs"]) / 2)  # median of two


@pytest.mark.slow
def test_bench_itl_alternates_a_compute_only_control_with_landing_transfers(checkpoint: Callable[[str], Path]) -> None:
    """``tandem bench kv``'s ITL phase on the tiny model over nixl, real worker processes: the control run's load
    is prefill compute with no destination (nothing lands on decode), the loaded run's is real transfers into the
    decode worker, the streams' gaps are counted only while every stream runs, and the reported cost is loaded
    against control. No timing threshold: the figures are the benchmark's, this checks what they mean."""
    from bench.kv import measure_itl

    affinity = os.sched_getaffinity(0)
    report = measure_itl(str(checkpoint("llama")), "nixl", 256, streams=2, tokens=64, rounds=2)
    assert os.sched_getaffinity(0) == affinity  # the load client's pinning is undone
    quiet, control, loaded = (report[k] for k in ("itl_ms_quiet", "itl_ms_prefill_compute_only",
                                                  "itl_ms_with_transfers"))
    assert quiet["load_requests"] == 0
    assert all(r["load_requests"] >= 1 for r in control["runs"] + loaded["runs"])
    assert report["transfers_during_loaded_run"] == statistics.median(r["load_requests"] for r in loaded["runs"])
    for run in [quiet, *control["runs"], *loaded["runs"]]:
        assert 0 < run["p50"] <= run["p99"] and 0 < run["decode_cores_busy"] < 1.5
    costs = [ld["p50"] / c["p50"] - 1 for c, ld in zip(control["runs"], loaded["runs"], strict=True)]
    assert report["transfer_cost_p50_runs"] == pytest.approx(costs)
    assert report["transfer_cost_p50"] == pytest.approx(statistics.median(costs))
