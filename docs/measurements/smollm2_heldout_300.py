# ruff: noqa  -- a one-off measurement script, kept as it ran (figures: docs/results/smollm2.md)
"""Held-out accuracy on 300 questions instead of 100: a tighter figure for a RL actor (issue 27).

The RL stage judges its actor on the 100 prompts of eval_prompts.parquet (a standard error of about 3.4 points
at 87 %). This adds the SFT stage's 200 held-out questions (eval_sft.parquet: the same split, operand pairs and
phrasings that no training row has), judged exactly as the stage judges (eval settings of params.yaml, greedy,
the checker). Both sets are printed, and their union.
Run (on the GPU when there is one):  OMP_NUM_THREADS=1 python docs/measurements/smollm2_heldout_300.py WS MODEL_DIR...
(WS: a configs/smollm2.yaml workspace; prints one JSON row per model; HELDOUT_LIMIT=N judges only the first N of
each set, for a rehearsal)
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, "/work/main")
from transformers import AutoModelForCausalLM

from rlhf_core.evaluation import heldout_eval
from smollm2_questions import as_held_out, held_out_questions, judge_setup

ws = Path(sys.argv[1])
device, params, tok, limit = judge_setup(ws)
sets = {name: as_held_out(tok, params, *q) for name, q in held_out_questions(ws, params, tok, limit).items()}
for folder in sys.argv[2:]:
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(folder).to(device).eval()
    row = {"model": folder}
    with torch.inference_mode():
        for name, data in sets.items():
            out = heldout_eval(model, tok, data, params.eval, device)
            row[f"{name}_accuracy"] = out["accuracy"]
            row[f"{name}_n"] = len(data.prompts)
    n = row["rl_heldout_n"] + row["sft_heldout_n"]
    row["accuracy_300"] = (row["rl_heldout_accuracy"] * row["rl_heldout_n"]
                           + row["sft_heldout_accuracy"] * row["sft_heldout_n"]) / n
    row["s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(row), flush=True)
