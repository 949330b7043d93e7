# ruff: noqa  -- a one-off measurement script, kept as it ran (figures: docs/results/smollm2.md)
"""Where SFT's held-out errors are, and what RL changes: per question, not only the mean (issue 27).

Judges each model greedily on the 300 held-out questions of smollm2_heldout_300.py (the RL stage's 100 plus the
SFT split's 200), as the stage judges, and keeps every answer. Each question is tagged by its operation (from
the operands and the answer), by whether it needs a carry or a borrow in the ones digit, by its phrasing
(the user turn with every number replaced by '#') and by whether a training row used that phrasing; each wrong
worked answer by its first wrong step. Prints, per model, the accuracy of each set and by tag, and for every
model after the first the flips against the first (right -> wrong, wrong -> right): a gain is fewer errors,
churn is many flips both ways.
Run:  OMP_NUM_THREADS=1 python docs/measurements/smollm2_error_taxonomy.py WS OUT.jsonl MODEL_DIR...
(WS: a configs/smollm2.yaml workspace; OUT: one row per model and question; the first model is the baseline;
HELDOUT_LIMIT=N judges only the first N of each set, for a rehearsal)
"""

from __future__ import annotations

import collections
import json
import re
import sys
import time
from pathlib import Path

import pandas as pd
import torch

sys.path.insert(0, "/work/main")
from transformers import AutoModelForCausalLM

from rlhf_core.evaluation import answer_batches
from rlhf_core.rewards.checkers import get_checker
from smollm2_questions import as_held_out, flatten, held_out_questions, judge_setup

ws, out_path = Path(sys.argv[1]), Path(sys.argv[2])
device, params, tok, limit = judge_setup(ws)
check = get_checker(params.eval.checker)


def user_turn(prompt: str) -> str:
    return prompt.split("<|im_start|>user\n")[-1].split("<|im_end|>")[0]


def phrasing(prompt: str) -> str:
    return re.sub(r"\d+", "#", user_turn(prompt))


# the phrasings of every training row (SFT, pairs, RL prompts): a held-out question is asked in one of them (its
# operand pair held out) or in a held-out phrasing
training_phrasings = {phrasing(p) for f in (ws / "data/prepared").glob("*.parquet") if not f.name.startswith("eval")
                      for p in pd.read_parquet(f, columns=["prompt"])["prompt"]}


def tags(prompt: str, answer: str) -> dict:
    text = user_turn(prompt)
    a, b = (int(x) for x in re.findall(r"\d+", text)[:2])
    ans = int(answer)
    if ans == a + b:
        op, carry = "plus", (a % 10 + b % 10) >= 10
    elif ans in (a - b, b - a):
        hi, lo = max(a, b), min(a, b)
        op, carry = "minus", (hi % 10) < (lo % 10)
    else:
        op, carry = "other", False
    return {"op": op, "carry": carry, "phrasing": phrasing(prompt),
            "training_phrasing": phrasing(prompt) in training_phrasings}


def error_kind(completion: str) -> str:
    """Of a wrong worked answer: the first step whose own arithmetic is wrong, else the operands or operation."""
    steps = re.findall(r"(\d+)\s*([+-])\s*(\d+)\s*=\s*(\d+)", completion)
    if not steps:
        return "no equation"
    for i, (x, op, y, z) in enumerate(steps, 1):
        if (int(x) + int(y) if op == "+" else int(x) - int(y)) != int(z):
            return f"step {i} arithmetic"
    return "operands or operation"


questions = held_out_questions(ws, params, tok, limit)
n_rl = len(questions["rl_heldout"][0])
prompts, answers = flatten(questions)
answers = [str(a) for a in answers]
data = as_held_out(tok, params, prompts, answers)
qtags = [tags(p, a) for p, a in zip(prompts, answers)]


def tally(ok: list[bool], keys_of) -> dict[str, list[int]]:
    """``{key: [right, asked]}`` over the questions, each counted under every key ``keys_of(its tags)`` gives."""
    counts = collections.defaultdict(lambda: [0, 0])
    for t, c in zip(qtags, ok):
        for key in keys_of(t):
            counts[key][0] += c
            counts[key][1] += 1
    return counts


base: list[bool] | None = None  # the first model's judgements, which the others' flips are counted against
with out_path.open("w") as out:
    for folder in sys.argv[3:]:
        t0 = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(folder).to(device).eval()
        ok = [False] * len(prompts)
        kinds = collections.Counter()
        with torch.inference_mode():
            for rows, _, roll in answer_batches(model, tok, data, params.eval.batch_size, params.eval.max_new_tokens):
                for j, text in zip(rows.tolist(), roll.texts):
                    ok[j] = bool(check(text, answers[j]))
                    if not ok[j]:
                        kinds[error_kind(text)] += 1
                    out.write(json.dumps({"model": folder, "q": j, "answer": answers[j], "completion": text,
                                          "correct": ok[j], **qtags[j]}) + "\n")
        by = tally(ok, lambda t: (f"op={t['op']}", f"carry={t['carry']}", f"op={t['op']},carry={t['carry']}",
                                  f"training_phrasing={t['training_phrasing']}"))
        row = {"model": folder, "rl_heldout_accuracy": sum(ok[:n_rl]) / n_rl, "rl_heldout_n": n_rl,
               "sft_heldout_accuracy": sum(ok[n_rl:]) / (len(ok) - n_rl), "sft_heldout_n": len(ok) - n_rl,
               "accuracy_300": sum(ok) / len(ok),
               "by_tag": {k: f"{v[0]}/{v[1]}" for k, v in sorted(by.items())}, "error_kinds": dict(kinds),
               "s": round(time.perf_counter() - t0, 1)}
        if base is None:
            base = ok
        else:
            row["right_to_wrong"] = sum(b and not c for b, c in zip(base, ok))
            row["wrong_to_right"] = sum(c and not b for b, c in zip(base, ok))
        phr = tally(ok, lambda t: (t["phrasing"],))
        worst = sorted((v[0] / v[1], f"{v[0]}/{v[1]}", k) for k, v in phr.items() if v[1] >= 5)[:6]
        row["worst_phrasings"] = [[right, k] for _, right, k in worst]
        print(json.dumps(row), flush=True)
