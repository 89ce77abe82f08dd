"""``tandem controller`` and ``tandem scale``: their flags and the commands, wired from cli/main.py.

``tandem scale TIER N`` asks a controller (by default the running ``tandem up``'s, from its state file) for N
replicas of TIER through ``Control.SetReplicas``, optionally waits until the tier has converged, and prints the
resulting status. ``SetReplicas`` needs the cluster token: ``--auth-token-file``, else ``$TANDEM_CLUSTER_TOKEN``,
else the running ``tandem up``'s token file (0600, beside its state file). Exit codes: 0 done, 1 the controller is
unreachable, refused the token or did not converge in time, 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from auth.credentials import Credentials
    from controlplane.controller import ControllerConfig
    from proto.tandem.v1.control_pb2 import TierStatus

KV_BACKEND_CHOICES = ["auto", "nixl", "torch", "tcp"]


def add_controller_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="HF checkpoint directory (as the workers see it)")
    p.add_argument("--redis", required=True, help="redis://... : the worker registry the routers read")
    p.add_argument("--prefill", type=int, default=1, help="prefill replicas at start (0: colocated)")
    p.add_argument("--decode", type=int, default=1, help="decode replicas at start")
    p.add_argument("--control-port", type=int, default=9400, help="tandem.v1.Control gRPC port")
    p.add_argument("--host", default="0.0.0.0", help="address the Control API listens on")
    p.add_argument("--kv-backend", default="auto", choices=KV_BACKEND_CHOICES,
                   help="every tier's KV transport, unless --prefill-kv-backend / --decode-kv-backend name one")
    p.add_argument("--drain-timeout", type=float, default=120.0,
                   help="seconds a draining replica may take to finish its in-flight work before it is removed")
    p.add_argument("--cpus-per-replica", type=float, default=1.0, help="CPUs per rank (placement-group bundle)")
    p.add_argument("--ranks", type=int, default=1,
                   help="ranks (bundles) per replica of every tier, unless --prefill-ranks / --decode-ranks say; a "
                        "tier with --*-tp/--*-pp/--*-ep above 1 has max(tp, ep) x pp ranks, and another count is "
                        "refused")
    for tier in ("prefill", "decode"):
        p.add_argument(f"--{tier}-ranks", type=int, default=None,
                       help=f"ranks (bundles) per {tier} replica (default: max(tp, ep) x pp of its layout)")
        for dim in ("tp", "pp", "ep"):
            p.add_argument(f"--{tier}-{dim}", type=int, default=1, help=f"{dim.upper()} of each {tier} replica's "
                           "ranks (its workers' --" + dim + ")")
        p.add_argument(f"--{tier}-kv-backend", default=None, choices=KV_BACKEND_CHOICES,
                       help=f"{tier} workers' KV transport")
        p.add_argument(f"--{tier}-threads", type=int, default=None,
                       help=f"torch threads of each {tier} rank (default: the workers' own, one under Ray)")
    p.add_argument("--tier-resources", action="store_true",
                   help="each bundle also asks for one unit of the Ray resource tandem_<tier>, which only that "
                        "tier's nodes advertise (the operator's worker groups do), so replicas land on their own tier")
    p.add_argument("--worker-host", default="node",
                   help="worker listen/advertise address; 'node': each Ray node's IP (default)")
    p.add_argument("--worker-port", type=int, default=None,
                   help="each worker's gRPC port (default: 7100 with --worker-host node, one replica per pod as the "
                        "chart's NetworkPolicies expect; else a free port)")
    p.add_argument("--worker-session-port", type=int, default=None,
                   help="each worker's plain-TCP Session port (default: 7101 with --worker-host node, else free)")
    p.add_argument("--worker-metrics-port", type=int, default=None,
                   help="each worker's own /metrics port (default: 7102 with --worker-host node, where the "
                        "operator's PodMonitor scrapes it by the name 'metrics'; else a free port)")
    p.add_argument("--ray-address", default=None,
                   help="Ray cluster to join ('auto' in a Ray head pod); default $RAY_ADDRESS, else start one")
    p.add_argument("--otlp-endpoint", default=None, metavar="HOST:PORT",
                   help="the workers record their spans of traced requests and export them over OTLP/gRPC here")
    p.add_argument("--worker-flag", action="append", default=[], metavar="FLAG",
                   help="extra `tandem worker` flag (repeat; e.g. --worker-flag=--dtype --worker-flag=bfloat16)")
    p.add_argument("--lora", action="append", default=[], metavar="NAME=DIR",
                   help="serve a PEFT LoRA adapter under NAME on every worker replica of every tier (repeatable; DIR "
                        "as every node sees it); a request selects it with model: NAME. Single-rank workers only")
    from auth.credentials import add_args as add_credential_args

    add_credential_args(p)  # the workers get the same TLS files and token file (paths as every node mounts them)


def add_scale_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("tier", choices=["prefill", "decode"])
    p.add_argument("replicas", type=int)
    p.add_argument("--control", default=None,
                   help="the controller's host:port (default: the running `tandem up`'s, from its state file)")
    p.add_argument("--wait", type=float, default=0.0,
                   help="seconds to wait until the tier has its replicas ready and none draining (0: do not wait)")
    p.add_argument("--json", action="store_true", help="print the status as JSON")
    from auth.credentials import add_args as add_credential_args

    # The cluster token SetReplicas needs (default: $TANDEM_CLUSTER_TOKEN, else the running `tandem up`'s token
    # file) and, for a controller serving mutual TLS, this client's certificate.
    add_credential_args(p)


def controller_config(args: argparse.Namespace, creds: Credentials) -> ControllerConfig:
    """The controller's config from ``add_controller_args``' flags; ValueError for a bad value."""
    from auth.credentials import to_flags
    from controlplane.controller import ControllerConfig
    from controlplane.replica import NODE_IP

    return ControllerConfig(
        args.model, args.prefill, args.decode, args.kv_backend, args.cpus_per_replica, args.ranks,
        worker_flags=(*_port_flags(args), *args.worker_flag, *to_flags(creds, args.auth_token_file),
                      *(("--otlp-endpoint", args.otlp_endpoint) if args.otlp_endpoint else ())),
        redis=args.redis,
        worker_host=NODE_IP if args.worker_host == "node" else args.worker_host, drain_timeout_s=args.drain_timeout,
        prefill_ranks=args.prefill_ranks, decode_ranks=args.decode_ranks,
        prefill_kv_backend=args.prefill_kv_backend, decode_kv_backend=args.decode_kv_backend,
        prefill_parallel=(args.prefill_tp, args.prefill_pp, args.prefill_ep),
        decode_parallel=(args.decode_tp, args.decode_pp, args.decode_ep),
        prefill_threads=args.prefill_threads, decode_threads=args.decode_threads,
        tier_resources=args.tier_resources, worker_metrics_port=_metrics_port(args), lora=_lora(args))


def _lora(args: argparse.Namespace) -> tuple[str, ...]:
    """``--lora NAME=DIR`` each, parsed and named as ``tandem worker`` will (engine/lora/config.py), so a bad value
    stops the controller here rather than every worker it starts; ControllerConfig refuses a repeated NAME. The
    directory is not checked: it is a path on the worker nodes, which the worker checks."""
    from engine.lora.config import check_adapter_name, parse_lora_flag

    adapters = []
    for value in args.lora:
        name, path = parse_lora_flag(value)
        check_adapter_name(name)
        adapters.append(f"{name}={path}")
    multi_rank = [f"--{tier}-{dim} {getattr(args, f'{tier}_{dim}')}" for tier in ("prefill", "decode")
                  for dim in ("tp", "pp", "ep") if getattr(args, f"{tier}_{dim}") > 1]
    if adapters and multi_rank:  # worker/server.py's rule, for every tier the adapters reach
        raise ValueError(f"--lora runs on single-rank workers, but {', '.join(multi_rank)}")
    return tuple(adapters)


def _metrics_port(args: argparse.Namespace) -> int:
    """Each worker's ``--metrics-port``: the Kubernetes contract's fixed port on a node's own IP, else a free one."""
    if args.worker_metrics_port is not None:
        return int(args.worker_metrics_port)
    return 7102 if args.worker_host == "node" else 0


def cmd_controller(args: argparse.Namespace) -> int:
    import logging
    import os

    from auth.credentials import from_args
    from auth.token import TOKEN_ENV
    from controlplane.daemon import DaemonConfig, run_controller

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        creds = from_args(args)
        if creds.token is not None:  # a Ray started here passes it on to every worker through the environment
            os.environ[TOKEN_ENV] = creds.token
        controller = controller_config(args, creds)
        cfg = DaemonConfig(controller, args.host, args.control_port,
                           args.ray_address or os.environ.get("RAY_ADDRESS") or "local")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return run_controller(cfg, creds)


def _port_flags(args: argparse.Namespace) -> list[str]:
    """``tandem worker`` port flags: the Kubernetes contract's fixed ports on a node's own IP, else free ports."""
    in_pod = args.worker_host == "node"
    grpc_port = args.worker_port if args.worker_port is not None else (7100 if in_pod else 0)
    session = args.worker_session_port if args.worker_session_port is not None else (7101 if in_pod else 0)
    for name, port in (("--worker-port", grpc_port), ("--worker-session-port", session)):
        if not 0 <= port < 65536:
            raise ValueError(f"{name} {port} out of range")
    return ["--port", str(grpc_port), "--session-port", str(session)]


def cmd_scale(args: argparse.Namespace) -> int:
    import grpc

    from auth.credentials import Credentials, from_args
    from auth.grpc_client import attach, channel
    from auth.token import read_token_file
    from controlplane.paths import STATE_FILE, token_file_for
    from proto.tandem.v1 import control_pb2 as cpb
    from proto.tandem.v1 import control_pb2_grpc as cpb_grpc

    if args.replicas < 0:
        print(f"error: replicas must be >= 0, got {args.replicas}", file=sys.stderr)
        return 2
    try:
        creds = from_args(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    target = args.control
    if target is None:
        if not STATE_FILE.is_file():
            print("error: no running `tandem up` found (pass --control HOST:PORT)", file=sys.stderr)
            return 1
        state = json.loads(STATE_FILE.read_text())
        target = state["control"]
        token_file = state.get("token_file") or str(token_file_for(STATE_FILE))
        if creds.token is None:
            try:
                creds = Credentials(read_token_file(token_file), creds.tls)
            except (OSError, ValueError) as e:
                print(f"error: the cluster token of the running `tandem up` ({token_file}): {e}", file=sys.stderr)
                return 1
    with channel(target, creds) as ch:
        stub = attach(cpb_grpc.ControlStub(ch), creds)
        try:
            tier = stub.SetReplicas(cpb.SetReplicasRequest(tier=args.tier, replicas=args.replicas), timeout=10).tier
            deadline = time.monotonic() + args.wait
            while args.wait > 0 and not _settled(tier):
                if time.monotonic() > deadline:
                    _print(tier, args.json)
                    print(f"error: {args.tier} did not converge within {args.wait:g}s", file=sys.stderr)
                    return 1
                time.sleep(0.5)
                tier = next(t for t in stub.Status(cpb.StatusRequest(), timeout=10).tiers if t.tier == args.tier)
        except grpc.RpcError as e:
            code = e.code() if isinstance(e, grpc.Call) else None
            print(f"error: {target}: {e.details() if isinstance(e, grpc.Call) else e}", file=sys.stderr)
            return 2 if code == grpc.StatusCode.INVALID_ARGUMENT else 1
    _print(tier, args.json)
    return 0


def _settled(tier: TierStatus) -> bool:
    return tier.ready == tier.desired and not tier.draining and not tier.starting


def _print(tier: TierStatus, as_json: bool) -> None:
    from google.protobuf.json_format import MessageToDict

    from proto.tandem.v1 import control_pb2 as cpb

    if as_json:
        print(json.dumps(MessageToDict(tier, always_print_fields_with_no_presence=True)))
        return
    print(f"{tier.tier}: desired {tier.desired}, ready {tier.ready}, starting {tier.starting}, "
          f"draining {tier.draining}")
    for r in tier.replicas:
        print(f"  {r.replica_id:<18} {cpb.ReplicaState.Name(r.state).removeprefix('REPLICA_STATE_'):<9} "
              f"{r.address or '-':<22} in_flight={r.in_flight} restarts={r.restarts}")
