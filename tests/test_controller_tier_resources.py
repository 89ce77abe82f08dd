"""The controller's placement-group bundles on a real local Ray (its own instance, started and stopped here): a node
that advertises only ``tandem_decode`` (as the operator's decode worker group does) places a decode replica's
bundles and never a prefill replica's, which stays pending until a node of its tier would join."""

from __future__ import annotations

import os

import pytest

from controlplane.controller import ControllerConfig

pytestmark = pytest.mark.slow


def test_a_tiers_bundles_are_placed_only_on_a_node_advertising_its_resource() -> None:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    cfg = ControllerConfig("/m", cpus_per_replica=0.25, prefill_ranks=1, decode_ranks=2, tier_resources=True)
    assert not ray.is_initialized(), "another test left Ray running"
    ray.init(num_cpus=2, resources={"tandem_decode": 2}, include_dashboard=False, log_to_driver=False,
             _node_ip_address="127.0.0.1", configure_logging=False)
    try:
        decode = placement_group(cfg.bundles("decode"), strategy="PACK")
        prefill = placement_group(cfg.bundles("prefill"), strategy="PACK")
        assert decode.wait(60), "the decode replica's bundles were not placed on the decode node"
        assert not prefill.wait(5), "a prefill replica's bundle was placed on a node without tandem_prefill"
        # the decode replica took both units: a second one waits for another decode pod
        second = placement_group(cfg.bundles("decode"), strategy="PACK")
        assert not second.wait(3)
        for pg in (decode, prefill, second):
            remove_placement_group(pg)
    finally:
        ray.shutdown()
