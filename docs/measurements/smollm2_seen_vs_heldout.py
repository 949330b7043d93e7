# ruff: noqa  -- a one-off measurement script, kept as it ran (figures: docs/results/smollm2.md)
"""Does RL move the greedy answers on the prompts it trained on, or only fail to generalise? (issue 27)

Measures each model folder exactly as the RL stage measures its actor (eval settings of params.yaml, greedy,
the checker), on the stage's held-out prompts and on the first N of the RL training prompts (prompts.parquet),
which a run of >= 38 iterations x 16 prompts has sampled at least once.
Run:  OMP_NUM_THREADS=1 python docs/measurements/smollm2_seen_vs_heldout.py WS N MODEL_DIR...
(WS: a configs/smollm2.yaml workspace; prints one JSON row per model)
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, "/work/main")
from transformers import AutoModelForCausalLM

from rlhf_core.config import load_params
from rlhf_core.data.collate import encode_prompts
from rlhf_core.data.tokenizer import load_tokenizer
from rlhf_core.evaluation import HeldOut, heldout_eval
from rlhf_core.trainers.rlhf.inputs import load_prompts

ws, n = Path(sys.argv[1]), int(sys.argv[2])
torch.set_num_threads(1)
params = load_params(ws / "params.yaml")
tok = load_tokenizer(ws / "models/sft")
prompts = load_prompts(params, ws, tok)
texts = list(prompts.texts[:n])
seen = HeldOut(texts, list(prompts.answers[:n]), encode_prompts(tok, texts, params.data.max_prompt_len))
for folder in sys.argv[3:]:
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    row = {"model": folder}
    with torch.inference_mode():
        for name, data in (("heldout", prompts.heldout), ("seen", seen)):
            out = heldout_eval(model, tok, data, params.eval, torch.device("cpu"))
            row[f"{name}_accuracy"] = out["accuracy"]
            row[f"{name}_n"] = len(data.prompts)
    row["s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(row), flush=True)
