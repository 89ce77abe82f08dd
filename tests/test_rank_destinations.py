"""The hand-off of a decode replica with TP ranks (one destination per decode rank) and rank 0's ledger of what its
follower ranks still owe, as units: no process, no transport.

``Reserve`` answers one destination as itself (as a single-rank decode always did) and several as a JSON array;
prefill's ``Bootstrap`` takes both and refuses, naming the problem, anything but exactly one destination per rank of
one decode TP degree, for one request, of a compatible layout.
"""

from __future__ import annotations

import json
import time

import pytest

from decode_worker.ranks import encode_destinations
from engine.parallel.ledger import RankLedger
from kvtransfer.base import DestinationInfo
from kvtransfer.layout import CompatibilityError, KVLayout
from prefill_worker.connector import Bootstrap

LAYOUT = KVLayout(model_id="llama:abc", dtype="float32", num_layers=4, block_size=16, num_kv_heads=4, head_dim=32)


def _dest(tp: int, rank: int, rid: str = "r", layout: KVLayout = LAYOUT) -> DestinationInfo:
    lay = KVLayout(**{**layout.to_dict(), "tp_size": tp, "tp_rank": rank})  # type: ignore[arg-type]
    return DestinationInfo(backend="tcp", request_id=rid, transfer_id=7 + rank, endpoint=f"127.0.0.1:{9000 + rank}",
                           layout=lay, dst_block_ids=(3, 4), num_tokens=20, deadline_s=time.time() + 30,
                           compat_hash=lay.compat_hash())


def test_one_destination_travels_as_itself_and_several_as_a_list_rank_by_rank() -> None:
    boot = Bootstrap(KVLayout(**{**LAYOUT.to_dict(), "tp_size": 2}))  # type: ignore[arg-type]  # prefill TP=2
    single = _dest(1, 0)
    assert encode_destinations([single]) == single.to_bytes()
    assert boot.accept(single.to_bytes()) == (single,)
    pair = [_dest(2, 0), _dest(2, 1)]
    wire = encode_destinations(pair)
    assert wire.startswith(b"[") and boot.accept(wire) == tuple(pair)


@pytest.mark.parametrize(("dests", "message"), [
    ([_dest(2, 0)], "one per decode rank of tp=2"),
    ([_dest(2, 0), _dest(2, 0)], "one per decode rank of tp=2"),
    ([_dest(2, 0), _dest(4, 1)], "one per decode rank"),
    ([_dest(2, 0), _dest(2, 1, rid="other")], "different requests"),
])
def test_destinations_that_are_not_one_per_rank_of_one_request_are_refused(dests: list[DestinationInfo],
                                                                           message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Bootstrap(LAYOUT).accept(encode_destinations(dests) if len(dests) > 1 else b"[" + dests[0].to_bytes() + b"]")


def test_malformed_or_incompatible_destinations_are_refused_naming_why() -> None:
    boot = Bootstrap(LAYOUT)
    with pytest.raises(ValueError, match="not valid JSON"):
        boot.accept(b"[{")
    with pytest.raises(ValueError, match="1 to 64"):
        boot.accept(json.dumps([{}] * 65).encode())
    other = KVLayout(**{**LAYOUT.to_dict(), "dtype": "bfloat16"})  # type: ignore[arg-type]
    with pytest.raises(CompatibilityError, match="dtype"):
        boot.accept(encode_destinations([_dest(2, 0, layout=other), _dest(2, 1, layout=other)]))


def test_the_ledger_waits_for_every_rank_keeps_the_first_failure_and_drops_late_reports() -> None:
    woken: list[int] = []
    ledger = RankLedger(wake=lambda: woken.append(1))
    ledger.open("r", [1, 2, 3])
    ledger.settle(1, "r", True)
    ledger.settle(2, "r", False, "rank 2: peer gone")
    assert ledger.owes("r") and ledger.failure("r") == "rank 2: peer gone"
    ledger.settle(3, "r", False, "rank 3: later")
    assert not ledger.owes("r") and ledger.failure("r") == "rank 2: peer gone" and len(woken) == 3
    assert ledger.close("r") == set() and len(ledger) == 0
    ledger.settle(1, "r", False, "late")  # after close: dropped
    assert ledger.failure("r") is None and len(ledger) == 0
    released = RankLedger(drop_settled=True)
    released.open("q", [1, 2])
    released.settle(1, "q", True)
    assert len(released) == 1
    released.settle(2, "q", True)
    assert len(released) == 0
