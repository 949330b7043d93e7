"""GRPO (DeepSeekMath, Shao et al. 2024): G samples per prompt, group-relative advantages, KL in the loss.

::

    A_i     = (r_i - mean(r_group)) / (std(r_group) + eps)          (rlhf.grpo.scale: group | batch | none)
    L       = masked_mean(max(-A_i ratio_t, -A_i clip(ratio_t, 1 - eps, 1 + eps)))
              + beta * masked_mean(k3_t),  k3_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1

No critic. The loss is the token-level mean over the micro-batch (DAPO / TRL's current default, rather than
DeepSeekMath's per-sequence mean then mean over sequences, which down-weights long responses' tokens).
"""

from __future__ import annotations

from rlhf_core.config import RLHFConfig
from rlhf_core.rlhf.ppo import ActorLossConfig


def grpo_loss_config(cfg: RLHFConfig) -> ActorLossConfig:
    g = cfg.grpo
    return ActorLossConfig(clip_eps=g.clip_eps, dual_clip=None, kl_in_loss=g.beta > 0, kl_estimator=g.kl_estimator,
                           entropy_coef=cfg.entropy_coef, temperature=cfg.temperature)

