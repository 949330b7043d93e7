"""Deterministic, disjoint splits.

``data_split`` follows DeepSpeed-Chat: shares like ``2,4,4`` are normalised and
a seeded permutation of the rows is cut into SFT / RM / RL parts.  Every part
then holds out ``eval_fraction`` of its rows (at least one) for evaluation.
"""

from __future__ import annotations

import numpy as np


def split_by_shares(n: int, shares: list[float], seed: int) -> list[np.ndarray]:
    """Indices ``0..n-1`` permuted under ``seed`` and cut by the normalised shares (disjoint, covering)."""
    perm = np.random.default_rng(seed).permutation(n)
    weights = np.asarray(shares, dtype=np.float64)
    bounds = np.round(np.cumsum(weights / weights.sum()) * n).astype(int)
    bounds[-1] = n
    starts = np.concatenate([[0], bounds[:-1]])
    return [np.sort(perm[s:e]) for s, e in zip(starts, bounds, strict=True)]


def train_eval_split(n: int, eval_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, eval) indices; eval holds ``ceil(n * eval_fraction)`` rows (at least one when n >= 2)."""
    if n == 0:
        return np.arange(0), np.arange(0)
    n_eval = min(max(1, int(np.ceil(n * eval_fraction))), n - 1) if n >= 2 else 0
    perm = np.random.default_rng(seed).permutation(n)
    return np.sort(perm[n_eval:]), np.sort(perm[:n_eval])
