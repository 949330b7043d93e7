"""Losses for SFT and the reward model (vectorised). The sequence-level pairwise loss is
``rlhf_core.algos.pairwise_rm_loss``; the per-token DeepSpeed-Chat variant lives here."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlhf_core.data.collate import IGNORE_INDEX


def token_nll(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row summed NLL and token count of a causal LM: logits at ``t`` score ``labels[t + 1]``.

    ``logits [B, T, V]``, ``labels [B, T]`` with ``-100`` on ignored positions -> (``[B]``, ``[B]``).
    """
    shift_logits = logits[:, :-1].float()
    shift_labels = labels[:, 1:]
    nll = F.cross_entropy(shift_logits.reshape(-1, shift_logits.shape[-1]), shift_labels.reshape(-1),
                          ignore_index=IGNORE_INDEX, reduction="none").view_as(shift_labels)
    valid = shift_labels != IGNORE_INDEX
    return (nll * valid).sum(-1), valid.sum(-1)


def divergence_rm_loss(chosen_values: torch.Tensor, rejected_values: torch.Tensor, chosen_ids: torch.Tensor,
                       rejected_ids: torch.Tensor, chosen_mask: torch.Tensor, rejected_mask: torch.Tensor,
                       margin: float = 0.0) -> torch.Tensor:
    """DeepSpeed-Chat's per-token pairwise loss (``RewardModel.forward``), vectorised over the batch.

    For pair ``i`` with right-padded rows: ``d`` = first position where the chosen and rejected ids
    differ, ``end`` = max of the two lengths; the loss is the mean over ``d <= t < end`` of
    ``-log sigmoid(v_c[t] - v_r[t] - m)``, averaged over pairs.  Identical pairs use ``t = end - 1`` only.
    """
    T = chosen_ids.shape[1]
    pos = torch.arange(T, device=chosen_ids.device).unsqueeze(0)
    c_len, r_len = chosen_mask.sum(-1), rejected_mask.sum(-1)
    end = torch.maximum(c_len, r_len)
    differs = (chosen_ids != rejected_ids) & (pos < end[:, None])
    has_div = differs.any(-1)
    first = torch.argmax(differs.to(torch.int8), dim=-1)
    start = torch.where(has_div, first, end - 1)
    window = (pos >= start[:, None]) & (pos < end[:, None])
    per_token = -F.logsigmoid(chosen_values.float() - rejected_values.float() - margin)
    per_pair = (per_token * window).sum(-1) / window.sum(-1).clamp(min=1)
    return per_pair.mean()
