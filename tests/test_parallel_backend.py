"""The collective backend and device each rank gets: gloo on CPU, NCCL on CUDA (each rank its own GPU), guarded by
``torch.cuda.is_available()`` so that a CPU machine never needs NCCL. CUDA and NCCL are faked here by patching
``torch.cuda.is_available``/``device_count`` and ``torch.distributed.is_nccl_available`` (this machine has no GPU);
the choice itself is the real code path.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from engine.parallel.process_group import backend_for, rank_device


def test_cpu_ranks_use_gloo_and_stay_on_cpu() -> None:
    assert backend_for("cpu") == "gloo"
    assert rank_device("cpu", 3) == "cpu"


def test_cuda_ranks_would_use_nccl_each_on_its_own_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    assert backend_for("cuda") == backend_for("cuda:1") == "nccl"
    assert [rank_device("cuda", r) for r in range(4)] == ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]
    assert backend_for("cpu") == "gloo"


def test_cuda_without_a_gpu_or_nccl_falls_back_to_gloo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert backend_for("cuda") == "gloo"
    assert rank_device("cuda", 1) == "cuda"  # left as asked: the engine then refuses a device it cannot use
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: False)
    assert backend_for("cuda:0") == "gloo"
