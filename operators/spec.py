"""A ``TandemDeployment``'s spec, validated into typed, frozen config.

The CRD's openAPIV3Schema and CEL rules catch most mistakes at admission, but an API server without CEL, a spec
written before a rule existed, or a rule the schema cannot state (a GPU count that the ranks do not divide, a
Redis password without a URL) still reach the operator. Every such case raises ``SpecError`` with a message that
names the field; the reconcile turns it into ``Degraded=True`` and a Warning Event, and does not retry until the
spec changes.

Absent fields take the CRD's defaults (mTLS on with the Secret ``tandem-mtls`` and server name ``tandem``, the cluster
token from the Secret ``tandem-cluster-token`` key ``token``, one router, bfloat16, nixl), so a TandemDeployment read
from a file renders as the API server would store it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from operators.autoscaling import AutoscalingError, AutoscalingSpec, TierBounds, parse_autoscaling

TIERS = ("prefill", "decode")
KV_BACKENDS = ("nixl", "tcp", "torch", "auto")
DTYPES = ("float32", "bfloat16", "float16")
DEFAULT_IMAGE = "ghcr.io/tandem-dev/tandem"
DEFAULT_TAG = "0.1.0"
PULL_POLICIES = ("Always", "IfNotPresent", "Never")
DEFAULT_MTLS_SECRET = "tandem-mtls"
DEFAULT_SERVER_NAME = "tandem"  # the DNS name every Tandem server's certificate carries (pod IPs are not known)
DEFAULT_TOKEN_SECRET = ("tandem-cluster-token", "token")
_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]+)?)([a-zA-Z]*)$")
# A LoRA adapter's name: engine/lora/config.py's rule (the operator does not import the engine; a test checks they
# agree). Its path: relative, inside the model volume, no '.' or '..' segment, as the CRD's pattern says.
ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._\-]*")
_SEGMENT = r"(?:[^./][^/]*|\.[^./][^/]*|\.\.[^/]+)"
ADAPTER_PATH = re.compile(rf"{_SEGMENT}(?:/{_SEGMENT})*/?")
MAX_ADAPTERS = 64


class SpecError(ValueError):
    """A TandemDeployment spec that cannot be reconciled; the message names the field."""


@dataclass(slots=True, frozen=True)
class Image:
    repository: str = DEFAULT_IMAGE
    tag: str = DEFAULT_TAG
    pull_policy: str = "IfNotPresent"

    def __post_init__(self) -> None:
        if not self.repository or not self.tag:
            raise SpecError("spec.image: repository and tag must not be empty")
        if self.pull_policy not in PULL_POLICIES:
            raise SpecError(f"spec.image.pullPolicy {self.pull_policy!r} is not one of {', '.join(PULL_POLICIES)}")

    @property
    def ref(self) -> str:
        return f"{self.repository}:{self.tag}"


@dataclass(slots=True, frozen=True)
class ModelSpec:
    kind: str  # pvc | hostPath | hf
    path: str  # the model's path inside the pod, or the HF id
    volume: dict[str, Any]  # the pod volume that holds it (without its name)
    mount_path: str
    served_name: str
    dtype: str

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise SpecError(f"spec.model.dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if not self.served_name:
            raise SpecError("spec.model.servedName must not be empty")


@dataclass(slots=True, frozen=True)
class LoRAAdapter:
    """A PEFT adapter every worker replica serves as ``model: name``: ``path`` is its directory inside the model
    volume (the pvc's or HF cache's root, or the hostPath model directory), mounted at ``ModelSpec.mount_path``."""

    name: str
    path: str

    def __post_init__(self) -> None:
        check_adapter(self.name, self.path, "spec.lora")

    def pod_path(self, model: ModelSpec) -> str:
        return f"{model.mount_path}/{self.path.rstrip('/')}"


def check_adapter(name: Any, path: Any, where: str) -> None:
    """SpecError unless ``name`` is an adapter name the worker takes and ``path`` a relative path in the volume."""
    if not isinstance(name, str) or not ADAPTER_NAME.fullmatch(name) or len(name) > 128:
        raise SpecError(f"{where}.name {name!r} must be letters, digits, '.', '_' or '-' (starting with a letter or "
                        f"digit, at most 128)")
    if not isinstance(path, str) or not path:
        raise SpecError(f"{where}.path must be a non-empty directory inside the model volume")
    if not ADAPTER_PATH.fullmatch(path):
        raise SpecError(f"{where}.path {path!r} must be relative to the model volume, without '.' or '..' "
                        f"segments or empty ones")


@dataclass(slots=True, frozen=True)
class SecretKey:
    name: str
    key: str

    def __post_init__(self) -> None:
        if not self.name or not self.key:
            raise SpecError("a secret reference needs both name and key")


@dataclass(slots=True, frozen=True)
class TierSpec:
    name: str  # prefill | decode
    replicas: int  # the count the TandemDeployment asks for (scaling.min when it gives a range)
    min_replicas: int
    max_replicas: int
    tp: int
    pp: int
    ep: int
    kv_backend: str
    resources: dict[str, Any] = field(default_factory=dict)  # one rank's; a pod holds every rank of a replica
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        where = f"spec.{self.name}"
        for name in ("tp", "pp", "ep"):
            if getattr(self, name) < 1:
                raise SpecError(f"{where}.{name} must be >= 1, got {getattr(self, name)}")
        if self.ep > 1 and self.tp > 1 and self.ep != self.tp:  # engine/parallel/config.py's rule
            raise SpecError(f"{where}: ep={self.ep} with tp={self.tp}: expert parallelism runs on the tensor-parallel "
                            f"ranks (ep == tp) or on replicated-attention ranks (tp == 1), so ep must equal tp or "
                            f"tp must be 1")
        if self.kv_backend not in KV_BACKENDS:
            raise SpecError(f"{where}.kvBackend {self.kv_backend!r} is not one of {', '.join(KV_BACKENDS)}")
        if not 0 <= self.min_replicas <= self.max_replicas:
            raise SpecError(f"{where}.scaling: min={self.min_replicas} must be >= 0 and <= max={self.max_replicas}")
        if not self.min_replicas <= self.replicas <= self.max_replicas:
            raise SpecError(f"{where}: replicas={self.replicas} outside [{self.min_replicas}, {self.max_replicas}]")
        for section in ("requests", "limits"):
            for resource, amount in (self.resources.get(section) or {}).items():
                if _QUANTITY.match(str(amount)) is None:
                    raise SpecError(f"{where}.resources.{section}.{resource}: {amount!r} is not a plain quantity")
        gpus = (self.resources.get("limits") or {}).get("nvidia.com/gpu")
        if gpus is not None and (not str(gpus).isdigit() or int(gpus) < 1):
            raise SpecError(f"{where}.resources: nvidia.com/gpu must be a whole number >= 1, got {gpus!r}")

    @property
    def ranks(self) -> int:
        """Placement-group bundles of one replica: ``max(tp, ep)`` ranks per pipeline stage, times ``pp`` (as
        engine/parallel/config.py numbers them)."""
        return max(self.tp, self.ep) * self.pp

    @property
    def gpus_per_replica(self) -> int:
        """Its ranks times a rank's ``nvidia.com/gpu`` limit (one device per rank when the limit is not given)."""
        per_rank = (self.resources.get("limits") or {}).get("nvidia.com/gpu")
        return self.ranks * (int(per_rank) if per_rank is not None else 1)

    @property
    def threads(self) -> int | None:
        """Each rank's torch threads: its whole CPUs (the limit, else the request; at least 1), or None when the spec
        gives no CPU (the worker keeps its default). Without it a rank would run the single thread Ray's
        OMP_NUM_THREADS=1 leaves an actor's child, whatever the pod asked for."""
        for section in ("limits", "requests"):
            cpu = (self.resources.get(section) or {}).get("cpu")
            if cpu is not None:
                m = _QUANTITY.match(str(cpu))
                assert m is not None  # __post_init__ checked every quantity
                cores = float(m.group(1)) / (1000 if m.group(2) == "m" else 1)
                return max(1, int(cores))
        return None

    def clamp(self, replicas: int) -> int:
        return min(max(replicas, self.min_replicas), self.max_replicas)

    def pod_resources(self) -> dict[str, Any]:
        """One replica's pod: each rank's requests and limits times the ranks."""
        return {section: {k: scale_quantity(str(v), self.ranks) for k, v in amounts.items()}
                for section, amounts in self.resources.items() if section in ("requests", "limits") and amounts}


@dataclass(slots=True, frozen=True)
class RedisSpec:
    url: str | None  # None: in-cluster
    password: SecretKey | None = None

    @property
    def in_cluster(self) -> bool:
        return self.url is None


@dataclass(slots=True, frozen=True)
class SecuritySpec:
    """``token_secret`` holds the cluster token (auth/token.py): admin RPCs carry it (the workers' Drain, Snapshot,
    Abort and KVEvents, the controller's SetReplicas and Drain) and it keys the HMAC that signs the Redis registry
    entries (auth/signing.py). One secret for both, because the signing key is derived from the token."""

    mtls_secret: str | None = None  # Secret with tls.crt, tls.key and ca.crt; None: mTLS off
    token_secret: SecretKey = field(default_factory=lambda: SecretKey(*DEFAULT_TOKEN_SECRET))
    server_name: str | None = None  # what clients check servers' certificates against (mTLS only)

    def __post_init__(self) -> None:
        if self.server_name is not None and (not self.mtls_secret or not self.server_name):
            raise SpecError("spec.security.mtls.serverName needs mTLS enabled and must not be empty")


@dataclass(slots=True, frozen=True)
class DeploymentSpec:
    name: str
    image: Image
    model: ModelSpec
    router_replicas: int
    router_resources: dict[str, Any]
    api_key_secret: SecretKey | None
    tiers: tuple[TierSpec, ...]  # decode always; prefill first when disaggregated
    redis: RedisSpec
    security: SecuritySpec
    slo: dict[str, Any]
    autoscaling: AutoscalingSpec | None = None  # None: absent or disabled (operators.autoscaling)
    lora: tuple[LoRAAdapter, ...] = ()  # served by every replica of every tier (tandem controller --lora)

    def __post_init__(self) -> None:
        if self.router_replicas < 1:
            raise SpecError(f"spec.router.replicas must be >= 1, got {self.router_replicas}")
        names = [a.name for a in self.lora]
        if len(set(names)) != len(names):
            raise SpecError(f"spec.lora: adapter names must be unique, got {names}")
        if len(names) > MAX_ADAPTERS:
            raise SpecError(f"spec.lora: at most {MAX_ADAPTERS} adapters, got {len(names)}")
        if self.model.served_name in names:  # a request's model: NAME would name both
            raise SpecError(f"spec.lora: adapter {self.model.served_name!r} has the served model's name")
        multi_rank = [f"spec.{t.name} has tp={t.tp} pp={t.pp} ep={t.ep}" for t in self.tiers
                      if max(t.tp, t.pp, t.ep) > 1]
        if self.lora and multi_rank:  # worker/server.py's rule; every tier's workers get the adapters
            raise SpecError(f"spec.lora: LoRA adapters run on single-rank workers only, but {'; '.join(multi_rank)}")
        backends = {t.name: t.kv_backend for t in self.tiers}
        if len(set(backends.values())) > 1:  # a prefill worker's sender and a decode worker's receiver must match
            raise SpecError(f"spec.prefill.kvBackend ({backends['prefill']}) and spec.decode.kvBackend "
                            f"({backends['decode']}) must match: KV moves from prefill to decode over one transport")

    @property
    def disaggregated(self) -> bool:
        return any(t.name == "prefill" for t in self.tiers)

    def tier(self, name: str) -> TierSpec | None:
        return next((t for t in self.tiers if t.name == name), None)


def scale_quantity(quantity: str, factor: int) -> str:
    """``"500m" * 2 == "1000m"``, ``"16Gi" * 2 == "32Gi"``: the number scales, the suffix stays."""
    m = _QUANTITY.match(quantity)
    if m is None:
        raise SpecError(f"{quantity!r} is not a plain quantity")
    number, suffix = float(m.group(1)) * factor, m.group(2)
    if suffix == "m" and number % 1000 == 0:  # the API server would print "1000m" back as "1"
        number, suffix = number / 1000, ""
    return (str(int(number)) if number.is_integer() else f"{number:g}") + suffix


def parse(td: dict[str, Any]) -> DeploymentSpec:
    """Validate a TandemDeployment (the whole object, as the API server or a YAML file gives it)."""
    name = (td.get("metadata") or {}).get("name")
    if not name:
        raise SpecError("metadata.name is missing")
    spec = td.get("spec")
    if not isinstance(spec, dict):
        raise SpecError("spec is missing")
    try:
        return _parse(name, spec)
    except SpecError:
        raise
    except (TypeError, ValueError, AttributeError) as e:  # a field of the wrong type
        raise SpecError(f"spec: {e}") from None


def _parse(name: str, spec: dict[str, Any]) -> DeploymentSpec:
    image = spec.get("image") or {}
    if spec.get("decode") is None:
        raise SpecError("spec.decode is required")
    tiers = tuple(_tier(t, spec[t]) for t in TIERS if spec.get(t) is not None)
    router = spec.get("router") or {}
    api_key = router.get("apiKeySecret")
    security = spec.get("security") or {}
    mtls = security.get("mtls") or {}
    mtls_on, mtls_secret = mtls.get("enabled", True), mtls.get("secretName", DEFAULT_MTLS_SECRET)
    if mtls_on and not mtls_secret:
        raise SpecError("spec.security.mtls: enabled needs secretName")
    token = security.get("tokenSecret") or dict(zip(("name", "key"), DEFAULT_TOKEN_SECRET, strict=True))
    slo = dict(spec.get("slo") or {})
    try:
        bounds = tuple(TierBounds(t.name, t.min_replicas, t.max_replicas, t.gpus_per_replica) for t in tiers)
        autoscaling = parse_autoscaling(spec.get("autoscaling"), bounds, slo)
    except AutoscalingError as e:
        raise SpecError(str(e)) from None
    return DeploymentSpec(
        name=name,
        image=Image(image.get("repository", DEFAULT_IMAGE), str(image.get("tag", DEFAULT_TAG)),
                    image.get("pullPolicy", "IfNotPresent")),
        model=_model(spec.get("model")),
        router_replicas=int(router.get("replicas", 1)),
        router_resources=dict(router.get("resources") or {}),
        api_key_secret=SecretKey(api_key["name"], api_key["key"]) if api_key else None,
        tiers=tiers,
        redis=_redis(spec.get("redis")),
        security=SecuritySpec(mtls_secret if mtls_on else None,
                              SecretKey(str(token.get("name") or ""), str(token.get("key") or "")),
                              mtls.get("serverName", DEFAULT_SERVER_NAME) if mtls_on else None),
        slo=slo,
        autoscaling=autoscaling,
        lora=_lora(spec.get("lora")),
    )


def _tier(name: str, t: dict[str, Any]) -> TierSpec:
    if not isinstance(t, dict):
        raise SpecError(f"spec.{name} must be an object")
    scaling = t.get("scaling")
    if scaling is not None and t.get("replicas") is not None:
        raise SpecError(f"spec.{name}: replicas and scaling are exclusive; give one")
    if scaling is not None:
        lo, hi = int(scaling.get("min", 1)), int(scaling.get("max", 1))
        if lo > hi:
            raise SpecError(f"spec.{name}.scaling: min={lo} is greater than max={hi}")
        replicas = lo
    else:
        # Fixed replicas pin the tier: a TandemTier scaled by hand is clamped back to this; scaling{} frees it.
        replicas = int(t.get("replicas", 1))
        if replicas < 0:
            raise SpecError(f"spec.{name}.replicas must be >= 0, got {replicas}")
        lo = hi = replicas
    return TierSpec(name=name, replicas=replicas, min_replicas=lo, max_replicas=hi, tp=int(t.get("tp", 1)),
                    pp=int(t.get("pp", 1)), ep=int(t.get("ep", 1)), kv_backend=t.get("kvBackend", "nixl"),
                    resources=dict(t.get("resources") or {}), node_selector=dict(t.get("nodeSelector") or {}),
                    tolerations=list(t.get("tolerations") or []))


def _model(m: Any) -> ModelSpec:
    if not isinstance(m, dict) or not isinstance(m.get("source"), dict):
        raise SpecError("spec.model.source is required")
    source = m["source"]
    given = [k for k in ("pvc", "hostPath", "hf") if source.get(k)]
    if len(given) != 1:
        raise SpecError(f"spec.model.source needs exactly one of pvc, hostPath, hf; got {given or 'none'}")
    kind = given[0]
    s = source[kind]
    if kind == "pvc":
        if not s.get("claimName"):
            raise SpecError("spec.model.source.pvc.claimName is required")
        sub = str(s.get("path", "")).strip("/")
        volume = {"persistentVolumeClaim": {"claimName": s["claimName"], "readOnly": True}}
        mount, path, default_name = "/models", "/models/" + sub if sub else "/models", sub.rsplit("/", 1)[-1]
    elif kind == "hostPath":
        if not str(s.get("path", "")).startswith("/"):
            raise SpecError("spec.model.source.hostPath.path must be an absolute path")
        volume = {"hostPath": {"path": s["path"], "type": "Directory"}}
        mount, path, default_name = "/models/model", "/models/model", s["path"].rstrip("/").rsplit("/", 1)[-1]
    else:
        if not s.get("id") or not s.get("cacheClaimName"):
            raise SpecError("spec.model.source.hf needs id and cacheClaimName (the model is read offline from it)")
        volume = {"persistentVolumeClaim": {"claimName": s["cacheClaimName"], "readOnly": True}}
        mount, path, default_name = "/hf-cache", s["id"], s["id"].rsplit("/", 1)[-1]
    return ModelSpec(kind=kind, path=path, volume=volume, mount_path=mount,
                     served_name=m.get("servedName") or default_name, dtype=m.get("dtype", "bfloat16"))


def _lora(adapters: Any) -> tuple[LoRAAdapter, ...]:
    if adapters is None:
        return ()
    if not isinstance(adapters, list):
        raise SpecError("spec.lora must be a list of {name, path}")
    out = []
    for i, a in enumerate(adapters):
        if not isinstance(a, dict):
            raise SpecError(f"spec.lora[{i}] must be an object with name and path")
        check_adapter(a.get("name"), a.get("path"), f"spec.lora[{i}]")
        out.append(LoRAAdapter(a["name"], a["path"]))
    return tuple(out)


def _redis(r: Any) -> RedisSpec:
    if not isinstance(r, dict):
        raise SpecError("spec.redis needs exactly one of url, inCluster")
    url, in_cluster = r.get("url"), bool(r.get("inCluster"))
    if bool(url) == in_cluster:
        raise SpecError("spec.redis needs exactly one of url, inCluster")
    password = r.get("passwordSecret")
    if password and in_cluster:
        raise SpecError("spec.redis.passwordSecret goes with url, not inCluster")
    if url and not str(url).startswith(("redis://", "rediss://")):
        raise SpecError(f"spec.redis.url {url!r} must start with redis:// or rediss://")
    return RedisSpec(url or None, SecretKey(password["name"], password["key"]) if password else None)
