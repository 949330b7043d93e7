"""The optimiser sections (``OptimConfig``, ``EpochConfig``) and the stages that pass over a fixed dataset:
``sft`` and ``rm`` (``RMConfig``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rlhf_core.config.base import Section


class OptimConfig(Section):
    lr: float = Field(1e-3, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    warmup_steps: int = Field(10, ge=0)
    max_steps: int = Field(0, ge=0, description="Stop after this many optimizer steps; 0 means all epochs.")
    micro_batch_size: int = Field(32, ge=1)
    grad_accum: int = Field(1, ge=1)
    save_every: int = Field(0, ge=0, description="Checkpoint every N optimizer steps; 0 only at the end.")
    log_every: int = Field(10, ge=1)
    lr_scheduler: Literal["cosine", "linear", "constant"] = Field(
        "cosine", description="LR decay after the linear warmup.")
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0, description="Final LR as a share of `lr` (cosine/linear).")
    resume: bool = Field(True, description="Continue from `checkpoints/<stage>/` when it matches params and data.")
    keep_checkpoints: int = Field(1, ge=1, description="Checkpoints kept per stage (oldest deleted first).")


class EpochConfig(OptimConfig):
    """An optimiser section that passes over a fixed dataset (SFT, RM); RL counts rollout iterations instead."""

    epochs: int = Field(1, ge=1, description="Passes over the training rows.")


class SFTConfig(EpochConfig):
    loss_on_prompt: bool = Field(False, description="Train on prompt tokens too (DeepSpeed-Chat style).")
    packing: bool = Field(False, description="Pack short examples into full-length rows.")
    max_length: int | None = Field(
        None, ge=2, description="Tokens per row (prompt + response + EOS); null: data limits + 2. "
                                "A prompt this long is an error; longer responses are cut and counted.")
    epochs: int = Field(20, ge=1, description="Passes over the SFT rows.")
    save_every: int = Field(100, ge=0, description="Checkpoint every N optimizer steps; 0 only at the end.")


class RMConfig(EpochConfig):
    init_from: Literal["sft", "base"] = Field("sft", description="Initialise the backbone from SFT or base.")
    margin: float = Field(0.0, ge=0.0, description="Margin m in -log sigmoid(r_c - r_r - m).")
    loss: Literal["sequence", "divergence"] = Field(
        "sequence", description="`divergence`: DeepSpeed-Chat's per-token loss after the first divergence.")
    objective: Literal["score_head", "dpo", "process"] = Field(
        "score_head", description="`score_head`: a fresh linear head on the backbone, Bradley-Terry on its scores "
                                  "(a `*ForSequenceClassification` checkpoint). `dpo`: DPO's implicit reward, "
                                  "beta * [log pi(y|x) - log pi_ref(y|x)], pi a LoRA adapter on the init model "
                                  "trained with DPO's loss, pi_ref the init model (the adapter off): the "
                                  "preference read through the LM head (rlhf_core/models/implicit_reward.py). "
                                  "Needs `compute.lora.enabled`, `loss: sequence`, and in feedback rounds "
                                  "`feedback.rm_init: sft`. "
                                  "`process`: a process reward model (Math-Shepherd): the head's value at each "
                                  "step's end, trained with binary cross-entropy on the checker's step labels of "
                                  "the pairs' responses (`data.source: multistep`); its outcome score is the "
                                  "last step's.")
    step_delimiter: str = Field("\n", min_length=1, description="`objective: process`: the text that ends a step "
                                                                 "(one token of the tokenizer); a response's last "
                                                                 "step ends at its last token.")
    beta: float = Field(0.1, gt=0.0, description="`objective: dpo`: the beta of the implicit reward (DPO's "
                                                 "temperature; the reward's scale).")
    rpo_alpha: float = Field(
        0.0, ge=0.0, description="`objective: dpo`: weight of the chosen answers' negative log-likelihood per token "
                                 "added to DPO's loss (RPO, Pang et al. 2024; TRL's `rpo_alpha`, 1.0 in the paper). "
                                 "DPO alone lowers the chosen answers' likelihood with the rejected ones', and its "
                                 "policy, the implicit reward's RL optimum, can answer worse than the init; 0: "
                                 "plain DPO.")
    max_length: int | None = Field(
        None, ge=2, description="Tokens per chosen/rejected row; null: data limits + 2. "
                                "A prompt this long is an error; longer responses are cut and counted.")
    lr: float = Field(1e-3, gt=0.0)
    epochs: int = Field(16, ge=1, description="Passes over the preference pairs.")
    save_every: int = Field(200, ge=0, description="Checkpoint every N optimizer steps; 0 only at the end.")
    ensemble: int = Field(
        1, ge=1, le=16, description="Reward models trained on the same pairs with the same settings, member k with "
                                    "seed `project.seed + k`; the reward (`rlhf.reward_fns: rm`) is then their "
                                    "mean standardised score (docs/rlhf.md). Members 1.. are saved in "
                                    "`models/rm/members/<k>`, listed in `models/rm/ensemble.json`. Costs K times "
                                    "the RM training and the RM scoring in RL.")
    parallel: int = Field(
        0, ge=0, description="RM trainings (the ensemble members, the judge) run at once on a CPU, each in its "
                             "own process with `compute.num_threads` threads; 0: as many as the cores allow "
                             "(cores // num_threads); 1: one after another. A member's weights do not depend on "
                             "it. Always one at a time under a launcher (torchrun) or on a GPU.")
    best_of_n: int = Field(
        0, ge=0, le=64, description="After training, check whether this RM can lift the policy RL starts from by "
                                    "choosing among its own samples: that policy answers each held-out RL prompt "
                                    "(`eval.max_prompts`) n times as RL samples, the RM picks one, the checker "
                                    "judges. metrics/rm.json gets `best_of_n_rm` (the pick's accuracy) beside "
                                    "pass@n, the majority vote, one sample and the greedy answer, for n = 1, 2, 4, "
                                    "..., and `best_of_n_rm_gain`: the pick of the KL-regularised optimum at the RL "
                                    "stage's beta among the greedy answer and the samples, minus greedy "
                                    "(rlhf_core/trainers/rm_selection.py). With `objective: dpo` also "
                                    "`best_of_n_rm_policy`: the implicit reward's own policy read greedily, the "
                                    "optimum of RL at `best_of_n_rm_tilt` k = 1. Needs prompts with answers; costs n "
                                    "rollouts and RM scores of the held-out prompts. 0: off.")
    judge: bool = Field(
        False, description="Also train a judge reward model, same settings, on the held-out pairs (`eval_pairs`, "
                           "never seen by the proxy RM) into `models/judge`; its held-out accuracy is measured on "
                           "the proxy's training pairs. The evaluate stage's judge when prompts carry no answers "
                           "(`eval.judge: auto|model`). Off: `models/judge` holds only its meta file.")

    external: str | None = Field(
        None, description="A reward model of your own instead of training one: a local folder or Hub id of a "
                          "decoder `*ForSequenceClassification` (one label) with its tokenizer. The stage scores "
                          "the held-out pairs with it (`accuracy`) and saves it as `models/rm`; the folder is only "
                          "read (rlhf_core/trainers/rm_external.py). Not with `ensemble` > 1 or another objective.")

    @model_validator(mode="after")
    def _rpo_needs_dpo(self) -> RMConfig:
        if self.rpo_alpha and self.objective != "dpo":
            raise ValueError(f"rpo_alpha {self.rpo_alpha} applies to objective dpo only, not {self.objective}")
        if self.external is not None and (self.ensemble > 1 or self.objective != "score_head"):
            raise ValueError(f"external {self.external!r} is a trained reward model: it takes ensemble 1 and "
                             f"objective score_head, not ensemble {self.ensemble}, objective {self.objective}")
        return self
