"""``python -m benchmarks.ptx_filter WORKSPACE... [--floors -1,0,1]``: what ``rlhf.ptx_min_reward`` keeps.

The ptx loss imitates ``sft.parquet``. On the demo task a share of those demonstrations is wrong
(``data.demo.wrong_share``, and every demonstration of a slipped question with ``data.demo.slip_share``), so
ptx teaches the wrong answers beside the right ones. For each floor this scores every SFT row once with
``models/rm`` (the ensemble's mean standardised score when it is one: 0 is the midpoint of the held-out chosen
and rejected scores) and reports the share of rows kept, the share of correct demonstrations before and among
the kept rows, and the share of the wrong ones dropped, overall and on the slipped questions. Correctness is
the demo task's exact checker. One JSON line per workspace.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def filter_shares(scores: torch.Tensor, correct: torch.Tensor, floor: float) -> dict[str, float | None]:
    """For ``keep = scores >= floor``: kept share, correct share among the kept rows, wrong rows dropped."""
    from rlhf_core.trainers.rlhf.inputs import ptx_keep

    keep = ptx_keep(scores, floor)
    wrong = ~correct

    def share(num: torch.Tensor, den: torch.Tensor) -> float | None:
        return float(num.sum()) / float(den.sum()) if den.any() else None

    return {"floor": floor, "kept": share(keep, torch.ones_like(keep)), "correct_kept": share(keep & correct, keep),
            "wrong_dropped": share(wrong & ~keep, wrong)}


def evaluate_workspace(root: Path, floors: list[float]) -> dict:
    from rlhf_core.config import load_params
    from rlhf_core.models import load_scorer
    from rlhf_core.ops import paths
    from rlhf_core.rewards.demo_task import check_answer, question_of, slipped, solve
    from rlhf_core.trainers.common import read_split

    params = load_params(root / "params.yaml")
    rows = read_split(root, "sft", columns=("prompt", "response"))
    questions = [question_of(p) for p in rows["prompt"]]
    if None in questions:
        raise ValueError(f"{root}: {paths.prepared_file('sft')} holds prompts that are not the demo task's")
    correct = torch.tensor([check_answer(r, solve(q)) for q, r in zip(questions, rows["response"], strict=True)])
    slip = torch.tensor([slipped(q, params.data.demo.slip_share, params.project.seed) for q in questions])
    scores = load_scorer(root / paths.RM_MODEL, device="cpu", batch_size=256).score_responses(
        rows["prompt"], rows["response"]).float()
    return {"workspace": str(root), "rows": len(questions), "correct": float(correct.float().mean()),
            "slipped_rows": int(slip.sum()),
            "floors": [filter_shares(scores, correct, f) | {"slipped": filter_shares(scores[slip], correct[slip], f)}
                       for f in floors]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workspaces", nargs="+", type=Path, help="workspaces with params.yaml, data/ and models/rm")
    ap.add_argument("--floors", default="-1,-0.5,0,0.5,1", help="comma-separated rlhf.ptx_min_reward values")
    a = ap.parse_args(argv)
    floors = [float(f) for f in a.floors.split(",")]
    for root in a.workspaces:
        print(json.dumps(evaluate_workspace(root, floors)), flush=True)


if __name__ == "__main__":
    main()
