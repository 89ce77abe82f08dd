"""The Tandem Kubernetes operator (kopf): a ``TandemDeployment`` becomes a KubeRay ``RayCluster`` whose head runs
``tandem controller``, one ``TandemTier`` per tier, the router, Redis when asked, monitoring, disruption budgets and
network policies.

Modules, in the order a reconcile uses them: ``spec`` (validate the custom resource into typed config), ``render``
and its ``render_*`` parts (pure: spec -> manifest dicts), ``apply`` (create or patch each object to the fields the
operator owns, through ``kube``), ``control`` (the controller's gRPC ``Control`` API), ``status`` (actual state into
``.status``), ``handlers`` (the kopf registry that wires them), ``config`` (the operator's own settings).

It imports neither torch nor ray (a test checks ``sys.modules``): the operator pod is small and starts in seconds.
"""
