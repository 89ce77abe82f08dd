"""What the API server would check of a Tandem custom resource, done offline: its CRD's schema and its CEL rules.

No kube-apiserver can run here, so the two halves of its validation run separately and for real:
- the openAPIV3Schema with `jsonschema`, closed first (every object with named properties gets
  `additionalProperties: false`: the API server would silently prune an unknown field, which in an example or a
  rendered manifest is a typo to fail on, not to drop);
- every `x-kubernetes-validations` rule with cel-python (`celpy`), evaluated at each node present in the object as
  the API server does, with `oldSelf` for transition rules when an old object is given.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import celpy
import jsonschema
import yaml

CHART = Path(__file__).resolve().parent.parent / "deploy" / "helm" / "tandem"
CRD_DIR = CHART / "crds"


def load_crds() -> dict[str, dict[str, Any]]:
    """The chart's CRDs by kind."""
    out = {}
    for path in sorted(CRD_DIR.glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        out[crd["spec"]["names"]["kind"]] = crd
    return out


def root_schema(crd: dict[str, Any]) -> dict[str, Any]:
    (version,) = crd["spec"]["versions"]
    schema: dict[str, Any] = version["schema"]["openAPIV3Schema"]
    return schema


def closed(node: dict[str, Any]) -> dict[str, Any]:
    """The schema with every object that names its properties closed to others (metadata stays open)."""
    out = copy.deepcopy(node)

    def walk(n: dict[str, Any], top: bool) -> None:
        props = n.get("properties")
        if props is not None:
            n.setdefault("additionalProperties", False)
            for name, child in props.items():
                if not (top and name == "metadata"):
                    walk(child, False)
        for key in ("items", "additionalProperties"):
            if isinstance(n.get(key), dict):
                walk(n[key], False)
        for child in n.get("anyOf", []):
            walk(child, False)

    walk(out, True)
    return out


def schema_errors(crd: dict[str, Any], obj: dict[str, Any]) -> list[str]:
    validator = jsonschema.Draft202012Validator(closed(root_schema(crd)))
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(obj)]


@dataclass(slots=True, frozen=True)
class Rule:
    path: str  # where in the schema, e.g. "spec.decode"
    rule: str
    message: str


def rules(crd: dict[str, Any]) -> list[Rule]:
    """Every CEL rule of the CRD with the schema path it sits on."""
    found: list[Rule] = []

    def walk(n: dict[str, Any], path: str) -> None:
        for r in n.get("x-kubernetes-validations", []):
            found.append(Rule(path, r["rule"], r["message"]))
        for name, child in n.get("properties", {}).items():
            walk(child, f"{path}.{name}" if path else name)
        if isinstance(n.get("items"), dict):
            walk(n["items"], f"{path}[]")
        if isinstance(n.get("additionalProperties"), dict):
            walk(n["additionalProperties"], f"{path}{{}}")

    walk(root_schema(crd), "")
    return found


_ENV = celpy.Environment()
_PROGRAMS: dict[str, Any] = {}


def _program(rule: str) -> Any:
    if rule not in _PROGRAMS:
        _PROGRAMS[rule] = _ENV.program(_ENV.compile(rule))
    return _PROGRAMS[rule]


def cel_failures(crd: dict[str, Any], obj: Any, old: Any = None) -> list[str]:
    """Messages of the CEL rules that `obj` breaks (transition rules only when `old` is given)."""
    failed: list[str] = []

    def walk(n: dict[str, Any], value: Any, previous: Any) -> None:
        for r in n.get("x-kubernetes-validations", []):
            uses_old = "oldSelf" in r["rule"]
            if uses_old and previous is None:
                continue  # transition rules do not run on create
            activation = {"self": celpy.json_to_cel(value)}
            if uses_old:
                activation["oldSelf"] = celpy.json_to_cel(previous)
            result = _program(r["rule"]).evaluate(activation)
            if not isinstance(result, celpy.celtypes.BoolType):
                raise AssertionError(f"CEL rule {r['rule']!r} did not evaluate to a bool: {result!r}")
            if not result:
                failed.append(r["message"])
        if isinstance(value, dict):
            for name, child in n.get("properties", {}).items():
                if name in value:
                    walk(child, value[name], previous.get(name) if isinstance(previous, dict) else None)
            extra = n.get("additionalProperties")
            if isinstance(extra, dict):
                for child_value in value.values():
                    walk(extra, child_value, None)
        elif isinstance(value, list) and isinstance(n.get("items"), dict):
            for item in value:
                walk(n["items"], item, None)

    walk(root_schema(crd), obj, old)
    return failed
