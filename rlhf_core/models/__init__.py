"""Models: the value-head model (reward model / critic), the reward scorer, loading and saving helpers."""

from rlhf_core.algos import gather_last, last_valid_index
from rlhf_core.models.loading import (
    build_causal_lm,
    build_value_model,
    check_vocab_fits,
    load_causal_lm,
    load_training_tokenizer,
    save_causal_lm,
    save_value_model,
)
from rlhf_core.models.scorer import RewardScorer
from rlhf_core.models.value_head import ValueHeadModel, ValueHeadOutput

__all__ = [
    "RewardScorer",
    "ValueHeadModel",
    "ValueHeadOutput",
    "build_causal_lm",
    "build_value_model",
    "check_vocab_fits",
    "gather_last",
    "last_valid_index",
    "load_causal_lm",
    "load_training_tokenizer",
    "save_causal_lm",
    "save_value_model",
]
