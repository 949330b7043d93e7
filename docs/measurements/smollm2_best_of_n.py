# ruff: noqa  -- a measurement script, kept as it ran (figures: docs/results/smollm2.md)
"""`rm.best_of_n`'s check (rlhf_core/trainers/rm_selection.py) for several RM folders on the same answers (issue 27).

The policy of WS (models/sft) answers each held-out RL prompt N times as RL samples (seed SEED) and once greedily,
with the log-probability of each answer; they are kept in WS/best_of_n_N_SEED.json and reused by later calls, so
RMs trained later are judged on the very same answers. Each RM folder given scores them all; one JSON row per RM:
the table of rlhf_core.algos.selection.best_of_n, the greedy accuracy, the RM's pick among the greedy answer and
the N samples (`rm_over_greedy`), and the KL-regularised optimum's pick (`rm_kl`, selection.keep_default on
r / sigma + beta log pi_ref, sigma the scores' std as GRPO's scale) for a range of beta.
Run:  OMP_NUM_THREADS=1 python docs/measurements/smollm2_best_of_n.py WS N SEED RM_DIR [RM_DIR ...]
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, "/work/main")
from rlhf_core.algos.selection import best_of_n, keep_default
from rlhf_core.config import load_params
from rlhf_core.data.tokenizer import load_tokenizer
from rlhf_core.models import load_causal_lm
from rlhf_core.models.scorer import load_scorer
from rlhf_core.passes.generation import GenerationConfig
from rlhf_core.rewards.checkers import ANSWER_OF, get_checker
from rlhf_core.trainers.rlhf.inputs import load_prompts
from rlhf_core.trainers.rm_selection import answer_ids, sample_answers

BETAS = (0.0, 0.01, 0.02, 0.04, 0.1, 0.2, 0.5, 1.0)
ws, N, seed = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
torch.set_num_threads(1)
params = load_params(ws / "params.yaml")
tok = load_tokenizer(ws / "models/sft")
held = load_prompts(params, ws, tok).heldout
cache, t0 = ws / f"best_of_n_{N}_{seed}.json", time.perf_counter()
if cache.is_file():
    kept = json.loads(cache.read_text())
else:
    model, T = load_causal_lm(ws / "models/sft").eval(), params.rlhf.temperature
    greedy, greedy_logp = sample_answers(model, tok, held, 1, GenerationConfig(params.eval.max_new_tokens, T,
                                                                               do_sample=False), 50)
    torch.manual_seed(seed)
    texts, logp = sample_answers(model, tok, held, N, GenerationConfig(params.rlhf.max_new_tokens, T,
                                                                       params.rlhf.top_p, True), 50 // N or 1)
    kept = {"greedy": [r[0] for r in greedy], "greedy_logp": greedy_logp[:, 0].tolist(), "texts": texts,
            "logp": logp.tolist()}
    cache.write_text(json.dumps(kept))
gen_s = time.perf_counter() - t0
texts, greedy = kept["texts"], kept["greedy"]
logp = torch.tensor([[g, *row] for g, row in zip(kept["greedy_logp"], kept["logp"])], dtype=torch.float64)
check, answer_of = get_checker(params.eval.checker), ANSWER_OF[params.eval.checker]
correct = torch.tensor([[check(t, a) for t in row] for row, a in zip(texts, held.answers)])
ids = answer_ids([[answer_of(t) for t in row] for row in texts])
greedy_ok = torch.tensor([check(t, a) for t, a in zip(greedy, held.answers)])
for rm_dir in sys.argv[4:]:
    t0 = time.perf_counter()
    with torch.inference_mode():
        s = load_scorer(rm_dir, device="cpu", batch_size=32).score_responses(
            [p for p in held.prompts for _ in range(N + 1)],
            [t for g, row in zip(greedy, texts) for t in (g, *row)]).double().view(-1, N + 1)
    sigma = float(s[:, 1:].std())
    rm_kl = {b: keep_default(greedy_ok, (s / sigma + b * logp)[:, 0], correct, (s / sigma + b * logp)[:, 1:])
             for b in BETAS}
    print(json.dumps({"workspace": str(ws), "rm": rm_dir, "n": N, "seed": seed, "prompts": len(texts),
                      "greedy": float(greedy_ok.double().mean()), "sigma": sigma,
                      "rm_over_greedy": keep_default(greedy_ok, s[:, 0], correct, s[:, 1:]), "rm_kl": rm_kl,
                      **best_of_n(correct, s[:, 1:], ids), "generate_s": round(gen_s, 1),
                      "score_s": round(time.perf_counter() - t0, 1)}), flush=True)
