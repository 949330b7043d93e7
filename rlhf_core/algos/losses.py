"""Losses and per-token quantities from logits: clipped PPO policy/value losses, pairwise reward-model losses
(sequence and DeepSpeed-Chat's per-token divergence; DPO's implicit reward), the SFT token NLL, log-probabilities
and entropy.

Losses return ``(loss, stats)``: ``loss`` is a differentiable 0-dim tensor and ``stats`` a dict of detached
0-dim tensors (no host synchronisation; call ``.item()`` when logging).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlhf_core.algos.masking import as_bool_mask, masked_mean

__all__ = [
    "IGNORE_INDEX",
    "divergence_rm_loss",
    "entropy_from_logits",
    "implicit_reward",
    "logprobs_from_logits",
    "pairwise_rm_loss",
    "policy_loss",
    "response_logprob_sums",
    "token_nll",
    "value_loss",
]

IGNORE_INDEX = -100  # label of positions that carry no loss (PyTorch's cross-entropy default)

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _zero_outside(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return torch.where(m, x, torch.zeros((), dtype=x.dtype, device=x.device))


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float,
    dual_clip: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate loss (Schulman et al., 2017), token-level mean over valid positions.

    With ``ratio = exp(logp - old_logp)``::

        loss_t = max(-A_t * ratio, -A_t * clamp(ratio, 1 - clip_eps, 1 + clip_eps))
        loss   = masked_mean(loss_t, mask)            # every valid token of the batch weighs the same

    Dual clip (Ye et al., 2020), ``dual_clip = c > 1``: where ``A_t < 0`` the token loss is capped,
    ``loss_t = min(loss_t, -A_t * c)``, bounding the loss of very large ratios on negative advantages.

    ``stats``:

    * ``clipfrac``: masked share of tokens where the clipped term is strictly larger than the unclipped one
      (the clipped branch was taken and the token gets no gradient);
    * ``dual_clipfrac``: masked share of tokens where the dual-clip cap bound (0 without ``dual_clip``);
    * ``approx_kl``: ``masked_mean(0.5 * (logp - old_logp)^2)``, the k2 estimator of ``KL(old || new)``;
    * ``ratio_mean``: masked mean of ``ratio``.

    ``old_logp`` and ``advantages`` are treated as constants (detached).
    """
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    m = as_bool_mask(mask)
    # Zero the log-ratio and advantage on padding first, so -inf/NaN there cannot reach the loss or the gradient.
    log_ratio = _zero_outside(logp - old_logp.detach(), m)
    adv = _zero_outside(advantages.detach().to(log_ratio.dtype), m)
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps)
    token_loss = torch.maximum(unclipped, clipped)
    if dual_clip is not None:
        cap = -adv * dual_clip
        dual_bound = (adv < 0) & (token_loss > cap)
        token_loss = torch.where(dual_bound, cap, token_loss)
    else:
        dual_bound = torch.zeros_like(m)
    loss = masked_mean(token_loss, m)
    with torch.no_grad():
        stats = {
            "clipfrac": masked_mean((clipped > unclipped).to(ratio.dtype), m),
            "dual_clipfrac": masked_mean(dual_bound.to(ratio.dtype), m),
            "approx_kl": masked_mean(0.5 * log_ratio**2, m),
            "ratio_mean": masked_mean(ratio, m),
        }
    return loss, stats


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss: ``0.5 * masked_mean(max((V - R)^2, (V_clip - R)^2))``.

    ``V_clip = clamp(V, V_old - clip_eps, V_old + clip_eps)``; with ``clip_eps=None`` the plain
    ``0.5 * masked_mean((V - R)^2)``. ``stats``: ``vf_clipfrac`` (masked share of tokens where the clipped
    error is strictly larger, i.e. the clipped branch was taken) and ``vpred_mean`` (masked mean of ``V``).
    ``old_values`` and ``returns`` are treated as constants (detached).
    """
    m = as_bool_mask(mask)
    v = _zero_outside(values, m)
    old_v = _zero_outside(old_values.detach().to(v.dtype), m)
    ret = _zero_outside(returns.detach().to(v.dtype), m)
    unclipped = (v - ret) ** 2
    if clip_eps is None:
        per_token, clipped_taken = unclipped, torch.zeros_like(m)
    else:
        v_clipped = old_v + (v - old_v).clamp(-clip_eps, clip_eps)
        clipped = (v_clipped - ret) ** 2
        per_token, clipped_taken = torch.maximum(unclipped, clipped), clipped > unclipped
    loss = 0.5 * masked_mean(per_token, m)
    with torch.no_grad():
        stats = {
            "vf_clipfrac": masked_mean(clipped_taken.to(v.dtype), m),
            "vpred_mean": masked_mean(v, m),
        }
    return loss, stats


# float32 elements a half-precision log-prob pass holds at once (64 MiB): rows of the logits go through in chunks
LOGPROB_CHUNK_ELEMENTS = 2**24


class _GatherLogProb(torch.autograd.Function):
    """``logits[labels] - logsumexp(logits)`` in float32 for half-precision logits, in chunks of rows.

    Saves only the (already existing) logits, the labels and the ``[..]`` float32 logsumexp, never a float32
    copy of the logits: the float32 reduction (forward) and the softmax (backward) are taken
    ``LOGPROB_CHUNK_ELEMENTS // V`` rows at a time, so the extra memory is one chunk, not ``[B, T, V]`` in float32.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        V = logits.shape[-1]
        rows = max(1, LOGPROB_CHUNK_ELEMENTS // V)
        lse = torch.cat([torch.logsumexp(c.float(), dim=-1) for c in logits.reshape(-1, V).split(rows)])
        lse = lse.view(logits.shape[:-1])
        ctx.save_for_backward(logits, labels, lse)
        return logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1).float() - lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        """``d/dz_v = g * (1[v = label] - softmax(z)_v)``, a chunk of rows at a time, written in the logits' dtype."""
        logits, labels, lse = ctx.saved_tensors
        V = logits.shape[-1]
        rows = max(1, LOGPROB_CHUNK_ELEMENTS // V)
        out = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        chunks = zip(logits.reshape(-1, V).split(rows), labels.reshape(-1).split(rows), lse.reshape(-1).split(rows),
                     grad.reshape(-1).split(rows), out.view(-1, V).split(rows), strict=True)
        for z, y, c, g, o in chunks:
            g_z = -g[:, None] * torch.exp(z.float() - c[:, None])
            g_z.scatter_add_(-1, y[:, None], g[:, None])
            o.copy_(g_z)
        return out, None


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits)[..., labels]``: ``[B, T, V], [B, T] -> [B, T]``.

    Computed as ``logits.gather(labels) - logsumexp(logits)``, so the full ``[B, T, V]`` log-softmax is never
    kept. Half-precision (fp16/bf16) logits are reduced in float32 and give float32 log-probs (a bf16
    logsumexp would be off by up to ~0.03 nats); other dtypes are kept.
    """
    labels = labels.long()
    if logits.dtype in _LOW_PRECISION:
        return _GatherLogProb.apply(logits, labels)
    return logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of ``softmax(logits)`` over the last dim: ``H = logsumexp(z) - sum_v softmax(z)_v * z_v``.

    ``[B, T, V] -> [B, T]``; fp16/bf16 logits are computed in float32 and give float32. ``-inf`` logits
    (masked vocabulary entries) contribute 0, not ``NaN``. Where no gradient is taken (the usual case: an
    entropy that is only logged), rows go through ``LOGPROB_CHUNK_ELEMENTS // V`` at a time, so the float32
    copy, the softmax and its product are one chunk each, not ``[B, T, V]``: the same values (per-row ops).
    """
    if torch.is_grad_enabled() and logits.requires_grad:
        return _entropy(logits)
    V = logits.shape[-1]
    rows = max(1, LOGPROB_CHUNK_ELEMENTS // V)
    return torch.cat([_entropy(c) for c in logits.reshape(-1, V).split(rows)]).view(logits.shape[:-1])


def _entropy(logits: torch.Tensor) -> torch.Tensor:
    z = logits.float() if logits.dtype in _LOW_PRECISION else logits
    probs = torch.softmax(z, dim=-1)
    z_finite = torch.where(probs > 0, z, torch.zeros((), dtype=z.dtype, device=z.device))
    return torch.logsumexp(z, dim=-1) - (probs * z_finite).sum(dim=-1)


def pairwise_rm_loss(
    chosen_scores: torch.Tensor, rejected_scores: torch.Tensor, margin: float | torch.Tensor = 0.0
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Bradley-Terry reward-model loss: ``mean(-logsigmoid(r_chosen - r_rejected - margin))``.

    ``margin`` is a float or a per-pair tensor (Llama 2 style). ``stats``: ``accuracy`` (share of pairs with
    ``r_chosen > r_rejected``), ``chosen_mean``, ``rejected_mean`` and ``margin_mean`` (mean of
    ``r_chosen - r_rejected``).
    """
    diff = chosen_scores - rejected_scores
    loss = -F.logsigmoid(diff - margin).mean()
    with torch.no_grad():
        stats = {
            "accuracy": (chosen_scores > rejected_scores).to(diff.dtype).mean(),
            "chosen_mean": chosen_scores.mean(),
            "rejected_mean": rejected_scores.mean(),
            "margin_mean": diff.mean(),
        }
    return loss, stats


def implicit_reward(logp: torch.Tensor, ref_logp: torch.Tensor, beta: float) -> torch.Tensor:
    """DPO's implicit reward (Rafailov et al., 2023) of a response: ``r = beta * (log pi(y|x) - log pi_ref(y|x))``,
    from the summed response log-probs under the policy and the reference. DPO's loss is
    :func:`pairwise_rm_loss` on these rewards: ``-log sigmoid(r_chosen - r_rejected)``."""
    return beta * (logp - ref_logp)


def rpo_loss(
    chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor, chosen_logp: torch.Tensor,
    chosen_tokens: torch.Tensor, alpha: float, margin: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPO's loss on the implicit rewards plus the chosen responses' negative log-likelihood per token (RPO: Pang et
    al. 2024, "Iterative Reasoning Preference Optimization"; TRL's ``rpo_alpha``)::

        L = mean_i -log sigmoid(r_c,i - r_r,i - margin) + alpha * sum_i -log pi(y_c,i|x_i) / sum_i |y_c,i|

    ``chosen_logp``: each chosen response's summed log-prob under the policy, ``chosen_tokens`` its token count.
    DPO alone lowers the chosen answers' likelihood along with the rejected ones'; the NLL term holds it up.
    ``stats``: :func:`pairwise_rm_loss`'s and ``nll``."""
    dpo, stats = pairwise_rm_loss(chosen_rewards, rejected_rewards, margin)
    nll = -chosen_logp.sum() / chosen_tokens.sum().clamp(min=1)
    return dpo + alpha * nll, stats | {"nll": nll.detach()}


def response_logprob_sums(logits: torch.Tensor, input_ids: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """``log pi(y|x)`` per row: the log-probs of the response tokens (``response_mask``, ``[B, T]`` over
    ``input_ids``) summed, the logits at ``t`` scoring token ``t + 1``. ``[B]``."""
    logp = logprobs_from_logits(logits[:, :-1], input_ids[:, 1:])
    return (logp * as_bool_mask(response_mask)[:, 1:]).sum(dim=-1)


# --------------------------------------------------------------------------- SFT and reward-model losses
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
