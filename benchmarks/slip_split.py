"""``python -m benchmarks.slip_split RUN_DIR...``: held-out accuracy split by what imitation can learn.

With ``data.demo.slip_share`` > 0 the demo's questions fall in two sets: *slipped* questions, whose every SFT
demonstration carries the same wrong answer (correct + 10) and whose preference pairs prefer the correct
answer, and the rest. On the first set only the preferences (the reward model) know the answer; on the second,
imitation does too.
For each run directory of ``benchmarks.learning`` this prints the greedy held-out accuracy of the SFT start
and of the trained actor on both sets, judged by the task's checker (``rlhf_core.evaluation.heldout_eval``),
one JSON line per run.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def split_by_slip(prompts: list[str], slip_share: float, seed: int) -> tuple[list[int], list[int]]:
    """Indices of the slipped and of the other prompts (``demo_task.slipped`` on each prompt's question)."""
    from rlhf_core.rewards.demo_task import question_of, slipped

    flags = []
    for i, p in enumerate(prompts):
        question = question_of(p)
        if question is None:
            raise ValueError(f"prompt {i} is not a demo question: {p!r}")
        flags.append(slipped(question, slip_share, seed))
    return [i for i, f in enumerate(flags) if f], [i for i, f in enumerate(flags) if not f]


def evaluate_run(run: Path) -> dict:
    from transformers import AutoModelForCausalLM

    from rlhf_core.config import load_params
    from rlhf_core.data.collate import encode_prompts
    from rlhf_core.data.tokenizer import load_tokenizer
    from rlhf_core.evaluation import HeldOut, heldout_eval
    from rlhf_core.ops import paths
    from rlhf_core.trainers.rlhf.inputs import load_prompts

    params = load_params(run / "params.yaml")
    tok = load_tokenizer(run / paths.SFT_MODEL)
    held = load_prompts(params, run, tok).heldout
    slip, rest = split_by_slip(held.prompts, params.data.demo.slip_share, params.project.seed)
    out = {"run": run.name, "n_slipped": len(slip), "n_other": len(rest)}
    for name, model_dir in (("sft", paths.SFT_MODEL), ("actor", paths.ACTOR_MODEL)):
        model = AutoModelForCausalLM.from_pretrained(run / model_dir).eval()
        for part, idx in (("slipped", slip), ("other", rest)):
            texts = [held.prompts[i] for i in idx]
            sub = HeldOut(texts, [held.answers[i] for i in idx],
                          encode_prompts(tok, texts, params.data.max_prompt_len))
            out[f"{name}_{part}"] = heldout_eval(model, tok, sub, params.eval, "cpu")["accuracy"] if idx else None
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path, help="run directories (each with params.yaml and models/)")
    for run in ap.parse_args(argv).runs:
        print(json.dumps(evaluate_run(run)), flush=True)


if __name__ == "__main__":
    main()
