"""Masked reductions over ``[B, T]`` response tensors.

Conventions shared by every function here and in the rest of :mod:`rlhf_core.algos`:

* ``mask`` marks valid action positions. It may be float, bool or integer; any non-zero entry counts as
  valid (so a 0/1 float mask and a bool mask behave the same). It must broadcast against ``x``.
* Masked-out entries of ``x`` are never read: they are replaced by 0 with :func:`torch.where` rather than
  multiplied by 0, so ``inf``/``NaN`` padding (e.g. ``-inf`` log-probs) cannot leak into the results.
* An empty selection (no valid entry) reduces to 0, never ``NaN``.
"""

from __future__ import annotations

import torch

__all__ = [
    "as_bool_mask",
    "gather_last",
    "gather_pooled",
    "last_valid_index",
    "pooled_index",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
]

Dim = int | tuple[int, ...] | None


def as_bool_mask(mask: torch.Tensor) -> torch.Tensor:
    """``mask != 0`` as a bool tensor (float, bool and integer masks all accepted)."""
    return mask if mask.dtype == torch.bool else mask != 0


def _sum_count(x: torch.Tensor, mask: torch.Tensor, dim: Dim, keepdim: bool) -> tuple[torch.Tensor, torch.Tensor]:
    m = as_bool_mask(mask)
    x, m = torch.broadcast_tensors(x, m)
    xm = torch.where(m, x, torch.zeros((), dtype=x.dtype, device=x.device))
    if dim is None:
        return xm.sum(), m.sum().to(x.dtype)
    return xm.sum(dim=dim, keepdim=keepdim), m.sum(dim=dim, keepdim=keepdim).to(x.dtype)


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: Dim = None, keepdim: bool = False) -> torch.Tensor:
    """``sum(x_i for valid i)``; over all entries when ``dim`` is None (a 0-dim tensor), else along ``dim``."""
    return _sum_count(x, mask, dim, keepdim)[0]


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: Dim = None, keepdim: bool = False) -> torch.Tensor:
    """Mean of the valid entries: ``sum(m * x) / sum(m)``.

    ``dim=None`` gives a 0-dim tensor over every valid entry of the batch (token-level mean); with ``dim``
    the mean is taken along that dimension (e.g. ``dim=-1``: one mean per row). A row (or batch) with no
    valid entry gives 0, not ``NaN``, and contributes zero gradient.
    """
    total, count = _sum_count(x, mask, dim, keepdim)
    # Safe denominator: where count == 0 the sum is 0 too, so 0 / 1 = 0 (and no 0/0 in the backward pass).
    return total / torch.where(count > 0, count, torch.ones_like(count))


def masked_var(
    x: torch.Tensor, mask: torch.Tensor, dim: Dim = None, unbiased: bool = True, keepdim: bool = False
) -> torch.Tensor:
    """Variance of the valid entries (TRL's ``masked_var``).

    ``mu = masked_mean(x)``; ``var = sum(m * (x - mu)^2) / n``, times Bessel's correction ``n / (n - 1)`` when
    ``unbiased`` (so ``sum(m * (x - mu)^2) / (n - 1)``), ``n = sum(m)``. Where ``n <= 1`` (unbiased) or
    ``n == 0`` (biased) the variance is defined as 0 instead of ``inf``/``NaN``.
    """
    mean = masked_mean(x, mask, dim=dim, keepdim=True)
    sq, count = _sum_count((x - mean) ** 2, mask, dim, keepdim)
    denom = count - 1 if unbiased else count
    safe = torch.where(denom > 0, denom, torch.ones_like(denom))
    return torch.where(denom > 0, sq / safe, torch.zeros_like(sq))


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """Normalise the valid entries of the whole batch: ``(x - mu) / sqrt(var + eps)``.

    ``mu`` and ``var`` are the global :func:`masked_mean` and unbiased :func:`masked_var` over all valid
    entries. With ``shift_mean=False`` the mean is added back (``(x - mu) / sqrt(var + eps) + mu``: only the
    scale changes). The output is 0 wherever ``mask`` is 0.
    """
    m = as_bool_mask(mask)
    mean = masked_mean(x, m)
    var = masked_var(x, m, unbiased=True)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(m, whitened, torch.zeros((), dtype=whitened.dtype, device=whitened.device))


def last_valid_index(mask: torch.Tensor) -> torch.Tensor:
    """Index of the last valid entry along the last dim, ``[..., T] -> [...]`` (long).

    Rows with no valid entry give ``-1``.
    """
    m = as_bool_mask(mask)
    positions = torch.arange(m.shape[-1], device=m.device)
    return torch.where(m, positions, torch.full_like(positions, -1)).amax(dim=-1)


def gather_last(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``x`` at :func:`last_valid_index` of each row, ``[..., T] -> [...]``; 0 for rows with no valid entry.

    ``x`` and ``mask`` have the same shape.
    """
    idx = last_valid_index(mask)
    picked = x.gather(-1, idx.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return torch.where(idx >= 0, picked, torch.zeros_like(picked))


def pooled_index(input_ids: torch.Tensor, mask: torch.Tensor, pad_token_id: int | None) -> torch.Tensor:
    """The position a transformers ``*ForSequenceClassification`` reads a row's score at, ``[B, T] -> [B]`` (long).

    transformers (``GenericForSequenceClassification.forward``) takes the rightmost token whose id is not
    ``pad_token_id``, so with pad = EOS a trailing EOS (or a run of them) is skipped and the token before it is
    read; a row of pad ids only is read at its first token; with no ``pad_token_id``, the last token. Here the
    same on padded rows, left or right: among the positions valid in ``mask``, the rightmost whose id is not
    ``pad_token_id``, else the row's first valid position (transformers' index 0 of the unpadded row); with
    ``pad_token_id`` None, the last valid position. ``-1`` for a row with no valid position.
    """
    m = as_bool_mask(mask)
    if pad_token_id is None:
        return last_valid_index(m)
    last = last_valid_index(m & (input_ids != pad_token_id))
    positions = torch.arange(m.shape[-1], device=m.device)
    first = torch.where(m, positions, torch.full_like(positions, m.shape[-1])).amin(dim=-1)
    return torch.where(last >= 0, last, torch.where(m.any(dim=-1), first, torch.full_like(first, -1)))


def gather_pooled(x: torch.Tensor, input_ids: torch.Tensor, mask: torch.Tensor,
                  pad_token_id: int | None) -> torch.Tensor:
    """``x`` at :func:`pooled_index` of each row, ``[B, T] -> [B]``; 0 for rows with no valid position."""
    idx = pooled_index(input_ids, mask, pad_token_id)
    picked = x.gather(-1, idx.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return torch.where(idx >= 0, picked, torch.zeros_like(picked))
