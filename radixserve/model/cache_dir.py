"""Where radixserve keeps what it rebuilds from a model file once (dequantized weights,
converted tokenizers, compiled grammars). Torch-free: tokenizer-only tools use it too."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["CACHE_DIR_ENV", "default_cache_dir"]

CACHE_DIR_ENV = "RADIXSERVE_CACHE_DIR"


def default_cache_dir() -> Path:
    """$RADIXSERVE_CACHE_DIR, else $XDG_CACHE_HOME/radixserve, else ~/.cache/radixserve."""
    if os.environ.get(CACHE_DIR_ENV):
        return Path(os.environ[CACHE_DIR_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "radixserve"
