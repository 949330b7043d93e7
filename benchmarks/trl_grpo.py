"""TRL's ``GRPOTrainer`` on our RLHF budget, judged by our held-out evaluator: the peer in the learning comparison.

``python -m benchmarks.trl_grpo [--seed S] [--threads N] [-S key=value ...]`` in a workspace holding
``data/prepared`` and ``models/sft`` (and ``models/rm`` for the RM reward); needs the ``bench`` extra (trl).
``benchmarks.learning`` runs it as the variant ``trl``, next to ours, from the same base workspace.

The same inputs and budget as ``rlhf stage rlhf`` with ``rlhf.algorithm: grpo`` and the same params:

* model: ``models/sft`` (actor; TRL builds its own frozen reference from it when ``beta > 0``);
* prompts: ``prompts.parquet``, tokenised by TRL's ``processing_class`` (the same tokenizer);
* reward: ``rlhf.reward_fns`` through our ``RewardSources`` (the RM, the checker, or both);
* per iteration ``prompts_per_step x G`` completions (one generation batch), split into ``rows / (micro_batch_size
  x grad_accum)`` optimizer steps (``steps_per_generation`` micro-batches, ``gradient_accumulation_steps``),
  ``ppo_epochs`` passes (``num_iterations``), ``num_steps`` iterations; ``lr`` and its schedule, AdamW betas
  (0.9, 0.95) and eps as our DeepSpeed config, grad clip, gradient checkpointing as ``compute``;
  ``beta = grpo.beta`` (TRL: k3 in the loss), ``epsilon = grpo.clip_eps``, the same LoRA adapters
  (``compute.lora``, ``peft_config``), ``scale_rewards = grpo.scale``,
  temperature, top-p, top-k off, ``max_new_tokens``; TRL's default ``loss_type="dapo"`` (token-level mean, like
  ours). What TRL has no equivalent of (ptx, entropy bonus, no-EOS penalty, another KL estimator, dropping
  uniform groups, batches that do not divide the rows) is refused, so a comparison is always like for like.

The trained policy is scored by ``rlhf_core.evaluation.heldout_eval`` (greedy held-out accuracy, proxy reward,
exact KL to the SFT model) and ``metrics/rlhf.json`` is written with the keys ``learning`` reads, so both frameworks are
measured by one evaluator. The policy is saved to ``models/actor`` as ours is (adapters merged, with the tokenizer),
so any later judge (the per-question ones of docs/measurements) reads both the same way.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch


def train_trl_grpo(params, root: str | Path = ".") -> dict:
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlhf_core.data.tokenizer import load_tokenizer
    from rlhf_core.evaluation import heldout_eval, step_judge
    from rlhf_core.models.loading import save_causal_lm
    from rlhf_core.ops import paths
    from rlhf_core.ops.atomic import write_json_atomic
    from rlhf_core.rewards.sources import RewardSources
    from rlhf_core.trainers.rlhf.inputs import load_prompts

    root = Path(root)
    t_start = time.perf_counter()
    cfg = params.rlhf
    torch.set_num_threads(params.compute.num_threads or torch.get_num_threads())
    tok = load_tokenizer(root / paths.SFT_MODEL)
    reward = RewardSources(cfg.reward_fns, root / paths.RM_MODEL, tok, cfg.rm_tokenizer_mismatch)
    data = load_prompts(params, root, tok)
    held = data.heldout

    def reward_fn(prompts, completions, answer=None, **_):
        columns = {"answer": list(answer)} if answer is not None else {}
        return reward(list(prompts), list(completions), **columns).tolist()

    reward_fn.__name__ = "+".join(cfg.reward_fns)
    group = cfg.grpo.group_size
    rows = cfg.prompts_per_step * group
    per_step = cfg.micro_batch_size * cfg.grad_accum
    unmapped = {"rlhf.ptx_coef": cfg.ptx_coef > 0, "rlhf.entropy_coef": cfg.entropy_coef > 0,
                "rlhf.no_eos_penalty": cfg.no_eos_penalty is not None,
                "rlhf.grpo.kl_estimator": cfg.grpo.kl_estimator != "k3",
                "rlhf.grpo.drop_uniform_groups": cfg.grpo.drop_uniform_groups,
                f"rlhf.micro_batch_size x grad_accum ({per_step}) must divide the {rows} rows": rows % per_step}
    bad = [k for k, v in unmapped.items() if v]
    if bad:
        raise ValueError(f"TRL's GRPOTrainer has no equivalent of: {', '.join(bad)}; set them to their defaults "
                         "on both sides of the comparison")
    n_mini = rows // per_step  # optimizer steps per generation batch, as ours
    model = AutoModelForCausalLM.from_pretrained(root / paths.SFT_MODEL)
    ref = AutoModelForCausalLM.from_pretrained(root / paths.SFT_MODEL).eval()
    steps = step_judge(params)
    sft_eval = heldout_eval(model, tok, held, params.eval, "cpu", reward=reward, step_judge=steps)

    class Timer(TrainerCallback):
        train_s = 0.0

        def on_train_begin(self, args, state, control, **kwargs):
            self.t0 = time.perf_counter()

        def on_train_end(self, args, state, control, **kwargs):
            self.train_s = time.perf_counter() - self.t0

    args = GRPOConfig(
        output_dir=str(root / "trl"), use_cpu=True, bf16=False, fp16=False, report_to=[], save_strategy="no",
        logging_steps=n_mini * cfg.log_every, max_steps=cfg.num_steps * n_mini * cfg.ppo_epochs,
        learning_rate=cfg.lr, lr_scheduler_type=cfg.lr_scheduler, warmup_steps=cfg.warmup_steps,
        weight_decay=cfg.weight_decay, adam_beta1=0.9, adam_beta2=0.95, adam_epsilon=1e-8,  # ours (ds_config)
        max_grad_norm=params.compute.grad_clip, gradient_checkpointing=params.compute.gradient_checkpointing,
        per_device_train_batch_size=cfg.micro_batch_size, gradient_accumulation_steps=cfg.grad_accum,
        steps_per_generation=n_mini * cfg.grad_accum, num_generations=group,
        max_completion_length=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p, top_k=0,
        beta=cfg.grpo.beta, epsilon=cfg.grpo.clip_eps, num_iterations=cfg.ppo_epochs,
        scale_rewards={"group": "group", "batch": "batch", "none": "none"}[cfg.grpo.scale],
        seed=params.project.seed, data_seed=params.project.seed, dataloader_num_workers=0, disable_dropout=True)
    timer = Timer()
    dataset = Dataset.from_dict({"prompt": data.texts, "answer": data.answers})
    lora = params.compute.lora
    peft_config = None
    if lora.enabled:  # the same adapters as ours; TRL's reference is then the model with its adapter disabled
        from peft import LoraConfig

        peft_config = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, bias="none",
                                 target_modules=list(lora.target_modules), task_type="CAUSAL_LM")
    trainer = GRPOTrainer(model=model, reward_funcs=reward_fn, args=args, train_dataset=dataset, processing_class=tok,
                          callbacks=[timer], peft_config=peft_config)
    trainer.train()
    final = heldout_eval(trainer.model, tok, held, params.eval, "cpu", ref=ref, reward=reward, step_judge=steps)
    save_causal_lm(trainer.model, root / paths.ACTOR_MODEL)
    tok.save_pretrained(root / paths.ACTOR_MODEL)
    metrics = {
        "framework": f"trl {trl.__version__}", "algorithm": "grpo", "steps": cfg.num_steps,
        "optimizer_steps": trainer.state.global_step, "sft_accuracy": sft_eval["accuracy"],
        "accuracy": final["accuracy"], "accuracy_gain": final["accuracy"] - sft_eval["accuracy"],
        "proxy_reward": final["proxy_reward"], "sft_proxy_reward": sft_eval["proxy_reward"],
        "kl_to_reference": final["kl_to_reference"], "eos_share": final["eos_share"],
        "train_time_s": round(timer.train_s, 3), "wall_time_s": round(time.perf_counter() - t_start, 2),
        **({"sft_step_accuracy": sft_eval["step_accuracy"], "step_accuracy": final["step_accuracy"]}
           if steps is not None else {}),
    }
    write_json_atomic(root / paths.METRICS / "rlhf.json", metrics)
    return metrics


def main(argv: list[str] | None = None) -> None:
    from rlhf_core.config import DEFAULT_PARAMS, load_params

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("-S", "--set", dest="overrides", action="append", default=[])
    a = ap.parse_args(argv)
    sets = [*a.overrides, "rlhf.algorithm=grpo"]
    if a.seed is not None:
        sets.append(f"project.seed={a.seed}")
    if a.threads:
        sets.append(f"compute.num_threads={a.threads}")
    os.environ.setdefault("RLHF_TRACKING", "off")
    print(json.dumps(train_trl_grpo(load_params(Path(DEFAULT_PARAMS), sets))))


if __name__ == "__main__":
    main()
