"""Where a KV transfer's time goes: CPU time, run-queue waits and time slices per request, per process, next to a
raw socket moving the same bytes between two processes.

Wall time on a shared 2-vCPU host swings with everyone else's load; the CPU a request costs does much less. Each
side's threads are read from ``/proc/<pid>/task/*/schedstat`` (nanoseconds on the CPU, nanoseconds waiting on a
run queue, time slices, i.e. how often a thread was put on a CPU: wake-ups) before and after ``n`` timed
requests, so the figures cover every thread of the two processes, whatever library started it.

``python3 -m bench.kv_cpu --sizes 1,8 --backends tcp --n 64 [--python-writer]`` prints it (:func:`run_cpu_bench`);
used for the issue 32 A/B in docs/benchmarks.md §2. Both sides' figures include the harness's pipe calls (the
receiver's ``reserve`` and ``release``, the sender's ``transfer``), which the raw socket has none of.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import statistics
import time
from collections.abc import Sequence
from typing import Any

from bench.kv_bandwidth import BENCH_LAYOUT, MIB, _ids, _reap, _request_bytes_per_block, transfer_once
from bench.kv_peer import Peer
from kvtransfer.layout import KVLayout

_CTX = mp.get_context("spawn")


def schedstat(pid: int) -> tuple[int, int, int]:
    """``(cpu_ns, runqueue_wait_ns, slices)`` summed over every live thread of ``pid``."""
    cpu = wait = slices = 0
    base = f"/proc/{pid}/task"
    for tid in os.listdir(base):
        try:
            with open(f"{base}/{tid}/schedstat") as f:
                a, b, c = (int(x) for x in f.read().split()[:3])
        except (OSError, ValueError):
            continue  # a thread that ended between the listing and the read
        cpu, wait, slices = cpu + a, wait + b, slices + c
    return cpu, wait, slices


def _delta(before: tuple[int, int, int], after: tuple[int, int, int], n: int) -> dict[str, float]:
    return {"cpu_ms": (after[0] - before[0]) / n / 1e6, "runq_wait_ms": (after[1] - before[1]) / n / 1e6,
            "slices": (after[2] - before[2]) / n}


def measure_backend(backend: str, size_mib: int, n: int, layout: KVLayout = BENCH_LAYOUT,
                    config: dict[str, Any] | None = None) -> dict[str, Any]:
    """``n`` requests of ``size_mib`` through ``backend`` between two child processes (after 5 warm-up requests):
    median wall ms, and per request each side's CPU ms, run-queue wait ms and time slices."""
    per_block = _request_bytes_per_block(layout)
    count = max(1, size_mib * MIB // per_block)
    num_blocks = max(_ids(count, 16)[-1], _ids(count, 32)[-1]) + 2
    r = Peer(backend, "receiver", layout, num_blocks, wait=False, config=config)
    s = Peer(backend, "sender", layout, num_blocks, seed=0, wait=False, config=config)
    src, dst = _ids(count, 16), _ids(count, 32)
    try:
        r.wait_ready()
        s.wait_ready()
        times: list[float] = []
        before: dict[str, tuple[int, int, int]] = {}
        for i in range(n + 5):
            if i == 5:
                before = {"sender": schedstat(s.pid), "receiver": schedstat(r.pid)}
            elapsed = transfer_once(r, s, f"cpu-{size_mib}-{i}", src, dst, count * layout.block_size,
                                    f"{backend} {size_mib} MiB")
            if i >= 5:
                times.append(elapsed)
        after = {"sender": schedstat(s.pid), "receiver": schedstat(r.pid)}
    finally:
        s.close()
        r.close()
    # The harness's pipe round trips (reserve, transfer, release) are in both sides' figures; the raw socket has none.
    return {"wall_ms": statistics.median(times) * 1e3, "bytes": count * per_block,
            **{side: _delta(before[side], after[side], n) for side in ("sender", "receiver")}}


def _raw_sink(conn: Any, nbytes: int, total: int) -> None:
    srv = socket.create_server(("127.0.0.1", 0))
    conn.send(srv.getsockname()[1])
    sock, _ = srv.accept()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = memoryview(bytearray(nbytes))
    for _ in range(total):
        off = 0
        while off < nbytes:
            got = sock.recv_into(buf[off:], nbytes - off, socket.MSG_WAITALL)
            if got == 0:
                return
            off += got
        sock.sendall(b"k")
    conn.recv()  # the parent reads our schedstat before we exit
    sock.close()


def measure_raw_socket(nbytes: int, n: int) -> dict[str, Any]:
    """The same bytes as one ``sendall`` and a one-byte ack between this process and a sink process (this
    process's other threads, idle here, are counted too); per request wall and CPU as above."""
    parent, child = _CTX.Pipe()
    proc = _CTX.Process(target=_raw_sink, args=(child, nbytes, n + 5), daemon=True)
    proc.start()
    try:
        if not parent.poll(60):
            raise TimeoutError("raw socket sink did not start")
        sock = socket.create_connection(("127.0.0.1", parent.recv()), timeout=30)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        data = memoryview(bytearray(os.urandom(1024)) * (nbytes // 1024 + 1))[:nbytes]
        ack = bytearray(1)
        me = os.getpid()
        times: list[float] = []
        before: dict[str, tuple[int, int, int]] = {}
        for i in range(n + 5):
            if i == 5:
                before = {"sender": schedstat(me), "receiver": schedstat(proc.pid or 0)}
            t0 = time.perf_counter()
            sock.sendall(data)
            sock.recv_into(ack, 1)
            if i >= 5:
                times.append(time.perf_counter() - t0)
        after = {"sender": schedstat(me), "receiver": schedstat(proc.pid or 0)}
        parent.send("done")
        sock.close()
    finally:
        _reap(proc)
    return {"wall_ms": statistics.median(times) * 1e3, "bytes": nbytes,
            **{side: _delta(before[side], after[side], n) for side in ("sender", "receiver")}}


def run_cpu_bench(sizes_mib: Sequence[int] = (1, 8), backends: Sequence[str] = ("tcp",), n: int = 64,
                  config: dict[str, Any] | None = None) -> dict[str, Any]:
    """Per size: the raw socket, then each backend (``config``: the backends' ``TransferConfig`` fields)."""
    out: dict[str, Any] = {"n": n, "rows": {}}
    per_block = _request_bytes_per_block(BENCH_LAYOUT)
    for size in sizes_mib:
        nbytes = max(1, size * MIB // per_block) * per_block
        row = {"raw_socket": measure_raw_socket(nbytes, n)}
        for backend in backends:
            row[backend] = measure_backend(backend, size, n, config=config)
        out["rows"][size] = row
    return out


def format_cpu_bench(result: dict[str, Any]) -> str:
    lines = [f"{'size':>5} {'path':>10} {'wall_ms':>8} {'snd_cpu':>8} {'rcv_cpu':>8} {'snd_rq':>7} {'rcv_rq':>7} "
             f"{'snd_sl':>7} {'rcv_sl':>7}"]
    for size, row in result["rows"].items():
        for name, m in row.items():
            s, r = m["sender"], m["receiver"]
            lines.append(f"{size:>5} {name:>10} {m['wall_ms']:8.3f} {s['cpu_ms']:8.3f} {r['cpu_ms']:8.3f} "
                         f"{s['runq_wait_ms']:7.3f} {r['runq_wait_ms']:7.3f} {s['slices']:7.1f} {r['slices']:7.1f}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    import argparse
    import json

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1,8", help="request sizes in MiB")
    p.add_argument("--backends", default="tcp")
    p.add_argument("--n", type=int, default=64, help="timed requests per size and path")
    p.add_argument("--python-writer", action="store_true", help="TransferConfig(native_io=False)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    result = run_cpu_bench([int(x) for x in args.sizes.split(",")], args.backends.split(","), args.n,
                           {"native_io": False} if args.python_writer else None)
    print(json.dumps(result) if args.json else format_cpu_bench(result))


if __name__ == "__main__":
    main()
