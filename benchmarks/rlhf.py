"""``rlhf bench ppo`` / ``rlhf bench grpo``: samples/s of RLHF iterations on a fixed small config.

The workload is fixed and reproducible: demo data, the tiny demo Llama (``model.tiny``) randomly initialised
with ``project.seed`` as the SFT model (and, for PPO, a random value model as the RM/critic init), the
rule reward ``exact_answer``. EOS is suppressed until ``max_new_tokens`` (``min_new_tokens``), so every
response has the same length: the same token count on every run and in any other framework given the same
settings (TRL: ``generation_kwargs={"min_new_tokens": 32}``).

Settings (one optimizer step per iteration, as TRL's GRPOTrainer with ``num_iterations=1``):

* GRPO: 16 prompts x G=8 = 128 completions, 32 new tokens, temperature 1, beta 0.04 (reference pass),
  micro-batch 32 x 4 accumulation; TRL equivalent: ``num_generations=8, max_completion_length=32,
  per_device_train_batch_size=32, gradient_accumulation_steps=4, beta=0.04, num_iterations=1``.
* PPO: 128 prompts x 1, same lengths and batches, critic (GAE) and KL in the reward.

One warm-up iteration, then ``iterations`` timed ones; phases: ``generate`` (sampling with the KV cache),
``score`` (reward + one inference pass per model, logits over response positions only), ``train``.
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

BENCH_COMMON = [
    "data.demo.n_rows=2000", "eval.max_prompts=8", "rlhf.max_new_tokens=32", "rlhf.temperature=1.0",
    "rlhf.micro_batch_size=32", "rlhf.grad_accum=4", "rlhf.ppo_epochs=1", "rlhf.reward_fns={exact_answer: 1.0}",
    "rlhf.warmup_steps=0", "rlhf.lr_scheduler=constant", "rlhf.num_steps=1000", "rlhf.lr=1e-5",
]
BENCH_ALGO = {
    "grpo": ["rlhf.algorithm=grpo", "rlhf.prompts_per_step=16", "rlhf.grpo.group_size=8", "rlhf.grpo.beta=0.04"],
    "ppo": ["rlhf.algorithm=ppo", "rlhf.prompts_per_step=128", "rlhf.ppo.samples_per_prompt=1", "rlhf.kl_coef=0.05"],
}


def bench_params(algorithm: str, overrides: list[str] | tuple[str, ...] = ()):
    from rlhf_core.config import apply_overrides, validate

    if algorithm not in BENCH_ALGO:
        raise ValueError(f"unknown benchmark {algorithm!r}; expected one of {', '.join(BENCH_ALGO)}")
    raw = apply_overrides({}, [*BENCH_COMMON, *BENCH_ALGO[algorithm], *overrides])
    return validate(raw, origin=f"<bench {algorithm}>")


def build_workspace(params, root: Path, with_rm: bool) -> None:
    """Demo data + a random-init tiny SFT model (and value model) under ``root``."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    from rlhf_core.data.tokenizer import load_tokenizer
    from rlhf_core.models.value_head import ValueHeadModel
    from rlhf_core.ops import paths
    from rlhf_core.stages.prepare import prepare

    prepare(params, root)
    config = AutoConfig.from_pretrained(str(root / paths.BASE_MODEL))
    tok = load_tokenizer(root / paths.BASE_MODEL)
    torch.manual_seed(params.project.seed)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(root / paths.SFT_MODEL)
    tok.save_pretrained(root / paths.SFT_MODEL)
    if with_rm:
        torch.manual_seed(params.project.seed + 1)
        ValueHeadModel(AutoModel.from_config(config)).save_pretrained(root / paths.RM_MODEL, tok.pad_token_id)
        tok.save_pretrained(root / paths.RM_MODEL)


def bench_rlhf(algorithm: str, iterations: int = 1, warmup: int = 1, overrides: list[str] | tuple[str, ...] = (),
               root: str | Path | None = None) -> dict:
    """Time ``warmup + iterations`` RLHF iterations; returns the per-phase breakdown of the timed ones."""
    from rlhf_core.trainers.rlhf.trainer import RLHFTrainer

    params = bench_params(algorithm, overrides)
    with tempfile.TemporaryDirectory(prefix="rlhf-bench-") as tmp:
        work = Path(root) if root is not None else Path(tmp)
        build_workspace(params, work, with_rm=algorithm == "ppo")
        t0 = time.perf_counter()
        trainer = RLHFTrainer(params, work, evaluate=False, checkpoints=False).setup()
        # every response runs to max_new_tokens (EOS suppressed before): the same work on every run
        trainer.maker.cfg.gen = replace(trainer.maker.cfg.gen, min_new_tokens=params.rlhf.max_new_tokens)
        setup_s = time.perf_counter() - t0
        for _ in range(warmup):
            trainer.step()
        runs = [trainer.step() for _ in range(iterations)]
    keys = ("t_generate", "t_score", "t_train", "t_step", "rows", "response_length")
    mean = {k: sum(r[k] for r in runs) / len(runs) for k in keys}
    cfg = params.rlhf
    return {
        "algorithm": algorithm, "iterations": iterations, "rows_per_iteration": mean["rows"],
        "new_tokens_per_row": mean["response_length"], "samples_per_s": mean["rows"] / mean["t_step"],
        "tokens_per_s": mean["rows"] * mean["response_length"] / mean["t_step"],
        "seconds": {"generate": mean["t_generate"], "score": mean["t_score"], "train": mean["t_train"],
                    "iteration": mean["t_step"], "setup": setup_s},
        "settings": {"prompts_per_step": cfg.prompts_per_step, "samples_per_prompt": cfg.samples_per_prompt,
                     "max_new_tokens": cfg.max_new_tokens, "micro_batch_size": cfg.micro_batch_size,
                     "grad_accum": cfg.grad_accum, "model": params.model.tiny.model_dump(),
                     "threads": torch.get_num_threads(), "device": str(trainer.device),
                     "precision": trainer.actor.precision},
    }


def format_report(result: dict) -> str:
    s = result["seconds"]
    share = {k: 100 * s[k] / s["iteration"] if s["iteration"] else 0.0 for k in ("generate", "score", "train")}
    lines = [
        f"rlhf bench {result['algorithm']}: {result['rows_per_iteration']:.0f} samples x "
        f"{result['new_tokens_per_row']:.1f} new tokens per iteration "
        f"({result['settings']['device']}, {result['settings']['threads']} threads, "
        f"{result['settings']['precision']})",
        f"  samples/s      {result['samples_per_s']:10.1f}",
        f"  tokens/s       {result['tokens_per_s']:10.1f}",
        f"  iteration      {s['iteration']:10.3f} s",
        f"    generate     {s['generate']:10.3f} s  ({share['generate']:4.1f} %)",
        f"    score        {s['score']:10.3f} s  ({share['score']:4.1f} %)",
        f"    train        {s['train']:10.3f} s  ({share['train']:4.1f} %)",
    ]
    return "\n".join(lines)


def run_cli(algorithm: str, iterations: int = 1, warmup: int = 1, overrides: list[str] | None = None,
            as_json: bool = False) -> dict:
    """What ``rlhf bench ppo|grpo`` runs: prints the report (or JSON) and returns the result."""
    import os
    import sys

    os.environ.setdefault("RLHF_TRACKING", "off")
    result = bench_rlhf(algorithm, iterations, warmup, overrides or [])
    sys.stdout.write((json.dumps(result) if as_json else format_report(result)) + "\n")
    return result
