# ruff: noqa  -- a one-off measurement script, kept as it ran (figures: docs/results/smollm2.md)
"""Does a reward read through the LM head generalise where a fresh score head does not?  (issue 27)

The SFT policy's own log-likelihood ranks 70/100 held-out pairs; the trained score-head RM 53-56.  Here a LoRA
adapter (same r 16 on every linear layer, as the RM) on the SFT model is trained on the same 600 preference pairs
with DPO's loss (Rafailov et al. 2023), and two rewards are read from it on the 100 held-out pairs as it trains:

- implicit (DPO): r(x, y) = beta * [log pi(y|x) - log pi_sft(y|x)]  (pi_sft: the adapter disabled)
- reference-free: r(x, y) = log pi(y|x)   (starts at the SFT policy's 0.70)

log pi(y|x) sums response + EOS, tokenised as the RM tokenises pairs (encode_sequences, keep_eos).
Run:  OMP_NUM_THREADS=2 python docs/measurements/smollm2_implicit_rm.py [WS] [--lr 2e-4 --beta 0.1 --epochs 1]
(WS: a finished configs/smollm2.yaml workspace; reads only; prints rows and writes /tmp/rmx/implicit_rm.jsonl)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import pandas as pd
import torch
import torch.nn.functional as F
import yaml

sys.path.insert(0, "/work/main")
from rlhf_core.data.collate import Ragged, encode_sequences
from rlhf_core.data.tokenizer import load_tokenizer

ap = argparse.ArgumentParser()
ap.add_argument("ws", nargs="?", default="/tmp/ws1")
ap.add_argument("--lr", type=float, default=2e-4)
ap.add_argument("--beta", type=float, default=0.1)
ap.add_argument("--epochs", type=int, default=1)
ap.add_argument("--batch", type=int, default=16)
ap.add_argument("--eval-every", type=int, default=10)
ap.add_argument("--seed", type=int, default=1234)
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--out", default="/tmp/rmx/implicit_rm.jsonl")
args = ap.parse_args()
torch.manual_seed(args.seed)
torch.set_num_threads(args.threads)
os.makedirs(os.path.dirname(args.out), exist_ok=True)
out = open(args.out, "a")


def emit(rec: dict) -> None:
    rec = {"lr": args.lr, "beta": args.beta, "seed": args.seed, **rec}
    print(json.dumps(rec), flush=True)
    out.write(json.dumps(rec) + "\n")
    out.flush()


t0 = time.time()
params = yaml.safe_load(open(f"{args.ws}/params.yaml"))
d = params["data"]
max_length = d["max_prompt_len"] + d["max_response_len"] + 2
tok = load_tokenizer(f"{args.ws}/models/base")
train = pd.read_parquet(f"{args.ws}/data/prepared/pairs.parquet")
held = pd.read_parquet(f"{args.ws}/data/prepared/eval_pairs.parquet")


def encode(df: pd.DataFrame, side: str):
    s = encode_sequences(tok, list(df.prompt), list(getattr(df, side)), max_length, side, "rm.max_length",
                         keep_eos=True)
    assert s.truncated == 0
    return s.tokens, Ragged(s.response_mask.long(), s.tokens.offsets)


def logps(model, seqs, idx: torch.Tensor) -> torch.Tensor:
    tokens, rmask = seqs
    ids, valid = tokens.pad(idx, pad_value=tok.pad_token_id, side="right")
    rm, _ = rmask.pad(idx, pad_value=0, side="right")
    logits = model(input_ids=ids, attention_mask=valid.long()).logits.float()
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return (lp * (rm[:, 1:].bool() & valid[:, 1:])).sum(1)


from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

model = AutoModelForCausalLM.from_pretrained(f"{args.ws}/models/sft", dtype=torch.float32)
lora = params["compute"]["lora"]
model = get_peft_model(model, LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=0.0,
                                         target_modules=lora["target_modules"]))
sets = {name: (encode(df, "chosen"), encode(df, "rejected")) for name, df in (("train", train), ("held", held))}


@torch.no_grad()
def all_logps(name: str, adapter: bool) -> tuple[torch.Tensor, torch.Tensor]:
    model.eval()
    c, r = sets[name]
    n = len(c[0])
    res = []
    for side in (c, r):
        vals = []
        for i in range(0, n, 50):
            idx = torch.arange(i, min(n, i + 50))
            if adapter:
                vals.append(logps(model, side, idx))
            else:
                with model.disable_adapter():
                    vals.append(logps(model, side, idx))
        res.append(torch.cat(vals))
    return res[0], res[1]


ref = {name: all_logps(name, adapter=False) for name in sets}
emit({"event": "reference", "seconds": round(time.time() - t0, 1)})


def evaluate(step: int) -> None:
    c, r = all_logps("held", adapter=True)
    rc, rr = ref["held"]
    implicit = args.beta * ((c - rc) - (r - rr))
    emit({"event": "eval", "step": step, "seconds": round(time.time() - t0, 1),
          "held_implicit_acc": round(((implicit > 0).float() + 0.5 * (implicit == 0).float()).mean().item(), 4),
          "held_reffree_acc": round((c > r).float().mean().item(), 4),
          "held_dpo_loss": round(-F.logsigmoid(implicit).mean().item(), 4),
          "held_logp_chosen": round(c.mean().item(), 3), "held_logp_rejected": round(r.mean().item(), 3)})


opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.0)
n = len(train)
steps_per_epoch = n // args.batch
total = steps_per_epoch * args.epochs
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5) * max(0.0, 1 - s / total))
evaluate(0)
step = 0
for epoch in range(args.epochs):
    perm = torch.randperm(n)
    for b in range(steps_per_epoch):
        model.train()
        idx = perm[b * args.batch:(b + 1) * args.batch]
        c, r = sets["train"]
        lc, lr_ = logps(model, c, idx), logps(model, r, idx)
        rc, rr = ref["train"][0][idx], ref["train"][1][idx]
        margin = args.beta * ((lc - rc) - (lr_ - rr))
        loss = -F.logsigmoid(margin).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        step += 1
        if step % 5 == 0:
            emit({"event": "train", "step": step, "loss": round(loss.item(), 4),
                  "acc": round((margin > 0).float().mean().item(), 3), "seconds": round(time.time() - t0, 1)})
        if step % args.eval_every == 0 or step == total:
            evaluate(step)
emit({"event": "done", "seconds": round(time.time() - t0, 1)})
