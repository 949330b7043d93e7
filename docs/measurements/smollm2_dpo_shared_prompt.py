# ruff: noqa  -- a one-off measurement script, kept as it ran (figures: docs/results/smollm2.md)
"""One training step of the DPO implicit-reward RM on SmolLM2 (rm.objective: dpo), from the full rows against
the pair layout (each pair's prompt once, logits at the response positions only), alternating, in one process.

A step: dpo_scores over 16 pairs (policy pass with gradients, reference pass without), the pairwise loss,
backward; LoRA r 16 on every linear layer as configs/smollm2.yaml. Peak memory: the process's max RSS growth over
each variant's first step (ru_maxrss only rises: the full rows run first, so the second variant's figure is the
max of the two; the first step's growth is reported for the full rows, the layout's from a fresh process).
Run:  OMP_NUM_THREADS=2 python docs/measurements/smollm2_dpo_shared_prompt.py WS [--variant both|full|shared]
(WS: a configs/smollm2.yaml workspace with models/sft and data/prepared; reads only)
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

import pandas as pd
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from rlhf_core.algos import pairwise_rm_loss
from rlhf_core.config import load_params
from rlhf_core.data.collate import collate_pairs
from rlhf_core.data.tokenizer import load_tokenizer
from rlhf_core.models.loading import apply_lora, load_causal_lm
from rlhf_core.trainers.rm import encode_pairs
from rlhf_core.trainers.rm_objectives import dpo_scores

ap = argparse.ArgumentParser()
ap.add_argument("ws")
ap.add_argument("--variant", default="both")
ap.add_argument("--steps", type=int, default=3)
args = ap.parse_args()
ws = Path(args.ws)
params = load_params(ws / "params.yaml")
tok = load_tokenizer(ws / "models/sft")
model = apply_lora(load_causal_lm(ws / "models/sft"), params.compute.lora).train()
df = pd.read_parquet(ws / "data/prepared/pairs.parquet")
rows = {k: df[k].tolist() for k in ("prompt", "chosen", "rejected")}
rows["id"] = [str(i) for i in range(len(df))]
data = encode_pairs(tok, rows, params.data.max_prompt_len + params.data.max_response_len, "pairs.parquet")
score = dpo_scores(params.rm.beta)
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.0)  # lr 0: the same model each step
variants = ["full", "shared"] if args.variant == "both" else [args.variant]
for step in range(args.steps):
    idx = torch.arange(step * 16, step * 16 + 16)
    batch = collate_pairs(data, idx, tok.pad_token_id)
    for v in variants:
        b = batch if v == "shared" else {k: batch[k] for k in ("input_ids", "attention_mask", "response_mask")}
        rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        t = time.perf_counter()
        s = score(model, b, "cpu")
        loss, _ = pairwise_rm_loss(*s.float().chunk(2), 0.0)
        loss.backward()
        opt.step(); opt.zero_grad()
        row = {"variant": v, "step": step, "s": round(time.perf_counter() - t, 2), "loss": round(float(loss), 6),
               "rows": tuple(batch["input_ids"].shape), "prefix": tuple(batch["prefix_ids"].shape),
               "suffix": tuple(batch["suffix_ids"].shape), "threads": torch.get_num_threads(),
               "max_rss_growth_mb": round((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024)}
        print(json.dumps(row), flush=True)
