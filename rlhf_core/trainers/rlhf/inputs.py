"""The RL stage's inputs: checked before anything loads (errors name the key or path), then read once.

``check_inputs`` refuses what the stage cannot use (no SFT model, no RM where the critic or the reward
needs one, an RM with another vocabulary under a critic, unknown reward functions, a process count that
does not divide ``prompts_per_step``). ``load_prompts`` tokenises the train and held-out prompts once, with
the special tokens of SFT training; ``load_ptx`` reads the SFT rows of the pretraining-mix loss, less those
the reward model scores below ``rlhf.ptx_min_reward``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from itertools import compress
from pathlib import Path

import torch

from rlhf_core.config import Params
from rlhf_core.data.collate import Ragged, SFTData, build_sft_data, encode_prompts, encode_sequences
from rlhf_core.data.tokenizer import load_tokenizer, same_tokenizer
from rlhf_core.engine import distributed as D
from rlhf_core.engine.errors import TrainingInputError
from rlhf_core.evaluation import HeldOut
from rlhf_core.ops import paths
from rlhf_core.ops.meta import META_FILE
from rlhf_core.rewards.registry import REWARD_FUNCTIONS
from rlhf_core.rewards.sources import RM_SOURCE
from rlhf_core.trainers.common import default_max_length, read_split


@dataclass(frozen=True)
class Inputs:
    sft: Path  # the tokenizer; actor init and frozen reference in the base pipeline
    rm: Path
    uses_rm: bool  # the RM is read (critic init or a reward source)
    needs_critic: bool
    actor_init: Path  # models/sft, or a feedback round's starting actor
    reference: Path  # the KL reference: models/sft, or the round's starting actor (feedback.reference: previous)


def check_inputs(params: Params, root: Path, needs_critic: bool) -> Inputs:
    """Fail early, naming the key or path, on inputs the stage cannot use."""
    cfg = params.rlhf
    sft_dir, rm_dir = root / paths.SFT_MODEL, root / paths.RM_MODEL
    if not (sft_dir / "config.json").exists():
        raise TrainingInputError(f"{paths.SFT_MODEL}: no SFT model (actor and reference start from it); "
                                 "run `rlhf stage sft` first")
    if needs_critic and not (rm_dir / "config.json").exists():
        raise TrainingInputError(
            f"{paths.RM_MODEL}: no reward model, but PPO with rlhf.ppo.advantage_estimator: gae needs a critic "
            "initialised from it; run `rlhf stage rm`, or use rlhf.algorithm: grpo or a critic-free "
            "rlhf.ppo.advantage_estimator (rloo, reinforce_pp)")
    if needs_critic:
        check_critic_tokenizer(sft_dir, rm_dir, params.model.trust_remote_code)
    if cfg.prompts_per_step % D.world_size():
        raise TrainingInputError(f"rlhf.prompts_per_step ({cfg.prompts_per_step}) must be divisible by the number "
                                 f"of processes ({D.world_size()})")
    if cfg.ema_decay is not None and params.compute.zero_stage == 3:
        raise TrainingInputError("rlhf.ema_decay is not supported with compute.zero_stage: 3")
    unknown = [k for k in cfg.reward_fns if k != RM_SOURCE and k not in REWARD_FUNCTIONS]
    if unknown:
        raise TrainingInputError(f"rlhf.reward_fns: unknown reward function(s) {unknown}; known: "
                                 f"{', '.join(sorted(REWARD_FUNCTIONS))}, {RM_SOURCE}")
    if RM_SOURCE in cfg.reward_fns and not (rm_dir / "config.json").exists():
        raise TrainingInputError(f"rlhf.reward_fns names `rm` but {paths.RM_MODEL} has no reward model; "
                                 "run `rlhf stage rm` or remove `rm`")
    supervision = cfg.grpo.supervision if cfg.algorithm == "grpo" else cfg.ppo.supervision
    if supervision == "process":
        check_process_inputs(params, sft_dir, rm_dir)
    actor_init, reference = start_policies(params, root)
    return Inputs(sft_dir, rm_dir, needs_critic or RM_SOURCE in cfg.reward_fns, needs_critic, actor_init, reference)


def start_policies(params: Params, root: Path) -> tuple[Path, Path]:
    """``(actor_init, reference)``: ``models/sft`` twice, or in a feedback round the policy it collected comparisons
    on and the KL reference ``feedback.reference`` names; a round without its starting actor is an error."""
    sft_dir = root / paths.SFT_MODEL
    if not params.feedback.round:
        return sft_dir, sft_dir
    actor_init = paths.start_dir(root, params.feedback.round, "actor")
    if not (actor_init / "config.json").exists():
        raise TrainingInputError(f"{actor_init}: no starting actor for feedback round {params.feedback.round}; "
                                 "run `rlhf stage feedback` first")
    return actor_init, actor_init if params.feedback.reference == "previous" else sft_dir


def check_process_inputs(params: Params, sft_dir: Path, rm_dir: Path) -> None:
    """Process supervision reads a process reward model, alone, on the actor's own token ids."""
    key = f"rlhf.{params.rlhf.algorithm}.supervision: process"
    weights = params.rlhf.reward_fns
    if set(weights) != {RM_SOURCE} or weights[RM_SOURCE] <= 0:
        raise TrainingInputError(f"{key} takes its rewards from the process reward model alone: set "
                                 f"rlhf.reward_fns to {{rm: 1.0}} (not {dict(weights)})")
    meta = rm_dir / META_FILE
    objective = json.loads(meta.read_text()).get("objective") if meta.exists() else None
    if objective != "process":
        raise TrainingInputError(f"{key} needs a process reward model, but {paths.RM_MODEL} was trained with "
                                 f"rm.objective: {objective or 'unknown'}; run `rlhf stage rm -S rm.objective=process`")
    if not same_tokenizer(load_tokenizer(sft_dir, params.model.trust_remote_code),
                          load_tokenizer(rm_dir, params.model.trust_remote_code)):
        raise TrainingInputError(f"{paths.RM_MODEL}: its tokenizer differs from the actor's, but {key} reads it on "
                                 "the actor's token ids; train the PRM from the SFT model (rm.init_from: sft)")


def check_critic_tokenizer(sft_dir: Path, rm_dir: Path, trust_remote_code: bool) -> None:
    """The critic (initialised from the RM) reads the actor's token ids: refuse an RM with another vocabulary
    (the reward can be re-tokenised from text, the critic's per-token values cannot)."""
    if not same_tokenizer(load_tokenizer(sft_dir, trust_remote_code), load_tokenizer(rm_dir, trust_remote_code)):
        raise TrainingInputError(
            f"{paths.RM_MODEL}: its tokenizer differs from the actor's ({paths.SFT_MODEL}), but PPO with "
            "rlhf.ppo.advantage_estimator: gae initialises the critic from it and feeds it the actor's token ids; "
            "train the RM from the SFT model (rm.init_from: sft), or use a critic-free estimator (grpo, rloo, "
            "reinforce_pp), which score the RM on re-tokenised text")


@dataclass
class Prompts:
    """The training prompts (text, answers for the judge where the data has them, tokens) and the held-out set."""

    texts: list[str]
    answers: list
    tokens: Ragged
    heldout: HeldOut
    seen: HeldOut | None = None  # the first ``eval.seen_prompts`` training prompts, judged as the held-out ones
    sampled: HeldOut | None = None  # each held-out prompt ``eval.sampled_answers`` times, for sampled answers

    @property
    def has_answers(self) -> bool:
        return any(a is not None for a in self.answers)


def load_prompts(params: Params, root: Path, tokenizer) -> Prompts:
    """``prompts.parquet`` and the first ``eval.max_prompts`` of ``eval_prompts.parquet``, tokenised once
    (prepare already cut the prompts; ``encode_prompts`` keeps the one BOS a tokenizer adds)."""
    def encode(texts: list[str]) -> Ragged:
        return encode_prompts(tokenizer, texts, params.data.max_prompt_len)

    train = read_split(root, "prompts", columns=("id", "prompt", "answer"))
    evals = read_split(root, "prompts", eval_split=True, columns=("id", "prompt", "answer"))
    n_eval = min(len(evals["prompt"]), params.eval.max_prompts)
    texts, answers = evals["prompt"][:n_eval], evals["answer"][:n_eval]
    has_answers = any(a is not None for a in train["answer"])
    heldout = HeldOut(texts, answers if has_answers else None, encode(texts))
    n_seen = min(params.eval.seen_prompts, len(train["prompt"]))
    if n_seen and not has_answers:
        raise TrainingInputError(f"eval.seen_prompts: {params.eval.seen_prompts} judges training prompts with the "
                                 f"checker, but {paths.prepared_file('prompts')} has no answers")
    k = params.eval.sampled_answers
    if k and not has_answers:
        raise TrainingInputError(f"eval.sampled_answers: {k} judges sampled answers with the checker, but "
                                 f"{paths.prepared_file('prompts')} has no answers")
    tokens = encode(train["prompt"])
    first = torch.arange(n_seen)
    seen = HeldOut(train["prompt"][:n_seen], train["answer"][:n_seen], tokens.select(first)) if n_seen else None
    sampled = HeldOut(texts, answers, heldout.tokens).repeat_each(k) if k else None
    return Prompts(train["prompt"], train["answer"], tokens, heldout, seen, sampled)


def ptx_keep(scores: torch.Tensor, min_reward: float) -> torch.Tensor:
    """Rows (``[N]`` bool) of the ptx data to keep: ``score >= min_reward`` (``rlhf.ptx_min_reward``)."""
    return scores >= min_reward


@dataclass(frozen=True)
class PtxRows:
    data: SFTData  # the rows of the ptx loss
    dropped: int  # rows the reward model scored below rlhf.ptx_min_reward


def load_ptx(params: Params, root: Path, tokenizer,
             rm_scores: Callable[[list[str], list[str]], torch.Tensor] | None = None) -> PtxRows:
    """The SFT rows of the pretraining-mix loss (``rlhf.ptx_coef``), as ``build_sft_data`` rows. With
    ``rlhf.ptx_min_reward`` set, ``rm_scores(prompts, responses)`` scores every row once and :func:`ptx_keep`
    decides which stay; dropping every row is an error that names the file, the key and the best score."""
    rel = paths.prepared_file("sft")
    sft = read_split(root, "sft", columns=("id", "prompt", "response"))
    n, floor = len(sft["id"]), params.rlhf.ptx_min_reward
    if floor is not None:
        if rm_scores is None:
            raise TrainingInputError("rlhf.ptx_min_reward is set but no reward model scores the ptx rows")
        scores = rm_scores(sft["prompt"], sft["response"])
        keep = ptx_keep(scores, floor)
        if not bool(keep.any()):
            raise TrainingInputError(f"{rel}: rlhf.ptx_min_reward {floor} drops all {n} ptx rows (the reward "
                                     f"model's best score is {float(scores.max()):.3f}); lower it or unset it")
        sft = {k: list(compress(v, keep.tolist())) for k, v in sft.items()}
    max_len = default_max_length(params, params.sft.max_length)
    data = build_sft_data(encode_sequences(tokenizer, sft["prompt"], sft["response"], max_len, str(rel),
                                           "sft.max_length", sft["id"]))
    return PtxRows(data, n - len(sft["id"]))
