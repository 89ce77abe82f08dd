"""The KV transport's threads on CPUs of their own (``TransferConfig.io_cpus``, ``tandem worker --kv-io-cpus``).

What is asserted is where threads are allowed to run, read back from ``/proc`` (Linux), for every thread the
transport starts, the ones C++ libraries start included (gloo's loop and work threads, NIXL's and UCX's). What that
placement buys (decode ITL while transfers land) is a benchmark figure, in docs/benchmarks.md §2.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from bench.kv_peer import digest, make_caches
from kvtransfer import KVLayout, TransferConfig, TransferState, get_backend
from kvtransfer.io_cpus import check_cpus, io_affinity, parse_cpu_list, start_io_thread

HAS_NIXL = importlib.util.find_spec("nixl") is not None
LAYOUT = KVLayout("tiny-llama", "float32", num_layers=2, block_size=4, num_kv_heads=2, head_dim=8)
IO_CPU = max(os.sched_getaffinity(0))  # with 2+ CPUs a strict subset of what the test process may use
REPO_ROOT = Path(__file__).resolve().parents[1]


def allowed_cpus(pid: int | str, tid: int | str) -> str:
    for line in Path(f"/proc/{pid}/task/{tid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return line.split()[1]
    raise AssertionError("no Cpus_allowed_list")


def threads(pid: int | str = "self") -> dict[str, str]:
    """thread id → its name, for every live thread of ``pid``."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(FileNotFoundError):  # ended meanwhile
            out[tid] = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
    return out


def test_cpu_lists_parse_like_taskset_and_bad_ones_are_named() -> None:
    assert parse_cpu_list("3") == (3,)
    assert parse_cpu_list("0,2-3, 5") == (0, 2, 3, 5)
    assert parse_cpu_list("1-1,1") == (1,)
    for bad, words in (("", "names no CPU"), ("a", "'a' is not a CPU number"), ("3-1", "ascending"),
                       ("-1", "not a CPU number")):
        with pytest.raises(ValueError, match=words):
            parse_cpu_list(bad)
    with pytest.raises(ValueError, match=r"KV I/O CPUs \[4096\] do not exist on this host"):
        check_cpus((0, 4096))
    with pytest.raises(ValueError, match="io_cpus must be CPU numbers"):
        TransferConfig(io_cpus=(-1,))


def test_cpus_outside_the_cpuset_are_refused_at_start_and_a_late_refusal_leaves_the_thread_running(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The kernel refuses a mask outside the process's cgroup cpuset with EINVAL; at start-up that is a clear
    error, and a transport thread refused later still runs its work (unpinned, with a warning) instead of dying."""

    def refuse(pid: int, cpus: object) -> None:
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(os, "sched_setaffinity", refuse)
    with pytest.raises(ValueError, match=r"cannot be used by this process \(Invalid argument\); are they outside"):
        check_cpus((0,))
    ran = threading.Event()
    start_io_thread((0,), ran.set, "kv-refused").join(5)
    assert ran.is_set()
    assert "could not be pinned to CPUs [0] (Invalid argument); running unpinned" in caplog.text


def test_io_threads_and_the_threads_created_under_io_affinity_run_on_the_io_cpus() -> None:
    """A thread started by :func:`start_io_thread` pins itself; one created inside :func:`io_affinity` inherits the
    pin (as C++ threads do); the creating thread gets its own mask back afterwards."""
    before = os.sched_getaffinity(0)
    seen: dict[str, set[int]] = {}

    def record(name: str) -> None:
        seen[name] = os.sched_getaffinity(0)

    start_io_thread((IO_CPU,), record, "io", "pinned").join(5)
    with io_affinity((IO_CPU,)):
        t = threading.Thread(target=record, args=("inherited",))
        t.start()
    t.join(5)
    start_io_thread((), record, "io", "unpinned").join(5)
    assert seen == {"pinned": {IO_CPU}, "inherited": {IO_CPU}, "unpinned": before}
    assert os.sched_getaffinity(0) == before


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["tcp", "torch"] + (["nixl"] if HAS_NIXL else []))
def test_every_transport_thread_runs_on_the_io_cpus_through_a_real_transfer(backend: str) -> None:
    """A sender and a receiver with ``io_cpus`` in this process move a request exactly; every thread that appeared
    meanwhile (Python's, gloo's, NIXL's, UCX's, the TCP store's) may run only on the I/O CPU, and this thread's
    own mask is unchanged."""
    main_mask = os.sched_getaffinity(0)
    old = set(threads())
    cfg = TransferConfig(io_cpus=(IO_CPU,))
    sender_cls, receiver_cls = get_backend(backend)
    src, dst = make_caches(LAYOUT, 16, 5), make_caches(LAYOUT, 16, None)
    r = receiver_cls(cfg)
    r.register(dst, LAYOUT)
    s = sender_cls(cfg)
    s.register(src, LAYOUT)
    try:
        d = r.reserve("pin", [9, 3, 4], 12, time.time() + 30)
        s.start("pin", d, [0, 1, 2], time.time() + 30)
        for layer in range(LAYOUT.num_layers):
            s.send_layer("pin", layer)
        s.finish("pin")
        deadline = time.monotonic() + 30
        while not (s.poll("pin").finished and r.poll("pin").finished) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert s.poll("pin").state == r.poll("pin").state == TransferState.DONE, (s.poll("pin"), r.poll("pin"))
        assert digest(src, [0, 1, 2]) == digest(dst, [9, 3, 4])
        new = {tid: name for tid, name in threads().items() if tid not in old}
        assert new, "the transport started no thread"
        placed = {f"{name} ({tid})": allowed_cpus("self", tid) for tid, name in new.items()}
        assert set(placed.values()) == {str(IO_CPU)}, placed
        assert os.sched_getaffinity(0) == main_mask
    finally:
        s.close()
        r.close()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_decode_worker_started_with_kv_io_cpus_keeps_its_transport_threads_there(
        checkpoint: Callable[[str], Path]) -> None:
    """``tandem worker --kv-io-cpus``, real prefill and decode processes over tcp: after a disaggregated request,
    the decode worker's KV threads (named ``kv-*``) are on the I/O CPU and its other threads (engine, gRPC) are
    not; a CPU the host lacks is refused at start with exit code 2, before the model loads."""
    from router.handoff import WorkerClient, disaggregated_generate
    from worker.launcher import start_worker

    model = str(checkpoint("llama"))
    bad = subprocess.run([sys.executable, "-m", "cli.main", "worker", "--role", "decode", "--model", model,
                          "--kv-io-cpus", "4096"], capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
    assert bad.returncode == 2
    assert "--kv-io-cpus: KV I/O CPUs [4096] do not exist on this host" in bad.stderr

    pre = start_worker("prefill", model, "tcp")
    dec = start_worker("decode", model, "tcp", ["--kv-io-cpus", str(IO_CPU)])
    p, d = WorkerClient.connect(pre.address), WorkerClient.connect(dec.address)
    try:
        from proto.tandem.v1 import worker_pb2 as pb

        params = pb.SamplingParams(max_tokens=4, ignore_eos=True)
        replies = list(disaggregated_generate(p, d, "pinned", [5, 6, 7, 8, 9], params))
        assert sum(len(x.token_ids) for x in replies) == 4
        names = threads(dec.proc.pid)
        kv = {f"{n} ({tid})": allowed_cpus(dec.proc.pid, tid) for tid, n in names.items() if n.startswith("kv-")}
        assert any(n.startswith("kv-tcp-recv") for n in kv), kv  # the connection's receive thread
        assert set(kv.values()) == {str(IO_CPU)}, kv
        main = allowed_cpus(dec.proc.pid, dec.proc.pid)
        assert main != str(IO_CPU) or len(os.sched_getaffinity(0)) == 1
    finally:
        p.close()
        d.close()
        pre.stop()
        dec.stop()
