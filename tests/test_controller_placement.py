"""A replica's placement group: one bundle per rank, PACK by default, STRICT_PACK for TP on GPUs (issue 27).

The rule is :meth:`ControllerConfig.strategy`; the Ray test makes the controller's own groups
(:func:`controlplane.controller.replica_placement_group`) on a real local Ray (its own instance, started and stopped
here) and reads their strategy and bundles back from Ray's placement-group table.
"""

from __future__ import annotations

import os

import pytest

from controlplane.controller import ControllerConfig, replica_placement_group


@pytest.mark.parametrize(("decode_parallel", "flags", "strategy"), [
    ((1, 1, 1), (), "PACK"),
    ((2, 1, 1), (), "PACK"),  # TP on CPU
    ((2, 2, 1), ("--device", "cpu"), "PACK"),
    ((2, 1, 1), ("--device", "cuda"), "STRICT_PACK"),  # TP on GPUs
    ((2, 2, 1), ("--device=cuda:0",), "STRICT_PACK"),
    ((2, 1, 2), ("--device", "cpu", "--device", "cuda"), "STRICT_PACK"),  # the last --device wins, as in argparse
    ((1, 2, 1), ("--device", "cuda"), "PACK"),  # PP only: stages pass hidden states, no per-layer all-reduce
    ((1, 1, 2), ("--device", "cuda"), "PACK"),  # EP only
])
def test_strategy_is_strict_pack_only_for_tp_on_gpus(decode_parallel: tuple[int, int, int], flags: tuple[str, ...],
                                                     strategy: str) -> None:
    cfg = ControllerConfig("/m", decode_parallel=decode_parallel, worker_flags=flags)
    assert cfg.strategy("decode") == strategy
    assert cfg.strategy("prefill") == "PACK"  # the prefill tier keeps (1, 1, 1)


@pytest.mark.slow
def test_ray_holds_one_bundle_per_rank_packed_for_a_cpu_replica_and_strict_packed_for_gpu_tp() -> None:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    from ray.util.placement_group import placement_group_table, remove_placement_group

    cpu = ControllerConfig("/m", cpus_per_replica=0.25, decode_ranks=4, decode_parallel=(2, 2, 1))
    gpu = ControllerConfig("/m", cpus_per_replica=0.25, decode_ranks=2, decode_parallel=(2, 1, 1),
                           worker_flags=("--device", "cuda"))
    assert not ray.is_initialized(), "another test left Ray running"
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1",
             configure_logging=False)
    try:
        groups = [replica_placement_group(cpu, "decode", "tandem-decode-cpu"),
                  replica_placement_group(cpu, "prefill", "tandem-prefill-cpu"),
                  replica_placement_group(gpu, "decode", "tandem-decode-gpu")]
        for pg in groups:
            assert pg.wait(60), "a replica's bundles were not placed on the local node"
        tables = [placement_group_table(pg) for pg in groups]
        assert [(t["name"], t["strategy"], t["state"]) for t in tables] == [
            ("tandem-decode-cpu", "PACK", "CREATED"), ("tandem-prefill-cpu", "PACK", "CREATED"),
            ("tandem-decode-gpu", "STRICT_PACK", "CREATED")]
        assert tables[0]["bundles"] == {i: {"CPU": 0.25} for i in range(4)}  # TP=2 x PP=2: four ranks
        assert tables[1]["bundles"] == {0: {"CPU": 0.25}}
        assert tables[2]["bundles"] == {0: {"CPU": 0.25}, 1: {"CPU": 0.25}}
        for pg in groups:
            remove_placement_group(pg)
    finally:
        ray.shutdown()
