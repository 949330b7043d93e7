"""Models: the value-head model (reward model / critic), the reward scorer, loading and saving helpers."""

from rlhf_core.models.loading import load_causal_lm
from rlhf_core.models.scorer import EnsembleScorer, RewardScorer, load_scorer
from rlhf_core.models.value_head import ValueHeadModel

__all__ = [
    "EnsembleScorer",
    "RewardScorer",
    "ValueHeadModel",
    "load_causal_lm",
    "load_scorer",
]
