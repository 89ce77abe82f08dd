"""Ray control plane: placement groups for replicas, rank actors, and the ``tandem up`` local cluster."""
