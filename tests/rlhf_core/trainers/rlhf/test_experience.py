"""Experience assembly on hand-made sequences: masks, dropped empty rows, aligned log-probs and values,
rewards at the last valid token, the buffer's mini-batches."""

from __future__ import annotations

import pytest
import torch

from rlhf_core.algos import kl_estimate
from rlhf_core.config import RLHFConfig
from rlhf_core.passes.generation import GenerationConfig
from rlhf_core.passes.generation import response_logprobs as sequence_logprobs
from rlhf_core.passes.values import sequence_values
from rlhf_core.trainers.rlhf.algorithms import algorithm_for, compute_advantages
from rlhf_core.trainers.rlhf.experience import (
    Experience,
    ExperienceMaker,
    MakerConfig,
    minibatch_plan,
    zero_row,
)

EOS, PAD, V = 2, 0, 8


def algo(name: str = "ppo", estimator: str = "gae", kl_in: str = "reward", kl_estimator: str = "k1",
         reward_clip: float | None = None, gamma: float = 1.0, lam: float = 0.95, whiten: bool = True, n: int = 1,
         score_baseline: str = "none", advantage: str = "normalised"):
    """The algorithm declaration for these settings (``rlhf_core.trainers.rlhf.algorithms``)."""
    return algorithm_for(RLHFConfig(
        algorithm=name, kl_estimator=kl_estimator, reward_clip=reward_clip, whiten_advantages=whiten,
        grpo={"group_size": max(n, 2), "advantage": advantage},
        ppo={"advantage_estimator": estimator, "kl_in": kl_in, "gamma": gamma, "lam": lam, "samples_per_prompt": n,
             "score_baseline": score_baseline}))


class ScriptedLM(torch.nn.Module):
    """``generate`` returns the prompt + a scripted response; logits[t] = table[token[t]] (a bigram model)."""

    def __init__(self, table: torch.Tensor, script: torch.Tensor | None = None):
        super().__init__()
        self.table = torch.nn.Parameter(table.clone())
        self.script = script

    def generate(self, input_ids, attention_mask, max_new_tokens, **kw):
        return torch.cat([input_ids, self.script[:, :max_new_tokens]], dim=1)

    def forward(self, input_ids, attention_mask=None, position_ids=None, logits_to_keep=0, use_cache=False):
        logits = self.table[input_ids]
        if logits_to_keep:
            logits = logits[:, -logits_to_keep:]
        return type("Out", (), {"logits": logits})()


class TokenValueCritic(torch.nn.Module):
    """values[t] = 10 * token[t] + position_id[t]: easy to read back."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(()))

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        return type("Out", (), {"values": 10.0 * input_ids.float() + position_ids.float() + self.w})()


class Tok:
    def __init__(self, eos=EOS, pad=PAD):
        self.eos_token_id, self.pad_token_id = eos, pad

    def batch_decode(self, ids, skip_special_tokens=True):
        return ["".join(str(int(t)) for t in row if int(t) not in (self.eos_token_id, self.pad_token_id))
                for row in ids]


def bigram(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.log_softmax(torch.randn(V, V, generator=g), dim=-1)


# prompt rows, left-padded: [PAD, 5, 6] and [4, 5, 6]
PROMPTS = torch.tensor([[PAD, 5, 6], [4, 5, 6]])
PROMPT_MASK = torch.tensor([[0, 1, 1], [1, 1, 1]])


def make(script, *, eos=EOS, pad=PAD, algorithm="ppo", n=1, penalty=None, scores=None, critic=True,
         prompts=PROMPTS, prompt_mask=PROMPT_MASK, drop_uniform=False, advantage="normalised", columns=None):
    actor, ref = ScriptedLM(bigram(0), script), ScriptedLM(bigram(1))
    declared = algo(algorithm, n=n, advantage=advantage)
    maker_cfg = MakerConfig(baseline=declared.baseline, samples_per_prompt=n,
                            gen=GenerationConfig(max_new_tokens=4),
                            forward_batch_size=2, need_old_logp=True, need_ref=True, need_values=critic,
                            no_eos_penalty=penalty, drop_uniform_groups=drop_uniform,
                            drop_unselected=declared.drop_unselected)
    given = scores

    def score_fn(prompts_, completions, **_):
        return torch.tensor(given, dtype=torch.float) if given is not None else torch.ones(len(completions))

    maker = ExperienceMaker(actor, ref, TokenValueCritic() if critic else None, score_fn, Tok(eos, pad), maker_cfg)
    n_prompts = prompts.shape[0] // n if algorithm == "grpo" else prompts.shape[0]
    rows = torch.arange(n_prompts)
    exp = maker.make(prompts[rows * n if n > 1 else rows], prompt_mask[rows * n if n > 1 else rows],
                     [f"p{i}" for i in range(n_prompts)], columns or {})
    return exp, actor.table.detach(), ref.table.detach()


def hand_logp(table, prompt_last, response, mask):
    """Bigram log-prob of each response token given the previous token (the prompt's last for t=0)."""
    prev = torch.cat([torch.tensor([prompt_last]), response[:-1]])
    return torch.where(mask.bool(), table[prev, response], torch.zeros(()))


def test_masks_eos_middle_end_missing_and_empty_row_dropped():
    script = torch.tensor([
        [7, EOS, PAD, PAD],  # EOS in the middle -> 2 actions
        [EOS, PAD, PAD, PAD],  # empty response (only EOS) -> dropped
        [7, 7, 7, EOS],  # EOS at the end -> 4 actions
        [3, 4, 5, 7],  # no EOS -> 4 actions, flagged
    ])
    prompts = torch.cat([PROMPTS, PROMPTS])
    pmask = torch.cat([PROMPT_MASK, PROMPT_MASK])
    exp, actor_t, ref_t = make(script, prompts=prompts, prompt_mask=pmask, penalty=-1.0)
    assert exp.info["rows"] == 4 and exp.info["empty"] == 1 and exp.info["no_eos"] == 1
    assert len(exp) == 3  # the empty row is gone
    assert exp.action_mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1]]
    assert exp.scores.tolist() == [1.0, 1.0, -1.0]  # the no-EOS row got the penalty
    kept_script = script[[0, 2, 3]]
    for i in range(3):
        expected = hand_logp(actor_t, 6, kept_script[i], exp.action_mask[i])
        assert torch.allclose(torch.where(exp.action_mask[i].bool(), exp.old_logp[i], torch.zeros(())), expected,
                              atol=1e-6)
        expected_ref = hand_logp(ref_t, 6, kept_script[i], exp.action_mask[i])
        assert torch.allclose(torch.where(exp.action_mask[i].bool(), exp.ref_logp[i], torch.zeros(())),
                              expected_ref, atol=1e-6)


def test_values_are_read_at_the_state_before_each_action():
    script = torch.tensor([[7, EOS, PAD, PAD], [3, 4, 5, 7]])
    exp, _, _ = make(script)
    # row 0: prompt [PAD, 5, 6] -> position ids of 6 is 1; value of action 0 = 10*6 + 1, action 1 = 10*7 + 2
    assert exp.values[0, :2].tolist() == [61.0, 72.0]
    # row 1: prompt [4, 5, 6] -> 6 at position 2; then the actions 3, 4, 5 at positions 3, 4, 5
    assert exp.values[1].tolist() == [62.0, 33.0, 44.0, 55.0]


def test_pad_equal_to_eos_tokenizer():
    """With pad == eos the first EOS ends the response and the padding after it is masked."""
    script = torch.tensor([[7, EOS, EOS, EOS], [3, EOS, EOS, EOS]])
    prompts = torch.tensor([[EOS, 5, 6], [4, 5, 6]])  # left padding with the EOS id
    exp, actor_t, _ = make(script, pad=EOS, prompts=prompts)
    assert exp.action_mask.tolist() == [[1, 1], [1, 1]]  # trimmed to the longest response
    assert exp.info["empty"] == 0 and exp.info["no_eos"] == 0
    assert exp.prompt_mask.tolist() == PROMPT_MASK.tolist()
    assert torch.allclose(exp.old_logp[0], hand_logp(actor_t, 6, script[0, :2], torch.ones(2)), atol=1e-6)


def test_rewards_at_last_valid_token_and_kl_penalty():
    script = torch.tensor([[7, EOS, PAD, PAD], [3, 4, 5, 7]])
    exp, _, _ = make(script, scores=[2.0, -3.0])
    cfg = algo("ppo", "gae", "reward", "k1", reward_clip=None, gamma=1.0, lam=1.0, whiten=False)
    plain = compute_advantages(exp, cfg, kl_coef=0.0)
    assert plain.rewards.tolist() == [[0.0, 2.0, 0.0, 0.0], [0.0, 0.0, 0.0, -3.0]]
    # gamma = lam = 1: A_t = sum of future rewards - V_t; returns = score on every valid token
    assert plain.returns.tolist() == [[2.0, 2.0, 0.0, 0.0], [-3.0, -3.0, -3.0, -3.0]]
    assert torch.allclose(plain.advantages, torch.where(exp.action_mask.bool(), plain.returns - exp.values,
                                                        torch.zeros(())))
    clipped = compute_advantages(exp, algo("ppo", "gae", "reward", "k1", reward_clip=1.0, whiten=False),
                                 kl_coef=0.0)
    assert clipped.rewards[0, 1] == 1.0 and clipped.rewards[1, 3] == -1.0
    kl = compute_advantages(exp, cfg, kl_coef=0.1)
    pen = -0.1 * kl_estimate(exp.old_logp, exp.ref_logp, "k1")
    expected = torch.where(exp.action_mask.bool(), pen, torch.zeros(()))
    expected[0, 1] += 2.0
    expected[1, 3] += -3.0
    assert torch.allclose(kl.rewards, expected, atol=1e-6)
    loss_kl = compute_advantages(exp, algo("ppo", "gae", "loss", "k3", whiten=False), kl_coef=0.1)
    assert loss_kl.rewards.tolist() == plain.rewards.tolist()  # kl_in: loss keeps it out of the reward


def test_grpo_group_advantages_use_the_full_group_before_dropping():
    script = torch.tensor([[7, EOS, PAD, PAD], [EOS, PAD, PAD, PAD], [3, EOS, PAD, PAD], [4, EOS, PAD, PAD]])
    prompts, pmask = PROMPTS[[1, 1, 1, 1]], PROMPT_MASK[[1, 1, 1, 1]]
    exp, _, _ = make(script, algorithm="grpo", n=4, scores=[1.0, 0.0, 0.0, 1.0], critic=False, prompts=prompts,
                     prompt_mask=pmask)
    assert len(exp) == 3 and exp.group.tolist() == [0, 0, 0]
    full = torch.tensor([1.0, 0.0, 0.0, 1.0])
    expected = (full - full.mean()) / (full.std() + 1e-4)
    assert torch.allclose(exp.baselined, expected[[0, 2, 3]])
    out = compute_advantages(exp, algo("grpo", n=4), kl_coef=0.0)
    assert torch.allclose(out.advantages[:, 0], expected[[0, 2, 3]])
    assert torch.allclose(out.advantages[:, 1], expected[[0, 2, 3]])  # the EOS action gets it too
    assert out.rewards.tolist() == [[0.0, 1.0], [0.0, 0.0], [0.0, 1.0]]


def test_uniform_groups_are_dropped_and_counted():
    """Two groups of 2: scores (1, 1) are uniform (both advantages 0) and go; (1, 0) stays. With the flag off
    every row stays."""
    script = torch.tensor([[7, EOS, PAD, PAD], [3, EOS, PAD, PAD], [4, EOS, PAD, PAD], [5, 7, EOS, PAD]])
    prompts, pmask = PROMPTS[[0, 0, 1, 1]], PROMPT_MASK[[0, 0, 1, 1]]
    kw = {"algorithm": "grpo", "n": 2, "scores": [1.0, 1.0, 1.0, 0.0], "critic": False, "prompts": prompts,
          "prompt_mask": pmask}
    exp, _, _ = make(script, drop_uniform=True, **kw)
    assert exp.group.tolist() == [1, 1] and exp.responses[:, 0].tolist() == [4, 5]
    assert exp.info["uniform"] == 2 and exp.info["idle_score"] == 2.0 and exp.info["idle_score_sq"] == 2.0
    assert exp.info["uniform_groups"] == 1 and exp.info["groups"] == 2  # uniform_group_share 1/2
    assert exp.ref_logp.shape[0] == 2  # the reference pass ran on the kept rows only
    kept, _, _ = make(script, drop_uniform=False, **kw)
    assert len(kept) == 4 and kept.info["uniform"] == 0
    assert kept.info["uniform_groups"] == 1  # counted whether or not the groups are dropped
    assert kept.baselined[:2].tolist() == [0.0, 0.0]  # what dropping saves: rows with no policy gradient


def test_best_of_group_keeps_only_each_groups_pick():
    """RAFT (``grpo.advantage: best``): two groups of 4 scored (0.2, 0.9, 0.5, 0.9) and (-1, -3, -1, -2): the
    picks are rows 1 and 4 (ties go to the first), each with advantage 1 on every token; the other six rows leave
    before the reference pass, counted with their scores (0.2 + 0.5 + 0.9 - 3 - 1 - 2 = -4.4)."""
    script = torch.tensor([[7, EOS, PAD, PAD], [3, 4, EOS, PAD], [4, EOS, PAD, PAD], [6, EOS, PAD, PAD],
                           [5, 7, EOS, PAD], [6, EOS, PAD, PAD], [4, EOS, PAD, PAD], [3, EOS, PAD, PAD]])
    prompts, pmask = PROMPTS[[0] * 4 + [1] * 4], PROMPT_MASK[[0] * 4 + [1] * 4]
    exp, _, _ = make(script, algorithm="grpo", n=4, scores=[0.2, 0.9, 0.5, 0.9, -1.0, -3.0, -1.0, -2.0],
                     critic=False, prompts=prompts, prompt_mask=pmask, advantage="best")
    assert exp.responses[:, 0].tolist() == [3, 5] and exp.group.tolist() == [0, 1]
    assert exp.baselined.tolist() == [1.0, 1.0] and exp.ref_logp.shape[0] == 2
    assert exp.info["unselected"] == 6 and exp.info["uniform"] == 0 and exp.info["idle"] == 6
    assert exp.info["idle_score"] == pytest.approx(-4.4) and exp.info["idle_score_sq"] == pytest.approx(15.1)
    out = compute_advantages(exp, algo("grpo", n=4, advantage="best"), kl_coef=0.0)
    assert out.advantages.tolist() == [[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]  # 2 tokens + EOS each


def test_best_of_group_counts_right_picks_and_right_candidates():
    """With answers: group 1 ("7", "34", "4", "6"; answer 34) picks "34", right; group 2 ("57", "6", "4", "3";
    answer 6) picks "57", wrong. Picks right 1 of 2; candidates (every row of a group with a pick) right 2 of 8."""
    script = torch.tensor([[7, EOS, PAD, PAD], [3, 4, EOS, PAD], [4, EOS, PAD, PAD], [6, EOS, PAD, PAD],
                           [5, 7, EOS, PAD], [6, EOS, PAD, PAD], [4, EOS, PAD, PAD], [3, EOS, PAD, PAD]])
    prompts, pmask = PROMPTS[[0] * 4 + [1] * 4], PROMPT_MASK[[0] * 4 + [1] * 4]
    exp, _, _ = make(script, algorithm="grpo", n=4, scores=[0.2, 0.9, 0.5, 0.9, -1.0, -3.0, -1.0, -2.0],
                     critic=False, prompts=prompts, prompt_mask=pmask, advantage="best",
                     columns={"answer": ["34", "6"]})
    assert exp.info["correct"] == 2 and exp.info["correct_trained"] == 1
    assert exp.info["candidates"] == 8 and exp.info["correct_candidates"] == 2


def test_best_of_group_an_empty_pick_leaves_its_group_untrained():
    """The pick's response is empty (only EOS): it is dropped as empty, and the group's other rows, not picked,
    are dropped too; nothing of that group is trained on."""
    script = torch.tensor([[EOS, PAD, PAD, PAD], [3, EOS, PAD, PAD], [4, EOS, PAD, PAD], [5, EOS, PAD, PAD]])
    prompts, pmask = PROMPTS[[0, 0, 1, 1]], PROMPT_MASK[[0, 0, 1, 1]]
    exp, _, _ = make(script, algorithm="grpo", n=2, scores=[1.0, 0.0, 0.0, 2.0], critic=False, prompts=prompts,
                     prompt_mask=pmask, advantage="best")
    assert exp.info["empty"] == 1 and exp.info["unselected"] == 2 and exp.responses[:, 0].tolist() == [5]


def test_uniform_groups_count_an_empty_row_once():
    """A uniform group with an empty response: the empty row is counted as empty, the other as uniform."""
    script = torch.tensor([[EOS, PAD, PAD, PAD], [3, EOS, PAD, PAD], [4, EOS, PAD, PAD], [5, EOS, PAD, PAD]])
    prompts, pmask = PROMPTS[[0, 0, 1, 1]], PROMPT_MASK[[0, 0, 1, 1]]
    exp, _, _ = make(script, algorithm="grpo", n=2, scores=[0.0, 0.0, 1.0, 0.0], critic=False, prompts=prompts,
                     prompt_mask=pmask, drop_uniform=True)
    assert exp.info["empty"] == 1 and exp.info["uniform"] == 1 and len(exp) == 2


def test_all_empty_rows_keep_one_zero_mask_row():
    script = torch.tensor([[EOS, PAD, PAD, PAD], [EOS, PAD, PAD, PAD]])
    exp, _, _ = make(script)
    assert exp.info["empty"] == 2 and len(exp) == 1 and exp.action_mask.sum() == 0


def test_cat_repads_prompts_left_and_responses_right():
    a = Experience(torch.tensor([[5, 6]]), torch.tensor([[1, 1]]), torch.tensor([[7, EOS]]), torch.tensor([[1, 1]]),
                   torch.tensor([1.0]), torch.tensor([0]), old_logp=torch.tensor([[-1.0, -2.0]]))
    b = Experience(torch.tensor([[4, 5, 6]]), torch.tensor([[1, 1, 1]]), torch.tensor([[3, 4, 5]]),
                   torch.tensor([[1, 1, 1]]), torch.tensor([0.0]), torch.tensor([1]),
                   old_logp=torch.tensor([[-1.0, -1.0, -1.0]]))
    c = Experience.cat([a, b], PAD)
    assert c.prompt_ids.tolist() == [[PAD, 5, 6], [4, 5, 6]] and c.prompt_mask.tolist() == [[0, 1, 1], [1, 1, 1]]
    assert c.responses.tolist() == [[7, EOS, PAD], [3, 4, 5]] and c.action_mask.tolist() == [[1, 1, 0], [1, 1, 1]]
    assert c.old_logp.tolist() == [[-1.0, -2.0, 0.0], [-1.0, -1.0, -1.0]]
    assert c.values is None
    sel = c.select(torch.tensor([0]))  # trims the pad column of the prompt and the masked response column
    assert sel.prompt_ids.tolist() == [[5, 6]] and sel.responses.tolist() == [[7, EOS]]


def test_minibatch_plan_is_fixed_size_and_keeps_groups_together():
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    plan = minibatch_plan(groups, n_minibatches=2, grad_accum=2, generator=torch.Generator().manual_seed(0))
    assert len(plan) == 2 and all(len(mb) == 2 for mb in plan)
    rows = torch.cat([r for mb in plan for r in mb])
    assert sorted(rows.tolist()) == list(range(8))
    for mb in plan:
        for r in mb:  # every micro-batch holds whole groups here (2 rows = 1 group)
            assert len(set(groups[r].tolist())) == 1
    few = minibatch_plan(torch.tensor([0, 1]), n_minibatches=2, grad_accum=2,
                         generator=torch.Generator().manual_seed(0))
    assert sum(len(r) == 0 for mb in few for r in mb) == 2  # fixed count: empty micro-batches remain


def test_zero_row_gives_zero_loss_and_gradient():
    from rlhf_core.trainers.rlhf.ppo import ActorLossConfig, actor_loss

    script = torch.tensor([[7, EOS, PAD, PAD], [3, 4, 5, 7]])
    exp, _, _ = make(script)
    exp = compute_advantages(exp, algo("ppo", "gae", whiten=False), kl_coef=0.0)
    model = ScriptedLM(bigram(0))
    loss, _ = actor_loss(model, zero_row(exp), ActorLossConfig(entropy_coef=0.1, kl_in_loss=True), 0.1)
    loss.backward()
    assert loss.item() == 0.0 and model.table.grad.abs().sum() == 0


def test_logprobs_and_values_only_over_response_positions():
    model = ScriptedLM(bigram(0))
    seq = torch.tensor([[PAD, 5, 6, 7, EOS]])
    att = torch.tensor([[0, 1, 1, 1, 1]])
    logp = sequence_logprobs(model, seq, att, response_len=2)
    assert torch.allclose(logp, torch.stack([model.table[6, 7], model.table[7, EOS]]).unsqueeze(0))
    hot = sequence_logprobs(model, seq, att, response_len=2, temperature=0.5)
    expected = torch.log_softmax(model.table[[6, 7]] / 0.5, dim=-1)[[0, 1], [7, EOS]]
    assert torch.allclose(hot, expected.unsqueeze(0), atol=1e-6)
    values = sequence_values(TokenValueCritic(), seq, att, response_len=2)
    assert values.tolist() == [[61.0, 72.0]]


@pytest.mark.parametrize("estimator", ["rloo", "reinforce_pp"])
def test_critic_free_estimators(estimator):
    script = torch.tensor([[7, EOS, PAD, PAD], [3, 4, EOS, PAD]])
    prompts, pmask = PROMPTS[[1, 1]], PROMPT_MASK[[1, 1]]
    actor, ref = ScriptedLM(bigram(0), script), ScriptedLM(bigram(1))
    cfg = MakerConfig(samples_per_prompt=2, gen=GenerationConfig(4), forward_batch_size=0, need_old_logp=True,
                      need_ref=True, need_values=False, baseline=algo("ppo", estimator, n=2).baseline)
    maker = ExperienceMaker(actor, ref, None, lambda p, c, **_: torch.tensor([1.0, 0.0]), Tok(), cfg)
    exp = maker.make(prompts[:1], pmask[:1], ["p"], {})
    out = compute_advantages(exp, algo("ppo", estimator, whiten=False, n=2), kl_coef=0.0)
    if estimator == "rloo":  # leave-one-out: 1 - 0 and 0 - 1, on every token (gamma 1, no KL)
        assert exp.baselined.tolist() == [1.0, -1.0]
        assert out.advantages.tolist() == [[1.0, 1.0, 0.0], [-1.0, -1.0, -1.0]]
    else:  # whitened return-to-go over all valid tokens
        m = out.action_mask.bool()
        assert abs(float(out.advantages[m].mean())) < 1e-6


def test_ppo_group_mean_baseline_centres_scores_per_prompt_before_gae():
    """ppo.score_baseline: group_mean: scores 5, 3 for one prompt (mean 4) become +1 and -1 at the last valid
    token; with gamma = lam = 1, no KL and a zero critic, GAE's advantage is that on every token."""
    script = torch.tensor([[7, EOS, PAD, PAD], [3, 4, EOS, PAD]])
    prompts, pmask = PROMPTS[[1, 1]], PROMPT_MASK[[1, 1]]
    actor, ref = ScriptedLM(bigram(0), script), ScriptedLM(bigram(1))
    cfg = MakerConfig(samples_per_prompt=2, gen=GenerationConfig(4), forward_batch_size=0, need_old_logp=True,
                      need_ref=True, need_values=False, baseline=algo("ppo", n=2, score_baseline="group_mean").baseline)
    maker = ExperienceMaker(actor, ref, None, lambda p, c, **_: torch.tensor([5.0, 3.0]), Tok(), cfg)
    exp = maker.make(prompts[:1], pmask[:1], ["p"], {})
    assert exp.scores.tolist() == [5.0, 3.0] and exp.baselined.tolist() == [1.0, -1.0]
    exp.values = torch.zeros(exp.action_mask.shape)
    out = compute_advantages(exp, algo("ppo", "gae", gamma=1.0, lam=1.0, whiten=False), kl_coef=0.0)
    assert out.rewards.tolist() == [[0.0, 1.0, 0.0], [0.0, 0.0, -1.0]]
    assert out.advantages.tolist() == [[1.0, 1.0, 0.0], [-1.0, -1.0, -1.0]]


def test_critic_values_and_gradients_with_each_prompt_computed_once_equal_the_full_forward():
    """The critic's shared-prefix pass (groups of 3, 1 and 2 rows over left-padded prompts) gives the values and
    parameter gradients of one forward over the full rows; rows of one group with different prompts are refused."""
    from transformers import LlamaConfig, LlamaModel

    from rlhf_core.models import ValueHeadModel
    from rlhf_core.passes.generation import response_mask

    torch.manual_seed(0)
    critic = ValueHeadModel(LlamaModel(LlamaConfig(
        vocab_size=12, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=32, pad_token_id=PAD)))
    prompts = torch.tensor([[PAD, PAD, 1, 7, 8], [1, 7, 8, 9, 7], [PAD, 1, 9, 9, 3]])
    group = torch.tensor([0, 0, 0, 1, 2, 2])
    responses = torch.tensor([[4, 5, EOS], [6, EOS, PAD], [4, 4, 4], [9, 3, EOS], [EOS, PAD, PAD], [5, 6, 7]])
    seq = torch.cat([prompts[group], responses], dim=1)
    att = torch.cat([(prompts[group] != PAD).long(), response_mask(responses, EOS)], dim=1)
    mask = att[:, -3:].bool()

    def run(g):
        critic.zero_grad()
        values = sequence_values(critic, seq, att, 3, g)
        (values * mask).pow(2).sum().backward()
        return values.detach(), [p.grad.clone() for p in critic.parameters()]

    full, full_grads = run(None)
    shared, shared_grads = run(group)
    torch.testing.assert_close(shared[mask], full[mask], atol=1e-5, rtol=1e-5)
    for a, b in zip(full_grads, shared_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="different prompts"):
        sequence_values(critic, seq, att, 3, torch.tensor([0, 0, 0, 0, 2, 2]))
