"""Admission control's arithmetic (router/admission.py), on a worker pool whose workers are set by hand (no process
is needed to count): the bound of each tier grows with its available workers, the prefill tier counts only when it
has workers, the workers' own queues refuse too, and every refusal is a 429 with ``Retry-After``, counted per tier.
The end-to-end overload test is tests/test_gateway_overload.py."""

from __future__ import annotations

import pytest

from proto.tandem.v1 import worker_pb2 as pb
from router.admission import Admission, AdmissionConfig, retry_after_header
from router.api_error import APIError
from router.metrics import RouterMetrics
from router.pool import Worker, WorkerPool


def _pool(decode: int, prefill: int, waiting: int = 0) -> WorkerPool:
    pool = WorkerPool([])
    for i in range(decode + prefill):
        w = Worker(f"127.0.0.1:{7000 + i}")
        w.role = "decode" if i < decode else "prefill"
        w.healthy = True
        w.last_load = pb.LoadResponse(waiting=waiting)
        pool.workers[w.address] = w
    return pool


def _fill(adm: Admission) -> int:
    """Admit until refused; return how many got in."""
    n = 0
    while True:
        try:
            adm.enter()
        except APIError as e:
            assert e.status == 429 and e.retry_after and e.err_type == "rate_limit_error"
            return n
        n += 1


def test_the_bound_is_per_worker_of_each_tier_and_every_refusal_is_counted() -> None:
    cfg = AdmissionConfig(max_per_decode_worker=3, max_per_prefill_worker=2)
    pool = _pool(decode=2, prefill=0)
    metrics = RouterMetrics(pool)
    adm = Admission(cfg, pool, metrics)
    assert _fill(adm) == 6  # 3 per decode worker, no prefill tier
    adm.leave()
    adm.enter()  # a slot freed is a slot taken
    assert metrics.admission_rejected.labels("decode").value == 1

    pool = _pool(decode=2, prefill=1)
    metrics = RouterMetrics(pool)
    adm = Admission(cfg, pool, metrics)
    assert _fill(adm) == 2  # the one prefill worker bounds it
    assert metrics.admission_rejected.labels("prefill").value == 1


def test_the_workers_own_queues_refuse_and_no_decode_worker_is_503() -> None:
    pool = _pool(decode=2, prefill=0, waiting=5)
    adm = Admission(AdmissionConfig(max_waiting_per_worker=4), pool, RouterMetrics(pool))
    with pytest.raises(APIError) as e:
        adm.enter()
    assert e.value.status == 429 and "queued" in e.value.message
    empty = _pool(decode=0, prefill=1)
    with pytest.raises(APIError) as e:
        Admission(AdmissionConfig(), empty, RouterMetrics(empty)).enter()
    assert e.value.status == 503 and e.value.retry_after


def test_config_and_retry_after() -> None:
    for bad in ({"max_per_decode_worker": 0}, {"max_per_prefill_worker": -1}, {"retry_after_s": 0}):
        with pytest.raises(ValueError):
            AdmissionConfig(**bad)  # type: ignore[arg-type]
    assert [retry_after_header(s) for s in (0.2, 1.0, 1.5)] == ["1", "1", "2"]
