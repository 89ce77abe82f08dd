"""The operator's pure parts: spec validation, render (names, labels, ports, sizing), the owned-field comparison,
the render CLI's errors, and that the operator never imports torch or ray. No Kubernetes API is involved."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from typing import Any

import pytest
import yaml

from operators.apply import is_subset, owned_view
from operators.render import render
from operators.spec import SpecError, parse, scale_quantity

BASE = yaml.safe_load("""
apiVersion: tandem.dev/v1alpha1
kind: TandemDeployment
metadata: {name: llama}
spec:
  model: {source: {pvc: {claimName: models, path: llama-3-8b}}, dtype: bfloat16}
  router: {replicas: 2}
  prefill: {replicas: 2, tp: 1, kvBackend: nixl}
  decode: {scaling: {min: 1, max: 4}, tp: 2, kvBackend: nixl,
           resources: {requests: {cpu: "500m", memory: 16Gi}, limits: {nvidia.com/gpu: "1"}}}
  redis: {url: "rediss://redis.example:6380/0", passwordSecret: {name: redis, key: password}}
""")


def _td(**spec_changes: Any) -> dict[str, Any]:
    td = copy.deepcopy(BASE)
    for key, value in spec_changes.items():
        td["spec"][key] = value
    return td


def _by_name(objs: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(o["kind"], o["metadata"]["name"]): o for o in objs}


def test_render_names_labels_and_ports_follow_the_contract() -> None:
    objs = _by_name(render(_td(), "serving"))
    assert set(objs) == {("TandemTier", "llama-prefill"), ("TandemTier", "llama-decode"), ("RayCluster", "llama"),
                         ("Deployment", "llama-router"), ("Service", "llama-router"),
                         ("Service", "llama-router-metrics"), ("PodDisruptionBudget", "llama-router"),
                         ("PodDisruptionBudget", "llama-prefill"), ("PodDisruptionBudget", "llama-decode"),
                         ("NetworkPolicy", "llama-workers"), ("NetworkPolicy", "llama-head")}
    for o in objs.values():
        labels = o["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == "tandem" and labels["app.kubernetes.io/instance"] == "llama"
        assert labels["app.kubernetes.io/managed-by"] == "tandem-operator"
        assert labels["tandem.dev/deployment"] == "llama" and o["metadata"]["namespace"] == "serving"
        assert "ownerReferences" not in o["metadata"]  # no uid in a file: nothing to own them yet
    svc = objs[("Service", "llama-router")]["spec"]["ports"]
    assert [(p["name"], p["port"]) for p in svc] == [("http", 8000), ("grpc", 8001)]
    assert objs[("Service", "llama-router-metrics")]["spec"]["ports"][0]["port"] == 9090
    ray = objs[("RayCluster", "llama")]["spec"]
    head = ray["headGroupSpec"]["template"]["spec"]["containers"]
    assert {"name": "control", "containerPort": 9400} in head[0]["ports"]
    assert head[1]["command"] == ["tandem"] and head[1]["args"][0] == "controller"
    groups = {g["groupName"]: g for g in ray["workerGroupSpecs"]}
    assert set(groups) == {"prefill", "decode"}
    decode = groups["decode"]["template"]
    assert decode["metadata"]["labels"]["tandem.dev/tier"] == "decode"
    worker = decode["spec"]["containers"][0]
    assert [(p["name"], p["containerPort"]) for p in worker["ports"]] == [("grpc", 7100), ("session", 7101),
                                                                          ("kv", 7200), ("metrics", 7102)]
    # One pod per replica: tp=2 ranks, each rank's resources doubled ("500m" * 2 == "1", as the API server says).
    assert worker["resources"] == {"requests": {"cpu": "1", "memory": "32Gi"}, "limits": {"nvidia.com/gpu": "2"}}
    assert (groups["decode"]["minReplicas"], groups["decode"]["maxReplicas"]) == (1, 4)
    assert groups["decode"]["replicas"] == 1  # at creation; KubeRay's autoscaler owns it after that
    live = copy.deepcopy(objs[("RayCluster", "llama")])
    live["spec"]["workerGroupSpecs"][1]["replicas"] = 3  # the autoscaler added pods
    assert is_subset(owned_view(objs[("RayCluster", "llama")], live), live)
    tier = objs[("TandemTier", "llama-decode")]["spec"]
    assert tier == {"deployment": "llama", "tier": "decode", "replicas": 1, "minReplicas": 1, "maxReplicas": 4}
    router = objs[("Deployment", "llama-router")]["spec"]["template"]["spec"]["containers"][0]
    assert "--redis" in router["args"]
    redis_url = router["args"][router["args"].index("--redis") + 1]
    assert redis_url == "rediss://:$(TANDEM_REDIS_PASSWORD)@redis.example:6380/0"  # never the password itself


def test_network_policy_lets_only_the_router_reach_worker_ports_and_only_workers_reach_kv() -> None:
    policy = _by_name(render(_td(), "serving"))[("NetworkPolicy", "llama-workers")]["spec"]
    rules = {tuple(p["port"] for p in r["ports"]): r["from"][0]["podSelector"]["matchExpressions"][0]["values"]
             for r in policy["ingress"][:2]}
    assert rules == {(7100, 7101): ["router", "controller"], (7200,): ["prefill", "decode"]}
    assert policy["podSelector"]["matchExpressions"][0]["values"] == ["prefill", "decode"]
    # the workers' own /metrics from anywhere (a Prometheus in its own namespace), and nothing else that way
    assert [r for r in policy["ingress"] if "from" not in r] == [{"ports": [{"protocol": "TCP", "port": 7102}]}]


def test_monitoring_scrapes_each_tier_pod_on_the_port_the_worker_serves_its_metrics_on() -> None:
    """The PodMonitor selects exactly the tier pods, by the container port's name, and that port is the one the
    controller's real parser hands every worker as --metrics-port."""
    import argparse

    from auth.credentials import Credentials
    from cli.controller import add_controller_args, controller_config

    objs = _by_name(render(_td(), "serving", monitoring=True))
    monitor = objs[("PodMonitor", "llama-workers")]["spec"]
    assert monitor["selector"]["matchExpressions"] == [
        {"key": "app.kubernetes.io/component", "operator": "In", "values": ["prefill", "decode"]}]
    assert monitor["namespaceSelector"] == {"matchNames": ["serving"]}
    assert [e["port"] for e in monitor["podMetricsEndpoints"]] == ["metrics"]
    for group in objs[("RayCluster", "llama")]["spec"]["workerGroupSpecs"]:
        labels = group["template"]["metadata"]["labels"]
        assert all(labels[k] == v for k, v in monitor["selector"]["matchLabels"].items())
        ports = {p["name"]: p["containerPort"] for p in group["template"]["spec"]["containers"][0]["ports"]}
        assert ports["metrics"] == 7102
    head = objs[("RayCluster", "llama")]["spec"]["headGroupSpec"]["template"]["spec"]["containers"][1]
    p = argparse.ArgumentParser(exit_on_error=False)
    add_controller_args(p)
    cfg = controller_config(p.parse_args(head["args"][1:]), Credentials(None))
    assert cfg.worker_metrics_port == 7102
    assert ("PodMonitor", "llama-workers") not in _by_name(render(_td(), "serving", monitoring=False))


def test_colocated_in_cluster_redis_and_monitoring_switch_their_objects() -> None:
    td = _td(redis={"inCluster": True})
    del td["spec"]["prefill"]
    names = set(_by_name(render(td, "ns", monitoring=True)))
    assert ("Deployment", "llama-redis") in names and ("Service", "llama-redis") in names
    assert ("ServiceMonitor", "llama") in names and ("TandemTier", "llama-prefill") not in names
    assert ("PodDisruptionBudget", "llama-prefill") not in names
    args = _by_name(render(td, "ns"))[("RayCluster", "llama")]["spec"]["headGroupSpec"]["template"]["spec"][
        "containers"][1]["args"]
    assert args[args.index("--prefill") + 1] == "0"
    assert ("ServiceMonitor", "llama") not in set(_by_name(render(td, "ns", monitoring=False)))


def test_render_is_deterministic() -> None:
    assert render(_td(), "serving") == render(_td(), "serving")


@pytest.mark.parametrize(("change", "message"), [
    ({"decode": {"replicas": 2, "scaling": {"min": 1, "max": 2}}}, "replicas and scaling are exclusive"),
    ({"decode": {"scaling": {"min": 3, "max": 2}}}, "min=3 is greater than max=2"),
    ({"decode": {"replicas": 1, "kvBackend": "rdma"}}, "kvBackend 'rdma' is not one of"),
    ({"decode": {"replicas": 1, "tp": 2, "ep": 3}}, "ep=3 with tp=2: expert parallelism runs on the tensor-parallel"),
    ({"decode": {"replicas": 1, "tp": 2, "ep": 4}}, "so ep must equal tp or tp must be 1"),  # a multiple: still refused
    ({"decode": {"replicas": 1, "tp": 0}}, "tp must be >= 1"),
    ({"decode": {"replicas": 1, "resources": {"limits": {"nvidia.com/gpu": "1.5"}}}}, "whole number"),
    ({"redis": {"url": "redis://r:6379", "inCluster": True}}, "exactly one of url, inCluster"),
    ({"redis": {"inCluster": True, "passwordSecret": {"name": "r", "key": "p"}}}, "goes with url"),
    ({"model": {"source": {"pvc": {"claimName": "m"}, "hostPath": {"path": "/m"}}}}, "exactly one of pvc"),
    ({"router": {"replicas": 0}}, "router.replicas must be >= 1"),
    ({"decode": None}, "spec.decode is required"),
    ({"decode": {"replicas": 1, "kvBackend": "tcp"}}, "spec.prefill.kvBackend (nixl) and spec.decode.kvBackend (tcp)"),
    ({"decode": {"replicas": "many"}}, "spec:"),
    ({"lora": [{"name": "bad name", "path": "a"}]}, "spec.lora[0].name 'bad name' must be letters, digits"),
    ({"lora": [{"name": "-x", "path": "a"}]}, "spec.lora[0].name '-x'"),
    ({"lora": [{"name": "a", "path": "x"}, {"name": "a", "path": "y"}]}, "adapter names must be unique"),
    ({"lora": [{"name": "a", "path": ""}]}, "spec.lora[0].path must be a non-empty directory"),
    ({"lora": [{"name": "a"}]}, "spec.lora[0].path must be a non-empty directory"),
    ({"lora": [{"name": "a", "path": "/etc/adapters"}]}, "spec.lora[0].path '/etc/adapters' must be relative"),
    ({"lora": [{"name": "a", "path": "adapters/../../etc"}]}, "without '.' or '..' segments"),
    ({"lora": [{"name": "llama-3-8b", "path": "a"}]}, "adapter 'llama-3-8b' has the served model's name"),
    ({"lora": [{"name": "a", "path": "a"}]}, "single-rank workers only, but spec.decode has tp=2 pp=1 ep=1"),
    ({"lora": {"name": "a", "path": "a"}}, "spec.lora must be a list"),
])
def test_bad_specs_raise_a_spec_error_naming_the_field(change: dict[str, Any], message: str) -> None:
    with pytest.raises(SpecError, match=None) as e:
        render(_td(**change), "ns")
    assert message in str(e.value)


def _lora_td(source: dict[str, Any] | None = None) -> dict[str, Any]:
    """BASE at one rank per replica (LoRA adapters run on single-rank workers), serving two adapters."""
    td = _td(decode={"scaling": {"min": 1, "max": 4}, "kvBackend": "nixl"},
             lora=[{"name": "sql", "path": "adapters/sql"}, {"name": "chat.v2", "path": "adapters/chat/"}])
    if source is not None:
        td["spec"]["model"]["source"] = source
    return td


def _controller_args(td: dict[str, Any]) -> list[str]:
    args: list[str] = _by_name(render(td, "serving"))[("RayCluster", "llama")]["spec"]["headGroupSpec"]["template"][
        "spec"]["containers"][1]["args"]
    return args


@pytest.mark.parametrize(("source", "mount"), [
    (None, "/models"),  # BASE: the pvc's root, where the model is /models/llama-3-8b
    ({"hostPath": {"path": "/data/llama"}}, "/models/model"),  # the model directory itself
    ({"hf": {"id": "org/llama", "cacheClaimName": "hf"}}, "/hf-cache"),
])
def test_lora_adapters_reach_the_controller_and_through_it_every_worker(
        source: dict[str, Any] | None, mount: str) -> None:
    """spec.lora becomes `tandem controller --lora NAME=DIR` with DIR in the model volume as every pod mounts it; the
    controller's real parser and config take it, and the `--lora` flags it hands each worker (controlplane/
    controller.py) parse with the worker's real parser."""
    import argparse

    from auth.credentials import Credentials
    from cli.controller import add_controller_args, controller_config
    from worker.server import add_worker_args

    td = _lora_td(source)
    args = _controller_args(td)
    flags = [(args[i], args[i + 1]) for i, a in enumerate(args) if a == "--lora"]
    assert flags == [("--lora", f"sql={mount}/adapters/sql"), ("--lora", f"chat.v2={mount}/adapters/chat")]
    objs = _by_name(render(td, "serving"))
    spec = objs[("RayCluster", "llama")]["spec"]
    pods = [spec["headGroupSpec"]["template"]["spec"]["containers"][1],
            *(g["template"]["spec"]["containers"][0] for g in spec["workerGroupSpecs"])]
    for container in pods:  # the controller and every tier's workers mount the model volume at the same path
        assert {"name": "model", "mountPath": mount, "readOnly": True} in container["volumeMounts"]
    p = argparse.ArgumentParser(exit_on_error=False)
    add_controller_args(p)
    cfg = controller_config(p.parse_args(args[1:]), Credentials(None))
    assert cfg.lora == (f"sql={mount}/adapters/sql", f"chat.v2={mount}/adapters/chat")
    p = argparse.ArgumentParser(exit_on_error=False)
    add_worker_args(p)
    w = p.parse_args(["--role", "decode", "--model", cfg.model, *(f for a in cfg.lora for f in ("--lora", a))])
    assert w.lora == list(cfg.lora)
    assert "--lora" not in _controller_args(_td(decode={"replicas": 1}))  # none asked: none passed


@pytest.mark.parametrize("name", ["sql", "a", "Chat.v2_x-1", "9lives", "bad name", "-x", ".x", "_x", "a/b", "a=b",
                                  "", "ü"])
def test_operator_crd_and_engine_agree_on_adapter_names(name: str) -> None:
    """The operator does not import the engine, so it keeps its own copy of the adapter-name rule: the engine's
    check_adapter_name, the operator's and the CRD's pattern accept exactly the same names."""
    import re

    from crd_check import load_crds, root_schema

    from engine.lora.config import check_adapter_name
    from operators.spec import LoRAAdapter

    try:
        check_adapter_name(name)
        engine_ok = True
    except ValueError:
        engine_ok = False
    try:
        LoRAAdapter(name, "adapters/x")
        operator_ok = True
    except SpecError:
        operator_ok = False
    pattern = root_schema(load_crds()["TandemDeployment"])["properties"]["spec"]["properties"]["lora"]["items"][
        "properties"]["name"]["pattern"]
    assert engine_ok == operator_ok == bool(name and re.search(pattern, name))


@pytest.mark.parametrize(("flags", "message"), [
    (["--lora", "bad name=/x"], "adapter name 'bad name' must be letters, digits"),
    (["--lora", "sql"], "--lora takes NAME=DIR, got 'sql'"),
    (["--lora", "=/x"], "--lora takes NAME=DIR"),
    (["--lora", "sql=/x", "--lora", "sql=/y"], "lora adapter names must be unique"),
    (["--lora", "sql=/x", "--decode-tp", "2"], "--lora runs on single-rank workers, but --decode-tp 2"),
    (["--lora", "sql=/x", "--prefill-pp", "2"], "--lora runs on single-rank workers, but --prefill-pp 2"),
])
def test_tandem_controller_refuses_a_bad_lora_flag(flags: list[str], message: str) -> None:
    import argparse

    from auth.credentials import Credentials
    from cli.controller import add_controller_args, controller_config

    p = argparse.ArgumentParser(exit_on_error=False)
    add_controller_args(p)
    with pytest.raises(ValueError) as e:
        controller_config(p.parse_args(["--model", "m", "--redis", "redis://127.0.0.1:1", *flags]), Credentials(None))
    assert message in str(e.value)
    ok = controller_config(p.parse_args(["--model", "m", "--redis", "redis://r", "--lora", "a=/x", "--lora", "b=/y"]),
                           Credentials(None))
    assert ok.lora == ("a=/x", "b=/y")


def test_tandem_controller_exits_2_naming_a_bad_lora_before_starting_anything() -> None:
    """The real command: a bad adapter name is refused before Ray or the Control server starts."""
    out = subprocess.run([sys.executable, "-m", "cli.main", "controller", "--model", "m", "--redis",
                          "redis://127.0.0.1:1", "--lora", "sql=/a", "--lora", "bad/name=/b"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "adapter name 'bad/name' must be letters, digits" in out.stderr, out.stderr


def test_scale_quantity_keeps_the_suffix() -> None:
    assert [scale_quantity(q, 2) for q in ("500m", "16Gi", "1.5", "1", "250m")] == ["1", "32Gi", "3", "2", "500m"]
    with pytest.raises(SpecError):
        scale_quantity("1e3", 2)


def test_owned_fields_compare_as_a_subset_and_empty_fields_match_missing_ones() -> None:
    assert is_subset({"a": 1, "b": {"c": [1, {"d": 2}]}}, {"a": 1, "x": 0, "b": {"c": [1, {"d": 2, "e": 3}]}})
    assert not is_subset({"b": {"c": [1]}}, {"b": {"c": [1, 2]}})
    assert is_subset({"emptyDir": {}, "env": []}, {})
    assert not is_subset({"replicas": 2}, {"replicas": 5})


def test_a_tandem_tier_scaled_by_hand_keeps_its_replicas_until_the_deployment_changes_its_own() -> None:
    tier = next(o for o in render(_td(), "ns") if o["metadata"]["name"] == "llama-decode")
    live = copy.deepcopy(tier)
    live["spec"]["replicas"] = 3  # kubectl scale
    assert is_subset(owned_view(tier, live), live)
    changed = next(o for o in render(_td(decode={"scaling": {"min": 2, "max": 4}}), "ns")
                   if o["metadata"]["name"] == "llama-decode")
    assert owned_view(changed, live)["spec"]["replicas"] == 2
    narrowed = next(o for o in render(_td(decode={"scaling": {"min": 1, "max": 2}}), "ns")
                    if o["metadata"]["name"] == "llama-decode")
    assert owned_view(narrowed, live)["spec"]["replicas"] == 2  # 3 is outside the new [1, 2]


def test_ranks_are_max_of_tp_and_ep_times_pp() -> None:
    def ranks(**tier: int) -> int:
        return parse(_td(decode={"replicas": 1, **tier})).tier("decode").ranks  # type: ignore[union-attr]
    assert ranks(tp=2, pp=2) == 4
    assert ranks(tp=1, ep=8) == 8  # replicated attention, experts over 8 ranks
    assert ranks(tp=4, ep=4, pp=2) == 8  # experts on the TP ranks, two stages
    assert ranks(tp=1, ep=4, pp=2) == 8  # as engine/parallel/config.py numbers them: max(tp, ep) per stage


def test_render_cli_rejects_a_bad_spec_with_exit_code_2(tmp_path: Any) -> None:
    bad = _td(decode={"scaling": {"min": 3, "max": 1}})
    path = tmp_path / "td.yaml"
    path.write_text(yaml.safe_dump(bad))
    out = subprocess.run([sys.executable, "-m", "cli.main", "operator", "render", "-f", str(path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "min=3 is greater than max=1" in out.stderr
    path.write_text("kind: ConfigMap\n")
    out = subprocess.run([sys.executable, "-m", "cli.main", "operator", "render", "-f", str(path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "no TandemDeployment" in out.stderr


def test_the_operator_never_imports_torch_or_ray() -> None:
    code = ("import sys, operators.handlers, operators.render, cli.operator; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'ray')); "
            "print(bad); sys.exit(1 if bad else 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_operator_run_flags_parse_as_the_chart_passes_them() -> None:
    from cli.main import build_parser

    args = build_parser().parse_args(["operator", "run", "--namespace=a", "--namespace=b",
                                      "--liveness=http://0.0.0.0:8080/healthz", "--metrics-port=9100"])
    assert (args.namespace, args.metrics_port, args.liveness) == (["a", "b"], 9100, "http://0.0.0.0:8080/healthz")


def _examples() -> list[dict[str, Any]]:
    from crd_check import CHART

    docs = [yaml.safe_load(p.read_text()) for p in sorted((CHART / "examples").glob("*.yaml"))]
    return [d for d in docs if d and d.get("kind") == "TandemDeployment"] + [BASE]


def test_rendered_examples_validate_for_kubernetes_1_30_and_1_35_and_the_tier_crd() -> None:
    """Core kinds with kubernetes-validate --strict; TandemTiers with the chart's CRD schema and CEL rules; the
    RayCluster, ServiceMonitor and PodMonitor schemas (KubeRay's, the Prometheus operator's) are not available
    offline."""
    import kubernetes_validate
    from crd_check import cel_failures, load_crds, schema_errors

    tier_crd = load_crds()["TandemTier"]
    seen = set()
    for td in _examples():
        td = copy.deepcopy(td)
        td["metadata"]["uid"] = "0b7c5a8e-0000-4000-8000-000000000002"  # as the API server gives it to the operator
        for doc in render(td, "serving", monitoring=True):
            seen.add(doc["kind"])
            if doc["kind"] == "TandemTier":
                assert schema_errors(tier_crd, doc) == [] and cel_failures(tier_crd, doc) == []
            elif doc["kind"] in ("RayCluster", "ServiceMonitor", "PodMonitor"):
                assert doc["apiVersion"] in ("ray.io/v1", "monitoring.coreos.com/v1")
            else:
                for version in ("1.30", "1.35"):
                    kubernetes_validate.validate(doc, version, strict=True)
    assert seen == {"TandemTier", "RayCluster", "Deployment", "Service", "ServiceMonitor", "PodMonitor",
                    "PodDisruptionBudget", "NetworkPolicy"}


def test_absent_fields_take_the_crd_defaults() -> None:
    spec = parse(_td())
    assert spec.security.mtls_secret == "tandem-mtls" and spec.image.ref == "ghcr.io/tandem-dev/tandem:0.1.0"
    assert spec.model.dtype == "bfloat16" and spec.tier("prefill").kv_backend == "nixl"  # type: ignore[union-attr]
    assert parse(_td(security={"mtls": {"enabled": False}})).security.mtls_secret is None


def test_rendered_commands_parse_with_the_real_parsers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The router's, the controller's and (through --worker-flag, and the credential flags the controller hands on)
    the workers' command lines are what their own argparse parsers accept, so a flag renamed on either side fails
    here rather than in a crash-looping pod. Every process gets the same token file, TLS files and server name."""
    import argparse

    import auth.credentials
    from auth.credentials import Credentials, from_args, to_flags
    from auth.credentials import add_args as add_credential_args
    from auth.tls import TLSFiles
    from cli.controller import add_controller_args, controller_config
    from router.serve import add_router_args
    from worker.server import add_worker_args

    td = _td(router={"replicas": 1, "apiKeySecret": {"name": "keys", "key": "k"}})
    objs = _by_name(render(td, "serving"))
    router = objs[("Deployment", "llama-router")]["spec"]["template"]["spec"]["containers"][0]
    assert router["command"] == ["python3"] and router["args"][:2] == ["-m", "router.serve"]
    p = argparse.ArgumentParser(exit_on_error=False)
    add_router_args(p)
    if not any(a.option_strings == ["--tls-cert"] for a in p._actions):
        add_credential_args(p)
    r = p.parse_args(router["args"][2:])
    assert (r.port, r.grpc_port, r.metrics_port, r.api_key_file) == (8000, 8001, 9090, "/etc/tandem/api-keys/keys")
    creds = ("/etc/tandem/token/token", "/etc/tandem/tls/tls.crt", "/etc/tandem/tls/tls.key", "/etc/tandem/tls/ca.crt",
             "tandem")
    assert (r.auth_token_file, r.tls_cert, r.tls_key, r.tls_ca, r.tls_server_name) == creds
    head = objs[("RayCluster", "llama")]["spec"]["headGroupSpec"]["template"]["spec"]["containers"][1]
    p = argparse.ArgumentParser(exit_on_error=False)
    add_controller_args(p)
    c = p.parse_args(head["args"][1:])
    assert (c.prefill, c.decode, c.control_port, c.ray_address) == (2, 1, 9400, "auto")
    # per tier: prefill tp=1, decode tp=2; each replica's bundles ask for the tier's Ray resource
    assert (c.prefill_ranks, c.decode_ranks, c.prefill_kv_backend, c.decode_kv_backend, c.tier_resources) == (
        1, 2, "nixl", "nixl", True)
    # and each tier's tp/pp/ep, which the controller hands that tier's workers as --tp/--pp/--ep
    cc = controller_config(c, Credentials(None))
    assert (cc.prefill_parallel, cc.decode_parallel) == ((1, 1, 1), (2, 1, 1))
    # (and each decode rank's threads: its 500m request, at least one thread; prefill gives no CPU: none passed)
    assert (cc.tier_flags("prefill"), cc.tier_flags("decode")) == ((), ("--tp", "2", "--threads", "1"))
    assert (c.auth_token_file, c.tls_cert, c.tls_key, c.tls_ca, c.tls_server_name) == creds
    # What `tandem controller` hands each worker (cli/controller.py): its own credential flags. The mounted files do
    # not exist here, so their checks are skipped.
    monkeypatch.setattr(TLSFiles, "__post_init__", lambda self: None)
    monkeypatch.setattr(auth.credentials, "read_token_file", lambda path: "x" * 32)
    p = argparse.ArgumentParser(exit_on_error=False)
    add_worker_args(p)
    w = p.parse_args(["--role", "decode", "--model", c.model, *c.worker_flag, *to_flags(from_args(c),
                                                                                           c.auth_token_file),
                      *cc.tier_flags("decode")])
    assert (w.tp, w.pp, w.ep, w.threads) == (2, 1, 1, 1)
    assert w.dtype == "bfloat16" and (w.auth_token_file, w.tls_cert, w.tls_key, w.tls_ca, w.tls_server_name) == creds
    groups = objs[("RayCluster", "llama")]["spec"]["workerGroupSpecs"]
    worker_pod = next(g for g in groups if g["groupName"] == "decode")
    mounts = {m["mountPath"] for m in worker_pod["template"]["spec"]["containers"][0]["volumeMounts"]}
    assert {"/etc/tandem/token", "/etc/tandem/tls"} <= mounts  # the same paths on every pod
    # each tier's pods advertise its Ray resource once per rank: exactly one replica's bundles fit a pod
    from cli.controller import controller_config

    cfg = controller_config(c, from_args(c))
    for g in groups:
        advertised = json.loads(g["rayStartParams"]["resources"])
        wanted: dict[str, float] = {}
        for bundle in cfg.bundles(g["groupName"]):
            for k, v in bundle.items():
                wanted[k] = wanted.get(k, 0) + v
        assert advertised == {k: v for k, v in wanted.items() if k != "CPU"}


def test_status_conditions_follow_the_controller_and_the_router() -> None:
    from operators.status import deployment_status, with_transition_times
    from proto.tandem.v1 import control_pb2 as cpb

    spec = parse(_td(router={"replicas": 1}))
    desired = {"prefill": 2, "decode": 1}
    router = {"status": {"readyReplicas": 1}}

    def tiers(prefill_ready: int, failed: int = 0) -> dict[str, cpb.TierStatus]:
        bad = [cpb.ReplicaStatus(replica_id=f"p{i}", state=cpb.REPLICA_STATE_FAILED) for i in range(failed)]
        return {"prefill": cpb.TierStatus(tier="prefill", desired=2, ready=prefill_ready, replicas=bad),
                "decode": cpb.TierStatus(tier="decode", desired=1, ready=1)}

    def conditions(st: dict[str, Any]) -> dict[str, tuple[str, str]]:
        return {c["type"]: (c["status"], c["reason"]) for c in st["conditions"]}

    ok = deployment_status(spec, 3, desired, tiers(2), None, router)
    assert conditions(ok) == {"Ready": ("True", "AllReplicasReady"), "Progressing": ("False", "Converged"),
                              "Degraded": ("False", "AsExpected")}
    assert (ok["prefill"], ok["decode"], ok["observedGeneration"]) == ("2/2", "1/1", 3)
    scaling = deployment_status(spec, 3, desired, tiers(1, failed=1), None, router)
    assert conditions(scaling) == {"Ready": ("False", "ReplicasNotReady"), "Progressing": ("True", "Scaling"),
                                   "Degraded": ("True", "ReplicasFailed")}
    assert scaling["tiers"]["prefill"] == {"desired": 2, "ready": 1, "draining": 0}
    down = deployment_status(spec, 3, desired, None, "Status on x: UNAVAILABLE", router)
    assert conditions(down)["Ready"] == ("Unknown", "ControllerUnreachable")
    first = with_transition_times(ok["conditions"], None, "2026-01-01T00:00:00Z")
    again = with_transition_times(ok["conditions"], first, "2026-01-01T00:05:00Z")
    assert again == first  # unchanged conditions keep their transition time
    moved = with_transition_times(scaling["conditions"], first, "2026-01-01T00:05:00Z")
    assert {c["type"]: c["lastTransitionTime"] for c in moved}["Ready"] == "2026-01-01T00:05:00Z"


def test_a_layout_the_controller_refused_makes_the_deployment_degraded_with_its_message() -> None:
    """The operator cannot read the model; the controller can, and its refusal (TierStatus.refused) is the
    condition's message (issue 27)."""
    from operators.status import deployment_status
    from proto.tandem.v1 import control_pb2 as cpb

    spec = parse(_td(router={"replicas": 1}))
    why = "decode: tensor parallel size 3 must divide the attention heads (8)"
    control = {"prefill": cpb.TierStatus(tier="prefill", desired=2, ready=2),
               "decode": cpb.TierStatus(tier="decode", desired=1, refused=why)}
    st = deployment_status(spec, 3, {"prefill": 2, "decode": 1}, control, None, {"status": {"readyReplicas": 1}})
    got = {c["type"]: (c["status"], c["reason"], c["message"]) for c in st["conditions"]}
    assert got["Ready"] == ("False", "InvalidLayout", why)
    assert got["Degraded"] == ("True", "InvalidLayout", why)
    assert got["Progressing"][:2] == ("False", "InvalidLayout")
    assert st["decode"] == "0/1"
    unreachable = deployment_status(spec, 3, {"prefill": 2, "decode": 1}, None, "Status on x: UNAVAILABLE", None)
    assert {c["type"]: c["reason"] for c in unreachable["conditions"]}["Degraded"] == "AsExpected"


@pytest.mark.parametrize(("resources", "threads"), [
    ({"requests": {"cpu": "4"}}, 4), ({"requests": {"cpu": "2500m"}}, 2), ({"requests": {"cpu": "250m"}}, 1),
    ({"requests": {"cpu": "2"}, "limits": {"cpu": "6"}}, 6), ({"limits": {"cpu": "3.5"}}, 3),
    ({"requests": {"memory": "8Gi"}}, None), ({}, None),
])
def test_each_tiers_ranks_run_as_many_torch_threads_as_whole_cpus_they_ask_for(
        resources: dict[str, Any], threads: int | None) -> None:
    """A rank's CPUs (its limit, else its request; whole cores, at least one) become ``tandem controller
    --decode-threads``, which the controller hands that tier's workers as ``--threads`` and the worker's own parser
    reads; no CPU in the spec: no flag, the worker keeps its default."""
    import argparse

    from auth.credentials import Credentials
    from cli.controller import add_controller_args, controller_config
    from worker.server import add_worker_args

    td = _td(decode={"replicas": 1, "tp": 1, "kvBackend": "nixl", "resources": resources})
    args = _controller_args(td)
    assert (args[args.index("--decode-threads") + 1] if "--decode-threads" in args else None) == (
        None if threads is None else str(threads))
    assert "--prefill-threads" not in args
    p = argparse.ArgumentParser(exit_on_error=False)
    add_controller_args(p)
    cc = controller_config(p.parse_args(args[1:]), Credentials(None))
    assert (cc.prefill_threads, cc.decode_threads) == (None, threads)
    p = argparse.ArgumentParser(exit_on_error=False)
    add_worker_args(p)
    w = p.parse_args(["--role", "decode", "--model", cc.model, "--threads", "9", *cc.tier_flags("decode")])
    assert w.threads == (9 if threads is None else threads)  # the tier's count wins over a shared --worker-flag
