# ruff: noqa  -- a helper of the one-off measurement scripts beside it (figures: docs/results/smollm2.md)
"""The held-out questions of a configs/smollm2.yaml workspace, as smollm2_heldout_300.py, smollm2_error_taxonomy.py
and smollm2_sampled_300.py judge them: the RL stage's held-out prompts (eval_prompts.parquet, 100) and the SFT
split's held-out questions (eval_sft.parquet, 200; the same operand-pair and phrasing split, never trained on);
and the set-up those judges share.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from rlhf_core.config import load_params
from rlhf_core.data.collate import encode_prompts
from rlhf_core.data.tokenizer import load_tokenizer
from rlhf_core.evaluation import HeldOut
from rlhf_core.trainers.common import read_split
from rlhf_core.trainers.rlhf.inputs import load_prompts


def held_out_questions(ws: Path, params, tok, limit: int) -> dict[str, tuple[list[str], list]]:
    """``{"rl_heldout": (prompts, answers), "sft_heldout": (prompts, answers)}``, the first ``limit`` of each."""
    rl = load_prompts(params, ws, tok).heldout
    sft = read_split(ws, "sft", eval_split=True, columns=("prompt", "answer"))
    return {"rl_heldout": (list(rl.prompts[:limit]), list(rl.answers[:limit])),
            "sft_heldout": (list(sft["prompt"][:limit]), list(sft["answer"][:limit]))}


def as_held_out(tok, params, prompts: list[str], answers: list) -> HeldOut:
    """The questions tokenised as the RL stage tokenises its prompts."""
    return HeldOut(prompts, answers, encode_prompts(tok, prompts, params.data.max_prompt_len))


def judge_setup(ws: Path):
    """``(device, params, tokenizer, limit)`` of a judge: the GPU when there is one, else one CPU thread; the
    workspace's params.yaml and SFT tokenizer; ``HELDOUT_LIMIT`` (the first N of each set, for a rehearsal)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        torch.set_num_threads(1)
    return (device, load_params(ws / "params.yaml"), load_tokenizer(ws / "models/sft"),
            int(os.environ.get("HELDOUT_LIMIT", 10**9)))


def flatten(questions: dict[str, tuple[list[str], list]]) -> tuple[list[str], list]:
    """``held_out_questions``' sets as one list of prompts and one of answers, in order (the RL stage's first)."""
    return ([p for prompts, _ in questions.values() for p in prompts],
            [a for _, answers in questions.values() for a in answers])
