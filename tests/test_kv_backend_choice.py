"""Which KV transfer backend ``tandem up`` and ``tandem generate --mode disaggregated`` start workers with."""

from __future__ import annotations

import importlib.util

import pytest

from controlplane.local_cluster import UpConfig
from worker.launcher import resolve_kv_backend


def test_auto_is_nixl_where_it_is_installed_else_tcp_and_named_backends_pass_through(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("nixl", "torch", "tcp"):
        assert resolve_kv_backend(name) == name
    installed = importlib.util.find_spec("nixl") is not None
    assert resolve_kv_backend("auto") == ("nixl" if installed else "tcp")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "nixl" else real(name, *a))
    assert resolve_kv_backend("auto") == "tcp"
    with pytest.raises(ValueError, match="unknown KV backend 'rdma'"):
        resolve_kv_backend("rdma")


def test_up_starts_on_tcp_unless_told_and_refuses_an_unknown_backend_by_name() -> None:
    assert UpConfig().kv_backend == "tcp"  # the quickest to start (see UpConfig)
    assert UpConfig(kv_backend="auto").kv_backend == "auto"
    with pytest.raises(ValueError, match="unknown kv_backend 'mooncake'"):
        UpConfig(kv_backend="mooncake")
