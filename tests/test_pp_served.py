"""Pipeline- and expert-parallel replicas served end to end, CPU binding of the ranks, and KV events of a TP=2 worker.

- ``tandem generate --pp 2`` (Llama) and ``--ep 2`` (the tiny Mixtral): greedy tokens equal transformers' fp32 ones
  but for a demonstrated near-tie (``tests/parallel_parity.py``), every rank's blocks free or cached (the CLI checks
  them before it prints), and no rank process left once it exits.
- ``tandem worker --role decode --pp 2``: two stages (rank 0 the worker, rank 1 its child) behind the Worker gRPC
  API, prompts sent at once; every block free afterwards; Reserve (landing remote KV) refused, since stages do not
  split KV by TP; SIGTERM leaves no rank behind.
- ``tandem up --config`` with ``"pp": 2`` and ``tandem up --ep 2`` (Mixtral): a real local cluster serving the
  official openai client exactly, the replica's blocks all free afterwards, SIGINT leaving nothing behind.
- CPU binding (``cpus_for``): the rule as a pure function for hosts of 2 to 64 cores, and on this host the affinity
  the kernel reports for the rank processes of a PP=2 worker and a TP=2 x PP=2 one.
- KV events of a TP=2 x PP=2 worker: rank 0 publishes a prompt's stored block hashes on ``KVEvents`` (and in its
  ``Snapshot``), equal to the router's hashes of that prompt's full blocks.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import openai
import psutil
import pytest
from parallel_parity import assert_all_blocks_free, assert_greedy_matches, serve_greedy
from test_tandem_up import Cluster, _alive
from test_tp_cli import _hf_greedy_with_logits

from auth.credentials import Credentials
from auth.grpc_client import attach
from engine.block_hash import extra_keys_for, hash_blocks
from engine.parallel.rank_process import cpus_for
from engine.tokenizer import Tokenizer
from proto.tandem.v1 import worker_pb2 as pb
from proto.tandem.v1 import worker_pb2_grpc as pb_grpc
from worker.launcher import WorkerProcess, start_worker

MAX_NEW = 8


# ---- CPU binding: the rule ---------------------------------------------------------------------------------------


def test_cpus_for_gives_each_rank_its_own_slice_where_there_are_enough_cores_and_shares_them_otherwise() -> None:
    # as many cores as ranks or more: disjoint, equal, contiguous slices in rank order (a remainder is left unused)
    for n_cpus in (2, 3, 4, 8, 16, 64):
        cpus = list(range(100, 100 + n_cpus))  # core ids need not start at 0 (a cgroup's CPU set)
        for world in range(1, n_cpus + 1):
            per = n_cpus // world
            slices = [cpus_for(r, world, cpus) for r in range(world)]
            assert slices == [cpus[r * per:(r + 1) * per] for r in range(world)], (n_cpus, world)
            assert all(len(s) == per for s in slices)
            assert len({c for s in slices for c in s}) == per * world  # no core held by two ranks
    assert cpus_for(0, 2, [0, 1]) == [0] and cpus_for(1, 2, [0, 1]) == [1]
    assert cpus_for(1, 4, list(range(16))) == [4, 5, 6, 7]
    assert cpus_for(2, 3, [0, 2, 4, 6, 8, 10, 12]) == [8, 10]  # 7 cores, 3 ranks: 2 each, core 12 unused
    # fewer cores than ranks: every rank shares all of them
    for world in (3, 4):
        assert all(cpus_for(r, world, [0, 1]) == [0, 1] for r in range(world))
    assert cpus_for(0, 1, [5]) == [5]


# ---- tandem generate --pp 2 / --ep 2 ----------------------------------------------------------------------------


def _generate_watching_ranks(path: Path, out_dir: Path, *flags: str) -> tuple[subprocess.CompletedProcess[str],
                                                                              set[int]]:
    """``tandem generate`` with ``flags``; also the process ids of every descendant seen while it ran."""
    cmd = [sys.executable, "-m", "cli.main", "generate", "--model", str(path), "--prompt", "Hello", "--prompt",
           "Tandem serves tokens", "--max-tokens", str(MAX_NEW), "--ignore-eos", "--json", "--num-kv-blocks", "64",
           *flags]
    out, err = out_dir / "stdout", out_dir / "stderr"
    with out.open("w") as o, err.open("w") as e:
        proc = subprocess.Popen(cmd, stdout=o, stderr=e, text=True)
    seen: set[int] = set()
    deadline = time.monotonic() + 600
    try:
        while proc.poll() is None:
            assert time.monotonic() < deadline, "tandem generate did not finish in 600 s"
            with contextlib.suppress(psutil.NoSuchProcess):
                seen.update(p.pid for p in psutil.Process(proc.pid).children(recursive=True))
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    return subprocess.CompletedProcess(cmd, proc.returncode, out.read_text(), err.read_text()), seen


@pytest.mark.slow
@pytest.mark.parametrize(("arch", "flags", "ranks"), [
    ("llama", ("--pp", "2"), 2),
    ("mixtral", ("--ep", "2"), 2),
])
def test_generate_pp2_and_ep2_print_transformers_greedy_tokens_and_leave_no_rank(
        checkpoint: Callable[[str], Path], tmp_path: Path, arch: str, flags: tuple[str, ...], ranks: int) -> None:
    path = checkpoint(arch)
    res, seen = _generate_watching_ranks(path, tmp_path, *flags)
    assert res.returncode == 0, res.stderr
    rows = [json.loads(line) for line in res.stdout.splitlines()]
    assert len(rows) == 2
    for row in rows:
        ref, logits = _hf_greedy_with_logits(path, row["prompt_token_ids"], MAX_NEW)
        assert_greedy_matches(row["token_ids"], ref, logits, f"generate {' '.join(flags)} {arch}")
    assert len(seen) >= ranks, f"expected {ranks} rank processes, saw {sorted(seen)}"
    deadline = time.monotonic() + 30
    while (alive := [p for p in seen if _alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive, f"processes left behind: {alive}"


def _cmdline(pid: int) -> str:
    try:
        return " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return ""


# ---- tandem worker --pp 2 / --tp 2 ------------------------------------------------------------------------------


def _ranks(worker: WorkerProcess) -> list[psutil.Process]:
    """The worker's rank processes (spawned children; not multiprocessing's resource tracker)."""
    return [c for c in psutil.Process(worker.proc.pid).children() if "resource_tracker" not in " ".join(c.cmdline())]


def _assert_ranks_bound_by_the_rule(worker: WorkerProcess, world: int) -> None:
    """Rank 0 (the worker) and its followers (spawned before rank 0 binds itself, so from the same allowed set) hold
    what ``cpus_for`` gives them of this host's CPUs, as the kernel reports them."""
    allowed = sorted(os.sched_getaffinity(0))  # the worker inherited this process's set (start_worker: no pin)
    ranks = _ranks(worker)
    assert len(ranks) == world - 1
    got = [sorted(os.sched_getaffinity(worker.proc.pid)), *(sorted(os.sched_getaffinity(r.pid)) for r in ranks)]
    want = [cpus_for(rank, world, allowed) for rank in range(world)]
    assert sorted(got) == sorted(want), f"{len(allowed)} CPUs allowed: ranks hold {got}, the rule says {want}"
    assert got[0] == want[0]  # rank 0 is the worker itself
    if len(allowed) >= world:
        assert len({c for cpus in got for c in cpus}) == sum(len(c) for c in got), "two ranks share a core"


@pytest.mark.slow
def test_pp2_decode_worker_serves_transformers_greedy_tokens_frees_every_block_and_stops_its_rank(
        checkpoint: Callable[[str], Path], hf_greedy: Callable[[Path, list[int], int], list[int]]) -> None:
    path = checkpoint("llama")
    # a decode worker, as tandem up's decode tier: its stages serve colocated requests; it lands no remote KV
    worker = start_worker("decode", str(path), "tcp", ["--pp", "2", "--num-kv-blocks", "64",
                                                     "--max-num-batched-tokens", "48", "--session-port", "-1"],
                          timeout_s=300)
    try:
        ranks = _ranks(worker)
        assert len(ranks) == 1 and "--pp 2" in " ".join(psutil.Process(worker.proc.pid).cmdline())
        _assert_ranks_bound_by_the_rule(worker, 2)
        rng = random.Random(27)
        prompts = [[rng.randrange(2040) for _ in range(n)] for n in (1, 6, 40)]  # 40: prefilled in two chunks
        with ThreadPoolExecutor(len(prompts)) as pool:
            results = list(pool.map(lambda p: serve_greedy(worker.address, p, MAX_NEW), prompts))
        for prompt, (ids, tops, _) in zip(prompts, results, strict=True):
            assert tops.shape == (MAX_NEW, 2)
            assert_greedy_matches(ids, hf_greedy(path, prompt, MAX_NEW), tops, f"PP=2 worker, {len(prompt)} tokens")
        with grpc.insecure_channel(worker.address) as ch, pytest.raises(grpc.RpcError) as refused:
            pb_grpc.WorkerStub(ch).Reserve(pb.ReserveRequest(prompt_token_ids=prompts[2], params=pb.SamplingParams(
                max_tokens=MAX_NEW, temperature=0)), timeout=30)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION  # type: ignore[attr-defined]
        assert_all_blocks_free(worker.address)
        assert worker.proc.poll() is None
    finally:
        worker.stop(timeout=30)
    assert worker.proc.returncode == 0
    _, alive = psutil.wait_procs(ranks, timeout=30)
    assert not alive, f"rank processes left behind: {alive}"


@pytest.mark.slow
def test_tp2_pp2_worker_rank0_publishes_the_kv_events_of_its_prompts_and_ranks_are_bound_by_the_rule(
        checkpoint: Callable[[str], Path]) -> None:
    """Four ranks (TP=2 x PP=2): on a host of fewer than 4 CPUs they share all of them (the PP=2 worker's two
    ranks above hold one core each on 2 CPUs)."""
    path = checkpoint("llama")
    worker = start_worker("both", str(path), "tcp", ["--tp", "2", "--pp", "2", "--num-kv-blocks", "64",
                                                     "--session-port", "-1"], timeout_s=300)
    try:
        _assert_ranks_bound_by_the_rule(worker, 4)
        prompt = [random.Random(3).randrange(2040) for _ in range(40)]
        # the router's hashes of the prompt's 2 full blocks (salted by the model's name, as the workers say)
        want = hash_blocks(prompt, 16, extra_keys_for(model=path.name))
        assert len(want) == 2
        assert len(serve_greedy(worker.address, prompt, MAX_NEW)[0]) == MAX_NEW
        stored: list[int] = []
        with grpc.insecure_channel(worker.address) as ch:
            stub = attach(pb_grpc.WorkerStub(ch), Credentials.for_cluster())
            stream = stub.KVEvents(pb.KVEventsRequest(after_seq=0), timeout=30)
            try:
                for batch in stream:
                    stored += [h for h, kind in zip(batch.hashes, batch.kinds, strict=True) if kind == 1]
                    if set(want) <= set(stored):
                        break
            finally:
                stream.cancel()
            snap = stub.Snapshot(pb.SnapshotRequest(), timeout=10)
        assert stored[:2] == want, f"stored {stored}, the prompt's blocks hash to {want}"
        assert set(want) <= set(snap.hashes)
        assert_all_blocks_free(worker.address)
    finally:
        worker.stop(timeout=30)


# ---- tandem up --pp 2 (--config) / --ep 2 -----------------------------------------------------------------------


def _worker_address(pid: int) -> str:
    """The worker's gRPC port among the ports it listens on: the one that answers ``Load``."""
    for conn in psutil.Process(pid).net_connections(kind="tcp"):
        if conn.status != psutil.CONN_LISTEN:
            continue
        address = f"127.0.0.1:{conn.laddr.port}"
        with grpc.insecure_channel(address) as ch:
            try:
                pb_grpc.WorkerStub(ch).Load(pb.LoadRequest(), timeout=5)
            except grpc.RpcError:
                continue
        return address
    raise AssertionError(f"worker {pid} serves no Worker API")


@pytest.mark.slow
@pytest.mark.parametrize(("arch", "how"), [("llama", "config pp 2"), ("mixtral", "flags ep 2")])
def test_up_serves_a_pp2_or_ep2_replica_to_the_openai_client_exactly_and_leaves_nothing(
        checkpoint: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory,
        hf_greedy: Callable[[Path, list[int], int], list[int]], arch: str, how: str) -> None:
    path = checkpoint(arch)
    home = tmp_path_factory.mktemp("tandem-home")
    if how.startswith("config"):
        cfg = home / "up.conf.json"
        cfg.write_text(json.dumps({"prefill": 0, "decode": 1, "pp": 2}))
        flags: tuple[str, ...] = ("--config", str(cfg))
        want_flag = "--pp 2"
    else:
        flags, want_flag = ("--prefill", "0", "--decode", "1", "--ep", "2"), "--ep 2"
    c = Cluster(path, home, flags)
    pids: list[int] = [c.proc.pid]
    try:
        (worker,) = c.state["worker_pids"]
        assert want_flag in " ".join(psutil.Process(worker).cmdline())
        ranks = [p.pid for p in psutil.Process(worker).children() if "resource_tracker" not in _cmdline(p.pid)]
        assert len(ranks) == 1, f"a 2-rank replica's rank 1 is not a child of its worker: {ranks}"
        pids += [worker, *ranks]
        client = openai.OpenAI(base_url=c.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        tok = Tokenizer(path)
        for prompt in ([7, 8, 9, 10, 11], [random.Random(4).randrange(2000) for _ in range(30)]):
            r = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_NEW, temperature=0,
                                          extra_body={"ignore_eos": True})
            assert r.choices[0].text == tok.decode(hf_greedy(path, prompt, MAX_NEW)), (how, prompt)
        assert_all_blocks_free(_worker_address(worker))
    finally:
        code = c.stop()
    assert code == 0, "".join(c.lines[-30:])
    deadline = time.monotonic() + 30
    while (alive := [p for p in pids if _alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive, f"processes left behind: {alive}"
