{{/*
The rules for what the operator touches in a namespace it watches, and nothing else: its own resources, what it
reconciles a TandemDeployment into (RayCluster, the router's Deployment and Services, the in-cluster Redis,
PodDisruptionBudgets, NetworkPolicies, ServiceMonitor, the workers' PodMonitor), reading a named Secret or ConfigMap (the cluster-token and mTLS
Secrets a TandemDeployment names, for its calls to the controller), and Events for a bad spec.
*/}}
{{- define "tandem.namespacedRules" -}}
- apiGroups: ["tandem.dev"]
  resources: ["tandemdeployments"]
  verbs: ["get", "list", "watch", "patch", "update"]
- apiGroups: ["tandem.dev"]
  resources: ["tandemdeployments/status"]
  verbs: ["get", "patch", "update"]
# Owner references with blockOwnerDeletion need update on the owner's finalizers (OwnerReferencesPermissionEnforcement).
- apiGroups: ["tandem.dev"]
  resources: ["tandemdeployments/finalizers"]
  verbs: ["update"]
- apiGroups: ["tandem.dev"]
  resources: ["tandemtiers"]
  verbs: ["get", "list", "watch", "create", "patch", "update", "delete"]
- apiGroups: ["tandem.dev"]
  resources: ["tandemtiers/status", "tandemtiers/scale"]
  verbs: ["get", "patch", "update"]
- apiGroups: ["ray.io"]
  resources: ["rayclusters"]
  verbs: ["get", "list", "watch", "create", "patch", "update", "delete"]
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "create", "patch", "update", "delete"]
- apiGroups: [""]
  resources: ["services"]
  verbs: ["get", "list", "watch", "create", "patch", "update", "delete"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "list", "watch", "create", "patch", "update", "delete"]
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "list", "watch", "create", "patch", "update", "delete"]
- apiGroups: ["monitoring.coreos.com"]
  resources: ["servicemonitors", "podmonitors"]
  verbs: ["get", "list", "watch", "create", "patch", "update", "delete"]
# Named Secrets and ConfigMaps only (get: no list or watch, which would read every Secret in the namespace).
- apiGroups: [""]
  resources: ["configmaps", "secrets"]
  verbs: ["get"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
{{- end }}
