"""Pure, vectorised tensor math for PPO / GRPO: masking, KL, advantages and losses; process supervision
(step ends, the PRM loss, per-step advantages).

No I/O, no models, no config objects. Tensors are ``[B, T]`` over response positions with a 0/1 ``mask`` of
valid action positions unless a docstring says otherwise.
"""

from __future__ import annotations

from rlhf_core.algos.advantages import (
    best_of_group,
    discounted_cumsum,
    gae,
    group_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
)
from rlhf_core.algos.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    kl_estimate,
    kl_penalized_rewards,
)
from rlhf_core.algos.losses import (
    IGNORE_INDEX,
    divergence_rm_loss,
    entropy_from_logits,
    implicit_reward,
    logprobs_from_logits,
    pairwise_rm_loss,
    policy_loss,
    response_logprob_sums,
    rpo_loss,
    token_nll,
    value_loss,
)
from rlhf_core.algos.masking import (
    as_bool_mask,
    gather_last,
    gather_pooled,
    last_valid_index,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)
from rlhf_core.algos.process import (
    normalised_step_rewards,
    process_advantages,
    step_bce_loss,
    step_ends,
    step_token_rewards,
)

__all__ = [
    "IGNORE_INDEX",
    "KL_ESTIMATORS",
    "AdaptiveKLController",
    "FixedKLController",
    "as_bool_mask",
    "best_of_group",
    "discounted_cumsum",
    "divergence_rm_loss",
    "entropy_from_logits",
    "gae",
    "gather_last",
    "gather_pooled",
    "group_advantages",
    "implicit_reward",
    "kl_estimate",
    "kl_penalized_rewards",
    "last_valid_index",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "pairwise_rm_loss",
    "rpo_loss",
    "policy_loss",
    "normalised_step_rewards",
    "process_advantages",
    "reinforce_pp_advantages",
    "response_logprob_sums",
    "rloo_advantages",
    "step_bce_loss",
    "step_ends",
    "step_token_rewards",
    "token_nll",
    "value_loss",
]
