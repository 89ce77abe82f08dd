"""Drain waits for prefill's KV transfers in flight, not just its scheduler.

A prefill worker whose finished prefills still stream KV out is not idle: its ``Drain`` answer (what the Ray
controller polls before removing a replica) counts those transfers, and on SIGTERM it exits only once they are
done. Real ``tandem worker`` processes (KV over TCP); the prefill worker's fault injection
(``--debug-transfer-delay-ms``) holds each transfer's last layer back for 3 s after the first token was returned.
"""

from __future__ import annotations

import random
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from proto.tandem.v1 import worker_pb2 as pb
from router.handoff import WorkerClient
from worker.launcher import start_worker

pytestmark = pytest.mark.slow
FLAGS = ["--num-kv-blocks", "256", "--threads", "1"]
DELAY_S = 3.0


def test_sigterm_during_a_transfer_exits_only_after_the_transfer_lands(
        checkpoint: Callable[[str], Path], hf_greedy: Callable[..., list[int]]) -> None:
    """Prefill returns its first token while the transfer is held back: ``Drain`` then reports it in flight
    (``Load`` too) and refuses new prefills; SIGTERM does not end the process while the transfer is pending; it
    exits cleanly once the transfer landed, and decode continues from that KV exactly as transformers does."""
    path = checkpoint("llama")
    prefill = start_worker("prefill", str(path), "tcp", [*FLAGS, "--debug-transfer-delay-ms", str(DELAY_S * 1000)])
    decode = start_worker("decode", str(path), "tcp", FLAGS)
    pre, dec = WorkerClient.connect(prefill.address), WorkerClient.connect(decode.address)
    try:
        prompt = [random.Random(3).randrange(1, 2000) for _ in range(80)]
        params = pb.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        res = dec.stub.Reserve(pb.ReserveRequest(request_id="d", prompt_token_ids=prompt, params=params,
                                                 lease_ms=60_000), timeout=60)
        first = pre.stub.Prefill(pb.PrefillRequest(request_id="d", prompt_token_ids=prompt, params=params,
                                                   destination=res.destination, lease_ms=60_000), timeout=60)
        returned = time.monotonic()
        assert pre.stub.Drain(pb.DrainRequest(), timeout=10).in_flight == 1
        assert pre.stub.Load(pb.LoadRequest(), timeout=10).transfers_in_flight == 1
        with pytest.raises(Exception, match="draining"):
            pre.stub.Prefill(pb.PrefillRequest(request_id="late", prompt_token_ids=prompt, params=params),
                             timeout=10)
        prefill.proc.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        assert prefill.proc.poll() is None, "the prefill worker exited with a transfer in flight"
        code = prefill.proc.wait(30)
        exited = time.monotonic()
        assert code == 0
        assert exited - returned >= DELAY_S * 0.9, f"exited {exited - returned:.1f}s after the prefill"
        tokens = [first.first_token_id]
        for chunk in dec.stub.Decode(pb.DecodeRequest(request_id="d", first_token_id=first.first_token_id,
                                                      first_token_sent=True), timeout=60):
            tokens.extend(chunk.token_ids)
        assert tokens == hf_greedy(path, prompt, 8)
        deadline = time.monotonic() + 20
        while (ld := dec.stub.Load(pb.LoadRequest(), timeout=10)).used_blocks and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ld.used_blocks == 0 and ld.waiting_for_kv == 0 and ld.running == 0, ld
    finally:
        pre.close()
        dec.close()
        prefill.stop()
        decode.stop()
