"""The Prometheus targets of a local ``tandem up``, as a file_sd file: the router's ``/metrics`` (the HTTP API's
port) and each worker's own (``tandem worker --metrics-port``, a free loopback port per worker, which changes as
replicas are replaced or scaled). A Prometheus with ``file_sd_configs`` naming this file follows the cluster
without a restart: the file is rewritten, whole and atomically, whenever the controller's replicas change.

Each group carries ``exporter`` (``router`` or ``worker``, as router/metric_catalogue.py's ``exporter`` names who
serves a family) and, for a worker, its ``tier``."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path


def prometheus_targets_for(state_file: Path) -> Path:
    """Where a ``tandem up`` with ``state_file`` writes its file_sd targets."""
    return state_file.with_name(state_file.stem + "-prometheus.json")


def write_prometheus_targets(path: Path, router: str, workers: Mapping[str, str]) -> None:
    """Write ``router`` (host:port) and ``workers`` (metrics host:port -> tier) as file_sd target groups."""
    groups = [{"targets": [router], "labels": {"exporter": "router"}}]
    groups += [{"targets": [address], "labels": {"exporter": "worker", "tier": tier}}
               for address, tier in sorted(workers.items())]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(groups, indent=1))
    tmp.replace(path)
