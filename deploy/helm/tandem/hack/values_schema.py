"""Writes the chart's values.schema.json, whose deployment.spec is derived from the TandemDeployment CRD.

Why generated: the chart can render one TandemDeployment from values, and its spec must be checked by exactly the
CRD's schema at `helm install` time, before the API server sees it. Hand-keeping two copies of that schema would
drift. The conversion makes the CRD's structural schema strict JSON Schema (`additionalProperties: false` on every
object with named properties; the API server instead prunes unknown fields silently) and turns each CEL rule into
the JSON Schema that says the same, where one exists. A CEL rule this file does not know fails the generation, so a
new rule in the CRD is a decision here too. The rest of the values schema (operator, RBAC, monitoring) is below.

    python3 deploy/helm/tandem/hack/values_schema.py          # rewrite values.schema.json
    python3 deploy/helm/tandem/hack/values_schema.py --check  # exit 1 if the committed file differs
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path
from typing import Any

import yaml

CHART = Path(__file__).resolve().parent.parent
CRD_FILE = CHART / "crds" / "tandem.dev_tandemdeployments.yaml"
SCHEMA_FILE = CHART / "values.schema.json"

# Each CEL rule of the CRD's spec and the JSON Schema saying the same (None: JSON Schema cannot compare two fields,
# or a bound already says it; the CRD alone enforces those at apply time).
CEL_AS_JSON_SCHEMA: dict[str, dict[str, Any] | None] = {
    "!(has(self.replicas) && has(self.scaling))": {"not": {"required": ["replicas", "scaling"]}},
    "(has(self.tp) ? self.tp : 1) * (has(self.pp) ? self.pp : 1) >= 1": None,  # tp >= 1 and pp >= 1
    "!has(self.ep) || self.ep >= 1": None,  # ep >= 1
    "!has(self.ep) || self.ep == 1 || !has(self.tp) || self.tp == 1 || self.ep == self.tp": None,
    "self.min <= self.max": None,
    # uniqueItems compares whole items, not one field of each: the API server's list-map keys and this rule refuse a
    # repeated adapter name, and so does the operator (operators/spec.py)
    "self.all(a, self.exists_one(b, b.name == a.name))": None,
    "(has(self.pvc) ? 1 : 0) + (has(self.hostPath) ? 1 : 0) + (has(self.hf) ? 1 : 0) == 1": {
        "oneOf": [{"required": ["pvc"]}, {"required": ["hostPath"]}, {"required": ["hf"]}]
    },
    "has(self.url) != (has(self.inCluster) && self.inCluster)": {
        "oneOf": [{"required": ["url"]}, {"required": ["inCluster"], "properties": {"inCluster": {"const": True}}}]
    },
    "!has(self.passwordSecret) || has(self.url)": {"dependentRequired": {"passwordSecret": ["url"]}},
    "!(has(self.enabled) && self.enabled) || (has(self.prometheusUrl) && has(self.gpuBudget))": {
        "if": {"required": ["enabled"], "properties": {"enabled": {"const": True}}},
        "then": {"required": ["prometheusUrl", "gpuBudget"]},
    },
    "!(has(self.enabled) && self.enabled) || has(self.secretName)": {
        "if": {"required": ["enabled"], "properties": {"enabled": {"const": True}}},
        "then": {"required": ["secretName"]},
    },
}


def strict(node: dict[str, Any]) -> dict[str, Any]:
    """The CRD schema node as strict JSON Schema: closed objects, CEL rules translated, Kubernetes keys dropped."""
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key.startswith("x-kubernetes-") or key == "default":
            continue
        if key == "properties":
            out[key] = {name: strict(child) for name, child in value.items()}
        elif key == "items" or (key == "additionalProperties" and isinstance(value, dict)):
            out[key] = strict(value)
        elif key == "anyOf":
            out[key] = [strict(child) for child in value]
        else:
            out[key] = copy.deepcopy(value)
    if "properties" in node and "additionalProperties" not in node:
        out["additionalProperties"] = False
    rules = [r["rule"] for r in node.get("x-kubernetes-validations", [])]
    translated = []
    for rule in rules:
        if rule not in CEL_AS_JSON_SCHEMA:
            raise ValueError(f"CEL rule without a JSON Schema decision in {__file__}: {rule!r}")
        schema = CEL_AS_JSON_SCHEMA[rule]
        if schema is not None:
            translated.append(schema)
    if len(translated) == 1:
        out.update(translated[0])
    elif translated:
        out["allOf"] = translated
    return out


def td_spec_schema() -> dict[str, Any]:
    crd = yaml.safe_load(CRD_FILE.read_text())
    (version,) = crd["spec"]["versions"]
    return strict(version["schema"]["openAPIV3Schema"]["properties"]["spec"])


def _obj(properties: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"type": "object", "additionalProperties": False, "properties": properties, **extra}


_STR = {"type": "string"}
_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_ANY_OBJ = {"type": "object"}  # core/v1 structures passed through to the pod spec (Kubernetes validates them)
_LIST = {"type": "array", "items": {"type": "object"}}
_DNS1123 = "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"


def values_schema() -> dict[str, Any]:
    spec = td_spec_schema()
    required_when_enabled = spec.pop("required")
    return _obj(
        {
            "global": {"type": "object", "description": "Helm's global values (shared with subcharts)."},
            "nameOverride": {"type": "string", "maxLength": 40},
            "fullnameOverride": {"type": "string", "maxLength": 63},
            "image": _obj(
                {
                    "repository": {"type": "string", "minLength": 1},
                    "tag": _STR,
                    "pullPolicy": {"enum": ["Always", "IfNotPresent", "Never"]},
                },
                required=["repository"],
            ),
            "imagePullSecrets": {
                "type": "array",
                "items": _obj({"name": {"type": "string", "minLength": 1}}, required=["name"]),
            },
            "operator": _obj(
                {
                    "replicas": {"type": "integer", "minimum": 0, "maximum": 1,
                                 "description": "0 pauses the operator; more than one would reconcile twice."},
                    "watchNamespaces": {"type": "array", "uniqueItems": True,
                                        "items": {"type": "string", "pattern": _DNS1123, "maxLength": 63}},
                    "extraArgs": {"type": "array", "items": _STR},
                    "extraEnv": _LIST,
                    "healthPort": {"type": "integer", "minimum": 1024, "maximum": 65535},
                    "metricsPort": {"type": "integer", "minimum": 1024, "maximum": 65535},
                    "resources": _obj({"requests": _MAP | {"additionalProperties": {}},
                                       "limits": _MAP | {"additionalProperties": {}}}),
                    "nodeSelector": _MAP,
                    "tolerations": _LIST,
                    "affinity": _ANY_OBJ,
                    "podAnnotations": _MAP,
                    "podLabels": _MAP,
                    "priorityClassName": _STR,
                }
            ),
            "serviceAccount": _obj({"create": {"type": "boolean"}, "name": _STR, "annotations": _MAP}),
            "rbac": _obj({"create": {"type": "boolean"}}),
            "monitoring": _obj(
                {
                    "enabled": {"type": "boolean"},
                    "kind": {"enum": ["PodMonitor", "ServiceMonitor"]},
                    "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                    "labels": _MAP,
                }
            ),
            "dashboards": _obj({"enabled": {"type": "boolean"}, "labels": _MAP, "annotations": _MAP}),
            "alerts": _obj({"enabled": {"type": "boolean"}, "labels": _MAP}),
            "deployment": _obj(
                {
                    "enabled": {"type": "boolean"},
                    "name": {"type": "string", "maxLength": 40, "pattern": "^([a-z]([-a-z0-9]*[a-z0-9])?)?$"},
                    "spec": spec,
                },
                **{"if": {"properties": {"enabled": {"const": True}}, "required": ["enabled"]},
                   "then": {"properties": {"spec": {"required": required_when_enabled}}}},
            ),
            "tests": _obj(
                {
                    "deployment": {"type": "string", "maxLength": 40, "pattern": "^([a-z]([-a-z0-9]*[a-z0-9])?)?$"},
                    "apiKeySecret": {
                        "anyOf": [
                            _obj({}),
                            _obj({"name": {"type": "string", "minLength": 1},
                                  "key": {"type": "string", "minLength": 1}}, required=["name", "key"]),
                        ]
                    },
                }
            ),
            "kuberay-operator": {"type": "object", "properties": {"enabled": {"type": "boolean"}},
                                 "description": "Values of the optional kuberay-operator subchart."},
        },
        **{"$schema": "https://json-schema.org/draft/2020-12/schema", "title": "Tandem chart values"},
    )


def render() -> str:
    return json.dumps(values_schema(), indent=2) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if values.schema.json is not up to date")
    args = parser.parse_args()
    text = render()
    if args.check:
        if not SCHEMA_FILE.exists() or SCHEMA_FILE.read_text() != text:
            print(f"{SCHEMA_FILE} is out of date: run python3 {Path(__file__).relative_to(CHART.parent.parent.parent)}",
                  file=sys.stderr)
            return 1
        return 0
    SCHEMA_FILE.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
