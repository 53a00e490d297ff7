"""FourSight trainer bridge: streaming rollouts with per-token logprobs, TIM metrics, TIM-aware
sequence filtering, weight sync, and TRL/verl adapters.

Light imports only here (torch + pydantic); the server, client and adapters are imported from
their modules (``foursight.trainer_bridge.server`` etc.). See docs/bridge.md and docs/tim.md.
"""

from foursight.trainer_bridge.filters import FilterConfig, FilterResult, apply_filter
from foursight.trainer_bridge.metrics import compute_tim_metrics, sequence_stats
from foursight.trainer_bridge.protocol import Rollout, SamplingParams

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
    if name == "score":
        from foursight.trainer_bridge.scoring import score

        return score
    if name == "filter":  # score + pad + apply_filter: the loss masks of a batch of rollouts
        from foursight.trainer_bridge.scoring import filter_rollouts

        return filter_rollouts
    if name == "RolloutClient":
        from foursight.trainer_bridge.client import RolloutClient

        return RolloutClient
    raise AttributeError(name)
