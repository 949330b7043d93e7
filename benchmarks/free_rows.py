"""The static decoder with finished rows freed against the same decoder keeping every row to the end.

A real model (any causal LM folder) samples its answers to real prompts (a prepared prompts file), so the answer
lengths are the model's own. The two runs alternate, each from the same seed, and the tokens are compared::

    python -m benchmarks.free_rows --model W/models/sft --prompts W/data/prepared/eval_prompts.parquet \
        [--rows 64] [--group 1] [--new-tokens 32] [--repeats 3] [--threads 1]

Prints one JSON row: seconds per rollout of each kind (every repeat), their ratio, the response lengths, and
whether the tokens were equal. Figures: docs/results/benchmarks-gpu-rollout.md ("Finished rows freed").
"""

from __future__ import annotations

import argparse
import json
import time

import pandas as pd
import torch


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--rows", type=int, default=64, help="prompt rows per rollout (before --group copies)")
    ap.add_argument("--group", type=int, default=1, help="samples per prompt")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf_core.passes.generation import encode_prompts, response_mask
    from rlhf_core.passes.static_decode import static_rollout

    if args.threads:
        torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="sdpa").eval()
    prompts = pd.read_parquet(args.prompts)["prompt"].tolist()[:args.rows]
    ids, mask = encode_prompts(tok, prompts)
    ids, mask = ids.repeat_interleave(args.group, dim=0), mask.repeat_interleave(args.group, dim=0)

    def run(free: bool) -> tuple[float, torch.Tensor]:
        torch.manual_seed(0)
        t0 = time.perf_counter()
        out = static_rollout(model, ids, mask, args.new_tokens, tok.eos_token_id, tok.pad_token_id,
                             temperature=args.temperature, group_size=args.group, free_finished=free)[0]
        return time.perf_counter() - t0, out

    times: dict[str, list[float]] = {"kept": [], "freed": []}
    outs = {}
    run(True)  # warm-up
    for _ in range(args.repeats):
        for kind in ("kept", "freed"):
            s, outs[kind] = run(kind == "freed")
            times[kind].append(round(s, 3))
    lengths = response_mask(outs["freed"], tok.eos_token_id).sum(dim=1).float()
    row = {"bench": "free_rows", "model": args.model, "rows": ids.shape[0], "new_tokens": args.new_tokens,
           "threads": torch.get_num_threads(), "times_s": times,
           "freed_over_kept": round(sum(times["freed"]) / sum(times["kept"]), 3),
           "same_tokens": bool(torch.equal(outs["kept"], outs["freed"])),
           "response_len_mean": round(float(lengths.mean()), 2), "response_len_max": int(lengths.max()),
           "ended_share": round(float((outs["freed"] == tok.eos_token_id).any(dim=1).float().mean()), 3)}
    print(json.dumps(row))
    return row


if __name__ == "__main__":
    main()
