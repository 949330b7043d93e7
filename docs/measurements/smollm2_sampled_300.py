# ruff: noqa  -- a one-off measurement script, kept as it ran (figures: docs/results/smollm2.md)
"""Sampled held-out accuracy: what GRPO optimises, on questions it never trained on (issue 27).

The stage judges the greedy answer. RL raises the chance that a *sampled* answer is right; if that gain does not
reach the greedy answer, the greedy judge shows churn while the model did learn. This judges each model on the
300 held-out questions of smollm2_heldout_300.py with K answers each, sampled as the RL stage samples
(`rlhf.temperature`, `eval.max_new_tokens`), and prints per model the sampled accuracy (mean over the 300 x K
answers), its standard error over questions (each question's K answers are one cluster), and the greedy
accuracy from the same run. The same torch seed for every model, so models differ by their weights only.
Run:  OMP_NUM_THREADS=1 python docs/measurements/smollm2_sampled_300.py WS K OUT.jsonl MODEL_DIR...
(WS: a configs/smollm2.yaml workspace; OUT: per model and question, the K verdicts; HELDOUT_LIMIT=N judges only
the first N of each set, for a rehearsal)
Compare:  python docs/measurements/smollm2_sampled_300.py compare OUT.jsonl  (per model after the first: the
sampled and greedy gains over the first, each with its standard error over the questions, paired)
Its maintained form, which also pairs the questions by id and runs after every benchmark run:
python -m benchmarks.heldout (and benchmarks.learning --judge K; docs/benchmarks.md).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, "/work/main")
from transformers import AutoModelForCausalLM

from rlhf_core.evaluation import answer_batches
from rlhf_core.rewards.checkers import get_checker
from smollm2_questions import as_held_out, flatten, held_out_questions, judge_setup

if sys.argv[1] == "compare":
    rows = [json.loads(line) for line in open(sys.argv[2])]
    models = list(dict.fromkeys(r["model"] for r in rows))
    by = {m: {r["question"]: r for r in rows if r["model"] == m} for m in models}
    base = by[models[0]]
    for m in models[1:]:
        qs = sorted(set(base) & set(by[m]))
        out = {"model": m, "baseline": models[0], "questions": len(qs)}
        for name, value in (("sampled", lambda r: sum(r["sampled_right"]) / len(r["sampled_right"])),
                            ("greedy", lambda r: float(r["greedy_right"]))):
            d = torch.tensor([value(by[m][q]) - value(base[q]) for q in qs], dtype=torch.float64)
            out[f"{name}_gain"] = round(float(d.mean()), 4)
            out[f"{name}_gain_se"] = round(float(d.std() / len(qs) ** 0.5), 4)
        print(json.dumps(out))
    sys.exit(0)
ws, K, out_path = Path(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
device, params, tok, limit = judge_setup(ws)
check = get_checker(params.eval.checker)
prompts, answers = flatten(held_out_questions(ws, params, tok, limit))
Q = len(prompts)
repeated = as_held_out(tok, params, [p for p in prompts for _ in range(K)], [a for a in answers for _ in range(K)])
once = as_held_out(tok, params, prompts, answers)


def verdicts(model, data, temperature: float) -> torch.Tensor:
    right = torch.zeros(len(data.prompts))
    for rows, _, roll in answer_batches(model, tok, data, params.eval.batch_size, params.eval.max_new_tokens,
                                        temperature):
        right[rows] = torch.tensor([float(check(t, data.answers[j])) for t, j in zip(roll.texts, rows.tolist())])
    return right


with out_path.open("w") as out:
    for folder in sys.argv[4:]:
        t0 = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(folder).to(device).eval()
        torch.manual_seed(20261129)
        with torch.inference_mode():
            sampled = verdicts(model, repeated, params.rlhf.temperature).view(Q, K)
            greedy = verdicts(model, once, 0.0)
        per_question = sampled.mean(dim=1)
        for q in range(Q):
            out.write(json.dumps({"model": folder, "question": q, "sampled_right": sampled[q].tolist(),
                                  "greedy_right": bool(greedy[q])}) + "\n")
        print(json.dumps({"model": folder, "questions": Q, "k": K, "temperature": params.rlhf.temperature,
                          "sampled_accuracy": round(float(per_question.mean()), 4),
                          "sampled_se": round(float(per_question.std() / Q ** 0.5), 4),
                          "pass_at_k": round(float((sampled.max(dim=1).values).mean()), 4),
                          "greedy_accuracy": round(float(greedy.mean()), 4),
                          "s": round(time.perf_counter() - t0, 1)}), flush=True)
