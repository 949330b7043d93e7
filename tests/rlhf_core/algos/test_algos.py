"""rlhf_core.algos against small hand-computed numbers (the arithmetic is written out in the comments)."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_core.algos import (
    AdaptiveKLController,
    FixedKLController,
    best_of_group,
    discounted_cumsum,
    entropy_from_logits,
    gae,
    gather_last,
    group_advantages,
    kl_estimate,
    kl_penalized_rewards,
    last_valid_index,
    logprobs_from_logits,
    masked_mean,
    masked_var,
    masked_whiten,
    pairwise_rm_loss,
    policy_loss,
    reinforce_pp_advantages,
    rloo_advantages,
    value_loss,
)

INF = float("inf")
MASK_DTYPES = [torch.float32, torch.bool, torch.long]


def t(data, dtype=torch.float64, **kw) -> torch.Tensor:
    return torch.tensor(data, dtype=dtype, **kw)


def close(actual, expected, atol=1e-6) -> None:
    expected = torch.as_tensor(expected, dtype=torch.float64)
    torch.testing.assert_close(torch.as_tensor(actual).double(), expected, atol=atol, rtol=1e-6)


# --------------------------------------------------------------------------------------------- masking


@pytest.mark.parametrize("mask_dtype", MASK_DTYPES)
def test_masked_mean_global_rowwise_and_empty_row(mask_dtype):
    x = t([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]])
    mask = t([[1, 1, 0, 0], [1, 1, 1, 0]], dtype=mask_dtype)
    close(masked_mean(x, mask), 4.2)  # (1 + 2 + 5 + 6 + 7) / 5 = 21 / 5
    close(masked_mean(x, mask, dim=-1), [1.5, 6.0])  # (1+2)/2, (5+6+7)/3
    close(masked_mean(x, mask, dim=0), [3.0, 4.0, 7.0, 0.0])  # (1+5)/2, (2+6)/2, 7/1, empty column -> 0
    empty = t([[0, 0, 0, 0], [1, 0, 0, 0]], dtype=mask_dtype)
    close(masked_mean(x, empty, dim=-1), [0.0, 5.0])  # empty row -> 0, not NaN
    close(masked_mean(x, torch.zeros_like(empty)), 0.0)


def test_masked_mean_ignores_inf_padding_and_has_finite_grad():
    x = t([[1.0, -INF], [INF, 3.0]], requires_grad=True)
    mask = t([[1, 0], [0, 0]])
    out = masked_mean(x, mask, dim=-1)
    close(out.detach(), [1.0, 0.0])
    out.sum().backward()
    close(x.grad, [[1.0, 0.0], [0.0, 0.0]])


def test_masked_var_unbiased_and_biased():
    x = t([[1.0, 2.0, 99.0], [5.0, 6.0, 7.0]])
    mask = t([[1, 1, 0], [1, 1, 1]])
    # valid 1, 2, 5, 6, 7: mean 4.2; deviations -3.2 -2.2 0.8 1.8 2.8
    # squares 10.24 + 4.84 + 0.64 + 3.24 + 7.84 = 26.8 -> unbiased 26.8 / 4 = 6.7, biased 26.8 / 5 = 5.36
    close(masked_var(x, mask), 6.7)
    close(masked_var(x, mask, unbiased=False), 5.36)
    # per row: row 0 {1, 2}: mean 1.5, squares 0.25 + 0.25 = 0.5 -> 0.5 / 1; row 1 {5, 6, 7}: 1 + 0 + 1 = 2 -> 2 / 2
    close(masked_var(x, mask, dim=-1), [0.5, 1.0])
    # a single valid entry: unbiased variance defined as 0 (not inf / NaN)
    close(masked_var(x, t([[0, 0, 0], [0, 1, 0]])), 0.0)


@pytest.mark.parametrize("mask_dtype", MASK_DTYPES)
def test_masked_whiten(mask_dtype):
    x = t([[1.0, 3.0, 99.0], [5.0, -7.0, 42.0]])
    mask = t([[1, 1, 0], [1, 0, 0]], dtype=mask_dtype)
    # valid 1, 3, 5: mean 3; deviations -2 0 2; unbiased var (4 + 0 + 4) / 2 = 4 -> std 2
    close(masked_whiten(x, mask), [[-1.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    # shift_mean=False adds the mean 3 back on valid positions; still 0 where the mask is 0
    close(masked_whiten(x, mask, shift_mean=False), [[2.0, 3.0, 0.0], [4.0, 0.0, 0.0]])


@pytest.mark.parametrize("mask_dtype", MASK_DTYPES)
def test_last_valid_index_and_gather_last(mask_dtype):
    mask = t([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0], [1, 0, 1, 0], [1, 0, 0, 0]], dtype=mask_dtype)
    idx = last_valid_index(mask)
    assert idx.dtype == torch.long
    assert idx.tolist() == [1, 3, -1, 2, 0]
    x = t([[10, 11, 12, 13], [20, 21, 22, 23], [30, 31, 32, 33], [40, 41, 42, 43], [50, 51, 52, 53]])
    close(gather_last(x, mask), [11.0, 23.0, 0.0, 42.0, 50.0])  # empty row -> 0


# -------------------------------------------------------------------------------------------------- KL


def test_kl_estimators_k1_k2_k3():
    logp = t([-1.0, -2.0])
    ref = t([-1.5, -1.0])
    # logp - ref = [0.5, -1.0]
    close(kl_estimate(logp, ref), [0.5, -1.0])  # k1 is the default
    close(kl_estimate(logp, ref, "k2"), [0.125, 0.5])  # 0.5 * 0.25, 0.5 * 1
    # k3 with r = ref - logp = [-0.5, 1.0]: exp(-0.5) + 0.5 - 1 = 0.6065306597 - 0.5; exp(1) - 1 - 1 = 0.7182818285
    close(kl_estimate(logp, ref, "k3"), [0.1065306597, 0.7182818285])
    close(kl_estimate(ref, ref, "k3"), [0.0, 0.0])


def test_kl_estimate_unknown_kind():
    with pytest.raises(ValueError, match="k4"):
        kl_estimate(t([0.0]), t([0.0]), kind="k4")


@pytest.mark.parametrize("mask_dtype", MASK_DTYPES)
def test_kl_penalized_rewards(mask_dtype):
    ref = t([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
    # logp - ref: row 0 [0.2, -0.1, pad], row 1 [0.3, pad, pad] (pads carry garbage, even -inf)
    logp = t([[-0.8, -1.1, -INF], [-0.7, 5.0, -INF]])
    mask = t([[1, 1, 0], [1, 0, 0]], dtype=mask_dtype)
    scores = t([2.0, -3.0])
    rewards = kl_penalized_rewards(scores, logp, ref, mask, kl_coef=0.5, clip=1.5)
    # row 0: -0.5 * 0.2 = -0.1; -0.5 * -0.1 = 0.05, plus clamp(2, -1.5, 1.5) = 1.5 at the last valid token -> 1.55
    # row 1 (single token): -0.5 * 0.3 + clamp(-3) = -0.15 - 1.5 = -1.65
    close(rewards, [[-0.1, 1.55, 0.0], [-1.65, 0.0, 0.0]])
    # no clip: 0.05 + 2 = 2.05; -0.15 - 3 = -3.15
    close(kl_penalized_rewards(scores, logp, ref, mask, 0.5), [[-0.1, 2.05, 0.0], [-3.15, 0.0, 0.0]])
    # k2: 0.5 * 0.2^2 = 0.02 -> -0.01; 0.5 * 0.1^2 = 0.005 -> -0.0025 + 1.5; 0.5 * 0.3^2 = 0.045 -> -0.0225 - 1.5
    k2 = kl_penalized_rewards(scores, logp, ref, mask, 0.5, clip=1.5, kind="k2")
    close(k2, [[-0.01, 1.4975, 0.0], [-1.5225, 0.0, 0.0]])


def test_kl_penalized_rewards_empty_row_gets_nothing():
    z = torch.zeros(2, 2, dtype=torch.float64)
    out = kl_penalized_rewards(t([1.0, 4.0]), z, z, t([[0, 1], [0, 0]]), kl_coef=0.1)
    close(out, [[0.0, 1.0], [0.0, 0.0]])


def test_fixed_kl_controller():
    ctl = FixedKLController(0.05)
    ctl.update(100.0, 512)
    assert ctl.value == 0.05
    other = FixedKLController(1.0)
    other.load_state_dict(ctl.state_dict())
    assert other.value == 0.05


def test_adaptive_kl_controller_update_arithmetic_and_state():
    ctl = AdaptiveKLController(init_kl_coef=0.1, target=6.0, horizon=10000)
    # KL 9: 9 / 6 - 1 = 0.5, clipped to 0.2; mult = 1 + 0.2 * 256 / 10000 = 1.00512 -> 0.100512
    ctl.update(torch.tensor(9.0), n_steps=256)
    assert ctl.value == pytest.approx(0.100512, rel=1e-12)
    # KL 5.4: 5.4 / 6 - 1 = -0.1 (inside the clip); mult = 1 - 0.1 * 500 / 10000 = 0.995 -> 0.100512 * 0.995
    ctl.update(5.4, n_steps=500)
    assert ctl.value == pytest.approx(0.10000944, rel=1e-12)
    state = ctl.state_dict()
    # KL 0: error -1 clipped to -0.2; mult = 1 - 0.2 * 10000 / 10000 = 0.8
    ctl.update(0.0, n_steps=10000)
    assert ctl.value == pytest.approx(0.080007552, rel=1e-12)
    restored = AdaptiveKLController(init_kl_coef=1.0, target=1.0, horizon=1)
    restored.load_state_dict(state)
    assert (restored.value, restored.target, restored.horizon) == (pytest.approx(0.10000944), 6.0, 10000.0)


# ------------------------------------------------------------------------------------------ advantages


@pytest.mark.parametrize("mask_dtype", MASK_DTYPES)
def test_gae_two_ragged_rows(mask_dtype):
    gamma, lam = 0.9, 0.8  # gamma * lam = 0.72
    values = t([[1.0, 0.5, 2.0, 9.0], [2.0, -1.0, 5.0, 5.0]])
    rewards = t([[0.0, 1.0, 3.0, 7.0], [0.5, 2.0, 4.0, 4.0]])
    mask = t([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=mask_dtype)
    adv, ret = gae(values, rewards, mask, gamma, lam)
    # row 0 (3 valid; V after the last valid token counts as 0):
    #   t=2: delta = 3 + 0.9*0 - 2 = 1.0;                 A = 1.0
    #   t=1: delta = 1 + 0.9*2 - 0.5 = 2.3;               A = 2.3 + 0.72*1.0 = 3.02
    #   t=0: delta = 0 + 0.9*0.5 - 1 = -0.55;             A = -0.55 + 0.72*3.02 = -0.55 + 2.1744 = 1.6244
    # row 1 (2 valid):
    #   t=1: delta = 2 + 0.9*0 - (-1) = 3.0;              A = 3.0
    #   t=0: delta = 0.5 + 0.9*(-1) - 2 = -2.4;           A = -2.4 + 0.72*3.0 = -0.24
    close(adv, [[1.6244, 3.02, 1.0, 0.0], [-0.24, 3.0, 0.0, 0.0]])
    # returns = A + V: 1.6244 + 1 = 2.6244, 3.02 + 0.5 = 3.52, 1 + 2 = 3; -0.24 + 2 = 1.76, 3 - 1 = 2
    close(ret, [[2.6244, 3.52, 3.0, 0.0], [1.76, 2.0, 0.0, 0.0]])


def test_gae_single_token_row_and_detached():
    values = t([[0.5, 3.0]], requires_grad=True)
    adv, ret = gae(values, t([[2.0, 8.0]]), t([[1, 0]]), gamma=0.9, lam=0.8)
    # delta = 2 + 0.9*0 - 0.5 = 1.5 = A; R = 1.5 + 0.5 = 2.0
    close(adv, [[1.5, 0.0]])
    close(ret, [[2.0, 0.0]])
    assert not adv.requires_grad and not ret.requires_grad


def test_gae_long_sequences_closed_form():
    # Longer than one 64-step block, so the blocked discount path is exercised.
    T = 150
    rewards = torch.zeros(2, T, dtype=torch.float64)
    mask = torch.zeros(2, T)
    mask[0, :130] = 1
    mask[1, :70] = 1
    rewards[0, :130] = 1.0
    rewards[1, 69] = 1.0
    values = torch.zeros(2, T, dtype=torch.float64)
    # row 0, gamma = lam = 1, V = 0: A_t = number of remaining rewards = 130 - t
    adv, _ = gae(values, rewards, mask, gamma=1.0, lam=1.0)
    close(adv[0, :130], torch.arange(130, 0, -1))
    # row 1, gamma = 0.9, lam = 0.8, one reward of 1 at t=69, V = 0: A_t = 0.72 ** (69 - t)
    adv, _ = gae(values, rewards, mask, gamma=0.9, lam=0.8)
    close(adv[1, :70], [0.72 ** (69 - i) for i in range(70)], atol=1e-12)
    assert adv[:, 130:].abs().sum() == 0 and adv[1, 70:].abs().sum() == 0


@pytest.mark.parametrize("n", [1, 7, 64, 65, 200, 4100])
def test_discounted_cumsum_matches_backward_recursion(n):
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(3, n, generator=gen, dtype=torch.float64)
    for discount in (0.0, 0.72, 1.0):
        expected = torch.zeros_like(x)
        running = torch.zeros(3, dtype=torch.float64)
        for i in reversed(range(n)):  # y_i = x_i + discount * y_{i+1}
            running = x[:, i] + discount * running
            expected[:, i] = running
        torch.testing.assert_close(discounted_cumsum(x, discount), expected, atol=1e-9, rtol=1e-9)
    assert discounted_cumsum(x.float(), 0.5).dtype == torch.float32


def test_group_advantages_unbiased_std():
    scores = t([1.0, 2.0, 3.0, 0.0, 0.0, 6.0])
    # group [1, 2, 3]: mean 2, squares 1 + 0 + 1 = 2, unbiased var 2 / 2 = 1, std 1 -> [-1, 0, 1] / (1 + 1e-4)
    # group [0, 0, 6]: mean 2, squares 4 + 4 + 16 = 24, var 24 / 2 = 12, std 3.4641016 -> [-2, -2, 4] / 3.4642016
    expected = [-0.99990001, 0.0, 0.99990001, -0.5773336030, -0.5773336030, 1.1546672060]
    close(group_advantages(scores, group_size=3), expected)
    # scale="none": centre only
    close(group_advantages(scores, 3, scale="none"), [-1.0, 0.0, 1.0, -2.0, -2.0, 4.0])
    # scale="batch": std of all six scores: mean 2, squares 1+0+1+4+4+16 = 26, 26 / 5 = 5.2, std 2.2803509
    close(group_advantages(scores, 3, scale="batch"), [d / (math.sqrt(5.2) + 1e-4) for d in (-1, 0, 1, -2, -2, 4)])
    # identical scores: std 0 -> advantages 0 (0 / eps), not NaN
    close(group_advantages(t([5.0, 5.0, 5.0, 5.0]), 2), [0.0, 0.0, 0.0, 0.0])


def test_group_advantages_bad_group_size():
    with pytest.raises(ValueError, match=r"group_size=4.*6"):
        group_advantages(torch.zeros(6), group_size=4)
    with pytest.raises(ValueError, match="scale"):
        group_advantages(torch.zeros(6), group_size=3, scale="bogus")


def test_best_of_group_one_hot_first_max():
    """Groups (0.1, 0.7, 0.3), (2, 2, -1), (-5, -4, -6): the picks are 0.7, the first of the tied 2s, and -4."""
    picks = best_of_group(t([0.1, 0.7, 0.3, 2.0, 2.0, -1.0, -5.0, -4.0, -6.0]), group_size=3)
    assert picks.tolist() == [0.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0]
    with pytest.raises(ValueError):
        best_of_group(torch.zeros(6), group_size=4)


def test_rloo_advantages():
    scores = t([1.0, 2.0, 3.0, 0.0, 0.0, 6.0])
    # group 0: 1 - (2+3)/2 = -1.5; 2 - (1+3)/2 = 0; 3 - (1+2)/2 = 1.5
    # group 1: 0 - (0+6)/2 = -3;   0 - (0+6)/2 = -3; 6 - (0+0)/2 = 6
    close(rloo_advantages(scores, 3), [-1.5, 0.0, 1.5, -3.0, -3.0, 6.0])
    with pytest.raises(ValueError, match="group_size"):
        rloo_advantages(scores, 4)
    with pytest.raises(ValueError, match="group_size"):
        rloo_advantages(scores, 1)


def test_reinforce_pp_advantages():
    rewards = t([[0.0, 0.0, 1.0], [0.0, 2.0, 9.0]])
    mask = t([[1, 1, 1], [1, 1, 0]])
    # return-to-go with gamma 0.5: row 0: G2 = 1, G1 = 0 + 0.5*1 = 0.5, G0 = 0.25; row 1: G1 = 2, G0 = 1 (pad 9 ignored)
    # valid G: 0.25 0.5 1 1 2 -> mean 0.95; deviations -0.7 -0.45 0.05 1.05 0.05
    # squares 0.49 + 0.2025 + 0.0025 + 1.1025 + 0.0025 = 1.8 -> unbiased var 0.45, std 0.6708204
    adv = reinforce_pp_advantages(rewards, mask, gamma=0.5)
    close(adv, [[-1.0434983779, -0.6708203858, 0.0745355984], [0.0745355984, 1.5652475669, 0.0]])


# ---------------------------------------------------------------------------------------------- losses


def _policy_case():
    # old_logp = 0, so ratio = exp(logp); one padded position with garbage (-inf logp, huge advantage)
    logp = t([[math.log(1.5), math.log(0.5), math.log(0.5), -INF], [math.log(1.1), 0.0, 0.0, 0.0]])
    adv = t([[1.0, 1.0, -2.0, 100.0], [-1.0, 0.0, 0.0, 0.0]])
    mask = t([[1, 1, 1, 0], [1, 0, 0, 0]])
    return logp, torch.zeros_like(logp), adv, mask


def test_policy_loss_clip_and_stats():
    logp, old, adv, mask = _policy_case()
    loss, stats = policy_loss(logp, old, adv, mask, clip_eps=0.2)
    # ratio 1.5, A  1: max(-1.5, -1.2) = -1.2  (clipped)
    # ratio 0.5, A  1: max(-0.5, -0.8) = -0.5
    # ratio 0.5, A -2: max( 1.0,  1.6) =  1.6  (clipped)
    # ratio 1.1, A -1: max( 1.1,  1.1) =  1.1  (equal: not clipped)
    # loss = (-1.2 - 0.5 + 1.6 + 1.1) / 4 = 0.25, clipfrac = 2 / 4
    close(loss, 0.25)
    close(stats["clipfrac"], 0.5)
    # approx_kl = 0.5 * (ln(1.5)^2 + 2 ln(0.5)^2 + ln(1.1)^2) / 4 = 0.5 * (0.1644019 + 0.9609060 + 0.0090840) / 4
    close(stats["approx_kl"], 0.1417990015)
    close(stats["dual_clipfrac"], 0.0)
    assert all(not v.requires_grad for v in stats.values())


def test_policy_loss_gradient_flows():
    logp, old, adv, mask = _policy_case()
    logp.requires_grad_(True)
    loss, _ = policy_loss(logp, old, adv, mask, clip_eps=0.2)
    loss.backward()
    # d loss / d logp_t = d(-A ratio)/d logp / 4 = -A * ratio / 4 on unclipped tokens, 0 on clipped ones and pads:
    # token 1: -1 * 0.5 / 4 = -0.125; row 1: 1 * 1.1 / 4 = 0.275
    close(logp.grad, [[0.0, -0.125, 0.0, 0.0], [0.275, 0.0, 0.0, 0.0]])


def test_policy_loss_dual_clip_binds():
    logp = t([[math.log(5.0), math.log(2.0), math.log(5.0)]], requires_grad=True)
    old = torch.zeros(1, 3, dtype=torch.float64)
    adv = t([[-1.0, -1.0, 1.0]])
    mask = torch.ones(1, 3)
    # ratio 5, A -1: max(5, 1.2) = 5 -> dual cap min(5, 3 * 1) = 3 (binds)
    # ratio 2, A -1: max(2, 1.2) = 2 -> below the cap 3
    # ratio 5, A  1: max(-5, -1.2) = -1.2 (clipped; dual clip only applies to A < 0)
    plain, plain_stats = policy_loss(logp, old, adv, mask, clip_eps=0.2)
    close(plain, (5.0 + 2.0 - 1.2) / 3)  # 1.9333
    close(plain_stats["clipfrac"], 1 / 3)
    loss, stats = policy_loss(logp, old, adv, mask, clip_eps=0.2, dual_clip=3.0)
    close(loss, (3.0 + 2.0 - 1.2) / 3)  # 1.2667
    close(stats["dual_clipfrac"], 1 / 3)
    loss.backward()
    # capped token and clipped token: no gradient; ratio-2 token: -A * ratio / 3 = 2 / 3
    close(logp.grad, [[0.0, 2.0 / 3.0, 0.0]])
    with pytest.raises(ValueError, match="dual_clip"):
        policy_loss(logp, old, adv, mask, clip_eps=0.2, dual_clip=1.0)


def _value_case():
    values = t([[1.0, 1.0, 0.0, 50.0], [3.0, 0.0, 0.0, 0.0]], requires_grad=True)
    old = t([[0.5, 0.9, 1.0, -50.0], [3.0, 0.0, 0.0, 0.0]])
    returns = t([[2.0, 0.0, 1.0, INF], [1.0, 0.0, 0.0, 0.0]])
    mask = t([[1, 1, 1, 0], [1, 0, 0, 0]])
    return values, old, returns, mask


def test_value_loss_clip_and_stats():
    values, old, returns, mask = _value_case()
    loss, stats = value_loss(values, old, returns, mask, clip_eps=0.2)
    # V 1,   old 0.5, R 2: V_clip 0.7; max((1-2)^2, (0.7-2)^2) = max(1, 1.69) = 1.69   (clipped branch)
    # V 1,   old 0.9, R 0: V_clip 1.0; max(1, 1) = 1
    # V 0,   old 1.0, R 1: V_clip 0.8; max(1, 0.04) = 1                               (unclipped branch)
    # V 3,   old 3,   R 1: max(4, 4) = 4
    # loss = 0.5 * (1.69 + 1 + 1 + 4) / 4 = 0.96125; vf_clipfrac = 1 / 4
    close(loss, 0.96125)
    close(stats["vf_clipfrac"], 0.25)
    # no clipping: 0.5 * (1 + 1 + 1 + 4) / 4 = 0.875
    close(value_loss(values, old, returns, mask, clip_eps=None)[0], 0.875)


def test_value_loss_gradient_flows():
    values, old, returns, mask = _value_case()
    loss, _ = value_loss(values, old, returns, mask, clip_eps=0.2)
    loss.backward()
    # d/dV 0.5 * (V - R)^2 / 4 = (V - R) / 4 on unclipped tokens; the clipped token (V_clip saturated) gets 0:
    # (1 - 0) / 4 = 0.25; (0 - 1) / 4 = -0.25; (3 - 1) / 4 = 0.5
    close(values.grad, [[0.0, 0.25, -0.25, 0.0], [0.5, 0.0, 0.0, 0.0]])


def test_logprobs_and_entropy_from_logits():
    ln2 = math.log(2.0)
    # [B=2, T=2, V=4]
    logits = t(
        [
            [[0.0, 0.0, ln2, -INF], [1.0, 1.0, 1.0, 1.0]],
            [[100.0, 100.0, 100.0 + ln2, -INF], [0.0, -INF, -INF, -INF]],
        ]
    )
    labels = torch.tensor([[2, 3], [0, 0]])
    # softmax [1/4, 1/4, 1/2, 0]: log p(2) = ln(1/2); uniform over 4: ln(1/4); shift-invariant; one-hot: ln 1 = 0
    close(logprobs_from_logits(logits, labels), [[-ln2, -math.log(4.0)], [-2 * ln2, 0.0]])
    # H([1/4, 1/4, 1/2]) = 2 * (1/4) ln 4 + (1/2) ln 2 = 1.5 ln 2; uniform: ln 4; one-hot: 0 (-inf logits give no NaN)
    close(entropy_from_logits(logits), [[1.5 * ln2, math.log(4.0)], [1.5 * ln2, 0.0]])


def test_logprobs_from_logits_low_precision_is_float32_with_grad():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 17, generator=gen).bfloat16().requires_grad_(True)
    labels = torch.randint(0, 17, (2, 3), generator=gen)
    out = logprobs_from_logits(logits, labels)
    assert out.dtype == torch.float32
    # cross-check against log_softmax of the same (bf16-rounded) logits in float64
    ref_logits = logits.detach().double().requires_grad_(True)
    ref = torch.log_softmax(ref_logits, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(out.double(), ref.detach(), atol=1e-5, rtol=1e-5)
    out.sum().backward()
    ref.sum().backward()
    assert logits.grad.dtype == torch.bfloat16
    torch.testing.assert_close(logits.grad.double(), ref_logits.grad, atol=1e-2, rtol=1e-2)


def test_dpo_is_the_pairwise_loss_on_implicit_rewards():
    """Two tokens of vocab 2 with uniform logits score log(1/2) each: a 2-token response sums to -2 ln 2."""
    from rlhf_core.algos import implicit_reward, response_logprob_sums

    ids = torch.tensor([[0, 1, 1], [0, 0, 1]])
    logits = torch.zeros(2, 3, 2, dtype=torch.float64)
    logits[1, 0] = torch.tensor([0.0, math.log(3.0)])  # row 1, position 0 scores token 0 at 1/4
    response = torch.tensor([[0, 1, 1], [0, 1, 1]])
    logp = response_logprob_sums(logits, ids, response)
    close(logp, [2 * math.log(0.5), math.log(0.25) + math.log(0.5)])
    r = implicit_reward(logp, torch.tensor([math.log(0.25), math.log(0.25)], dtype=torch.float64), beta=0.5)
    close(r, [0.5 * (2 * math.log(0.5) - math.log(0.25)), 0.5 * (math.log(0.125) - math.log(0.25))])  # 0, -ln2/2
    loss, stats = pairwise_rm_loss(r[:1], r[1:])  # chosen 0, rejected -ln 2 / 2: -logsigmoid(ln 2 / 2)
    close(loss, math.log1p(math.exp(-math.log(2.0) / 2)))
    close(stats["accuracy"], 1.0)


def test_rpo_adds_the_chosen_answers_nll_per_token_to_dpo():
    """Chosen rewards 0 and 1 against rejected 0: DPO = [ln 2 + ln(1 + e^-1)] / 2; the chosen answers sum to
    -2 and -4 nats over 2 and 3 tokens: NLL per token 6 / 5 = 1.2, weighted by alpha 0.5."""
    from rlhf_core.algos import rpo_loss

    chosen, rejected = torch.tensor([0.0, 1.0], dtype=torch.float64), torch.zeros(2, dtype=torch.float64)
    logp, tokens = torch.tensor([-2.0, -4.0], dtype=torch.float64), torch.tensor([2, 3])
    dpo = (math.log(2.0) + math.log1p(math.exp(-1.0))) / 2
    loss, stats = rpo_loss(chosen, rejected, logp, tokens, alpha=0.5)
    close(loss, dpo + 0.5 * 1.2)
    close(stats["nll"], 1.2)
    close(stats["accuracy"], 0.5)  # a tie is not a win
    close(rpo_loss(chosen, rejected, logp, tokens, alpha=0.0)[0], dpo)
    close(rpo_loss(chosen, rejected, logp, tokens, alpha=1.0, margin=1.0)[0],
          (math.log1p(math.exp(1.0)) + math.log(2.0)) / 2 + 1.2)


def test_pairwise_rm_loss():
    chosen = t([2.0, 0.0], requires_grad=True)
    rejected = t([1.0, 1.0])
    loss, stats = pairwise_rm_loss(chosen, rejected)
    # diffs [1, -1]: -logsigmoid(1) = ln(1 + e^-1) = 0.3132617, -logsigmoid(-1) = ln(1 + e) = 1.3132617; mean 0.8132617
    close(loss, 0.8132616875)
    close(stats["accuracy"], 0.5)
    close(stats["chosen_mean"], 1.0)
    close(stats["rejected_mean"], 1.0)
    close(stats["margin_mean"], 0.0)  # mean of [1, -1]
    loss.backward()
    # d/dc_i mean(-logsigmoid(d_i)) = -sigmoid(-d_i) / 2: -0.2689414 / 2, -0.7310586 / 2
    close(chosen.grad, [-0.1344707107, -0.3655292893])
    # margin 1: diffs - 1 = [0, -2]: ln 2 = 0.6931472, ln(1 + e^2) = 2.1269280; mean 1.4100376
    close(pairwise_rm_loss(chosen, rejected, margin=1.0)[0], 1.4100375958)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_an_entropy_without_gradient_in_chunks_equals_one_pass(monkeypatch, dtype):
    """Chunks of 3 rows (7 x 5 positions, vocabulary 11, one entry masked to -inf): the entropy of a one-chunk
    pass exactly; with a gradient to keep, the whole pass (and its gradient) as before."""
    from rlhf_core.algos import losses

    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(7, 5, 11, generator=gen).to(dtype)
    logits[0, 0, 3] = -float("inf")
    monkeypatch.setattr(losses, "LOGPROB_CHUNK_ELEMENTS", 2**24)
    whole = entropy_from_logits(logits)
    monkeypatch.setattr(losses, "LOGPROB_CHUNK_ELEMENTS", 3 * 11)
    assert torch.equal(entropy_from_logits(logits), whole) and whole.dtype == torch.float32
    assert torch.equal(entropy_from_logits(logits[:, 1:4]), whole[:, 1:4])  # a non-contiguous slice
    leaf = logits.clone().requires_grad_(True)
    with_grad = entropy_from_logits(leaf)
    assert with_grad.requires_grad and torch.equal(with_grad.detach(), whole)
    with_grad.sum().backward()
    assert torch.isfinite(leaf.grad).all()


def test_half_precision_log_probs_in_chunks_equal_one_pass(monkeypatch):
    """Chunks of 3 rows (7 rows of 5 positions, vocabulary 11: a last chunk of 2) give the log-probs and gradients
    of a one-chunk pass exactly: the float32 reduction is per row."""
    from rlhf_core.algos import losses

    gen = torch.Generator().manual_seed(1)
    base = torch.randn(7, 5, 11, generator=gen).bfloat16()
    labels = torch.randint(0, 11, (7, 5), generator=gen)
    weights = torch.randn(7, 5, generator=gen)

    def run(chunk_elements):
        monkeypatch.setattr(losses, "LOGPROB_CHUNK_ELEMENTS", chunk_elements)
        logits = base.clone().requires_grad_(True)
        out = logprobs_from_logits(logits, labels)
        (out * weights).sum().backward()
        return out.detach(), logits.grad

    whole, whole_grad = run(2**24)
    chunked, chunked_grad = run(3 * 11)
    assert torch.equal(whole, chunked) and torch.equal(whole_grad, chunked_grad)
    # non-contiguous logits (a slice of positions, as logits_to_keep gives) take the same path
    leaf = base.clone().requires_grad_(True)
    sliced = leaf[:, 1:4]
    assert not sliced.is_contiguous()
    assert torch.equal(logprobs_from_logits(sliced, labels[:, 1:4]), whole[:, 1:4])
