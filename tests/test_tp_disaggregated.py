"""Heterogeneous P/D with real ranks: a prefill replica at TP=2 feeds a decode replica at TP=1, and TP=1 feeds TP=2,
each rank sending or landing its own heads' KV on its own endpoint (tcp and nixl), through the real gRPC handoff.

Per backend one set of real ``tandem worker`` processes: prefill TP=1 and TP=2, decode TP=1 and TP=2 (the TP=2 ones
each rank 0 and a rank process, gloo on loopback). Greedy tokens equal transformers' fp32 ones except at a
demonstrated near-tie (``tests/parallel_parity.py``; the top-2 logprob gap is the top-2 logit gap), and each token's
logprobs equal, float for float, the split-emulating reference of the mixed layout (``tests/hetero_reference.py``:
prefill at TP=a, its KV re-split by head, decode at TP=b), so the logits are bit-identical to it. Afterwards, and
after an aborted request and a request whose leg to one decode rank cannot be sent, no block is in use or held and no
transfer is pending on any worker, the follower ranks' reservations included (``Load.transfers_in_flight`` of a
decode replica counts every rank's).
"""

from __future__ import annotations

import dataclasses
import json
import random
import time
from collections.abc import Callable, Generator, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import cast

import grpc
import psutil
import pytest
import torch
from hetero_reference import hetero_reference
from parallel_parity import assert_greedy_matches

from auth.token import ensure_cluster_token
from engine.sampling_params import SamplingParams
from kvtransfer.base import DestinationInfo
from proto.tandem.v1 import worker_pb2 as pb
from router.handoff import WorkerClient, disaggregated_generate
from worker.launcher import WorkerProcess, start_worker

pytestmark = pytest.mark.slow
MAX_NEW = 8
BLOCKS = 64
FLAGS = ["--num-kv-blocks", str(BLOCKS), "--max-num-batched-tokens", "48", "--session-port", "-1"]
GREEDY = pb.SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, logprobs=2)
# the split-emulating reference's engines: the workers' KV pool and batch budget, one thread per rank
REF_ENGINE = {"num_kv_blocks": BLOCKS, "max_num_batched_tokens": 48, "num_threads": 1}
# the broken leg's lease: the request fails on both tiers when it ends, and the test waits for that (the prefill is
# sent at once after Reserve; 5 s only made the test wait 5 s)
LEG_LEASE_MS = 2_000


class Tiers:
    """Prefill and decode workers at TP=1 and TP=2 on one KV backend."""

    def __init__(self, model: Path, backend: str) -> None:
        self.backend = backend
        self.procs: dict[str, WorkerProcess] = {}
        self.clients: dict[str, WorkerClient] = {}
        ensure_cluster_token()  # once, before the four start side by side (each inherits it)
        # the four start at once (their imports, model loads and rank rendezvous overlap), as tandem up starts its
        # replicas; each is waited for alone, and every one that started is stopped if any did not
        names = [(f"{role}{tp}", role, tp) for role in ("prefill", "decode") for tp in (1, 2)]
        with ThreadPoolExecutor(len(names)) as pool:
            starts = {name: pool.submit(start_worker, role, str(model), backend, [*FLAGS, "--tp", str(tp)],
                                        timeout_s=300) for name, role, tp in names}
        failed: BaseException | None = None
        for name, f in starts.items():
            try:
                self.procs[name] = f.result()
            except BaseException as e:
                failed = failed or e
        try:
            if failed is not None:
                raise failed
            for name, proc in self.procs.items():
                self.clients[name] = WorkerClient.connect(proc.address)
        except BaseException:
            self.close()
            raise

    def generate(self, prefill: str, decode: str, rid: str, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
        chunks = self.chunks(prefill, decode, rid, prompt)
        ids = [t for c in chunks for t in c.token_ids]
        tops = torch.tensor([[top.logprob for top in lp.top[:2]] for c in chunks for lp in c.logprobs])
        return ids, tops

    def chunks(self, prefill: str, decode: str, rid: str, prompt: list[int]) -> list[pb.TokenChunk]:
        return list(disaggregated_generate(self.clients[prefill], self.clients[decode], rid, prompt, GREEDY,
                                           lease_ms=60_000, rpc_timeout_s=120))

    def assert_all_free(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            loads = {n: c.stub.Load(pb.LoadRequest(), timeout=10) for n, c in self.clients.items()}
            busy = {n: ld for n, ld in loads.items()
                    if ld.used_blocks or ld.held_blocks or ld.transfers_in_flight or ld.running or ld.waiting
                    or ld.waiting_for_kv or ld.free_blocks != BLOCKS}
            if not busy:
                return
            if time.monotonic() > deadline:
                pytest.fail(f"blocks or transfers left: {busy}")
            time.sleep(0.05)

    def close(self) -> None:
        for c in self.clients.values():
            c.close()
        for p in self.procs.values():
            p.stop(timeout=30)


@pytest.fixture(scope="module", params=["tcp", "nixl"])
def tiers(request: pytest.FixtureRequest, checkpoint: Callable[[str], Path]) -> Iterator[tuple[Path, Tiers]]:
    path = checkpoint("llama")
    t = Tiers(path, request.param)
    yield path, t
    t.close()


def test_prefill_tp2_to_decode_tp1_and_tp1_to_tp2_equal_transformers(
        tiers: tuple[Path, Tiers], hf_greedy: Callable[[Path, list[int], int], list[int]]) -> None:
    path, t = tiers
    rng = random.Random(27)
    prompts = [[rng.randrange(2040) for _ in range(n)] for n in (5, 33, 70)]
    pairs = [("prefill2", "decode1"), ("prefill1", "decode2"), ("prefill2", "decode2")]
    jobs = [(p, d, i, prompt) for p, d in pairs for i, prompt in enumerate(prompts)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda j: t.generate(j[0], j[1], f"{j[0]}-{j[1]}-{j[2]}", j[3]), jobs))
    for (p, d, _, prompt), (ids, tops) in zip(jobs, results, strict=True):
        assert tops.shape == (MAX_NEW, 2)
        assert_greedy_matches(ids, hf_greedy(path, prompt, MAX_NEW), tops, f"{p} -> {d}, {len(prompt)} tokens")
    t.assert_all_free()
    # every prompt's KV went out whole, from every prefill rank: 16-token blocks of 4 layers x K and V x 4 heads x
    # 32 floats (64 KiB a block), counted in the prefill worker's totals whichever rank sent it
    per_prompt = sum(-(-len(prompt) // 16) for prompt in prompts) * 64 * 1024
    sent = {p: t.clients[p].stub.Load(pb.LoadRequest(), timeout=10).kv_transfer_bytes for p in ("prefill1", "prefill2")}
    assert sent == {"prefill1": per_prompt, "prefill2": 2 * per_prompt}


def test_hetero_logprobs_equal_the_split_emulating_reference_float_for_float(tiers: tuple[Path, Tiers]) -> None:
    """Prefill TP=2 -> decode TP=1 and TP=1 -> TP=2: every token's logprob and top-2 (``log_softmax`` of its logits
    row, so bit-identical logits give equal floats) equal the split-emulating reference's (``hetero_reference``:
    the prompt prefilled at TP=a, its KV re-split by head for TP=b and decoded there), ==, not within a tolerance.
    One request at a time on prompts no other test sends, so the served batches are the reference's (the prompt
    alone, the 70-token one prefilled in two chunks) and no prefix-cache hit (another prefill's KV) comes in."""
    path, t = tiers
    rng = random.Random(2727)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, logprobs=2)
    for prefill, decode in (("prefill2", "decode1"), ("prefill1", "decode2")):
        for n in (5, 70):
            prompt = [rng.randrange(2040) for _ in range(n)]
            what = f"{prefill} -> {decode}, {n} tokens"
            chunks = t.chunks(prefill, decode, f"ref-{prefill}-{decode}-{n}", prompt)
            got = [(lp.token_id, lp.logprob, [(top.token_id, top.logprob) for top in lp.top])
                   for c in chunks for lp in c.logprobs]
            ref = hetero_reference(str(path), prompt, int(prefill[-1]), int(decode[-1]), params, **REF_ENGINE)
            want = [(lp.token_id, lp.logprob, list(lp.top)) for lp in ref.logprobs]
            assert [c for ch in chunks for c in ch.token_ids] == ref.token_ids, what
            for step, (g, w) in enumerate(zip(got, want, strict=True)):
                assert g == w, f"{what}: token {step}: served {g}, split-emulating reference {w}"
    t.assert_all_free()


def test_an_aborted_request_is_freed_on_every_rank(tiers: tuple[Path, Tiers]) -> None:
    _, t = tiers
    prompt = list(range(1, 41))
    dec = t.clients["decode2"].stub
    dec.Reserve(pb.ReserveRequest(request_id="abort-reserved", prompt_token_ids=prompt, params=GREEDY,
                                  lease_ms=60_000), timeout=60)
    assert dec.Abort(pb.AbortRequest(request_id="abort-reserved"), timeout=10).found
    stream = cast(Generator[pb.TokenChunk, None, None], disaggregated_generate(
        t.clients["prefill2"], t.clients["decode2"], "abort-streaming", prompt, GREEDY, lease_ms=60_000,
        rpc_timeout_s=120))
    next(stream)  # the first token: prefill done, its KV sent; then the client goes away
    stream.close()
    for name in ("prefill2", "decode2"):
        t.clients[name].stub.Abort(pb.AbortRequest(request_id="abort-streaming"), timeout=10)
    t.assert_all_free()


def test_a_leg_that_cannot_be_sent_fails_its_request_alone(tiers: tuple[Path, Tiers]) -> None:
    """Rank 1's destination points at a closed port: the request fails explicitly on both tiers, and a request
    alongside it is untouched."""
    _, t = tiers
    if t.backend != "tcp":
        pytest.skip("a destination's endpoint is a tcp address")
    prompt = list(range(3, 40))
    params = pb.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    res = t.clients["decode2"].stub.Reserve(pb.ReserveRequest(request_id="broken", prompt_token_ids=prompt,
                                                              params=params, lease_ms=LEG_LEASE_MS), timeout=60)
    dests = [DestinationInfo.from_bytes(json.dumps(d).encode()) for d in json.loads(res.destination)]
    assert [d.layout.tp_rank for d in dests] == [0, 1]
    dests[1] = dataclasses.replace(dests[1], endpoint="127.0.0.1:1")
    broken = b"[" + b",".join(d.to_bytes() for d in dests) + b"]"
    with ThreadPoolExecutor(1) as pool:
        fine = pool.submit(t.generate, "prefill2", "decode2", "alongside", list(range(50, 80)))
        with pytest.raises(grpc.RpcError):
            first = t.clients["prefill2"].stub.Prefill(pb.PrefillRequest(
                request_id="broken", prompt_token_ids=prompt, params=params, destination=broken,
                lease_ms=LEG_LEASE_MS), timeout=60)
            list(t.clients["decode2"].stub.Decode(pb.DecodeRequest(
                request_id="broken", first_token_id=first.first_token_id, first_token_sent=True), timeout=60))
        assert len(fine.result(timeout=120)[0]) == MAX_NEW
    t.assert_all_free()


def test_a_prefill_rank_killed_mid_transfer_fails_its_request_alone(tiers: tuple[Path, Tiers],
                                                                    checkpoint: Callable[[str], Path]) -> None:
    """A prefill TP=2 worker stalls after handing over layer 1 (fault injection on rank 0; rank 1 has sent its
    layers 0 and 1 by then) and its rank 1 is killed with SIGKILL: the prefill worker exits 3, the decode TP=2
    replica fails that request explicitly and frees it on every rank, and a request through the other prefill
    worker alongside it is untouched. Over tcp the landing rank sees its sender's connection go, well within the
    lease; a NIXL receiver has no connection to watch, so there the request's (short) lease ends it."""
    _, t = tiers
    # the NIXL lease: the kill came 1.2 s after Reserve under a load of 10-24 on 2 cores, so 5 s leaves > 4x
    lease_ms, within_s = (120_000, 30.0) if t.backend == "tcp" else (5_000, 45.0)
    stalled = start_worker("prefill", str(checkpoint("llama")), t.backend,
                           [*FLAGS, "--tp", "2", "--debug-stall-after-layer", "1", "--debug-stall-seconds", "120"],
                           timeout_s=300)
    try:
        client = WorkerClient.connect(stalled.address)
        prompt = list(range(5, 60))
        params = pb.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        dec = t.clients["decode2"].stub
        res = dec.Reserve(pb.ReserveRequest(request_id="killed", prompt_token_ids=prompt, params=params,
                                            lease_ms=lease_ms), timeout=60)
        with ThreadPoolExecutor(2) as pool:
            prefill = pool.submit(client.stub.Prefill, pb.PrefillRequest(
                request_id="killed", prompt_token_ids=prompt, params=params, destination=res.destination,
                lease_ms=lease_ms), timeout=120)
            stall_deadline = time.monotonic() + 120
            while not any("fault injection: stalling" in line for line in list(stalled.log)):
                assert stalled.proc.poll() is None and time.monotonic() < stall_deadline, "rank 0 never stalled"
                time.sleep(0.05)
            time.sleep(1.0)  # rank 0 is in its stall; rank 1, a step behind it at most, sends its layers 0 and 1
            (rank1,) = [c for c in psutil.Process(stalled.proc.pid).children()
                        if "resource_tracker" not in " ".join(c.cmdline())]
            killed_at = time.monotonic()
            rank1.kill()
            fine = pool.submit(t.generate, "prefill1", "decode2", "beside-the-kill", list(range(70, 100)))
            assert stalled.proc.wait(60) == 3
            with pytest.raises(grpc.RpcError):
                prefill.result(timeout=60)
            while True:
                try:
                    list(dec.Decode(pb.DecodeRequest(request_id="killed", first_token_id=1, first_token_sent=True),
                                    timeout=within_s))
                except grpc.RpcError as e:
                    if e.code() == grpc.StatusCode.UNAVAILABLE:
                        assert "KV transfer" in (e.details() or ""), e.details()
                        break
                    raise
                pytest.fail("a request whose prefill rank died decoded")  # pragma: no cover
            assert time.monotonic() - killed_at < within_s, "the failure came too late"
            assert len(fine.result(timeout=120)[0]) == MAX_NEW
        client.close()
    finally:
        stalled.stop(timeout=30)
    t.assert_all_free()
