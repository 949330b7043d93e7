"""Models: the value-head model (reward model / critic), the reward scorer, loading and saving helpers."""

from rlhf_core.models.loading import load_causal_lm
from rlhf_core.models.scorer import RewardScorer
from rlhf_core.models.value_head import ValueHeadModel

__all__ = [
    "RewardScorer",
    "ValueHeadModel",
    "load_causal_lm",
]
