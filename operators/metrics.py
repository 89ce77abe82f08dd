"""The operator's Prometheus metrics (``tandem operator run --metrics-port``; the chart's ServiceMonitor scrapes
them): reconciles by result, owned-object writes by kind, SetReplicas calls, and each tier's desired, ready and
draining replicas as the status timer last saw them (desired versus actual, per TandemDeployment)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

RECONCILES = Counter("tandem_operator_reconciles", "Reconciles of a TandemDeployment, by result",
                     ["result"])  # unchanged | changed | invalid_spec | error
WRITES = Counter("tandem_operator_object_writes", "Creates and patches of owned objects", ["kind", "outcome"])
SET_REPLICAS = Counter("tandem_operator_set_replicas", "Control.SetReplicas calls, by tier and result",
                       ["tier", "result"])  # ok | error
TIER_REPLICAS = Gauge("tandem_operator_tier_replicas", "A tier's replicas as last observed, by state",
                      ["namespace", "deployment", "tier", "state"])  # desired | ready | draining


def observe_tiers(namespace: str, deployment: str, tiers: dict[str, dict[str, int]]) -> None:
    for tier, counts in tiers.items():
        for state, value in counts.items():
            TIER_REPLICAS.labels(namespace, deployment, tier, state).set(value)
