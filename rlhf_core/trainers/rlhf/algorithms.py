"""The RL algorithms, one declaration each: what an iteration needs and which equations it runs.

With ``s_i`` the score of sample ``i`` (reward sources, no-EOS penalty applied), ``g`` its prompt's group
and ``c`` the KL coefficient::

    algorithm         critic  baselined score b_i (whole groups)      token advantages A_t             KL to ref
    grpo              -       (s_i - mean_g s) / std (grpo.scale)     A_t = b_i                        beta k3, loss
    grpo/best (RAFT)  -       [i = argmax_g s] (others dropped)       A_t = b_i                        beta k3, loss
    grpo/process      -       per step: r~ = (r - mean_g R) / std_g R  A_t = sum_{ends >= t} r~         beta k3, loss
    ppo/gae           yes     s_i, or s_i - mean_g s                  GAE(V, r)                        in r (or loss)
    ppo/gae/process   yes     per step: r~ as grpo/process            GAE(V, r), r~ at the step ends   in r (or loss)
    ppo/rloo          -       s_i - mean_{j != i} s_j                 sum_{k>=t} gamma^(k-t) r_k       in r (or loss)
    ppo/reinforce_pp  -       s_i, or s_i - mean_g s                  whiten(sum_{k>=t} ...)           in r (or loss)

with PPO's token rewards ``r_t = -c KL_t + clip(b_i) [t = last]`` (``kl_in: reward``; no KL term with ``kl_in:
loss``), and under process supervision ``r_t = -c KL_t + clip(r~_t) [t a step end]``. ``b`` is computed per
generation batch on whole groups, before empty responses are dropped (``ExperienceMaker``), and kept as
``Experience.baselined``. Adding a variant (Dr. GRPO, a new baseline) is one ``Algorithm`` in ``algorithm_for``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial

import torch

from rlhf_core.algos import (
    best_of_group,
    discounted_cumsum,
    gae,
    group_advantages,
    kl_penalized_rewards,
    masked_whiten,
    reinforce_pp_advantages,
    rloo_advantages,
    step_token_rewards,
)
from rlhf_core.config import RLHFConfig
from rlhf_core.trainers.rlhf.experience import Experience
from rlhf_core.trainers.rlhf.ppo import ActorLossConfig

Baseline = Callable[[torch.Tensor], torch.Tensor]  # scores [B] in contiguous groups -> baselined scores [B]
Advantages = Callable[[Experience, float], Experience]  # (buffer, kl_coef) -> buffer with rewards/advantages/returns


@dataclass(frozen=True)
class Algorithm:
    """One RL algorithm: its needs (critic, rollout log-probs, reference) and its equations."""

    name: str  # grpo | grpo/best | grpo/process | ppo/gae | ppo/rloo | ppo/reinforce_pp
    critic: bool  # trains a value model (initialised from models/rm)
    kl_in_reward: bool  # -c * KL_t is part of the token rewards: needs the rollout log-probs before training
    kl_coef: float  # the (initial) KL coefficient c; 0: no reference model pass
    kl_metric: str  # estimator of the logged sampled KL ``kl``
    adaptive_kl: bool  # the coefficient follows a KL target (``rlhf.kl_controller: adaptive``)
    baseline: Baseline
    advantages: Advantages
    loss: ActorLossConfig
    drop_uniform_groups: bool = False  # groups scored all alike (every advantage 0) leave the buffer (GRPO)
    drop_unselected: bool = False  # rows that are not their group's pick (advantage 0) leave the buffer (RAFT)
    process: bool = False  # step rewards from a process reward model, normalised per group (*/process)

    @property
    def needs_reference(self) -> bool:
        return self.kl_coef > 0


def algorithm_for(cfg: RLHFConfig) -> Algorithm:
    """The declaration ``cfg`` selects (``rlhf.algorithm`` and, for PPO, ``rlhf.ppo.advantage_estimator``)."""
    n = cfg.samples_per_prompt
    if cfg.algorithm == "grpo":
        g = cfg.grpo
        process, best = g.supervision == "process", g.advantage == "best"
        return Algorithm("grpo/process" if process else "grpo/best" if best else "grpo", critic=False,
                         kl_in_reward=False, kl_coef=g.beta, kl_metric="k1", adaptive_kl=False,
                         baseline=partial(best_of_group, group_size=n) if best
                         else partial(group_advantages, group_size=n, scale=g.scale),
                         advantages=process_grpo_advantages if process else grpo_advantages,
                         loss=ActorLossConfig(clip_eps=g.clip_eps, kl_in_loss=g.beta > 0, kl_estimator=g.kl_estimator,
                                              entropy_coef=cfg.entropy_coef, temperature=cfg.temperature),
                         drop_uniform_groups=g.drop_uniform_groups and not process, drop_unselected=best,
                         process=process)
    p = cfg.ppo
    process = p.supervision == "process"
    centred = partial(group_advantages, group_size=n, scale="none")
    score_baseline = centred if p.score_baseline == "group_mean" else _identity
    rewards = partial(process_token_rewards if process else token_rewards, kl_estimator=cfg.kl_estimator,
                      reward_clip=cfg.reward_clip, kl_in_reward=p.kl_in == "reward")
    baseline, advantages = {
        "gae": (score_baseline, partial(gae_advantages, rewards=rewards, gamma=p.gamma, lam=p.lam,
                                        whiten=cfg.whiten_advantages)),
        "rloo": (partial(rloo_advantages, group_size=n),
                 partial(return_advantages, rewards=rewards, gamma=p.gamma, whiten=cfg.whiten_advantages)),
        "reinforce_pp": (score_baseline, partial(reinforce_pp, rewards=rewards, gamma=p.gamma)),
    }[p.advantage_estimator]
    return Algorithm(f"ppo/{p.advantage_estimator}" + ("/process" if process else ""),
                     critic=p.advantage_estimator == "gae", process=process,
                     kl_in_reward=p.kl_in == "reward" and cfg.kl_coef > 0, kl_coef=cfg.kl_coef,
                     kl_metric=cfg.kl_estimator, adaptive_kl=cfg.kl_controller == "adaptive",
                     baseline=baseline, advantages=advantages,
                     loss=ActorLossConfig(clip_eps=p.clip_eps, dual_clip=p.dual_clip, kl_in_loss=p.kl_in == "loss",
                                          kl_estimator=cfg.kl_estimator, entropy_coef=cfg.entropy_coef,
                                          temperature=cfg.temperature))


def _identity(scores: torch.Tensor) -> torch.Tensor:
    return scores


# --------------------------------------------------------------------------- token rewards and advantages
def token_rewards(exp: Experience, kl_coef: float, kl_estimator: str, reward_clip: float | None,
                  kl_in_reward: bool) -> torch.Tensor:
    """``r_t = -c KL_t + clip(b) [t = last valid token]`` (``c = 0`` when the KL is in the loss)."""
    coef = kl_coef if kl_in_reward else 0.0
    mask = exp.action_mask.bool()
    if coef > 0 and (exp.old_logp is None or exp.ref_logp is None):
        raise ValueError("KL in the reward needs the actor's and the reference's log-probs")
    logp = exp.old_logp if exp.old_logp is not None else torch.zeros(mask.shape)
    ref = exp.ref_logp if exp.ref_logp is not None else logp
    return kl_penalized_rewards(exp.baselined.float(), logp, ref, mask, coef, reward_clip, kl_estimator)


def process_token_rewards(exp: Experience, kl_coef: float, kl_estimator: str, reward_clip: float | None,
                          kl_in_reward: bool) -> torch.Tensor:
    """``r_t = -c KL_t + clip(r~_t)``: the group-normalised step rewards the experience maker read from the PRM
    (``Experience.step_rewards``, 0 off the step ends) in place of the score at the last token."""
    if exp.step_rewards is None:
        raise ValueError("ppo/gae/process needs the step rewards the experience maker reads from the PRM")
    coef = kl_coef if kl_in_reward else 0.0
    if coef > 0 and (exp.old_logp is None or exp.ref_logp is None):
        raise ValueError("KL in the reward needs the actor's and the reference's log-probs")
    logp = exp.old_logp if exp.old_logp is not None else torch.zeros(exp.action_mask.shape)
    ref = exp.ref_logp if exp.ref_logp is not None else logp
    return step_token_rewards(exp.step_rewards.float(), logp, ref, exp.action_mask.bool(), coef, reward_clip,
                              kl_estimator)


def grpo_advantages(exp: Experience, kl_coef: float) -> Experience:
    """``A_t = b`` on every valid token; ``rewards`` holds the raw score at the last token (for metrics)."""
    mask = exp.action_mask.bool()
    zero = torch.zeros((), dtype=torch.float32)
    adv = torch.where(mask, exp.baselined.float().unsqueeze(-1), zero)
    last = mask & (torch.arange(mask.shape[1]) == mask.sum(1, keepdim=True) - 1)
    return replace(exp, rewards=torch.where(last, exp.scores.float().unsqueeze(-1), zero), advantages=adv, returns=adv)


def process_grpo_advantages(exp: Experience, kl_coef: float) -> Experience:
    """``A_t = sum over step ends t' >= t of r~(t')``, taken on whole groups before rows were dropped
    (``Experience.step_advantages``); ``rewards`` holds the PRM's step rewards at the step ends (for metrics)."""
    if exp.step_advantages is None:
        raise ValueError("grpo/process needs the step advantages the experience maker computes from the PRM")
    mask = exp.action_mask.bool()
    zero = torch.zeros((), dtype=torch.float32)
    adv = torch.where(mask, exp.step_advantages.float(), zero)
    return replace(exp, rewards=exp.rewards if exp.rewards is not None else torch.zeros(mask.shape), advantages=adv,
                   returns=adv)


def gae_advantages(exp: Experience, kl_coef: float, rewards: Callable, gamma: float, lam: float,
                   whiten: bool) -> Experience:
    """``A, R = gae(V, r)``; ``A`` whitened over the buffer when configured."""
    if exp.values is None:
        raise ValueError("GAE needs critic values")
    mask = exp.action_mask.bool()
    r = rewards(exp, kl_coef)
    adv, ret = gae(exp.values.float(), r, mask, gamma, lam)
    return replace(exp, rewards=r, advantages=masked_whiten(adv, mask) if whiten else adv, returns=ret)


def return_advantages(exp: Experience, kl_coef: float, rewards: Callable, gamma: float, whiten: bool) -> Experience:
    """``A = R = sum_{k>=t} gamma^(k-t) r_k`` (``A`` whitened when configured): RLOO's token advantages."""
    mask = exp.action_mask.bool()
    zero = torch.zeros((), dtype=torch.float32)
    r = rewards(exp, kl_coef)
    ret = torch.where(mask, discounted_cumsum(torch.where(mask, r, zero), gamma), zero)
    return replace(exp, rewards=r, advantages=masked_whiten(ret, mask) if whiten else ret, returns=ret)


def reinforce_pp(exp: Experience, kl_coef: float, rewards: Callable, gamma: float) -> Experience:
    """``A = R = whiten(sum_{k>=t} gamma^(k-t) r_k)`` (REINFORCE++)."""
    r = rewards(exp, kl_coef)
    adv = reinforce_pp_advantages(r, exp.action_mask.bool(), gamma)
    return replace(exp, rewards=r, advantages=adv, returns=adv)


def compute_advantages(exp: Experience, algorithm: Algorithm, kl_coef: float) -> Experience:
    """Token rewards, advantages and returns over the whole buffer (vectorised, no loop over tokens)."""
    return algorithm.advantages(exp, kl_coef)
