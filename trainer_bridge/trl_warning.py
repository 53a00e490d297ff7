"""TRL's vLLM-version warning, printed once: TRL warns on every lazy import of its vLLM parts when
vLLM is outside its tested range (7 times per GRPO run on vLLM 0.32); the trainer adapter
(:mod:`.trl`) and the server-mode client (:mod:`.trl_client`) both call this first (one home, so
neither imports the other at module level)."""

from __future__ import annotations

import warnings

TRL_VLLM_VERSION_WARNING = r"TRL currently supports vLLM versions"


def trl_version_warning_once() -> None:
    """Let TRL's vLLM-version warning print once, here, and silence its repeats (a ``"once"`` filter
    did not hold across TRL's lazy imports). Called before FourSight imports TRL's trainer or client."""
    from trl.import_utils import is_vllm_available

    is_vllm_available()  # the warning, when vLLM is outside TRL's tested range
    warnings.filterwarnings("ignore", message=TRL_VLLM_VERSION_WARNING, category=UserWarning)
