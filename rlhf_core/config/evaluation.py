"""``eval`` (the held-out evaluation and its judge) and ``gates`` (what a candidate must beat to be registered)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rlhf_core.config.base import Section


class EvalConfig(Section):
    max_prompts: int = Field(200, ge=1)
    checker: Literal["exact", "final_number"] = Field(
        "exact", description="How the checker judges an answer: `exact` (the completion is exactly the integer: "
                             "the demo), `final_number` (the last integer it states: the arithmetic task, so a "
                             "base model's \"23 + 45 = 68\" counts).")
    max_new_tokens: int = Field(8, ge=1)
    seen_prompts: int = Field(
        0, ge=0, description="RLHF: also judge the first N RL training prompts (`prompts.parquet`) greedily, before "
                             "and after RL: `sft_seen_accuracy` and `seen_accuracy` in metrics/rlhf.json beside the "
                             "held-out `accuracy`. A gain on the prompts RL trained on that the held-out prompts do "
                             "not share is memorisation, not learning. Needs the checker's answers; 0: off.")
    sampled_answers: int = Field(
        0, ge=0, description="RLHF: also judge K answers per held-out prompt, sampled as the rollouts sample "
                             "(`rlhf.temperature`; one torch seed, `project.seed`, for both models), before and "
                             "after RL: `sft_sampled_accuracy` and `sampled_accuracy` in metrics/rlhf.json beside "
                             "the greedy `accuracy`. RL raises the reward of sampled answers; the greedy answer "
                             "changes only where the most likely answer does, so a sampled gain under a flat "
                             "greedy accuracy is RL sharpening what SFT already answers. Needs the checker's "
                             "answers; costs K times the held-out rollouts; 0: off.")
    temperature: float = Field(0.0, ge=0.0, description="0 means greedy decoding.")
    batch_size: int = Field(64, ge=1)
    judge: Literal["auto", "checker", "model", "none"] = Field(
        "auto", description="What scores answers independently of the training reward (the proxy): `checker` "
                            "(exact answers; needs an answer per eval prompt), `model` (the reward model at "
                            "`eval.judge_model`, trained on pairs the proxy never saw), `auto` (checker when "
                            "answers exist, else the judge model when set, else none), `none`.")
    judge_model: str | None = Field(
        None, description="Judge reward model directory (relative to the workspace), for `judge: model|auto`; "
                          "null: `models/judge` when `rm.judge` trained one.")
    table_every: int = Field(
        20, ge=0, description="RLHF: log a table of sampled prompts, responses, proxy reward and judge score "
                              "to MLflow every N iterations (and the last); 0: off.")


class GatesConfig(Section):
    min_reward_gain: float = Field(0.0, description="Candidate mean proxy reward (`rlhf.reward_fns`, what RL "
                                                    "optimised) minus the reference's.")
    min_judge_gain: float = Field(
        0.01, description="Candidate judge score (`eval.judge`: checker accuracy or judge-RM reward) minus the "
                          "reference's. Below it the gate fails whatever the proxy says: reward hacking is a proxy "
                          "that rises while the judge does not.")
    allow_unjudged: bool = Field(
        False, description="Promote a candidate that no judge scored (no checker answers, no `eval.judge_model`, no "
                           "`rm.judge`) on the proxy and the other gates alone. Off: such a candidate is registered "
                           "and refused, since reward hacking cannot be detected without a judge. On: the console "
                           "summary and the model version's `rlhf.gate.judge` tag say it was promoted unjudged.")
    min_win_rate_vs_champion: float = Field(0.5, ge=0.0, le=1.0)
    max_kl: float = Field(5.0, gt=0.0)
    min_accuracy: float = Field(0.0, ge=0.0, le=1.0)
    min_step_accuracy_gain: float = Field(
        0.0, description="Where the task labels steps (`data.source: multistep`): the candidate's held-out step "
                         "accuracy (the share of solution steps right) minus the reference's. A process reward "
                         "that is hacked can raise the proxy and even the final answers while the steps go wrong.")
