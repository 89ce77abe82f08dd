"""``tandem up``'s model and port handling: a Hugging Face id resolved from a local cache laid out here (no network),
a one-line error naming where a missing model was looked for, and a busy port failing at once."""

from __future__ import annotations

import os
import shutil
import signal
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


def _up(args: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cli.main", "up", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, "TANDEM_HOME": str(tmp_path / "home"), "RAY_AUTH_MODE": "disabled", **extra}


def test_tandem_up_on_a_busy_port_fails_at_once_with_one_line(tmp_path: Path,
                                                             checkpoint: Callable[[str], Path]) -> None:
    """Before Ray or any worker starts: no 'ray started' line, one line on stderr, exit code 2."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        t0 = time.monotonic()
        r = _up(["--model", str(checkpoint("llama")), "--port", str(port)], _env(tmp_path), timeout=120)
        took = time.monotonic() - t0
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and f"127.0.0.1:{port}" in lines[0] and "Traceback" not in r.stderr
    assert "ray started" not in r.stdout
    assert took < 60  # interpreter start-up and imports only (Ray and the workers took 24 s before)


def test_tandem_up_with_a_hub_id_missing_from_the_cache_fails_with_where_it_looked(tmp_path: Path) -> None:
    r = _up(["--model", "acme/absent"], _env(tmp_path, HF_HUB_CACHE=str(tmp_path / "hub"), HF_HUB_OFFLINE="1"),
            timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and str(tmp_path / "hub" / "models--acme--absent" / "snapshots") in lines[0]
    assert "ray started" not in r.stdout


@pytest.mark.slow
def test_tandem_up_serves_a_hub_id_from_the_cache_under_its_served_name(
        tmp_path: Path, checkpoint: Callable[[str], Path]) -> None:
    """``--model acme/tiny-llama`` from a cache laid out here, ``--served-model-name`` and ``--host``, with no
    prefill tier (the quickest cluster to start): /v1/models and a completion answer under the served name."""
    import openai

    _hub_cache(tmp_path / "hub", checkpoint("llama"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = _env(tmp_path, HF_HUB_CACHE=str(tmp_path / "hub"), HF_HUB_OFFLINE="1")
    proc = subprocess.Popen([sys.executable, "-m", "cli.main", "up", "--model", "acme/tiny-llama",
                             "--served-model-name", "surface-model", "--host", "127.0.0.1", "--port", str(port),
                             "--grpc-port", "-1", "--prefill", "0"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                break
            lines.append(line)
            if "serving OpenAI API at" in line:
                break
        assert any("serving OpenAI API at" in line for line in lines), "".join(lines[-30:])
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == ["surface-model"]
        r = client.completions.create(model="surface-model", prompt="Hello", max_tokens=3, temperature=0)
        assert r.model == "surface-model" and r.usage is not None and r.usage.completion_tokens >= 1
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
