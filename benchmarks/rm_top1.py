"""``python -m benchmarks.rm_top1 WORKSPACE...``: how often the reward model's best answer is the right one.

A pairwise (Bradley-Terry) RM is trained to rank one chosen answer above one rejected answer. Its held-out
pairwise accuracy does not say whether the best answer it can be offered is the right one, and that is what RL
that maximises it drifts toward. For each distinct held-out question of the demo task this scores every integer
answer in ``[0, 2 * max_operand + 10]`` with ``models/rm`` (the ensemble's mean when it is one, and each member
alone) and reports the share of questions whose top-scoring answer is correct (top-1), split into slipped and
other questions (``data.demo.slip_share``). One JSON line per workspace.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def top1_correct(scores: torch.Tensor, answers: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """``[Q]`` bool: whether question q's highest-scoring candidate (``scores[q]``, ``[Q, A]``; ties: the first)
    is its answer."""
    return candidates[scores.argmax(dim=1)] == answers


def shares(correct: torch.Tensor, slipped: torch.Tensor) -> dict[str, float | None]:
    """Top-1 share over all questions, the slipped ones and the others (None for an empty set)."""
    def share(mask: torch.Tensor) -> float | None:
        return float(correct[mask].float().mean()) if mask.any() else None

    return {"all": share(torch.ones_like(slipped)), "slipped": share(slipped), "other": share(~slipped)}


def evaluate_workspace(root: Path) -> dict:
    from benchmarks.slip_split import split_by_slip
    from rlhf_core.config import load_params
    from rlhf_core.models import EnsembleScorer, load_scorer
    from rlhf_core.ops import paths
    from rlhf_core.rewards.demo_task import render_answer
    from rlhf_core.trainers.common import read_split

    params = load_params(root / "params.yaml")
    rows = read_split(root, "prompts", eval_split=True, columns=("prompt", "answer"))
    questions = dict(zip(rows["prompt"], rows["answer"], strict=True))  # one row per distinct question
    prompts = list(questions)
    answers = torch.tensor([int(a) for a in questions.values()])
    candidates = torch.arange(2 * params.data.demo.max_operand + 11)
    slip, _ = split_by_slip(prompts, params.data.demo.slip_share, params.project.seed)
    slipped = torch.zeros(len(prompts), dtype=torch.bool)
    slipped[slip] = True

    flat_prompts = [p for p in prompts for _ in candidates]
    flat_answers = [render_answer(int(c)) for _ in prompts for c in candidates]
    scorer = load_scorer(root / paths.RM_MODEL, device="cpu", batch_size=256)
    members = scorer.members if isinstance(scorer, EnsembleScorer) else [scorer]
    member_scores = [m.score_responses(flat_prompts, flat_answers).view(len(prompts), -1) for m in members]
    combined = scorer.combine(member_scores) if isinstance(scorer, EnsembleScorer) else member_scores[0]
    return {"workspace": str(root), "n_questions": len(prompts), "n_slipped": len(slip),
            "candidates": f"0..{int(candidates[-1])}",
            "rm": shares(top1_correct(combined, answers, candidates), slipped),
            "members": [shares(top1_correct(s, answers, candidates), slipped) for s in member_scores]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workspaces", nargs="+", type=Path, help="workspaces with params.yaml, data/ and models/rm")
    for root in ap.parse_args(argv).workspaces:
        print(json.dumps(evaluate_workspace(root)), flush=True)


if __name__ == "__main__":
    main()
