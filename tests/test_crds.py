"""The TandemDeployment and TandemTier CRDs (deploy/helm/tandem/crds/): the shared Kubernetes contract, the
examples against the schema, and every CEL rule evaluated for real on good and bad objects.

No kube-apiserver can run here: the CRDs themselves are validated with kubernetes-validate (the API server's own
OpenAPI schema for CustomResourceDefinition), objects against the CRDs with jsonschema, and the CEL rules with
cel-python (tests/crd_check.py).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import celpy
import kubernetes_validate
import pytest
import yaml
from crd_check import CHART, cel_failures, load_crds, root_schema, rules, schema_errors

KUBE_VERSIONS = ("1.30", "1.35")
CRDS = load_crds()
TD, TT = CRDS["TandemDeployment"], CRDS["TandemTier"]
EXAMPLES = sorted((CHART / "examples").glob("*.yaml"))


def _example(name: str) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((CHART / "examples" / name).read_text())
    return doc


def _tier(**spec: Any) -> dict[str, Any]:
    return {"apiVersion": "tandem.dev/v1alpha1", "kind": "TandemTier", "metadata": {"name": "llama-decode"},
            "spec": {"deployment": "llama", "tier": "decode", "replicas": 2, "minReplicas": 1, "maxReplicas": 4} | spec}


@pytest.mark.parametrize("kube", KUBE_VERSIONS)
@pytest.mark.parametrize("kind", sorted(CRDS))
def test_crd_is_a_valid_customresourcedefinition(kind: str, kube: str) -> None:
    kubernetes_validate.validate(CRDS[kind], kube, strict=True)


def test_contract_names_group_version_and_scope() -> None:
    for kind, crd in CRDS.items():
        assert crd["spec"]["group"] == "tandem.dev"
        assert crd["spec"]["scope"] == "Namespaced"
        (version,) = crd["spec"]["versions"]
        assert (version["name"], version["served"], version["storage"]) == ("v1alpha1", True, True)
        assert crd["metadata"]["name"] == f"{crd['spec']['names']['plural']}.tandem.dev", kind
    assert TD["spec"]["names"]["shortNames"] == ["td"] and TD["spec"]["names"]["categories"] == ["tandem"]
    assert TT["spec"]["names"]["shortNames"] == ["tt"]


def test_tandemdeployment_printer_columns_are_ready_prefill_decode_age() -> None:
    (version,) = TD["spec"]["versions"]
    columns = [(c["name"], c["jsonPath"]) for c in version["additionalPrinterColumns"]]
    assert columns == [("Ready", '.status.conditions[?(@.type=="Ready")].status'), ("Prefill", ".status.prefill"),
                       ("Decode", ".status.decode"), ("Age", ".metadata.creationTimestamp")]
    status = root_schema(TD)["properties"]["status"]["properties"]
    assert status["prefill"]["type"] == status["decode"]["type"] == "string"
    assert "Ready" in status["conditions"]["items"]["properties"]["type"]["enum"]


def _field(schema: dict[str, Any], path: str) -> dict[str, Any]:
    node = schema
    for part in path.lstrip(".").split("."):
        node = node["properties"][part]
    return node


def test_both_have_a_status_subresource_and_the_tier_a_scale_subresource_on_existing_fields() -> None:
    (td_version,) = TD["spec"]["versions"]
    (tt_version,) = TT["spec"]["versions"]
    assert td_version["subresources"] == {"status": {}}
    assert "status" in tt_version["subresources"]
    scale = tt_version["subresources"]["scale"]
    assert scale == {"specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
                     "labelSelectorPath": ".status.selector"}
    schema = root_schema(TT)
    assert _field(schema, scale["specReplicasPath"])["type"] == "integer"
    assert _field(schema, scale["statusReplicasPath"])["type"] == "integer"
    assert _field(schema, scale["labelSelectorPath"])["type"] == "string"
    for column in tt_version["additionalPrinterColumns"]:
        if column["jsonPath"] != ".metadata.creationTimestamp":
            assert _field(schema, column["jsonPath"])["type"] == column["type"], column


def test_status_written_by_the_operator_matches_the_schema() -> None:
    td = _example("disaggregated.yaml") | {"status": {
        "observedGeneration": 3,
        "tiers": {"prefill": {"desired": 2, "ready": 1, "draining": 0},
                  "decode": {"desired": 2, "ready": 2, "draining": 0}},
        "prefill": "1/2", "decode": "2/2",
        "conditions": [{"type": "Ready", "status": "False", "reason": "TiersStarting", "message": "prefill 1/2 ready",
                        "lastTransitionTime": "2026-01-01T00:00:00Z"}]}}
    assert schema_errors(TD, td) == []
    tt = _tier() | {"status": {"replicas": 2, "readyReplicas": 2, "drainingReplicas": 0, "desiredReplicas": 2,
                               "selector": "tandem.dev/deployment=llama,tandem.dev/tier=decode"}}
    assert schema_errors(TT, tt) == []
    bad = copy.deepcopy(td)
    bad["status"]["conditions"][0]["type"] = "Healthy"
    assert schema_errors(TD, bad)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_validates_against_the_crd_schema_and_its_cel_rules(path: Any) -> None:
    doc = yaml.safe_load(path.read_text())
    assert doc["kind"] == "TandemDeployment" and doc["apiVersion"] == "tandem.dev/v1alpha1"
    assert schema_errors(TD, doc) == []
    assert cel_failures(TD, doc) == []


def test_examples_are_one_disaggregated_and_one_colocated() -> None:
    disagg, coloc = _example("disaggregated.yaml")["spec"], _example("colocated.yaml")["spec"]
    assert disagg["prefill"]["replicas"] == 1 and disagg["decode"]["scaling"] == {"min": 2, "max": 4}
    assert "prefill" not in coloc


def test_schema_rejects_unknown_fields_and_out_of_bound_values() -> None:
    good = _example("disaggregated.yaml")
    for mutate in (lambda s: s["decode"].update(tp=0), lambda s: s["decode"].update(replicaz=2),
                   lambda s: s["decode"].update(kvBackend="rdma"), lambda s: s["model"].update(dtype="int8"),
                   lambda s: s["router"].update(replicas=0), lambda s: s.pop("decode"),
                   lambda s: s["redis"].update(url="http://redis:6379")):
        bad = copy.deepcopy(good)
        mutate(bad["spec"])
        assert schema_errors(TD, bad), bad["spec"]


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def apply(obj: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node = obj
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return apply


def _drop(path: str) -> Callable[[dict[str, Any]], None]:
    def apply(obj: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node = obj
        for p in parents:
            node = node[p]
        del node[last]
    return apply


# For each CEL rule message: an object breaking it, from a good base (the disaggregated example, or a TandemTier),
# and for transition rules the old object it is an update of. Each breaks that rule alone (but ALSO_BROKEN).
BREAKS: dict[str, tuple[str, list[Callable[[dict[str, Any]], None]], dict[str, Any] | None]] = {
    "replicas and scaling are mutually exclusive: set one of them": ("td", [_set("spec.decode.replicas", 3)], None),
    "tp*pp must be at least 1": ("td", [_set("spec.prefill.tp", 0)], None),
    "ep must be at least 1": ("td", [_set("spec.prefill.ep", 0)], None),
    "ep must equal tp, or tp must be 1 (the engine runs experts on the TP ranks or on replicated-attention ranks)": (
        "td", [_set("spec.prefill.tp", 2), _set("spec.prefill.ep", 4)], None),
    "autoscaling.enabled needs prometheusUrl and gpuBudget": (
        "td", [_set("spec.autoscaling", {"enabled": True, "prometheusUrl": "http://prometheus:9090"})], None),
    "scaling.min must be less than or equal to scaling.max": ("td", [_set("spec.decode.scaling.min", 5)], None),
    "model.source needs exactly one of pvc, hostPath or hf": (
        "td", [_set("spec.model.source.hostPath", {"path": "/models/x"})], None),
    "redis needs exactly one of url or inCluster: true": ("td", [_set("spec.redis.url", "redis://r:6379")], None),
    "redis.passwordSecret applies only with redis.url": (
        "td", [_set("spec.redis.passwordSecret", {"name": "redis", "key": "password"})], None),
    "security.mtls.secretName is required when mTLS is enabled": ("td", [_drop("spec.security.mtls.secretName")], None),
    "lora adapter names must be unique": (
        "td", [_set("spec.lora", [{"name": "sql", "path": "a/sql"}, {"name": "sql", "path": "b/sql"}])], None),
    "metadata.name must be a DNS-1035 label of at most 40 characters (it prefixes Service names such as "
    "<name>-router-metrics)": ("td", [_set("metadata.name", "1llama")], None),
    "minReplicas must be less than or equal to maxReplicas": (
        "tt", [_set("spec.minReplicas", 5), _set("spec.maxReplicas", 4), _set("spec.replicas", 4)], None),
    "replicas is below minReplicas": ("tt", [_set("spec.replicas", 0)], None),
    "replicas is above maxReplicas": ("tt", [_set("spec.replicas", 5)], None),
    "deployment is immutable": ("tt", [_set("spec.deployment", "other")], _tier()),
    "tier is immutable": ("tt", [_set("spec.tier", "prefill")], _tier()),
}


# A tier whose bounds cross cannot hold its replicas inside them either.
ALSO_BROKEN = {"minReplicas must be less than or equal to maxReplicas": ["replicas is below minReplicas"]}


def test_every_cel_rule_has_a_breaking_case() -> None:
    messages = {r.message for crd in CRDS.values() for r in rules(crd)}
    assert messages == set(BREAKS)


@pytest.mark.parametrize("message", sorted(BREAKS))
def test_cel_rule_rejects_the_object_that_breaks_it_and_only_that_rule(message: str) -> None:
    which, mutations, old = BREAKS[message]
    crd, obj = (TD, _example("disaggregated.yaml")) if which == "td" else (TT, _tier())
    assert cel_failures(crd, obj, old) == []
    for mutate in mutations:
        mutate(obj)
    assert cel_failures(crd, obj, old) == [message, *ALSO_BROKEN.get(message, [])]


@pytest.mark.parametrize(("redis", "ok"), [
    ({"inCluster": True}, True), ({"url": "rediss://r:6380/0"}, True),
    ({"url": "rediss://r:6380/0", "inCluster": False}, True),
    ({"inCluster": False}, False), ({}, False), ({"url": "redis://r", "inCluster": True}, False)])
def test_redis_needs_exactly_one_of_url_or_in_cluster(redis: dict[str, Any], ok: bool) -> None:
    td = _example("colocated.yaml")
    td["spec"]["redis"] = redis
    assert (cel_failures(TD, td) == []) is ok


@pytest.mark.parametrize(("source", "ok"), [
    ({"pvc": {"claimName": "m"}}, True), ({"hf": {"id": "org/m", "cacheClaimName": "hf"}}, True),
    ({}, False), ({"pvc": {"claimName": "m"}, "hf": {"id": "org/m", "cacheClaimName": "hf"}}, False)])
def test_model_needs_exactly_one_source(source: dict[str, Any], ok: bool) -> None:
    td = _example("colocated.yaml")
    td["spec"]["model"]["source"] = source
    assert (cel_failures(TD, td) == []) is ok


def test_colocated_tier_scaling_at_its_bounds_and_unchanged_tier_update_pass() -> None:
    td = _example("colocated.yaml")
    td["spec"]["decode"] = {"scaling": {"min": 3, "max": 3}}
    assert cel_failures(TD, td) == []
    assert cel_failures(TT, _tier(replicas=4), _tier()) == []


def test_every_cel_rule_compiles() -> None:
    env = celpy.Environment()
    for crd in CRDS.values():
        for r in rules(crd):
            env.compile(r.rule)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_tandemtiers_the_operator_renders_for_an_example_fit_the_tier_crd(path: Any) -> None:
    from operators.render import render

    tiers = [d for d in render(yaml.safe_load(path.read_text()), "serving") if d["kind"] == "TandemTier"]
    assert sorted(t["spec"]["tier"] for t in tiers) == sorted(
        t for t in ("prefill", "decode") if t in yaml.safe_load(path.read_text())["spec"])
    for tier in tiers:
        assert schema_errors(TT, tier) == []
        assert cel_failures(TT, tier) == []


_GOOD_ADAPTERS = [{"name": "sql", "path": "adapters/sql"}, {"name": "Chat.v2_x-1", "path": "chat/"},
                  {"name": "9", "path": ".hidden/a...b"}]


@pytest.mark.parametrize(("adapter", "ok"), [
    *((a, True) for a in _GOOD_ADAPTERS),
    ({"name": "bad name", "path": "a"}, False), ({"name": "-x", "path": "a"}, False),
    ({"name": "a/b", "path": "a"}, False), ({"name": "", "path": "a"}, False),
    ({"name": "x" * 129, "path": "a"}, False),
    ({"name": "a", "path": ""}, False), ({"name": "a"}, False), ({"path": "a"}, False),
    ({"name": "a", "path": "/models/a"}, False), ({"name": "a", "path": "../a"}, False),
    ({"name": "a", "path": "a/../../b"}, False), ({"name": "a", "path": "./a"}, False),
    ({"name": "a", "path": "a//b"}, False), ({"name": "a", "path": "a", "rank": 8}, False),
])
def test_lora_adapter_schema(adapter: dict[str, Any], ok: bool) -> None:
    """spec.lora: a name the engine accepts (engine/lora/config.py) and a non-empty path relative to the model volume
    that cannot leave it; nothing else."""
    td = _example("colocated.yaml")
    td["spec"]["lora"] = [adapter]
    assert (schema_errors(TD, td) == []) is ok, schema_errors(TD, td)
    if ok:  # CEL rules run on objects the schema admits (name is required)
        assert cel_failures(TD, td) == []  # one adapter: the uniqueness rule holds


def test_lora_names_must_be_unique_and_at_most_64() -> None:
    td = _example("colocated.yaml")
    td["spec"]["lora"] = _GOOD_ADAPTERS
    assert schema_errors(TD, td) == [] and cel_failures(TD, td) == []
    td["spec"]["lora"] = [*_GOOD_ADAPTERS, {"name": "sql", "path": "other"}]
    assert schema_errors(TD, td) == [] and cel_failures(TD, td) == ["lora adapter names must be unique"]
    td["spec"]["lora"] = [{"name": f"a{i}", "path": f"a{i}"} for i in range(65)]
    assert schema_errors(TD, td) and cel_failures(TD, td) == []
    lora = root_schema(TD)["properties"]["spec"]["properties"]["lora"]
    # the API server itself also keys the list by name (a repeated key is refused, server-side apply merges by it)
    assert lora["x-kubernetes-list-type"] == "map" and lora["x-kubernetes-list-map-keys"] == ["name"]
