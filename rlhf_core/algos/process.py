"""Process supervision (DeepSeekMath, Shao et al. 2024, section 4.1.3; Math-Shepherd, Wang et al. 2024).

A response is a chain of steps; a process reward model (PRM) scores the end of each step. Over ``[B, T]``
response positions, with ``ends`` marking the token that ends a step:

    step ends        e(i, t) = token t of row i is a delimiter, or row i's last valid token
    PRM loss         L = mean over step ends of BCE(sigmoid(s(i, t)), y(i, t))          y: the step's label
    normalised       r~(i, t) = (r(i, t) - mean(R_g)) / (std(R_g) + eps)   R_g: every step reward of the
                     group g of i (its G outputs of one prompt), std unbiased
    advantage        A(i, t) = sum over step ends t' >= t of r~(i, t')                      (GRPO)
    PPO's rewards    r(i, t) = -c KL(i, t) + clip(r~(i, t)) [t a step end]; GAE over them     (PPO)

so a token is credited with the normalised rewards of its own step and of every later one. Groups are
``group_size`` consecutive rows, as in :func:`rlhf_core.algos.advantages.group_advantages`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlhf_core.algos.advantages import _grouped
from rlhf_core.algos.kl import kl_penalized_rewards
from rlhf_core.algos.masking import as_bool_mask

__all__ = ["normalised_step_rewards", "process_advantages", "step_bce_loss", "step_ends", "step_token_rewards"]


def step_ends(response_ids: torch.Tensor, mask: torch.Tensor, delimiter_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the steps of each response end, and which rows hold an empty step.

    ``ends[i, t]``: token ``t`` is ``delimiter_id`` or row ``i``'s last valid token (a response without a
    delimiter is one step). ``empty[i]``: a step of row ``i`` has no token but its delimiter (the response opens
    with one, or two follow each other); the caller drops such rows and counts them. A row with no valid token
    has no step end. Both detached; ``ends`` is 0 outside ``mask``.
    """
    m = as_bool_mask(mask)
    last = m & ~F.pad(m[:, 1:], (0, 1), value=False)
    delim = m & (response_ids == delimiter_id)
    ends = delim | last
    first = m & ~F.pad(m[:, :-1], (1, 0), value=False)
    previous_ended = F.pad(ends[:, :-1], (1, 0), value=False)
    empty = (delim & (first | previous_ended)).any(dim=1)
    return ends, empty


def step_bce_loss(step_logits: torch.Tensor, labels: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """PRM loss: mean binary cross-entropy of the step scores (logits) against the step labels (1 correct,
    0 wrong), over the step ends only. No step end at all: 0 (keeps the graph)."""
    e = as_bool_mask(ends)
    per_token = F.binary_cross_entropy_with_logits(step_logits, labels.to(step_logits.dtype), reduction="none")
    return (per_token * e).sum() / e.sum().clamp(min=1)


def normalised_step_rewards(step_rewards: torch.Tensor, ends: torch.Tensor, mask: torch.Tensor, group_size: int,
                            eps: float = 1e-4) -> torch.Tensor:
    """``r~(i, t) = (r(i, t) - mean(R_g)) / (std(R_g) + eps)`` at the step ends, 0 elsewhere.

    ``step_rewards`` ``[B, T]``: the PRM's reward of each step, read at its end (other positions ignored); ``R_g``
    is every step reward of the group (``group_size`` consecutive rows); a group with a single step end has std
    0. ``[B, T]`` float64, detached.
    """
    e = as_bool_mask(ends) & as_bool_mask(mask)
    B, T = step_rewards.shape
    r = _grouped(step_rewards.detach().to(torch.float64), group_size).reshape(-1, group_size * T)
    g = _grouped(e, group_size).reshape(-1, group_size * T)
    count = g.sum(dim=1, keepdim=True)
    mean = (r * g).sum(dim=1, keepdim=True) / count.clamp(min=1)
    var = (((r - mean) * g) ** 2).sum(dim=1, keepdim=True) / (count - 1).clamp(min=1)
    return torch.where(g, (r - mean) / (var.sqrt() + eps), torch.zeros((), dtype=r.dtype)).reshape(B, T)


def rewards_to_go(per_step: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``A(i, t) = sum_{t' >= t} r~(i, t')``: each token's sum of the step rewards at or after it (``per_step``
    ``[B, T]``, 0 off the step ends), 0 outside ``mask``."""
    to_go = per_step.flip(-1).cumsum(-1).flip(-1)
    return torch.where(as_bool_mask(mask), to_go, torch.zeros((), dtype=to_go.dtype))


def process_advantages(step_rewards: torch.Tensor, ends: torch.Tensor, mask: torch.Tensor, group_size: int,
                       eps: float = 1e-4) -> torch.Tensor:
    """GRPO advantages under process supervision: ``A(i, t) = sum_{t' >= t, t' a step end} r~(i, t')``, with
    ``r~`` from :func:`normalised_step_rewards`. ``[B, T]`` in ``step_rewards``' dtype, detached, 0 outside
    ``mask``."""
    per_step = normalised_step_rewards(step_rewards, ends, mask, group_size, eps)
    return rewards_to_go(per_step, mask).to(step_rewards.dtype)


def step_token_rewards(step_rewards: torch.Tensor, logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor,
                       kl_coef: float | torch.Tensor, clip: float | None = None, kind: str = "k1") -> torch.Tensor:
    """PPO's token rewards under process supervision: ``r_t = -c KL_t + clip(r~_t)``, where ``step_rewards``
    ``[B, T]`` holds ``r~`` at the step ends and 0 elsewhere (:func:`normalised_step_rewards`), so each step's
    reward sits on its last token. Outside ``mask``: 0."""
    penalty = kl_penalized_rewards(torch.zeros(mask.shape[0], dtype=logp.dtype), logp, ref_logp, mask, kl_coef,
                                   None, kind)
    steps = step_rewards.clamp(-clip, clip) if clip is not None else step_rewards
    return penalty + torch.where(as_bool_mask(mask), steps.to(penalty.dtype), torch.zeros((), dtype=penalty.dtype))
