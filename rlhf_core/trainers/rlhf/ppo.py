"""The actor and critic losses on one micro-batch of experience (InstructGPT / DeepSpeed-Chat / OpenRLHF
semantics); PPO and GRPO share the clipped surrogate (``rlhf_core.trainers.rlhf.algorithms`` picks the terms).

Actor::

    ratio_t = exp(logp_t - old_logp_t)
    L_pg    = masked_mean(max(-A_t ratio_t, -A_t clip(ratio_t, 1 - eps, 1 + eps)))   (dual clip optional)
    L_actor = L_pg  [+ kl_coef * masked_mean(KL_t)  when rlhf.ppo.kl_in: loss]
                    - entropy_coef * masked_mean(H_t)  [+ ptx_coef * L_sft]

Critic (initialised from the reward model)::

    V_clip  = V_old + clip(V - V_old, -eps_v, eps_v)
    L_value = vf_coef * 0.5 * masked_mean(max((V - R)^2, (V_clip - R)^2))

GRPO (DeepSeekMath, Shao et al. 2024) is the actor loss with ``A_t`` the group advantage and KL in the loss,
``beta * masked_mean(k3_t)``, ``k3_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1``, and no critic.

Token-level means over every valid action token of the micro-batch (OpenRLHF / DeepSpeed-Chat; for GRPO the
DAPO / TRL default rather than DeepSeekMath's per-sequence mean, which down-weights long responses' tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlhf_core.algos import kl_estimate, masked_mean, policy_loss, value_loss
from rlhf_core.passes.generation import response_logprobs
from rlhf_core.passes.values import sequence_values
from rlhf_core.trainers.rlhf.experience import Experience


@dataclass(frozen=True)
class ActorLossConfig:
    clip_eps: float = 0.2
    dual_clip: float | None = None
    kl_in_loss: bool = False  # add kl_coef * KL to the loss (PPO kl_in: loss; GRPO always)
    kl_estimator: str = "k1"
    entropy_coef: float = 0.0
    temperature: float = 1.0


def actor_loss(model, mb: Experience, cfg: ActorLossConfig, kl_coef: float,
               shared_prefix: bool = False, pack: bool = False) -> tuple[torch.Tensor, dict]:
    """Clipped surrogate (+ KL in the loss, - entropy bonus) on ``mb`` (already on the model's device);
    ``shared_prefix``: each prompt of ``mb.group`` is computed once, with ``pack`` its responses packed after it
    (``generation.response_logits``).

    Without stored ``old_logp`` (one optimizer step per buffer, one epoch: the policy has not moved since
    the rollout) the ratio is taken against ``logp.detach()``: ratio = 1 with the same gradient, one forward
    pass saved (TRL does the same).
    """
    mask = mb.action_mask.bool()
    logp, entropy = response_logprobs(model, mb.sequences, mb.attention_mask, mb.response_len, cfg.temperature,
                                      return_entropy=True, entropy_grad=cfg.entropy_coef > 0,
                                      group=mb.group if shared_prefix else None, pack=pack)
    old = mb.old_logp if mb.old_logp is not None else logp.detach()
    loss, stats = policy_loss(logp, old, mb.advantages, mask, cfg.clip_eps, cfg.dual_clip)
    stats = {"policy_loss": loss.detach(), "clipfrac": stats["clipfrac"], "approx_kl": stats["approx_kl"]}
    if cfg.kl_in_loss and mb.ref_logp is not None:
        kl = masked_mean(kl_estimate(logp, mb.ref_logp, cfg.kl_estimator), mask)
        loss = loss + kl_coef * kl
        stats["kl_loss"] = kl.detach()
    ent = masked_mean(entropy, mask)
    if cfg.entropy_coef > 0:
        loss = loss - cfg.entropy_coef * ent
    stats["entropy"] = ent.detach()
    stats["_logp"] = logp.detach()  # the trainer keeps it as the rollout log-probs when none were stored
    return loss, stats


def critic_loss(model, mb: Experience, clip_eps: float | None, vf_coef: float,
                shared_prefix: bool = False) -> tuple[torch.Tensor, dict]:
    """Clipped value loss against the GAE returns (``shared_prefix``: each prompt of ``mb.group`` once)."""
    values = sequence_values(model, mb.sequences, mb.attention_mask, mb.response_len,
                             mb.group if shared_prefix else None)
    loss, stats = value_loss(values, mb.values, mb.returns, mb.action_mask, clip_eps)
    return vf_coef * loss, {"value_loss": loss.detach(), "vf_clipfrac": stats["vf_clipfrac"]}


def ptx_loss(model, batch: dict) -> torch.Tensor:
    """SFT (pretraining-mix) loss on a ``collate_sft`` batch: transformers' shifted token cross-entropy."""
    batch = {k: v for k, v in batch.items() if k != "num_tokens"}
    return model(**batch, use_cache=False).loss
