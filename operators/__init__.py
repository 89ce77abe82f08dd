"""The Tandem Kubernetes operator (kopf): a ``TandemDeployment`` becomes a KubeRay ``RayCluster`` whose head runs
``tandem controller``, one ``TandemTier`` per tier, the router, Redis when asked, monitoring, disruption budgets and
network policies.

Modules, in the order a reconcile uses them: ``spec`` (validate the custom resource into typed config), ``render``
with ``render_ray``, ``render_router``, ``render_redis``, ``render_policy``, ``pods`` and ``labels`` (pure: spec ->
manifest dicts), ``apply`` (create, patch to the fields the operator owns, prune what is no longer rendered) over
``kube`` (the Kubernetes API), ``control`` (the controller's gRPC ``Control`` API), ``status`` (actual state into
``.status``), ``handlers`` (the kopf registry that wires them), ``metrics`` and ``config`` (the operator's own).
``planner/`` is the SLO planner, a pure function the operator, ``tandem up`` and the simulator share; the operator
runs it in ``autoscale`` (the planner loop), configured by ``autoscaling`` (``spec.autoscaling``), fed by
``prometheus`` (observations over Prometheus' HTTP API), its state kept in the status by ``planner_store``.

What it touches (the chart's RBAC grants exactly this): TandemDeployments (watch, patch, status), TandemTiers
(their ``/scale`` too), RayClusters, Deployments, Services, PodDisruptionBudgets, NetworkPolicies, ServiceMonitors and
PodMonitors (watch, create, patch, delete), Events (create), and CRDs (list and watch: kopf learns from them which
APIs exist). Outside the API server: each deployment's controller (gRPC) and, with autoscaling, its Prometheus (HTTP).

It imports neither torch nor ray (a test checks ``sys.modules``): the operator pod is small and starts in seconds.
"""
