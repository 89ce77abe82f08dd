"""The controller refuses a tier's parallel layout its workers would refuse, before it places anything (issue 27).

The rules are the worker's own (:func:`worker.server.parallel_config`, which is ``ParallelConfig.check_model`` on the
model's HF config plus the ranks' KV between tiers); the controller runs them once, at construction, on the tiny
checkpoints' configs. A refused tier gets no placement group; its refusal is in ``Status`` (``TierStatus.refused``),
where the operator reads it into the TandemDeployment's conditions. The rank count of a multi-rank tier is its
layout's world size, ``max(tp, ep) * pp``; an explicit count that disagrees is refused.

The Ray test runs a real controller with its Control server on a real local Ray (its own instance, started and
stopped here) and reads Ray's placement-group table.
"""

from __future__ import annotations

import argparse
import asyncio
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from auth.credentials import Credentials
from controlplane.controller import Controller, ControllerConfig, layout_refusals


def _args(*flags: str) -> argparse.Namespace:
    from cli.controller import add_controller_args

    p = argparse.ArgumentParser(exit_on_error=False)
    add_controller_args(p)
    return p.parse_args(["--model", "/m", "--redis", "redis://r:6379", *flags])


@pytest.mark.parametrize(("decode_parallel", "ranks"), [
    ((2, 1, 1), 2), ((1, 2, 1), 2), ((2, 2, 1), 4), ((1, 1, 2), 2), ((2, 1, 2), 2), ((1, 1, 4), 4),
])
def test_ranks_default_to_the_layouts_world_size(decode_parallel: tuple[int, int, int], ranks: int) -> None:
    cfg = ControllerConfig("/m", decode_parallel=decode_parallel)
    assert cfg.ranks_of("decode") == ranks
    assert len(cfg.bundles("decode")) == ranks
    assert cfg.ranks_of("prefill") == 1  # (1, 1, 1)
    assert ControllerConfig("/m", decode_parallel=decode_parallel, decode_ranks=ranks).ranks_of("decode") == ranks
    assert ControllerConfig("/m", decode_parallel=decode_parallel, ranks=ranks).ranks_of("decode") == ranks


def test_a_single_rank_layout_keeps_its_given_bundles() -> None:
    """A (1, 1, 1) worker with more bundles only reserves their CPUs (the tier-resources tests use it)."""
    assert ControllerConfig("/m", decode_ranks=2).ranks_of("decode") == 2
    assert ControllerConfig("/m", ranks=3).ranks_of("prefill") == 3


@pytest.mark.parametrize(("kw", "message"), [
    ({"decode_parallel": (2, 1, 1), "decode_ranks": 1}, "decode_ranks 1 disagrees with the decode layout tp=2"),
    ({"decode_parallel": (2, 2, 1), "decode_ranks": 2}, "which has max(tp, ep) x pp = 4 ranks"),
    ({"prefill_parallel": (1, 1, 2), "prefill_ranks": 3}, "prefill_ranks 3 disagrees with the prefill layout"),
    ({"decode_parallel": (2, 1, 1), "ranks": 3}, "ranks 3 disagrees with the decode layout tp=2 pp=1 ep=1"),
])
def test_an_explicit_rank_count_that_disagrees_with_the_layout_is_refused(kw: dict[str, object], message: str,
                                                                         ) -> None:
    with pytest.raises(ValueError, match="disagrees") as e:
        ControllerConfig("/m", **kw)  # type: ignore[arg-type]
    assert message in str(e.value)


def test_tandem_controller_derives_the_ranks_from_its_tp_and_refuses_other_counts() -> None:
    from cli.controller import controller_config

    cfg = controller_config(_args("--decode-tp", "2"), Credentials(None))
    assert (cfg.ranks_of("prefill"), cfg.ranks_of("decode")) == (1, 2)
    assert len(cfg.bundles("decode")) == 2
    both = controller_config(_args("--prefill-tp", "2", "--decode-tp", "2", "--decode-pp", "2"), Credentials(None))
    assert (both.ranks_of("prefill"), both.ranks_of("decode")) == (2, 4)
    with pytest.raises(ValueError, match="decode_ranks 1 disagrees with the decode layout tp=2"):
        controller_config(_args("--decode-tp", "2", "--decode-ranks", "1"), Credentials(None))


@pytest.mark.parametrize(("arch", "kw", "refusal"), [
    ("llama", {"decode_parallel": (3, 1, 1)}, "decode: tensor parallel size 3 must divide the attention heads (8)"),
    ("llama", {"prefill_parallel": (1, 5, 1)},
     "prefill: pipeline parallel size 5 is above the number of layers (4)"),
    ("mixtral", {"decode_parallel": (1, 1, 8)}, "decode: expert parallel size 8 is above the number of experts (4)"),
    ("llama", {"decode_parallel": (1, 1, 2)}, "decode: expert parallel size 2 needs a MoE model"),
    ("llama", {"decode_parallel": (8, 1, 1)}, "decode: a decode worker with ranks: --tp 8 is above the model's 4 KV"),
    ("llama", {"decode_parallel": (2, 1, 4)}, "decode: expert parallel size 4 must equal the tensor parallel size 2"),
])
def test_a_layout_the_model_cannot_take_is_refused_naming_the_constraint(
        checkpoint: Callable[[str], Path], arch: str, kw: dict[str, object], refusal: str) -> None:
    cfg = ControllerConfig(str(checkpoint(arch)), **kw)  # type: ignore[arg-type]
    refused = layout_refusals(cfg)
    assert list(refused) == [next(iter(k for k in kw)).split("_")[0]]
    assert refusal in next(iter(refused.values()))


def test_a_layout_the_model_takes_is_accepted_and_an_unreadable_model_is_left_to_the_workers(
        checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    llama = str(checkpoint("llama"))
    assert layout_refusals(ControllerConfig(llama, prefill_parallel=(2, 1, 1), decode_parallel=(4, 1, 1))) == {}
    # stages (or experts without an equal TP) on the decode tier: its workers serve colocated requests only
    # (worker/server.py; tandem up refuses them beside prefill replicas, tests/test_pp_served.py serves them)
    assert layout_refusals(ControllerConfig(llama, prefill=0, decode_parallel=(2, 2, 1))) == {}
    # ... and beside a prefill tier they could land no request's KV: refused, as tandem up refuses them
    beside = layout_refusals(ControllerConfig(llama, prefill=1, decode_parallel=(2, 2, 1)))
    assert list(beside) == ["decode"] and "cannot land the prefill tier's KV" in beside["decode"]
    assert "prefill" in layout_refusals(ControllerConfig(llama, prefill_parallel=(1, 2, 1)))
    moe = str(checkpoint("mixtral"))
    assert layout_refusals(ControllerConfig(moe, decode_parallel=(2, 1, 2), prefill_parallel=(4, 1, 4))) == {}
    # a path only the worker nodes mount: not checked here (the worker checks it), not refused
    assert layout_refusals(ControllerConfig(str(tmp_path / "absent"), decode_parallel=(3, 1, 1))) == {}


def test_a_refused_tier_is_in_status_and_never_converges(checkpoint: Callable[[str], Path]) -> None:
    from controlplane.control_server import tier_status

    async def scenario() -> None:
        c = Controller(ControllerConfig(str(checkpoint("llama")), prefill=0, decode=1, decode_parallel=(3, 1, 1)),
                       credentials=Credentials(None))
        assert tier_status(c, "decode").refused == ("decode: tensor parallel size 3 must divide the attention "
                                                    "heads (8)")
        assert tier_status(c, "prefill").refused == ""
        with pytest.raises(ValueError, match="tensor parallel size 3 must divide the attention heads"):
            await c.wait_converged(30.0)
        c.set_replicas("decode", 0)
        await c.wait_converged(1.0)  # nothing asked of the refused tier: converged

    asyncio.run(scenario())


@pytest.mark.slow
def test_ray_places_no_group_for_a_refused_layout_and_status_names_the_constraint(
        checkpoint: Callable[[str], Path]) -> None:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import grpc
    import ray
    from ray.util.placement_group import placement_group_table

    from auth.grpc_client import attach
    from auth.token import new_token
    from controlplane.control_server import start_control_server
    from proto.tandem.v1 import control_pb2 as cpb
    from proto.tandem.v1 import control_pb2_grpc as cpb_grpc

    async def scenario() -> None:
        cfg = ControllerConfig(str(checkpoint("llama")), prefill=0, decode=1, decode_parallel=(3, 1, 1),
                               reconcile_interval_s=0.05)
        creds = Credentials(new_token())  # SetReplicas needs the cluster token
        controller = Controller(cfg, credentials=creds)
        server, port = await start_control_server(controller, "127.0.0.1", 0)
        controller.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = attach(cpb_grpc.ControlStub(channel), creds)
                await asyncio.sleep(1.0)  # about 20 reconcile steps
                reply = await stub.SetReplicas(cpb.SetReplicasRequest(tier="decode", replicas=2), timeout=10)
                assert reply.tier.refused.startswith("decode: tensor parallel size 3 must divide the attention heads")
                await asyncio.sleep(1.0)
                tiers = {t.tier: t for t in (await stub.Status(cpb.StatusRequest(), timeout=10)).tiers}
            assert tiers["decode"].refused == "decode: tensor parallel size 3 must divide the attention heads (8)"
            assert (tiers["decode"].desired, tiers["decode"].starting, len(tiers["decode"].replicas)) == (2, 0, 0)
            assert tiers["prefill"].refused == ""
            assert controller.replicas == {} and len(controller.removed) == 0
            assert not [g for g in placement_group_table().values() if g["name"].startswith("tandem-")]
        finally:
            await server.stop(None)
            await controller.close()

    assert not ray.is_initialized(), "another test left Ray running"
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1",
             configure_logging=False)
    try:
        asyncio.run(scenario())
    finally:
        ray.shutdown()
