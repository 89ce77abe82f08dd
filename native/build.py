"""Compile one C source into a shared object in a per-user cache, keyed by everything that changes the binary.

Built for this CPU (``-march=native``), so the key holds the source, the headers beside it, the compiler and its
version, the flags, the CPU's feature flags and the machine. The ``.so`` is written under a temporary name and
renamed into place, so processes that start together and build the same source never load half a file; whichever
rename lands last wins, and both wrote the same bytes.

Native code is optional everywhere: ``TANDEM_NATIVE_KERNELS=0`` (or a platform other than Linux) turns it off,
``CC`` picks the compiler, ``TANDEM_KERNEL_CACHE`` the cache directory (default ``~/.cache/tandem/kernels``).
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

# Flags for code that runs without OpenMP; callers add ``-fopenmp`` (or more) where their source needs it.
BASE_FLAGS = ("-O3", "-march=native", "-shared", "-fPIC", "-std=gnu11")


def enabled() -> bool:
    """Native code is on: not disabled by ``TANDEM_NATIVE_KERNELS`` and on Linux."""
    return os.environ.get("TANDEM_NATIVE_KERNELS", "1") not in ("0", "false", "no") and platform.system() == "Linux"


def compiler() -> str | None:
    """``CC``, else gcc, else cc; None when there is none."""
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def cache_dir() -> Path:
    root = os.environ.get("TANDEM_KERNEL_CACHE")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tandem" / "kernels"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return platform.processor()


def compile_shared(cc: str, source: Path, flags: tuple[str, ...], key_extra: str = "") -> Path:
    """Compile ``source`` (with the ``*.h`` beside it) into the per-user cache and return the ``.so``'s path; a
    cached build is reused when the source, the headers, the compiler, the flags, the CPU and ``key_extra`` match.
    RuntimeError when the compiler fails (its stderr's tail in the message)."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    headers = "".join(h.read_text() for h in sorted(source.parent.glob("*.h")))
    key = hashlib.sha256(b"\0".join(s.encode() for s in (
        source.read_text(), headers, cc, version, " ".join(flags), _cpu_flags(), platform.machine(), key_extra)
    )).hexdigest()[:20]
    out = cache_dir() / f"{source.stem}-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *flags, "-o", tmp, str(source)], capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed: {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out
