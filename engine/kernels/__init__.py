"""Native CPU kernels, compiled on first use with the host's C compiler and loaded with ctypes.

Why C and ctypes rather than a torch C++ extension: the kernel needs no torch headers (it takes raw pointers and
shapes), so it compiles in about a second instead of a minute, with nothing to install at build time. The build
itself is :mod:`native`'s: for this CPU (``-march=native``), into a per-user cache keyed by the source, the compiler,
the flags and the CPU's feature flags, written atomically so that worker processes starting together cannot load
half a file.

Three sources: ``paged_attention.c`` (attention over the paged KV cache, fp32 and bf16), ``layer_ops.c`` (fused
fp32 RMSNorm, SiLU-and-multiply and rotary embedding) and ``block_hash.c`` (the block-hash chain of
:mod:`engine.block_hash`). The first two use OpenMP and share torch's runtime; ``block_hash`` is single-threaded,
built without ``-fopenmp`` and loaded without importing torch, because the router, which never imports torch,
calls it for every request.

``block_hash.c`` is also built as the CPython extension ``engine._block_hash`` (token lists read in place) by
:func:`native.extension.load_python_extension`, as the router's own extensions are; it has a Python path that
computes the same thing.

Everything here is optional. When there is no compiler, the build fails, ``TANDEM_NATIVE_KERNELS=0`` is set, or
the platform is not Linux, :func:`paged_attention_kernel` and :func:`layer_ops` return ``None`` and the engine uses
its torch path, which computes the same thing (the parity tests run on both); :func:`block_hasher` returns
``None`` and :mod:`engine.block_hash` uses hashlib.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from native.build import BASE_FLAGS, compile_shared, compiler, enabled
from native.extension import load_python_extension

log = logging.getLogger(__name__)

_HERE = Path(__file__).parent
_FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")  # BASE_FLAGS with OpenMP
_EXTRA_FLAGS = {"layer_ops": ("-ffp-contract=off",)}  # round like torch's separate ops (see layer_ops.c)
_STANDALONE = frozenset({"block_hash"})  # no OpenMP: built without -fopenmp, loaded without importing torch
_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}


def _build(cc: str, name: str) -> Path:
    base = BASE_FLAGS if name in _STANDALONE else _FLAGS
    return compile_shared(cc, _HERE / f"{name}.c", (*base, *_EXTRA_FLAGS.get(name, ())))


_SOURCES = ("paged_attention", "layer_ops", "block_hash")


def build_all() -> None:
    """Compile every kernel into the cache without loading it (no torch import): ``tandem up`` runs this while
    Ray starts, so that its workers, starting side by side, find the kernels built instead of each compiling them
    (~2 s of gcc per process on a cold cache)."""
    cc = compiler()
    if not enabled() or cc is None:
        return
    for name in _SOURCES:
        try:
            _build(cc, name)
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            log.warning("could not build the native %s kernel (%s)", name, e)


def _load(name: str) -> ctypes.CDLL | None:
    with _lock:
        if name in _loaded:
            return _loaded[name]
        lib = None
        cc = compiler()
        fallback = "the Python path" if name in _STANDALONE else "the torch path"
        if not enabled():
            log.info("native kernels disabled; using %s", fallback)
        elif cc is None:
            log.info("no C compiler found; using %s", fallback)
        else:
            try:
                if name not in _STANDALONE:
                    import torch  # noqa: F401  (loads torch's libgomp first, so the kernel shares its OpenMP runtime)
                lib = ctypes.CDLL(str(_build(cc, name)))
            except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                log.warning("could not build the native %s kernel (%s); using %s", name, e, fallback)
                lib = None
        _loaded[name] = lib
        return lib


_i64 = ctypes.c_int64
_ptr = ctypes.c_void_p


def _bind(source: str, symbol: str, argtypes: list[Any], restype: Any) -> Any:
    """``tandem_<symbol>`` from ``<source>.c`` with its ctypes signature, or None when the kernel is unavailable."""
    lib = _load(source)
    if lib is None:
        return None
    fn = getattr(lib, f"tandem_{symbol}")
    fn.argtypes = argtypes
    fn.restype = restype
    return fn


@functools.cache
def paged_attention_kernel() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """``tandem_paged_attention`` from ``paged_attention.c`` (see its header for the contract), or None."""
    return _bind("paged_attention", "paged_attention",
                 [_ptr, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, _i64, _i64,
                  ctypes.c_float, ctypes.c_int, _ptr], ctypes.c_int)


@functools.cache
def kv_writer() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """``tandem_write_kv`` from ``paged_attention.c``: scatter a step's K/V rows into their cache slots."""
    return _bind("paged_attention", "write_kv", [_ptr, _i64, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64], None)


_f32 = ctypes.c_float


@dataclass(frozen=True, slots=True)
class LayerOps:
    """The functions of ``layer_ops.c`` (see its header for each contract): fp32, and the ``*_bf16`` twins."""

    rms_norm: Any
    silu_mul: Any
    rope: Any
    rms_norm_bf16: Any
    silu_mul_bf16: Any
    rope_bf16: Any
    mean_square: Any


@functools.cache
def layer_ops() -> LayerOps | None:
    sigs = {
        "rms_norm": [_ptr, _i64, _ptr, _ptr, _i64, _i64, _f32],
        "silu_mul": [_ptr, _i64, _ptr, _i64, _i64],
        "rope": [_ptr, _i64, _i64, _i64, _i64, _ptr, _ptr],
    }
    sigs.update({f"{name}_bf16": argtypes for name, argtypes in sigs.items()})
    sigs["rms_norm_bf16"] = [*sigs["rms_norm"], _ptr]  # + each row's fp32 mean square, or NULL
    sigs["mean_square"] = [_ptr, _i64, ctypes.c_int, _i64, _i64, _ptr]
    if _load("layer_ops") is None:
        return None
    return LayerOps(**{name: _bind("layer_ops", name, argtypes, None) for name, argtypes in sigs.items()})


def block_hash_module() -> ModuleType | None:
    """``block_hash.c`` built as the CPython module ``engine._block_hash`` (lists in, lists out), or None."""
    return load_python_extension("engine._block_hash", _HERE / "block_hash.c", ("-DTANDEM_PY_EXTENSION",))


@functools.cache
def block_hasher() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """``tandem_hash_blocks`` from ``block_hash.c`` (see its header for the contract), or None. Never imports torch."""
    return _bind("block_hash", "hash_blocks", [_ptr, _i64, _i64, _ptr, _i64, ctypes.c_uint64, _ptr], _i64)
