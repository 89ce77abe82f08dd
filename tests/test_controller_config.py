"""The controller's and ``tandem scale``'s input checks, without Ray: configs refuse bad values with ValueError,
SetReplicas' validation, the worker port flags of ``tandem controller``, its per-tier ranks and KV backends and
the placement-group bundles they make, and ``tandem scale``'s exit codes."""

from __future__ import annotations

import argparse
import asyncio
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from auth.credentials import Credentials
from cli.controller import _port_flags
from controlplane.controller import Controller, ControllerConfig
from controlplane.daemon import DaemonConfig
from controlplane.local_cluster import UpConfig
from controlplane.replica import ReplicaSpec


@pytest.mark.parametrize("bad", [
    {"prefill": -1}, {"decode": 300}, {"kv_backend": "carrier-pigeon"}, {"cpus_per_replica": 0}, {"ranks": 0},
    {"drain_timeout_s": 0}, {"start_timeout_s": -1}, {"reconcile_interval_s": 0}, {"prefill_ranks": 0},
    {"decode_ranks": -1}, {"decode_kv_backend": "rdma"}, {"prefill_kv_backend": ""}, {"decode_parallel": (0, 1, 1)},
    {"prefill_parallel": (2, 1)}, {"decode_threads": 0}, {"prefill_threads": -1},
])
def test_controller_config_refuses_bad_values(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        ControllerConfig("/m", **bad)  # type: ignore[arg-type]


def test_other_configs_refuse_bad_values() -> None:
    with pytest.raises(ValueError):
        DaemonConfig(ControllerConfig("/m"), control_port=70000)
    with pytest.raises(ValueError):
        UpConfig(control_port=-1)
    with pytest.raises(ValueError):
        UpConfig(drain_timeout_s=0)
    with pytest.raises(ValueError):
        ReplicaSpec("router", "/m")
    with pytest.raises(ValueError):
        ReplicaSpec("decode", "/m", host="")


def test_set_replicas_refuses_unknown_tiers_and_counts_out_of_range_and_keeps_desired() -> None:
    async def run() -> dict[str, int]:
        c = Controller(ControllerConfig("/m", prefill=1, decode=2, max_replicas=8), credentials=Credentials(None))
        for tier, n in (("router", 1), ("decode", -1), ("decode", 9)):
            with pytest.raises(ValueError):
                c.set_replicas(tier, n)
        with pytest.raises(KeyError):
            c.drain("decode-nope")
        c.set_replicas("prefill", 0)
        return c.desired

    assert asyncio.run(run()) == {"prefill": 0, "decode": 2}


def test_worker_ports_are_the_contract_ports_on_a_node_ip_and_free_on_loopback() -> None:
    def flags(host: str, port: int | None = None, session: int | None = None) -> list[str]:
        return _port_flags(argparse.Namespace(worker_host=host, worker_port=port, worker_session_port=session))

    assert flags("node") == ["--port", "7100", "--session-port", "7101"]
    assert flags("127.0.0.1") == ["--port", "0", "--session-port", "0"]
    assert flags("node", 9000, 0) == ["--port", "9000", "--session-port", "0"]
    with pytest.raises(ValueError):
        flags("node", 70000)


def test_tandem_scale_exit_codes_without_a_controller(tmp_path: Path) -> None:
    """Bad input: 2, before any call; no `tandem up` state file or an unreachable controller: 1."""
    env = {"TANDEM_HOME": str(tmp_path), "PATH": "/usr/bin:/bin"}

    def scale(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "cli.main", "scale", *args], capture_output=True, text=True,
                              env=env, timeout=60)

    assert scale("decode", "-1").returncode == 2
    assert scale("router", "1").returncode == 2
    missing = scale("decode", "2")
    assert missing.returncode == 1 and "no running `tandem up`" in missing.stderr
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    unreachable = scale("decode", "2", "--control", f"127.0.0.1:{closed}")
    assert unreachable.returncode == 1 and f"127.0.0.1:{closed}" in unreachable.stderr


def _controller_args(*flags: str) -> argparse.Namespace:
    from cli.controller import add_controller_args

    p = argparse.ArgumentParser(exit_on_error=False)
    add_controller_args(p)
    return p.parse_args(["--model", "/m", "--redis", "redis://r:6379", *flags])


def test_tandem_up_shares_the_hosts_cpus_among_its_worker_ranks_as_torch_threads() -> None:
    """``tandem up``'s workers each get ``--threads``: the CPUs divided among the ranks it starts (a lone colocated
    replica takes every core; 1 prefill + 1 decode take half each; a TP=2 replica's ranks share), at least 1, or
    the autoscaler's rank budget (cli/main.py), or what ``--threads`` / the workers' own flags say."""
    assert UpConfig(prefill=0, decode=1).worker_threads(cpus=2) == 2
    assert UpConfig(prefill=1, decode=1).worker_threads(cpus=2) == 1
    assert UpConfig(prefill=1, decode=1).worker_threads(cpus=1) == 1
    assert UpConfig(prefill=0, decode=1, decode_tp=2).worker_threads(cpus=8) == 4
    assert UpConfig(prefill=1, decode=2).worker_threads(cpus=16) == 5
    assert UpConfig(prefill=0, decode=1).worker_threads(cpus=4, ranks=3) == 1
    assert UpConfig(prefill=0, decode=1, threads=3).worker_threads(cpus=2, ranks=2) == 3
    flags = UpConfig(prefill=0, decode=1, otlp_endpoint="127.0.0.1:4317",
                     worker_flags=("--max-num-seqs", "2")).flags_for_workers(cpus=2)
    assert flags == ("--max-num-seqs", "2", "--threads", "2", "--otlp-endpoint", "127.0.0.1:4317")
    own = UpConfig(prefill=0, decode=1, worker_flags=("--threads", "1")).flags_for_workers(cpus=8)
    assert own == ("--threads", "1")
    for bad in (0, -2, 1.5):
        with pytest.raises(ValueError, match="threads must be an int >= 1"):
            UpConfig(threads=bad)  # type: ignore[arg-type]


def test_tandem_up_refuses_a_bad_threads_flag_before_anything_starts(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from cli_runs import tandem

    monkeypatch.setenv("TANDEM_HOME", str(tmp_path))
    code, _, err = tandem(["up", "--threads", "0"], capsys, as_process=False)
    assert code == 2 and "threads must be an int >= 1, got 0" in err, err
    assert not (tmp_path / "up.json").exists()


def test_per_tier_ranks_and_kv_backends_parse_and_default_to_the_shared_flags() -> None:
    from cli.controller import controller_config

    shared = controller_config(_controller_args("--ranks", "2", "--kv-backend", "tcp"), Credentials(None))
    assert [(shared.ranks_of(t), shared.kv_backend_of(t)) for t in ("prefill", "decode")] == [(2, "tcp"), (2, "tcp")]
    assert not shared.tier_resources
    own = controller_config(_controller_args("--ranks", "2", "--kv-backend", "tcp", "--prefill-ranks", "1",
                                             "--decode-ranks", "4", "--prefill-kv-backend", "nixl",
                                             "--decode-kv-backend", "nixl", "--tier-resources"), Credentials(None))
    assert [(own.ranks_of(t), own.kv_backend_of(t)) for t in ("prefill", "decode")] == [(1, "nixl"), (4, "nixl")]
    assert own.tier_resources
    with pytest.raises(argparse.ArgumentError):
        _controller_args("--decode-kv-backend", "rdma")
    with pytest.raises(ValueError):
        controller_config(_controller_args("--decode-ranks", "0"), Credentials(None))


def test_the_controllers_otlp_endpoint_reaches_every_worker_as_its_flag() -> None:
    from cli.controller import controller_config

    traced = controller_config(_controller_args("--otlp-endpoint", "collector:4317"), Credentials(None))
    flags = traced.worker_flags
    assert flags[flags.index("--otlp-endpoint") + 1] == "collector:4317"
    assert "--otlp-endpoint" not in controller_config(_controller_args(), Credentials(None)).worker_flags


def test_every_worker_gets_a_metrics_port_fixed_in_a_pod_and_free_on_loopback() -> None:
    """``tandem controller``: 7102 (the pods' ``metrics`` port the PodMonitor scrapes) on a node IP, a free port on
    loopback, or the one asked for; the controller hands it to each worker as ``--metrics-port``, once."""
    from cli.controller import controller_config

    def port(*flags: str) -> int | None:
        return controller_config(_controller_args(*flags), Credentials(None)).worker_metrics_port

    assert (port(), port("--worker-host", "127.0.0.1"), port("--worker-metrics-port", "9100")) == (7102, 0, 9100)
    worker_flags = Controller(ControllerConfig("/m", worker_metrics_port=0))._flags()
    assert worker_flags[worker_flags.index("--metrics-port") + 1] == "0"
    assert worker_flags.count("--metrics-port") == 1
    assert "--metrics-port" not in Controller(ControllerConfig("/m"))._flags()
    with pytest.raises(ValueError):
        ControllerConfig("/m", worker_metrics_port=70000)


def test_bundles_ask_for_the_tiers_ray_resource_once_per_rank_only_with_tier_resources() -> None:
    from controlplane.controller import tier_resource
    from operators.render_ray import ray_resource

    cfg = ControllerConfig("/m", cpus_per_replica=1.0, prefill_ranks=1, decode_ranks=2, tier_resources=True)
    assert cfg.bundles("prefill") == [{"CPU": 1.0, "tandem_prefill": 1.0}]
    assert cfg.bundles("decode") == [{"CPU": 1.0, "tandem_decode": 1.0}] * 2
    local = ControllerConfig("/m", cpus_per_replica=0.5, decode_ranks=2)  # tandem up: a local Ray has no such resource
    assert local.bundles("decode") == [{"CPU": 0.5}] * 2 and local.bundles("prefill") == [{"CPU": 0.5}]
    # the operator's worker groups advertise exactly the names the controller asks for
    assert all(tier_resource(t) == ray_resource(t) for t in ("prefill", "decode"))
