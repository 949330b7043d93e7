"""Advantage estimators: GAE (PPO), group-relative (GRPO), RLOO and REINFORCE++.

All estimators return detached tensors: advantages and returns are regression/weighting targets, so
gradients must not flow back into the critic or reward model through them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlhf_core.algos.masking import as_bool_mask, masked_whiten

__all__ = [
    "discounted_cumsum",
    "gae",
    "group_advantages",
    "reinforce_pp_advantages",
    "rloo_advantages",
]

_BLOCK = 64


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    # float64 keeps the discount powers and sums exact to well below float32 precision; MPS has no float64.
    return torch.float32 if t.device.type == "mps" else torch.float64


def _discount_matrix(n: int, discount: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``D[k, t] = discount^(k - t)`` for ``k >= t`` else 0, so ``(x @ D)[t] = sum_{k>=t} discount^(k-t) x_k``."""
    idx = torch.arange(n, device=device)
    lag = idx.unsqueeze(1) - idx.unsqueeze(0)
    powers = torch.tensor(discount, dtype=dtype, device=device) ** lag.clamp(min=0).to(dtype)
    return torch.where(lag >= 0, powers, torch.zeros((), dtype=dtype, device=device))


def _discounted_cumsum(x: torch.Tensor, discount: float, block: int) -> torch.Tensor:
    n = x.shape[-1]
    if n <= block:
        return x @ _discount_matrix(n, discount, x.dtype, x.device)
    # Blocked: solve each block as if the sequence ended there, then add the true value carried in from the
    # start of the next block. Those block-start values are themselves a discounted cumsum (discount^block)
    # over n / block entries, solved recursively. Memory O(B * T), work O(B * T * block), no loop over T.
    n_blocks = -(-n // block)
    chunks = F.pad(x, (0, n_blocks * block - n)).reshape(*x.shape[:-1], n_blocks, block)
    local = chunks @ _discount_matrix(block, discount, x.dtype, x.device)
    starts = _discounted_cumsum(local[..., 0], discount**block, block)  # true value at each block start
    carried = F.pad(starts[..., 1:], (0, 1))  # value at the start of the next block (0 after the last one)
    offsets = torch.arange(block, 0, -1, device=x.device).to(x.dtype)  # block - i
    out = local + carried.unsqueeze(-1) * torch.tensor(discount, dtype=x.dtype, device=x.device) ** offsets
    return out.reshape(*x.shape[:-1], n_blocks * block)[..., :n]


def discounted_cumsum(x: torch.Tensor, discount: float) -> torch.Tensor:
    """Reverse discounted cumulative sum along the last dim: ``y_t = sum_{k >= t} discount^(k - t) x_k``.

    Equivalent to the backward recursion ``y_t = x_t + discount * y_{t+1}`` (``y_T = 0``) but fully vectorised
    with (blocked) discount matrices; computed in float64 (float32 on MPS) and returned in ``x``'s dtype.
    """
    if x.shape[-1] == 0:
        return x.clone()
    out_dtype = x.dtype if x.is_floating_point() else torch.get_default_dtype()
    return _discounted_cumsum(x.to(_compute_dtype(x)), float(discount), _BLOCK).to(out_dtype)


def gae(
    values: torch.Tensor, rewards: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised Advantage Estimation (Schulman et al., 2016) over ``[B, T]`` token positions.

    ``values`` and ``rewards`` are first set to 0 outside ``mask``; then, with ``V_T = 0``::

        delta_t = r_t + gamma * V_{t+1} - V_t
        A_t     = delta_t + gamma * lam * A_{t+1}      (A_T = 0)
        R_t     = A_t + V_t

    so the value after the last valid token is 0 (the episode ends there). Returns ``(advantages, returns)``,
    both ``[B, T]``, detached, and 0 outside ``mask``.
    """
    m = as_bool_mask(mask)
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    v = torch.where(m, values.detach(), zero)
    r = torch.where(m, rewards.detach().to(values.dtype), zero)
    next_v = F.pad(v[..., 1:], (0, 1))
    delta = r + gamma * next_v - v
    advantages = discounted_cumsum(delta, gamma * lam)
    returns = advantages + v
    return torch.where(m, advantages, zero), torch.where(m, returns, zero)


def _grouped(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    n = scores.numel()
    if group_size < 1:
        raise ValueError(f"group_size must be a positive integer, got {group_size}")
    if n % group_size != 0:
        raise ValueError(
            f"group_size={group_size} does not divide the number of scores {n}: scores must hold "
            f"n_prompts * group_size entries, each prompt's group_size completions contiguous"
        )
    return scores.detach().reshape(n // group_size, group_size)


def group_advantages(scores: torch.Tensor, group_size: int, scale: str = "group", eps: float = 1e-4) -> torch.Tensor:
    """GRPO advantages: each sequence score relative to its group (the completions of one prompt).

    ``scores`` has ``n_prompts * group_size`` entries, groups contiguous. ``A_i = (r_i - mean_g) / (std_g + eps)``
    with the unbiased (``n - 1``) group std, as :meth:`torch.Tensor.std` computes by default. ``scale``:

    * ``"group"``: as above; a group of size 1 has std 0 (so ``A = 0``) instead of ``NaN``;
    * ``"batch"``: divide by the (unbiased) std of all scores instead: ``(r_i - mean_g) / (std_all + eps)``;
    * ``"none"``: only centre, ``A_i = r_i - mean_g`` (Dr. GRPO).

    A ``group_size`` that does not divide ``len(scores)`` raises :class:`ValueError`. Same shape as ``scores``.
    """
    grouped = _grouped(scores, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if scale == "none":
        out = centred
    elif scale == "group":
        std = grouped.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(grouped[:, :1])
        out = centred / (std + eps)
    elif scale == "batch":
        std = grouped.std() if grouped.numel() > 1 else torch.zeros((), dtype=grouped.dtype, device=grouped.device)
        out = centred / (std + eps)
    else:
        raise ValueError(f"unknown scale {scale!r}; expected 'group', 'batch' or 'none'")
    return out.reshape(scores.shape)


def best_of_group(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """RAFT's selection (reward-ranked fine-tuning, Dong et al. 2023; Llama 2's rejection sampling, online):
    ``A_i = [i = argmax_g s]``, 1 for each group's highest score and 0 for the others; ties go to the first.

    With these advantages the clipped surrogate at ratio 1 is the NLL of each group's best response, i.e. SFT on
    the reward model's pick among the policy's own samples. Groups contiguous as in :func:`group_advantages`.
    """
    best = _grouped(scores, group_size).argmax(dim=1)
    return F.one_hot(best, group_size).to(scores.dtype).reshape(scores.shape)


def rloo_advantages(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """REINFORCE Leave-One-Out (Ahmadian et al., 2024): ``A_i = r_i - mean_{j != i} r_j`` within each group.

    Groups are contiguous as in :func:`group_advantages`; computed as ``r_i - (sum_g - r_i) / (k - 1)``.
    Needs ``group_size >= 2``. Same shape as ``scores``.
    """
    if group_size == 1:
        raise ValueError("rloo_advantages needs group_size >= 2 (leave-one-out baseline over the others)")
    grouped = _grouped(scores, group_size)
    baseline = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)
    return (grouped - baseline).reshape(scores.shape)


def reinforce_pp_advantages(rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """REINFORCE++ (Hu, 2025): discounted return-to-go of token rewards, whitened over the whole batch.

    ``G_t = sum_{k >= t} gamma^(k - t) r_k`` (rewards outside ``mask`` count as 0), then
    ``A = masked_whiten(G, mask)`` with the global mean and unbiased variance of all valid tokens. ``[B, T]``,
    detached, 0 outside ``mask``.
    """
    m = as_bool_mask(mask)
    r = torch.where(m, rewards.detach(), torch.zeros((), dtype=rewards.dtype, device=rewards.device))
    return masked_whiten(discounted_cumsum(r, gamma), m)
