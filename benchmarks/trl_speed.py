"""TRL's ``GRPOTrainer`` on the workload of ``rlhf bench grpo``, for a like-for-like samples/s figure.

``python -m benchmarks.trl_speed [--iterations 3] [--threads 2]`` (needs ``pip install -e ".[bench]"``).

Same data, the same random-init tiny Llama (``build_workspace``), the same reward (``exact_answer``) and the
same work per optimizer step: 16 prompts x G=8 = 128 completions of exactly 32 new tokens
(``min_new_tokens=32``), temperature 1, top-k off, beta 0.04 (a reference pass), micro-batch 32 x 4
accumulation, ``num_iterations=1``, fp32 on the CPU. One warm-up step, then ``iterations`` timed ones;
a step's time is the gap between TRL's ``on_step_end`` callbacks (the first from ``on_train_begin``).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.rlhf import bench_params, build_workspace


def step_timer(warmup: int):
    """A ``TrainerCallback`` that marks the end of every optimizer step (the first mark: ``on_train_begin``);
    ``timed_gaps()`` are the step times after ``warmup`` steps. On CUDA it waits for the device before each mark
    and resets the peak-memory counter when the timed steps begin."""
    from transformers import TrainerCallback

    class StepTimes(TrainerCallback):
        marks: list[float] = []

        def on_train_begin(self, args, state, control, **kwargs):
            self.marks = [time.perf_counter()]

        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == warmup and torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()

        def on_step_end(self, args, state, control, **kwargs):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.marks.append(time.perf_counter())

        def timed_gaps(self) -> list[float]:
            return [b - a for a, b in zip(self.marks[:-1], self.marks[1:], strict=True)][warmup:]

    return StepTimes()


def bench_trl_grpo(iterations: int = 3, warmup: int = 1, threads: int | None = None) -> dict:
    import pandas as pd
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    from rlhf_core.data.tokenizer import load_tokenizer
    from rlhf_core.ops import paths
    from rlhf_core.rewards import check_answer

    if threads:
        torch.set_num_threads(threads)
    params = bench_params("grpo")
    cfg = params.rlhf
    group = cfg.grpo.group_size
    per_step = cfg.prompts_per_step * group

    def exact_answer(completions, answer, **_):
        return [float(check_answer(c, a)) for c, a in zip(completions, answer, strict=True)]

    with tempfile.TemporaryDirectory(prefix="rlhf-bench-trl-") as tmp:
        work = Path(tmp)
        build_workspace(params, work, with_rm=False)
        prompts = pd.read_parquet(work / paths.prepared_file("prompts"))[["prompt", "answer"]]
        steps = warmup + iterations
        data = Dataset.from_pandas(prompts.head(steps * cfg.prompts_per_step), preserve_index=False)
        tok = load_tokenizer(work / paths.SFT_MODEL)
        model = AutoModelForCausalLM.from_pretrained(work / paths.SFT_MODEL)
        args = GRPOConfig(
            output_dir=str(work / "trl"), use_cpu=True, bf16=False, fp16=False, report_to=[], save_strategy="no",
            logging_steps=1, max_steps=steps, learning_rate=cfg.lr, lr_scheduler_type="constant",
            per_device_train_batch_size=cfg.micro_batch_size, gradient_accumulation_steps=cfg.grad_accum,
            num_generations=group, max_completion_length=cfg.max_new_tokens,
            generation_kwargs={"min_new_tokens": cfg.max_new_tokens}, temperature=cfg.temperature, top_p=1.0,
            top_k=0, beta=cfg.grpo.beta, num_iterations=1, epsilon=cfg.grpo.clip_eps, seed=params.project.seed,
            dataloader_num_workers=0, shuffle_dataset=False)
        timer = step_timer(warmup)
        trainer = GRPOTrainer(model=model, reward_funcs=exact_answer, args=args, train_dataset=data,
                              processing_class=tok, callbacks=[timer])
        trainer.train()
    gaps = timer.timed_gaps()
    step_s = sum(gaps) / len(gaps)
    return {"framework": f"trl {trl.__version__}", "iterations": len(gaps),
            "rows_per_iteration": per_step, "samples_per_s": per_step / step_s, "iteration_s": step_s,
            "threads": torch.get_num_threads(), "step_times_s": gaps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    os.environ.setdefault("RLHF_TRACKING", "off")
    print(json.dumps(bench_trl_grpo(a.iterations, a.warmup, a.threads)))


if __name__ == "__main__":
    main()
