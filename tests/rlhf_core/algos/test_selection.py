"""Best-of-n over a policy's own samples (``rlhf_core.algos.selection``), against numbers worked by hand."""

from __future__ import annotations

import pytest
import torch

from rlhf_core.algos.selection import best_of_n, doubling, keep_default
from rlhf_core.trainers.rm_selection import answer_ids, kl_terms
from tests.tiny import TINY_DEMO, tiny_params

# Two prompts, four samples each. Prompt 0: answers 5 (wrong, samples 0 and 3) and 6 (right, 1 and 2). Prompt 1:
# answer 1 (right, sample 0), 2 and 3 (wrong).
CORRECT = torch.tensor([[0, 1, 1, 0], [1, 0, 0, 0]])
SCORES = torch.tensor([[0.3, 0.2, 0.9, 0.1], [0.1, 0.5, 0.2, 0.3]])
ANSWERS = torch.tensor([[5, 6, 6, 5], [1, 2, 3, 3]])


def test_best_of_n_matches_the_hand_worked_table():
    t = best_of_n(CORRECT, SCORES, ANSWERS)
    assert t["sampled"] == pytest.approx((2 / 4 + 1 / 4) / 2)
    # n = 1 is the first sample for all three; n = 2: the reward picks 0.3 (wrong) and 0.5 (wrong), the vote ties
    # 1-1 and keeps the first (wrong, right); n = 4: the reward picks 0.9 (right) and 0.5 (wrong), the vote picks
    # answer 5 (2-2 tie, first: wrong) and answer 3 (two votes: wrong)
    assert t["by_n"] == {1: {"oracle": 0.5, "reward": 0.5, "majority": 0.5},
                         2: {"oracle": 1.0, "reward": 0.0, "majority": 0.5},
                         4: {"oracle": 1.0, "reward": 0.5, "majority": 0.0}}
    # (right, wrong) pairs: prompt 0 ranks 3 of its 4 (0.2 < 0.3), prompt 1 none of its 3
    assert t["pairs"] == 7 and t["pairwise"] == pytest.approx(3 / 7)


def test_best_of_n_ties_go_to_the_first_sample_and_a_prompt_all_right_has_no_pairs():
    t = best_of_n(torch.tensor([[0, 1, 1]]), torch.zeros(1, 3), torch.tensor([[0, 1, 1]]))
    assert t["by_n"][1]["reward"] == 0.0 and t["by_n"][3] == {"oracle": 1.0, "reward": 0.0, "majority": 1.0}
    alike = best_of_n(torch.ones(2, 2), torch.rand(2, 2), torch.zeros(2, 2, dtype=torch.long))
    assert alike["pairs"] == 0 and alike["pairwise"] is None and alike["by_n"][2]["reward"] == 1.0


def test_keep_default_moves_off_the_greedy_answer_only_for_a_higher_score():
    # prompt 0: greedy wrong (0.25), a right sample scores 0.9 -> right; prompt 1: greedy right (0.5), the samples
    # score 0.5 (a tie keeps greedy) and 0.3 -> right; prompt 2: greedy right (0.1), a wrong sample at 0.4 -> wrong
    got = keep_default(torch.tensor([0, 1, 1]), torch.tensor([0.25, 0.5, 0.1]),
                       torch.tensor([[1, 0], [0, 0], [0, 1]]), torch.tensor([[0.9, 0.1], [0.5, 0.3], [0.4, 0.2]]))
    assert got == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match=r"\[P\] defaults and \[P, N\] samples"):
        keep_default(torch.zeros(2), torch.zeros(2), torch.zeros(3, 2), torch.zeros(3, 2))


def test_doubling_ends_at_n():
    assert doubling(1) == [1] and doubling(4) == [1, 2, 4] and doubling(6) == [1, 2, 4, 6]


def test_best_of_n_refuses_mismatched_or_empty_tables():
    with pytest.raises(ValueError, match=r"\[P, N\].*\(2, 4\), \(2, 3\)"):
        best_of_n(CORRECT, SCORES[:, :3], ANSWERS)
    with pytest.raises(ValueError, match="N >= 1"):
        best_of_n(torch.zeros(2, 0), torch.zeros(2, 0), torch.zeros(2, 0))


def test_answer_ids_give_equal_answers_one_id_and_each_missing_answer_its_own():
    assert answer_ids([[5, None, 5, 7], [None, None, 2, 2]]).tolist() == [[0, 1, 0, 3], [0, 1, 2, 2]]


def test_kl_terms_are_the_rl_stages_coefficient_and_reward_scale():
    scores = torch.tensor([1.0, 3.0])  # std (n - 1) = sqrt(2)
    grpo = tiny_params(TINY_DEMO, "rlhf.algorithm=grpo", "rlhf.grpo.beta=0.05")
    assert kl_terms(grpo, scores) == pytest.approx((0.05, 2 ** 0.5))
    assert kl_terms(tiny_params(TINY_DEMO, "rlhf.algorithm=grpo", "rlhf.grpo.scale=none"), scores)[1] == 1.0
    assert kl_terms(tiny_params(TINY_DEMO, "rlhf.algorithm=ppo", "rlhf.kl_coef=0.2"), scores) == (0.2, 1.0)
