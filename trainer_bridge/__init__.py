"""FourSight trainer bridge: streaming rollouts with per-token logprobs, TIM metrics, TIM-aware
sequence filtering, weight sync, and TRL/verl adapters.

Nothing is imported here: each name below is imported from its module when first read, so that
importing a submodule (the command line's ``bridge_config``) does not import torch. The server,
client and adapters are imported from their modules (``foursight.trainer_bridge.server`` etc.).
See docs/bridge.md and docs/tim.md.
"""

import importlib

#: the package's names and the module each comes from
_FROM = {"FilterConfig": "filters", "FilterResult": "filters", "apply_filter": "filters", "compute_tim_metrics": "metrics",
         "sequence_stats": "metrics", "Rollout": "protocol", "SamplingParams": "protocol", "score": "scoring",
         "filter_rollouts": "scoring", "RolloutClient": "client"}

__all__ = [
    "FilterConfig",
    "FilterResult",
    "apply_filter",
    "compute_tim_metrics",
    "sequence_stats",
    "Rollout",
    "SamplingParams",
    "filter",
    "score",
    "RolloutClient",
]


def __getattr__(name: str):
    if name == "filter":  # score + pad + apply_filter: the loss masks of a batch of rollouts
        name = "filter_rollouts"
    if name not in _FROM:
        raise AttributeError(name)
    return getattr(importlib.import_module(f"foursight.trainer_bridge.{_FROM[name]}"), name)
