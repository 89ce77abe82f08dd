"""Tandem's C build tool: compile a C source with the host's compiler into a per-user cache, on first use.

A leaf component: it imports nothing else of Tandem (nor torch), so the engine, whose kernels it builds, and the
router, whose CPython extensions (``router/prefix_map.c``, ``router/cost_kernel.c``) it builds, both use it
without either depending on the other.

- :mod:`native.build`: whether native code is on, which compiler, and :func:`native.build.compile_shared`, the
  cached, atomic build of one shared object.
- :mod:`native.extension`: :func:`native.extension.load_python_extension`, a C source built as a CPython extension
  module for this interpreter and imported, or None so that its caller takes its Python path.
"""
