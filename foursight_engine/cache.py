"""Where FourSight keeps what it builds once per machine (the converted SmolLM2 folder, the native CPU
quantizer): ``$FOURSIGHT_CACHE`` or ``~/.cache/foursight``. Imports nothing of ours, so the numerics can use it."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Root of FourSight's cache (``$FOURSIGHT_CACHE`` or ``~/.cache/foursight``)."""
    return Path(os.environ.get("FOURSIGHT_CACHE", Path.home() / ".cache" / "foursight"))
