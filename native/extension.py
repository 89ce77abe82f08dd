"""A C source built as a CPython extension module for this interpreter, imported once per process.

The key of the cached build also holds the interpreter's ABI (``EXT_SUFFIX``), so interpreters of different
versions sharing one cache never load each other's builds. Every caller keeps a Python path that computes the same
thing: when native code is off, there is no compiler, the interpreter's headers (``Python.h``) are missing or the
build fails, :func:`load_python_extension` logs why and returns None.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import subprocess
import sys
import sysconfig
import threading
from pathlib import Path
from types import ModuleType

from native.build import BASE_FLAGS, compile_shared, compiler, enabled

log = logging.getLogger(__name__)

_lock = threading.Lock()
_modules: dict[str, ModuleType | None] = {}  # module name -> the loaded module, or None once it could not be


def load_python_extension(module_name: str, source: Path, extra_flags: tuple[str, ...] = ()) -> ModuleType | None:
    """Build ``source``, a CPython extension module, for this interpreter and import it as ``module_name`` (its
    ``PyInit_`` symbol is named after the last dotted part); None, logged, when native code is disabled, there is no
    compiler, the interpreter's headers are missing or the build fails: the caller then uses its Python path."""
    with _lock:
        if module_name in _modules:
            return _modules[module_name]
        module = None
        cc = compiler()
        include = sysconfig.get_paths().get("include", "")
        if not enabled() or cc is None:
            log.info("native code disabled or no C compiler; %s uses its Python path", module_name)
        elif not include or not os.path.exists(os.path.join(include, "Python.h")):
            log.info("no Python.h for this interpreter; %s uses its Python path", module_name)
        else:
            flags = (*BASE_FLAGS, f"-I{include}", *extra_flags)
            try:
                path = compile_shared(cc, source, flags, sysconfig.get_config_var("EXT_SUFFIX") or sys.version)
                spec = importlib.util.spec_from_file_location(module_name, path)
                if spec is None or spec.loader is None:
                    raise ImportError(f"cannot load {path}")
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
            except (OSError, ImportError, RuntimeError, subprocess.SubprocessError) as e:
                log.warning("could not build %s (%s); using its Python path", module_name, e)
                module = None
        _modules[module_name] = module
        return module
