"""Best-of-n over a policy's own samples, judged by an exact checker: how far a reward lifts the policy by choosing
among what it already writes, before any RL (the RM stage's ``rm.best_of_n`` check).

GRPO or PPO from a reward move the policy towards the samples the reward prefers; where the reward's pick among
n samples is no more often right than one sample (or the greedy answer), RL from it has nothing to learn that the
checker would count. For P prompts with N samples each, ``correct[p, i]`` in {0, 1} (the checker), ``scores[p, i]``
(the reward) and ``answers[p, i]`` (an id per distinct final answer: equal ids, the same answer), over the first n
samples:

    sampled    = mean_{p,i} correct[p, i]                                       one sample
    oracle@n   = mean_p max_{i<n} correct[p, i]                                 pass@n: the most any reward can pick
    reward@n   = mean_p correct[p, argmax_{i<n} scores[p, i]]                   the reward's pick (ties: the first)
    majority@n = mean_p correct[p, argmax_{i<n} #{j<n : answers[p, j] = answers[p, i]}]   no reward at all
    pairwise   = #{(p, i, j): correct_pi > correct_pj, scores_pi > scores_pj} / #{(p, i, j): correct_pi > correct_pj}

``pairwise`` is the reward's accuracy on the (right, wrong) pairs within a prompt: the pairs that RL's group
comparisons see, not the prepared held-out pairs of ``eval_pairs``.

Greedy decoding reads the policy's mode, which RL moves only where the reward prefers another answer to it. With
the greedy answer ``g`` beside the samples (``keep_default``), the pick keeps ``g`` unless a sample scores higher:

    reward_over_greedy = mean_p correct[p, argmax(score(g_p), scores[p, 0], ..., scores[p, N-1])]   (ties: g)

Above the greedy accuracy, the reward would move wrong modes to right answers more often than the reverse.

RL does not maximise the reward alone: the KL-regularised optimum at coefficient beta is
``pi*(y) ∝ pi_ref(y) exp(r(y) / (sigma * beta))`` (sigma: the scale the algorithm divides rewards by), whose mode is

    argmax_y  r(y) / sigma + beta * log pi_ref(y | x)

So the same pick with ``scores = r / sigma + beta * log pi_ref`` predicts the mode RL moves to (with DPO's implicit
reward at beta = its own beta, that is the DPO policy's own preference among the candidates).
"""

from __future__ import annotations

import torch

__all__ = ["best_of_n", "doubling", "keep_default"]


def doubling(n_max: int) -> list[int]:
    """1, 2, 4, ... up to ``n_max``, and ``n_max`` itself."""
    ns = [1 << k for k in range(n_max.bit_length()) if 1 << k <= n_max]
    return ns if ns[-1] == n_max else [*ns, n_max]


def _pick(correct: torch.Tensor, index: torch.Tensor) -> float:
    return float(correct.gather(1, index.unsqueeze(1)).mean())


def best_of_n(correct: torch.Tensor, scores: torch.Tensor, answers: torch.Tensor) -> dict:
    """The module's table for ``[P, N]`` inputs: ``{"sampled", "pairwise", "pairs", "by_n": {n: {"oracle",
    "reward", "majority"}}}`` for n in ``doubling(N)``; ``pairwise`` is None where no prompt has both a right and a
    wrong sample."""
    if not correct.shape == scores.shape == answers.shape or correct.dim() != 2 or correct.shape[1] == 0:
        raise ValueError(f"best_of_n needs three [P, N] tensors with N >= 1; got {tuple(correct.shape)}, "
                         f"{tuple(scores.shape)}, {tuple(answers.shape)}")
    correct = correct.double()
    by_n = {}
    for n in doubling(correct.shape[1]):
        c, s, a = correct[:, :n], scores[:, :n], answers[:, :n]
        votes = (a.unsqueeze(2) == a.unsqueeze(1)).sum(dim=2)
        by_n[n] = {"oracle": float(c.amax(dim=1).mean()), "reward": _pick(c, s.argmax(dim=1)),
                   "majority": _pick(c, votes.argmax(dim=1))}
    right_over_wrong = correct.unsqueeze(2) > correct.unsqueeze(1)
    ranked_right = right_over_wrong & (scores.unsqueeze(2) > scores.unsqueeze(1))
    pairs = int(right_over_wrong.sum())
    return {"sampled": float(correct.mean()), "pairwise": float(ranked_right.sum()) / pairs if pairs else None,
            "pairs": pairs, "by_n": by_n}


def keep_default(default_correct: torch.Tensor, default_scores: torch.Tensor, correct: torch.Tensor,
                 scores: torch.Tensor) -> float:
    """``reward_over_greedy`` of the module docstring: ``[P]`` default answers beside ``[P, N]`` samples."""
    if default_correct.shape != default_scores.shape or correct.shape != scores.shape \
            or default_correct.shape[0] != correct.shape[0]:
        raise ValueError(f"keep_default needs [P] defaults and [P, N] samples; got {tuple(default_correct.shape)}, "
                         f"{tuple(default_scores.shape)}, {tuple(correct.shape)}, {tuple(scores.shape)}")
    both = torch.cat([default_correct[:, None], correct], dim=1).double()
    return _pick(both, torch.cat([default_scores[:, None], scores], dim=1).argmax(dim=1))
