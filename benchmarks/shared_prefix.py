"""Shared prompts computed once against the plain forward, on random Llama models of any size and device.

``python -m benchmarks.shared_prefix [--device cuda] [--dtype bf16] [--hidden 2048 --layers 16 ...]``

Rows come as the RL stage makes them: ``rows / group`` prompts of 1/2..1 x ``--prompt-len`` tokens, left-padded, the
first ``--head`` of them the same in every prompt (a system prompt or chat template's opening, computed once for all
prompts: ``prefix_cache``), each prompt repeated ``group`` times, and responses of 1..``--response-len`` tokens
ending in EOS, right-padded. Three passes, each timed plain (every row computes its prompt) and shared (each prompt
once, its KV cache indexed out to its rows), alternating, median of ``--repeats`` after one warm-up:

* ``actor fwd+bwd``: ``generation.response_logprobs`` (training forward and backward of the policy), shared: the
  prompt's KV cache indexed out to buckets of response lengths;
* ``actor fwd+bwd packed``: the same pass with each group's responses packed after its prompt in one row
  (``group_packing``; ``--pack-max-width`` overrides the widest row it packs, to find where it stops paying);
* ``critic fwd+bwd``: ``passes.values.sequence_values`` (the PPO critic's value pass and training step);
* ``rm score``: ``ValueHeadModel.forward`` over the full rows against ``shared_prefix_scores`` (RM scoring).

One JSON line per pass: times (ms), ``shared / plain``, the largest difference of the outputs, and the largest
difference of a parameter's gradient relative to that gradient's largest entry (float rounding). Random weights
(``--init-std``, HF's 0.02 by default, leaves a deep random model's outputs nearly uniform): the figures measure
cost and agreement, not learning.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def _rows(args, gen: torch.Generator):
    n_prompts = args.rows // args.group
    lens = torch.randint(max(2, args.prompt_len // 2), args.prompt_len + 1, (n_prompts,), generator=gen)
    pos = torch.arange(args.prompt_len)
    pmask = pos[None] >= (args.prompt_len - lens)[:, None]
    prompts = torch.where(pmask, torch.randint(3, args.vocab, (n_prompts, args.prompt_len), generator=gen), 0)
    if args.head:  # every prompt opens with the same --head tokens (a system prompt), each keeping one of its own
        head = torch.randint(3, args.vocab, (args.head,), generator=gen)
        k = pos[None] - (args.prompt_len - lens)[:, None]  # index among the prompt's real tokens
        prompts = torch.where((k >= 0) & (k < args.head) & (k < lens[:, None] - 1), head[k.clamp(0, args.head - 1)],
                              prompts)
    group = torch.arange(n_prompts).repeat_interleave(args.group)
    rlens = torch.randint(1, args.response_len + 1, (len(group),), generator=gen)
    rpos = torch.arange(args.response_len)
    rmask = rpos[None] < rlens[:, None]
    responses = torch.randint(3, args.vocab, (len(group), args.response_len), generator=gen)
    responses = torch.where(rpos[None] == (rlens - 1)[:, None], 2, responses)  # EOS last
    responses = torch.where(rmask, responses, 0)
    seq = torch.cat([prompts[group], responses], dim=1)
    att = torch.cat([pmask[group], rmask], dim=1).long()
    return seq, att, group, prompts, pmask, responses, rmask


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _grads(model) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]


def _compare(name, plain_fn, shared_fn, model, device, repeats):
    """Alternate plain and shared ``repeats + 1`` times (the first is a warm-up); outputs and gradients of the
    last call of each are compared."""
    times = {"plain": [], "shared": []}
    out = {}
    for i in range(repeats + 1):
        for kind, fn in (("plain", plain_fn), ("shared", shared_fn)):
            if model is not None:
                model.zero_grad(set_to_none=True)
            _sync(device)
            t0 = time.perf_counter()
            result = fn()
            _sync(device)
            if i:
                times[kind].append(time.perf_counter() - t0)
            out[kind] = (result.detach().float(), _grads(model) if model is not None else [])
    (a, ga), (b, gb) = out["plain"], out["shared"]
    grad_diff = max((float((x.float() - y.float()).abs().max() / x.float().abs().max().clamp(min=1e-30))
                     for x, y in zip(ga, gb, strict=True)), default=0.0)
    plain_ms, shared_ms = (1000 * statistics.median(times[k]) for k in ("plain", "shared"))
    return {"pass": name, "plain_ms": round(plain_ms, 2), "shared_ms": round(shared_ms, 2),
            "ratio": round(shared_ms / plain_ms, 3), "max_abs_diff": float((a - b).abs().max()),
            "max_rel_grad_diff": grad_diff}


def run(args) -> list[dict]:
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaModel

    from rlhf_core.models.value_head import ValueHeadModel
    from rlhf_core.passes import generation
    from rlhf_core.passes.generation import response_logprobs, shared_prefix_split
    from rlhf_core.passes.group_packing import packed_width
    from rlhf_core.passes.values import sequence_values

    device = torch.device(args.device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    torch.manual_seed(args.seed)
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads,
                      max_position_embeddings=args.prompt_len + args.response_len + 8, pad_token_id=0,
                      bos_token_id=1, eos_token_id=2, initializer_range=args.init_std)
    actor = LlamaForCausalLM(cfg).to(device=device, dtype=dtype).train()
    critic = ValueHeadModel(LlamaModel(cfg)).to(device=device, dtype=dtype).train()
    seq, att, group, prompts, pmask, responses, rmask = (
        t.to(device) for t in _rows(args, torch.Generator().manual_seed(args.seed)))
    R = args.response_len
    mask = att[:, -R:].bool()

    def actor_pass(g, pack=False):
        logp = response_logprobs(actor, seq, att, R, group=g, pack=pack)
        torch.where(mask, logp, 0).sum().backward()
        return torch.where(mask, logp, 0)

    def critic_pass(g):
        values = sequence_values(critic, seq, att, R, g)
        torch.where(mask, values, 0).pow(2).sum().backward()
        return torch.where(mask, values, 0)

    first, owner, _ = shared_prefix_split(seq, att, R, group)
    if args.pack_max_width:
        generation.PACK_MAX_WIDTH = args.pack_max_width
    width = packed_width(att, R, first, owner)

    @torch.no_grad()
    def rm_plain():
        return critic(seq, att).scores

    @torch.no_grad()
    def rm_shared():
        return critic.shared_prefix_scores(prompts[group[first]], pmask[group[first]], group, responses, rmask)

    head = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "dtype": args.dtype,
            "params_m": round(sum(p.numel() for p in actor.parameters()) / 1e6, 1), "rows": len(group),
            "group": args.group, "prompt_len": args.prompt_len, "head": args.head, "response_len": R,
            "threads": torch.get_num_threads()}
    return [head | _compare("actor fwd+bwd", lambda: actor_pass(None), lambda: actor_pass(group), actor, device,
                            args.repeats),
            head | _compare("actor fwd+bwd packed", lambda: actor_pass(None), lambda: actor_pass(group, True), actor,
                            device, args.repeats) | {"packed_width": width},
            head | _compare("critic fwd+bwd", lambda: critic_pass(None), lambda: critic_pass(group), critic, device,
                            args.repeats),
            head | _compare("rm score", rm_plain, rm_shared, None, device, args.repeats)]


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--intermediate", type=int, default=352)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=12)
    ap.add_argument("--head", type=int, default=0, help="tokens every prompt opens with")
    ap.add_argument("--response-len", type=int, default=8)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--init-std", type=float, default=0.02)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pack-max-width", type=int, default=0, help="pack rows up to this width (0: the library's)")
    args = ap.parse_args(argv)
    if args.rows % args.group:
        ap.error(f"--rows {args.rows} is not a multiple of --group {args.group}")
    out = run(args)
    for row in out:
        print(json.dumps(row), flush=True)
    return out


if __name__ == "__main__":
    main()
