"""``tandem bench kv``: KV transfer bandwidth, compute/transfer overlap, and decode ITL under incoming transfers.

1. **Bandwidth** (:func:`bench.kv_bandwidth.run_kv_bench`): each backend between two processes for 1, 8 and 64 MiB
   requests, beside a raw NIXL transfer of the same bytes, a raw socket and an in-process memcpy.
2. **Overlap**: a real decode worker process and a real prefill worker (gRPC server included) on the given model,
   in a fresh process per backend (spawned, as a worker is: the bandwidth phase's agents, threads and process
   groups must not share the prefill side's cores or GIL). A ``--prompt-len`` prompt goes through the normal
   handoff; the prefill worker records when the last layer's forward finished and when the transfer was
   acknowledged. The same blocks are then sent again with no compute running (``serial``).
   ``overlap = 1 - exposed / serial``: the fraction of the transfer that was hidden behind prefill compute. With
   ``--repeats N``, N fresh prompts (no prefix-cache hits between them); the medians are reported, every run listed.
3. **Decode ITL** (:func:`measure_itl`): four decode streams on a decode worker, alone, then alternately while the
   prefill worker computes long prompts for nobody (the control) and while it pushes their KV into this decode
   worker. p50/p99 inter-token latency for each, and ``transfer_cost_p50`` = loaded / control - 1. With two or
   more CPUs the two workers are pinned to disjoint CPU sets (half each, with as many engine threads) and the
   load client to the prefill half, as separate hosts would be.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import threading
import time
from collections.abc import Callable
from concurrent import futures
from typing import Any

import grpc
import psutil

from proto.tandem.v1 import worker_pb2 as pb
from proto.tandem.v1 import worker_pb2_grpc as pb_grpc
from router.handoff import WorkerClient, disaggregated_generate
from worker.launcher import start_worker


def _params(max_tokens: int) -> pb.SamplingParams:
    return pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _drain(stream: Any) -> list[float]:
    """Consume a token stream; return the arrival time of every token."""
    times = []
    for chunk in stream:
        now = time.perf_counter()
        times.extend([now] * len(chunk.token_ids))
    return times


def _worker_args(model: str, backend: str, threads: int | None, blocks: int = 512) -> argparse.Namespace:
    from worker.server import add_worker_args

    p = argparse.ArgumentParser()
    add_worker_args(p)
    argv = ["--role", "prefill", "--model", model, "--kv-backend", backend, "--num-kv-blocks", str(blocks)]
    if threads:
        argv += ["--threads", str(threads)]
    return p.parse_args(argv)


def measure_overlap(model: str, backend: str, prompt_len: int, threads: int | None,
                    repeats: int = 1) -> dict[str, Any]:
    """``repeats`` fresh prompts (no prefix-cache hit between them) through one prefill/decode pair; the report's
    figures are the medians, every run listed in ``runs``. Both KV pools hold every run's blocks, so no run pays
    for evicting an earlier one's cached blocks and the repeats measure the same thing."""
    from worker.prefill_service import PrefillService
    from worker.server import build_service

    blocks = max(512, (2 * repeats + 2) * (prompt_len // 16 + 1))  # each run: the request and the serial copy
    decode = start_worker("decode", model, backend, ["--num-kv-blocks", str(blocks)])
    service = build_service(_worker_args(model, backend, threads, blocks))
    assert isinstance(service, PrefillService)  # role prefill: its transfer timings and sender are read below
    service.start()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    pb_grpc.add_WorkerServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    pre, dec = WorkerClient.connect(f"127.0.0.1:{port}"), WorkerClient.connect(decode.address)
    from kvtransfer.base import DestinationInfo, TransferState

    def one(k: int) -> dict[str, float]:
        rid = f"overlap-{k}"
        prompt = [(i * 7919 + k * 104729) % 1500 + 1 for i in range(prompt_len)]
        t0 = time.perf_counter()
        _drain(disaggregated_generate(pre, dec, rid, prompt, _params(1)))
        total = time.perf_counter() - t0
        deadline = time.monotonic() + 30  # the prefill side sees the ACK a poll tick after decode finishes
        while not any(t.request_id == rid for t in service.timings):
            if time.monotonic() > deadline:
                raise TimeoutError("prefill never saw the overlap transfer finish")
            time.sleep(0.005)
        exposed = next(t for t in reversed(service.timings) if t.request_id == rid).exposed_s

        # The same bytes again, with nothing computing: the transfer's own duration.
        serial_id = f"serial-{k}"
        res = dec.stub.Reserve(pb.ReserveRequest(request_id=serial_id, prompt_token_ids=prompt, params=_params(1)))
        dest = DestinationInfo.from_bytes(res.destination)
        src = list(range(len(dest.dst_block_ids)))

        def send_all(_: Any) -> float:
            t = time.perf_counter()
            service.sender.start(serial_id, dest, src, time.time() + 60)
            for layer in range(layers):
                service.sender.send_layer(serial_id, layer)
            service.sender.finish(serial_id)
            return t

        t_start = service.loop.call_sync(send_all)
        while service.sender.poll(serial_id).state < TransferState.DONE:
            time.sleep(0.0005)
        serial = time.perf_counter() - t_start
        service.sender.release(serial_id)
        _drain(dec.stub.Decode(pb.DecodeRequest(request_id=serial_id, first_token_id=1)))
        nblocks[0] = len(src)
        return {"request_s": total, "serial_transfer_s": serial, "exposed_after_compute_s": exposed,
                "overlap": max(0.0, min(1.0, 1.0 - exposed / serial)) if serial > 0 else 0.0}

    layers = service.engine.model_config.num_layers
    nblocks = [0]
    try:
        _drain(disaggregated_generate(pre, dec, "warm", list(range(1, 65)), _params(1)))
        runs = [one(k) for k in range(repeats)]
        report: dict[str, Any] = {"backend": backend, "prompt_len": prompt_len,
                                  "kv_bytes": 2 * layers * nblocks[0] * service.layout.block_bytes}
        for key in ("request_s", "serial_transfer_s", "exposed_after_compute_s", "overlap"):
            report[key] = statistics.median(r[key] for r in runs)
        report["runs"] = runs
        return report
    finally:
        pre.close()
        dec.close()
        server.stop(1.0)
        service.stop()
        decode.stop()


def measure_overlap_isolated(model: str, backend: str, prompt_len: int, threads: int | None,
                             repeats: int = 1) -> dict[str, Any]:
    """:func:`measure_overlap` in a freshly spawned process (nothing of this process's earlier phases in it)."""
    import multiprocessing

    with futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(measure_overlap, model, backend, prompt_len, threads, repeats).result(timeout=900)


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def _tier_cpus() -> tuple[set[int] | None, set[int] | None, list[str]]:
    """Disjoint CPU sets for the prefill and the decode worker (half each) and the thread flag to match, or no
    pinning on a 1-CPU host."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None, None, []
    half = len(cpus) // 2
    return set(cpus[:half]), set(cpus[half:]), ["--threads", str(half)]


KV_IO = ("engine", "spare")  # where the decode worker's transport threads run in the ITL phase


def measure_itl(model: str, backend: str, load_prompt_len: int, streams: int = 4, tokens: int = 128,
                pin: bool = True, rounds: int = 3, kv_io: str = "engine") -> dict[str, Any]:
    """Decode ITL over runs of ``streams`` concurrent streams: one quiet, then ``rounds`` alternations of the
    control (the prefill worker keeps computing ``load_prompt_len``-token prompts with no destination: the same
    prefill work next door, no bytes landing) and the loaded run (it keeps prefilling them *into this decode
    worker*). Only loaded against control is what landing transfers cost decode; control against quiet is what
    sharing one host with a busy prefill worker costs (memory bandwidth, L3, scheduling), which separate hosts do
    not pay. Run-to-run noise on a shared 2-vCPU VM is ±10-20%, hence the alternation and the medians.

    ``kv_io``: ``"engine"`` leaves the decode worker's transport threads on its own CPUs, beside its forward pass;
    ``"spare"`` pins them elsewhere (``--kv-io-cpus``), as a decode host with a core kept for I/O would. With two
    CPUs the only other one is the prefill half's, busy with prefill in the control and the loaded run alike, so
    the receive copy then competes with prefill compute instead of decode's."""
    if kv_io not in KV_IO:
        raise ValueError(f"kv_io must be one of {KV_IO}, got {kv_io!r}")
    pre_cpus, dec_cpus, threads = _tier_cpus() if pin else (None, None, [])
    if kv_io == "spare" and not pre_cpus:
        raise ValueError("kv_io='spare' needs two or more CPUs and pinning: there is no spare CPU otherwise")
    io_flags = ["--kv-io-cpus", ",".join(map(str, sorted(pre_cpus)))] if kv_io == "spare" and pre_cpus else []
    prefill = start_worker("prefill", model, backend, ["--num-kv-blocks", "1024", *threads], cpus=pre_cpus)
    decode = start_worker("decode", model, backend, ["--num-kv-blocks", "1024", *threads, *io_flags],
                          cpus=dec_cpus)
    own_cpus = os.sched_getaffinity(0)
    if pre_cpus:  # the load client runs beside prefill, off the decode worker's CPUs, as a separate host would
        os.sched_setaffinity(0, pre_cpus)
    pre, dec = WorkerClient.connect(prefill.address), WorkerClient.connect(decode.address)
    decode_proc = psutil.Process(decode.proc.pid)
    load_prompt = [(i * 31) % 1500 + 1 for i in range(load_prompt_len)]

    def decode_cpu_s() -> float:
        t = decode_proc.cpu_times()
        return t.user + t.system

    def run_streams(tag: str) -> list[float]:
        """Inter-token gaps of the streams, counted only while all of them run: their prefills queue behind the
        load's on the prefill worker, so they start at different times, and the decode batch (hence the step
        time) must be the same ``streams`` sequences in every run for the runs to be comparable."""
        with futures.ThreadPoolExecutor(streams) as ex:
            runs = list(ex.map(lambda i: _drain(disaggregated_generate(pre, dec, f"{tag}-{i}", [3 + i, 4, 5, 6],
                                                                       _params(tokens))), range(streams)))
        lo, hi = max(times[1] for times in runs), min(times[-1] for times in runs)  # times[0]: the prefill token
        gaps = [b - a for times in runs for a, b in itertools.pairwise(times[1:]) if lo <= a and b <= hi]
        if len(gaps) < streams * 8:
            raise RuntimeError(f"ITL run {tag}: the streams overlapped for only {len(gaps)} gaps")
        return gaps

    def under(tag: str, load: Callable[[int], None] | None) -> dict[str, Any]:
        """One run of the streams, with ``load(k)`` (if given) called back to back on another thread meanwhile."""
        stop, sent = threading.Event(), [0]

        def pressure(fn: Callable[[int], None]) -> None:
            while not stop.is_set() and sent[0] < 200:
                fn(sent[0])
                sent[0] += 1

        t = threading.Thread(target=pressure, args=(load,), daemon=True) if load is not None else None
        if t is not None:
            t.start()
        c0, w0 = decode_cpu_s(), time.perf_counter()
        gaps = run_streams(tag)
        cores = (decode_cpu_s() - c0) / (time.perf_counter() - w0)
        stop.set()
        if t is not None:
            t.join(60)
        ms = 1000.0
        return {"p50": _pct(gaps, 0.5) * ms, "p99": _pct(gaps, 0.99) * ms, "mean": statistics.fmean(gaps) * ms,
                "load_requests": sent[0], "decode_cores_busy": cores}

    def compute_only(k: int) -> None:
        pre.stub.Prefill(pb.PrefillRequest(request_id=f"compute-{k}", prompt_token_ids=load_prompt,
                                           params=_params(1)), timeout=120)

    def with_transfer(k: int) -> None:
        _drain(disaggregated_generate(pre, dec, f"load-{k}", load_prompt, _params(1)))

    try:
        _drain(disaggregated_generate(pre, dec, "warm", list(range(1, 33)), _params(2)))
        quiet = under("quiet", None)
        controls, loads = [], []
        for k in range(rounds):
            controls.append(under(f"control{k}", compute_only))
            loads.append(under(f"loaded{k}", with_transfer))

        def median_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
            out = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
            return out | {"runs": runs}

        costs = [ld["p50"] / c["p50"] - 1.0 for c, ld in zip(controls, loads, strict=True)]
        return {"backend": backend, "kv_io": kv_io, "streams": streams, "tokens": tokens,
                "load_prompt_len": load_prompt_len,
                "transfers_during_loaded_run": statistics.median(r["load_requests"] for r in loads),
                "cpus": {"prefill": sorted(pre_cpus) if pre_cpus else "all", "decode": sorted(dec_cpus) if dec_cpus
                         else "all"},
                "itl_ms_quiet": quiet, "itl_ms_prefill_compute_only": median_of(controls),
                "itl_ms_with_transfers": median_of(loads),
                "transfer_cost_p50": statistics.median(costs), "transfer_cost_p50_runs": costs}
    finally:
        os.sched_setaffinity(0, own_cpus)
        pre.close()
        dec.close()
        prefill.stop()
        decode.stop()


def run_kv(args: argparse.Namespace) -> dict[str, Any]:
    from bench.kv_bandwidth import run_kv_bench

    backends = tuple(args.backends.split(","))
    report: dict[str, Any] = {"bandwidth": run_kv_bench(tuple(int(s) for s in args.sizes.split(",")), backends,
                                                        args.repeats)}
    if args.model:
        report["overlap"] = [measure_overlap_isolated(args.model, b, args.prompt_len, args.threads, args.repeats)
                             for b in backends]
        placements = [io for io in args.kv_io.split(",") if io]
        if _tier_cpus()[0] is None:
            placements = [io for io in placements if io != "spare"] or ["engine"]  # no spare CPU to pin to
        report["decode_itl"] = [measure_itl(args.model, b, args.prompt_len // 2, kv_io=io)
                                for b in backends for io in placements]
    return report


def format_kv_report(report: dict[str, Any]) -> str:
    """:func:`run_kv`'s report as text (``tandem bench kv`` without ``--json``): the bandwidth table and ratios,
    then one line per backend for overlap and for decode ITL, each next to the issue's goal."""
    from bench.kv_bandwidth import MIB, format_kv_bench

    lines = ["bandwidth, GB/s (goal: each backend >= 0.90 of raw NIXL; tcp of a raw socket)",
             format_kv_bench(report["bandwidth"])]
    if report.get("overlap"):
        lines.append("overlap (goal >= 80% of the transfer hidden behind prefill compute):")
        for o in report["overlap"]:
            runs = ", ".join(f"{100 * r['overlap']:.1f}" for r in o.get("runs", []))
            lines.append(f"  {o['backend']:>6}: {100 * o['overlap']:5.1f}% median ({runs}); "
                         f"serial {1e3 * o['serial_transfer_s']:.1f} ms, "
                         f"exposed after compute {1e3 * o['exposed_after_compute_s']:.2f} ms, "
                         f"{o['kv_bytes'] / MIB:.0f} MiB of KV for {o['prompt_len']} tokens")
    if report.get("decode_itl"):
        lines.append("decode ITL, p50 / p99 ms (goal: unaffected while transfers land):")
        for r in report["decode_itl"]:
            q, c, w = r["itl_ms_quiet"], r["itl_ms_prefill_compute_only"], r["itl_ms_with_transfers"]
            costs = ", ".join(f"{100 * x:+.1f}" for x in r.get("transfer_cost_p50_runs", []))
            where = {"engine": "KV I/O on decode's CPUs", "spare": "KV I/O on a spare CPU"}.get(r.get("kv_io", ""), "")
            lines.append(f"  {r['backend']:>6}{', ' + where if where else ''}: quiet {q['p50']:.1f} / {q['p99']:.1f}, "
                         f"control {c['p50']:.1f} / {c['p99']:.1f}, with transfers {w['p50']:.1f} / {w['p99']:.1f}; "
                         f"cost {100 * r['transfer_cost_p50']:+.1f}% p50 ({costs}), "
                         f"{r['transfers_during_loaded_run']} transfers")
    return "\n".join(lines)
