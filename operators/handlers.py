"""The kopf handlers of the operator, registered into a registry built per ``OperatorConfig``.

Level-triggered, in three loops over the same render and apply:

- TandemDeployment created, changed or resumed (``on.create/update/resume``): render and apply every owned
  object, and delete the owned objects it no longer renders (``apply.prune``). An API-server failure raises
  ``kopf.TemporaryError(delay=...)``; a bad spec does not raise at all: it sets ``Degraded=True`` (reason
  ``InvalidSpec``) and posts one Warning Event per distinct message, and nothing is retried until the spec
  changes.
- An owned object changed or was deleted (``on.event`` on each owned kind, filtered by ``managed-by``): that one
  object is rendered and applied again, which patches a hand-edited owned field back (NVIDIA Dynamo #4420) or
  recreates it, and writes nothing otherwise.
- A timer per TandemDeployment: reconcile again (a missed event is repaired within one interval), read the
  controller's ``Status``, forward any tier whose controller-side desired count differs from its TandemTier
  (``SetReplicas``), and write ``.status`` of the TandemDeployment and its TandemTiers when they changed. Every
  Control call carries the deployment's cluster token, over mTLS when it is on (``operators.secrets``).

- A second timer per TandemDeployment (every ``autoscale_tick_s``): the planner loop (``operators.autoscale``), which
  decides once per ``spec.autoscaling.intervalSeconds`` when autoscaling is enabled and writes each TandemTier's
  scale.

A TandemTier change (``kubectl scale``, an HPA, KEDA, the planner) is forwarded at once by ``on.event`` on
TandemTiers: its ``spec.replicas`` clamped to ``[minReplicas, maxReplicas]`` of the TandemDeployment goes to
``Control.SetReplicas``; a clamp posts a Warning Event. Only changed values are forwarded (the timer covers a
controller that restarted and forgot).
"""

from __future__ import annotations

import asyncio
import datetime
import logging
from dataclasses import dataclass, field
from typing import Any

import kopf
from kubernetes_asyncio.client import ApiException

from operators import metrics
from operators.apply import Outcome, apply, prune
from operators.autoscale import PlannerMemory, tick
from operators.config import OperatorConfig
from operators.control import ControlAuth, ControlClients, ControlError
from operators.kube import KINDS, Kube
from operators.labels import GROUP, LABEL_DEPLOYMENT, LABEL_MANAGED_BY, MANAGED_BY, VERSION
from operators.render import render
from operators.secrets import control_auth
from operators.spec import DeploymentSpec, SpecError, parse
from operators.status import (
    deployment_status,
    invalid_spec_conditions,
    missing_api_conditions,
    tier_desired,
    tier_status,
    with_transition_times,
)

TD_PLURAL = "tandemdeployments"
TT_PLURAL = "tandemtiers"
MONITORING_GROUP = "monitoring.coreos.com"
MONITORING_VERSION = f"{MONITORING_GROUP}/v1"  # ServiceMonitor, PodMonitor: rendered only where that API exists
OWNED = [KINDS[k] for k in ("RayCluster", "Deployment", "Service", "PodDisruptionBudget", "NetworkPolicy",
                            "ServiceMonitor", "PodMonitor")]
_MEMO_KEY = "tandem"


@dataclass(slots=True)
class Runtime:
    """What the handlers share for the operator's life (kept in kopf's memo)."""

    kube: Kube
    control: ControlClients
    forwarded: dict[tuple[str, str, str], int] = field(default_factory=dict)  # (ns, td, tier) -> last SetReplicas
    invalid: dict[tuple[str, str], str] = field(default_factory=dict)  # (ns, td) -> the Degraded message reported
    locks: dict[tuple[str, str], asyncio.Lock] = field(default_factory=dict)  # one reconcile at a time per td
    planner: PlannerMemory = field(default_factory=PlannerMemory)

    def lock(self, namespace: str, name: str) -> asyncio.Lock:
        return self.locks.setdefault((namespace, name), asyncio.Lock())


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _runtime(memo: Any) -> Runtime:
    rt = memo.get(_MEMO_KEY)
    assert isinstance(rt, Runtime), "the startup handler did not run"
    return rt


def _set_conditions(body: kopf.Body, patch: kopf.Patch, conditions: list[dict[str, str]]) -> bool:
    previous = list((body.get("status") or {}).get("conditions") or [])
    timed = with_transition_times(conditions, previous, _now())
    if timed == previous:
        return False
    patch.status["conditions"] = timed
    return True


def _report(rt: Runtime, key: tuple[str, str], body: kopf.Body, patch: kopf.Patch,
            logger: logging.Logger | logging.LoggerAdapter[Any], reason: str, message: str,
            conditions: list[dict[str, str]]) -> None:
    """Degraded with ``reason``: the conditions and one Warning Event per distinct message."""
    if rt.invalid.get(key) == message:
        return  # reported already; the patch of its condition may not be visible in ``body`` yet
    rt.invalid[key] = message
    if _set_conditions(body, patch, conditions):
        patch.status["observedGeneration"] = body.get("metadata", {}).get("generation")
        kopf.warn(body, reason=reason, message=message)
        logger.warning("%s: %s", reason, message)


async def reconcile(cfg: OperatorConfig, rt: Runtime, body: kopf.Body, namespace: str, patch: kopf.Patch,
                    logger: logging.Logger | logging.LoggerAdapter[Any]) -> DeploymentSpec | None:
    """Apply every owned object; None (and Degraded, and an Event) for a spec that cannot be reconciled.

    The create/update handler, the timer and the owned-object watch may fire together: one reconcile runs at a
    time per TandemDeployment, and a spec error is reported (condition and Event) once per distinct message."""
    async with rt.lock(namespace, body.get("metadata", {}).get("name", "")):
        return await _reconcile(cfg, rt, body, namespace, patch, logger)


async def _reconcile(cfg: OperatorConfig, rt: Runtime, body: kopf.Body, namespace: str, patch: kopf.Patch,
                     logger: logging.Logger | logging.LoggerAdapter[Any]) -> DeploymentSpec | None:
    key = (namespace, body.get("metadata", {}).get("name", ""))
    try:
        monitoring = await rt.kube.has_group(MONITORING_GROUP)
        objs = render(dict(body), namespace, monitoring=monitoring)
    except SpecError as e:
        metrics.RECONCILES.labels("invalid_spec").inc()
        _report(rt, key, body, patch, logger, "InvalidSpec", str(e), invalid_spec_conditions(str(e)))
        return None
    except ApiException as e:
        metrics.RECONCILES.labels("error").inc()
        raise kopf.TemporaryError(f"API discovery failed: {e.status} {e.reason}", delay=cfg.retry_delay_s) from e
    changed = []
    for obj in objs:
        try:
            outcome = await apply(rt.kube, obj)
        except ApiException as e:
            metrics.RECONCILES.labels("error").inc()
            if e.status == 404:  # the object was missing and so is its API: nothing to retry on until it exists
                message = (f"{obj['apiVersion']} {obj['kind']} is not served by this cluster"
                           + (" (install KubeRay's operator)" if obj["kind"] == "RayCluster" else ""))
                _report(rt, key, body, patch, logger, "MissingAPI", message, missing_api_conditions(message))
                return None
            raise kopf.TemporaryError(f"{obj['kind']} {obj['metadata']['name']}: {e.status} {e.reason}",
                                      delay=cfg.retry_delay_s) from e
        if outcome is not Outcome.UNCHANGED:
            metrics.WRITES.labels(obj["kind"], outcome.value).inc()
            changed.append(f"{obj['kind']}/{obj['metadata']['name']} {outcome.value}")
    rt.invalid.pop(key, None)
    uid = body.get("metadata", {}).get("uid")
    if uid:
        kinds = [KINDS["TandemTier"], *(k for k in OWNED if monitoring or k.api_version != MONITORING_VERSION)]
        try:
            for gone in await prune(rt.kube, objs, kinds, namespace, key[1], uid):
                metrics.WRITES.labels(gone.split("/")[0], "deleted").inc()
                changed.append(f"{gone} deleted")
        except ApiException as e:
            metrics.RECONCILES.labels("error").inc()
            raise kopf.TemporaryError(f"pruning: {e.status} {e.reason}", delay=cfg.retry_delay_s) from e
    metrics.RECONCILES.labels("changed" if changed else "unchanged").inc()
    if changed:
        logger.info("reconciled: %s", ", ".join(changed))
    return parse(dict(body))


async def reassert(rt: Runtime, td: dict[str, Any], namespace: str, kind: str, name: str,
                   logger: logging.Logger | logging.LoggerAdapter[Any]) -> None:
    """An owned object changed or went away: converge that one object (a bad spec is the timer's to report)."""
    async with rt.lock(namespace, td["metadata"]["name"]):
        try:
            monitoring = await rt.kube.has_group(MONITORING_GROUP)
            objs = render(td, namespace, monitoring=monitoring)
        except (SpecError, ApiException):
            return
        for obj in objs:
            if obj["kind"] == kind and obj["metadata"]["name"] == name:
                try:
                    outcome = await apply(rt.kube, obj)
                except ApiException as e:
                    logger.warning("re-asserting %s/%s: %s %s; the timer retries", kind, name, e.status, e.reason)
                    return
                if outcome is not Outcome.UNCHANGED:
                    metrics.WRITES.labels(kind, outcome.value).inc()
                    logger.info("re-asserted %s/%s: %s", kind, name, outcome.value)


async def _forward(cfg: OperatorConfig, rt: Runtime, namespace: str, td: str, tier: str, replicas: int,
                   auth: ControlAuth) -> None:
    address = cfg.control_address_for(td, namespace)
    try:
        await rt.control.set_replicas(address, tier, replicas, auth)
    except ControlError:
        metrics.SET_REPLICAS.labels(tier, "error").inc()
        raise
    metrics.SET_REPLICAS.labels(tier, "ok").inc()
    rt.forwarded[(namespace, td, tier)] = replicas


async def observe(cfg: OperatorConfig, rt: Runtime, body: kopf.Body, namespace: str, patch: kopf.Patch,
                  logger: logging.Logger | logging.LoggerAdapter[Any], stopped: kopf.DaemonStopped | None = None,
                  ) -> None:
    """The timer: reconcile, then actual state from the controller and the owned objects into ``.status``."""
    spec = await reconcile(cfg, rt, body, namespace, patch, logger)
    if spec is None or stopped:
        return
    tiers = {t.name: await rt.kube.get(KINDS["TandemTier"], namespace, f"{spec.name}-{t.name}") for t in spec.tiers}
    desired = {name: tier_desired(spec, name, obj) for name, obj in tiers.items()}
    address = cfg.control_address_for(spec.name, namespace)
    control, control_error = None, None
    try:
        auth = await control_auth(rt.kube, spec, namespace)
        control = await rt.control.status(address, auth)
        for name, want in desired.items():
            got = control.get(name)
            if got is None or got.desired != want:
                await _forward(cfg, rt, namespace, spec.name, name, want, auth)
                logger.info("forwarded %s replicas=%d to the controller (it had %s)", name, want,
                            None if got is None else got.desired)
    except ControlError as e:
        control_error = str(e)
    router = await rt.kube.get(KINDS["Deployment"], namespace, f"{spec.name}-router")
    status = deployment_status(spec, body.get("metadata", {}).get("generation"), desired, control, control_error,
                               router)
    conditions = status.pop("conditions")
    metrics.observe_tiers(namespace, spec.name, status["tiers"])
    current = dict(body.get("status") or {})
    for key, value in status.items():
        if current.get(key) != value:
            patch.status[key] = value
    _set_conditions(body, patch, conditions)
    for name, obj in tiers.items():
        if obj is None:
            continue
        want_status = tier_status(spec, name, desired[name], (control or {}).get(name))
        have = obj.get("status") or {}
        if any(have.get(k) != v for k, v in want_status.items()):
            await rt.kube.patch({"apiVersion": obj["apiVersion"], "kind": obj["kind"],
                                 "metadata": {"name": obj["metadata"]["name"], "namespace": namespace},
                                 "status": want_status}, subresource="status")


async def forward_tier(cfg: OperatorConfig, rt: Runtime, body: kopf.Body, namespace: str,
                       logger: logging.Logger | logging.LoggerAdapter[Any]) -> None:
    """A TandemTier changed: forward its clamped replicas to the controller if they differ from the last sent."""
    td_name, tier = body.get("spec", {}).get("deployment"), body.get("spec", {}).get("tier")
    if not td_name or not tier:
        return
    td = await rt.kube.get(KINDS["TandemDeployment"], namespace, td_name)
    if td is None:
        return
    try:
        spec = parse(td)
    except SpecError:
        return  # the TandemDeployment's own handlers report it
    if spec.tier(tier) is None:
        return
    asked = body.get("spec", {}).get("replicas")
    want = tier_desired(spec, tier, dict(body))
    if rt.forwarded.get((namespace, td_name, tier)) == want:
        return
    if asked is not None and int(asked) != want:
        t = spec.tier(tier)
        assert t is not None
        kopf.warn(body, reason="Clamped", message=f"replicas {asked} clamped to {want}: the TandemDeployment "
                                                  f"allows [{t.min_replicas}, {t.max_replicas}]")
    try:
        await _forward(cfg, rt, namespace, td_name, tier, want, await control_auth(rt.kube, spec, namespace))
    except ControlError as e:
        logger.warning("%s; the status timer retries", e)
        return
    logger.info("forwarded %s replicas=%d to the controller", tier, want)


def build_registry(cfg: OperatorConfig) -> kopf.OperatorRegistry:
    """A fresh registry with every handler of the operator, bound to ``cfg``."""
    registry = kopf.OperatorRegistry()
    td_resource = (GROUP, VERSION, TD_PLURAL)

    if cfg.kube_url is not None:
        @kopf.on.login(registry=registry)
        def login(**_: Any) -> kopf.ConnectionInfo:
            return kopf.ConnectionInfo(server=str(cfg.kube_url))

    @kopf.on.startup(registry=registry)
    async def startup(memo: Any, settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.posting.level = logging.WARNING  # Events for problems only
        # A deletion that meets a timer mid-tick waits for the tick (a second or so) rather than kopf's 60 s poll.
        settings.background.instant_exit_timeout = 10.0
        settings.background.cancellation_polling = 2.0
        memo[_MEMO_KEY] = Runtime(await Kube.connect(cfg.kube_url), ControlClients(cfg.control_timeout_s))

    @kopf.on.cleanup(registry=registry)
    async def cleanup(memo: Any, **_: Any) -> None:
        rt = memo.get(_MEMO_KEY)
        if isinstance(rt, Runtime):
            await rt.control.close()
            await rt.kube.close()

    @kopf.on.resume(*td_resource, registry=registry)
    @kopf.on.create(*td_resource, registry=registry)
    @kopf.on.update(*td_resource, registry=registry)
    async def reconcile_deployment(body: kopf.Body, namespace: str | None, patch: kopf.Patch, memo: Any,
                                   logger: kopf.Logger, **_: Any) -> None:
        await reconcile(cfg, _runtime(memo), body, namespace or "default", patch, logger)

    @kopf.on.delete(*td_resource, optional=True, registry=registry)  # optional: no finalizer; the GC deletes the rest
    async def forget_deployment(name: str | None, namespace: str | None, memo: Any, **_: Any) -> None:
        rt = _runtime(memo)
        key = (namespace or "default", name or "")
        rt.invalid.pop(key, None)
        rt.locks.pop(key, None)
        rt.planner.forget(key)
        for k in [k for k in rt.forwarded if k[:2] == key]:
            del rt.forwarded[k]

    @kopf.timer(*td_resource, interval=cfg.status_interval_s, initial_delay=cfg.status_initial_delay_s,
                registry=registry)
    async def observe_deployment(body: kopf.Body, namespace: str | None, patch: kopf.Patch, memo: Any,
                                 logger: kopf.Logger, **kwargs: Any) -> None:
        stopped: kopf.DaemonStopped | None = kwargs.get("stopped")  # kopf passes it to timers; TimerFn omits it
        if not stopped:  # the operator is stopping or the object is being deleted: its API client may be closed
            await observe(cfg, _runtime(memo), body, namespace or "default", patch, logger, stopped)

    @kopf.timer(*td_resource, id="autoscale", interval=cfg.autoscale_tick_s,
                initial_delay=cfg.status_initial_delay_s, registry=registry)
    async def autoscale_deployment(body: kopf.Body, namespace: str | None, patch: kopf.Patch, memo: Any,
                                   logger: kopf.Logger, **kwargs: Any) -> None:
        if kwargs.get("stopped"):
            return
        rt, ns = _runtime(memo), namespace or "default"
        name = body.get("metadata", {}).get("name", "")
        await tick(rt.control, cfg.control_address_for(name, ns), rt.kube, rt.planner, body, ns, patch, logger)

    @kopf.on.event(GROUP, VERSION, TT_PLURAL, registry=registry)
    async def tier_changed(body: kopf.Body, namespace: str | None, memo: Any, logger: kopf.Logger, type: str,
                           **_: Any) -> None:
        if type in (None, "ADDED", "MODIFIED") and namespace:  # None: the first listing, before the watch
            await forward_tier(cfg, _runtime(memo), body, namespace, logger)

    for kind in OWNED:
        group, _, version = kind.api_version.rpartition("/")

        @kopf.on.event(group, version, kind.plural, id=f"owned_{kind.plural}", labels={LABEL_MANAGED_BY: MANAGED_BY},
                       registry=registry)
        async def owned_changed(body: kopf.Body, namespace: str | None, memo: Any, logger: kopf.Logger, type: str,
                                **_: Any) -> None:
            td_name = body.get("metadata", {}).get("labels", {}).get(LABEL_DEPLOYMENT)
            if type not in ("MODIFIED", "DELETED") or not td_name or not namespace:
                return
            rt = _runtime(memo)
            td = await rt.kube.get(KINDS["TandemDeployment"], namespace, td_name)
            if td is None or td.get("metadata", {}).get("deletionTimestamp"):
                return
            await reassert(rt, td, namespace, body.get("kind", ""), body.get("metadata", {}).get("name", ""), logger)

    return registry
