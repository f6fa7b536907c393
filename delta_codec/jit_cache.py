"""Where numba keeps the compiled kernels: one cache per interpreter environment.

numba's default cache sits beside the source (`delta_codec/__pycache__`), so two virtual
environments with different numba versions (`.venv`, `.venv-vllm`) share one index and each
overwrites the other's entries: the first process of the other venv recompiles (~35 s here, and
inside vLLM's worker it stalled the first delta). A folder under `sys.prefix`, named by the numba
version, keeps them apart. `NUMBA_CACHE_DIR`, when set, wins (numba reads it itself)."""

from __future__ import annotations

import os
import sys
from pathlib import Path


def use_environment_cache(numba) -> None:
    """Point numba's cache at this environment's folder; call before any `njit(cache=True)`."""
    if os.environ.get("NUMBA_CACHE_DIR"):
        return
    folder = Path(sys.prefix) / "numba-cache" / f"numba-{numba.__version__}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:  # a read-only prefix: numba's own default (beside the source) then
        return
    numba.config.CACHE_DIR = str(folder)
