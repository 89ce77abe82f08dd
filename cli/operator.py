"""``tandem operator run`` (the kopf operator) and ``tandem operator render -f td.yaml`` (what it would apply).

``render`` goes through the same ``operators.render.render`` as the reconcile, so what it prints is what the
operator creates, less the ownerReferences: they need the TandemDeployment's uid, which the API server assigns.
Exit codes: 0 success, 2 bad input (unreadable file, no TandemDeployment in it, an invalid spec).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

DEFAULT_NAMESPACE = "default"


def add_operator_args(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="operator_command", required=True)
    run = sub.add_parser("run", help="run the operator (in a pod: the service account; else the kubeconfig)")
    run.add_argument("--namespace", action="append", default=[],
                     help="watch only this namespace (repeatable; default: every namespace)")
    run.add_argument("--kube-url", default=None, help="API server URL without credentials (a proxy; tests)")
    run.add_argument("--control-address", default=None,
                     help="the controller's address template, with {name} and {namespace} "
                          "(default {name}-head-svc.{namespace}.svc:9400)")
    run.add_argument("--status-interval", type=float, default=None, help="seconds between status refreshes")
    run.add_argument("--liveness", default=None, help="serve a liveness probe, e.g. http://0.0.0.0:8080/healthz")
    run.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics on this port")
    run.add_argument("--verbose", action="store_true", help="log every handler's progress")
    render = sub.add_parser("render", help="print the manifests the operator would apply for a TandemDeployment")
    render.add_argument("-f", "--file", required=True, help="YAML with one or more TandemDeployments ('-': stdin)")
    render.add_argument("--namespace", default=None,
                        help="namespace of the objects (default: the resource's own, else 'default')")
    render.add_argument("--monitoring", action="store_true",
                        help="include the ServiceMonitor (the operator does when monitoring.coreos.com exists)")


def _render(args: argparse.Namespace) -> int:
    import yaml

    from operators.render import render
    from operators.spec import SpecError

    try:
        text = sys.stdin.read() if args.file == "-" else Path(args.file).read_text()
        docs = [d for d in yaml.safe_load_all(text) if isinstance(d, dict)]
    except (OSError, yaml.YAMLError) as e:
        print(f"error: {args.file}: {e}", file=sys.stderr)
        return 2
    tds = [d for d in docs if d.get("kind") == "TandemDeployment"]
    if not tds:
        print(f"error: {args.file}: no TandemDeployment in it", file=sys.stderr)
        return 2
    out: list[dict[str, Any]] = []
    for td in tds:
        namespace = args.namespace or (td.get("metadata") or {}).get("namespace") or DEFAULT_NAMESPACE
        try:
            out += render(td, namespace, monitoring=args.monitoring)
        except SpecError as e:
            print(f"error: {(td.get('metadata') or {}).get('name')}: {e}", file=sys.stderr)
            return 2
    sys.stdout.write(yaml.safe_dump_all(out, sort_keys=False))
    return 0


def _run(args: argparse.Namespace) -> int:
    import kopf

    from operators.config import OperatorConfig
    from operators.handlers import build_registry

    overrides: dict[str, Any] = {"kube_url": args.kube_url}
    if args.control_address:
        overrides["control_address"] = args.control_address
    if args.status_interval is not None:
        overrides["status_interval_s"] = args.status_interval
    try:
        cfg = OperatorConfig(**overrides)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    kopf.configure(verbose=args.verbose)  # kopf's log format on stderr, as `kopf run` sets it up
    if args.metrics_port is not None:
        from prometheus_client import start_http_server

        start_http_server(args.metrics_port)
    asyncio.run(kopf.operator(registry=build_registry(cfg), standalone=True, clusterwide=not args.namespace,
                              namespaces=args.namespace, liveness_endpoint=args.liveness))
    return 0


def run_operator_command(args: argparse.Namespace) -> int:
    if args.operator_command == "render":
        return _render(args)
    return _run(args)
