# ruff: noqa  -- a one-off measurement script, kept as it ran (figures: docs/results/smollm2.md)
"""Is the preference information in the SFT policy?  Forward passes only.

For every preference pair (held-out eval pairs, and the first 200 training pairs) compute the summed log-prob of
the response tokens (response + EOS, tokenised exactly as rlhf_core's RM does: encode_sequences with keep_eos) under
the SFT model and the base model, and report pairwise accuracies of several likelihood-based scores.

Run:  . .venv/bin/activate && OMP_NUM_THREADS=1 python docs/measurements/smollm2_logp_pairs.py  (WS: a finished configs/smollm2.yaml workspace)
(reads only; writes /tmp/rmx/logp_pairs.txt and /tmp/rmx/logp_pairs.jsonl)
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import defaultdict

os.environ.setdefault("OMP_NUM_THREADS", "1")
import pandas as pd  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402

sys.path.insert(0, "/work/main")
from rlhf_core.data.collate import encode_sequences  # noqa: E402  (the RM's own tokenisation)
from rlhf_core.data.tokenizer import load_tokenizer  # noqa: E402
from rlhf_core.rewards import arithmetic  # noqa: E402

torch.set_num_threads(1)
WS = "/tmp/ws1"
OUT_TXT = "/tmp/rmx/logp_pairs.txt"
OUT_JSONL = "/tmp/rmx/logp_pairs.jsonl"
BATCH = 16
N_TRAIN = 200

lines: list[str] = []


def say(s: str = "") -> None:
    print(s, flush=True)
    lines.append(s)


t0 = time.time()
params = yaml.safe_load(open(f"{WS}/params.yaml"))
dcfg = params["data"]
max_length = dcfg["max_prompt_len"] + dcfg["max_response_len"] + 2  # rm.max_length null -> data limits + 2

tok = load_tokenizer(f"{WS}/models/base")  # what load_training_tokenizer returns (pad != eos, left padding)
say(f"tokenizer: eos={tok.eos_token!r}({tok.eos_token_id}) pad={tok.pad_token!r}({tok.pad_token_id}) "
    f"bos={tok.bos_token!r}({tok.bos_token_id}); rm max_length={max_length}")

evals = pd.read_parquet(f"{WS}/data/prepared/eval_pairs.parquet")
train_all = pd.read_parquet(f"{WS}/data/prepared/pairs.parquet")
train = train_all.iloc[:N_TRAIN].reset_index(drop=True)
say(f"held-out eval pairs: {len(evals)}   training pairs: {len(train_all)} (using first {len(train)})")

# ---- provenance of each rejected answer: regenerate the synthetic near misses (deterministic in the seed) and
# call a pair 'base_sampled' where its rejected differs from the near miss prepare drew for that id.
a = dcfg["arithmetic"]
gen_train, gen_held = arithmetic.generate(a["n_train"], a["n_held_out"], a["max_operand"], a.get("ops", ["+", "-"]),
                                          params["project"]["seed"], a["held_out_pair_share"],
                                          a["held_out_phrasings"], render=lambda m: m[0]["content"])
gen = {r["id"]: r for r in gen_train + gen_held}


def provenance(df: pd.DataFrame) -> list[str]:
    kinds, mismatched_q = [], 0
    for row in df.itertuples():
        g = gen.get(row.id)
        if g is None or g["prompt"] not in row.prompt or g["answer"] != row.answer:
            mismatched_q += 1
            kinds.append("unknown")
        else:
            kinds.append("near_miss" if g["rejected"] == row.rejected else "base_sampled")
    if mismatched_q:
        say(f"  WARNING: {mismatched_q} rows could not be matched to the regenerated data")
    return kinds


for name, df in (("eval", evals), ("train", train)):
    df["kind"] = provenance(df)
    df["diff"] = [abs(int(c) - int(r)) for c, r in zip(df.chosen, df.rejected, strict=True)]
    df["gap"] = ["|d|=1" if d == 1 else "|d|=2" if d == 2 else "|d|=10" if d == 10 else "other" for d in df["diff"]]
    say(f"{name}: rejected kinds {df.kind.value_counts().to_dict()}; |chosen-rejected| "
        f"{df['gap'].value_counts().to_dict()}")
say(f"(all {len(train_all)} training pairs: {pd.Series(provenance(train_all)).value_counts().to_dict()})")

say("\nFive held-out examples (prompt tail | chosen | rejected | kind):")
for row in evals.sample(5, random_state=0).itertuples():
    q = row.prompt.split("<|im_start|>user\n")[-1].replace("<|im_end|>\n<|im_start|>assistant\n", " [asst]")
    say(f"  {row.id:18s} ...{q[-80:]!r} | {row.chosen!r} | {row.rejected!r} | {row.kind}")

# ---- tokenisation as the RM does it
ex = encode_sequences(tok, [evals.prompt[0]], [evals.chosen[0]], max_length, "eval", "rm.max_length", keep_eos=True)
ids = ex.tokens.flat.tolist()
resp = [t for t, m in zip(ids, ex.response_mask.tolist(), strict=True) if m]
say(f"\nexample row tokens: {len(ids)} (prompt {int(ex.prompt_lens[0])}); first ids {ids[:3]}; response ids {resp} "
    f"= {tok.convert_ids_to_tokens(resp)}")


@torch.no_grad()
def response_logps(model, prompts, responses) -> tuple[list[float], list[float], list[int]]:
    """Per row: summed log-prob of response tokens incl. EOS, same without EOS, number of response tokens."""
    seqs = encode_sequences(tok, list(prompts), list(responses), max_length, "pairs", "rm.max_length", keep_eos=True)
    assert seqs.truncated == 0
    from rlhf_core.data.collate import Ragged
    mask_r = Ragged(seqs.response_mask.long(), seqs.tokens.offsets)
    out_all, out_noeos, out_n = [], [], []
    n = len(seqs)
    for i in range(0, n, BATCH):
        idx = torch.arange(i, min(n, i + BATCH))
        ids, valid = seqs.tokens.pad(idx, pad_value=tok.pad_token_id, side="right")
        rmask, _ = mask_r.pad(idx, pad_value=0, side="right")
        logits = model(input_ids=ids, attention_mask=valid.long()).logits.float()
        lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        tgt = rmask[:, 1:].bool() & valid[:, 1:]
        is_eos = ids[:, 1:] == tok.eos_token_id
        out_all += (lp * tgt).sum(1).tolist()
        out_noeos += (lp * (tgt & ~is_eos)).sum(1).tolist()
        out_n += tgt.sum(1).tolist()
    return out_all, out_noeos, out_n


from transformers import AutoModelForCausalLM  # noqa: E402

res: dict[str, dict[str, dict[str, list]]] = defaultdict(dict)
for mname in ("sft", "base"):
    t = time.time()
    model = AutoModelForCausalLM.from_pretrained(f"{WS}/models/{mname}", dtype=torch.float32).eval()
    for name, df in (("eval", evals), ("train", train)):
        c = response_logps(model, df.prompt, df.chosen)
        r = response_logps(model, df.prompt, df.rejected)
        res[mname][name] = {"c": c, "r": r}
    say(f"{mname}: forward passes {time.time() - t:.1f}s")
    del model

SCORES = ["sft_sum", "sft_mean", "sft_sum_noeos", "base_sum", "base_mean", "ratio_sft_base", "ratio_mean"]


def scores(mname_res, name, side):
    s, s_noeos, n = res["sft"][name][side]
    b, b_noeos, nb = res["base"][name][side]
    assert n == nb
    return {
        "sft_sum": s, "sft_mean": [x / k for x, k in zip(s, n, strict=False)], "sft_sum_noeos": s_noeos,
        "base_sum": b, "base_mean": [x / k for x, k in zip(b, n, strict=False)],
        "ratio_sft_base": [x - y for x, y in zip(s, b, strict=False)], "ratio_mean": [(x - y) / k for x, y, k in zip(s, b, n, strict=False)],
        "n_tok": n,
    }


jsonl = open(OUT_JSONL, "w")
say("\nPairwise accuracy = share of pairs with score(chosen) > score(rejected) (ties count half)")
say("scores: sum/mean of log p(response+EOS | prompt); sum_noeos drops the EOS term; ratio = logp_sft - logp_base "
    "(DPO implicit reward, beta=1)")
for name, df in (("eval", evals), ("train", train)):
    C, R = scores(res, name, "c"), scores(res, name, "r")
    wins = {k: [1.0 if c > r else 0.5 if c == r else 0.0 for c, r in zip(C[k], R[k], strict=False)] for k in SCORES}
    for i, row in enumerate(df.itertuples()):
        rec = {"split": name, "id": row.id, "chosen": row.chosen, "rejected": row.rejected, "kind": row.kind,
               "abs_diff": int(row.diff), "n_tok_chosen": C["n_tok"][i], "n_tok_rejected": R["n_tok"][i]}
        for k in SCORES:
            rec[f"{k}_chosen"] = round(C[k][i], 5)
            rec[f"{k}_rejected"] = round(R[k][i], 5)
        jsonl.write(json.dumps(rec) + "\n")
    groups = [("all", [True] * len(df))]
    groups += [(f"kind={k}", list(df.kind == k)) for k in sorted(df.kind.unique())]
    groups += [(f"gap {g}", list(df["gap"] == g)) for g in ("|d|=1", "|d|=2", "|d|=10", "other") if (df["gap"] == g).any()]
    say(f"\n[{name}]")
    say(f"{'subset':22s} {'n':>4s} " + " ".join(f"{k:>14s}" for k in SCORES))
    for gname, sel in groups:
        m = sum(sel)
        accs = [sum(w for w, s in zip(wins[k], sel, strict=False) if s) / m for k in SCORES]
        say(f"{gname:22s} {m:4d} " + " ".join(f"{x:14.3f}" for x in accs))
    # margin summary
    d = [c - r for c, r in zip(C["sft_sum"], R["sft_sum"], strict=False)]
    say(f"sft_sum margin chosen-rejected: mean {sum(d) / len(d):+.3f} nats; "
        f"mean logp chosen {sum(C['sft_sum']) / len(d):.3f}, rejected {sum(R['sft_sum']) / len(d):.3f}; "
        f"p(chosen) > 0.5 in {sum(x > -0.6931 for x in C['sft_sum_noeos'])}/{len(d)}")
jsonl.close()
say(f"\nwall time {time.time() - t0:.1f}s")
open(OUT_TXT, "w").write("\n".join(lines) + "\n")
