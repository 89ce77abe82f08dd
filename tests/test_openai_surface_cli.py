"""``tandem up``'s model and port handling: a Hugging Face id resolved from a local cache laid out here (no network),
a one-line error naming where a missing model was looked for, and a busy port failing at once."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from controlplane.ports import PortInUseError, check_bindable
from engine.model_source import ModelNotFoundError, resolve_checkpoint

REV = "0123456789abcdef0123456789abcdef01234567"


def _hub_cache(root: Path, checkpoint: Path, repo: str = "acme/tiny-llama") -> Path:
    """The Hugging Face cache layout: blobs, ``snapshots/<rev>`` of symlinks to them, ``refs/main`` naming rev."""
    repo_dir = root / f"models--{repo.replace('/', '--')}"
    snap = repo_dir / "snapshots" / REV
    snap.mkdir(parents=True)
    (repo_dir / "blobs").mkdir()
    for i, f in enumerate(sorted(checkpoint.iterdir())):
        blob = repo_dir / "blobs" / f"blob{i}"
        shutil.copyfile(f, blob)
        (snap / f.name).symlink_to(Path("..", "..", "blobs", blob.name))
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(REV)
    return snap


def test_a_hub_id_resolves_to_its_snapshot_in_the_local_cache(tmp_path: Path, checkpoint: Callable[[str], Path],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    snap = _hub_cache(tmp_path / "hub", checkpoint("llama"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    assert resolve_checkpoint("acme/tiny-llama") == snap
    assert resolve_checkpoint(str(snap)) == snap  # a directory is taken as it is
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # $HF_HOME/hub
    assert resolve_checkpoint("acme/tiny-llama") == snap


def test_a_missing_hub_id_says_where_it_was_looked_for(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelNotFoundError) as e:
        resolve_checkpoint("acme/absent")
    msg = str(e.value)
    assert "\n" not in msg and str(tmp_path / "hub" / "models--acme--absent" / "snapshots") in msg
    with pytest.raises(ModelNotFoundError, match="checkpoint directory"):
        resolve_checkpoint(str(tmp_path / "not" / "a" / "model"))


def test_a_bound_port_is_not_bindable() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(PortInUseError, match=f"127.0.0.1:{port}"):
            check_bindable("127.0.0.1", port, "HTTP")
    check_bindable("127.0.0.1", port, "HTTP")  # free again once closed
    check_bindable("127.0.0.1", 0, "HTTP")
