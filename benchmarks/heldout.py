"""``python -m benchmarks.heldout``: every held-out question of a workspace judged for several models, greedy and
``K`` sampled answers each, and each model's gain over the first, paired over the questions.

The RL stage judges its first ``eval.max_prompts`` held-out prompts once, greedy: at 100 questions one model's
accuracy has a standard error of 3-4 points, more than most changes worth measuring. This judge reads every
held-out question the workspace has answers for (the RL split's ``eval_prompts`` and, where its rows carry an
``answer``, the SFT split's ``eval_sft``: the same held-out operand pairs and phrasings, never trained on) and
answers each greedily and ``K`` times sampled at ``rlhf.temperature`` (what RL optimises), under one torch seed
for every model, so that models differ by their weights only.

Gains are paired over the ``Q`` questions: with ``x_m(q)`` model ``m``'s score on question ``q`` (greedy: 0 or 1;
sampled: the share of its ``K`` answers judged right)::

    d(q)   = x_m(q) - x_0(q)
    gain   = (1/Q) sum_q d(q)
    SE     = std_q(d) / sqrt(Q)                 (sample std; each question is one cluster of K answers)
    flips  = #{q: greedy_0(q) = 1, greedy_m(q) = 0},  #{q: greedy_0(q) = 0, greedy_m(q) = 1}

Run (one thread on a CPU; the GPU when there is one)::

    python -m benchmarks.heldout judge --workspace W --samples 4 --out q.jsonl W/models/sft RUN/models/actor ...
    python -m benchmarks.heldout compare q.jsonl        # each model against the first

``judge`` appends one row per model and question to ``OUT`` (``model``, ``question`` (its index here); ``split``,
``position`` (in the split) and ``id`` (the prepared row's), which ``compare`` pairs on; ``greedy_right``,
``sampled_right``) and prints one summary line per model. ``benchmarks.learning --judge K``
runs it after every run, against the SFT start.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

JUDGE_SEED = 20261129  # one sampling stream for every model: the paired comparison differs by weights only


@dataclass(frozen=True)
class Verdicts:
    """One model's verdicts on ``Q`` questions: ``greedy`` ``[Q]`` (0/1), ``sampled`` ``[Q, K]`` (0/1), and which
    question each row is (``keys``: ``(split, position in the split, id)``, the order of the rows)."""

    greedy: torch.Tensor
    sampled: torch.Tensor
    keys: tuple = ()

    def summary(self) -> dict:
        """Accuracies with their standard errors over the questions (a question's K sampled answers are one
        cluster: SE = std_q(share right) / sqrt(Q)), and pass@K; ``None`` where one question gives no spread."""
        q = self.greedy.numel()
        per_question = self.sampled.mean(dim=1) if self.sampled.numel() else torch.zeros(0)
        out = {"questions": q, "greedy_accuracy": round(float(self.greedy.mean()), 4),
               "greedy_se": round(float(self.greedy.std() / q ** 0.5), 4) if q > 1 else None}
        if per_question.numel():
            out |= {"samples": self.sampled.shape[1], "sampled_accuracy": round(float(per_question.mean()), 4),
                    "sampled_se": round(float(per_question.std() / q ** 0.5), 4) if q > 1 else None,
                    f"pass_at_{self.sampled.shape[1]}": round(float(self.sampled.max(dim=1).values.mean()), 4)}
        return out


def _same_questions(base: torch.Tensor, other: torch.Tensor) -> None:
    if base.shape != other.shape or base.dim() != 1:
        raise ValueError(f"a paired comparison needs two [Q] vectors of the same questions, got {tuple(base.shape)} "
                         f"and {tuple(other.shape)}")


def paired_gain(base: torch.Tensor, other: torch.Tensor) -> tuple[float, float | None]:
    """``(gain, SE)`` of ``other`` over ``base``, per-question scores ``[Q]`` of the same questions in order:
    ``d = other - base``, gain = mean(d), SE = std(d) / sqrt(Q) (sample std; ``None`` for one question)."""
    _same_questions(base, other)
    d = other.double() - base.double()
    q = d.numel()
    return float(d.mean()), float(d.std() / q ** 0.5) if q > 1 else None


def flips(base: torch.Tensor, other: torch.Tensor) -> tuple[int, int]:
    """``(right -> wrong, wrong -> right)`` between two greedy verdict vectors ``[Q]``."""
    _same_questions(base, other)
    b, o = base.bool(), other.bool()
    return int((b & ~o).sum()), int((~b & o).sum())


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def compare(base: Verdicts, other: Verdicts) -> dict:
    """``other``'s greedy and sampled gains over ``base`` (paired, with SE) and its greedy flips. Where both name
    their questions (``keys``), ``other`` is paired question by question and must hold the same ones."""
    if base.keys and other.keys:
        if set(base.keys) != set(other.keys) or len(other.keys) != len(base.keys):
            raise ValueError(f"the two models were judged on other questions ({len(base.keys)} and "
                             f"{len(other.keys)}, {len(set(base.keys) ^ set(other.keys))} not in both): judge both "
                             "on one workspace")
        row_of = {k: i for i, k in enumerate(other.keys)}
        order = torch.tensor([row_of[k] for k in base.keys])
        other = Verdicts(other.greedy[order], other.sampled[order], base.keys)
    g, g_se = paired_gain(base.greedy, other.greedy)
    out = {"greedy_gain": round(g, 4), "greedy_gain_se": _round(g_se)}
    if base.sampled.numel() and other.sampled.numel():
        s, s_se = paired_gain(base.sampled.mean(dim=1), other.sampled.mean(dim=1))
        out |= {"sampled_gain": round(s, 4), "sampled_gain_se": _round(s_se)}
    out["right_to_wrong"], out["wrong_to_right"] = flips(base.greedy, other.greedy)
    return out


def held_out_questions(root: Path, params, tokenizer, limit: int | None = None):
    """``(HeldOut, keys)``: the RL split's held-out prompts, then the SFT split's held-out rows where they carry
    an answer, the first ``limit`` of each, tokenised as the RL stage tokenises its prompts; ``keys`` names each
    question ``(split, position in the split, row id)``. A workspace whose prompts have no answers has nothing to
    judge: an error."""
    from rlhf_core.data.collate import encode_prompts
    from rlhf_core.evaluation import HeldOut
    from rlhf_core.ops import paths
    from rlhf_core.trainers.common import read_split

    prompts, answers, keys = [], [], []
    sources = [("rl_heldout", "prompts")]
    if (root / paths.prepared_file("sft", eval_split=True)).exists():
        sources.append(("sft_heldout", "sft"))
    for name, phase in sources:
        table = read_split(root, phase, eval_split=True)
        if "answer" not in table or all(a is None for a in table["answer"]):
            if phase == "prompts":
                raise ValueError(f"{root / paths.prepared_file(phase, eval_split=True)}: no answers, so no checker "
                                 "can judge these held-out questions")
            continue
        rows = [(i, p, a) for i, (p, a) in enumerate(zip(table["prompt"], table["answer"], strict=True))
                if a is not None][:limit]
        prompts += [p for _, p, _ in rows]
        answers += [a for _, _, a in rows]
        keys += [(name, i, str(table["id"][i])) for i, _, _ in rows]
    return HeldOut(prompts, answers, encode_prompts(tokenizer, prompts, params.data.max_prompt_len)), keys


def judge(model, tokenizer, params, questions, samples: int) -> Verdicts:
    """Greedy and ``samples`` sampled answers (at ``rlhf.temperature``, from :data:`JUDGE_SEED`) to every
    question, judged by ``eval.checker``."""
    from rlhf_core.evaluation import answer_batches
    from rlhf_core.rewards import get_checker

    check = get_checker(params.eval.checker)
    q = len(questions.prompts)

    def verdicts(data, temperature: float) -> torch.Tensor:
        right = torch.zeros(len(data.prompts))
        for rows, _, roll in answer_batches(model, tokenizer, data, params.eval.batch_size,
                                            params.eval.max_new_tokens, temperature):
            texts = zip(roll.texts, rows.tolist(), strict=True)
            right[rows] = torch.tensor([float(check(t, data.answers[j])) for t, j in texts])
        return right

    torch.manual_seed(JUDGE_SEED)
    with torch.inference_mode():
        sampled = verdicts(questions.repeat_each(samples), params.rlhf.temperature).view(q, samples) if samples \
            else torch.zeros(q, 0)
        greedy = verdicts(questions, 0.0)
    return Verdicts(greedy, sampled)


def read_verdicts(path: Path) -> dict[str, Verdicts]:
    """The per-question rows of ``path`` as one :class:`Verdicts` per model (in first-seen order), its questions
    in the order first seen; a model judged twice keeps its last verdict per question. A row that is not a judge
    row, or whose K differs from its model's first row's, is an error naming the line."""
    by_model: dict[str, dict[tuple, tuple[float, list[float]]]] = {}
    samples: dict[str, int] = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        try:
            row = json.loads(line)
            key = (str(row["split"]), int(row["position"]), str(row["id"]))
            greedy, sampled = row["greedy_right"], [float(v) for v in row["sampled_right"]]
            if not isinstance(greedy, bool) or any(v not in (0.0, 1.0) for v in sampled):
                raise TypeError("greedy_right must be true/false and sampled_right a list of 0/1")
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{n}: not a judge row ({type(e).__name__}: {e})") from None
        if samples.setdefault(row["model"], len(sampled)) != len(sampled):
            raise ValueError(f"{path}:{n}: {len(sampled)} sampled answers, but {row['model']}'s first row has "
                             f"{samples[row['model']]}")
        by_model.setdefault(row["model"], {})[key] = (float(greedy), sampled)
    return {model: Verdicts(torch.tensor([g for g, _ in rows.values()]),
                            torch.tensor([s for _, s in rows.values()]).view(len(rows), samples[model]),
                            tuple(rows))
            for model, rows in by_model.items()}


def judge_models(root: Path, samples: int, out: Path, models: list[str], limit: int | None = None) -> list[dict]:
    """Judge every model folder in ``models`` on ``root``'s held-out questions; append the per-question rows to
    ``out`` and return one summary per model. A folder is loaded as the stages load a policy
    (``load_causal_lm``): its manifest checked where it has one, an unmerged ``adapter/`` (an implicit-reward RM,
    a policy saved with ``compute.lora.merge_on_save: false``) applied and merged, so the policy judged is the one
    the folder holds, not its base weights alone."""
    from rlhf_core.config import load_params
    from rlhf_core.data.tokenizer import load_tokenizer
    from rlhf_core.models.loading import load_causal_lm
    from rlhf_core.ops import paths

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    params = load_params(root / "params.yaml")
    tokenizer = load_tokenizer(root / paths.SFT_MODEL, params.model.trust_remote_code)
    questions, keys = held_out_questions(root, params, tokenizer, limit)
    summaries = []
    for folder in models:
        t0 = time.perf_counter()
        model = load_causal_lm(folder, trust_remote_code=params.model.trust_remote_code)
        v = judge(model.to(device).eval(), tokenizer, params, questions, samples)
        with out.open("a") as fh:
            for q, (split, position, row_id) in enumerate(keys):
                fh.write(json.dumps({"model": str(folder), "question": q, "split": split, "position": position,
                                     "id": row_id, "greedy_right": bool(v.greedy[q]),
                                     "sampled_right": [int(x) for x in v.sampled[q].tolist()]}) + "\n")
        summaries.append({"model": str(folder)} | v.summary() | {"temperature": params.rlhf.temperature,
                                                                  "judge_s": round(time.perf_counter() - t0, 1)})
    return summaries


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="verb", required=True)
    j = sub.add_parser("judge", help="judge model folders; the first is the baseline of `compare`")
    j.add_argument("--workspace", type=Path, required=True)
    j.add_argument("--samples", type=int, default=4, help="sampled answers per question (0: greedy only)")
    j.add_argument("--out", type=Path, required=True, help="per-question rows, appended")
    j.add_argument("--limit", type=int, default=None, help="the first N questions of each split (a rehearsal)")
    j.add_argument("models", nargs="+")
    c = sub.add_parser("compare", help="each model's paired gains over the first model in the file")
    c.add_argument("rows", type=Path)
    a = ap.parse_args(argv)
    if a.verb == "judge":
        if not torch.cuda.is_available() and "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(1)
        for line in judge_models(a.workspace.resolve(), a.samples, a.out, a.models, a.limit):
            print(json.dumps(line), flush=True)
        return
    verdicts = read_verdicts(a.rows)
    names = list(verdicts)
    if not names:
        sys.exit(f"{a.rows}: no rows")
    for name in names[1:]:
        print(json.dumps({"model": name, "baseline": names[0], "questions": verdicts[name].greedy.numel()}
                         | compare(verdicts[names[0]], verdicts[name])), flush=True)


if __name__ == "__main__":
    main()
