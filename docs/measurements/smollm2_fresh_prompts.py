# ruff: noqa  -- a one-off measurement script, kept as it ran (figures: docs/results/smollm2.md)
"""Replace a workspace's RL prompts by N fresh ones that no stage has seen (issue 27).

The arithmetic generator is deterministic in project.seed, so generate(n_train + N, ...) repeats the workspace's
n_train training rows and then draws N more from the same distribution (training phrasings and operand pairs,
never the held-out ones: is_held_out does not depend on n_train). Those N become data/prepared/prompts.parquet
(same columns as prepare writes; duplicates of a prompt dropped) and the manifest's hash is updated, so an RL run
of up to N / prompts_per_step iterations never repeats a prompt and has seen none in SFT or the RM's pairs.
Run:  python docs/measurements/smollm2_fresh_prompts.py WS N
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pandas as pd

sys.path.insert(0, "/work/main")
from rlhf_core.config import load_params
from rlhf_core.data.tokenizer import chat_renderer, load_tokenizer
from rlhf_core.ops.integrity import sha256_file
from rlhf_core.rewards import arithmetic

ws, n = Path(sys.argv[1]), int(sys.argv[2])
params = load_params(ws / "params.yaml")
a = params.data.arithmetic
render = chat_renderer(load_tokenizer(ws / "models/base"))
train, _ = arithmetic.generate(a.n_train + n, a.n_held_out, a.max_operand, list(a.ops), params.project.seed,
                               a.held_out_pair_share, a.held_out_phrasings, render)
old = {r["prompt"] for r in train[: a.n_train]}
was = set(pd.read_parquet(ws / "data/prepared/prompts.parquet").prompt)
assert was <= old, f"{len(was - old)} of the workspace's RL prompts are not regenerated: another seed or template"
fresh = [r for r in train[a.n_train:] if r["prompt"] not in old]
df = pd.DataFrame({"id": [r["id"] for r in fresh], "prompt": [r["prompt"] for r in fresh],
                   "answer": [r["answer"] for r in fresh], "source": "arithmetic"}).drop_duplicates("prompt")
out = ws / "data/prepared/prompts.parquet"
df.to_parquet(out, index=False)
manifest = json.loads((ws / "data/prepared/manifest.json").read_text())
manifest["hashes"]["prompts.parquet"] = sha256_file(out)
manifest["counts"]["prompts"] = len(df)
(ws / "data/prepared/manifest.json").write_text(json.dumps(manifest, indent=2))
print(json.dumps({"workspace": str(ws), "fresh_prompts": len(df), "seen_overlap": len(old & set(df.prompt))}))
