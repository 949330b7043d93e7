# ruff: noqa  -- a one-off measurement script, kept as it ran (figures: docs/results/smollm2.md)
"""The held-out accuracy of the DPO policy inside the implicit-reward RM (issue 27).

With the implicit reward r = beta_rm * log(pi_dpo / pi_ref), the KL-regularised RL optimum is
pi_ref * (pi_dpo / pi_ref)^(beta_rm / beta_kl): at grpo.beta = rm.beta it is the DPO policy itself. This reads that
policy (models/rm: the reference weights + adapter/), merges the adapter, and measures it exactly as the RL stage
measures its actor (held-out prompts of the stage, eval settings of params.yaml, the greedy checker), beside
models/sft through the same code.
Run:  OMP_NUM_THREADS=1 python docs/measurements/smollm2_dpo_policy.py WS   (WS: a configs/smollm2.yaml workspace
with its implicit-reward RM; reads only; prints one JSON row per model)
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, "/work/main")
from peft import PeftModel
from transformers import AutoModelForCausalLM

from rlhf_core.config import load_params
from rlhf_core.data.tokenizer import load_tokenizer
from rlhf_core.evaluation import heldout_eval
from rlhf_core.trainers.rlhf.inputs import load_prompts

ws = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/ws1")
torch.set_num_threads(1)
params = load_params(ws / "params.yaml")
tok = load_tokenizer(ws / "models/sft")
prompts = load_prompts(params, ws, tok)
for name in ("sft", "dpo_policy"):
    t0 = time.perf_counter()
    if name == "sft":
        model = AutoModelForCausalLM.from_pretrained(ws / "models/sft")
    else:
        base = AutoModelForCausalLM.from_pretrained(ws / "models/rm")
        model = PeftModel.from_pretrained(base, ws / "models/rm/adapter").merge_and_unload()
    model.eval()
    with torch.inference_mode():
        out = heldout_eval(model, tok, prompts.heldout, params.eval, torch.device("cpu"))
    print(json.dumps({"model": name, "workspace": str(ws), **out, "n": len(prompts.heldout.prompts),
                      "s": round(time.perf_counter() - t0, 1)}), flush=True)
