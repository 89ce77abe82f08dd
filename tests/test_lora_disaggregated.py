"""LoRA on a disaggregated pair: real ``tandem worker --role prefill|decode --lora NAME=DIR`` processes over tcp on
loopback, driven through the hand-off as a router drives it (Reserve on decode with the adapter and the prefill
worker's content hash from its Health, Prefill with the decode worker's ``ReserveResponse.lora``, then Decode).

- A concurrent mixed batch of base-model requests and requests of two adapters is token-exact with transformers +
  peft (prefill samples the first token under the adapter, decode the rest).
- One adapter name serves other files on each worker. Reserve carrying prefill's hash is refused by decode before
  it reserves a block; a Reserve without a hash succeeds and Prefill, carrying decode's hash, is refused by the
  prefill worker before any compute (the caller then aborts the reservation, as the router does). Both refusals are
  FAILED_PRECONDITION naming the adapter; the mixed batch running meanwhile is unaffected, and both workers end
  with every block free and none held.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from gateway_harness import WORKER_FLAGS, wait_idle
from lora_reference import peft_greedy

from auth.credentials import Credentials
from auth.grpc_client import aio_channel, attach
from cli.main import main as tandem
from proto.tandem.v1 import worker_pb2 as pb
from proto.tandem.v1 import worker_pb2_grpc as pb_grpc
from worker.launcher import WorkerProcess, start_worker

pytestmark = pytest.mark.slow
MAX_NEW = 8
# (prompt, adapter): two base requests and two of each adapter, prompts across block boundaries (16 tokens)
BATCH = [([5, 17, 42, 99, 7, 3, 250, 11, 64, 8, 31, 2, 77, 19, 23, 101, 4, 9, 12], "a"),
         ([9, 81, 12, 33, 7], ""),
         ([200, 1, 54, 76, 18, 29, 140, 3, 3, 8, 91, 17, 44, 5, 61, 62, 63], "b"),
         ([61, 62, 63, 64, 65, 66, 67, 68, 69, 70], "a"),
         ([300, 301, 302, 303, 304, 305, 306, 307, 308, 309, 310, 311, 312, 313, 314, 315, 316, 317], ""),
         ([9, 81, 12, 33, 7], "b")]
PARAMS = pb.SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


class HandoffRefused(Exception):
    def __init__(self, step: str, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{step}: {code.name}: {details}")
        self.step, self.code, self.details = step, code, details


async def _handoff(prefill: pb_grpc.WorkerStub, decode: pb_grpc.WorkerStub, rid: str, prompt: list[int],
                   lora: pb.LoRARef | None) -> list[int]:
    """Reserve → Prefill → Decode for one request; its tokens. On a refusal both sides are told to abort (as
    router/handoff.py does) and HandoffRefused names the step."""
    step = "Reserve"
    try:
        reserve = await decode.Reserve(pb.ReserveRequest(request_id=rid, prompt_token_ids=prompt, params=PARAMS,
                                                         lease_ms=30_000, lora=lora), timeout=120)
        if lora is not None:
            assert reserve.lora.name == lora.name and reserve.lora.content_hash
        step = "Prefill"
        first = await prefill.Prefill(pb.PrefillRequest(
            request_id=rid, prompt_token_ids=prompt, params=PARAMS, destination=reserve.destination,
            lease_ms=30_000, lora=reserve.lora if reserve.HasField("lora") else None), timeout=120)
        step = "Decode"
        tokens = [first.first_token_id]
        async for chunk in decode.Decode(pb.DecodeRequest(request_id=rid, first_token_id=first.first_token_id,
                                                          first_token_sent=True), timeout=120):
            tokens.extend(chunk.token_ids)
        return tokens
    except grpc.aio.AioRpcError as e:
        for stub in (decode, prefill):
            await stub.Abort(pb.AbortRequest(request_id=rid), timeout=30)
        raise HandoffRefused(step, e.code(), e.details() or "") from None


def _adapter(base: Path, out: Path, targets: str, seed: int) -> Path:
    assert tandem(["model", "init-lora", str(base), str(out), "--targets", targets, "--seed", str(seed)]) == 0
    return out


def test_prefill_and_decode_apply_adapters_exactly_and_refuse_a_mismatched_one(
        checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    base = checkpoint("llama")
    a = _adapter(base, tmp_path / "a", "q_proj,v_proj", 1)
    b = _adapter(base, tmp_path / "b", "o_proj,down_proj", 2)
    c_prefill = _adapter(base, tmp_path / "c1", "q_proj,v_proj", 3)
    c_decode = _adapter(base, tmp_path / "c2", "q_proj,v_proj", 4)  # same name "c", other content
    expected = [peft_greedy(base, {"a": a, "b": b}.get(name), prompt, MAX_NEW) for prompt, name in BATCH]
    assert expected[1] != expected[5] and expected[0] != peft_greedy(base, None, BATCH[0][0], MAX_NEW)
    flags = [*WORKER_FLAGS, "--lora", f"a={a}", "--lora", f"b={b}"]
    workers: list[WorkerProcess] = []
    try:
        workers.append(start_worker("decode", str(base), "tcp", [*flags, "--lora", f"c={c_decode}",
                                                                 "--worker-id", "lora-dec"]))
        workers.append(start_worker("prefill", str(base), "tcp", [*flags, "--lora", f"c={c_prefill}",
                                                                  "--worker-id", "lora-pre"]))
        got, refusals = asyncio.run(_run(workers[1].address, workers[0].address))
        idle = wait_idle(workers)
    finally:
        for w in workers:
            w.stop()
    assert got == expected
    at_reserve, at_prefill = refusals
    assert at_reserve.step == "Reserve" and at_prefill.step == "Prefill"
    for refused, role in ((at_reserve, "decode"), (at_prefill, "prefill")):
        assert refused.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "LoRA adapter 'c' differs between the workers" in refused.details and f"this {role} worker" in \
            refused.details, refused.details
    assert [(ld.used_blocks, ld.held_blocks, ld.waiting_for_kv) for ld in idle] == [(0, 0, 0), (0, 0, 0)]
    assert all(ld.free_blocks == ld.total_blocks for ld in idle)


async def _run(prefill_addr: str, decode_addr: str) -> tuple[list[list[int]], list[HandoffRefused]]:
    creds = Credentials.for_cluster()  # the workers' cluster token (Abort needs it)
    async with aio_channel(prefill_addr, creds) as pch, aio_channel(decode_addr, creds) as dch:
        prefill, decode = attach(pb_grpc.WorkerStub(pch), creds), attach(pb_grpc.WorkerStub(dch), creds)
        health = await prefill.Health(pb.HealthRequest(), timeout=30)
        prefill_hash = {info.name: info.content_hash for info in health.lora_adapters}
        assert set(prefill_hash) == {"a", "b", "c"}

        def ref(name: str, hashed: bool = True) -> pb.LoRARef | None:
            return pb.LoRARef(name=name, content_hash=prefill_hash[name] if hashed else "") if name else None

        async def refused(rid: str, lora: pb.LoRARef | None) -> HandoffRefused:
            with pytest.raises(HandoffRefused) as e:
                await _handoff(prefill, decode, rid, BATCH[0][0], lora)
            return e.value

        batch = [_handoff(prefill, decode, f"mix-{i}", prompt, ref(name)) for i, (prompt, name) in enumerate(BATCH)]
        results = await asyncio.gather(*batch, refused("c-hashed", ref("c")), refused("c-unhashed", ref("c", False)))
        return list(results[:len(BATCH)]), list(results[len(BATCH):])  # type: ignore[arg-type]
