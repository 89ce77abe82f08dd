"""The KubeRay ``RayCluster`` of a TandemDeployment: a head pod that runs ``tandem controller``, one worker group
per tier.

Head pod: KubeRay's ``ray-head`` container, plus a ``controller`` container running ``tandem controller
--ray-address auto`` against that head (they share ``/tmp/ray``, where a Ray driver finds the cluster and its
raylet). The Control port is declared on ``ray-head`` because KubeRay's head Service (``<td>-head-svc``) exposes
that container's ports.

Worker groups: one pod holds one replica's ranks; each rank's requests and limits (``nvidia.com/gpu`` included) are
multiplied by its ranks, ``max(tp, ep) * pp``. Each pod advertises the custom Ray resource ``tandem_<tier>`` once
per rank, so a placement-group bundle that asks for one unit of it lands only on its own tier's group. In-tree
autoscaling is on: a group's ``replicas`` is the tier's initial count when the RayCluster is created, and KubeRay's
autoscaler owns it after that (``apply`` never asserts it over a live value): the controller creates placement
groups, the autoscaler adds pods for the pending ones and removes idle pods after the drain.

The worker container declares the worker's own ``/metrics`` port by the name ``metrics``, which the tiers'
PodMonitor (operators/render_router.py) scrapes.

Ray's own ports are pinned so the tier NetworkPolicy can open exactly them between the cluster's pods.
"""

from __future__ import annotations

import json
from typing import Any

from operators import pods
from operators.config import CONTROL_PORT
from operators.labels import (
    WORKER_GRPC_PORT,
    WORKER_KV_PORT,
    WORKER_METRICS_PORT,
    WORKER_SESSION_PORT,
    labels,
    metadata,
)
from operators.spec import DeploymentSpec, TierSpec

RAY_VERSION = "2.60.0"
RAY_GCS_PORT = 6379
RAY_PORTS = {  # rayStartParams -> port; workers' Ray worker processes use RAY_WORKER_PORTS
    "node-manager-port": 8077,
    "object-manager-port": 8076,
    "metrics-export-port": 8080,
    "dashboard-agent-grpc-port": 8078,
    "dashboard-agent-listen-port": 52365,
    "runtime-env-agent-port": 8079,
}
RAY_WORKER_PORTS = (10002, 10999)
_RAY_TMP = {"name": "ray-tmp", "emptyDir": {}}
_RAY_TMP_MOUNT = {"name": "ray-tmp", "mountPath": "/tmp/ray"}


def ray_resource(tier: str) -> str:
    """The Ray custom resource a tier's pods advertise: ``controlplane.controller.tier_resource`` (a test checks)."""
    return f"tandem_{tier}"


def controller_args(spec: DeploymentSpec) -> list[str]:
    """``tandem controller``'s flags (cli/controller.py) for this TandemDeployment."""
    decode = spec.tier("decode")
    assert decode is not None
    prefill = spec.tier("prefill")
    worker_flags = ["--dtype", spec.model.dtype]
    # The controller's own credentials: it serves Control with them (token guard, mTLS) and hands the same files
    # on to every worker it starts (cli/controller.py), which the worker pods mount at the same paths.
    # Per tier: its ranks and KV backend, and --tier-resources, so each replica's bundles ask for the tier's Ray
    # resource and land on that tier's worker group only.
    # Its tp, pp and ep reach the tier's workers (--tp/--pp/--ep) through the controller.
    # And each rank's torch threads, from the CPUs a rank of the tier asks for.
    tiers = [flag for t in spec.tiers for flag in (f"--{t.name}-ranks", str(t.ranks),
                                                   f"--{t.name}-kv-backend", t.kv_backend,
                                                   f"--{t.name}-tp", str(t.tp), f"--{t.name}-pp", str(t.pp),
                                                   f"--{t.name}-ep", str(t.ep),
                                                   *((f"--{t.name}-threads", str(t.threads)) if t.threads else ()))]
    return ["controller", "--model", spec.model.path, "--redis", pods.redis_url(spec),
            "--prefill", str(prefill.replicas if prefill else 0), "--decode", str(decode.replicas),
            "--control-port", str(CONTROL_PORT), "--host", "0.0.0.0", "--kv-backend", decode.kv_backend, *tiers,
            "--tier-resources", "--ray-address", "auto", *pods.credential_flags(spec),
            *(f"--worker-flag={flag}" for flag in worker_flags),
            # LoRA adapters, in the model volume every pod mounts at the same path; the controller hands each worker
            # --lora NAME=DIR, and the router learns them from the workers' registry entries.
            *(f for a in spec.lora for f in ("--lora", f"{a.name}={a.pod_path(spec.model)}"))]


def _env(spec: DeploymentSpec) -> dict[str, Any]:
    env = pods.env(spec)
    return {"env": env} if env else {}


def _start_params(extra: dict[str, str]) -> dict[str, str]:
    params = {k: str(v) for k, v in RAY_PORTS.items()}
    params["min-worker-port"], params["max-worker-port"] = (str(p) for p in RAY_WORKER_PORTS)
    return {**params, **extra}


def _head(spec: DeploymentSpec) -> dict[str, Any]:
    image = {"image": spec.image.ref, "imagePullPolicy": spec.image.pull_policy}
    controller: dict[str, Any] = {"name": "controller", **image, "command": ["tandem"]}
    return {
        "serviceType": "ClusterIP",
        "rayStartParams": _start_params({"num-cpus": "0", "dashboard-host": "0.0.0.0"}),
        "template": {
            "metadata": {"labels": labels(spec.name, "controller")},
            "spec": {
                "containers": [
                    {"name": "ray-head", **image,
                     "ports": [{"name": "gcs-server", "containerPort": RAY_GCS_PORT},
                               {"name": "dashboard", "containerPort": 8265},
                               {"name": "client", "containerPort": 10001},
                               {"name": "control", "containerPort": CONTROL_PORT}],
                     "resources": {"requests": {"cpu": "1", "memory": "2Gi"}},
                     "volumeMounts": [_RAY_TMP_MOUNT]},
                    {**controller, "args": controller_args(spec), **_env(spec),
                     "readinessProbe": {"tcpSocket": {"port": CONTROL_PORT}, "periodSeconds": 5},
                     "resources": {"requests": {"cpu": "250m", "memory": "512Mi"}},
                     "volumeMounts": [_RAY_TMP_MOUNT, *pods.volume_mounts(spec)]},
                ],
                "volumes": [_RAY_TMP, *pods.volumes(spec)],
            },
        },
    }


def _worker_group(spec: DeploymentSpec, tier: TierSpec) -> dict[str, Any]:
    resources = json.dumps({ray_resource(tier.name): tier.ranks})
    pod: dict[str, Any] = {
        "containers": [{
            "name": "ray-worker", "image": spec.image.ref, "imagePullPolicy": spec.image.pull_policy,
            "ports": [{"name": "grpc", "containerPort": WORKER_GRPC_PORT},
                      {"name": "session", "containerPort": WORKER_SESSION_PORT},
                      {"name": "kv", "containerPort": WORKER_KV_PORT},
                      {"name": "metrics", "containerPort": WORKER_METRICS_PORT}],
            **_env(spec),
            **({"resources": tier.pod_resources()} if tier.pod_resources() else {}),
            "volumeMounts": [_RAY_TMP_MOUNT, *pods.volume_mounts(spec)],
        }],
        "volumes": [_RAY_TMP, *pods.volumes(spec)],
    }
    if tier.node_selector:
        pod["nodeSelector"] = dict(tier.node_selector)
    if tier.tolerations:
        pod["tolerations"] = list(tier.tolerations)
    return {
        "groupName": tier.name,
        "replicas": tier.replicas,
        "minReplicas": tier.min_replicas,
        "maxReplicas": tier.max_replicas,
        "rayStartParams": _start_params({"resources": resources}),
        "template": {"metadata": {"labels": labels(spec.name, tier.name)}, "spec": pod},
    }


def render_raycluster(spec: DeploymentSpec, namespace: str) -> dict[str, Any]:
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayCluster",
        "metadata": metadata(spec.name, namespace, spec.name, "controller"),
        "spec": {
            "rayVersion": RAY_VERSION,
            "enableInTreeAutoscaling": True,
            "autoscalerOptions": {"upscalingMode": "Default", "idleTimeoutSeconds": 60},
            "headGroupSpec": _head(spec),
            "workerGroupSpecs": [_worker_group(spec, t) for t in spec.tiers],
        },
    }
