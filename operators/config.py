"""The operator's own settings: where the controller and the Kubernetes API are, and how often state is re-read.

The controller address is a template over the TandemDeployment's name and namespace: in a cluster it is KubeRay's
head Service (``<td>-head-svc.<ns>.svc:9400``); tests point it at a fake ``Control`` server on 127.0.0.1.
"""

from __future__ import annotations

from dataclasses import dataclass

CONTROL_PORT = 9400
DEFAULT_CONTROL_ADDRESS = "{name}-head-svc.{namespace}.svc:" + str(CONTROL_PORT)


@dataclass(slots=True, frozen=True)
class OperatorConfig:
    control_address: str = DEFAULT_CONTROL_ADDRESS  # "{name}" and "{namespace}" are filled per TandemDeployment
    status_interval_s: float = 10.0  # the timer that re-reads actual state and re-asserts owned objects
    status_initial_delay_s: float = 1.0
    # How often the planner loop checks whether a TandemDeployment's spec.autoscaling.intervalSeconds has passed.
    autoscale_tick_s: float = 5.0
    control_timeout_s: float = 5.0  # per Control RPC
    retry_delay_s: float = 10.0  # kopf.TemporaryError delay when the API server or the controller fails
    kube_url: str | None = None  # None: in-cluster service account, else the kubeconfig; tests give kmock's URL
    field_manager: str = "tandem-operator"

    def __post_init__(self) -> None:
        try:
            self.control_address_for("td", "ns")
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(f"control_address {self.control_address!r}: only {{name}} and {{namespace}} may be "
                             f"filled in ({e})") from None
        for field in ("status_interval_s", "autoscale_tick_s", "control_timeout_s", "retry_delay_s"):
            if getattr(self, field) <= 0:
                raise ValueError(f"{field} must be > 0, got {getattr(self, field)}")
        if self.status_initial_delay_s < 0:
            raise ValueError(f"status_initial_delay_s must be >= 0, got {self.status_initial_delay_s}")
        if not self.field_manager:
            raise ValueError("field_manager must not be empty")

    def control_address_for(self, name: str, namespace: str) -> str:
        return self.control_address.format(name=name, namespace=namespace)
