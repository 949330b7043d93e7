"""KL estimators, KL-penalised token rewards, and KL-coefficient controllers.

``logp`` / ``ref_logp`` are per-token log-probabilities ``[B, T]`` of the sampled tokens under the policy
and the frozen reference model; the estimators follow Schulman, "Approximating KL Divergence" (2020),
with ``r = ref_logp - logp`` (log of ``p_ref / p_policy``) for tokens sampled from the policy.
"""

from __future__ import annotations

from typing import Any

import torch

from rlhf_core.algos.masking import as_bool_mask, last_valid_index

__all__ = [
    "KL_ESTIMATORS",
    "AdaptiveKLController",
    "FixedKLController",
    "kl_estimate",
    "kl_penalized_rewards",
]

KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k1") -> torch.Tensor:
    """Per-token estimate of ``KL(policy || ref)``, same shape as the inputs.

    * ``k1 = logp - ref_logp`` (unbiased, can be negative per token);
    * ``k2 = 0.5 * (logp - ref_logp)^2`` (biased, non-negative);
    * ``k3 = exp(ref_logp - logp) - (ref_logp - logp) - 1`` (unbiased, non-negative).

    An unknown ``kind`` raises :class:`ValueError`.
    """
    log_ratio = logp - ref_logp
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio**2
    if kind == "k3":
        r = -log_ratio
        return torch.expm1(r) - r  # exp(r) - r - 1, accurate for small r
    raise ValueError(f"unknown KL estimator kind {kind!r}; expected one of {', '.join(KL_ESTIMATORS)}")


def kl_penalized_rewards(
    scores: torch.Tensor,
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: float | torch.Tensor,
    clip: float | None = None,
    kind: str = "k1",
) -> torch.Tensor:
    """Token-level rewards ``[B, T]`` for PPO: a per-token KL penalty plus the sequence score at the end.

    ``rewards[b, t] = -kl_coef * kl_estimate(logp, ref_logp, kind)[b, t]`` on valid positions, and
    ``clamp(scores[b], -clip, clip)`` (unclamped when ``clip`` is None) is added at the last valid position
    of row ``b`` (see :func:`~rlhf_core.algos.masking.last_valid_index`). Positions where ``mask`` is 0 are 0;
    a row with no valid position gets no reward at all. ``scores`` is ``[B]``.
    """
    if clip is not None:
        if clip < 0:
            raise ValueError(f"clip must be non-negative, got {clip}")
        scores = scores.clamp(-clip, clip)
    m = as_bool_mask(mask)
    kl = kl_estimate(logp, ref_logp, kind)
    rewards = torch.where(m, -kl_coef * kl, torch.zeros((), dtype=kl.dtype, device=kl.device))
    positions = torch.arange(m.shape[-1], device=m.device)
    is_last = positions == last_valid_index(m).unsqueeze(-1)  # all False for an empty row
    return rewards + is_last.to(rewards.dtype) * scores.to(rewards.dtype).unsqueeze(-1)


class FixedKLController:
    """A constant KL coefficient; :meth:`update` is a no-op."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float | torch.Tensor, n_steps: int) -> None:
        """No-op (kept so both controllers share one interface)."""

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])

    def __repr__(self) -> str:
        return f"FixedKLController(value={self.value})"


class AdaptiveKLController:
    """Adaptive KL coefficient of Ziegler et al., "Fine-Tuning Language Models from Human Preferences" (2019).

    On each :meth:`update`::

        proportional_error = clip(current_kl / target - 1, -0.2, 0.2)
        mult = 1 + proportional_error * n_steps / horizon
        value = value * mult
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: float) -> None:
        if target <= 0:
            raise ValueError(f"target KL must be positive, got {target}")
        if horizon <= 0:
            raise ValueError(f"horizon must be positive, got {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float | torch.Tensor, n_steps: int) -> None:
        """Move ``value`` towards keeping the measured KL at ``target`` (``n_steps``: samples since last update)."""
        proportional_error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])
        self.target = float(state.get("target", self.target))
        self.horizon = float(state.get("horizon", self.horizon))

    def __repr__(self) -> str:
        return f"AdaptiveKLController(value={self.value}, target={self.target}, horizon={self.horizon})"
