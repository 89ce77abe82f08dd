"""KV transfer bandwidth: each backend between two processes, next to the raw transports it is built on.

For each request size (total bytes of all layers, K and V) the bench moves one request per repetition from a prefill
child into a decode child, timed on the sender from ``start`` to the receiver's ACK (so the result includes the
handshake of a warm connection and the per-layer bookkeeping, i.e. what a request actually pays). The request's
blocks are a handful of runs on each side (runs of 16 source / 32 destination blocks with gaps), as an engine's
block tables usually are.

Baselines, same bytes:

- ``raw_nixl``: two plain NIXL agents (no Tandem code), one contiguous descriptor, WRITE + notification, on the
  UCX transports the nixl backend uses (``TransferConfig.ucx_tls``; by default UCX's choice, shared memory
  between processes on one host); when the config names transports, ``raw_nixl_ucx_default`` is the same on
  UCX's default, for reference. These agents have NIXL's default progress thread, which spins on a core with no
  pause, so on a host with few cores the baseline is bimodal (the spinning threads get a core or not; figures in
  docs/benchmarks.md §2). ``raw_nixl_no_progress_thread`` is the same transfer by agents without it, for
  reference: the nixl backend's agents keep a progress thread that pauses ``nixl_progress_delay_us`` between
  passes, because a spinning one would take a core from decode. ``raw_nixl_acked`` is timed as the backends are,
  to the receiver's acknowledgement: agents without progress threads, the target polling its notifications without
  pause and answering each WRITE's with a one-byte notification that the initiator polls for. A backend cannot
  poll that way: a Python thread that never blocks holds the GIL against the engine's forward pass;
- ``raw_socket``: one TCP ``sendall`` / ``recv_into`` over loopback plus a one-byte ack;
- ``raw_gloo``: one contiguous gloo ``send`` / ``recv`` plus a one-byte ack, on a 2-rank group made as the torch
  backend makes its groups (the transport that backend is built on, on CPU);
- ``memcpy``: in-process ``torch.Tensor.copy_`` (the ceiling for anything that copies on the CPU).

Ratios: every backend against ``raw_nixl``, ``tcp`` against ``raw_socket`` and ``torch`` against ``raw_gloo``; and
``raw_socket`` and ``raw_gloo`` against ``raw_nixl``, the carriers' own ceilings: tcp and the torch backend on CPU
(gloo) move every byte over a loopback TCP socket, so no amount of work in those backends takes them past what a
plain socket or gloo pair reaches against NIXL's shared memory. Wired into ``tandem bench kv``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import multiprocessing as mp
import os
import socket
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

from bench.kv_peer import Peer
from kvtransfer.config import TransferConfig
from kvtransfer.layout import KVLayout

_CTX = mp.get_context("spawn")
MIB = 1 << 20
BENCH_LAYOUT = KVLayout("bench", "float16", num_layers=4, block_size=16, num_kv_heads=8, head_dim=128)


def _request_bytes_per_block(layout: KVLayout) -> int:
    return 2 * layout.num_layers * layout.block_bytes


def _ids(n: int, run: int, offset: int = 0) -> list[int]:
    """``n`` block ids in runs of ``run`` consecutive ids separated by one-block gaps."""
    return [(i // run) * (run + 1) + i % run + offset for i in range(n)]


def repeats_for(size_mib: int, repeats: int) -> int:
    """Timed requests at ``size_mib``: at least ``repeats``, and at least 64 MiB moved in all. A small request
    takes a millisecond or two, about what one wake-up delayed by another process costs, so small sizes get more
    samples (the same count for every side) to keep their medians steady."""
    return max(repeats, 64 // max(size_mib, 1))


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("nan")


def _reap(proc: Any) -> None:
    """Join a baseline's child process; kill -9 it (ours, by PID) if it has not ended in 10 s."""
    proc.join(10)
    if proc.is_alive() and proc.pid:
        os.kill(proc.pid, 9)
        proc.join(5)


# ------------------------------------------------------------------------------------------------ baselines
def bench_memcpy(nbytes: int, repeats: int) -> float:
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    for _ in range(3):  # fault the pages in and wake the thread pool
        dst.copy_(src)
    times = []
    for _ in range(max(repeats, 10)):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return _gbps(nbytes, statistics.median(times))


def _socket_sink(conn: Any, nbytes: int, repeats: int) -> None:
    srv = socket.create_server(("127.0.0.1", 0))
    srv.settimeout(30)
    conn.send(srv.getsockname()[1])
    sock, _ = srv.accept()
    sock.settimeout(30)
    buf = memoryview(bytearray(nbytes))
    for _ in range(repeats + 1):
        off = 0
        while off < nbytes:
            got = sock.recv_into(buf[off:], nbytes - off)
            if got == 0:
                return
            off += got
        sock.sendall(b"k")
    sock.close()
    srv.close()


def bench_raw_socket(nbytes: int, repeats: int) -> float:
    parent, child = _CTX.Pipe()
    proc = _CTX.Process(target=_socket_sink, args=(child, nbytes, repeats), daemon=True)
    proc.start()
    try:
        if not parent.poll(60):
            raise TimeoutError("raw socket sink did not start")
        port = parent.recv()
        sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        data = memoryview(bytearray(os.urandom(1024)) * (nbytes // 1024 + 1))[:nbytes]
        ack = bytearray(1)
        times = []
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            sock.sendall(data)
            sock.recv_into(ack, 1)
            if i:
                times.append(time.perf_counter() - t0)
        sock.close()
        return _gbps(nbytes, statistics.median(times))
    finally:
        _reap(proc)


def _gloo_sink(conn: Any, port: int, nbytes: int, repeats: int) -> None:
    from kvtransfer.torch_dist import make_group, store_client

    group = make_group(store_client(f"127.0.0.1:{port}", 30.0), 1, False, 30.0, "127.0.0.1")
    buf = torch.empty(nbytes, dtype=torch.uint8)
    ack = torch.ones(1, dtype=torch.uint8)
    pending = group.recv([buf], 0, 0)
    for i in range(repeats + 1):
        pending.wait()
        if i < repeats:  # the next recv is posted before the ack, so no send waits for it
            pending = group.recv([buf], 0, 0)
        group.send([ack], 0, 1).wait()
    conn.send(int(buf[0]))


def bench_raw_gloo(nbytes: int, repeats: int) -> float:
    """A plain gloo pair in two processes (the torch backend's transport): one contiguous ``send`` and an ack."""
    from torch.distributed import TCPStore

    from kvtransfer.torch_dist import make_group, timedelta_s

    store = TCPStore("127.0.0.1", 0, None, True, timedelta_s(30.0), wait_for_workers=False)
    parent, child = _CTX.Pipe()
    proc = _CTX.Process(target=_gloo_sink, args=(child, store.port, nbytes, repeats), daemon=True)
    proc.start()
    try:
        group = make_group(store, 0, False, 30.0, "127.0.0.1")
        data = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
        ack = torch.empty(1, dtype=torch.uint8)
        times = []
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            acked = group.recv([ack], 1, 1)
            group.send([data], 1, 0).wait()
            acked.wait()
            if i:
                times.append(time.perf_counter() - t0)
        if not parent.poll(30) or parent.recv() != int(data[0]):
            raise RuntimeError("raw gloo sink did not receive the bytes sent")
        return _gbps(nbytes, statistics.median(times))
    finally:
        _reap(proc)


def _nixl_agent(name: str, tls: str, progress_thread: bool = True) -> Any:
    """A plain agent on loopback; ``tls`` is applied to ``UCX_TLS`` (``""``: UCX's default transports).
    ``progress_thread``: NIXL's default, a thread that spins on UCX progress with no pause (a whole core)."""
    os.environ["UCX_NET_DEVICES"] = "lo"
    if tls:
        os.environ["UCX_TLS"] = tls
    else:
        os.environ.pop("UCX_TLS", None)
    from kvtransfer.nixl_agent import import_nixl_api

    api = import_nixl_api()
    return api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"]))


def _nixl_target(conn: Any, nbytes: int, repeats: int, tls: str, progress_thread: bool, acked: bool) -> None:
    agent = _nixl_agent(f"raw-target-{os.getpid()}", tls, progress_thread)
    buf = torch.zeros(nbytes, dtype=torch.uint8)
    agent.register_memory(buf)
    conn.send((agent.get_agent_metadata(), buf.data_ptr()))
    initiator = agent.add_remote_agent(conn.recv()) if acked else None
    got = 0
    end = time.monotonic() + 120
    while got < repeats + 1 and time.monotonic() < end:
        for msgs in agent.get_new_notifs().values():
            got += len(msgs)
            if initiator is not None:
                for _ in msgs:
                    agent.send_notif(initiator, b"k")
        if initiator is None:
            time.sleep(0.0005)
    conn.send(got)


def bench_raw_nixl(nbytes: int, repeats: int, tls: str = "", progress_thread: bool = True,
                   acked: bool = False) -> float:
    """Plain NIXL agents in two processes: one contiguous WRITE with a notification, timed to DONE.

    ``tls`` is the ``UCX_TLS`` both agents use (``""``: UCX's default). The caller's environment is restored.
    ``progress_thread=False`` makes both agents without NIXL's spinning progress thread (the initiator's state
    checks and the target's notification polls drive UCX instead). ``acked``: timed instead until the target,
    polling its notifications without pause, has seen the WRITE's notification and its one-byte reply has come
    back, as the socket and gloo baselines and every backend are timed (a backend's request is done when the
    receiver says the bytes landed, not when the initiator's WRITE completes).
    """
    saved = os.environ.get("UCX_TLS")
    parent, child = _CTX.Pipe()
    proc = _CTX.Process(target=_nixl_target, args=(child, nbytes, repeats, tls, progress_thread, acked), daemon=True)
    proc.start()
    try:
        agent = _nixl_agent(f"raw-initiator-{os.getpid()}-{time.monotonic_ns()}", tls, progress_thread)
        src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
        agent.register_memory(src)
        if not parent.poll(60):
            raise TimeoutError("raw NIXL target did not start")
        metadata, addr = parent.recv()
        remote = agent.add_remote_agent(metadata)
        if acked:
            parent.send(agent.get_agent_metadata())
        local = agent.get_xfer_descs([(src.data_ptr(), nbytes, 0)], "DRAM")
        target = agent.get_xfer_descs([(addr, nbytes, 0)], "DRAM")
        times = []
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            handle = agent.initialize_xfer("WRITE", local, target, remote, b"raw")
            state = agent.transfer(handle)
            deadline = time.monotonic() + 60
            while state == "PROC" and time.monotonic() < deadline:
                state = agent.check_xfer_state(handle)
            replied = not acked
            while not replied and state == "DONE" and time.monotonic() < deadline:
                replied = bool(agent.get_new_notifs())
            elapsed = time.perf_counter() - t0
            handle.release()
            if state != "DONE":
                raise RuntimeError(f"raw NIXL transfer ended in {state}")
            if not replied:  # an ack that never came is a failed sample, not a 60 s one
                raise RuntimeError("raw NIXL target did not acknowledge the WRITE within 60 s")
            if i:
                times.append(elapsed)
        with contextlib.suppress(Exception):
            parent.poll(10)
        return _gbps(nbytes, statistics.median(times))
    finally:
        if saved is None:
            os.environ.pop("UCX_TLS", None)
        else:
            os.environ["UCX_TLS"] = saved
        _reap(proc)


# ------------------------------------------------------------------------------------------------- backends
def transfer_once(r: Peer, s: Peer, rid: str, src: list[int], dst: list[int], num_tokens: int, what: str) -> float:
    """One request from peer ``s``'s blocks ``src`` into peer ``r``'s ``dst``: reserve, transfer, release; the
    sender's elapsed seconds. RuntimeError naming ``what`` if it did not complete."""
    dest = r.call("reserve", rid, dst, num_tokens, time.time() + 60)
    st, err, elapsed = s.call("transfer", rid, [dest], src, time.time() + 60, 60.0, timeout_s=90)
    if st != 2:
        raise RuntimeError(f"{what} transfer failed: {err}")
    r.call("release", rid)
    return float(elapsed)


def bench_backend(backend: str, sizes_mib: Sequence[int], repeats: int, layout: KVLayout = BENCH_LAYOUT) -> dict:
    """GB/s of ``backend`` per size, two child processes, median of :func:`repeats_for` requests (after one warm-up
    request)."""
    per_block = _request_bytes_per_block(layout)
    counts = {s: max(1, s * MIB // per_block) for s in sizes_mib}
    most = max(counts.values())
    num_blocks = max(_ids(most, 16)[-1], _ids(most, 32)[-1]) + 2
    r = Peer(backend, "receiver", layout, num_blocks, wait=False)
    s = Peer(backend, "sender", layout, num_blocks, seed=0, wait=False)
    out: dict[int, float] = {}
    try:
        r.wait_ready()
        s.wait_ready()
        for size in sizes_mib:
            n = counts[size]
            src, dst = _ids(n, 16), _ids(n, 32)
            times = []
            for i in range(repeats_for(size, repeats) + 1):
                elapsed = transfer_once(r, s, f"bench-{size}-{i}", src, dst, n * layout.block_size,
                                        f"{backend} {size} MiB")
                if i:
                    times.append(elapsed)
            out[size] = _gbps(n * per_block, statistics.median(times))
    finally:
        s.close()
        r.close()
    return out


def run_kv_bench(
    sizes_mib: Sequence[int] = (1, 8, 64),
    backends: Sequence[str] = ("tcp", "torch", "nixl"),
    repeats: int = 5,
) -> dict[str, Any]:
    """Bandwidth (GB/s) of each backend and of the baselines per request size, plus ratios.

    Returns ``{"sizes_mib", "gbps": {size: {name: GB/s}}, "ratios": {size: {"x/y": ratio}}, "layout", "repeats"}``.
    ``nixl`` and ``raw_nixl`` are skipped (``None``) when NIXL is not installed.
    """
    has_nixl = importlib.util.find_spec("nixl") is not None
    nixl_tls = TransferConfig().ucx_tls
    gbps: dict[int, dict[str, float | None]] = {s: {} for s in sizes_mib}
    per_block = _request_bytes_per_block(BENCH_LAYOUT)
    for size in sizes_mib:
        nbytes = max(1, size * MIB // per_block) * per_block
        n = repeats_for(size, repeats)
        gbps[size]["memcpy"] = bench_memcpy(nbytes, n)
        gbps[size]["raw_socket"] = bench_raw_socket(nbytes, n)
        if "torch" in backends:
            gbps[size]["raw_gloo"] = bench_raw_gloo(nbytes, n)
        # raw NIXL on the transports the nixl backend uses here, and on UCX's default (shared memory on one host)
        gbps[size]["raw_nixl"] = bench_raw_nixl(nbytes, n, nixl_tls) if has_nixl else None
        if has_nixl and nixl_tls:
            gbps[size]["raw_nixl_ucx_default"] = bench_raw_nixl(nbytes, n, "")
        # the same without NIXL's progress threads, which spin a core each (two of these 2), see the module doc
        gbps[size]["raw_nixl_no_progress_thread"] = (bench_raw_nixl(nbytes, n, nixl_tls, progress_thread=False)
                                                      if has_nixl else None)
        # ... and timed to the target's acknowledgement, as the backends are (two threads polling without pause)
        gbps[size]["raw_nixl_acked"] = (bench_raw_nixl(nbytes, n, nixl_tls, progress_thread=False, acked=True)
                                        if has_nixl else None)
    for backend in backends:
        if backend == "nixl" and not has_nixl:
            for size in sizes_mib:
                gbps[size]["nixl"] = None
            continue
        for size, value in bench_backend(backend, sizes_mib, repeats).items():
            gbps[size][backend] = value
    ratios: dict[int, dict[str, float | None]] = {}
    for size, row in gbps.items():
        ratios[size] = {}
        for backend in backends:
            if row.get(backend) is not None and row.get("raw_nixl"):
                ratios[size][f"{backend}/raw_nixl"] = row[backend] / row["raw_nixl"]  # type: ignore[operator]
        for ref in ("raw_nixl_no_progress_thread", "raw_nixl_acked"):
            if row.get("nixl") is not None and row.get(ref):
                ratios[size][f"nixl/{ref}"] = row["nixl"] / row[ref]  # type: ignore[operator]
        if row.get("tcp") is not None and row.get("raw_socket"):
            ratios[size]["tcp/raw_socket"] = row["tcp"] / row["raw_socket"]  # type: ignore[operator]
        if row.get("torch") is not None and row.get("raw_gloo"):
            ratios[size]["torch/raw_gloo"] = row["torch"] / row["raw_gloo"]  # type: ignore[operator]
        # Carrier ceilings: tcp and gloo (the torch backend on CPU) move their bytes over loopback TCP, so a plain
        # socket's and a plain gloo pair's rate against raw NIXL bound what those backends can reach against it.
        for carrier in ("raw_socket", "raw_gloo"):
            if row.get(carrier) and row.get("raw_nixl"):
                ratios[size][f"{carrier}/raw_nixl"] = row[carrier] / row["raw_nixl"]  # type: ignore[operator]
    return {"sizes_mib": list(sizes_mib), "gbps": gbps, "ratios": ratios, "layout": BENCH_LAYOUT.to_dict(),
            "repeats": repeats, "repeats_per_size": {s: repeats_for(s, repeats) for s in sizes_mib},
            "nixl_ucx_tls": nixl_tls or "UCX default"}


def format_kv_bench(result: dict[str, Any]) -> str:
    """A plain-text table of :func:`run_kv_bench`'s result."""
    names: list[str] = []
    for row in result["gbps"].values():
        names += [n for n in row if n not in names]
    lines = ["size_MiB " + " ".join(f"{n:>11}" for n in names)]
    for size, row in result["gbps"].items():
        cells = [f"{row[n]:11.2f}" if row.get(n) is not None else f"{'-':>11}" for n in names]
        lines.append(f"{size:>8} " + " ".join(cells))
    lines.append("ratios:")
    for size, row in result["ratios"].items():
        lines.append(f"{size:>8} " + "  ".join(f"{k}={v:.2f}" for k, v in row.items()))
    return "\n".join(lines)


if __name__ == "__main__":
    print(format_kv_bench(run_kv_bench(repeats=3)))
